"""Twins of activations: the kernel that makes a row also writes it quantized for the quantized linear after it.

Two kinds (a producer's `twin_kind`): "fp8", per-token e4m3 for an FP8 linear with dynamic activation scales
(below), and "q8", int8 per group of 32 (`Q8Act`, llama.cpp's q8_1) for the int8 decode GEMV of packed GGUF
weights on the GPU (`gguf_triton`), which otherwise quantizes its input in a launch of its own: the norms
and the SiLU-mul write it for decode rows (<= `gguf_triton.GEMV_MAX_M`), each group of 32 being local to the
program that writes it.

An FP8 W8A8 linear quantizes its input per token. In the decode GEMV (`w8a8_ops.w8a8_gemv`) every program does
that for the whole row again (an amax pass, then the division and conversion of each element it multiplies):
an H200 spent ~10 % of the FP8 GEMV on it (benchmarks/w8a8_gemv_sweep.py: 70.4 us a layer quantizing in the
GEMV, 63.4 us given the row quantized). For more rows the GEMM path quantizes in a pass of its own
(`quantize_rows`: 2 bytes read and 1 written an element, ~9 % of a W2-FP8 prefill step on an H200, session 39).
A kernel that holds a whole row in one program can write the e4m3 row and its scale as well
(`w8a8_ops.quant_row_e4m3`: the quantizer's scale and codes to the bit): the RMSNorm always, and the SiLU-mul
before down_proj for batches above `MAX_ROWS` (for decode rows its one-program-a-row version cost more than
the GEMV saved, benchmarks/NOTES.md, session 36). o_proj quantizes its input itself (it comes from the
attention's programs).

The hand-off is the output tensor itself: the producer attaches `(q, scale)` to the tensor it returns, and
the consumer uses them only when handed that very tensor object (a view, a slice or any op in between gives
a new object without them, so nothing stale can be read; `rows` slices a twin along with its tensor).
`link_producers` marks, once after loading, the producers whose output goes straight into an FP8 linear with
dynamic activation scales (Llama-family decoder layers: input norm -> q/k/v, post-attention norm -> gate/up,
SiLU-mul -> down). `PAGEDLLM_FP8_TWIN_PREFILL=0` keeps twins to decode rows (<= `MAX_ROWS`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from pagedllm import envs
from pagedllm.model_executor.layers import batch_invariant

MAX_ROWS = 4  # w8a8_ops.GEMV_MAX_M: the rows the FP8 decode GEMV takes
Q8_MAX_ROWS = 8  # gguf_triton.GEMV_MAX_M: the rows the int8 GEMV takes
_ATTR = "_pagedllm_act_twin"


class Q8Act(NamedTuple):
    """Activations quantized for the GGUF int8 GEMV (llama.cpp's q8_1), per group of 32 of each row: `q` int8
    [M, K], `d` = amax / 127 and `s` = d * sum(q), float32 [M, K / 32]."""

    q: torch.Tensor
    d: torch.Tensor
    s: torch.Tensor


def q8_buffers(n_rows: int, n_cols: int, device: torch.device) -> Q8Act:
    """Buffers for a q8 twin of [n_rows, n_cols] activations (n_cols a multiple of 32)."""
    groups = torch.empty((n_rows, n_cols // 32), dtype=torch.float32, device=device)
    return Q8Act(torch.empty((n_rows, n_cols), dtype=torch.int8, device=device), groups, torch.empty_like(groups))


def attach(t: torch.Tensor, *twin: torch.Tensor | Q8Act) -> torch.Tensor:
    """`t` with its quantized twin: (q [rows, K] e4m3, scale [rows, 1] float32 per token), or a `Q8Act`."""
    setattr(t, _ATTR, twin[0] if len(twin) == 1 else tuple(twin))
    return t


def twin_of(x: torch.Tensor) -> Any:
    """The twin attached to this tensor object by its producer, if any: an FP8 (q, scale) pair or a `Q8Act`."""
    return getattr(x, _ATTR, None)


def rows(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """x[start:stop], carrying the matching rows of x's twin if it has one (a chunked MLP's slices)."""
    part = x[start:stop]
    twin = twin_of(x)
    if twin is None:
        return part
    sliced = [t[start:stop] for t in twin]
    return attach(part, Q8Act(*sliced)) if isinstance(twin, Q8Act) else attach(part, *sliced)


def wants_twin(module: nn.Module, x: torch.Tensor, min_rows: int = 0) -> str | None:
    """The kind of twin `module` (a linked producer) should write for its input x's rows, or None: 16-bit rows
    on CUDA, not in batch-invariant mode, and for "fp8" (the GEMV's float16-pair path; the GEMM's row-wise
    scaling) more than `min_rows` of them and at most `MAX_ROWS` unless PAGEDLLM_FP8_TWIN_PREFILL; for "q8"
    1 to `Q8_MAX_ROWS` rows of a multiple of 32 columns (`min_rows` is the FP8 SiLU-mul's). The norm kernel
    with the twin may contract its float32 sum of squares differently (one more use of its registers), so an
    output element can differ by one 16-bit ulp from the plain kernel's: batch-dependent, as the GEMV already
    is outside that mode."""
    kind = getattr(module, "twin_kind", None)
    if kind is None:  # (every norm and SiLU-mul asks: the common answer first)
        return None
    n = x.numel() // x.shape[-1] if x.dim() else 0
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16) or batch_invariant.enabled():
        return None
    if kind == "q8":
        return kind if 0 < n <= Q8_MAX_ROWS and x.shape[-1] % 32 == 0 else None
    return kind if min_rows < n and (n <= MAX_ROWS or envs.PAGEDLLM_FP8_TWIN_PREFILL) else None


def link_producers(model: nn.Module) -> int:
    """Mark the producers whose output feeds a linear that takes a twin directly; returns how many. A decoder
    layer names its (producer, consumer) pairs in `twin_pairs()` (it alone knows its data flow); a consumer's
    quant method names the kind it takes (`twin_kind`: "fp8" for FP8 weights with dynamic activation scales,
    "q8" for GGUF weights on the GPU's int8 GEMV), a producer the kinds it can write (`twin_kinds`, default
    both)."""
    n = 0
    for m in model.modules():
        pairs = getattr(m, "twin_pairs", None)
        for producer, consumer in pairs() if pairs is not None else ():
            kind = getattr(getattr(consumer, "quant_method", None), "twin_kind", None)
            if kind is not None and kind in getattr(producer, "twin_kinds", ("fp8", "q8")):
                producer.twin_kind = kind
                n += 1
    return n
