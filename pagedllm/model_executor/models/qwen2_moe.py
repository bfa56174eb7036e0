"""Qwen2-MoE: Qwen2 attention (q/k/v biases) with sparse MoE blocks (softmax, top-k, renormalized when
`norm_topk_prob`) plus a shared expert scaled by a sigmoid gate; dense MLP layers per `mlp_only_layers`
/ `decoder_sparse_step`."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.model_executor.models.llama import LlamaModel
from pagedllm.model_executor.models.moe_common import (
    MoeForCausalLM,
    SparseMoeBlock,
    is_sparse_layer,
)
from pagedllm.model_executor.models.qwen2 import Qwen2DecoderLayer


class Qwen2MoeDecoderLayer(Qwen2DecoderLayer):
    def make_mlp(self, config: Any, layer_idx: int, prefix: str) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return super().make_mlp(config, layer_idx, prefix)
        return SparseMoeBlock(
            config,
            int(config.moe_intermediate_size),
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            shared_intermediate_size=int(getattr(config, "shared_expert_intermediate_size", 0) or 0),
            prefix=prefix,
        )


class Qwen2MoeModel(LlamaModel):
    decoder_layer_cls = Qwen2MoeDecoderLayer


class Qwen2MoeForCausalLM(MoeForCausalLM):
    model_cls = Qwen2MoeModel
