"""OLMoE: Llama attention whose q and k pass through an RMSNorm over the whole projection (not per
head) before RoPE, and a sparse MoE block in every layer (softmax, top-k, renormalized when
`norm_topk_prob`; experts named gate/up/down_proj). The full-width q/k norm needs the unsharded
projection, so tensor parallelism is refused."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_tensor_model_parallel_world_size
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.models.llama import LlamaDecoderLayer, LlamaModel
from pagedllm.model_executor.models.llama_attention import LlamaAttention
from pagedllm.model_executor.models.moe_common import MoeForCausalLM, SparseMoeBlock


class OlmoeAttention(LlamaAttention):
    def __init__(self, config: Any, layer_idx: int, prefix: str = "") -> None:
        if get_tensor_model_parallel_world_size() > 1:
            raise ValueError("OlmoeForCausalLM: tensor parallelism is not supported (full-width q/k norm)")
        if getattr(config, "clip_qkv", None):
            raise ValueError("OlmoeForCausalLM: clip_qkv is not supported")
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, layer_idx, qkv_bias=bias, o_bias=bias, prefix=prefix)
        eps = float(config.rms_norm_eps)
        self.q_norm = RMSNorm(self.q_size, eps=eps)
        self.k_norm = RMSNorm(self.kv_size, eps=eps)

    def forward_qkv(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, self.q_norm(q.contiguous()), self.k_norm(k.contiguous()))
        return self.o_proj(self.attn(q, k, v.contiguous()))


class OlmoeDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Any, layer_idx: int, prefix: str = "") -> None:
        super().__init__(config, layer_idx, prefix)
        self.self_attn = OlmoeAttention(config, layer_idx, prefix=f"{prefix}.self_attn")

    def make_mlp(self, config: Any, layer_idx: int, prefix: str) -> nn.Module:
        return SparseMoeBlock(
            config, int(config.intermediate_size), renormalize=bool(config.norm_topk_prob), prefix=prefix
        )


class OlmoeModel(LlamaModel):
    decoder_layer_cls = OlmoeDecoderLayer


class OlmoeForCausalLM(MoeForCausalLM):
    model_cls = OlmoeModel
