"""Batch-1 linear layers as a row GEMV (CUDA, Triton, no tensor cores).

cuBLAS runs a [1, K] x [K, N] product as a split-K GEMM plus a separate reduce kernel for some shapes and
reaches 1.15-1.67x the weight-read floor on Llama-3.1-8B's q/k/v, o and down projections (H200,
benchmarks/NOTES.md, session 5). Here every program streams BLOCK_N whole weight rows with wide loads and
keeps a [BLOCK_N, BLOCK_K] float32 partial-sum tile, reduced once at the end: no split-K, no second launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.triton_utils import HAS_TRITON, pdl_args, row_gemv_on
from pagedllm.utils import next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl

    from pagedllm.triton_utils import pdl_enter

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
        part_ptr,  # HAS_LORA: [cdiv(K, BLOCK_K), R] float32 scratch, the shrink's partial sums per K block
        cnt_ptr,  # HAS_LORA: [cdiv(R, BLOCK_N)] int32, zero between launches: partials done per row block
        push_addr,  # PUSH: the address of a peer's [2, N] int16 receive buffer (distributed/push_allreduce.py)
        epoch_ptr,  # PUSH: [1] int64, the call's epoch (its parity picks the receive buffer's half)
        N,
        K,
        R,
        stride_wn,
        stride_as,
        stride_ar,
        HAS_BIAS: tl.constexpr,
        HAS_LORA: tl.constexpr,
        EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks
        EVEN_A: tl.constexpr,  # R % BLOCK_N == 0 and K % BLOCK_K == 0
        PUSH: tl.constexpr,  # also store y's bits into the peer's receive buffer
        GLU: tl.constexpr,  # rows i and i + N of the weight (2N rows) -> silu(x . w_i) * (x . w_(i+N)) at i
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr = 0,
    ):
        pid = tl.program_id(0)
        rk = tl.arange(0, BLOCK_K)
        pdl_enter(PDL)
        if PUSH:  # (loaded first: its latency hides behind the weight stream)
            half = tl.load(epoch_ptr) % 2
        if HAS_LORA:
            # The shrink x @ A[slot]^T in the grid's first programs, one [BLOCK_N, BLOCK_K] tile each; the last
            # program of a row block to finish sums its partials (an atomic counter it resets). A decode GEMV's
            # programs all run in one wave, so the kernel lasts as long as its slowest program: a shrink
            # program streaming whole rows after its dependent slot load outlasted the weight's programs by
            # that load (+1.5 us per launch, benchmarks/NOTES.md, session 16); one tile each, they end first.
            k_blocks = tl.cdiv(K, BLOCK_K)
            a_progs = tl.cdiv(R, BLOCK_N) * k_blocks
            if pid < a_progs:
                slot = tl.load(slot_ptr)
                if slot < 0:
                    return
                rb = pid // k_blocks
                k0 = (pid % k_blocks) * BLOCK_K
                rr = rb * BLOCK_N + tl.arange(0, BLOCK_N)
                r_ok = rr < R
                a_ptrs = a_ptr + slot.to(tl.int64) * stride_as + rr[:, None].to(tl.int64) * stride_ar + k0 + rk[None, :]
                if EVEN_A:
                    a = tl.load(a_ptrs)
                    x = tl.load(x_ptr + k0 + rk)
                else:
                    k_ok = k0 + rk < K
                    a = tl.load(a_ptrs, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
                    x = tl.load(x_ptr + k0 + rk, mask=k_ok, other=0.0)
                s = tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
                tl.store(part_ptr + (pid % k_blocks) * R + rr, s, mask=r_ok)
                tl.debug_barrier()  # every thread's partial is written before the counter moves
                done = tl.atomic_add(cnt_ptr + rb, 1, sem="acq_rel")
                tl.debug_barrier()
                if done == k_blocks - 1:
                    tot = tl.zeros([BLOCK_N], dtype=tl.float32)
                    for i in range(0, k_blocks):
                        tot += tl.load(part_ptr + i * R + rr, mask=r_ok, other=0.0, cache_modifier=".cg")
                    tl.store(s_ptr + rr, tot, mask=r_ok)
                    tl.atomic_xchg(cnt_ptr + rb, 0)
                return
            pid -= a_progs
        if GLU:
            # One program per output: the gate row, then the up row, each as the plain launch's one-row
            # program computes it (same tile layout, so the same float32 sums: bit-identical), rounded to the
            # activation dtype, then `triton_ops.silu_and_mul`'s arithmetic.
            r1 = pid + tl.arange(0, 1)
            ok = r1 < N
            g_ptrs = w_ptr + r1[:, None].to(tl.int64) * stride_wn + rk[None, :]
            g = _rows_dot(g_ptrs, x_ptr, K, ok, EVEN, 1, BLOCK_K).to(y_ptr.dtype.element_ty).to(tl.float32)
            u = _rows_dot(g_ptrs + N * stride_wn, x_ptr, K, ok, EVEN, 1, BLOCK_K)
            act = (g / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty).to(tl.float32)
            tl.store(y_ptr + r1, (act * u.to(y_ptr.dtype.element_ty).to(tl.float32)).to(y_ptr.dtype.element_ty))
            return
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
        y = _rows_dot(w_ptrs, x_ptr, K, n_ok, EVEN, BLOCK_N, BLOCK_K)
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        y = y.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rn, y, mask=n_ok)
        if PUSH:
            # A posted NVLink write per row, no fence: the peer polls every element until it differs from
            # the sentinel 0xFFFF (a NaN, so a NaN result is sent as another NaN).
            bits = y.to(tl.int16, bitcast=True)
            bits = tl.where(bits == -1, 0x7FFF, bits)
            dst = push_addr.to(tl.pointer_type(tl.int16)) + half * N + rn
            tl.store(dst, bits, mask=n_ok)


@dataclass
class RowGemvLoRA:
    """A LoRA shrink riding on a batch-1 row GEMV (`lora/layers.py` installs one per target linear): the
    kernel also computes `out = x @ a[slot]^T` (float32) in extra programs, saving the shrink's own launch;
    `done` tells the layer's hook that it did. `part` and `count` are the kernel's scratch (sized by
    `create` for the layer's [N, K] weight; `count` stays zero between launches)."""

    a: torch.Tensor  # [slots, R, K]
    slot: torch.Tensor  # [1] int32 on the device
    out: torch.Tensor  # [1, R] float32
    part: torch.Tensor  # [cdiv(K, BLOCK_K), R] float32
    count: torch.Tensor  # [cdiv(R, BLOCK_N)] int32
    done: bool = False

    @classmethod
    def create(
        cls, a: torch.Tensor, slot: torch.Tensor, n: int, config: tuple[int, int, int, int] | None = None
    ) -> RowGemvLoRA:
        """For the row GEMV of an [n, a.shape[2]] weight (`config`: the one it will run with)."""
        r, k = a.shape[1], a.shape[2]
        bn, bk, _, _ = config or row_gemv_config(n, k)
        dev = a.device
        part = torch.zeros(-(-k // bk), r, dtype=torch.float32, device=dev)
        count = torch.zeros(-(-r // bn), dtype=torch.int32, device=dev)
        return cls(a, slot, torch.zeros(1, r, dtype=torch.float32, device=dev), part, count)


def row_gemv_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for a 16-bit [n, k] weight: one row per program, 512-wide K
    steps, 4 warps. Timed over weight copies that overflow L2 (as a decode step streams them), it is within
    2 % on average of the best of 48 configurations on Llama-3.1-8B's per-rank shapes at tp=1 and tp=2
    (benchmarks/row_gemv_tp_sweep.py). Per layer, against the earlier size-keyed table: H100 145.0 -> 142.0 us
    at tp=1, 78.6 -> 74.5 at tp=2; H200 109.8 -> 107.3 and 62.8 -> 58.2 (benchmarks/NOTES.md, session 20)."""
    return 1, min(512, next_pow2(k)), 4, 1


def row_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: tuple[int, int, int, int] | None = None,
    lora: RowGemvLoRA | None = None,
    push: tuple[int, torch.Tensor] | None = None,
    glu: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`x @ weight.T + bias` for one row x [1, K] (CUDA, Triton), in x's dtype; with `lora`, also its shrink
    (`lora.out`, in the same launch); with `push` = (a peer's receive-buffer address, the epoch tensor), also
    the result's bits into that buffer (16-bit x only; distributed/push_allreduce.py). With `glu` (a merged
    [gate; up] weight of 2N rows, no bias, LoRA or push): `silu_and_mul` of the product, [1, N], in one launch.
    `out_dtype` (float32: the LM head's logits) stores the float32 sums unrounded instead."""
    assert HAS_TRITON, "Triton is not installed"
    assert x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1 and weight.stride(-1) == 1
    n, k = weight.shape
    assert x.shape[1] == k
    bn, bk, nw, ns = config or row_gemv_config(n, k)
    if glu:
        assert n % 2 == 0 and bias is None and lora is None and push is None
        n //= 2
    assert out_dtype in (None, x.dtype) or (push is None and not glu)
    y = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
    n_blocks = n if glu else triton.cdiv(n, bn)
    r = 0
    if lora is not None:
        assert lora.a.shape[2] == k and lora.a.stride(2) == 1 and lora.out.dtype == torch.float32
        r = lora.a.shape[1]
        assert lora.out.shape == (1, r) and lora.part.shape == (triton.cdiv(k, bk), r)
        assert lora.count.shape == (triton.cdiv(r, bn),) and lora.count.dtype == torch.int32
    _row_gemv_kernel[(n_blocks + triton.cdiv(r, bn) * triton.cdiv(k, bk),)](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        lora.a if lora is not None else weight,
        lora.slot if lora is not None else weight,
        lora.out if lora is not None else weight,
        lora.part if lora is not None else weight,
        lora.count if lora is not None else weight,
        push[0] if push is not None else 0,
        push[1] if push is not None else weight,
        n,
        k,
        r,
        weight.stride(0),
        lora.a.stride(0) if lora is not None else 0,
        lora.a.stride(1) if lora is not None else 0,
        HAS_BIAS=bias is not None,
        HAS_LORA=lora is not None,
        EVEN=n % bn == 0 and k % bk == 0,
        EVEN_A=r % bn == 0 and k % bk == 0,
        PUSH=push is not None,
        GLU=glu,
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=nw,
        num_stages=ns,
        **pdl_args(x, "gemv" if push is None else "push"),
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
        and row_gemv_on()
    )
