"""Qwen2: Llama with biases on the q/k/v projections (none on o_proj); sliding window only on the layers
`layer_types` marks (use_sliding_window configs)."""

from __future__ import annotations

from typing import Any

from pagedllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Qwen2DecoderLayer(LlamaDecoderLayer):
    @staticmethod
    def attn_kwargs(config: Any) -> dict[str, Any]:
        return {"qkv_bias": True, "o_bias": False}


class Qwen2Model(LlamaModel):
    decoder_layer_cls = Qwen2DecoderLayer


class Qwen2ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen2Model
