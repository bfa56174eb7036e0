"""Top-k expert selection: softmax over the router logits in float32, the k largest probabilities, and
(`renormalize`, HF's `norm_topk_prob`) their rescaling to sum to one. On CUDA one Triton launch does it
all (`triton_routing.fused_topk`); elsewhere the PyTorch ops HF uses, in HF's order."""

from __future__ import annotations

import torch

from pagedllm.model_executor.layers import triton_ops


def torch_select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64) exactly as HF's Qwen2/Qwen3-MoE and Mixtral
    routers compute them."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing for `router_logits` [T, E]: the fused Triton kernel on CUDA (ids int32), else PyTorch."""
    if triton_ops.use_triton_ops(router_logits):
        from pagedllm.model_executor.layers.fused_moe import triton_routing

        return triton_routing.fused_topk(router_logits, top_k, renormalize)
    return torch_select_experts(router_logits, top_k, renormalize)
