"""Presence / frequency / repetition penalties (vLLM semantics) and the per-request token counts they
need, kept on the device and updated incrementally (one scatter-add per step) instead of rebuilt.

- repetition_penalty (HF/CTRL): for tokens in the prompt OR the output, logit / r if logit > 0 else
  logit * r.
- frequency_penalty: logit -= f * (occurrences in the output).
- presence_penalty: logit -= p * (1 if the token occurs in the output).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Penalize `logits` [P, V] (returns a new tensor)."""
    output_mask = output_counts > 0
    rep = repetition.unsqueeze(1)
    seen = prompt_mask | output_mask
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency.unsqueeze(1) * output_counts.to(logits.dtype)
    return logits - presence.unsqueeze(1) * output_mask.to(logits.dtype)


class TokenCountSlots:
    """Prompt-presence masks and output-token counts [slots, vocab] of the requests that use penalties.

    Only requests with penalties take a slot, and the tensors grow by doubling up to `max_slots`, so an
    engine whose requests never use penalties spends no memory on them.
    """

    def __init__(self, vocab_size: int, max_slots: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.max_slots = max_slots
        self.device = device
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self._free: list[int] = []

    def _grow(self) -> None:
        old = self.prompt_mask.shape[0]
        new = min(self.max_slots, max(4, 2 * old))
        if new <= old:
            raise RuntimeError("TokenCountSlots: more penalized requests than max_slots")
        mask = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        mask[:old] = self.prompt_mask
        counts[:old] = self.output_counts
        self.prompt_mask, self.output_counts = mask, counts
        self._free.extend(range(new - 1, old - 1, -1))

    def acquire(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> int:
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self.prompt_mask[slot].zero_()
        self.output_counts[slot].zero_()
        if len(prompt_token_ids):
            self.prompt_mask[slot, torch.as_tensor(np.asarray(prompt_token_ids), device=self.device)] = True
        if len(output_token_ids):
            ids = torch.as_tensor(np.asarray(output_token_ids), device=self.device)
            self.output_counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def add_tokens(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """counts[slots[i], tokens[i]] += 1 for all i, in one scatter-add."""
        if len(slots) == 0:
            return
        s = torch.as_tensor(slots, device=self.device)
        t = torch.as_tensor(tokens, device=self.device)
        self.output_counts.index_put_((s, t), torch.ones_like(s, dtype=torch.int32), accumulate=True)
