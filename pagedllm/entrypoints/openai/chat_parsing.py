"""Tool calling and reasoning output of /v1/chat/completions.

`ChatOutputParsing` (one per server) checks a request's `tools` / `tool_choice` and maps them to what the
engine must do: `named` -> the tool's parameters schema as a structured-output constraint, `required` ->
a JSON array of {name, parameters} calls (anyOf over the tools, at least one), `auto` -> the server's
`--tool-call-parser` reads the text. It then turns generated text into `reasoning_content` (the
`--reasoning-parser`), `content` and `tool_calls`, whole (`message`) or streamed (`ChoiceStream`, one per
choice). With both, the tool parser reads only the content after the reasoning.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.errors import OpenAIServingError
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ToolCall,
)
from pagedllm.entrypoints.openai.tool_parsers import (
    ExtractedToolCallInformation,
    PartialParse,
    PartialToolCall,
    ToolParser,
    get_tool_parser,
)
from pagedllm.entrypoints.openai.tool_parsers.abstract import extract_safely, make_tool_call
from pagedllm.reasoning import ReasoningParser, get_reasoning_parser
from pagedllm.sampling_params import StructuredOutputsParams

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
EMPTY_OBJECT_SCHEMA: dict[str, Any] = {"type": "object", "properties": {}}


def required_tools_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """The schema `tool_choice: "required"` constrains the output to (as vLLM): a non-empty JSON array of
    {"name": one of the tools, "parameters": that tool's arguments}."""
    items = [
        {
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": t["function"].get("parameters") or EMPTY_OBJECT_SCHEMA,
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class RequiredToolCalls(ToolParser):
    """The output of `tool_choice: "required"`: the JSON array of `required_tools_schema`. Streamed call by
    call (each once its element is complete)."""

    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest | None
    ) -> ExtractedToolCallInformation:
        try:
            items = json.loads(model_output)
            if not isinstance(items, list) or not items:
                raise ValueError("not a list")
            calls = [make_tool_call(_name(it), it["parameters"]) for it in items]
        except (ValueError, KeyError, TypeError):
            return ExtractedToolCallInformation(False, content=model_output)
        return ExtractedToolCallInformation(True, calls, None)

    def parse_partial(self, text: str) -> PartialParse:
        res = PartialParse()
        i = len(text) - len(text.lstrip())
        if not text.startswith("[", i):
            return res
        dec = json.JSONDecoder()
        i += 1
        while True:
            i += len(text[i:]) - len(text[i:].lstrip(" \t\n\r,"))
            try:
                it, i = dec.raw_decode(text, i)
                res.calls.append(PartialToolCall(_name(it), json.dumps(it["parameters"], ensure_ascii=False)))
            except (ValueError, KeyError, TypeError):
                return res


def _name(item: Any) -> str:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise ValueError("not a call")
    return item["name"]


@dataclass
class RequestParsing:
    """What one request asks for: `mode` none | auto | named | required."""

    mode: str = "none"
    named: str | None = None
    tools: list[dict[str, Any]] | None = None
    """The tool definitions for the chat template."""
    structured_outputs: StructuredOutputsParams | None = None
    parallel: bool = True


def check_parser_args(tool_call_parser: str | None, enable_auto_tool_choice: bool) -> None:
    """The server's tool-calling flags, checked before the model loads (ValueError naming the flag)."""
    if enable_auto_tool_choice and not tool_call_parser:
        raise ValueError("enable_auto_tool_choice: requires --tool-call-parser")
    if tool_call_parser is not None:
        get_tool_parser(tool_call_parser)


class ChatOutputParsing:
    def __init__(
        self,
        tokenizer: Any,
        reasoning_parser: str | None = None,
        tool_call_parser: str | None = None,
        enable_auto_tools: bool = False,
    ) -> None:
        check_parser_args(tool_call_parser, enable_auto_tools)
        self.tokenizer = tokenizer
        self.tool_parser_cls: type[ToolParser] | None = get_tool_parser(tool_call_parser) if tool_call_parser else None
        self.enable_auto_tools = enable_auto_tools
        self.reasoning: ReasoningParser | None = (
            get_reasoning_parser(reasoning_parser)(tokenizer) if reasoning_parser else None
        )

    # ---- request ---------------------------------------------------------------------------------------
    def prepare(self, req: ChatCompletionRequest) -> RequestParsing:
        """Validate `tools` / `tool_choice` (400 naming the field) and adjust `req` for the tool parser."""
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        choice = req.tool_choice
        if choice is None:
            choice = "auto" if tools else "none"
        elif choice != "none" and not tools:
            raise OpenAIServingError("tool_choice: when using `tool_choice`, `tools` must be set", 400, "tool_choice")
        parallel = req.parallel_tool_calls is not False
        res = RequestParsing(tools=tools, parallel=parallel)
        # Schemas go to the engine as JSON text: a client's schema may hold values (integers beyond 64 bits)
        # that the engine's msgpack transport cannot carry as objects.
        if isinstance(choice, ChatCompletionNamedToolChoiceParam):
            name = choice.function.name
            tool = next((t for t in tools or [] if t["function"]["name"] == name), None)
            if tool is None:
                raise OpenAIServingError(
                    f"tool_choice: the function {name!r} is not among the request's tools", 400, "tool_choice"
                )
            res.mode, res.named = "named", name
            res.structured_outputs = StructuredOutputsParams(
                json=json.dumps(tool["function"].get("parameters") or EMPTY_OBJECT_SCHEMA)
            )
        elif choice == "required":
            res.mode = "required"
            res.structured_outputs = StructuredOutputsParams(
                json=json.dumps(required_tools_schema(tools or [], parallel))
            )
        elif choice == "auto":
            if not (self.enable_auto_tools and self.tool_parser_cls is not None):
                raise OpenAIServingError(f"tool_choice: {AUTO_NEEDS_FLAGS}", 400, "tool_choice")
            res.mode = "auto"
            self.tool_parser_cls(self.tokenizer).adjust_request(req)
        return res

    def active(self, rp: RequestParsing) -> bool:
        return self.reasoning is not None or rp.mode != "none"

    def _tool_parser(self, rp: RequestParsing) -> ToolParser | None:
        if rp.mode == "auto":
            assert self.tool_parser_cls is not None
            return self.tool_parser_cls(self.tokenizer)
        if rp.mode == "required":
            return RequiredToolCalls(self.tokenizer)
        return None

    def _reasoning_prefix(self, prompt_token_ids: Sequence[int]) -> str:
        r = self.reasoning
        if r is not None and r.prompt_opens_reasoning(prompt_token_ids):
            return str(getattr(r, "start_token", ""))
        return ""

    # ---- whole outputs ---------------------------------------------------------------------------------
    def message(
        self, req: ChatCompletionRequest, rp: RequestParsing, text: str, prompt_token_ids: Sequence[int]
    ) -> ChatMessage:
        reasoning: str | None = None
        content: str | None = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract_reasoning(self._reasoning_prefix(prompt_token_ids) + text)
        calls: list[ToolCall] = []
        if rp.mode == "named" and rp.named is not None:
            calls = [make_tool_call(rp.named, content or "")]
            content = None
        else:
            parser = self._tool_parser(rp)
            if parser is not None:
                info = extract_safely(parser, content or "", req)
                if info.tools_called:
                    calls = info.tool_calls if rp.parallel else info.tool_calls[:1]
                    content = info.content
        return ChatMessage(
            role="assistant", content=content, reasoning_content=reasoning, reasoning=reasoning, tool_calls=calls
        )

    def stream(self, req: ChatCompletionRequest, rp: RequestParsing, prompt_token_ids: Sequence[int]) -> ChoiceStream:
        return ChoiceStream(self, req, rp, self._reasoning_prefix(prompt_token_ids))


class ChoiceStream:
    """The parsing state of one streamed choice: text deltas in, DeltaMessages out."""

    def __init__(self, parsing: ChatOutputParsing, req: ChatCompletionRequest, rp: RequestParsing, prefix: str):
        self.req = req
        self.rp = rp
        self.reasoning = parsing.reasoning
        self.tools = parsing._tool_parser(rp)
        self.text = prefix
        self.ids: list[int] = []
        if prefix and self.reasoning is not None:
            sid = getattr(self.reasoning, "start_token_id", None)
            self.ids = [sid] if isinstance(sid, int) else []
        self.sent_reasoning = ""
        self.content = ""  # the content so far (after the reasoning)
        self.named_id: str | None = None
        self.tools_called = False

    def feed(self, delta_text: str, delta_ids: Sequence[int], finished: bool) -> DeltaMessage | None:
        prev_text, prev_ids = self.text, self.ids
        self.text = prev_text + delta_text
        self.ids = prev_ids + list(delta_ids)
        reasoning: str | None = None
        content_delta: str | None = delta_text
        if self.reasoning is not None:
            d = self.reasoning.extract_reasoning_streaming(
                prev_text, self.text, delta_text, prev_ids, self.ids, list(delta_ids)
            )
            reasoning, content_delta = (d.reasoning, d.content) if d is not None else (None, None)
            if finished:
                reasoning, content_delta = self._flush_reasoning(reasoning, content_delta)
            self.sent_reasoning += reasoning or ""
        self.content += content_delta or ""
        out = self._tools_delta(content_delta, finished)
        if reasoning:
            out = out or DeltaMessage()
            out.reasoning_content = out.reasoning = reasoning
        return out

    def _flush_reasoning(self, reasoning: str | None, content: str | None) -> tuple[str | None, str | None]:
        """At the end: what the whole-output split still has beyond what was streamed (a held-back partial
        tag), when the streamed parts are prefixes of it."""
        assert self.reasoning is not None
        sent_r = self.sent_reasoning + (reasoning or "")
        sent_c = self.content + (content or "")
        final_r, final_c = self.reasoning.extract_reasoning(self.text)
        final_r, final_c = final_r or "", final_c or ""
        if final_r.startswith(sent_r) and final_c.startswith(sent_c):
            reasoning = (reasoning or "") + final_r[len(sent_r) :] or None
            content = (content or "") + final_c[len(sent_c) :] or None
        return reasoning, content

    def _tools_delta(self, content_delta: str | None, finished: bool) -> DeltaMessage | None:
        if self.rp.mode == "named" and self.rp.named is not None:
            if not content_delta:
                return None
            entries = []
            if self.named_id is None:
                self.named_id = make_tool_call(self.rp.named, "").id
                self.tools_called = True
                fn = DeltaFunctionCall(name=self.rp.named, arguments="")
                entries.append(DeltaToolCall(index=0, id=self.named_id, type="function", function=fn))
            entries.append(DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=content_delta)))
            return DeltaMessage(tool_calls=entries)
        if self.tools is None:
            return DeltaMessage(content=content_delta) if content_delta else None
        out = self.tools.extract_tool_calls_streaming("", self.content, content_delta or "", [], [], [], self.req)
        if finished:
            rest = self.tools.finish_streaming(self.content, self.req)
            if rest is not None:
                out = rest if out is None else _merge(out, rest)
        if out is not None and not self.rp.parallel:
            out.tool_calls = [tc for tc in out.tool_calls if tc.index == 0]
            if out.content is None and not out.tool_calls:
                out = None
        self.tools_called = self.tools.tools_called_streaming
        return out


def _merge(a: DeltaMessage, b: DeltaMessage) -> DeltaMessage:
    content = (a.content or "") + (b.content or "") or None
    return DeltaMessage(content=content, tool_calls=a.tool_calls + b.tool_calls)
