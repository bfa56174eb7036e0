"""The tool-parser interface, its name registry, and the streaming logic all parsers share.

A parser turns model text into OpenAI `tool_calls`. Each one implements two things:
- `extract_tool_calls(text)`: the whole output -> content and calls (malformed calls: all of it is content);
- `parse_partial(text)`: what a prefix of the output already settles: the content that can be sent
  (a possible start of a tool-call marker is held back) and the calls begun so far, each with its name
  once known and the certain prefix of its final `arguments` string.
Streaming (`extract_tool_calls_streaming`, `finish_streaming`) is the same for all parsers: it sends
what `parse_partial` adds since the last delta, and at the end whatever the non-streamed result still
has beyond that, so the deltas always add up to the non-streamed message. One instance per request.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    random_uuid,
)
from pagedllm.entrypoints.openai.tool_parsers.json_stream import canonical_json_prefix
from pagedllm.utils import PluginRegistry


@dataclass
class ExtractedToolCallInformation:
    tools_called: bool
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: str | None = None


@dataclass
class PartialToolCall:
    name: str | None
    """None until the whole name has been generated."""
    arguments: str = ""
    """The part of the final `arguments` string that is already certain."""


@dataclass
class PartialParse:
    content: str = ""
    calls: list[PartialToolCall] = field(default_factory=list)


PARSE_ERRORS = (ValueError, TypeError, KeyError, RecursionError, MemoryError)
"""What parsing model text may raise (deeply nested JSON is a RecursionError): the text is then content."""


def extract_safely(
    parser: ToolParser, text: str, request: ChatCompletionRequest | None
) -> ExtractedToolCallInformation:
    """`parser.extract_tool_calls`, with any parsing failure turning the whole text into content."""
    try:
        return parser.extract_tool_calls(text, request)
    except PARSE_ERRORS:
        return ExtractedToolCallInformation(False, content=text)


def make_tool_call(name: str, arguments: Any, call_id: str | None = None) -> ToolCall:
    """A ToolCall whose arguments are `json.dumps(arguments)` (a str is taken as JSON text already)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    fc = FunctionCall(name=name, arguments=args)
    return ToolCall(id=call_id, function=fc) if call_id is not None else ToolCall(function=fc)


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (it may become one)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def content_before(text: str, marker: str) -> tuple[str, int]:
    """(content that can be sent, index of the marker or -1): the text before `marker`, or while it has not
    appeared, all but a suffix that may be its beginning."""
    idx = text.find(marker)
    if idx >= 0:
        return text[:idx], idx
    return text[: len(text) - held_back(text, marker)], -1


_NAME_THEN_ARGS = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(arguments|parameters)"\s*:')


def partial_json_call(text: str, start: int = 0) -> tuple[PartialToolCall | None, int | None]:
    """A `{"name": ..., "arguments"|"parameters": {...}}` object starting at `text[start]`, complete or not:
    (the call so far or None if not even the name is known, index after the object when complete).
    A complete object must parse as JSON with a string name; otherwise (None, None)."""
    try:
        obj, end = json.JSONDecoder().raw_decode(text, _skip_ws(text, start))
    except ValueError:
        obj, end = None, None
    if end is not None:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None, None
        args = obj.get("arguments", obj.get("parameters", {}))
        return PartialToolCall(obj["name"], json.dumps(args, ensure_ascii=False)), end
    m = _NAME_THEN_ARGS.match(text, start)
    if m is None:
        return None, None
    try:
        name = json.loads(f'"{m.group(1)}"')
    except ValueError:
        return None, None
    args, _ = canonical_json_prefix(text, m.end())
    return PartialToolCall(name, args), None


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\n\r":
        i += 1
    return i


class ToolParser:
    """Base class. Subclasses set nothing but the two parsing methods (and `adjust_request` when the
    markers are special tokens that detokenization would otherwise drop)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._sent_content = ""
        self._sent_calls: list[list[str]] = []  # per started call: [id, arguments sent]

    call_marker_is_special = False
    """The model opens its calls with a special / control token (kept in the text so the parser sees it)."""

    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        if self.call_marker_is_special and request.tools and request.tool_choice != "none":
            request.skip_special_tokens = False
        return request

    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest | None
    ) -> ExtractedToolCallInformation:
        raise NotImplementedError

    def parse_partial(self, text: str) -> PartialParse:
        raise NotImplementedError

    # ---- streaming (shared) ------------------------------------------------------------------------
    @property
    def tools_called_streaming(self) -> bool:
        return bool(self._sent_calls)

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: ChatCompletionRequest | None,
    ) -> DeltaMessage | None:
        """What `delta_text` adds (vLLM's signature); only `current_text` is needed."""
        try:
            partial = self.parse_partial(current_text)
        except PARSE_ERRORS:
            return None  # e.g. JSON nested too deep to parse: settled at the end (as content)
        return self._emit(partial)

    def finish_streaming(self, current_text: str, request: ChatCompletionRequest | None) -> DeltaMessage | None:
        """The rest of the non-streamed result once the output is complete."""
        info = extract_safely(self, current_text, request)
        if not info.tools_called:
            return self._emit(PartialParse(content=current_text))
        calls = [PartialToolCall(c.function.name, c.function.arguments) for c in info.tool_calls]
        return self._emit(PartialParse(content=info.content or "", calls=calls))

    def _emit(self, target: PartialParse) -> DeltaMessage | None:
        content = None
        if len(target.content) > len(self._sent_content) and target.content.startswith(self._sent_content):
            content = target.content[len(self._sent_content) :]
            self._sent_content = target.content
        entries: list[DeltaToolCall] = []
        for i, call in enumerate(target.calls):
            if call.name is None:
                break
            if i >= len(self._sent_calls):
                call_id = self.new_call_id()
                self._sent_calls.append([call_id, ""])
                entries.append(
                    DeltaToolCall(
                        index=i, id=call_id, type="function", function=DeltaFunctionCall(name=call.name, arguments="")
                    )
                )
            sent = self._sent_calls[i][1]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                entries.append(
                    DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=call.arguments[len(sent) :]))
                )
                self._sent_calls[i][1] = call.arguments
        if content is None and not entries:
            return None
        return DeltaMessage(content=content, tool_calls=entries)

    def new_call_id(self) -> str:
        return f"chatcmpl-tool-{random_uuid()}"


_REGISTRY: PluginRegistry[ToolParser] = PluginRegistry(
    "tool_call_parser",
    __package__ or "pagedllm.entrypoints.openai.tool_parsers",
    str(Path(__file__).parent),
    ("abstract", "json_stream"),
)
register_tool_parser = _REGISTRY.register
tool_parser_names = _REGISTRY.names
get_tool_parser = _REGISTRY.get
