"""Tool calling and reasoning in the chat serving layer, driven with a scripted engine (the model output is
given, so every path is forced): tools / tool_choice -> prompt and structured-output constraint, 400s,
tool_calls and reasoning_content whole and streamed (parsed with the `openai` package's own types)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from pagedllm.entrypoints.chat_utils import load_chat_template  # noqa: E402
from pagedllm.entrypoints.openai.chat_parsing import AUTO_NEEDS_FLAGS, ChatOutputParsing  # noqa: E402
from pagedllm.entrypoints.openai.errors import OpenAIServingError  # noqa: E402
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest  # noqa: E402
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat  # noqa: E402
from pagedllm.entrypoints.openai.streaming import SSEStream  # noqa: E402
from pagedllm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from pagedllm.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

HERMES_TEMPLATE = str(Path(__file__).parents[3] / "examples" / "tool_chat_template_hermes.jinja")
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather", "parameters": WEATHER_PARAMS},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


class ScriptedEngine:
    """The parts of AsyncLLM the chat handler uses; every request "generates" `self.output`, token by token
    (DELTA) or at once (FINAL_ONLY), tokenized with the real tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.model_config = SimpleNamespace(max_model_len=4096, vocab_size=len(tokenizer))
        self.errored = False
        self.output = ""
        self.prompts: list[Any] = []
        self.params: list[SamplingParams] = []

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> dict[str, Any]:
        return {}

    async def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def run_in_worker(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    async def add_request(self, rid: str, prompt: Any, sp: SamplingParams, **_: Any) -> str:
        self.prompts.append(prompt)
        self.params.append(sp)
        return rid

    async def stream_outputs(self, rid: str, _: Any) -> AsyncIterator[RequestOutput]:
        sp = self.params[-1]
        ids = self.tokenizer.encode(self.output, add_special_tokens=False)
        if sp.output_kind == RequestOutputKind.FINAL_ONLY:
            yield RequestOutput(rid, None, [], [CompletionOutput(0, self.output, ids, finish_reason="stop")], True)
            return
        prev = ""
        for k in range(len(ids)):
            text = self.tokenizer.decode(ids[: k + 1])
            last = k == len(ids) - 1
            out = CompletionOutput(0, text[len(prev) :], ids[k : k + 1], finish_reason="stop" if last else None)
            prev = text
            yield RequestOutput(rid, None, [], [out], last)


def make_chat(tokenizer: Any, **parsing: Any) -> tuple[OpenAIServingChat, ScriptedEngine]:
    engine = ScriptedEngine(tokenizer)
    chat = OpenAIServingChat(engine, ["m"], load_chat_template(HERMES_TEMPLATE))  # type: ignore[arg-type]
    chat.parsing = ChatOutputParsing(tokenizer, **parsing)
    return chat, engine


def run(chat: OpenAIServingChat, body: dict[str, Any]) -> ChatCompletion | list[ChatCompletionChunk]:
    async def go() -> Any:
        res = await chat.create_chat_completion(ChatCompletionRequest.model_validate(body))
        if isinstance(res, SSEStream):
            chunks = []
            async for s in res.iterator:
                data = s.removeprefix("data: ").strip()
                if data != "[DONE]":
                    chunks.append(ChatCompletionChunk.model_validate_json(data))
            return chunks
        return ChatCompletion.model_validate_json(res.model_dump_json())

    return asyncio.run(go())


def accumulate(chunks: list[ChatCompletionChunk]) -> dict[str, Any]:
    """Reassemble a stream as a client does: content, reasoning and tool calls (merged by index)."""
    content, reasoning, finish = "", "", None
    calls: dict[int, dict[str, Any]] = {}
    for c in chunks:
        for ch in c.choices:
            d = ch.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.type == "function" and tc.function and tc.function.name
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                calls[tc.index]["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = ch.finish_reason or finish
    return {"content": content, "reasoning": reasoning, "calls": [calls[i] for i in sorted(calls)], "finish": finish}


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer: Any) -> Any:
    return smollm2_tokenizer


def test_tools_reach_the_template_and_none_is_not_parsed(tok: Any) -> None:
    chat, engine = make_chat(tok)
    engine.output = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    res = run(chat, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"})
    prompt = engine.prompts[-1]["prompt"]
    assert '"name": "get_weather"' in prompt and "Current weather" in prompt and '"enum": ["celsius"' in prompt
    assert engine.params[-1].structured_outputs is None
    assert isinstance(res, ChatCompletion)
    assert res.choices[0].message.content == engine.output and not res.choices[0].message.tool_calls
    assert res.choices[0].finish_reason == "stop"


def test_named_tool_choice(tok: Any) -> None:
    chat, engine = make_chat(tok)
    body = {
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    engine.output = '{"city": "Paris", "unit": "celsius"}'
    res = run(chat, body)
    so = engine.params[-1].structured_outputs
    assert so is not None and json.loads(so.json) == WEATHER_PARAMS  # type: ignore[arg-type] # the engine constrains the output to the tool's schema
    assert isinstance(res, ChatCompletion)
    (call,) = res.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Paris",
        "unit": "celsius",
    }
    assert call.id.startswith("chatcmpl-tool-") and res.choices[0].finish_reason == "tool_calls"
    streamed = accumulate(run(chat, {**body, "stream": True}))  # type: ignore[arg-type]
    assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == [("get_weather", call.function.arguments)]
    assert streamed["finish"] == "tool_calls" and streamed["content"] == ""


def test_required_tool_choice_schema(tok: Any) -> None:
    chat, engine = make_chat(tok)
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}
    engine.output = json.dumps(
        [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]
    )
    res = run(chat, body)
    so = engine.params[-1].structured_outputs
    assert so is not None and isinstance(so.json, str)
    validator = jsonschema.Draft202012Validator(json.loads(so.json))
    validator.validate(json.loads(engine.output))
    for bad in (
        [],
        [{"name": "get_weather", "parameters": {}}],  # missing required city
        [{"name": "get_weather", "parameters": {"city": 3}}],
        [{"name": "send_email", "parameters": {}}],
        [{"name": "get_time"}],
        {"name": "get_time", "parameters": {}},
    ):
        assert not validator.is_valid(bad), bad
    assert isinstance(res, ChatCompletion)
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in res.choices[0].message.tool_calls or []]
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert res.choices[0].finish_reason == "tool_calls"
    streamed = accumulate(run(chat, {**body, "stream": True}))  # type: ignore[arg-type]
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"]] == calls
    # parallel_tool_calls=false: the schema allows one call only
    run(chat, {**body, "parallel_tool_calls": False})
    one = jsonschema.Draft202012Validator(json.loads(engine.params[-1].structured_outputs.json))  # type: ignore[union-attr,arg-type]
    assert not one.is_valid(json.loads(engine.output)) and one.is_valid(json.loads(engine.output)[:1])


HERMES_OUTPUT = (
    "Let me look that up.\n<tool_call>\n"
    + json.dumps({"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}})
    + "\n</tool_call>\n<tool_call>\n"
    + json.dumps({"name": "get_time", "arguments": {}})
    + "\n</tool_call>"
)


def test_auto_hermes_whole_and_streamed(tok: Any) -> None:
    chat, engine = make_chat(tok, tool_call_parser="hermes", enable_auto_tools=True)
    engine.output = HERMES_OUTPUT
    for tool_choice in ("auto", None):  # tools without tool_choice: auto, as vLLM
        body: dict[str, Any] = {"messages": MESSAGES, "tools": TOOLS}
        if tool_choice is not None:
            body["tool_choice"] = tool_choice
        res = run(chat, body)
        assert isinstance(res, ChatCompletion)
        assert engine.params[-1].structured_outputs is None
        msg = res.choices[0].message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]
        assert calls == [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})]
        assert msg.content == "Let me look that up.\n" and res.choices[0].finish_reason == "tool_calls"
        chunks = run(chat, {**body, "stream": True})
        assert isinstance(chunks, list)
        streamed = accumulate(chunks)
        assert streamed["content"] == msg.content
        assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == [
            (c.function.name, c.function.arguments) for c in msg.tool_calls or []
        ]
        assert streamed["finish"] == "tool_calls"
        # the arguments arrive in fragments as they are generated
        assert (
            sum(
                1
                for c in chunks
                for ch in c.choices
                for tc in ch.delta.tool_calls or []
                if tc.function and tc.function.arguments
            )
            > 3
        )
    # plain text under auto: content, finish_reason stop
    engine.output = "It is sunny in Paris."
    res = run(chat, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto"})
    assert isinstance(res, ChatCompletion)
    assert res.choices[0].message.content == engine.output and not res.choices[0].message.tool_calls
    assert res.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "body,parsing,message",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, {}, "not among"),
        ({"tool_choice": "auto", "tools": TOOLS}, {}, AUTO_NEEDS_FLAGS),
        ({"tools": TOOLS}, {}, AUTO_NEEDS_FLAGS),
        ({"tool_choice": "required"}, {}, "`tools` must be set"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, {}, "`tools` must be set"),
        ({"tool_choice": "auto"}, {"tool_call_parser": "hermes", "enable_auto_tools": True}, "`tools` must be set"),
    ],
)
def test_bad_tool_choice_is_400(tok: Any, body: dict[str, Any], parsing: dict[str, Any], message: str) -> None:
    chat, engine = make_chat(tok, **parsing)
    with pytest.raises(OpenAIServingError) as info:
        run(chat, {"messages": MESSAGES, **body})
    assert info.value.status == 400 and info.value.param == "tool_choice" and message in info.value.message
    assert engine.params == []  # refused before anything was queued


@pytest.mark.parametrize(
    "tools",
    [
        [{"type": "function", "function": {"description": "no name"}}],
        [{"type": "function", "function": {"name": ""}}],
        [{"type": "function", "function": {"name": "f", "parameters": "not an object"}}],
        [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
        [{"type": "retrieval", "function": {"name": "f"}}],
        [{"type": "function"}],
        {"type": "function", "function": {"name": "f"}},
    ],
)
def test_malformed_tools_are_rejected(tools: Any) -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": tools})
    assert "tools" in str(info.value)


def test_server_flags_are_checked() -> None:
    with pytest.raises(ValueError, match="enable_auto_tool_choice"):
        ChatOutputParsing(None, enable_auto_tools=True)
    with pytest.raises(ValueError, match="tool_call_parser"):
        ChatOutputParsing(None, tool_call_parser="nope", enable_auto_tools=True)
    with pytest.raises(ValueError, match="reasoning_parser"):
        ChatOutputParsing(None, reasoning_parser="nope")


class ThinkTok:
    """A tokenizer stub with think tags: ids only matter for prompt_opens_reasoning."""

    def get_vocab(self) -> dict[str, int]:
        return {"<think>": 10, "</think>": 11}


@pytest.mark.parametrize("prompt_ids", [[1, 2], [1, 10]])
def test_reasoning_then_tool_calls(prompt_ids: list[int]) -> None:
    """With both parsers the tool parser reads the content after the reasoning, whole and streamed."""
    parsing = ChatOutputParsing(ThinkTok(), reasoning_parser="qwen3", tool_call_parser="hermes", enable_auto_tools=True)
    req = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": TOOLS})
    rp = parsing.prepare(req)
    opened = prompt_ids[-1] == 10  # the template opened <think>: the output has no start tag
    text = ("" if opened else "<think>") + "The user wants <tool_call> weather.</think>\n\n" + HERMES_OUTPUT
    msg = parsing.message(req, rp, text, prompt_ids)
    assert msg.reasoning_content == msg.reasoning == "The user wants <tool_call> weather."
    assert msg.content == "\n\nLet me look that up.\n"
    assert [c.function.name for c in msg.tool_calls] == ["get_weather", "get_time"]
    for step in (1, 3, 7):
        cs = parsing.stream(req, rp, prompt_ids)
        reasoning, content, calls = "", "", {}
        pieces = [text[i : i + step] for i in range(0, len(text), step)]
        for k, p in enumerate(pieces):
            d = cs.feed(p, [], k == len(pieces) - 1)
            if d is None:
                continue
            reasoning += d.reasoning_content or ""
            content += d.content or ""
            for tc in d.tool_calls:
                calls.setdefault(tc.index, [None, ""])
                calls[tc.index][0] = calls[tc.index][0] or (tc.function.name if tc.function else None)
                calls[tc.index][1] += (tc.function.arguments or "") if tc.function else ""
        assert (reasoning, content) == (msg.reasoning_content, msg.content)
        assert [tuple(calls[i]) for i in sorted(calls)] == [
            (c.function.name, c.function.arguments) for c in msg.tool_calls
        ]
        assert cs.tools_called
