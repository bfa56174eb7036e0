"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.distributed.parallel_state import tensor_model_parallel_all_reduce
from pagedllm.model_executor.layers import cpu_ops, triton_ops
from pagedllm.model_executor.layers.quantization import act_twin

if TYPE_CHECKING:
    from pagedllm.distributed.fused_allreduce_norm import AllReduceNorm


class RMSNorm(nn.Module):
    """RMS normalization computed in float32 (as HF does) and cast back to the input dtype.

    `forward(x)` returns the normalized tensor; `forward(x, residual)` first forms
    `new_residual = x + residual` (in the input dtype, like HF's residual stream) and returns
    `(norm(new_residual), new_residual)`. There x may be [..., P, H] against a [..., H] residual: the P parts
    are summed first (a MoE block's k expert outputs, left unsummed so that this pass does the sum).

    With `tp_reduce` set (tensor parallelism, `LlamaModel.defer_tp_reductions`), an x given with a residual is
    a row-parallel layer's partial sum: it is all-reduced here, in one kernel with the add and the norm where
    that kernel applies.
    """

    tp_reduce: AllReduceNorm | None = None
    twin_kind: str | None = None  # the output feeds a quantized linear: decode rows may carry a twin (act_twin.py)

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        orig_dtype = x.dtype
        xf = x.to(torch.float32)
        variance = xf.pow(2).mean(-1, keepdim=True)
        xf = xf * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * xf.to(orig_dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None and self.tp_reduce is not None:
            reduced = self.tp_reduce(x, residual, self.weight, self.variance_epsilon)
            if reduced is not None:
                return reduced
            x = tensor_model_parallel_all_reduce(x)  # too large for the fused kernel: NCCL, then the norm below
        if triton_ops.use_triton_ops(x) and self.weight.dtype == x.dtype:
            # One fused kernel instead of ~8 elementwise/reduction launches (same rounding).
            twin = act_twin.wants_twin(self, x)
            if residual is None:
                return triton_ops.rms_norm(x, self.weight, self.variance_epsilon, twin)
            return triton_ops.fused_add_rms_norm(x, residual, self.weight, self.variance_epsilon, twin)
        if residual is not None and x.dim() == residual.dim() + 1:
            x = x.sum(dim=-2)
        if cpu_ops.usable(x):
            fused = cpu_ops.rms_norm(x, self.weight, self.variance_epsilon, residual)
            if fused is not None:  # one C pass; the residual is updated in place (as on the GPU)
                return fused
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"
