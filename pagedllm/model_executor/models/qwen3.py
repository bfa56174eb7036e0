"""Qwen3: Llama with per-head RMSNorm on q and k before RoPE, explicit head_dim, biases per
`attention_bias` (off in released checkpoints)."""

from __future__ import annotations

from typing import Any

from pagedllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Qwen3DecoderLayer(LlamaDecoderLayer):
    @staticmethod
    def attn_kwargs(config: Any) -> dict[str, Any]:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}


class Qwen3Model(LlamaModel):
    decoder_layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
