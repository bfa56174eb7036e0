"""RoPE applied in place to q and k (neox style, CUDA, Triton), optionally preceded by a per-head RMSNorm
(Qwen3's q_norm / k_norm) so q and k are read and written once, and optionally followed by the paged
KV-cache write of the rotated k and of v, in the same launch (the attention backend then skips its own
`reshape_and_cache`).

Rounding follows the PyTorch reference in `model_executor/layers/rotary_embedding.py` step by step. Nothing
here launches or compiles a kernel at import time; without Triton the launchers raise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.triton_utils import HAS_TRITON, pdl_args, require_triton
from pagedllm.utils import next_pow2

if TYPE_CHECKING:
    from pagedllm.attention.backends.abstract import RotaryArgs

if HAS_TRITON:
    import triton
    import triton.language as tl

    from pagedllm.triton_utils import pdl_trigger, pdl_wait, product_in

    @triton.jit
    def _rope_heads(
        base_ptr,
        w_ptr,
        num_heads,
        cos,
        sin,
        eps,
        HEAD_SIZE: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        HAS_NORM: tl.constexpr,
    ):
        """Rotates (and first normalizes, if HAS_NORM) all `num_heads` heads of one token in place."""
        dt = base_ptr.dtype.element_ty
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_HALF)
        mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
        p1 = base_ptr + offs_h[:, None] * HEAD_SIZE + offs_d[None, :]
        p2 = p1 + HALF
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            # Per-head RMSNorm over the whole head (HAS_NORM requires rotary_dim == head_size).
            var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_SIZE
            rstd = (1.0 / tl.sqrt(var + eps))[:, None]
            w1 = tl.load(w_ptr + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
            w2 = tl.load(w_ptr + HALF + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
            x1 = (w1 * (x1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            x2 = (w2 * (x2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        # The reference multiplies in the activation dtype: round each product before combining (`mul_rn`: a
        # plain product became a half-precision FMA on sm_90, the first product unrounded; session 43).
        o1 = product_in(x1, cos, dt) - product_in(x2, sin, dt)
        o2 = product_in(x2, cos, dt) + product_in(x1, sin, dt)
        tl.store(p1, o1.to(dt), mask=mask)
        tl.store(p2, o2.to(dt), mask=mask)

    @triton.jit
    def rope_rows(rows_ptr, offs_d, mask, cos_sin_ptr, pos, stride_cs, HALF: tl.constexpr):
        """Rows of whole heads (rows_ptr [R, 1] pointers to each head's start, offs_d [D] = 0 .. 2 * HALF, the
        rotary dims the whole head) at positions pos [R], loaded and rotated as `_rope_heads` rotates them (the
        same roundings: each product in the activation dtype), in that dtype. For kernels that rotate what they
        read (the decode attention, `triton_paged_attn_kernels`) instead of a launch of their own."""
        dt = rows_ptr.dtype.element_ty
        j = offs_d % HALF
        x = tl.load(rows_ptr + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        xp = tl.load(rows_ptr + ((offs_d + HALF) % (2 * HALF))[None, :], mask=mask, other=0.0).to(tl.float32)
        cs = cos_sin_ptr + pos[:, None] * stride_cs + j[None, :]
        cos = tl.load(cs, mask=mask, other=0.0).to(dt).to(tl.float32)
        sin = tl.load(cs + HALF, mask=mask, other=0.0).to(dt).to(tl.float32)
        a = product_in(x, cos, dt)
        b = product_in(xp, sin, dt)
        return tl.where(offs_d[None, :] < HALF, a - b, a + b).to(dt)

    # n_cache (the step's token count) changes every step: no "== 1" / "divisible by 16" variants of it.
    @triton.jit(do_not_specialize=["n_cache"])
    def _rope_kernel(
        q_ptr,
        k_ptr,
        pos_ptr,
        cos_sin_ptr,
        qw_ptr,
        kw_ptr,
        stride_qt,
        stride_kt,
        stride_cs,
        num_q_heads,
        num_kv_heads,
        eps,
        v_ptr,
        slot_ptr,
        k_cache_ptr,
        v_cache_ptr,
        stride_vt,
        stride_cb,
        stride_ct,
        stride_ch,
        n_cache,
        HEAD_SIZE: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_KH: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        HAS_NORM: tl.constexpr,
        WRITE_CACHE: tl.constexpr,
        CACHE_BLOCK: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PDL: tl.constexpr = 0,
    ):
        pdl_trigger(PDL)
        # The position, its cos / sin and the cache slot before the PDL wait: the step's inputs (uploaded before
        # its first kernel) and a constant table, which no kernel of the step writes.
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_HALF)
        dmask = offs_d < HALF
        dt = q_ptr.dtype.element_ty
        # The reference casts the float32 cos/sin cache to the activation dtype.
        cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d, mask=dmask, other=0.0).to(dt).to(tl.float32)
        sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_d, mask=dmask, other=0.0)
        sin = sin.to(dt).to(tl.float32)
        cos = cos[None, :]
        sin = sin[None, :]
        if WRITE_CACHE:
            slot = tl.load(slot_ptr + t, mask=t < n_cache, other=-1).to(tl.int64)
        else:
            slot = -1
        pdl_wait(PDL)
        # Program (t, 0) rotates the token's q heads, (t, 1) its k heads and writes the cache: two short
        # dependent chains side by side instead of one long one (W6 at 256 tokens: 4.5 us a layer in one).
        if tl.program_id(1) == 0:
            q_row = q_ptr + t * stride_qt
            _rope_heads(q_row, qw_ptr, num_q_heads, cos, sin, eps, HEAD_SIZE, HALF, BLOCK_H, BLOCK_HALF, HAS_NORM)
            return
        _rope_heads(
            k_ptr + t * stride_kt, kw_ptr, num_kv_heads, cos, sin, eps, HEAD_SIZE, HALF, BLOCK_KH, BLOCK_HALF, HAS_NORM
        )
        if WRITE_CACHE:  # the token's rotated k and its v go to their paged-cache slot, as reshape_and_cache
            if slot >= 0:  # slot -1: padding (CUDA graphs), nothing written
                # Whole heads (partial rotary leaves the tail as is): re-read k after this program's stores.
                tl.debug_barrier()
                offs_h = tl.arange(0, BLOCK_KH)
                offs_e = tl.arange(0, BLOCK_D)
                mask = (offs_h[:, None] < num_kv_heads) & (offs_e[None, :] < HEAD_SIZE)
                row = offs_h[:, None] * HEAD_SIZE + offs_e[None, :]
                cache_off = (slot // CACHE_BLOCK) * stride_cb + (slot % CACHE_BLOCK) * stride_ct
                dst = cache_off + offs_h[:, None] * stride_ch + offs_e[None, :]
                k = tl.load(k_ptr + t * stride_kt + row, mask=mask)
                tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
                v = tl.load(v_ptr + t * stride_vt + row, mask=mask)
                tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@dataclass
class KVCacheWrite:
    """Where `rotary_embedding_` also writes the new K/V: one layer's paged cache halves
    ([num_blocks, block_size, num_kv_heads, head_size] each), the values [T, KVH*D] or [T, KVH, D] (a
    strided row view is fine), and the slot of each of the first `num_tokens` tokens (-1: write nothing)."""

    value: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    num_tokens: int


def rotary_embedding_(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    rotary_dim: int,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    cache: KVCacheWrite | None = None,
) -> None:
    """Neox-style RoPE on query [T, H*D] and key [T, KVH*D], in place; with `q_weight`/`k_weight`,
    a per-head RMSNorm (Qwen3's q_norm / k_norm) is applied first, in the same pass. With `cache`, the
    same launch also writes each token's rotated key and its value into the paged KV cache (what
    `reshape_and_cache` does), saving a launch per layer.

    query and key may be strided row views of a fused qkv tensor; within a row the heads must be
    packed (last dim contiguous, head stride head_size). `cos_sin_cache` is the float32
    [max_positions, rotary_dim] table of `RotaryEmbedding` (cos halves, then sin halves).
    """
    require_triton()
    has_norm = q_weight is not None
    if has_norm and (k_weight is None or rotary_dim != head_size):
        raise ValueError("the fused q/k norm needs both weights and rotary_dim == head_size")
    n_tokens = query.shape[0]
    if n_tokens == 0:
        return
    given = positions.data_ptr()
    positions = positions.reshape(-1).contiguous()
    # The kernel reads the positions before its PDL wait: a copy made just now (a kernel that may still run)
    # takes an ordinary launch.
    pdl = pdl_args(query, "rope") if positions.data_ptr() == given else {}
    q2 = query.view(n_tokens, -1)
    k2 = key.view(n_tokens, -1)
    assert q2.stride(-1) == 1 and k2.stride(-1) == 1, "q/k rows must be contiguous"
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.stride(-1) == 1
    num_q_heads = q2.shape[1] // head_size
    num_kv_heads = k2.shape[1] // head_size
    half = rotary_dim // 2
    block_h = next_pow2(num_q_heads)
    block_half = next_pow2(half)
    if cache is not None:
        v2 = cache.value.view(n_tokens, -1)
        kc, vc = cache.k_cache, cache.v_cache
        assert v2.stride(-1) == 1 and kc.stride() == vc.stride() and kc.stride(-1) == 1
        assert kc.shape[2:] == (num_kv_heads, head_size), "cache layout [blocks, block_size, kv_heads, head]"
        cache_args = (
            v2,
            cache.slot_mapping,
            kc,
            vc,
            v2.stride(0),
            kc.stride(0),
            kc.stride(1),
            kc.stride(2),
            min(cache.num_tokens, n_tokens),
        )
        block_size = kc.shape[1]
    else:
        cache_args = (k2, k2, k2, k2, 0, 0, 0, 0, 0)  # unused (WRITE_CACHE=False)
        block_size = 1
    _rope_kernel[(n_tokens, 2)](
        q2,
        k2,
        positions,
        cos_sin_cache,
        q_weight if has_norm else q2,
        k_weight if has_norm else k2,
        q2.stride(0),
        k2.stride(0),
        cos_sin_cache.stride(0),
        num_q_heads,
        num_kv_heads,
        eps,
        *cache_args,
        HEAD_SIZE=head_size,
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_KH=next_pow2(num_kv_heads),
        BLOCK_HALF=block_half,
        HAS_NORM=has_norm,
        WRITE_CACHE=cache is not None,
        CACHE_BLOCK=block_size,
        BLOCK_D=next_pow2(head_size),
        num_warps=4 if block_h * block_half <= 2048 else 8,
        **pdl,
    )


def apply_rotary_(
    rotary: RotaryArgs, query: torch.Tensor, key: torch.Tensor, head_size: int, cache: KVCacheWrite | None = None
) -> None:
    """`rotary_embedding_` with the arguments an attention layer was handed in `rotary`."""
    rotary_embedding_(
        rotary.positions,
        query,
        key,
        rotary.cos_sin_cache,
        head_size,
        rotary.rotary_dim,
        rotary.q_weight,
        rotary.k_weight,
        rotary.eps,
        cache,
    )
