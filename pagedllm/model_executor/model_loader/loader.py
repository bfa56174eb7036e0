"""Building a model from its config and filling in its weights."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from pagedllm import envs
from pagedllm.attention.kv_scales import split_kv_scales
from pagedllm.config import ModelConfig
from pagedllm.model_executor.layers.quantization.base import (
    QuantizationConfig,
    get_quantization_config,
    set_current_quant_config,
)
from pagedllm.model_executor.model_loader.gguf_loader import gguf_weights_iterator
from pagedllm.model_executor.model_loader.weight_utils import (
    get_pt_files,
    get_safetensors_files,
    initialize_dummy_weights,
    pt_weights_iterator,
    safetensors_weights_iterator,
)
from pagedllm.model_executor.models.registry import get_model_class

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def get_architectures(hf_config: Any) -> list[str]:
    """`hf_config.architectures`, or one inferred from `model_type` (GGUF-derived configs have none)."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:
        mt = getattr(hf_config, "model_type", None)
        archs = [_MODEL_TYPE_TO_ARCH.get(mt, "LlamaForCausalLM")]  # type: ignore[arg-type]
    return archs


@contextmanager
def _default_dtype(dtype: torch.dtype):  # noqa: ANN202
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def build_model(
    hf_config: Any, dtype: torch.dtype, device: torch.device | str, quant_config: QuantizationConfig | None = None
) -> nn.Module:
    """Instantiates the model (uninitialized weights) on `device` with parameters in `dtype`; the linear
    layers take their methods from `quant_config` (None: unquantized)."""
    model_cls = get_model_class(get_architectures(hf_config))
    if getattr(hf_config, "pagedllm_convert", None) == "classify":  # a decoder-only LM as a classifier
        from pagedllm.pooling.adapters import as_sequence_classifier

        model_cls = as_sequence_classifier(model_cls)
    with _default_dtype(dtype), torch.device(device), set_current_quant_config(quant_config):
        model = model_cls(hf_config=hf_config, prefix="")
    return model.eval()


def resolve_load_format(model_config: ModelConfig, load_format: str) -> str:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: unknown value {load_format!r}; expected one of {', '.join(LOAD_FORMATS)}")
    if load_format != "auto":
        return load_format
    if model_config.gguf_file:
        return "gguf"
    if get_safetensors_files(model_config.model_dir):
        return "safetensors"
    if get_pt_files(model_config.model_dir):
        return "pt"
    raise ValueError(f"no weights found in {model_config.model_dir} (*.safetensors, *.bin or a .gguf file)")


def get_weights_iterator(model_config: ModelConfig, load_format: str) -> Iterable[tuple[str, torch.Tensor]]:
    """HF-named CPU tensors of the checkpoint in `load_format` (not "auto"/"dummy")."""
    model_dir = model_config.model_dir
    if load_format == "gguf":
        if not model_config.gguf_file:
            raise ValueError("load_format 'gguf' needs a .gguf model file")
        return gguf_weights_iterator(model_config.gguf_file, model_config.hf_config)
    if load_format == "safetensors":
        files = get_safetensors_files(model_dir)
        if not files:
            raise ValueError(f"load_format 'safetensors': no *.safetensors files in {model_dir}")
        from pagedllm.distributed import parallel_state as ps

        # Several ranks: each narrows the weights to its shard; mapped, it reads only those pages.
        sharded = ps.get_tensor_model_parallel_world_size() > 1 or ps.get_pipeline_model_parallel_world_size() > 1
        return safetensors_weights_iterator(files, mapped=sharded)
    if load_format == "pt":
        files = get_pt_files(model_dir)
        if not files:
            raise ValueError(f"load_format 'pt': no *.bin files in {model_dir}")
        return pt_weights_iterator(files)
    raise ValueError(f"no weight iterator for load_format {load_format!r}")


def check_all_loaded(model: nn.Module, loaded: set[str]) -> None:
    missing = [name for name, _ in model.named_parameters() if name not in loaded]
    if missing:
        shown = ", ".join(missing[:20]) + (f", ... ({len(missing)} in all)" if len(missing) > 20 else "")
        raise ValueError(f"weights missing from the checkpoint for these parameters: {shown}")


def _gguf_packed(model_config: ModelConfig, device: torch.device | str) -> bool:
    """Whether the GGUF weights stay packed: `quantization="gguf"` (the default for a .gguf model unless
    `gguf_dequantize`) on the CPU with the C kernels built, or on CUDA with Triton (`gguf_triton`);
    otherwise they are dequantized to `dtype`."""
    if getattr(model_config, "quantization", None) != "gguf":
        return False
    from pagedllm.distributed.parallel_state import get_tensor_model_parallel_world_size
    from pagedllm.model_executor.layers.quantization.gguf import kernels_available

    if get_tensor_model_parallel_world_size() > 1:
        logger.info(
            "gguf: packed weights are not sharded; dequantizing to %s for tensor parallelism", model_config.dtype
        )
        return False
    dev = torch.device(device).type
    if dev == "cuda":
        from pagedllm.model_executor.layers import batch_invariant
        from pagedllm.triton_utils import HAS_TRITON

        if not envs.PAGEDLLM_GGUF_CUDA_PACKED:
            logger.info(
                "gguf: dequantizing the weights to %s on CUDA (PAGEDLLM_GGUF_CUDA_PACKED=1 keeps them packed)",
                model_config.dtype,
            )
            return False
        if not HAS_TRITON:
            logger.warning("gguf: Triton is not installed; dequantizing the weights to %s", model_config.dtype)
            return False
        if batch_invariant.enabled():  # the GEMV / GEMM split by batch size is not batch-invariant
            logger.info("gguf: batch_invariant; dequantizing the weights to %s", model_config.dtype)
            return False
        return True
    if dev != "cpu":
        logger.info("gguf: no packed kernels for %s; dequantizing the weights to %s", dev, model_config.dtype)
        return False
    if not kernels_available():
        logger.warning("gguf: the C kernels are unavailable; dequantizing the weights to %s", model_config.dtype)
        return False
    return True


def load_model(model_config: ModelConfig, load_format: str, device: torch.device | str) -> nn.Module:
    """Builds the model for `model_config` on `device` in `model_config.dtype` and loads its weights.

    load_format: "auto" (gguf if the model is a .gguf file, else safetensors if present, else *.bin),
    "safetensors", "pt", "gguf", or "dummy" (deterministic random weights, nothing read from disk).
    """
    fmt = resolve_load_format(model_config, load_format)
    quant = model_config.quantization
    quant_config = get_quantization_config(quant, model_config.hf_config) if quant not in (None, "gguf") else None
    if quant_config is not None:
        quant_config.check_device(torch.device(device))
    hf = model_config.hf_config
    moe = any(getattr(hf, a, None) for a in ("num_local_experts", "num_experts", "n_routed_experts"))
    if quant_config is not None and getattr(quant_config, "serialized", True) and moe:
        raise ValueError(
            f"quantization: {quant_config.name!r} checkpoints of mixture-of-experts models are not supported "
            "yet (their expert weights have no quantized kernels); online 'fp8' quantizes the dense layers"
        )
    model = build_model(hf, model_config.dtype, device, quant_config)
    with torch.no_grad():
        if fmt == "dummy":
            initialize_dummy_weights(model, seed=model_config.seed if model_config.seed is not None else 1234)
        elif fmt == "gguf" and _gguf_packed(model_config, device):
            from pagedllm.model_executor.model_loader.gguf_packed import load_gguf_packed

            assert model_config.gguf_file is not None
            loaded = load_gguf_packed(model, model_config.gguf_file, model_config.hf_config, device)
            check_all_loaded(model, loaded)
        else:
            weights = split_kv_scales(model, get_weights_iterator(model_config, fmt))  # k/v cache scales
            loaded = model.load_weights(weights)  # type: ignore[operator]
            check_all_loaded(model, loaded)
        for module in model.modules():
            qm = getattr(module, "quant_method", None)
            if qm is not None and hasattr(qm, "process_weights_after_loading"):
                qm.process_weights_after_loading(module)
    logger.info(
        "loaded %s (%s, %s%s) from %s: %.1f MiB of weights",
        type(model).__name__,
        fmt,
        model_config.dtype,
        f", {quant_config.describe()}" if quant_config is not None else "",
        model_config.gguf_file or os.path.abspath(model_config.model_dir),
        weight_bytes(model) / 2**20,
    )
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (tied tensors counted once), packed weights included."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    for m in model.modules():
        qm = getattr(m, "quant_method", None)
        total += int(getattr(qm, "nbytes", 0) or 0)  # GGUF blocks live outside the parameters
    return total
