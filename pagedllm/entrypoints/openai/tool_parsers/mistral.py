"""`mistral`: `[TOOL_CALLS]` then a JSON list `[{"name": ..., "arguments": {...}}, ...]` (Mistral 7B v0.3,
Mixtral, Nemo), or, with newer tokenizers, `[TOOL_CALLS]name[ARGS]{...}` once per call. Text before the
first `[TOOL_CALLS]` is the content. Call ids are 9 alphanumerics, as Mistral's chat templates require
(and vLLM generates)."""

from __future__ import annotations

import json
import random
import string

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.tool_parsers.abstract import (
    ExtractedToolCallInformation,
    PartialParse,
    PartialToolCall,
    ToolParser,
    content_before,
    make_tool_call,
    partial_json_call,
    register_tool_parser,
)
from pagedllm.entrypoints.openai.tool_parsers.json_stream import canonical_json_prefix

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ALNUM = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(random.choices(_ALNUM, k=9))


def _skip_ws(text: str, i: int) -> int:
    return len(text) - len(text[i:].lstrip())


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    call_marker_is_special = True  # [TOOL_CALLS] is a control token

    def new_call_id(self) -> str:
        return mistral_call_id()

    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest | None
    ) -> ExtractedToolCallInformation:
        idx = model_output.find(BOT)
        if idx < 0:
            return ExtractedToolCallInformation(False, content=model_output)
        content = model_output[:idx] or None
        i = _skip_ws(model_output, idx + len(BOT))
        calls = []
        try:
            if model_output.startswith("[", i):
                items, end = json.JSONDecoder().raw_decode(model_output, i)
                if model_output[end:].strip() or not isinstance(items, list) or not items:
                    raise ValueError("not a list of calls")
                for it in items:
                    if not isinstance(it, dict) or not isinstance(it.get("name"), str):
                        raise ValueError("not a call")
                    calls.append(make_tool_call(it["name"], it.get("arguments", {}), mistral_call_id()))
            else:
                for seg in model_output[idx + len(BOT) :].split(BOT):
                    name, sep, args = seg.partition(ARGS)
                    if not sep or not name.strip():
                        raise ValueError("no [ARGS]")
                    calls.append(make_tool_call(name.strip(), json.loads(args), mistral_call_id()))
        except ValueError:
            return ExtractedToolCallInformation(False, content=model_output)
        return ExtractedToolCallInformation(True, calls, content)

    def parse_partial(self, text: str) -> PartialParse:
        content, idx = content_before(text, BOT)
        res = PartialParse(content=content)
        if idx < 0:
            return res
        i = _skip_ws(text, idx + len(BOT))
        if i == len(text):
            return res
        if text[i] == "[":  # the JSON list form
            i += 1
            while True:
                call, end = partial_json_call(text, i)
                if call is None:
                    return res
                res.calls.append(call)
                if end is None:
                    return res
                j = _skip_ws(text, end)
                if not text.startswith(",", j):
                    return res
                i = j + 1
        for seg in text[idx + len(BOT) :].split(BOT):
            name, sep, args = seg.partition(ARGS)
            if not sep:
                return res
            prefix, _ = canonical_json_prefix(args)
            res.calls.append(PartialToolCall(name.strip(), prefix))
        return res
