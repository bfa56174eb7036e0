"""What the model runner needs of a generative model (every class in the registry provides it)."""

from __future__ import annotations

from typing import Protocol

import torch


class CausalLM(Protocol):
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T] token ids and positions of the step's flattened tokens -> [T, hidden] hidden states."""
        ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab]."""
        ...
