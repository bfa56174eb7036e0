"""AWQ and GPTQ int4 checkpoints (weight-only, 16-bit activations), as AutoAWQ / AutoGPTQ store them.

- AWQ (`quant_method: "awq"`, `version: "gemm"`, `zero_point: true`): `qweight` int32 [K, N/8] and
  `qzeros` int32 [K/G, N/8], both packed along the output dim in AWQ's interleaved order (nibble i holds
  column [0, 2, 4, 6, 1, 3, 5, 7][i] of its 8), `scales` [K/G, N]; w = (q - z) * s.
- GPTQ (`quant_method: "gptq"`, `desc_act: false`): `qweight` int32 [K/8, N] packed along the input dim,
  `qzeros` int32 [K/G, N/8] packed along the output dim holding zero - 1 (`checkpoint_format` "gptq";
  "gptq_v2" stores the zero itself), `scales` [K/G, N], `g_idx` [K] (must be k // G: `desc_act: true`
  checkpoints, whose rows are permuted, are refused).

At load both are repacked to one layout (`int4_ops`), which the Triton kernels and the CPU reference use.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers.linear import LinearMethodBase, set_weight_attrs
from pagedllm.model_executor.layers.quantization.base import QuantizationConfig, _is_ignored
from pagedllm.model_executor.layers.quantization.int4_ops import (
    TILE_N,
    int4_linear,
    pack_int4_rows,
    tile_columns,
    unpack_int4_cols,
)

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
GROUP_SIZES = (32, 64, 128)


def _check_common(method: str, config: dict[str, Any], bits_key: str = "bits") -> int:
    bits = config.get(bits_key, config.get("w_bit"))
    if bits != 4:
        raise ValueError(f"quantization_config.{bits_key}: {method} with {bits} bits is not supported; expected 4")
    group = config.get("group_size", config.get("q_group_size"))
    if group not in GROUP_SIZES:
        raise ValueError(
            f"quantization_config.group_size: {group} is not supported for {method}; expected one of "
            f"{', '.join(map(str, GROUP_SIZES))}"
        )
    return int(group)


class AWQConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, group_size: int, ignored: list[str]) -> None:
        self.group_size = group_size
        self.ignored = ignored

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        group = _check_common("awq", config)
        if not config.get("zero_point", True):
            raise ValueError("quantization_config.zero_point: AWQ without zero points is not supported")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config.version: AWQ {version!r} packing is not supported; expected 'gemm'")
        return cls(group, list(config.get("modules_to_not_convert") or []))

    def describe(self) -> str:
        return f"awq int4 (group {self.group_size})"

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if _is_ignored(prefix, self.ignored):
            return None
        return Int4LinearMethod(self.group_size, "awq")


class GPTQConfig(QuantizationConfig):
    name = "gptq"

    def __init__(self, group_size: int, zero_offset: int) -> None:
        self.group_size = group_size
        self.zero_offset = zero_offset

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        group = _check_common("gptq", config)
        if config.get("desc_act"):
            raise ValueError(
                "quantization_config.desc_act: GPTQ checkpoints with act-order (desc_act=true) are not "
                "supported; re-quantize with desc_act=false"
            )
        fmt = config.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization_config.checkpoint_format: {fmt!r} is not supported")
        return cls(group, 1 if fmt == "gptq" else 0)

    def describe(self) -> str:
        return f"gptq int4 (group {self.group_size})"

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        return Int4LinearMethod(self.group_size, "gptq", self.zero_offset)


class Int4LinearMethod(LinearMethodBase):
    """The checkpoint's tensors in its own layout; repacked once loaded (see the module docstring)."""

    def __init__(self, group_size: int, fmt: str, zero_offset: int = 0) -> None:
        self.group = group_size
        self.fmt = fmt
        self.zero_offset = zero_offset

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
        k, n, g = input_size_per_partition, sum(output_partition_sizes), self.group
        where = getattr(layer, "prefix", "") or "a linear layer"
        if k % g:
            raise ValueError(f"quantization_config.group_size: {g} does not divide the input size {k} of {where}")
        if any(p % 8 for p in output_partition_sizes):
            raise ValueError(f"{self.fmt}: the output sizes {output_partition_sizes} of {where} are not multiples of 8")
        if self.fmt == "awq":
            shapes = {"qweight": ((k, n // 8), torch.int32, 8), "qzeros": ((k // g, n // 8), torch.int32, 8)}
        else:
            shapes = {"qweight": ((k // 8, n), torch.int32, 1), "qzeros": ((k // g, n // 8), torch.int32, 8)}
        shapes["scales"] = ((k // g, n), params_dtype, 1)
        for name, (shape, dtype, pack) in shapes.items():
            p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            set_weight_attrs(p, {"input_dim": 0, "output_dim": 1, "output_pack_factor": pack, **extra_weight_attrs})
            layer.register_parameter(name, p)
        if self.fmt == "gptq":
            g_idx = nn.Parameter(torch.arange(k, dtype=torch.int32) // g, requires_grad=False)
            set_weight_attrs(g_idx, {"input_dim": 0, "skip_dummy_init": True, **extra_weight_attrs})
            layer.register_parameter("g_idx", g_idx)

    def process_weights_after_loading(self, layer: Any) -> None:
        qw: torch.Tensor = layer.qweight.data
        qz: torch.Tensor = layer.qzeros.data
        if self.fmt == "awq":
            qweight = pack_int4_rows(unpack_int4_cols(qw, AWQ_ORDER))
            zeros = unpack_int4_cols(qz, AWQ_ORDER)
        else:
            k = qw.shape[0] * 8
            g_idx = layer.g_idx.data
            expected = torch.arange(k, dtype=g_idx.dtype, device=g_idx.device) // self.group
            if not torch.equal(g_idx, expected):
                raise ValueError(
                    f"{getattr(layer, 'prefix', 'gptq')}: g_idx is not k // group_size (an act-order checkpoint "
                    "mislabelled desc_act=false?); act-order GPTQ is not supported"
                )
            qweight = qw.contiguous()
            zeros = unpack_int4_cols(qz) + self.zero_offset
            del layer.g_idx
        if qweight.is_cuda and qweight.shape[1] % TILE_N == 0:
            qweight = tile_columns(qweight)  # contiguous [rows, 64] tiles for the GPU kernels (int4_ops)
        layer.qweight = nn.Parameter(qweight, requires_grad=False)
        layer.zeros = nn.Parameter(zeros.to(torch.uint8), requires_grad=False)
        del layer.qzeros

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return int4_linear(x, layer.qweight, layer.zeros, layer.scales, self.group, bias)  # type: ignore[arg-type]
