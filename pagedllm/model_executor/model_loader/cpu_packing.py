"""After loading on the CPU: the model's linear layers and LM head get prepacked oneDNN weights
(`model_executor/layers/cpu_gemm.py` says why and what it gains)."""

from __future__ import annotations

from torch import nn

from pagedllm.model_executor.layers.cpu_gemm import pack_module
from pagedllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from pagedllm.model_executor.layers.vocab_embedding import ParallelLMHead


def pack_cpu_weights(model: nn.Module) -> int:
    """Pack every unquantized linear layer and the LM head of a CPU model; returns how many were packed.
    Tied LM heads keep the embedding's plain weight (the embedding lookup reads it); layers packed already
    are left as they are."""
    embeddings = {id(m.weight) for m in model.modules() if type(m).__name__ == "VocabParallelEmbedding"}
    n = 0
    for module in model.modules():
        if getattr(module, "packed_weight", None) is not None:  # packed already (e.g. `pooling/cpu_mixed.py`)
            continue
        if isinstance(module, LinearBase) and isinstance(
            getattr(module, "quant_method", None), UnquantizedLinearMethod
        ):
            n += pack_module(module, release=True)
        elif isinstance(module, ParallelLMHead) and getattr(module, "gguf_weight", None) is None:
            n += pack_module(module, release=id(module.weight) not in embeddings)
    return n
