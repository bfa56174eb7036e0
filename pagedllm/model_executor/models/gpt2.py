"""GPT-2: learned absolute positions, pre-LayerNorm blocks, fused biased q/k/v (`c_attn`), GELU (tanh)
MLP, final LayerNorm, LM head tied to the token embedding. Checkpoints store the projections as
`Conv1D` weights ([in, out], the transpose of a Linear's); `load_weights` transposes them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.model_executor.models.learned_pos import BiasedMLP, BiasedSelfAttention, load_renamed

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_RENAMES = (
    ("attn.c_attn.", "attn.qkv_proj."),
    ("attn.c_proj.", "attn.out_proj."),
    ("mlp.c_fc.", "mlp.fc1."),
    ("mlp.c_proj.", "mlp.fc2."),
)


class GPT2Block(nn.Module):
    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, float(config.layer_norm_epsilon)
        if getattr(config, "scale_attn_by_inverse_layer_idx", False) or getattr(
            config, "reorder_and_upcast_attn", False
        ):
            raise ValueError(
                "GPT-2 configs with scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported"
            )
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.attn = BiasedSelfAttention(hidden, config.num_attention_heads, prefix=f"{prefix}.attn")
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        inner = getattr(config, "n_inner", None) or 4 * hidden
        self.mlp = BiasedMLP(hidden, inner, config.activation_function, prefix=f"{prefix}.mlp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, config: Any, prefix: str = "transformer") -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size, prefix=f"{prefix}.wte")
        self.wpe = VocabParallelEmbedding(config.max_position_embeddings, config.hidden_size, prefix=f"{prefix}.wpe")
        self.h = nn.ModuleList(GPT2Block(config, f"{prefix}.h.{i}") for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=float(config.layer_norm_epsilon))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__()
        self.config = hf_config
        self.transformer = GPT2Model(hf_config)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, prefix="lm_head")
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:  # released GPT-2 checkpoints tie them
            self.lm_head.tie_weights(self.transformer.wte)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.transformer(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor, Any] | None:
            if name.startswith("lm_head."):
                return None if self.tie_word_embeddings else (name, t, None)
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                return None  # causal-mask buffers of old checkpoints
            if not name.startswith("transformer."):
                name = f"transformer.{name}"
            if name.endswith(_CONV1D):
                t = t.t()
            for old, new in _RENAMES:
                name = name.replace(old, new)
            return name, t, None

        return load_renamed(self, weights, rename)
