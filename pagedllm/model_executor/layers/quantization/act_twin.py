"""FP8 twins of activations: the kernel that makes a row also writes it quantized for the FP8 linear after it.

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

import torch
from torch import nn

from pagedllm import envs
from pagedllm.model_executor.layers import batch_invariant

MAX_ROWS = 4  # w8a8_ops.GEMV_MAX_M: the rows the decode GEMV takes
_ATTR = "_pagedllm_fp8_twin"


def attach(t: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`t` with its quantized twin: q [rows, K] e4m3, scale [rows, 1] float32 (per token)."""
    setattr(t, _ATTR, (q, scale))
    return t


def twin_of(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The twin attached to this tensor object by its producer, if any."""
    return getattr(x, _ATTR, None)


def rows(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """x[start:stop], carrying the matching rows of x's twin if it has one (a chunked MLP's slices)."""
    part = x[start:stop]
    twin = twin_of(x)
    return attach(part, twin[0][start:stop], twin[1][start:stop]) if twin is not None else part


def wants_twin(module: nn.Module, x: torch.Tensor, min_rows: int = 0) -> bool:
    """Whether `module` (a linked producer) should write a twin for its input x's rows: 16-bit rows (the
    GEMV's float16-pair path; the GEMM's row-wise scaling), more than `min_rows` of them, and at most
    `MAX_ROWS` unless PAGEDLLM_FP8_TWIN_PREFILL; not in batch-invariant mode. The norm kernel with the twin may
    contract its float32 sum of squares differently (one more use of its registers), so an output element can
    differ by one 16-bit ulp from the plain kernel's: batch-dependent, as the GEMV already is outside that mode."""
    if not getattr(module, "fp8_twin", False):  # (every norm and SiLU-mul asks: the common answer first)
        return False
    n = x.numel() // x.shape[-1] if x.dim() else 0
    return (
        x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and min_rows < n
        and (n <= MAX_ROWS or envs.PAGEDLLM_FP8_TWIN_PREFILL)
        and not batch_invariant.enabled()
    )


def link_producers(model: nn.Module) -> int:
    """Mark the producers whose output feeds an FP8 dynamic-scale linear directly; returns how many. A decoder layer
    names its (producer, consumer) pairs in `twin_pairs()` (it alone knows its data flow); a consumer takes a
    twin where its quant method says so (`takes_fp8_twin`: FP8 weights, dynamic activation scales)."""
    n = 0
    for m in model.modules():
        pairs = getattr(m, "twin_pairs", None)
        for producer, consumer in pairs() if pairs is not None else ():
            if getattr(getattr(consumer, "quant_method", None), "takes_fp8_twin", False):
                producer.fp8_twin = True
                n += 1
    return n
