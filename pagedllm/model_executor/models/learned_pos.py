"""Pieces of the pre-RoPE decoders with learned position embeddings (GPT-2, OPT): multi-head
self-attention with biased projections and no rotary, a biased two-layer MLP, and the shared loader
that maps checkpoint names onto them."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.layer import Attention
from pagedllm.model_executor.layers.fused_linear import QKVParallelLinear
from pagedllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.model_executor.model_loader.weight_utils import default_weight_loader

logger = logging.getLogger(__name__)

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported ({', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class BiasedSelfAttention(nn.Module):
    """q/k/v (one fused, biased projection) -> paged attention (scale head_dim^-0.5) -> biased output
    projection. Parameter names: `qkv_proj`, `out_proj`."""

    def __init__(self, hidden: int, num_heads: int, bias: bool = True, prefix: str = "") -> None:
        super().__init__()
        self.head_dim = hidden // num_heads
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, num_heads, num_heads, bias=bias, prefix=f"{prefix}.qkv_proj"
        )
        self.num_heads = self.qkv_proj.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.out_proj = RowParallelLinear(hidden, hidden, bias=bias, prefix=f"{prefix}.out_proj")
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, num_kv_heads=self.num_heads, prefix=f"{prefix}.attn"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size] * 3, dim=-1)
        return self.out_proj(self.attn(q, k, v.contiguous()))


class BiasedMLP(nn.Module):
    """fc1 -> activation -> fc2, both biased."""

    def __init__(self, hidden: int, inner: int, act: str, prefix: str = "") -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden, inner, bias=True, prefix=f"{prefix}.fc1")
        self.fc2 = RowParallelLinear(inner, hidden, bias=True, prefix=f"{prefix}.fc2")
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def load_renamed(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: Callable[[str, torch.Tensor], tuple[str, torch.Tensor, Any] | None],
) -> set[str]:
    """Loads checkpoint tensors through `rename(name, tensor) -> (param name, tensor, shard id) | None`
    (None: a tensor we do not use); fused projections get several shards, counted until all arrived."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    shards: dict[str, set[Any]] = {}
    for name, tensor in weights:
        mapped = rename(name, tensor)
        if mapped is None:
            continue
        pname, tensor, shard_id = mapped
        if pname not in params:
            logger.warning("load_weights: ignoring checkpoint tensor %s (no such parameter)", name)
            continue
        param = params[pname]
        loader = getattr(param, "weight_loader", default_weight_loader)
        if shard_id is None:
            loader(param, tensor)
            loaded.add(pname)
        else:
            loader(param, tensor, shard_id)
            got = shards.setdefault(pname, set())
            got.add(shard_id)
            if len(got) == 3:
                loaded.add(pname)
    return loaded
