"""Qwen2-MoE: Qwen2 attention (q/k/v biases) with sparse MoE blocks (softmax, top-k, renormalized when
`norm_topk_prob`) plus a shared expert scaled by a sigmoid gate; dense MLP layers per `mlp_only_layers`
/ `decoder_sparse_step`."""

from __future__ import annotations

from pagedllm.model_executor.models.llama import LlamaModel
from pagedllm.model_executor.models.moe_common import (
    MoeForCausalLM,
    QwenSparseMlpMixin,
)
from pagedllm.model_executor.models.qwen2 import Qwen2DecoderLayer


class Qwen2MoeDecoderLayer(QwenSparseMlpMixin, Qwen2DecoderLayer):
    pass


class Qwen2MoeModel(LlamaModel):
    decoder_layer_cls = Qwen2MoeDecoderLayer


class Qwen2MoeForCausalLM(MoeForCausalLM):
    model_cls = Qwen2MoeModel
