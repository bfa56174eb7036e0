"""Gemma 2: Gemma 3's layout (`gemma3.py`: (1 + w) RMSNorm, norms before and after attention and MLP, GeGLU,
embeddings times sqrt(hidden), `query_pre_attn_scalar`, alternating sliding-window / global layers, final logit
soft-capping) without the per-head q/k norms, with one RoPE base for every layer, and with attention-logit
soft-capping (`attn_logit_softcapping`: scores = cap * tanh(scores / cap) inside the attention backend)."""

from __future__ import annotations

from typing import Any

from pagedllm.model_executor.models.gemma3 import Gemma3Attention, Gemma3DecoderLayer, Gemma3ForCausalLM, Gemma3Model
from pagedllm.transformers_utils.config import get_rope_params


class Gemma2Attention(Gemma3Attention):
    qk_norm = False

    def rope_params(self, config: Any, layer_type: str) -> tuple[float, dict[str, Any] | None]:
        return get_rope_params(config)


class Gemma2DecoderLayer(Gemma3DecoderLayer):
    attention_cls = Gemma2Attention


class Gemma2Model(Gemma3Model):
    decoder_layer_cls = Gemma2DecoderLayer


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    model_cls = Gemma2Model  # type: ignore[assignment]
