"""FP8 (e4m3) weights and activations, as vLLM's `fp8` method.

- Online (`quantization="fp8"` on a 16-bit checkpoint): the weights load in `dtype`, then each layer is
  quantized to e4m3 with one scale per output channel; activations get a dynamic per-token scale.
- Serialized (`quantization_config.quant_method == "fp8"`, vLLM's format): `weight` (e4m3 [N, K]),
  `weight_scale` (float32, one per tensor), and with `activation_scheme: "static"` an `input_scale`
  (one per tensor; fused q/k/v and gate/up keep the largest). Block-wise scales (`weight_block_size`)
  are refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers.linear import LinearMethodBase, UnquantizedLinearMethod, set_weight_attrs
from pagedllm.model_executor.layers.quantization.base import (
    QuantizationConfig,
    _is_ignored,
    max_scalar_loader,
    per_channel_loader,
)
from pagedllm.model_executor.layers.quantization.w8a8_ops import (
    FP8_DTYPE,
    fp8_supported,
    quantize_weight_per_channel,
    w8a8_linear,
)


def check_fp8_device(device: torch.device, what: str) -> None:
    if device.type == "cuda" and not fp8_supported(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"{what} needs a GPU with FP8 support (compute capability >= 8.9, e.g. Ada or Hopper); "
            f"this GPU is sm_{major}{minor}"
        )


class Fp8Config(QuantizationConfig):
    name = "fp8"

    def __init__(self, serialized: bool, static_activations: bool, ignored: list[str]) -> None:
        self.serialized = serialized
        self.static_activations = static_activations
        self.ignored = ignored

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        if config.get("online"):
            return cls(False, False, [])
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("static", "dynamic"):
            raise ValueError(
                f"quantization_config.activation_scheme: {scheme!r} is not supported; expected 'static' or 'dynamic'"
            )
        if config.get("weight_block_size") is not None:
            raise ValueError(
                "quantization_config.weight_block_size: block-wise FP8 scales are not supported "
                "(per-tensor and per-channel are)"
            )
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config.fmt: {fmt!r} is not supported; expected 'e4m3'")
        return cls(True, scheme == "static", list(config.get("ignored_layers") or []))

    def describe(self) -> str:
        kind = "checkpoint" if self.serialized else "online"
        return f"fp8 ({kind}, {'static' if self.static_activations else 'dynamic'} activation scales)"

    def check_device(self, device: torch.device) -> None:
        check_fp8_device(device, "quantization='fp8'")

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if _is_ignored(prefix, self.ignored):
            return None
        if not self.serialized:
            if prefix.endswith(".gate"):  # a mixture-of-experts router stays in 16 bits, as vLLM keeps it
                return None
            return Fp8OnlineLinearMethod()
        return W8A8LinearMethod(FP8_DTYPE, self.static_activations)


class W8A8LinearMethod(LinearMethodBase):
    """8-bit weights from the checkpoint ([N, K] in `weight_dtype`) with per-output-channel float32 scales
    (a per-tensor checkpoint scale is expanded over its rows, which is exact); activations quantized per
    token, or with a static per-tensor `input_scale`."""

    def __init__(self, weight_dtype: torch.dtype, static_activations: bool) -> None:
        self.weight_dtype = weight_dtype
        self.static_activations = static_activations

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        n = sum(output_partition_sizes)
        weight = nn.Parameter(torch.empty(n, input_size_per_partition, dtype=self.weight_dtype), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
        layer.register_parameter("weight", weight)
        scale = nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(scale, {"output_dim": 0, "weight_loader": per_channel_loader(layer)})
        layer.register_parameter("weight_scale", scale)
        if self.static_activations:
            iscale = nn.Parameter(torch.zeros((), dtype=torch.float32), requires_grad=False)
            set_weight_attrs(iscale, {"weight_loader": max_scalar_loader})
            layer.register_parameter("input_scale", iscale)

    @property
    def twin_kind(self) -> str | None:
        """ "fp8" where the input's FP8 twin (quantization/act_twin.py) is this method's own quantization of it."""
        return "fp8" if self.weight_dtype == FP8_DTYPE and not self.static_activations else None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return w8a8_linear(
            x,
            layer.weight,  # type: ignore[arg-type]
            layer.weight_scale,  # type: ignore[arg-type]
            getattr(layer, "input_scale", None),
            bias,
        )


class Fp8OnlineLinearMethod(W8A8LinearMethod):
    """The layer loads its 16-bit weight as usual; `process_weights_after_loading` quantizes it to e4m3
    with a scale per output channel and drops the 16-bit copy."""

    def __init__(self) -> None:
        super().__init__(FP8_DTYPE, static_activations=False)

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        UnquantizedLinearMethod().create_weights(
            layer,
            input_size_per_partition,
            output_partition_sizes,
            input_size,
            output_size,
            params_dtype,
            **extra_weight_attrs,
        )

    def process_weights_after_loading(self, layer: Any) -> None:
        q, scale = quantize_weight_per_channel(layer.weight.data, FP8_DTYPE)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
