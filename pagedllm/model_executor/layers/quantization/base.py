"""The quantization registry: `QuantizationConfig` per method (vLLM's method names), the config in force
while a model is built, and the shard geometry helpers the quantized linear methods load with.

The layers never name a format: `LinearBase` asks the config in force (`current_quant_config`, set by
the loader around `build_model`) for its `LinearMethodBase`; the method creates the layer's parameters
(each with a `weight_loader`), loads the checkpoint tensors, repacks them in
`process_weights_after_loading` and computes the GEMM in `apply`.
"""

from __future__ import annotations

import importlib
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

# vLLM's method names (the `quantization=` argument, or `quantization_config.quant_method`).
QUANTIZATION_METHODS = ("gguf", "fp8", "compressed-tensors", "awq", "gptq")
# Names vLLM also accepts for the same checkpoints (its kernel-specific variants).
_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq", "compressed_tensors": "compressed-tensors"}


# Method -> its config class, imported when used (a format's kernels load only for its models).
_CLASSES = {
    "fp8": ("pagedllm.model_executor.layers.quantization.fp8", "Fp8Config"),
    "compressed-tensors": ("pagedllm.model_executor.layers.quantization.compressed_tensors", "CompressedTensorsConfig"),
    "awq": ("pagedllm.model_executor.layers.quantization.int4", "AWQConfig"),
    "gptq": ("pagedllm.model_executor.layers.quantization.int4", "GPTQConfig"),
}


def config_class(method: str) -> type[QuantizationConfig]:
    module, name = _CLASSES[method]
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def canonical_method(name: str) -> str:
    return _ALIASES.get(name.lower(), name.lower())


class QuantizationConfig(ABC):
    """One quantization format: parsed from `quantization_config` (or built for an online method)."""

    name: str = ""

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """Parses (and validates) a checkpoint's `quantization_config`; ValueErrors name the field."""

    @abstractmethod
    def get_linear_method(self, layer: nn.Module, prefix: str) -> Any:
        """The `LinearMethodBase` for the linear layer at `prefix`, or None to keep it unquantized."""

    def check_device(self, device: torch.device) -> None:  # noqa: B027 - optional hook
        """Raises a ValueError when `device` cannot run this format."""

    def describe(self) -> str:
        return self.name


def _is_ignored(prefix: str, ignore: list[str]) -> bool:
    """Whether a layer is left unquantized by an `ignore` / `ignored_layers` list: exact names, names of
    the HF sub-projections of a fused layer, or `re:` patterns (compressed-tensors)."""
    if not ignore:
        return False
    names = [prefix]
    for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        if prefix.endswith(fused):
            names = [prefix[: -len(fused)] + p for p in parts]
    hits = []
    for n in names:
        hit = False
        for pat in ignore:
            if pat.startswith("re:"):
                hit = hit or re.fullmatch(pat[3:], n) is not None
            else:
                hit = hit or n == pat or n.endswith("." + pat)
        hits.append(hit)
    if any(hits) and not all(hits):
        raise ValueError(f"quantization_config: ignore lists only some of the fused projections of {prefix}")
    return all(hits)


def get_quantization_config(quantization: str | None, hf_config: Any) -> QuantizationConfig | None:
    """The config for `quantization` (the engine argument) and the checkpoint's `quantization_config`.

    None: unquantized (or 'gguf', which its own loader handles). Raises a ValueError naming the field for
    an unknown method, a method that contradicts the checkpoint, or an unsupported setting."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is not None and not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else dict(vars(raw))
    ckpt_method = canonical_method(str(raw.get("quant_method", ""))) if raw else None
    method = canonical_method(quantization) if quantization else ckpt_method
    if method is None or method == "gguf":
        return None
    if method not in QUANTIZATION_METHODS:
        field = "quantization" if quantization else "quantization_config.quant_method"
        raise ValueError(f"{field}: unsupported method {method!r}; expected one of {', '.join(QUANTIZATION_METHODS)}")
    if ckpt_method is not None and ckpt_method != method:
        raise ValueError(
            f"quantization: {quantization!r} does not match the checkpoint, whose config.json has "
            f"quantization_config.quant_method={raw.get('quant_method')!r}"  # type: ignore[union-attr]
        )
    cls = config_class(method)
    if raw is None:
        if method != "fp8":
            raise ValueError(
                f"quantization: {method!r} needs a pre-quantized checkpoint (config.json has no "
                "quantization_config); only 'fp8' quantizes a model online"
            )
        return cls.from_config({"quant_method": "fp8", "online": True})
    return cls.from_config(raw)


# ---- the config in force while the model is built ------------------------------------------------

_CURRENT: list[QuantizationConfig | None] = [None]


@contextmanager
def set_current_quant_config(config: QuantizationConfig | None) -> Iterator[None]:
    prev = _CURRENT[0]
    _CURRENT[0] = config
    try:
        yield
    finally:
        _CURRENT[0] = prev


def linear_method_for(layer: nn.Module, prefix: str) -> Any:
    """The quantized linear method of the config in force for `layer`, or None (unquantized)."""
    config = _CURRENT[0]
    if config is None:
        return None
    return config.get_linear_method(layer, prefix)


# ---- shard geometry --------------------------------------------------------------------------------


def _shard_index(shard_id: Any) -> int:
    """A fused layer's sub-projection index: q/k/v -> 0/1/2, gate/up given as 0/1."""
    return {"q": 0, "k": 1, "v": 2}[shard_id] if isinstance(shard_id, str) else int(shard_id)


def full_shard_rows(layer: Any, shard_id: Any) -> int:
    """Rows of the checkpoint tensor of sub-projection `shard_id` (all ranks), or of the whole layer."""
    if shard_id is None:
        return int(layer.output_size)
    idx = _shard_index(shard_id)
    return int(layer.output_sizes[idx]) if hasattr(layer, "output_sizes") else int(layer.output_size)


def per_channel_loader(layer: Any) -> Any:
    """A weight_loader for a per-output-row float32 parameter [N] that also takes a per-tensor scale
    (a scalar or [1], expanded over the sub-projection's rows) or a [N, 1] per-channel one."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        loaded = loaded.reshape(-1).float()
        if loaded.numel() == 1:
            loaded = loaded.expand(full_shard_rows(layer, shard_id)).contiguous()
        layer.weight_loader(param, loaded, shard_id)

    return load


def max_scalar_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """A static per-tensor input scale: fused sub-projections keep the largest (as vLLM)."""
    value = float(loaded.reshape(-1).float().max())
    loaded_flag = getattr(param, "_loaded_once", False)
    param.data.fill_(max(value, float(param.data.item())) if loaded_flag else value)
    param._loaded_once = True  # type: ignore[attr-defined]
