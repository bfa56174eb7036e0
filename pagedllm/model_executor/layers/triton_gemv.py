"""Small-batch linear layers with their elementwise producer folded in (CUDA, Triton): `y = W a + b` for
M <= 16 rows, where `a` is computed while the weight streams by -- RMSNorm (optionally after the
residual add) for the q/k/v and gate/up projections, SiLU-and-mul for the down projection.

Why: a batch-1 decode step is ~11 launches per layer, and inside a CUDA graph each small elementwise
kernel costs a few microseconds whatever its work; the GEMV reads megabytes of weight anyway, so the
norm's or the activation's input (a few KB, from L2) can be recomputed by every program. Two launches
fewer per layer. The weight tile of every K step feeds a 16-row `tl.dot` (rows past M are masked), so
Triton pipelines the weight loads as it does for any matmul.

Rounding mirrors the unfused path step by step (the residual sum, the normalized value and the
activation are rounded to the activation dtype where the references hold them in it); the products
accumulate in float32 in a different order than cuBLAS, so outputs agree to an ulp or so.

Off by default until measured on a GPU: `PAGEDLLM_FUSED_GEMV=1` turns it on for decode batches of up
to `MAX_ROWS` rows (the Llama-family decoder layer picks it, see `llama.py`; so does the LM head for
its float32 logits, see `vocab_embedding.py`).
"""

from __future__ import annotations

import os

import torch

from pagedllm.model_executor.layers.triton_ops import HAS_TRITON, _next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl

MAX_ROWS = 16
PRO_NONE, PRO_NORM, PRO_ADD_NORM, PRO_SILU = 0, 1, 2, 3


def enabled(x: torch.Tensor) -> bool:
    """Whether the fused small-batch path applies to activations `x` [M, K]."""
    return (
        HAS_TRITON
        and x.is_cuda
        and x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and os.environ.get("PAGEDLLM_FUSED_GEMV", "0") == "1"
    )


if HAS_TRITON:

    @triton.jit
    def _prologue_tile(
        x_ptr, res_ptr, nw_ptr, rm, rk, m_ok, k_ok, K, stride_xm, stride_rm, rstd, PROLOGUE: tl.constexpr
    ):
        """The [BLOCK_M, BLOCK_K] tile of the GEMV's input `a`, in the activation dtype."""
        dt = x_ptr.dtype.element_ty
        mask = m_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0)
        if PROLOGUE == 3:  # SiLU(gate) * up; x holds [gate | up], each K wide
            g = x.to(tl.float32)
            u = tl.load(x_ptr + rm[:, None] * stride_xm + K + rk[None, :], mask=mask, other=0.0).to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            return (act * u).to(dt)
        if PROLOGUE == 0:
            return x
        if PROLOGUE == 2:
            r = tl.load(res_ptr + rm[:, None] * stride_rm + rk[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        w = tl.load(nw_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
        normed = (x.to(tl.float32) * rstd[:, None]).to(dt).to(tl.float32)
        return (w[None, :] * normed).to(dt)

    # M (the batch's rows) differs between eager steps: no "== 1" / "divisible by 16" variants of it.
    @triton.jit(do_not_specialize=["M"])
    def _fused_gemv_kernel(
        x_ptr,  # [M, K] activations ([M, 2K] for SiLU-and-mul)
        res_ptr,  # [M, K] residual (PRO_ADD_NORM)
        res_out_ptr,  # [M, K] x + residual, written by program 0 (PRO_ADD_NORM)
        nw_ptr,  # [K] RMSNorm weight (PRO_NORM / PRO_ADD_NORM)
        w_ptr,  # [N, K] weight
        b_ptr,  # [N] bias (HAS_BIAS)
        y_ptr,  # [M, N] out
        M,
        N,
        K,
        stride_xm,
        stride_rm,
        stride_rom,
        stride_wn,
        stride_ym,
        eps,
        PROLOGUE: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm < M
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
        if PROLOGUE == 1 or PROLOGUE == 2:
            # The norm's statistic over the whole row (every program recomputes it: a few KB from L2).
            ss = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                k_ok = rk < K
                mask = m_ok[:, None] & k_ok[None, :]
                x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0)
                if PROLOGUE == 2:
                    r = tl.load(res_ptr + rm[:, None] * stride_rm + rk[None, :], mask=mask, other=0.0)
                    x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
                    if pid == 0:
                        tl.store(res_out_ptr + rm[:, None] * stride_rom + rk[None, :], x, mask=mask)
                xf = x.to(tl.float32)
                ss += tl.sum(xf * xf, axis=1)
            rstd = 1.0 / tl.sqrt(ss / K + eps)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            a = _prologue_tile(x_ptr, res_ptr, nw_ptr, rm, rk, m_ok, k_ok, K, stride_xm, stride_rm, rstd, PROLOGUE)
            w = tl.load(
                w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None],
                mask=n_ok[None, :] & k_ok[:, None],
                other=0.0,
            )  # [BLOCK_K, BLOCK_N]
            acc += tl.dot(a, w.to(a.dtype), input_precision=DOT_PREC)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(
            y_ptr + rm[:, None] * stride_ym + rn[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=m_ok[:, None] & n_ok[None, :],
        )


def _config(n: int, k: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): narrow N tiles so that even a 4096-wide output gives
    every SM a couple of programs; a 16 KB weight tile per K step, pipelined."""
    block_n = 16 if n <= 16384 else 32
    block_k = min(_next_pow2(k), (16384 // (block_n * (4 if dtype == torch.float32 else 2))))
    return block_n, max(16, block_k), 4, 3


def fused_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu_and_mul: bool = False,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`weight @ a + bias` for x of M <= 16 rows, returning (y, new residual or None), where a is
    - `x` (nothing else given),
    - `RMSNorm(x)` with `norm_weight`, or `RMSNorm(x + residual)` with `residual` too (the new residual
      `x + residual` is returned, a fresh tensor),
    - `silu(x[:, :K]) * x[:, K:]` with `silu_and_mul` (x is [M, 2K]).
    y is in x's dtype, or `out_dtype` (float32 logits: the accumulators unrounded).
    """
    assert HAS_TRITON, "Triton is not installed"
    m = x.shape[0]
    n, k = weight.shape
    assert 0 < m <= MAX_ROWS and x.stride(-1) == 1 and weight.stride(-1) == 1
    if silu_and_mul:
        assert x.shape[1] == 2 * k and norm_weight is None and residual is None
        prologue = PRO_SILU
    elif norm_weight is not None:
        prologue = PRO_ADD_NORM if residual is not None else PRO_NORM
    else:
        assert residual is None
        prologue = PRO_NONE
    if prologue != PRO_SILU:
        assert x.shape[1] == k
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    res_out = torch.empty(m, k, dtype=x.dtype, device=x.device) if prologue == PRO_ADD_NORM else None
    res = residual if residual is not None else x
    assert res.stride(-1) == 1
    bn, bk, nw, ns = _config(n, k, x.dtype)
    _fused_gemv_kernel[(triton.cdiv(n, bn),)](
        x,
        res,
        res_out if res_out is not None else x,
        norm_weight if norm_weight is not None else x,
        weight,
        bias if bias is not None else weight,
        y,
        m,
        n,
        k,
        x.stride(0),
        res.stride(0),
        res_out.stride(0) if res_out is not None else 0,
        weight.stride(0),
        y.stride(0),
        eps,
        PROLOGUE=prologue,
        HAS_BIAS=bias is not None,
        BLOCK_M=16,
        BLOCK_N=bn,
        BLOCK_K=bk,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=nw,
        num_stages=ns,
    )
    return y, res_out


# ---- single-row GEMV (batch-1 decode), no tensor cores ---------------------------------------------------
#
# cuBLAS runs a [1, K] x [K, N] product as a split-K GEMM plus a separate reduce kernel for some shapes and
# reaches 1.15-1.67x the weight-read floor on Llama-3.1-8B's q/k/v, o and down projections (H200,
# benchmarks/NOTES.md, session 5). Here every program streams BLOCK_N whole weight rows with wide loads and
# keeps a [BLOCK_N, BLOCK_K] float32 partial-sum tile, reduced once at the end: no split-K, no second launch.

if HAS_TRITON:

    @triton.jit
    def _row_gemv_kernel(
        x_ptr,  # [K] activations (one row)
        w_ptr,  # [N, K] weight
        b_ptr,  # [N] bias (HAS_BIAS)
        y_ptr,  # [N] out
        N,
        K,
        stride_wn,
        HAS_BIAS: tl.constexpr,
        EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
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
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def row_gemv_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for a 16-bit [n, k] weight.

    From the H200 sweep over Llama-3.1-8B's projections (`benchmarks/decode_profile.py`, all 32 layers in
    one graph; cuBLAS / this kernel / floor, ms): o_proj 4096x4096 0.424 / 0.322 (2, 512, 2) / 0.253,
    down_proj 4096x14336 1.024 / 0.945 (2, 1024, 4) / 0.887, qkv 6144x4096 0.490 / 0.448 (4, 1024, 4) / 0.380,
    gate_up 28672x4096 1.789 / 1.745 (4, 1024, 4) / 1.774 (measured below the copy-bandwidth "floor").
    """
    if k > 8192:
        return 2, 1024, 4, 1
    if n <= 4096:
        return 2, min(512, _next_pow2(k)), 2, 1
    return 4, min(1024, _next_pow2(k)), 4, 1


def row_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """`x @ weight.T + bias` for one row x [1, K] (CUDA, Triton), in x's dtype."""
    assert HAS_TRITON, "Triton is not installed"
    assert x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1 and weight.stride(-1) == 1
    n, k = weight.shape
    assert x.shape[1] == k
    bn, bk, nw, ns = config or row_gemv_config(n, k)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _row_gemv_kernel[(triton.cdiv(n, bn),)](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        n,
        k,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        EVEN=n % bn == 0 and k % bk == 0,
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=nw,
        num_stages=ns,
    )
    return y


def row_gemv_enabled(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `UnquantizedLinearMethod` runs x @ weight.T through `row_gemv`: one 16-bit row on CUDA
    (`PAGEDLLM_ROW_GEMV=0` turns it off; on the H200 it took W3 from 4.712 to 4.515 ms per token)."""
    return (
        _ROW_GEMV
        and HAS_TRITON
        and x.is_cuda
        and x.dim() == 2
        and x.shape[0] == 1
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )


_ROW_GEMV = os.environ.get("PAGEDLLM_ROW_GEMV", "1") != "0"
