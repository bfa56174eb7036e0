"""Mixture-of-experts layers: top-k routing, a PyTorch path for the CPU and a fused Triton path for CUDA.

`FusedMoE` holds the experts' weights stacked as `w13_weight [E, 2 * I, H]` (gate rows, then up rows)
and `w2_weight [E, H, I]`, sharded along the intermediate dim `I` under tensor parallelism like the
dense `MergedColumnParallelLinear` / `RowParallelLinear` pair.
"""

from pagedllm.model_executor.layers.fused_moe.layer import FusedMoE
from pagedllm.model_executor.layers.fused_moe.routing import select_experts
from pagedllm.model_executor.layers.fused_moe.torch_moe import torch_moe

__all__ = ["FusedMoE", "select_experts", "torch_moe"]
