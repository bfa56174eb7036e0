"""`pythonic`: a Python list of calls with keyword arguments, `[f(a=1), g(b="x")]` (Llama 3.2 / 4,
ToolACE), optionally inside `<|python_start|>...<|python_end|>`. The argument values must be Python
literals; they become JSON. Output that is not such a list is content."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.tool_parsers.abstract import (
    ExtractedToolCallInformation,
    PartialParse,
    PartialToolCall,
    ToolParser,
    make_tool_call,
    register_tool_parser,
)

START, END = "<|python_start|>", "<|python_end|>"
_LIST_OF_CALLS = re.compile(r"\[\s*[A-Za-z_]")


def _unwrap(text: str) -> str:
    s = text.strip()
    if s.startswith(START):
        s = s[len(START) :]
        if s.endswith(END):
            s = s[: -len(END)]
    return s.strip()


def _call(node: ast.expr) -> tuple[str, dict[str, Any]]:
    """(name, JSON-ready keyword arguments) of a call node; ValueError for anything else."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise ValueError("not a call with keyword arguments only")
    args: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise ValueError("**kwargs")
        args[kw.arg] = ast.literal_eval(kw.value)
    json.dumps(args)  # TypeError for sets, bytes, complex numbers...
    return node.func.id, args


def parse_calls(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    """The calls of `[f(a=1), ...]`, or None if `text` is not such a list."""
    try:
        tree = ast.parse(text, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        return [_call(e) for e in tree.elts]
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None


@register_tool_parser("pythonic")
class PythonicToolParser(ToolParser):
    call_marker_is_special = True  # <|python_start|> is a special token

    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest | None
    ) -> ExtractedToolCallInformation:
        calls = parse_calls(_unwrap(model_output))
        if calls is None:
            return ExtractedToolCallInformation(False, content=model_output)
        return ExtractedToolCallInformation(True, [make_tool_call(n, a) for n, a in calls], None)

    def parse_partial(self, text: str) -> PartialParse:
        s = text.lstrip()
        if START.startswith(s) and len(s) < len(START):
            return PartialParse()  # undecided: empty, or a beginning of the tag
        if s.startswith(START):
            s = s[len(START) :].lstrip()
        if not s.startswith("["):
            return PartialParse() if not s else PartialParse(content=text)
        if not s[1:].strip():
            return PartialParse()  # "[": undecided
        if not _LIST_OF_CALLS.match(s):
            return PartialParse(content=text)
        return PartialParse(calls=[PartialToolCall(n, json.dumps(a, ensure_ascii=False)) for n, a in _complete(s)])


def _complete(s: str) -> list[tuple[str, dict[str, Any]]]:
    """The calls of the list `s` (a prefix) that are complete: each top-level element that has closed."""
    out: list[tuple[str, dict[str, Any]]] = []
    depth = 0
    quote: str | None = None
    seg_start = 1
    i = 0
    while i < len(s):
        c = s[i]
        if quote is not None:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 1 and c == ")":
                try:
                    node = ast.parse(s[seg_start : i + 1].strip(), mode="eval").body
                    out.append(_call(node))
                except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
                    return out
            if depth <= 0:
                return out
        elif c == "," and depth == 1:
            seg_start = i + 1
        i += 1
    return out
