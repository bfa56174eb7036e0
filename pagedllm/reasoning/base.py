"""The reasoning-parser interface and its name registry (see the package docstring)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class DeltaReasoning:
    """What one streamed text delta adds to the reasoning and to the content (None: nothing)."""

    reasoning: str | None = None
    content: str | None = None


class ReasoningParser:
    """Base class: one instance per tokenizer, stateless across requests (streaming state is passed in)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """True once the reasoning section has ended in these (output) token ids."""
        raise NotImplementedError

    def prompt_opens_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        """True when the prompt ends inside a reasoning section (a chat template that opens `<think>`): the
        server then parses the output as if it began with the start tag."""
        return False

    def extract_content_ids(self, input_ids: Sequence[int]) -> list[int]:
        """The token ids after the end of the reasoning (empty while it has not ended)."""
        raise NotImplementedError

    def extract_reasoning(self, model_output: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output."""
        raise NotImplementedError

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaReasoning | None:
        """What `delta_text` adds to the reasoning and the content (None: nothing to send yet)."""
        raise NotImplementedError


_REGISTRY: dict[str, type[ReasoningParser]] = {}


def register_reasoning_parser(name: str) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
    def deco(cls: type[ReasoningParser]) -> type[ReasoningParser]:
        _REGISTRY[name] = cls
        return cls

    return deco


def _load_builtin() -> None:
    # The concrete parsers live in modules of this package; importing them registers them. (By path, not
    # by importing the package: that would be an import cycle.)
    import importlib
    import pkgutil
    from pathlib import Path

    for mod in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if mod.name != "base":
            importlib.import_module(f"{__package__}.{mod.name}")


def reasoning_parser_names() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as `name`; ValueError naming `reasoning_parser` otherwise."""
    _load_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"reasoning_parser: unknown parser {name!r}; expected one of {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]
