"""`llama3_json`: Llama 3.1/3.2's JSON tool calls, `{"name": ..., "parameters": {...}}` (or
"arguments"), several separated by `;`, optionally after `<|python_tag|>`. The output is a tool call
only when it starts with one; otherwise it is all content."""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.tool_parsers.abstract import (
    ExtractedToolCallInformation,
    PartialParse,
    ToolParser,
    make_tool_call,
    partial_json_call,
    register_tool_parser,
)

PYTHON_TAG = "<|python_tag|>"


def _body_start(text: str) -> int | None:
    """Where the JSON calls begin; -1 when the text cannot be tool calls, None while undecided."""
    s = text.lstrip()
    if PYTHON_TAG.startswith(s) and len(s) < len(PYTHON_TAG):
        return None  # empty, or a beginning of the tag
    offset = len(text) - len(s)
    if s.startswith(PYTHON_TAG):
        offset += len(PYTHON_TAG)
        s = text[offset:].lstrip()
        offset = len(text) - len(s)
        if not s:
            return None
    return offset if s.startswith("{") else -1


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    call_marker_is_special = True  # <|python_tag|> is a special token

    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest | None
    ) -> ExtractedToolCallInformation:
        start = _body_start(model_output)
        if start is None or start < 0:
            return ExtractedToolCallInformation(False, content=model_output)
        dec = json.JSONDecoder()
        calls = []
        i = start
        while True:
            try:
                obj, i = dec.raw_decode(model_output, i)
            except ValueError:
                return ExtractedToolCallInformation(False, content=model_output)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return ExtractedToolCallInformation(False, content=model_output)
            calls.append(make_tool_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
            rest = model_output[i:].lstrip()
            if not rest:
                break
            if not rest.startswith(";"):
                return ExtractedToolCallInformation(False, content=model_output)
            i = len(model_output) - len(rest) + 1
            i += len(model_output[i:]) - len(model_output[i:].lstrip())
        return ExtractedToolCallInformation(True, calls, None)

    def parse_partial(self, text: str) -> PartialParse:
        start = _body_start(text)
        if start is None:
            return PartialParse()
        if start < 0:
            return PartialParse(content=text)
        res = PartialParse()
        i: int | None = start
        while i is not None:
            call, end = partial_json_call(text, i)
            if call is None:
                break
            res.calls.append(call)
            if end is None:
                break
            rest = text[end:].lstrip()
            if not rest.startswith(";"):
                break
            i = len(text) - len(rest) + 1
        return res
