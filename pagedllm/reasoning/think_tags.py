"""The shared part of the `<think>...</think>` parsers: tag token ids, `is_reasoning_end` by token id,
and streaming as the difference between the splits of the text before and after the delta.

A concrete parser gives `split(text, final)`: (reasoning, content) of an output; with `final=False` the
split of a prefix, which must only grow as the text grows (a possible start of a tag is held back).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedllm.reasoning.base import DeltaReasoning, ReasoningParser


def held_back(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ThinkTagReasoningParser(ReasoningParser):
    start_token = "<think>"
    end_token = "</think>"

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
        self.start_token_id = vocab.get(self.start_token)
        self.end_token_id = vocab.get(self.end_token)
        if tokenizer is not None and (self.start_token_id is None or self.end_token_id is None):
            raise ValueError(
                f"reasoning_parser: the tokenizer has no {self.start_token} / {self.end_token} tokens; "
                "this parser needs a model that generates them"
            )

    # ---- token ids ---------------------------------------------------------------------------------
    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """The last think tag in `input_ids` is the end tag (prompts may close an opened think, as
        Qwen3's template with enable_thinking=False does)."""
        for tid in reversed(input_ids):
            if tid == self.end_token_id:
                return True
            if tid == self.start_token_id:
                return False
        return False

    def prompt_opens_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        for tid in reversed(prompt_token_ids):
            if tid == self.end_token_id:
                return False
            if tid == self.start_token_id:
                return True
        return False

    def extract_content_ids(self, input_ids: Sequence[int]) -> list[int]:
        ids = list(input_ids)
        if self.end_token_id not in ids:
            return []
        last = len(ids) - 1 - ids[::-1].index(self.end_token_id)
        return ids[last + 1 :]

    # ---- text --------------------------------------------------------------------------------------
    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        raise NotImplementedError

    def extract_reasoning(self, model_output: str) -> tuple[str | None, str | None]:
        reasoning, content = self.split(model_output, final=True)
        return reasoning or None, content or None

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaReasoning | None:
        r0, c0 = self.split(previous_text, final=False)
        r1, c1 = self.split(current_text, final=False)
        r0, c0, r1, c1 = r0 or "", c0 or "", r1 or "", c1 or ""
        reasoning = r1[len(r0) :] if len(r1) > len(r0) and r1.startswith(r0) else None
        content = c1[len(c0) :] if len(c1) > len(c0) and c1.startswith(c0) else None
        if reasoning is None and content is None:
            return None
        return DeltaReasoning(reasoning=reasoning, content=content)

    def _after_end(self, text: str, final: bool) -> tuple[str, str] | None:
        """(reasoning, content) around the end tag, or None if it has not come (yet)."""
        idx = text.find(self.end_token)
        if idx < 0:
            return None
        return text[:idx], text[idx + len(self.end_token) :]
