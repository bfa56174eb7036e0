"""Per-step sampling parameters of the rows that sample, as tensors (built by the model runner)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [N] float32; 0 = greedy
    top_p: torch.Tensor | None  # [N] float32, None when no row uses it
    top_k: torch.Tensor | None  # [N] int64 (0 = off), None when no row uses it
    min_p: torch.Tensor | None  # [N] float32, None when no row uses it
    all_greedy: bool
    all_random: bool
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    """Row index -> the request's own generator (requests with a seed)."""
    min_tokens: dict[int, list[int]] = field(default_factory=dict)
    """Row index -> stop token ids to mask because the row has not reached min_tokens yet."""
    output_token_ids: list[list[int]] = field(default_factory=list)
    """Per row, the tokens generated so far (for logits processors that need history)."""
