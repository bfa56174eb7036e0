"""OPT (facebook/opt-*): learned positions offset by 2, biased q/k/v/out projections, ReLU MLP
(`fc1`/`fc2`), LayerNorm before (or, `do_layer_norm_before=False`, after) each block, optional
`project_in` / `project_out` when `word_embed_proj_dim` differs from the hidden size, LM head tied to
the token embedding."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers.linear import ReplicatedLinear
from pagedllm.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.model_executor.models.learned_pos import BiasedMLP, BiasedSelfAttention, load_renamed

POSITION_OFFSET = 2  # OPT's learned position table starts 2 rows in (a fairseq legacy)


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        hidden = config.hidden_size
        bias = bool(getattr(config, "enable_bias", True))
        affine = bool(getattr(config, "layer_norm_elementwise_affine", True))
        self.pre_norm = bool(config.do_layer_norm_before)
        self.self_attn = BiasedSelfAttention(
            hidden, config.num_attention_heads, bias=bias, prefix=f"{prefix}.self_attn"
        )
        self.self_attn_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.mlp = BiasedMLP(hidden, config.ffn_dim, config.activation_function, prefix=prefix)
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.self_attn(self.self_attn_layer_norm(x))
            return x + self.mlp(self.final_layer_norm(x))
        x = self.self_attn_layer_norm(x + self.self_attn(x))
        return self.final_layer_norm(x + self.mlp(x))


class OPTDecoder(nn.Module):
    def __init__(self, config: Any, prefix: str = "model.decoder") -> None:
        super().__init__()
        hidden, proj = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, proj, prefix=f"{prefix}.embed_tokens")
        self.embed_positions = VocabParallelEmbedding(
            config.max_position_embeddings + POSITION_OFFSET, hidden, prefix=f"{prefix}.embed_positions"
        )
        self.project_in = ReplicatedLinear(proj, hidden, bias=False) if proj != hidden else None
        self.project_out = ReplicatedLinear(hidden, proj, bias=False) if proj != hidden else None
        self.final_layer_norm = None
        if config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False):
            affine = bool(getattr(config, "layer_norm_elementwise_affine", True))
            self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.layers = nn.ModuleList(
            OPTDecoderLayer(config, f"{prefix}.layers.{i}") for i in range(config.num_hidden_layers)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers:
            x = layer(x)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x


class OPTModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)


class OPTForCausalLM(nn.Module):
    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__()
        self.config = hf_config
        self.model = OPTModel(hf_config)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.word_embed_proj_dim, prefix="lm_head")
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:  # released OPT checkpoints tie them
            self.lm_head.tie_weights(self.model.decoder.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.decoder(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor, Any] | None:
            if name.startswith("lm_head.") and self.tie_word_embeddings:
                return None
            if name.startswith("decoder."):
                name = f"model.{name}"
            for hf, sid in ((".q_proj.", "q"), (".k_proj.", "k"), (".v_proj.", "v")):
                if hf in name:
                    return name.replace(hf, ".qkv_proj."), t, sid
            return name.replace(".fc1.", ".mlp.fc1.").replace(".fc2.", ".mlp.fc2."), t, None

        return load_renamed(self, weights, rename)
