"""Mixtral: Llama/Mistral attention with a sparse MoE block in every layer (softmax, top-k, always
renormalized). Checkpoints name the block `block_sparse_moe` and the experts' projections w1 (gate),
w3 (up), w2 (down)."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.model_executor.layers.fused_moe.layer import EXPERT_NAMES_MIXTRAL
from pagedllm.model_executor.models.llama import LlamaDecoderLayer, LlamaModel
from pagedllm.model_executor.models.moe_common import MoeForCausalLM, SparseMoeBlock


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: Any, layer_idx: int, prefix: str) -> nn.Module:
        return SparseMoeBlock(config, int(config.intermediate_size), renormalize=True, prefix=prefix)


class MixtralModel(LlamaModel):
    decoder_layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(MoeForCausalLM):
    model_cls = MixtralModel
    expert_names = EXPERT_NAMES_MIXTRAL
    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),)
