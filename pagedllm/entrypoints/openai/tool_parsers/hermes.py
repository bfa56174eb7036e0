"""`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call (Hermes 2 Pro,
Qwen2.5, Qwen3). Text before the first block is the content; the last block may lack its closing tag
(generation stopped at it)."""

from __future__ import annotations

import json
import re

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.tool_parsers.abstract import (
    ExtractedToolCallInformation,
    PartialParse,
    ToolParser,
    content_before,
    make_tool_call,
    partial_json_call,
    register_tool_parser,
)

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest | None
    ) -> ExtractedToolCallInformation:
        if START not in model_output:
            return ExtractedToolCallInformation(False, content=model_output)
        calls = []
        for closed, open_ in _BLOCK.findall(model_output):
            body = (closed or open_).strip()
            try:
                obj = json.loads(body)
            except ValueError:
                return ExtractedToolCallInformation(False, content=model_output)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return ExtractedToolCallInformation(False, content=model_output)
            calls.append(make_tool_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
        content = model_output[: model_output.find(START)]
        return ExtractedToolCallInformation(True, calls, content or None)

    def parse_partial(self, text: str) -> PartialParse:
        content, idx = content_before(text, START)
        res = PartialParse(content=content)
        while idx >= 0:
            body_start = idx + len(START)
            end = text.find(END, body_start)
            body = text[body_start:] if end < 0 else text[body_start:end]
            call, _ = partial_json_call(body)
            if call is None:
                break
            res.calls.append(call)
            idx = -1 if end < 0 else text.find(START, end + len(END))
        return res
