"""Qwen3-MoE: Qwen3 attention (per-head q/k RMSNorm) with sparse MoE blocks (softmax, top-k,
renormalized when `norm_topk_prob`); dense MLP layers per `mlp_only_layers` / `decoder_sparse_step`."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.model_executor.models.llama import LlamaModel
from pagedllm.model_executor.models.moe_common import (
    MoeForCausalLM,
    SparseMoeBlock,
    is_sparse_layer,
)
from pagedllm.model_executor.models.qwen3 import Qwen3DecoderLayer


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, config: Any, layer_idx: int, prefix: str) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return super().make_mlp(config, layer_idx, prefix)
        return SparseMoeBlock(
            config,
            int(config.moe_intermediate_size),
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            prefix=prefix,
        )


class Qwen3MoeModel(LlamaModel):
    decoder_layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(MoeForCausalLM):
    model_cls = Qwen3MoeModel
