"""Activation functions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model_executor.layers import cpu_ops, triton_ops
from pagedllm.model_executor.layers.quantization import act_twin


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for the fused gate_up projection output of width 2*d."""

    twin_kind: str | None = None  # the output feeds a quantized linear: it may carry a twin (act_twin.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_ops.use_triton_ops(x):
            return triton_ops.silu_and_mul(x, act_twin.wants_twin(self, x, min_rows=act_twin.MAX_ROWS))
        if cpu_ops.usable(x):
            out = cpu_ops.silu_and_mul(x)
            if out is not None:
                return out
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
