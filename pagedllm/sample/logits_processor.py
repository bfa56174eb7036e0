"""Batch-level logits processors: each sees the whole [N, vocab] logits of the step at once."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pagedllm.sample.metadata import SamplingMetadata


class LogitsProcessor(ABC):
    """Public interface for batch-level logits processors (applied in order before sampling)."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Return the processed logits (may modify `logits` in place)."""


class MinTokensLogitsProcessor(LogitsProcessor):
    """Masks EOS and stop token ids of rows that have not produced `min_tokens` tokens yet."""

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if not metadata.min_tokens:
            return logits
        rows: list[int] = []
        cols: list[int] = []
        for row, ids in metadata.min_tokens.items():
            rows.extend([row] * len(ids))
            cols.extend(ids)
        if rows:
            logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = -float("inf")
        return logits
