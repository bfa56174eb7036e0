"""Batch-invariant mode on the GPU: the matmul whose rows do not depend on how many rows there are.

cuBLAS picks its kernel, tile and split-K by M (and the batch-1 row GEMV is another kernel again), so a token's
linear-layer outputs change with the batch it rides in. Here every linear layer and the LM head go through one
Triton kernel: an in-order K loop accumulating into float32, no split-K, rows padded with zeros into BLOCK_M
tiles. A row's reduction is then the same instruction sequence whatever M
is and wherever the row sits (tests/gpu/test_batch_invariant_gpu.py checks every row bitwise for M = 1..300).

The attention kernel is made invariant by fixing its tiles and turning split-KV off
(`attention/ops/triton_paged_attn.py`, `paged_attention`); RMSNorm, activations, rotary embedding, the
log-softmax and argmax of sampling already reduce within a row. The cost on W1 / W3 is in benchmarks/NOTES.md.
"""

from __future__ import annotations

import functools

import torch

from pagedllm import envs
from pagedllm.triton_utils import HAS_TRITON, require_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])
    def _bi_matmul_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_ym,
        HAS_BIAS: tl.constexpr,
        DOT_PREC: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # N tiles vary fastest: the programs running together share their x rows and stream distinct weights.
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
        w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + rk) < K
            a = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs + k0, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def config(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). N tiles are narrow for layers of up to 8k outputs, so a
    decode batch still has one program per SM or more streaming the weight (Llama-3.1-8B's o/down: 4,096 / 32 =
    128 programs on 132 SMs). Batches of up to 16 rows take 16-row tiles with a deeper pipeline (more weight
    bytes in flight per program), larger ones 64-row tiles: both accumulate the same 64-deep K tiles in the same
    order into float32, which the GPU test checks row for row across the boundary (PAGEDLLM_BI_SMALL_M_TILE=0:
    64 rows always)."""
    bn = 32 if n <= 8192 else 64
    if m <= 16 and small_m_tile():
        return 16, bn, 64, 4, 8
    return 64, bn, 64, 4, 4


@functools.cache
def small_m_tile() -> bool:
    return envs.PAGEDLLM_BI_SMALL_M_TILE


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias), each output row independent of the other rows."""
    require_triton()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    m, k = x2.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m:
        bm, bn, bk, warps, stages = config(m, n, k)
        grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
        _bi_matmul_kernel[grid](
            x2,
            w,
            bias if bias is not None else w,
            y,
            m,
            n,
            k,
            x2.stride(0),
            w.stride(0),
            y.stride(0),
            HAS_BIAS=bias is not None,
            DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            num_warps=warps,
            num_stages=stages,
        )
    return y.reshape(*lead, n)
