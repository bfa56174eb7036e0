"""What a loaded model becomes on a CUDA device before its first step: module rewrites that change how the
layers run, not what they compute (each bit-identical or within its stated rounding, each with its switch).

* dense MLP blocks in token chunks (`PAGEDLLM_MLP_CHUNK_TOKENS`; not with LoRA, whose hooks span the batch),
* activation twins: norms (and SiLU-muls) that also write their decode rows quantized for the FP8 linear
  or GGUF int8 GEMV after them (`quantization/act_twin.py`, `PAGEDLLM_FP8_ACT_TWIN`),
* at two tensor-parallel ranks, the row-parallel layers' all-reduce fused into the next norm
  (`distributed/tp_fusion.py`, `PAGEDLLM_TP_ALLREDUCE`).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.logger import init_logger

logger = init_logger(__name__)


def wants_fused_tp_norms(config: EngineConfig, device: torch.device, has_lora: bool) -> bool:
    """CUDA, two tensor-parallel ranks and no pipeline stages (the measured case; PAGEDLLM_TP_ALLREDUCE=fused,
    the default), and nothing that reads a layer's output between layers (LoRA's hooks on o_proj /
    down_proj, EAGLE-3's on the layers' inputs)."""
    pc = config.parallel_config
    return (
        pc.tensor_parallel_size == 2
        and pc.pipeline_parallel_size == 1
        and device.type == "cuda"
        and envs.PAGEDLLM_TP_ALLREDUCE == "fused"
        and not has_lora
        and config.speculative_config is None
    )


def apply_cuda_rewrites(
    model: nn.Module, config: EngineConfig, device: torch.device, dtype: torch.dtype, max_num_tokens: int,
    has_lora: bool,
) -> None:  # fmt: skip
    """The rewrites above that apply to `model` on `device` (none on the CPU)."""
    if device.type != "cuda":
        return
    if not has_lora and envs.PAGEDLLM_MLP_CHUNK_TOKENS > 0:
        from pagedllm.model_executor.models.llama import chunk_mlps

        chunk_mlps(model, envs.PAGEDLLM_MLP_CHUNK_TOKENS)
    if envs.PAGEDLLM_FP8_ACT_TWIN:
        from pagedllm.model_executor.layers.quantization.act_twin import link_producers

        if linked := link_producers(model):
            logger.info("Activation twins: %d norms / SiLU-muls also write their output quantized", linked)
    if wants_fused_tp_norms(config, device, has_lora):
        from pagedllm.distributed.tp_fusion import fuse_model

        fuse_model(model, max_num_tokens, dtype, device)
