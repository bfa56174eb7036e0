"""Segmented LoRA matmuls in Triton (Punica / S-LoRA style): the step's tokens grouped by adapter slot
(`sorted_idx`, with `seg_start` / `seg_len` per slot; the last segment, the base-model tokens, is skipped),
a shrink x @ A[slot]^T into a float32 [T, R] buffer (split over K, atomically summed), then an expand that
adds buffer @ B[slot]^T into the base layer's output in place. Grids depend only on the token count, so a
CUDA graph captures them; programs past their slot's segment return at once.
"""

from __future__ import annotations

import torch

from pagedllm.triton_utils import HAS_TRITON, require_triton
from pagedllm.utils import next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _shrink_kernel(
        x_ptr, a_ptr, buf_ptr, idx_ptr, start_ptr, len_ptr,
        K: tl.constexpr, R,
        sxm, sxk, sal, sar, sak, sbm,
        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        K_STEP: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        # K is a compile-time constant (the model's few widths): also keeps the loop runnable interpreted.
        slot = tl.program_id(0)
        mb = tl.program_id(1)
        ks = tl.program_id(2)
        seg_len = tl.load(len_ptr + slot)
        if mb * BLOCK_M >= seg_len:
            return
        seg_start = tl.load(start_ptr + slot)
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < seg_len
        rows = tl.load(idx_ptr + seg_start + offs_m, mask=m_mask, other=0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        a_base = a_ptr + slot.to(tl.int64) * sal
        for k0 in range(0, K, K_STEP):  # K_STEP = BLOCK_K * SPLIT_K
            offs_k = k0 + ks * BLOCK_K + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            x = tl.load(
                x_ptr + rows[:, None] * sxm + offs_k[None, :] * sxk, mask=m_mask[:, None] & k_mask[None, :], other=0.0
            )
            a = tl.load(
                a_base + offs_r[None, :] * sar + offs_k[:, None] * sak,
                mask=r_mask[None, :] & k_mask[:, None],
                other=0.0,
            )
            if IEEE:
                acc += tl.dot(x, a, input_precision="ieee")
            else:
                acc += tl.dot(x, a)
        ptrs = buf_ptr + rows[:, None] * sbm + offs_r[None, :]
        mask = m_mask[:, None] & r_mask[None, :]
        if SPLIT_K == 1:
            tl.store(ptrs, acc, mask=mask)
        else:
            tl.atomic_add(ptrs, acc, mask=mask)

    @triton.jit
    def _expand_kernel(
        buf_ptr, b_ptr, out_ptr, idx_ptr, start_ptr, len_ptr,
        N, R,
        sbm, sbl, sbn, sbr, som, son,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        slot = tl.program_id(0)
        mb = tl.program_id(1)
        nb = tl.program_id(2)
        seg_len = tl.load(len_ptr + slot)
        if mb * BLOCK_M >= seg_len:
            return
        seg_start = tl.load(start_ptr + slot)
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < seg_len
        rows = tl.load(idx_ptr + seg_start + offs_m, mask=m_mask, other=0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        s = tl.load(buf_ptr + rows[:, None] * sbm + offs_r[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        b = tl.load(
            b_ptr + slot.to(tl.int64) * sbl + offs_n[None, :] * sbn + offs_r[:, None] * sbr,
            mask=n_mask[None, :] & r_mask[:, None],
            other=0.0,
        )
        if IEEE:
            acc = tl.dot(s, b.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(s.to(b.dtype), b)
        optrs = out_ptr + rows[:, None] * som + offs_n[None, :] * son
        omask = m_mask[:, None] & n_mask[None, :]
        o = tl.load(optrs, mask=omask)
        tl.store(optrs, (o.to(tl.float32) + acc).to(o.dtype), mask=omask)


SPLIT_K_MAX_TOKENS = 1024
"""Up to this many tokens the shrink may split K (few token blocks: decode); the caller then passes a
zeroed float32 buffer (`split_buffer`), one memset per forward for all layers."""


def use_split_k(num_tokens: int, num_slots: int, k: int) -> int:
    """How many programs share a shrink's K: 1 when there are enough token blocks to fill the GPU."""
    if num_tokens > SPLIT_K_MAX_TOKENS or triton.cdiv(num_tokens, 16) * num_slots >= 64:
        return 1
    return min(16, max(1, k // 512))


def lora_shrink_expand(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    out: torch.Tensor,
    sorted_idx: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    split_buffer: torch.Tensor | None = None,
) -> None:
    """out[t] += (x[t] @ A[slot(t)]^T) @ B[slot(t)]^T for every token with a slot, in place.
    `split_buffer`: a zeroed float32 [>= T, >= R] view for the split-K shrink (allocated here if None)."""
    require_triton()
    num_tokens, k = x.shape
    num_slots, r, _ = lora_a.shape
    block_m = 16 if num_tokens <= 512 else 64
    block_r = max(16, next_pow2(r))
    ieee = x.dtype == torch.float32
    m_blocks = triton.cdiv(num_tokens, block_m)
    split_k = use_split_k(num_tokens, num_slots, k)
    block_k = 64 if block_r <= 64 else 32
    if split_k > 1:
        buf = split_buffer[:num_tokens, :r] if split_buffer is not None else None
        if buf is None:
            buf = torch.zeros(num_tokens, r, dtype=torch.float32, device=x.device)
    else:
        buf = torch.empty(num_tokens, r, dtype=torch.float32, device=x.device)
    _shrink_kernel[(num_slots, m_blocks, split_k)](
        x, lora_a, buf, sorted_idx, seg_start, seg_len,
        k, r,
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), buf.stride(0),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, SPLIT_K=split_k, K_STEP=block_k * split_k, IEEE=ieee,
    )  # fmt: skip
    lora_expand(buf, lora_b, out, sorted_idx, seg_start, seg_len)


def lora_expand(
    buf: torch.Tensor,
    lora_b: torch.Tensor,
    out: torch.Tensor,
    sorted_idx: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
) -> None:
    """out[t] += buf[t] @ B[slot(t)]^T for every token with a slot, in place (buf: the float32 shrink)."""
    num_tokens, r = buf.shape
    num_slots, n, _ = lora_b.shape
    block_m = 16 if num_tokens <= 512 else 64
    block_r = max(16, next_pow2(r))
    block_n = 64 if block_r > 64 else 128
    _expand_kernel[(num_slots, triton.cdiv(num_tokens, block_m), triton.cdiv(n, block_n))](
        buf, lora_b, out, sorted_idx, seg_start, seg_len,
        n, r,
        buf.stride(0), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, IEEE=out.dtype == torch.float32,
    )  # fmt: skip
