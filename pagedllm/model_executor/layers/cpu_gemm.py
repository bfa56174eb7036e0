"""Prepacked (oneDNN) weights for the CPU linear layers (bfloat16 and float32).

`F.linear` hands the BLAS a plain [out, in] weight on every call, which it re-blocks each time; packing
once after loading takes that off every step. Measured on the 2-core dev machine (AMX bf16), SmolLM2-135M's
linear shapes per step: bf16 11.9 -> 5.5 ms at 1 token, 21.2 -> 12.9 ms at 64; float32 29 -> 17 ms at 7
tokens, 75 -> 66 ms at 64, but 9.5 -> 12 ms at 1 token (benchmarks/NOTES.md). The plain weight is
released after packing, so memory stays at one copy. `PAGEDLLM_CPU_PACKED_GEMM=0` turns packing off.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

from pagedllm.logger import init_logger

logger = init_logger(__name__)


_PACKED_DTYPES = {torch.bfloat16, torch.float32}


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in _PACKED_DTYPES
        and weight.dim() == 2
        and os.environ.get("PAGEDLLM_CPU_PACKED_GEMM", "1") != "0"
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


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x @ W.T + bias with W packed by `pack_module`."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:
        return x.new_empty(*lead, out_features)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    return y.view(*lead, out_features)


def pack_module(module: nn.Module, release: bool) -> bool:
    """Give `module` (with a 2-D `weight`) a `packed_weight` the forward will use. `release` drops the
    plain weight's storage (it is no longer read; keeps memory at one copy of the weights)."""
    weight = getattr(module, "weight", None)
    if weight is None or not can_pack(weight):
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except RuntimeError as e:  # a oneDNN build without this path: stay on F.linear
        logger.info("CPU weight packing unavailable (%s)", e)
        return False
    module.packed_weight = packed
    module.packed_out_features, module.packed_in_features = weight.shape
    if release:
        weight.data = torch.empty(0, dtype=weight.dtype)
    return True


def pack_cpu_weights(model: nn.Module) -> int:
    """Pack every unquantized linear layer and the LM head of a CPU model; returns how many were packed.
    Tied LM heads keep the embedding's plain weight (the embedding lookup reads it)."""
    from pagedllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from pagedllm.model_executor.layers.vocab_embedding import ParallelLMHead

    embeddings = {id(m.weight) for m in model.modules() if type(m).__name__ == "VocabParallelEmbedding"}
    n = 0
    for module in model.modules():
        if isinstance(module, LinearBase) and isinstance(
            getattr(module, "quant_method", None), UnquantizedLinearMethod
        ):
            n += pack_module(module, release=True)
        elif isinstance(module, ParallelLMHead) and getattr(module, "gguf_weight", None) is None:
            n += pack_module(module, release=id(module.weight) not in embeddings)
    return n
