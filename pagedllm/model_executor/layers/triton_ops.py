"""Fused Triton kernels for the per-layer elementwise work of Llama-family decoders (CUDA only).

Each kernel replaces a chain of small PyTorch kernels with one launch and one read/write of its tensors:

* `rms_norm` / `fused_add_rms_norm`: RMSNorm, optionally after the residual add (`x + residual`, x optionally
  the unsummed parts of a MoE block's output),
* `silu_and_mul`: `silu(x[:, :d]) * x[:, d:]`,

(RoPE with the KV-cache write, which the attention backend uses, lives in `attention/ops/triton_rope_cache.py`.)

Rounding follows the PyTorch references in `layernorm.py` and `activation.py`
step by step (statistics in float32, a cast to the activation dtype wherever the reference holds an
intermediate in that dtype), so the fused results match the unfused ones to within an ulp or so.

The import is guarded: on a box without Triton `HAS_TRITON` is False and the callers keep their PyTorch
code; nothing here launches or compiles a kernel at import time.
"""

from __future__ import annotations

import torch

from pagedllm import envs
from pagedllm.model_executor.layers.quantization import act_twin
from pagedllm.triton_utils import HAS_TRITON, pdl_args, require_triton, row_warps
from pagedllm.utils import next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl

    from pagedllm.model_executor.layers.quantization.gguf_triton_int8 import quant_groups_q8
    from pagedllm.model_executor.layers.quantization.w8a8_ops import quant_row_e4m3
    from pagedllm.triton_utils import pdl_enter, silu_mul


def use_triton_ops(x: torch.Tensor) -> bool:
    """True where the fused kernels apply: Triton is installed and the tensor lives on a CUDA device."""
    return HAS_TRITON and x.is_cuda


if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        res_ptr,
        out_ptr,
        res_out_ptr,
        w_ptr,
        stride_x,
        stride_r,
        stride_o,
        stride_ro,
        n_cols,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
        PARTS: tl.constexpr = 1,
        q_ptr=None,  # QUANT: [rows, n_cols] e4m3 (1) / int8 (2) out
        qs_ptr=None,  # QUANT: [rows] float32 scales (1) / [rows, n_cols / 32] float32 d (2) out
        qm_ptr=None,  # QUANT 2: [rows, n_cols / 32] float32 d * sum(q) out
        QUANT: tl.constexpr = 0,  # also write the output quantized, 1: FP8, 2: q8 (quantization/act_twin.py)
        SPLIT: tl.constexpr = 1,  # programs a row: each reads the whole row for the statistics, writes 1/SPLIT
        PDL: tl.constexpr = 0,
    ):
        SB: tl.constexpr = BLOCK // SPLIT
        col0 = tl.program_id(1) * SB if SPLIT > 1 else 0
        own = col0 + tl.arange(0, SB)  # this program's columns
        own_ok = own < n_cols
        # The weights before the PDL wait (no kernel of a step writes them): their load overlaps the kernel
        # before instead of following the reduction.
        w = tl.load(w_ptr + own, mask=own_ok, other=0.0)
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n_cols
        x = _norm_input(x_ptr, res_ptr, row, stride_x, stride_r, offs, mask, n_cols, HAS_RESIDUAL, PARTS)
        if SPLIT > 1:
            # This program's columns, read again (in its own layout) and summed the same way: issued with the
            # whole row's loads, not after the reduction (one L2 round trip off the chain; the same values)
            x_own = _norm_input(x_ptr, res_ptr, row, stride_x, stride_r, own, own_ok, n_cols, HAS_RESIDUAL, PARTS)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / n_cols
        rstd = 1.0 / tl.sqrt(var + eps)
        if SPLIT > 1:
            offs = own
            mask = own_ok
            x = x_own
            xf = x.to(tl.float32)
        if HAS_RESIDUAL:
            tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
        normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
        y = (w.to(tl.float32) * normed).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_o + offs, y, mask=mask)
        _twin_out(y, q_ptr, qs_ptr, qm_ptr, row, col0, offs, mask, n_cols, QUANT, SB)

    @triton.jit
    def _norm_input(x_ptr, res_ptr, row, stride_x, stride_r, offs, mask, n_cols, HAS_RESIDUAL: tl.constexpr,
                    PARTS: tl.constexpr):  # fmt: skip
        """The norm's input at columns `offs` of a row: x (the sum of its PARTS rows, rounded: a MoE block's k
        expert outputs) plus the residual, rounded to the activation dtype as the reference adds."""
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        if PARTS > 1:
            xs = x.to(tl.float32)
            for p in tl.static_range(1, PARTS):
                xs += tl.load(x_ptr + row * stride_x + p * n_cols + offs, mask=mask, other=0.0).to(tl.float32)
            x = xs.to(x_ptr.dtype.element_ty)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        return x

    @triton.jit
    def _twin_out(y, q_ptr, qs_ptr, qm_ptr, row, col0, offs, mask, n_cols, QUANT: tl.constexpr, BLOCK: tl.constexpr):
        """A producer's twin of its 16-bit output y (columns col0 + [0, BLOCK) of the row; act_twin.py): 1, the
        row's per-token e4m3 (one program a row); 2, its int8 groups of 32 (`quant_groups_q8`)."""
        if QUANT == 1:
            quant_row_e4m3(y.to(tl.float32), q_ptr + row * n_cols + offs, qs_ptr + row, mask)
        elif QUANT == 2:
            g_row = row * (n_cols // 32)
            quant_groups_q8(y.to(tl.float32), q_ptr + row * n_cols, qs_ptr + g_row, qm_ptr + g_row, col0, n_cols, BLOCK)

    @triton.jit
    def _silu_and_mul_kernel(
        x_ptr,
        out_ptr,
        stride_x,
        stride_o,
        d,
        BLOCK: tl.constexpr,
        q_ptr=None,  # QUANT: [rows, d] e4m3 (1) / int8 (2) out
        qs_ptr=None,  # QUANT: [rows] float32 (1) / [rows, d / 32] float32 d (2) out
        qm_ptr=None,  # QUANT 2: [rows, d / 32] float32 d * sum(q) out
        # also write the output quantized (act_twin.py), 1: FP8, one program a row (BLOCK >= d); 2: q8 groups
        QUANT: tl.constexpr = 0,
        PDL: tl.constexpr = 0,
    ):
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < d
        g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + d + offs, mask=mask, other=0.0).to(tl.float32)
        y = silu_mul(g, u, out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_o + offs, y, mask=mask)
        _twin_out(y, q_ptr, qs_ptr, qm_ptr, row, tl.program_id(1) * BLOCK, offs, mask, d, QUANT, BLOCK)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D [rows, cols] tensor whose last dim is contiguous (a view where possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _twin(kind: str | None, n_rows: int, n_cols: int, device: torch.device) -> tuple[torch.Tensor, ...] | None:
    """Buffers of an output's twin of `kind` (quantization/act_twin.py): "fp8", e4m3 rows and one float32
    scale each; "q8", an `act_twin.Q8Act`; None: no twin."""
    if kind == "q8":
        return act_twin.q8_buffers(n_rows, n_cols, device)
    if kind is None:
        return None
    return (
        torch.empty((n_rows, n_cols), dtype=torch.float8_e4m3fn, device=device),
        torch.empty((n_rows, 1), dtype=torch.float32, device=device),
    )


def _twin_args(twin: tuple[torch.Tensor, ...] | None) -> dict[str, object]:
    """The kernels' QUANT keywords for a twin's buffers."""
    if twin is None:
        return {}
    q8 = isinstance(twin, act_twin.Q8Act)
    return dict(q_ptr=twin[0], qs_ptr=twin[1], qm_ptr=twin[2] if q8 else None, QUANT=2 if q8 else 1)


def _with_twin(out: torch.Tensor, twin: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
    if twin is None:
        return out
    return act_twin.attach(out, twin) if isinstance(twin, act_twin.Q8Act) else act_twin.attach(out, *twin)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, twin_kind: str | None = None) -> torch.Tensor:
    """`weight * norm(x)` over the last dim (float32 statistics), in x's dtype; `twin_kind` ("fp8" / "q8"):
    the output also carries its quantization (quantization/act_twin.py)."""
    require_triton()
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    twin = _twin(twin_kind, x2.shape[0], x2.shape[1], x.device)
    _launch_norm(x2, None, out, None, weight, eps, 1, twin)
    return _with_twin(out.view(x.shape), twin)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, twin_kind: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weight * norm(x + residual), x + residual)`: one read of x and residual, two writes.

    x may carry one more dim than the residual, [..., P, H]: its P parts are summed first (float32, rounded to
    x's dtype, as `triton_moe.moe_sum` does), so a MoE block's unsummed expert outputs need no launch of their
    own. The outputs are fresh tensors (inputs are left untouched), so callers may still hold x or residual.
    """
    require_triton()
    parts = x.shape[-2] if x.dim() == residual.dim() + 1 else 1
    r2 = _rows(residual)
    x2 = x.reshape(-1, parts * x.shape[-1]) if parts > 1 else _rows(x)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(r2.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty(r2.shape, dtype=x.dtype, device=x.device)
    twin = _twin(twin_kind, r2.shape[0], r2.shape[1], x.device)
    _launch_norm(x2, r2, out, res_out, weight, eps, parts, twin)
    return _with_twin(out.view(residual.shape), twin), res_out.view(residual.shape)


def _launch_norm(
    x2: torch.Tensor,
    r2: torch.Tensor | None,
    out: torch.Tensor,
    res_out: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    parts: int,
    twin: tuple[torch.Tensor, ...] | None,
) -> None:
    """`_rms_norm_kernel` over out's rows: with the residual `r2` (sum written to `res_out`) or without."""
    n_rows, n_cols = out.shape
    if not n_rows:
        return
    r2 = x2 if r2 is None else r2  # (unread without HAS_RESIDUAL)
    res = out if res_out is None else res_out
    block = next_pow2(n_cols)
    split = _norm_split(n_rows, block, twin)
    _rms_norm_kernel[(n_rows, split)](
        x2,
        r2,
        out,
        res,
        weight,
        x2.stride(0),
        r2.stride(0),
        out.stride(0),
        res.stride(0),
        n_cols,
        eps,
        HAS_RESIDUAL=res_out is not None,
        BLOCK=block,
        PARTS=parts,
        SPLIT=split,
        num_warps=row_warps(block),  # (the same with a split: the statistics summed in the same order)
        **_twin_args(twin),
        **pdl_args(x2, "norm"),
    )


def _norm_split(n_rows: int, block: int, twin: tuple[torch.Tensor, ...] | None) -> int:
    """Programs a row of the norm (`PAGEDLLM_NORM_COL_SPLIT`, a power of two): decode batches only (one program a
    row is a latency chain there: load, reduce, normalize, quantize), no per-row FP8 twin (its scale is the
    whole row's), at least 32 columns (a q8 group) a program."""
    if n_rows > act_twin.Q8_MAX_ROWS:
        return 1
    s = envs.PAGEDLLM_NORM_COL_SPLIT
    if s <= 1 or s & (s - 1) or block < 32 * s:
        return 1
    return 1 if twin is not None and not isinstance(twin, act_twin.Q8Act) else s


def silu_and_mul(x: torch.Tensor, twin_kind: str | None = None) -> torch.Tensor:
    """`silu(x[..., :d]) * x[..., d:]` for x of width 2*d; `twin_kind`: the output also carries its
    quantization (quantization/act_twin.py), "fp8" per token (one program a row) or "q8" per group of 32."""
    require_triton()
    x2 = _rows(x)
    n_rows, width = x2.shape
    d = width // 2
    out = torch.empty((n_rows, d), dtype=x.dtype, device=x.device)
    twin = _twin(twin_kind, n_rows, d, x.device)
    if n_rows:
        one = twin_kind == "fp8"  # (the row's amax in one program)
        block = next_pow2(d) if one else min(1024, next_pow2(d))
        _silu_and_mul_kernel[(n_rows, triton.cdiv(d, block))](
            x2, out, x2.stride(0), out.stride(0), d, BLOCK=block, num_warps=row_warps(block) if one else 4,
            **_twin_args(twin), **pdl_args(x2, "silu"),
        )  # fmt: skip
    return _with_twin(out.view(*x.shape[:-1], d), twin)
