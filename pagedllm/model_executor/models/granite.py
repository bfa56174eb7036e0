"""Granite (IBM, `GraniteForCausalLM`): the Llama decoder with four scalars from its config: token embeddings
times `embedding_multiplier`, attention scale `attention_multiplier` (instead of head_dim^-0.5), each block's
attention and MLP outputs times `residual_multiplier` before they join the residual stream, and logits divided
by `logits_scaling`."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.distributed.pipeline import Intermediate
from pagedllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class GraniteDecoderLayer(LlamaDecoderLayer):
    @staticmethod
    def attn_kwargs(config: Any) -> dict[str, Any]:
        return {**LlamaDecoderLayer.attn_kwargs(config), "scale": float(config.attention_multiplier)}

    def __init__(self, config: Any, layer_idx: int, prefix: str = "") -> None:
        super().__init__(config, layer_idx, prefix)
        self.residual_multiplier = float(config.residual_multiplier)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # As LlamaDecoderLayer, with each branch scaled before the fused residual add of the next norm.
        m = self.residual_multiplier
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states) * m
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states) * m, residual


class GraniteModel(LlamaModel):
    decoder_layer_cls = GraniteDecoderLayer

    def __init__(self, config: Any, prefix: str = "model") -> None:
        super().__init__(config, prefix)
        self.embedding_multiplier = float(config.embedding_multiplier)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate: Intermediate | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        emb = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        hidden_states = emb * self.embedding_multiplier
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class GraniteForCausalLM(LlamaForCausalLM):
    model_cls = GraniteModel
    supports_pp = False  # its own forward takes no previous stage's activations

    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__(hf_config, prefix)
        self.logits_scaling = float(getattr(hf_config, "logits_scaling", 1.0) or 1.0)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states) / self.logits_scaling
