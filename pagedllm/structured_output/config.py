"""The engine-wide structured-output settings (vLLM's `structured_outputs_config`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pagedllm.utils import json_dict_option

BACKENDS = ("auto", "xgrammar")


@dataclass
class StructuredOutputsConfig:
    backend: str = "auto"
    """Grammar backend: `auto` or `xgrammar` (the only one; `auto` picks it)."""
    disable_fallback: bool = False
    """Accepted for vLLM compatibility (there is no other backend to fall back to)."""
    disable_any_whitespace: bool = False
    """JSON grammars allow no free whitespace (xgrammar `any_whitespace=False`): compact output that
    small models cannot stretch with endless blank lines."""
    disable_additional_properties: bool = False
    """JSON schemas get `additionalProperties: false` on every object that does not say otherwise."""
    max_whitespace_count: int | None = None
    """With free whitespace: at most this many whitespace characters in a row (None: unbounded)."""
    reasoning_parser: str = ""
    """Name of the reasoning parser: the grammar applies only after the reasoning ends."""
    enable_in_reasoning: bool = False
    """Apply the grammar from the first output token even with a reasoning parser."""

    @classmethod
    def from_value(
        cls, value: dict[str, Any] | str | None, reasoning_parser: str | None = None
    ) -> StructuredOutputsConfig:
        """From the engine argument (a dict or its JSON text); ValueError naming the key otherwise.
        `reasoning_parser` (the engine argument) wins over the dict's."""
        value = json_dict_option(value, "structured_outputs_config")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(
                f"structured_outputs_config: unknown key(s) {', '.join(unknown)}; expected {', '.join(sorted(names))}"
            )
        cfg = cls(**value)
        if reasoning_parser:
            cfg.reasoning_parser = reasoning_parser
        if cfg.backend not in BACKENDS:
            raise ValueError(
                f"structured_outputs_config.backend: expected one of {', '.join(BACKENDS)}, got {cfg.backend!r}"
            )
        if cfg.max_whitespace_count is not None and (
            not isinstance(cfg.max_whitespace_count, int) or cfg.max_whitespace_count < 0
        ):
            raise ValueError(
                f"structured_outputs_config.max_whitespace_count: must be a non-negative integer, "
                f"got {cfg.max_whitespace_count!r}"
            )
        if cfg.reasoning_parser:
            from pagedllm.reasoning import get_reasoning_parser

            get_reasoning_parser(cfg.reasoning_parser)  # ValueError naming reasoning_parser
        return cfg
