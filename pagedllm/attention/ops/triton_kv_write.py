"""Triton kernel writing a step's new K/V into the paged cache (split from `triton_paged_attn.py`, which
re-exports `reshape_and_cache`). Cache layout (one layer): `k_cache`, `v_cache` are each
`[num_blocks, block_size, num_kv_heads, head_size]`; slot = block_id * block_size + offset."""

from __future__ import annotations

import torch

from pagedllm.triton_utils import HAS_TRITON, require_triton
from pagedllm.utils import next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl

if HAS_TRITON:

    @triton.jit
    def _reshape_and_cache_kernel(
        key_ptr,
        value_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_ptr,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_kcb,
        stride_kct,
        stride_kch,
        stride_vcb,
        stride_vct,
        stride_vch,
        k_scale_ptr,
        v_scale_ptr,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_SIZE: tl.constexpr,
        KVH_PAD: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        FP8: tl.constexpr,
        FP8_MAX: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot < 0:  # padded token (e.g. CUDA-graph padding): nothing to write
            return
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, KVH_PAD)
        d = tl.arange(0, HEAD_PAD)
        mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_SIZE)[None, :]
        k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        kc = k_cache_ptr + blk * stride_kcb + off * stride_kct + h[:, None] * stride_kch + d[None, :]
        vc = v_cache_ptr + blk * stride_vcb + off * stride_vct + h[:, None] * stride_vch + d[None, :]
        if FP8:  # cache = fp8(x / scale), saturated (kv_quant.py)
            k = tl.clamp(k.to(tl.float32) / tl.load(k_scale_ptr), -FP8_MAX, FP8_MAX)
            v = tl.clamp(v.to(tl.float32) / tl.load(v_scale_ptr), -FP8_MAX, FP8_MAX)
        tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [T, num_kv_heads, head_size], last dim contiguous
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [>= T] int64; negative entries are skipped
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Write the new tokens' K/V into their cache slots (slot = block_id * block_size + offset); an FP8
    cache stores x / scale with the layer's `kv_scales` (float32 [1] tensors)."""
    require_triton()
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    fp8 = k_cache.element_size() == 1
    assert not fp8 or kv_scales is not None, "an FP8 cache needs the layer's k/v scales"
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        *(kv_scales if fp8 else (slot_mapping, slot_mapping)),  # type: ignore[misc]
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        KVH_PAD=next_pow2(num_kv_heads),
        HEAD_PAD=next_pow2(head_size),
        BLOCK_SIZE=k_cache.shape[1],
        FP8=fp8,
        FP8_MAX=_fp8_max(k_cache.dtype) if fp8 else 0.0,
        num_warps=4,
    )


def _fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)
