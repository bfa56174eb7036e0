"""GGUF weights kept packed on the GPU: the load-time re-layout and the launchers of the Triton kernels
(`gguf_triton_kernels`): a GEMV for decode (M <= `GEMV_MAX_M`) that streams every packed byte once, with
int8 activations and IDP4A for 16-bit activations and the pair-layout types (`Q8A_TYPES`; the activations
quantized by `quantize_q8` or handed over as their producer's twin, act_twin.py), with float products
otherwise; and for prefill the weights dequantized a chunk at a time and multiplied by cuBLAS.

The load-time layout (`prepare`) and the torch references (`dequantize`, `q8_activations`) are in
`gguf_triton_layout`, re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from pagedllm import envs
from pagedllm.attention.qkv_rope import QKVRope
from pagedllm.model_executor.layers.quantization import act_twin
from pagedllm.model_executor.layers.quantization.act_twin import Q8Act
from pagedllm.model_executor.layers.quantization.gguf_blocks import PACKED_TYPES, GGUFTritonWeight, GGUFWeight
from pagedllm.model_executor.layers.quantization.gguf_triton_layout import (  # noqa: F401  (re-exported)
    Q8A_TYPES,
    dequantize,
    group_size,
    prepare,
    q8_activations,
    quants_per_word,
)
from pagedllm.triton_utils import HAS_TRITON, interpreted, num_sms, pdl_args, require_triton, split_counters

if HAS_TRITON:
    import triton

    from pagedllm.model_executor.layers.quantization import gguf_triton_int8 as int8
    from pagedllm.model_executor.layers.quantization import gguf_triton_kernels as kern

GEMV_MAX_M = 8


def _args(w: GGUFTritonWeight) -> tuple[list[torch.Tensor], list[int]]:
    """The kernels' weight pointers (absent planes replaced by `lo`) and row strides."""
    lo = w.data
    hi, d, dm, sc, mn = (t if t is not None else lo for t in (w.hi, w.d, w.dm, w.sc, w.mn))
    return [lo, hi, d, dm, sc, mn], [lo.stride(0), hi.stride(0), d.stride(0), sc.stride(0)]


class GemvConfig(NamedTuple):
    """A decode-GEMV launch: rows per program (BN), weights per row per K step (BK, a power of 2 >= 64),
    warps, num_stages, and the split-K factor (0: `_auto_split`). Stages change nothing today: Triton does
    not software-pipeline loads that feed no `tl.dot` (the sm_90a SASS is the same for 1 and 3); a prefetch
    of the next step written into the int8 kernel won no shape of the session-41 sweep and was removed."""

    bn: int
    bk: int
    warps: int
    stages: int
    split: int = 0
    flags: int = 0
    """Int8 GEMV variants, bits: `OPQ` (its scale loads indexed through an opaque identity, so Triton loads them
    in the layout that uses them, not vectorized and then moved between threads by shuffles) and `NOPRE` (no
    read before the PDL wait for this launch, whatever PAGEDLLM_GGUF_GEMV_PRELOAD says)."""


OPQ, NOPRE = 1, 4  # (bit 2 was KPACK, Q4_K's packed scale planes as a variant: the layout now; NOTES session 46)


# Sweep winners of the int8-activation GEMV (`benchmarks/gguf_gpu.py --sweep` prints these lines), keyed by
# (type name, N, K); any other shape takes `_DEFAULT`, the float GEMV `_FLOAT_DEFAULT`. NVIDIA H200, Llama-3.1-8B
# shapes, M = 1, bf16 activations (session 41, results/s41/call6/sweep.json): a row or a few a program, whole
# rows (no split-K), 1-2 warps; (BN, BK, warps, stages, split). Three changed by W3 in context (session 44,
# `gguf_gpu.py --ab TUNED:...`, benchmarks/NOTES.md): whole 4096-weight rows in one step (the step read before the
# PDL wait) for Q4_1 o_proj and gate/up (-0.07 ms together, repeated in two calls) and Q4_K o_proj (-0.013 /
# -0.016 ms); the same for qkv, down or the other types' gate/up was slower. Session 46 (W3 in context, the
# `flags` variants and Q4_K's packed scale planes, benchmarks/NOTES.md): Q4_K qkv (2, 1024, 2) and gate/up
# (2, 1024, 2) with OPQ and o_proj (2, 4096, 2) (1.850 -> 1.702 ms against the old three in one process); Q4_1
# qkv (2, 1024, 2) with OPQ (-0.007), o_proj without its early read (NOPRE: -0.012 in two calls) and gate/up
# (2, 1024, 2) with OPQ (-0.027; without OPQ +0.035).
TUNED: dict[tuple[str, int, int], GemvConfig] = {
    ("Q4_1", 6144, 4096): GemvConfig(2, 1024, 2, 1, 1, OPQ),
    ("Q4_1", 4096, 4096): GemvConfig(2, 4096, 2, 1, 1, NOPRE),
    ("Q4_1", 28672, 4096): GemvConfig(2, 1024, 2, 1, 1, OPQ),
    ("Q4_1", 4096, 14336): GemvConfig(1, 2048, 2, 1, 1),
    ("Q4_1", 128256, 4096): GemvConfig(4, 512, 1, 1, 1),
    ("Q8_0", 6144, 4096): GemvConfig(2, 2048, 4, 1, 1),
    ("Q8_0", 4096, 4096): GemvConfig(2, 1024, 2, 1, 1),
    ("Q8_0", 28672, 4096): GemvConfig(1, 2048, 2, 1, 1),
    ("Q8_0", 4096, 14336): GemvConfig(1, 2048, 2, 1, 1),
    ("Q8_0", 128256, 4096): GemvConfig(1, 2048, 2, 1, 1),
    ("Q4_K", 6144, 4096): GemvConfig(2, 1024, 2, 1, 1, OPQ),
    ("Q4_K", 4096, 4096): GemvConfig(2, 4096, 2, 1, 1),
    ("Q4_K", 28672, 4096): GemvConfig(2, 1024, 2, 1, 1, OPQ),
    ("Q4_K", 4096, 14336): GemvConfig(1, 2048, 2, 1, 1),
    ("Q4_K", 128256, 4096): GemvConfig(4, 512, 1, 1, 1),
}
# The int8 GEMV elsewhere: 2 rows x 1024 weights a step, 2 warps, split-K only where the rows leave SMs idle.
# Why so small (the sweeps of session 41): Triton pipelines no loads that feed no `tl.dot`, so a program waits
# out the memory latency every step, and the bytes in flight come from many small resident programs. Tiles of
# 64-256 rows ran at 1.7-3x the packed floor whatever their split; (2, 1024, 2) gate_up 1.12x.
_DEFAULT = GemvConfig(2, 1024, 2, 1, 0)
_FLOAT_DEFAULT = GemvConfig(64, 256, 4, 1, 0)  # the float GEMV (float32 activations, Q5_K / Q6_K)
PROGRAMS_PER_SM = 8  # `_auto_split`'s target of programs per SM (a few resident, the rest a second wave)
# The float exponent field of 2^23 (0x4B000000), passed to the GEMV as an argument: a register operand
# lets each quant's mask-and-or be one LOP3 with the mask as its immediate; as a constant, ptxas spent a MOV
# per two quants rematerializing one of the two immediates.
_EXP0 = 150 << 23


def int8_activations(qtype: int, dtype: torch.dtype) -> bool:
    """Whether the decode GEMV quantizes activations of `dtype` to int8 for a `qtype` weight (16-bit
    activations and a pair-layout type; float32 activations keep the float kernel's exact products)."""
    return qtype in Q8A_TYPES and dtype in (torch.bfloat16, torch.float16)


def gemv_config(qtype: int, m: int, n: int, k: int, int8_act: bool = True) -> GemvConfig:
    """The decode GEMV's launch for an [n, k] weight of `qtype` and m activation rows: the single place
    holding the chosen defaults (`TUNED` for the int8-activation kernel, else `_DEFAULT`)."""
    return TUNED.get((PACKED_TYPES[qtype], n, k), _DEFAULT) if int8_act else _FLOAT_DEFAULT


def _auto_split(m: int, n_blocks: int, k_steps: int, num_sms: int) -> int:
    """Split K until about PROGRAMS_PER_SM programs per SM exist (enough loads in flight to cover the
    memory latency), never below one K step per program."""
    return max(1, min(k_steps, triton.cdiv(PROGRAMS_PER_SM * num_sms, max(1, m * n_blocks))))


_Q8_BLOCK = 1024  # columns a program of the quantizer takes


def quantize_q8(x: torch.Tensor) -> Q8Act:
    """x [M, K] (16-bit, K % 32 == 0) quantized for the int8 GEMV (`_q8_quant_kernel`; reference
    `q8_activations`)."""
    require_triton()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    d = torch.empty(m, k // 32, dtype=torch.float32, device=x.device)
    s = torch.empty_like(d)
    block = min(_Q8_BLOCK, triton.next_power_of_2(k))
    int8._q8_quant_kernel[(m, triton.cdiv(k, block))](
        x, q, d, s, k, x.stride(0), q.stride(0), d.stride(0), BLOCK=block, num_warps=4, **pdl_args(x, "gemv")
    )
    return Q8Act(q, d, s)


def gguf_gemv_triton(
    x: torch.Tensor,
    w: GGUFTritonWeight,
    out: torch.Tensor,
    num_sms: int = 132,
    config: GemvConfig | None = None,
    q8: Q8Act | None = None,
    preload: bool | None = None,
    rope: QKVRope | None = None,
) -> torch.Tensor:
    """out [M <= 8, N] (a view with unit column stride) = x [M, K] @ dequant(w).T, written in place;
    `config` overrides `gemv_config` (the sweep). 16-bit activations and a pair-layout type take the int8
    GEMV, on `q8` (x quantized by `quantize_q8`) if given, else quantizing x first. `preload`: the int8
    GEMV reads its first step's weights before its PDL wait (None: under PDL unless
    PAGEDLLM_GGUF_GEMV_PRELOAD=0). `rope`: the qkv projection's RoPE and K / V cache write done in the int8
    GEMV's epilogue (`rope_fits` says where it can)."""
    require_triton()
    m, k = x.shape
    n = w.rows
    q8a = int8_activations(w.qtype, x.dtype)
    g, epw = group_size(w.qtype), quants_per_word(w.qtype)
    bn, bk, nw, ns, split, flags = config or gemv_config(w.qtype, m, n, k, q8a)
    bk = max(64, min(bk, triton.next_power_of_2(k)))
    n_blocks = triton.cdiv(n, bn)
    steps = triton.cdiv(k, bk)
    split = min(split, steps) if split > 0 else _auto_split(m, n_blocks, steps, num_sms)
    rope_kw: dict = {}
    if rope is not None:
        if not (q8a and _rope_tile_fits(bn, n, rope)):
            raise ValueError(f"gguf: no RoPE epilogue for a {w.type_name} [{n}, {k}] GEMV of {bn} rows a program")
        split = 1  # (whole rows a program: the epilogue rotates finished sums)
        rope_kw = dict(zip(_ROPE_ARGS, rope.kernel_args(), strict=True))
        rope_kw.update(HEAD=rope.head_size, CACHE_BLOCK=rope.kv_cache.shape[2])
    k_split = triton.cdiv(steps, split) * bk
    split = triton.cdiv(k, k_split)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    cnt = split_counters(x.device, max(m * n_blocks, 1 << 16))
    ptrs, strides = _args(w)
    grid = (n_blocks, m, split)
    pdl = pdl_args(x, "gemv" if rope is None else "qkv_rope")
    pre = bool(pdl) and envs.PAGEDLLM_GGUF_GEMV_PRELOAD and not flags & NOPRE if preload is None else preload
    if q8a:
        q8 = q8 if q8 is not None else quantize_q8(x)
        xq = q8.q.view(torch.int32)
        int8._gguf_gemv_q8a_kernel[grid](
            xq, q8.d, q8.s, ptrs[0], *ptrs[2:], part, out, cnt, m, n, k, xq.stride(0), q8.d.stride(0),
            out.stride(0), strides[0], *strides[2:], k_split, split, QT=w.qtype, BN=bn, BK=bk,
            EVEN_K=k % bk == 0, ASM=x.is_cuda, PRE=pre, OPQ=bool(flags & OPQ) and x.is_cuda,
            num_warps=nw, num_stages=ns, **pdl, **rope_kw,
        )  # fmt: skip
    else:
        kern._gguf_gemv_kernel[grid](
            x, *ptrs, part, out, cnt, m, n, k, x.stride(0), out.stride(0), *strides, k_split, split, _EXP0,
            QT=w.qtype, EPW=epw, G=g, BN=bn, BK=bk, EVEN_K=k % bk == 0, num_warps=nw, num_stages=ns, **pdl,
        )  # fmt: skip
    return out


_ROPE_ARGS = ("pos_ptr", "cos_sin_ptr", "slot_ptr", "kv_ptr", "stride_cs", "v_off", "stride_cb", "stride_ct",
              "stride_ch", "n_tok", "q_heads", "kv_heads")  # fmt: skip


def _rope_tile_fits(bn: int, n: int, rope: QKVRope) -> bool:
    """Whether programs of bn rows can each hold whole rotation pairs of one head (`rope_pair_rows`)."""
    hs = rope.head_size
    return bn % 2 == 0 and (hs // 2) % (bn // 2) == 0 and hs % 2 == 0 and n == (rope.q_heads + 2 * rope.kv_heads) * hs


def rope_fits(x: torch.Tensor, parts: Sequence[GGUFWeight], rope: QKVRope) -> bool:
    """Whether `gguf_matmul_triton(x, parts, rope=rope)` can do the RoPE epilogue: one part on the int8 GEMV,
    its launch of whole pairs (`_rope_tile_fits`), positions as a 1-D tensor."""
    if len(parts) != 1 or not isinstance(parts[0], GGUFTritonWeight):
        return False
    w, m, k = parts[0], x.numel() // x.shape[-1], x.shape[-1]
    if not (0 < m <= GEMV_MAX_M and w.qtype in PACKED_TYPES and int8_activations(w.qtype, x.dtype)):
        return False
    bn = gemv_config(w.qtype, m, w.rows, k).bn
    pos = rope.positions
    return _rope_tile_fits(bn, w.rows, rope) and pos.dim() == 1 and pos.is_contiguous() and pos.shape[0] >= m


def q8_twin_of(x: torch.Tensor, rows: torch.Tensor) -> Q8Act | None:
    """The q8 twin x's producer wrote with it (act_twin.py), if it quantizes these very rows ([M, K] `rows`)."""
    q8 = act_twin.twin_of(x)
    return q8 if isinstance(q8, Q8Act) and q8.q.shape == rows.shape else None


_DEQ_ELEMS = 1 << 25  # weights dequantized at a time for the prefill GEMM (64 MB of bf16 scratch)
_SCRATCH: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _dequant_scratch(device: torch.device, dtype: torch.dtype, n: int) -> torch.Tensor:
    """A buffer of >= n elements for `gguf_gemm_triton`'s dequantized chunks, one per (device, dtype), made once
    at its full size and never freed: CUDA graphs captured later (the piecewise prefill graphs) keep its
    address. The first prefill (the start-up's profile run, eager) makes it, so the KV cache sizing sees it."""
    buf = _SCRATCH.get((device, dtype))
    if buf is None or buf.numel() < n:
        buf = torch.empty(max(n, _DEQ_ELEMS), dtype=dtype, device=device)
        _SCRATCH[(device, dtype)] = buf  # (a larger one only for K > 2^19: an old one stays with its graphs)
    return buf


def dequantize_rows(w: GGUFTritonWeight, row0: int, out: torch.Tensor) -> torch.Tensor:
    """out [R, K] (unit column stride) = the dequantized rows row0 .. row0 + R of w, in out's dtype."""
    require_triton()
    rows, k = out.shape
    ptrs, strides = _args(w)
    if w.qtype in Q8A_TYPES:  # the pair layout: whole groups at a time
        bn, gb = 16, 8
        grid = (triton.cdiv(rows, bn), triton.cdiv(k, 32 * gb))
        kern._gguf_dequant_pair_kernel[grid](
            ptrs[0], *ptrs[2:], out, row0, rows, k, strides[0], *strides[2:], out.stride(0), QT=w.qtype, BN=bn,
            GB=gb, num_warps=4,
        )  # fmt: skip
        return out
    bn, bk = 32, 128
    grid = (triton.cdiv(rows, bn), triton.cdiv(k, bk))
    kern._gguf_dequant_kernel[grid](
        *ptrs, out, row0, rows, k, *strides, out.stride(0), QT=w.qtype, EPW=quants_per_word(w.qtype),
        G=group_size(w.qtype), BN=bn, BK=bk, num_warps=4,
    )  # fmt: skip
    return out


def gguf_gemm_triton(x: torch.Tensor, w: GGUFTritonWeight, out: torch.Tensor) -> torch.Tensor:
    """out [M, N] (a view with unit column stride) = x [M, K] @ dequant(w).T for prefill: the weight dequantized
    to x's dtype a chunk of rows at a time (`_gguf_dequant_kernel`, ~2.6 bytes moved a weight) and multiplied
    by cuBLAS. (A Triton GEMM dequantizing each tile in its loop redid the dequantization per 64 rows of x and
    was bound by its gathers: a 128-token prefill of an 8B Q4_1 model took ~170 ms on an H200, session 43.)"""
    m, k = x.shape
    n = w.rows
    if out.dtype != x.dtype:  # (float32 logits of 16-bit rows, e.g. prompt logprobs: float32 products)
        x = x.float()
    chunk = max(64, _DEQ_ELEMS // k // 64 * 64)
    buf = _dequant_scratch(x.device, x.dtype, min(n, chunk) * k)
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        wt = dequantize_rows(w, r0, buf[: (r1 - r0) * k].view(r1 - r0, k))
        torch.matmul(x, wt.t(), out=out[:, r0:r1])
    return out


def gguf_matmul_triton(
    x: torch.Tensor,
    parts: Sequence[GGUFWeight],
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    rope: QKVRope | None = None,
) -> torch.Tensor:
    """x [..., K] @ concat(parts).T (+ bias) -> [..., sum(rows)] in `out_dtype` (default x's dtype): each
    part writes its columns of one output (the GEMV for M <= 8 rows, else the dequant-GEMM). CUDA tensors,
    or CPU tensors under TRITON_INTERPRET=1 (the tests). No host synchronization: graph-capturable. `rope`
    (where `rope_fits`, which its caller asks first; no bias): RoPE and the K / V cache write in the GEMV's
    epilogue."""
    lead, k = x.shape[:-1], x.shape[-1]
    if rope is not None and (bias is not None or len(parts) != 1 or x.numel() // k > GEMV_MAX_M):
        raise ValueError("gguf: this projection cannot take the RoPE epilogue (see rope_fits)")
    n = sum(p.rows for p in parts)
    out_dtype = out_dtype or x.dtype
    x2 = x.reshape(-1, k)
    if x2.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        x2 = x2.float()
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m:
        if not (x2.is_cuda or interpreted()):
            raise RuntimeError("gguf: the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1)")
        sms = num_sms(x2.device) if x2.is_cuda else 4
        start = 0
        q8 = q8_twin_of(x, x2)
        for p in parts:
            if not isinstance(p, GGUFTritonWeight):
                raise TypeError("gguf: parts for the Triton kernels must come from gguf_triton.prepare")
            if p.cols != k or p.qtype not in PACKED_TYPES:
                raise ValueError(f"gguf: a {p.type_name} weight with {p.cols} columns cannot take {k} inputs")
            dst = out[:, start : start + p.rows]
            if m <= GEMV_MAX_M:
                if q8 is None and int8_activations(p.qtype, x2.dtype):
                    q8 = quantize_q8(x2)  # once for every int8-GEMV part
                gguf_gemv_triton(x2, p, dst, sms, q8=q8, rope=rope)
            else:
                gguf_gemm_triton(x2, p, dst)
            start += p.rows
    if bias is not None:
        out += bias.to(out.dtype)
    return out.view(*lead, n)
