"""Qwen3-MoE: Qwen3 attention (per-head q/k RMSNorm) with sparse MoE blocks (softmax, top-k,
renormalized when `norm_topk_prob`); dense MLP layers per `mlp_only_layers` / `decoder_sparse_step`."""

from __future__ import annotations

from pagedllm.model_executor.models.llama import LlamaModel
from pagedllm.model_executor.models.moe_common import (
    MoeForCausalLM,
    QwenSparseMlpMixin,
)
from pagedllm.model_executor.models.qwen3 import Qwen3DecoderLayer


class Qwen3MoeDecoderLayer(QwenSparseMlpMixin, Qwen3DecoderLayer):
    pass


class Qwen3MoeModel(LlamaModel):
    decoder_layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(MoeForCausalLM):
    model_cls = Qwen3MoeModel
