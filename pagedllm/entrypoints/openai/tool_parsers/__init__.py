"""Tool-call parsers of the OpenAI server (`--tool-call-parser NAME`, vLLM's names): model text ->
`tool_calls`. One module per parser; each registers itself under its name (see `abstract.py`)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract import (
    ExtractedToolCallInformation,
    PartialParse,
    PartialToolCall,
    ToolParser,
    get_tool_parser,
    register_tool_parser,
    tool_parser_names,
)

__all__ = [
    "ExtractedToolCallInformation",
    "PartialParse",
    "PartialToolCall",
    "ToolParser",
    "get_tool_parser",
    "register_tool_parser",
    "tool_parser_names",
]
