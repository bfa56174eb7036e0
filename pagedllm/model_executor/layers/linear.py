"""Tensor-parallel linear layers.

Every parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` attribute that takes the
FULL checkpoint tensor and copies this rank's shard into the parameter. Sharded parameters also carry
`output_dim` / `input_dim` attributes naming the dimension split across ranks.

How the weights are stored and multiplied is delegated to a per-layer `quant_method`
(`UnquantizedLinearMethod` by default) so quantized formats can plug in without touching the layers.
The layers that fuse several projections (gate/up, q/k/v) are in `layers/fused_linear.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from pagedllm.model_executor.layers import batch_invariant, batch_invariant_gpu, triton_gemv
from pagedllm.model_executor.layers.cpu_gemm import packed_linear
from pagedllm.model_executor.layers.quantization.base import linear_method_for

if TYPE_CHECKING:
    from pagedllm.distributed.fused_allreduce_norm import PartialSender


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any] | None) -> None:
    """Attach loader metadata (weight_loader, output_dim, ...) to a parameter."""
    for key, value in (attrs or {}).items():
        if hasattr(param, key):
            raise AttributeError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{what}: shape mismatch, parameter {tuple(dst.shape)} vs checkpoint {tuple(src.shape)}")
    dst.copy_(src)


class LinearMethodBase(ABC):
    """Creates a linear layer's parameters and computes its matmul."""

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None: ...

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 - optional hook
        """Called once all weights are loaded (repacking for kernels etc.)."""


class UnquantizedLinearMethod(LinearMethodBase):
    """Plain dense weight [out_per_partition, in_per_partition] in params_dtype."""

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
        weight = nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
        set_weight_attrs(weight, extra_weight_attrs)
        layer.register_parameter("weight", weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        packed = getattr(layer, "packed_weight", None)  # CPU bf16, see model_loader/cpu_packing.py
        if packed is not None:
            return packed_linear(x, packed, bias, int(layer.packed_out_features))  # type: ignore[arg-type]
        weight: torch.Tensor = layer.weight  # type: ignore[assignment]
        if x.is_cuda and batch_invariant.enabled():  # one kernel shape for every batch (layers/batch_invariant.py)
            return batch_invariant_gpu.linear(x, weight, bias)
        if triton_gemv.row_gemv_enabled(x, weight):  # batch-1 decode: one launch, no split-K reduce
            # A LoRA layer's shrink rides along (lora/layers.py), saving its launch.
            return triton_gemv.row_gemv(x, weight, bias, lora=getattr(layer, "row_gemv_lora", None))
        return F.linear(x, weight, bias)


def plain_weight(layer: nn.Module) -> torch.Tensor | None:
    """The weight where `layer`'s matmul is exactly `x @ weight.T` through the unquantized method: no bias, no
    LoRA, no packed CPU weight, no batch-invariant GEMM (where fused variants of that product may replace it:
    the push all-reduce, the gate/up GLU, the copy-engine prefill); else None."""
    weight = getattr(layer, "weight", None)
    if (
        type(getattr(layer, "quant_method", None)) is not UnquantizedLinearMethod
        or not isinstance(weight, torch.Tensor)
        or getattr(layer, "bias", None) is not None
        or getattr(layer, "packed_weight", None) is not None
        or getattr(layer, "row_gemv_lora", None) is not None
        or layer._forward_hooks  # (LoRA adds its delta in a hook: a fused launch must not skip it)
        or batch_invariant.enabled()
    ):
        return None
    return weight


def plain_row_gemv_weight(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """`plain_weight`, where `layer(x)` runs it through `triton_gemv.row_gemv` (one 16-bit row on CUDA)."""
    weight = plain_weight(layer)
    return weight if weight is not None and triton_gemv.row_gemv_enabled(x, weight) else None


class LinearBase(nn.Module):
    weight: torch.Tensor
    bias: torch.Tensor | None
    packed_out_features: int

    def __init__(
        self,
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype | None = None,
        quant_method: LinearMethodBase | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.prefix = prefix
        # A quantized model's layers get their method from the config in force while it is built.
        self.quant_method: LinearMethodBase = (
            quant_method or linear_method_for(self, prefix) or UnquantizedLinearMethod()
        )
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()

    def _create_params(
        self,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        bias_size: int | None,
        bias_attrs: dict[str, Any] | None = None,
    ) -> None:
        """Weights through the layer's quant method and, when bias_size is given, the bias; both load
        through this layer's weight_loader."""
        self.quant_method.create_weights(
            self,
            input_size_per_partition,
            output_partition_sizes,
            self.input_size,
            self.output_size,
            self.params_dtype,
            weight_loader=self.weight_loader,
        )
        if bias_size is None:
            self.register_parameter("bias", None)
            return
        param = nn.Parameter(torch.empty(bias_size, dtype=self.params_dtype), requires_grad=False)
        set_weight_attrs(param, {**(bias_attrs or {}), "weight_loader": self.weight_loader})
        self.register_parameter("bias", param)


class ReplicatedLinear(LinearBase):
    """Full weight on every rank."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        quant_method: LinearMethodBase | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(input_size, output_size, params_dtype, quant_method, prefix)
        self._create_params(input_size, [output_size], output_size if bias else None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        _copy_checked(param.data, loaded_weight, self.prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Y = X A with A split by output columns: rank r holds rows [r*n/tp, (r+1)*n/tp) of the HF weight."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_method: LinearMethodBase | None = None,
        prefix: str = "",
        output_sizes: list[int] | None = None,
    ) -> None:
        super().__init__(input_size, output_size, params_dtype, quant_method, prefix)
        self.gather_output = gather_output
        self.output_size_per_partition = divide(output_size, self.tp_size)
        if output_sizes is None:
            output_sizes = [output_size]
        self.output_sizes = output_sizes
        self.output_partition_sizes = self._partition_sizes()
        self._create_params(
            input_size,
            self.output_partition_sizes,
            self.output_size_per_partition if bias else None,
            {"output_dim": 0},
        )

    def _partition_sizes(self) -> list[int]:
        return [divide(s, self.tp_size) for s in self.output_sizes]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        output_dim = getattr(param, "output_dim", None)
        if output_dim is not None:
            size = param.data.shape[output_dim]
            loaded_weight = loaded_weight.narrow(output_dim, self.tp_rank * size, size)
        _copy_checked(param.data, loaded_weight, self.prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, self.bias)
        if self.gather_output and self.tp_size > 1:
            out = tensor_model_parallel_all_gather(out, dim=-1)
        return out


class RowParallelLinear(LinearBase):
    """Y = X A with A split by input rows: rank r holds columns [r*n/tp, (r+1)*n/tp) of the HF weight.

    The partial products are all-reduced; the (unsharded) bias is added once, after the reduction.
    With `reduce_results` off (`LlamaModel.defer_tp_reductions`) the output stays a partial sum, and a
    `partial_sender` may compute it while sending it to the peers (`distributed/fused_allreduce_norm.py`).
    """

    partial_sender: PartialSender | None = None

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        params_dtype: torch.dtype | None = None,
        quant_method: LinearMethodBase | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(input_size, output_size, params_dtype, quant_method, prefix)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, self.tp_size)
        self._create_params(self.input_size_per_partition, [output_size], output_size if bias else None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        input_dim = getattr(param, "input_dim", None)
        if input_dim is not None:
            size = param.data.shape[input_dim]
            loaded_weight = loaded_weight.narrow(input_dim, self.tp_rank * size, size)
        _copy_checked(param.data, loaded_weight, self.prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel and self.tp_size > 1:
            x = x.chunk(self.tp_size, dim=-1)[self.tp_rank]
        if self.tp_size == 1:
            return self.quant_method.apply(self, x, self.bias)
        if not self.reduce_results and self.partial_sender is not None:
            sent = self.partial_sender.matmul(self, x)
            if sent is not None:  # the partial sum already on its way to the peers; the next norm reduces it
                return sent
        out = self.quant_method.apply(self, x, None)
        if self.reduce_results:
            out = tensor_model_parallel_all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out
