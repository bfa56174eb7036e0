"""Prepacked (oneDNN) weights for the CPU linear layers (bfloat16 and float32).

`F.linear` hands the BLAS a plain [out, in] weight on every call, which it re-blocks each time; packing
once after loading takes that off every step (about 2x in bf16 at 1 token on the dev CPU:
benchmarks/NOTES.md, "Tuning figures behind code heuristics"). The plain weight is released after
packing, so memory stays at one copy. `PAGEDLLM_CPU_PACKED_GEMM=0` turns packing off.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from pagedllm import envs
from pagedllm.logger import init_logger
from pagedllm.model_executor.layers import batch_invariant

logger = init_logger(__name__)


_PACKED_DTYPES = {torch.bfloat16, torch.float32}


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in _PACKED_DTYPES
        and weight.dim() == 2
        and (envs.PAGEDLLM_CPU_PACKED_GEMM or batch_invariant.enabled())
        and pack_supported(weight.dtype)
    )


@functools.cache
def pack_supported(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN packs `dtype` weights (bf16 needs AVX-512 or AVX-NE-CONVERT): probed once."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=dtype))
    except RuntimeError as e:
        logger.info("CPU weight packing unavailable for %s (%s)", dtype, e)
        return False
    return True


def packed_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    gelu: str | None = None,
) -> torch.Tensor:
    """x @ W.T + bias with W packed by `pack_module`; `gelu` ("none" = erf, "tanh") fuses GELU into the GEMM's
    epilogue (oneDNN post-op: one pass over the output fewer). A weight packed in another dtype than `x`'s
    (bf16 weights of a float32 model, `pooling/cpu_mixed.py`) gets `x` cast to it, and the result is cast back:
    callers that want the GEMM's dtype pass `x` in it."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:
        return x.new_empty(*lead, out_features)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if x2.dtype != packed.dtype:
        return (
            packed_linear(x2.to(packed.dtype), packed, bias, out_features, gelu).to(x.dtype).view(*lead, out_features)
        )
    if batch_invariant.enabled():
        return batch_invariant.tiled_rows(
            x2, lambda t: torch.ops.mkldnn._linear_pointwise(t, packed, bias, "none", [], "")
        ).view(*lead, out_features)
    if gelu is not None:
        y = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "gelu", [], gelu)
    else:
        y = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    return y.view(*lead, out_features)


def pack_module(module: nn.Module, release: bool, dtype: torch.dtype | None = None) -> bool:
    """Give `module` (with a 2-D `weight`) a `packed_weight` the forward will use. `release` drops the
    plain weight's storage (it is no longer read; keeps memory at one copy of the weights). `dtype`: pack a
    copy cast to it (the GEMM then runs in it, `packed_linear`); default the weight's own."""
    weight = getattr(module, "weight", None)
    if weight is None or not can_pack(weight) or (dtype is not None and not pack_supported(dtype)):
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype or weight.dtype))
    except RuntimeError as e:  # a oneDNN build without this path: stay on F.linear
        logger.info("CPU weight packing unavailable (%s)", e)
        return False
    module.packed_weight = packed
    module.packed_out_features, module.packed_in_features = weight.shape
    if release:
        weight.data = torch.empty(0, dtype=weight.dtype)
    return True
