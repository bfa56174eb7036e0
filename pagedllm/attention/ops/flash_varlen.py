"""Causal varlen FlashAttention-2 (PyTorch's built-in kernel) for prefill chunks with no cached prefix.

A prompt's first chunk attends only to its own new keys, which are contiguous in the step's K/V
tensors: no paged gather is needed, and PyTorch ships FlashAttention-2 (`aten::_flash_attention_forward`,
the kernel behind SDPA's flash backend) with variable-length batches and GQA. On the H200 it runs causal
bf16 prefill at ~1.7x our Triton paged kernel (429 vs 247 TFLOP/s, benchmarks/NOTES.md), which
matters for prefill-heavy work (W2, W4 without prefix caching). Chunks with a cached prefix and decodes
stay on the Triton kernel.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def flash_available(device_index: int) -> bool:
    """FlashAttention-2 exists in this PyTorch build and runs on this GPU (sm80+); PAGEDLLM_FLASH_PREFILL=0 turns
    the path off."""
    if os.environ.get("PAGEDLLM_FLASH_PREFILL", "1") == "0":
        return False
    if not torch.cuda.is_available() or not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return False
    if not torch.backends.cuda.is_flash_attention_available():
        return False
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


def flash_supports(query: torch.Tensor, num_kv_heads: int) -> bool:
    head = query.shape[-1]
    return (
        query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and head % 8 == 0
        and head <= 256
        and query.shape[1] % num_kv_heads == 0
        and flash_available(query.device.index or 0)
    )


def flash_varlen_causal(
    query: torch.Tensor,  # [T, num_heads, head_size]
    key: torch.Tensor,  # [T, num_kv_heads, head_size]
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,  # [num_reqs + 1] int32, device: each request's token span (q and k alike)
    max_seqlen: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of every request's tokens over its own tokens; returns [T, num_heads, head_size]."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    window_left = sliding_window - 1 if sliding_window else None
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, False,
        scale=scale, window_size_left=window_left, window_size_right=0 if window_left is not None else None,
    )[0]
    return out
