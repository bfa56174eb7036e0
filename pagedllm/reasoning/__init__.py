"""Reasoning parsers: split a model's `<think>...</think>` output into reasoning and content.

The contract between the parts that use them:
- the OpenAI server (`--reasoning-parser NAME`) calls `extract_reasoning` / `extract_reasoning_streaming`
  to fill `reasoning_content` and `content`;
- the structured-output manager calls `is_reasoning_end` on a request's output token ids so that a
  grammar applies only to the content after the reasoning ends.
Concrete parsers register themselves with `register_reasoning_parser` and are looked up by name.
"""

from __future__ import annotations

from pagedllm.reasoning.base import (
    DeltaReasoning,
    ReasoningParser,
    get_reasoning_parser,
    reasoning_parser_names,
    register_reasoning_parser,
)

__all__ = [
    "DeltaReasoning",
    "ReasoningParser",
    "get_reasoning_parser",
    "reasoning_parser_names",
    "register_reasoning_parser",
]
