"""Batch-1 linear layers as a row GEMV (CUDA, Triton, no tensor cores).

cuBLAS runs a [1, K] x [K, N] product as a split-K GEMM plus a separate reduce kernel for some shapes and
reaches 1.15-1.67x the weight-read floor on Llama-3.1-8B's q/k/v, o and down projections (H200,
benchmarks/NOTES.md, session 5). Here every program streams BLOCK_N whole weight rows with wide loads and
keeps a [BLOCK_N, BLOCK_K] float32 partial-sum tile, reduced once at the end: no split-K, no second launch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pagedllm import envs
from pagedllm.triton_utils import HAS_TRITON
from pagedllm.utils import next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl

if HAS_TRITON:

    @triton.jit
    def _rows_dot(w_ptrs, x_ptr, K, n_ok, EVEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """[BLOCK_N] float32 dot products of the weight rows at `w_ptrs` (+ k) with x [K]."""
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN:
                w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
                x = tl.load(x_ptr + k0 + rk)
            else:
                k_ok = k0 + rk < K
                w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
                x = tl.load(x_ptr + k0 + rk, mask=k_ok, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        return tl.sum(acc, axis=1)

    @triton.jit
    def _row_gemv_kernel(
        x_ptr,  # [K] activations (one row)
        w_ptr,  # [N, K] weight
        b_ptr,  # [N] bias (HAS_BIAS)
        y_ptr,  # [N] out
        a_ptr,  # HAS_LORA: [slots, R, K] LoRA A of every slot
        slot_ptr,  # HAS_LORA: [1] int32, the row's slot (-1: none)
        s_ptr,  # HAS_LORA: [R] float32 out, x @ A[slot]^T
        N,
        K,
        R,
        N_BLOCKS,
        stride_wn,
        stride_as,
        stride_ar,
        HAS_BIAS: tl.constexpr,
        HAS_LORA: tl.constexpr,
        EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks
        EVEN_A: tl.constexpr,  # R % BLOCK_N == 0 and K % BLOCK_K == 0
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rk = tl.arange(0, BLOCK_K)
        if HAS_LORA:
            if pid >= N_BLOCKS:  # the LoRA shrink's rows: A[slot] after the weight's rows, same loop
                slot = tl.load(slot_ptr)
                if slot < 0:
                    return
                rr = (pid - N_BLOCKS) * BLOCK_N + tl.arange(0, BLOCK_N)
                r_ok = rr < R
                a_ptrs = a_ptr + slot.to(tl.int64) * stride_as + rr[:, None].to(tl.int64) * stride_ar + rk[None, :]
                s = _rows_dot(a_ptrs, x_ptr, K, r_ok, EVEN_A, BLOCK_N, BLOCK_K)
                tl.store(s_ptr + rr, s, mask=r_ok)
                return
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
        y = _rows_dot(w_ptrs, x_ptr, K, n_ok, EVEN, BLOCK_N, BLOCK_K)
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_ok)


@dataclass
class RowGemvLoRA:
    """A LoRA shrink riding on a batch-1 row GEMV (`lora/layers.py` installs one per target linear): the
    kernel also computes `out = x @ a[slot]^T` (float32) in extra programs, saving the shrink's own launch;
    `done` tells the layer's hook that it did."""

    a: torch.Tensor  # [slots, R, K]
    slot: torch.Tensor  # [1] int32 on the device
    out: torch.Tensor  # [1, R] float32
    done: bool = False


def row_gemv_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for a 16-bit [n, k] weight: the winners of the H200 sweep
    over Llama-3.1-8B's projections (benchmarks/NOTES.md, "Tuning figures behind code heuristics")."""
    if k > 8192:
        return 2, 1024, 4, 1
    if n <= 4096:
        return 2, min(512, next_pow2(k)), 2, 1
    return 4, min(1024, next_pow2(k)), 4, 1


def row_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: tuple[int, int, int, int] | None = None,
    lora: RowGemvLoRA | None = None,
) -> torch.Tensor:
    """`x @ weight.T + bias` for one row x [1, K] (CUDA, Triton), in x's dtype; with `lora`, also its shrink
    (`lora.out`, in the same launch)."""
    assert HAS_TRITON, "Triton is not installed"
    assert x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1 and weight.stride(-1) == 1
    n, k = weight.shape
    assert x.shape[1] == k
    bn, bk, nw, ns = config or row_gemv_config(n, k)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    n_blocks = triton.cdiv(n, bn)
    r = 0
    if lora is not None:
        assert lora.a.shape[2] == k and lora.a.stride(2) == 1 and lora.out.dtype == torch.float32
        r = lora.a.shape[1]
    _row_gemv_kernel[(n_blocks + triton.cdiv(r, bn),)](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        lora.a if lora is not None else weight,
        lora.slot if lora is not None else weight,
        lora.out if lora is not None else weight,
        n,
        k,
        r,
        n_blocks,
        weight.stride(0),
        lora.a.stride(0) if lora is not None else 0,
        lora.a.stride(1) if lora is not None else 0,
        HAS_BIAS=bias is not None,
        HAS_LORA=lora is not None,
        EVEN=n % bn == 0 and k % bk == 0,
        EVEN_A=r % bn == 0 and k % bk == 0,
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=nw,
        num_stages=ns,
    )
    if lora is not None:
        lora.done = True
    return y


def row_gemv_enabled(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `UnquantizedLinearMethod` runs x @ weight.T through `row_gemv`: one 16-bit row on CUDA
    (`PAGEDLLM_ROW_GEMV=0` turns it off; on the H200 it took W3 from 4.712 to 4.515 ms per token)."""
    return (
        HAS_TRITON
        and x.is_cuda
        and x.dim() == 2
        and x.shape[0] == 1
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
        and _row_gemv_on()
    )


@functools.cache
def _row_gemv_on() -> bool:
    return bool(envs.PAGEDLLM_ROW_GEMV)
