"""The reasoning-parser interface and its name registry (see the package docstring)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.utils import PluginRegistry


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


_REGISTRY: PluginRegistry[ReasoningParser] = PluginRegistry(
    "reasoning_parser", __package__ or "pagedllm.reasoning", str(Path(__file__).parent), ("base",)
)
register_reasoning_parser = _REGISTRY.register
reasoning_parser_names = _REGISTRY.names
get_reasoning_parser = _REGISTRY.get
