"""Each tool parser over model-style outputs: plain text, one call, several calls, malformed calls (all
content, never an exception); streamed deltas (token by token and in random chunks) add up to the
non-streamed message."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser, tool_parser_names
from pagedllm.entrypoints.openai.tool_parsers.abstract import extract_safely
from pagedllm.entrypoints.openai.tool_parsers.json_stream import canonical_json_prefix

WEATHER = {"city": "Paris", "unit": "celsius"}
SEARCH = {"query": 'caf\u00e9 "le coin"\n', "limit": 5, "score": 0.5, "tags": ["a", None, True], "nested": {}}

# (parser, output, expected calls as (name, arguments object) or None for plain content, expected content)
CASES: list[tuple[str, str, list[tuple[str, Any]] | None, str | None]] = [
    ("hermes", "The weather is nice today.", None, "The weather is nice today."),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
        [("get_weather", WEATHER)],
        None,
    ),
    (
        "hermes",
        "Let me check.\n<tool_call>\n"
        + json.dumps({"name": "get_weather", "arguments": WEATHER})
        + "\n</tool_call>\n<tool_call>\n"
        + json.dumps({"name": "search", "arguments": SEARCH}, indent=1)
        + "\n</tool_call>",
        [("get_weather", WEATHER), ("search", SEARCH)],
        "Let me check.\n",
    ),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>', None, "*"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1}}', [("f", {"x": 1})], None),  # stopped at the tag
    ("hermes", "I use <tool_ to write less-than signs: 1 < 2", None, "*"),
    ("llama3_json", "Paris is the capital of France.", None, "*"),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        [("get_weather", WEATHER)],
        None,
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": '
        + json.dumps(WEATHER)
        + '}; {"name": "search", "arguments": '
        + json.dumps(SEARCH, ensure_ascii=False)
        + "}",
        [("get_weather", WEATHER), ("search", SEARCH)],
        None,
    ),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"', None, "*"),
    ("llama3_json", '{"nam": "x"} and more', None, "*"),
    ("mistral", "Bonjour ! Comment puis-je aider ?", None, "*"),
    (
        "mistral",
        "[TOOL_CALLS] [" + json.dumps({"name": "get_weather", "arguments": WEATHER}) + "]",
        [("get_weather", WEATHER)],
        None,
    ),
    (
        "mistral",
        "Sure. [TOOL_CALLS]["
        + json.dumps({"name": "get_weather", "arguments": WEATHER})
        + ", "
        + json.dumps({"name": "search", "arguments": SEARCH})
        + "]",
        [("get_weather", WEATHER), ("search", SEARCH)],
        "Sure. ",
    ),
    (
        "mistral",
        "[TOOL_CALLS]get_weather[ARGS]" + json.dumps(WEATHER) + "[TOOL_CALLS]search[ARGS]" + json.dumps(SEARCH),
        [("get_weather", WEATHER), ("search", SEARCH)],
        None,
    ),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": }]', None, "*"),
    ("pythonic", "The answer is [1, 2, 3].", None, "*"),
    ("pythonic", '[get_weather(city="Paris", unit="celsius")]', [("get_weather", WEATHER)], None),
    (
        "pythonic",
        "[get_weather(city='Paris', unit='celsius'), search(query='caf\u00e9 \"le coin\"\\n', limit=5, score=0.5, "
        "tags=['a', None, True], nested={})]",
        [("get_weather", WEATHER), ("search", SEARCH)],
        None,
    ),
    (
        "pythonic",
        "<|python_start|>[get_weather(city='Paris', unit='celsius')]<|python_end|>",
        [("get_weather", WEATHER)],
        None,
    ),
    ("pythonic", "[get_weather(city=Paris)]", None, "*"),  # not a literal
    ("pythonic", "[get_weather('Paris')]", None, "*"),  # positional
]


def _ids(case: tuple[Any, ...]) -> str:
    return f"{case[0]}-{CASES.index(case)}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_extract(case: tuple[str, str, list[tuple[str, Any]] | None, str | None]) -> None:
    name, text, calls, content = case
    info = get_tool_parser(name)(None).extract_tool_calls(text, None)
    if calls is None:
        assert not info.tools_called and info.tool_calls == []
        assert info.content == (text if content == "*" else content)
        return
    assert info.tools_called
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == calls
    for c in info.tool_calls:
        assert c.type == "function"
        want = "^[A-Za-z0-9]{9}$" if name == "mistral" else "^chatcmpl-tool-[0-9a-f]{32}$"
        assert __import__("re").match(want, c.id)
    assert len({c.id for c in info.tool_calls}) == len(info.tool_calls)
    assert info.content == content


def stream(name: str, text: str, pieces: list[str]) -> tuple[str, list[dict[str, Any]], list[Any]]:
    """Feed `pieces` (which concatenate to `text`) to a fresh parser; reassemble as an OpenAI client does."""
    parser = get_tool_parser(name)(None)
    deltas = []
    prev = ""
    for p in pieces:
        cur = prev + p
        d = parser.extract_tool_calls_streaming(prev, cur, p, [], [], [], None)
        prev = cur
        if d is not None:
            deltas.append(d)
    d = parser.finish_streaming(text, None)
    if d is not None:
        deltas.append(d)
    content = "".join(d.content or "" for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for tc in d.tool_calls:
            if tc.index not in calls:
                # the first delta of a call carries its id, type and name
                assert tc.id and tc.type == "function" and tc.function and tc.function.name, tc
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and tc.function is not None and tc.function.name is None, tc
            calls[tc.index]["arguments"] += tc.function.arguments or "" if tc.function else ""
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)], deltas


def chunkings(text: str, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    out = [list(text)]  # character by character: finer than any tokenizer
    for _ in range(3):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        out.append([text[a:b] for a, b in zip(bounds, bounds[1:])])
    return out


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_streaming_reassembles_to_extract(case: tuple[str, str, list[tuple[str, Any]] | None, str | None]) -> None:
    name, text, expected, _ = case
    info = get_tool_parser(name)(None).extract_tool_calls(text, None)
    for i, pieces in enumerate(chunkings(text, seed=len(text))):
        content, calls, deltas = stream(name, text, pieces)
        assert content == (info.content or ""), (i, pieces)
        if expected is None and calls:
            # A call that turns out malformed after its start was streamed cannot be taken back (as in vLLM);
            # its whole text still arrives as content.
            assert text.find(calls[0]["name"]) >= 0
            continue
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in info.tool_calls
        ], (i, pieces)


def test_arguments_stream_in_fragments() -> None:
    """A long hermes call streams its arguments as they are generated, not all at the end."""
    text = '<tool_call>\n{"name": "search", "arguments": ' + json.dumps(SEARCH) + "}\n</tool_call>"
    _, calls, deltas = stream("hermes", text, list(text))
    fragments = [tc for d in deltas for tc in d.tool_calls if tc.function and tc.function.arguments]
    assert len(fragments) > 10
    assert calls[0]["arguments"] == json.dumps(SEARCH, ensure_ascii=False)


def test_content_is_held_only_while_it_may_start_a_marker() -> None:
    parser = get_tool_parser("hermes")(None)
    d = parser.extract_tool_calls_streaming("", "Hello <tool", "Hello <tool", [], [], [], None)
    assert d is not None and d.content == "Hello "
    d = parser.extract_tool_calls_streaming("Hello <tool", "Hello <tools are", " are", [], [], [], None)
    assert d is not None and d.content == "<tools are"


@pytest.mark.parametrize(
    "value",
    [WEATHER, SEARCH, [], {}, [1.0, -2e-3, 1e20, "\ud83d\ude00", "\\", "/", "\t"], {"a": {"b": [[], [{}]]}}],
)
def test_canonical_json_prefix(value: Any) -> None:
    for raw in (
        json.dumps(value),
        json.dumps(value, indent=2),
        json.dumps(value, ensure_ascii=False, separators=(",", ":")),
    ):
        final = json.dumps(json.loads(raw), ensure_ascii=False)
        for k in range(len(raw)):
            prefix, end = canonical_json_prefix(raw[:k])
            assert final.startswith(prefix) and end is None, (raw[:k], prefix)
        assert canonical_json_prefix(raw + " tail") == (final, len(raw))


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "pythonic"])
def test_deeply_nested_output_is_content(name: str) -> None:
    """JSON (or Python) nested deeper than the parsers' recursion: content, never an exception."""
    deep = "[" * 20000
    text = {
        "hermes": '<tool_call>{"name": "f", "arguments": ' + deep,
        "llama3_json": '{"name": "f", "arguments": ' + deep,
        "mistral": "[TOOL_CALLS] [" + deep,
        "pythonic": "[f(a=" + deep,
    }[name]
    info = extract_safely(get_tool_parser(name)(None), text, None)
    assert not info.tools_called and info.content == text
    content, _, _ = stream(name, text, [text[i : i + 500] for i in range(0, len(text), 500)])
    assert content == text


def test_registry() -> None:
    assert tool_parser_names() == ["hermes", "llama3_json", "mistral", "pythonic"]
    with pytest.raises(ValueError, match="tool_call_parser"):
        get_tool_parser("nope")


_PIECES = [
    "<tool_call>",
    "</tool_call>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "<|python_tag|>",
    '{"name": "f"',
    ', "arguments": ',
    '{"a": 1}',
    "}",
    "[",
    "]",
    "(",
    ")",
    "f(a=1)",
    ",",
    ";",
    '"',
    "\\",
    "\\u12",
    "x",
    " ",
    "\n",
    "1e5",
    "\ud83d",
]


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "pythonic"])
def test_any_text_parses_without_error(name: str) -> None:
    """Never an exception, whatever the model writes; streamed content matches the whole-output content
    whenever no call was found."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=150, deadline=None, database=None)
    @given(st.lists(st.sampled_from(_PIECES) | st.text(max_size=3), max_size=14), st.integers(1, 5))
    def check(parts: list[str], step: int) -> None:
        text = "".join(parts)
        info = get_tool_parser(name)(None).extract_tool_calls(text, None)
        for c in info.tool_calls:
            json.loads(c.function.arguments)
        content, calls, _ = stream(name, text, [text[i : i + step] for i in range(0, len(text), step)])
        assert content == (info.content or "")
        if info.tools_called:
            assert [c["arguments"] for c in calls] == [c.function.arguments for c in info.tool_calls]

    check()
