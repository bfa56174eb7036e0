"""8-bit weight-and-activation GEMMs: FP8 (e4m3) and INT8, per-output-channel weight scales, activations
quantized per token on the fly (dynamic) or with a static per-tensor scale.

GPU: FP8 through `torch._scaled_mm` (row-wise scales, Hopper / Ada), INT8 through `torch._int_mm`; the
per-token quantization is one Triton pass. CPU (and shapes the GPU GEMMs refuse): the same math emulated
in float32 (quantized values times their scales), which is what the tests check the loaders against.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedllm import envs
from pagedllm.model_executor.layers.quantization import act_twin
from pagedllm.triton_utils import HAS_TRITON, interpreted, pdl_args, row_warps

if HAS_TRITON:
    import triton
    import triton.language as tl

    from pagedllm.triton_utils import pdl_enter

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
INT8_MAX = 127.0
_EPS = 1e-10


def fp8_supported(device: torch.device) -> bool:
    """Whether `device` multiplies FP8 natively (CUDA compute capability >= 8.9)."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_weight_per_channel(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] in `dtype` (FP8 e4m3 or int8), scale [N] float32) with q * scale ~= w."""
    qmax = FP8_MAX if dtype == FP8_DTYPE else INT8_MAX
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / qmax).clamp(min=_EPS)
    q = wf / scale[:, None]
    q = q.clamp(-qmax, qmax) if dtype == FP8_DTYPE else q.round().clamp(-128, 127)
    return q.to(dtype), scale


def _quantize_rows_torch(
    x: torch.Tensor, dtype: torch.dtype, static_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    qmax = FP8_MAX if dtype == FP8_DTYPE else INT8_MAX
    xf = x.float()
    if static_scale is None:
        scale = (xf.abs().amax(dim=-1, keepdim=True) / qmax).clamp(min=_EPS)
    else:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    q = xf / scale
    q = q.clamp(-qmax, qmax) if dtype == FP8_DTYPE else q.round().clamp(-128, 127)
    return q.to(dtype), scale.contiguous()


if HAS_TRITON:

    @triton.jit
    def _token_scale(amax, QMAX: tl.constexpr):
        """A row's per-token scale from its absolute maximum: one formula for every quantizer here (the twin's
        codes are the quantizer's only if their scales are the same bits)."""
        return tl.maximum(tl.math.div_rn(amax, QMAX), 1e-10)

    @triton.jit
    def _div_rn(x, s):
        """x / s (s a scalar) rounded as IEEE division, in three instructions an element after one reciprocal
        instead of div_rn's ~40 an element (which made the per-token quantizer compute-bound: ~45 % of the copy
        bandwidth on an H200): Markstein's correction, with rcp = RN(1 / s), q = RN(x rcp), then
        RN(q + (x - q s) rcp) with the remainder exact in an FMA, is the correctly rounded quotient (no over- or
        underflow here: |x / s| <= 448, s >= 1e-10)."""
        rcp = tl.math.div_rn(1.0, s)
        q = x * rcp
        return tl.fma(tl.fma(-q, s, x), rcp, q)

    @triton.jit
    def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, static_ptr, K, stride_x, QMAX: tl.constexpr,
                           IS_INT: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < K
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        if STATIC:
            scale = tl.load(static_ptr).to(tl.float32)
        else:
            scale = _token_scale(tl.max(tl.abs(x), axis=0), QMAX)
        q = _div_rn(x, scale)  # as torch's `/`: boundaries are crossed the same way
        if IS_INT:
            # round half to even, as torch.round
            r = tl.floor(q + 0.5)
            tie = (r - q) == 0.5
            r = tl.where(tie & ((r % 2) != 0), r - 1.0, r)
            q = tl.clamp(r, -128.0, 127.0)
        else:
            q = tl.clamp(q, -QMAX, QMAX)
        tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)

    @triton.jit
    def _row_scale(x_row, K, QMAX: tl.constexpr, AB: tl.constexpr):
        """The per-token scale of one activation row, read AB elements at a time: one or two L2 round trips
        before the weight stream starts (K / 512 of them, one per loop step, cost an H200 ~10 % of the GEMV)."""
        offs = tl.arange(0, AB)
        amax = tl.zeros([AB], dtype=tl.float32)
        for k0 in range(0, K, AB):
            amax = tl.maximum(amax, tl.abs(tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)))
        return _token_scale(tl.max(amax, axis=0), QMAX)

    @triton.jit
    def quant_row_e4m3(y, q_ptrs, s_ptr, mask):
        """One float32 row's per-token e4m3 quantization in one program (an FP8 twin, act_twin.py): exactly
        `_quant_rows_kernel`'s scale and codes (`_div_rn`; div_rn itself, ~40 instructions an element in one
        program, cost W3-FP8 more than the GEMVs gained)."""
        scale = _token_scale(tl.max(tl.abs(y), axis=0), 448.0)
        q = tl.clamp(_div_rn(y, scale), -448.0, 448.0)
        tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty), mask=mask)
        tl.store(s_ptr, scale)

    @triton.jit
    def _fma_f16x2(a, b, c):
        """a * b + c on float16 pairs, one `fma.rn.f16x2` per two elements."""
        return tl.inline_asm_elementwise(
            "fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.float16, is_pure=True, pack=2
        )

    @triton.jit
    def _w8a8_gemv_kernel(x_ptr, xq_ptr, xs_ptr, w_ptr, ws_ptr, static_ptr, bias_ptr, out_ptr, N, K, stride_xm,
                          stride_om, QMAX: tl.constexpr, IS_INT: tl.constexpr, STATIC: tl.constexpr,
                          HAS_BIAS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, AB: tl.constexpr,
                          H2: tl.constexpr, FLUSH: tl.constexpr, EVEN: tl.constexpr, PIPE: tl.constexpr,
                          PRE: tl.constexpr, PDL: tl.constexpr = 0):  # fmt: skip
        """Decode rows: the row's per-token quantization fused into the GEMV (each program reads the small
        activation row for its amax first), BN weight rows streamed along K; one launch per linear.

        H2 (FP8 weights, 16-bit activations): weights and quantized activations become float16 pairs (e4m3
        converts exactly, two values an instruction) multiplied-added by `fma.rn.f16x2` into float16 partial
        sums, added to the float32 accumulator every FLUSH steps: ~1 instruction a weight instead of the
        float32 path's 2.5, which bound the GEMV by issue rather than bytes on an H200 (1.72x -> 1.35x its
        floor per layer, benchmarks/w8a8_gemv_sweep.py). The activation is scaled by 2^-8 (exact) so that
        |w x| <= 448 * 1.75 and a FLUSH-term partial sum stays far inside float16's range; the float16 sums
        round at ~5e-4 relative, below the 16-bit output's own rounding. Float32 activations keep float32.

        PRE: the row comes quantized already (xq [M, K] e4m3, xs [M, 1]: its producer's twin, act_twin.py),
        so no program reads or converts the 16-bit row (70.4 -> 63.4 us a layer on an H200)."""
        pdl_enter(PDL)
        m = tl.program_id(0)
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BK)
        x_row = x_ptr + m * stride_xm
        if PRE:
            scale = tl.load(xs_ptr + m)
            x_row = xq_ptr + m * K
        elif STATIC:
            scale = tl.load(static_ptr).to(tl.float32)
        else:
            scale = _row_scale(x_row, K, QMAX, AB)
        inv = tl.math.div_rn(1.0, scale)
        acc = tl.zeros([BN, BK], dtype=tl.float32)
        # tl.range's stages make the loads cp.async copies; a plain range left them synchronous (they feed
        # elementwise math, which Triton's pipeliner does not take on its own): 88.6 -> 77.7 us a layer (H200)
        for k0 in tl.range(0, K, BK * FLUSH, num_stages=PIPE):
            if H2:
                a16 = tl.zeros([BN, BK], dtype=tl.float16)
            for j in tl.static_range(FLUSH):
                kk = k0 + j * BK + offs_k
                w_ptrs = w_ptr + offs_n[:, None] * K + kk[None, :]
                if EVEN:
                    xv = tl.load(x_row + kk)
                    w = tl.load(w_ptrs)
                else:
                    k_ok = kk < K
                    xv = tl.load(x_row + kk, mask=k_ok, other=0.0)
                    w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                if IS_INT:
                    xf = xv.to(tl.float32) / scale  # (see below on `/`)
                    r = tl.floor(xf + 0.5)
                    r = tl.where(((r - xf) == 0.5) & ((r % 2) != 0), r - 1.0, r)  # half to even
                    acc += w.to(tl.float32) * tl.clamp(r, -128.0, 127.0)[None, :]
                else:
                    if PRE:
                        xe = xv
                    elif H2:
                        # times the reciprocal, no clamp (the e4m3 conversion saturates at +-448 on the GPU):
                        # two instructions an element fewer than `/` and a clamp (the sweep's 70.4 us a layer)
                        xe = (xv.to(tl.float32) * inv).to(w_ptr.dtype.element_ty)
                    else:
                        # `/` (not IEEE div_rn as in `_quant_rows_kernel`): every program divides the whole
                        # row, and div_rn cost 15 % of the GEMV on an H100 (benchmarks/NOTES.md); the clamp
                        # keeps the interpreter's conversion in range.
                        xe = tl.clamp(xv.to(tl.float32) / scale, -QMAX, QMAX).to(w_ptr.dtype.element_ty)
                    if H2:
                        xh = xe.to(tl.float16) * 0.00390625
                        a16 = _fma_f16x2(w.to(tl.float16), tl.broadcast_to(xh[None, :], [BN, BK]), a16)
                    else:
                        acc += w.to(tl.float32) * xe.to(tl.float32)[None, :]
            if H2:
                acc += a16.to(tl.float32)
        res = tl.sum(acc, axis=1) * ((256.0 if H2 else 1.0) * scale) * tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)
        if HAS_BIAS:
            res += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * stride_om + offs_n, res.to(out_ptr.dtype.element_ty), mask=n_ok)


GEMV_MAX_M = 4


class W8A8Launch(NamedTuple):
    """The decode GEMV's launch: BN weight rows x BK per program and step, warps, cp.async stages, and whether
    FP8 weights with 16-bit activations take the float16-pair path (`PAGEDLLM_W8A8_H2`). The default is the best
    of benchmarks/w8a8_gemv_sweep.py on an H200 (Llama-3.1-8B's shapes, weights streamed from HBM)."""

    bn: int = 16
    bk: int = 512
    warps: int = 4
    stages: int = 3
    h2: bool = True


def w8a8_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    twin: tuple[torch.Tensor, torch.Tensor] | None = None,
    launch: W8A8Launch | None = None,
) -> torch.Tensor:
    """x [M <= GEMV_MAX_M, K] (contiguous rows) through `_w8a8_gemv_kernel` -> [M, N] in x's dtype. `twin`:
    x already quantized per token (e4m3 [M, K], float32 scales [M, 1]; FP8 weights, dynamic scales)."""
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    launch = launch or W8A8Launch()
    bn, bk = launch.bn, launch.bk
    h2 = launch.h2 and w.dtype == FP8_DTYPE and x.dtype in (torch.bfloat16, torch.float16) and envs.PAGEDLLM_W8A8_H2
    flush = 4 if h2 else 1
    ab = min(triton.next_power_of_2(k), 8192)
    qmax = FP8_MAX if w.dtype == FP8_DTYPE else INT8_MAX
    pre = twin is not None and input_scale is None and w.dtype == FP8_DTYPE and twin[0].shape == (m, k)
    xq, xs = twin if pre else (x, w_scale)  # type: ignore[misc]
    _w8a8_gemv_kernel[(m, triton.cdiv(n, bn))](
        x, xq, xs, w, w_scale, input_scale if input_scale is not None else w_scale,
        bias if bias is not None else w_scale, out, n, k, x.stride(0), out.stride(0), QMAX=qmax,
        IS_INT=w.dtype == torch.int8, STATIC=input_scale is not None, HAS_BIAS=bias is not None, BN=bn, BK=bk,
        AB=ab, H2=h2, FLUSH=flush, EVEN=n % bn == 0 and k % (bk * flush) == 0, PIPE=launch.stages, PRE=pre,
        num_warps=launch.warps, **pdl_args(x, "w8a8"),
    )  # fmt: skip
    return out


def quantize_rows(
    x: torch.Tensor, dtype: torch.dtype, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] in `dtype`, scale [M, 1] float32): per-token amax scales, or `static_scale`."""
    use_triton = HAS_TRITON and (x.is_cuda or interpreted()) and x.shape[1] <= 32768
    if not use_triton or x.shape[0] == 0:
        return _quantize_rows_torch(x, dtype, static_scale)
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty(m, k, dtype=dtype, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    qmax = FP8_MAX if dtype == FP8_DTYPE else INT8_MAX
    static = static_scale if static_scale is not None else s
    block = triton.next_power_of_2(k)
    _quant_rows_kernel[(m,)](
        x, q, s, static, k, x.stride(0), QMAX=qmax, IS_INT=dtype == torch.int8,
        STATIC=static_scale is not None, BLOCK=block, num_warps=row_warps(block),
    )  # fmt: skip
    return q, s


def _emulated(
    xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    out = (xq.float() @ w.float().t()) * x_scale * w_scale[None, :]
    return out if bias is None else out + bias.float()


def w8a8_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x [..., K] @ (w [N, K] * w_scale [N, None]).T with x quantized to w's dtype (FP8 or int8) per token
    (or with the static `input_scale`); the result is in x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = w.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    twin = act_twin.twin_of(x) if envs.PAGEDLLM_FP8_ACT_TWIN else None
    if isinstance(twin, act_twin.Q8Act):  # (a GGUF int8 GEMV's: not an e4m3 row)
        twin = None
    if HAS_TRITON and 0 < m <= GEMV_MAX_M and (x.is_cuda or interpreted()):
        return w8a8_gemv(x2.contiguous(), w, w_scale, input_scale, bias, twin).view(*lead, n)
    if twin is not None and input_scale is None and w.dtype == FP8_DTYPE and twin[0].shape == (m, k):
        xq, xs = twin  # the producer's quantization of these very rows (act_twin.py): no pass of our own
    else:
        xq, xs = quantize_rows(x2, w.dtype, input_scale)
    out: torch.Tensor
    if m == 0:
        out = x2.new_empty(0, n)
    elif x.is_cuda and w.dtype == FP8_DTYPE and k % 16 == 0 and n % 16 == 0:
        if x.dtype == torch.float32:
            # Row-wise scaling only writes bfloat16; a float32 model keeps float32 sums: unit tensor-wise
            # scales, the row and column scales applied after (the products of FP8 values are exact).
            one = torch.ones((), dtype=torch.float32, device=x.device)
            out = torch._scaled_mm(xq, w.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
            out = out * xs * w_scale[None, :]
        else:  # row-wise scaling, bfloat16 output (cast after for fp16); the bias is added after
            out = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=w_scale.view(1, n), out_dtype=torch.bfloat16)
        if bias is not None:
            out = out + bias.to(out.dtype)
    elif x.is_cuda and w.dtype == torch.int8 and k % 8 == 0 and n % 8 == 0:
        pad = 17 - m if m <= 16 else 0  # _int_mm needs more than 16 rows
        a = torch.nn.functional.pad(xq, (0, 0, 0, pad)) if pad else xq
        acc = torch._int_mm(a, w.t())[:m]
        out = acc.float() * xs * w_scale[None, :]
        if bias is not None:
            out = out + bias.float()
    else:
        out = _emulated(xq, xs, w, w_scale, bias)
    return out.to(x.dtype).view(*lead, n)
