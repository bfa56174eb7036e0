"""The one batched, device-agnostic sampler: greedy, temperature, min-p, top-k, top-p, seeded rows.

All rows are processed together with tensor ops; per-request parameters come in as tensors. Random
rows sample with the exponential-race trick (argmax of probs / Exp(1) noise), which lets rows with
their own seeded generator draw their noise separately while everything else stays batched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.sample.logits_processor import LogitsProcessor, MinTokensLogitsProcessor
from pagedllm.sample.metadata import SamplingMetadata

_EPS = 1e-5


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64


class Sampler(nn.Module):
    def __init__(self, logits_processors: list[LogitsProcessor] | None = None) -> None:
        super().__init__()
        self.logits_processors: list[LogitsProcessor] = [MinTokensLogitsProcessor(), *(logits_processors or [])]

    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        for proc in self.logits_processors:
            logits = proc.apply(logits, md)
        greedy = logits.argmax(dim=-1)
        if md.all_greedy:
            return SamplerOutput(greedy)
        temp = torch.where(md.temperature < _EPS, torch.ones_like(md.temperature), md.temperature)
        logits = logits / temp.unsqueeze(1)
        if md.min_p is not None:
            logits = apply_min_p(logits, md.min_p)
        if md.top_k is not None or md.top_p is not None:
            logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = logits.softmax(dim=-1)
        sampled = random_sample(probs, md.generators)
        if md.all_random:
            return SamplerOutput(sampled)
        return SamplerOutput(torch.where(md.temperature < _EPS, greedy, sampled))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's probability."""
    probs = logits.softmax(dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < min_p.unsqueeze(1) * top, -float("inf"))


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """top-k (0 = off) then top-p over what is left (the smallest set whose mass reaches p)."""
    vocab = logits.shape[-1]
    if p is None:
        # top-k alone: a threshold from topk, no full-vocabulary sort.
        assert k is not None
        k_eff = torch.where(k <= 0, torch.full_like(k, vocab), k).clamp(max=vocab)
        max_k = int(k_eff.max())
        top_vals = logits.topk(max_k, dim=-1).values
        thresh = top_vals.gather(1, (k_eff - 1).unsqueeze(1))
        return logits.masked_fill(logits < thresh, -float("inf"))
    sorted_logits, idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        k_eff = torch.where(k <= 0, torch.full_like(k, vocab), k).clamp(max=vocab)
        kth = sorted_logits.gather(1, (vocab - k_eff).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -float("inf"))
    probs = sorted_logits.softmax(dim=-1)
    cum = probs.cumsum(dim=-1)
    # Ascending order: drop the low tail whose cumulative mass is <= 1 - p; always keep the top token.
    drop = cum <= (1 - p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, -float("inf"))
    return torch.empty_like(logits).scatter_(1, idx, sorted_logits)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.exponential_()
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    return probs.div(q).argmax(dim=-1)
