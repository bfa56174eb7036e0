"""compressed-tensors checkpoints (llm-compressor's format, `quant_method: "compressed-tensors"`): the
8-bit weight-and-activation schemes.

- FP8 W8A8 (`format: "float-quantized"`): `weight` e4m3 [N, K], `weight_scale` [N, 1] (strategy
  "channel") or [1] ("tensor"); activations dynamic per token (`strategy: "token", dynamic: true`) or
  static per tensor (`strategy: "tensor", dynamic: false`, an `input_scale` [1] per layer).
- INT8 W8A8 (`format: "int-quantized"`): the same with int8 weights (symmetric).

Each `config_groups` entry targets layers by class ("Linear") or `re:` pattern; `ignore` leaves layers in
16 bits. Other schemes (4-bit packed weights, weight-only, asymmetric, group-wise) are refused at start-up.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers.linear import LinearMethodBase
from pagedllm.model_executor.layers.quantization.base import QuantizationConfig, _is_ignored
from pagedllm.model_executor.layers.quantization.fp8 import W8A8LinearMethod, check_fp8_device
from pagedllm.model_executor.layers.quantization.w8a8_ops import FP8_DTYPE

_FORMATS = ("float-quantized", "int-quantized", "naive-quantized")


def _scheme(name: str, group: dict[str, Any], fmt: str | None) -> tuple[torch.dtype, bool]:
    """(weight dtype, static activations) of one config group; ValueErrors name the field."""
    field = f"quantization_config.config_groups.{name}"
    w = group.get("weights") or {}
    a = group.get("input_activations")
    fmt = group.get("format") or fmt
    if fmt not in _FORMATS:
        raise ValueError(f"{field}.format: {fmt!r} is not supported; expected one of {', '.join(_FORMATS)}")
    if w.get("num_bits") != 8:
        raise ValueError(f"{field}.weights.num_bits: {w.get('num_bits')} bits is not supported; expected 8")
    wtype = w.get("type", "int")
    if wtype not in ("float", "int"):
        raise ValueError(f"{field}.weights.type: {wtype!r} is not supported; expected 'float' or 'int'")
    if w.get("strategy") not in ("channel", "tensor"):
        raise ValueError(
            f"{field}.weights.strategy: {w.get('strategy')!r} is not supported; expected 'channel' or 'tensor'"
        )
    if not w.get("symmetric", True):
        raise ValueError(f"{field}.weights.symmetric: asymmetric weights are not supported")
    if w.get("dynamic"):
        raise ValueError(f"{field}.weights.dynamic: dynamic weight scales are not supported")
    if not a:
        raise ValueError(f"{field}.input_activations: weight-only schemes are not supported (W8A8 only)")
    if a.get("num_bits") != 8 or a.get("type", "int") != wtype:
        raise ValueError(f"{field}.input_activations: must be 8-bit {wtype} like the weights")
    if not a.get("symmetric", True):
        raise ValueError(f"{field}.input_activations.symmetric: asymmetric activations are not supported")
    if a.get("dynamic"):
        if a.get("strategy") not in ("token", "tensor"):
            raise ValueError(f"{field}.input_activations.strategy: {a.get('strategy')!r} is not supported")
        static = False
    else:
        if a.get("strategy") != "tensor":
            raise ValueError(
                f"{field}.input_activations.strategy: static scales must be per 'tensor', got {a.get('strategy')!r}"
            )
        static = True
    return (FP8_DTYPE if wtype == "float" else torch.int8), static


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, groups: list[tuple[list[str], torch.dtype, bool]], ignore: list[str]) -> None:
        self.groups = groups
        self.ignore = ignore

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        raw_groups = config.get("config_groups") or {}
        if not raw_groups:
            raise ValueError("quantization_config.config_groups: no quantization scheme in the checkpoint")
        groups = []
        for name, group in raw_groups.items():
            dtype, static = _scheme(name, group, config.get("format"))
            groups.append((list(group.get("targets") or ["Linear"]), dtype, static))
        if config.get("sparsity_config"):
            raise ValueError("quantization_config.sparsity_config: sparse checkpoints are not supported")
        return cls(groups, list(config.get("ignore") or []))

    def describe(self) -> str:
        kinds = {("fp8" if d == FP8_DTYPE else "int8") + (" static" if s else " dynamic") for _, d, s in self.groups}
        return f"compressed-tensors W8A8 ({', '.join(sorted(kinds))})"

    def check_device(self, device: torch.device) -> None:
        if any(d == FP8_DTYPE for _, d, _ in self.groups):
            check_fp8_device(device, "this compressed-tensors FP8 checkpoint")

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if _is_ignored(prefix, self.ignore):
            return None
        for targets, dtype, static in self.groups:
            if any(_target_matches(t, prefix) for t in targets):
                return W8A8LinearMethod(dtype, static)
        return None


def _target_matches(target: str, prefix: str) -> bool:
    if target == "Linear":
        return True
    if target.startswith("re:"):
        pat = target[3:]
        names = [prefix]
        for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
            if prefix.endswith(fused):
                names = [prefix[: -len(fused)] + p for p in parts]
        return all(re.fullmatch(pat, n) or re.match(pat, n) for n in names)
    return prefix == target or prefix.endswith("." + target)
