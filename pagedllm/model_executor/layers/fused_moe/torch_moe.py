"""The experts in plain PyTorch: a loop over the experts that received tokens (the CPU path, and the
reference the Triton kernels are tested against). Follows HF's `*Experts.forward` step by step:
per expert `down(silu(gate(x)) * up(x)) * weight`, accumulated with `index_add_`."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def torch_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_* [T, k] -> [T, H]."""
    out = torch.zeros_like(x)
    if x.shape[0] == 0:
        return out
    num_experts = w13.shape[0]
    flat_ids = topk_ids.reshape(-1).long()
    counts = torch.bincount(flat_ids, minlength=num_experts)
    top_k = topk_ids.shape[1]
    for e in torch.nonzero(counts).flatten().tolist():
        pos = torch.nonzero(flat_ids == e).flatten()
        token_idx, k_idx = pos // top_k, pos % top_k
        h = F.linear(x[token_idx], w13[e])
        gate, up = h.chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w2[e])
        h = h * topk_weights[token_idx, k_idx, None]
        out.index_add_(0, token_idx, h.to(out.dtype))
    return out
