"""Mixed precision for float32 encoder models on the CPU: bf16 GEMMs inside an otherwise float32 model.

What autocast would do, done once at load time: the encoder layers' linear weights are packed for oneDNN in
bf16 (`layers/cpu_gemm.py`), each GEMM takes its input cast to bf16, accumulates in float32 and gives a bf16
output, which the next GEMM takes as it is (fc1 -> fc2); the residual stream, the LayerNorms, attention
(scores, softmax), the embeddings, the pooling and the heads (BERT's pooler, classifiers) stay float32. On a
CPU with native bf16 dot products (AVX512-BF16, AMX) the GEMMs run about 2x faster than in float32, and the
error is that of rounding each GEMM's inputs and outputs to bf16 (2^-9 relative), which the float32 residual
stream does not accumulate: all-MiniLM-L6-v2's embeddings stay at cosine >= 0.9999 to sentence-transformers'
float32 ones, where a whole-bf16 model falls to 0.9998 (benchmarks/NOTES.md, "Pooling (issue 22)").

When: `dtype="auto"` (the default) for an encoder-only model with a float32 checkpoint, on a CPU with native
bf16 (where "auto" would otherwise load the whole model in bf16). `dtype="float32"` stays float32 throughout.
`PAGEDLLM_CPU_ENCODER_BF16_GEMM`: "auto" (that rule), "1" (also with `dtype="float32"`, and without native
bf16), "0" (never: "auto" then loads the model in bf16 as for other models)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm import envs
from pagedllm.logger import init_logger

logger = init_logger(__name__)

MODES = ("auto", "1", "0")


def _checkpoint_dtype(hf_config: Any) -> torch.dtype:
    cfg = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(cfg, str):
        cfg = getattr(torch, cfg.removeprefix("torch."), None)
    return cfg if isinstance(cfg, torch.dtype) else torch.float32


def choose(requested: str | torch.dtype, hf_config: Any, device: str) -> bool:
    """Whether an encoder-only model loaded with `dtype=requested` gets float32 weights and bf16 GEMMs."""
    from pagedllm.platforms import current_platform

    mode = envs.PAGEDLLM_CPU_ENCODER_BF16_GEMM
    if mode not in MODES:
        raise ValueError(f"PAGEDLLM_CPU_ENCODER_BF16_GEMM: expected one of {', '.join(MODES)}, got {mode!r}")
    if device != "cpu" or mode == "0":
        return False
    req = str(requested).removeprefix("torch.").lower()
    auto_fp32 = req == "auto" and _checkpoint_dtype(hf_config) == torch.float32
    if mode == "1":
        return auto_fp32 or req in ("float32", "float")
    return auto_fp32 and current_platform.cpu_has_native_bf16()


def pack_bf16_gemms(model: nn.Module) -> int:
    """Pack the encoder layers' linear weights in bf16 and give the encoder bf16 GEMM inputs; returns how many
    were packed (0 where this oneDNN cannot: the model then stays float32). The caller packs the rest (heads)."""
    from pagedllm.model_executor.layers.cpu_gemm import pack_module, pack_supported
    from pagedllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from pagedllm.model_executor.models.bert import BertEncoderModel

    enc = getattr(model, "model", None)
    if not isinstance(enc, BertEncoderModel) or not (pack_supported(torch.bfloat16) and pack_supported(torch.float32)):
        logger.info("bf16 GEMMs unavailable for %s here: float32 throughout", type(model).__name__)
        return 0
    n = 0
    for module in enc.layers.modules():
        if isinstance(module, LinearBase) and isinstance(module.quant_method, UnquantizedLinearMethod):
            n += pack_module(module, release=True, dtype=torch.bfloat16)
    enc.gemm_dtype = torch.bfloat16
    logger.info("Encoder: float32 with bf16 GEMMs (%d weights); dtype='float32' keeps float32 GEMMs", n)
    return n
