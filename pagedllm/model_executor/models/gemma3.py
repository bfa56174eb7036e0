"""Gemma 3 (text): RMSNorm scaled by (1 + w) in float32, token embeddings times sqrt(hidden), per-head
q/k RMSNorm, attention scale `query_pre_attn_scalar`^-0.5, alternating sliding-window / global layers
(`layer_types`; the sliding ones form their own KV-cache group and drop blocks that left the window), a
RoPE base per layer type (`rope_parameters[layer_type]`), GeGLU MLP (tanh GELU), norms before and after
both the attention and the MLP, and optional final logit soft-capping. Attention-logit soft-capping
(`attn_logit_softcapping`, Gemma 2's; `gemma2.py` builds on these classes) goes to the attention backend."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.layer import Attention
from pagedllm.model_executor.layers.fused_linear import MergedColumnParallelLinear, QKVParallelLinear
from pagedllm.model_executor.layers.linear import RowParallelLinear
from pagedllm.model_executor.layers.rotary_embedding import get_rope
from pagedllm.model_executor.layers.vocab_embedding import VocabParallelEmbedding
from pagedllm.model_executor.models.llama import LlamaForCausalLM
from pagedllm.model_executor.models.llama_attention import get_head_dim


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), all in float32, cast back to x's dtype (HF's Gemma3RMSNorm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (xf * (1.0 + self.weight.float())).type_as(x)


def _rope_for_layer(config: Any, layer_type: str) -> tuple[float, dict[str, Any] | None]:
    params = getattr(config, "rope_parameters", None) or {}
    p = params.get(layer_type) if isinstance(params, dict) else None
    if p is None:  # transformers 4.x fields
        local = layer_type == "sliding_attention"
        theta = float(getattr(config, "rope_local_base_freq" if local else "rope_theta", 10000.0))
        scaling = None if local else getattr(config, "rope_scaling", None)
        return theta, scaling
    scaling = dict(p) if p.get("rope_type", "default") != "default" else None
    return float(p["rope_theta"]), scaling


def layer_types(config: Any) -> list[str]:
    """Each layer's attention type; configs without `layer_types` alternate, sliding first (Gemma 2)."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    n = int(config.num_hidden_layers)
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]


class Gemma3Attention(nn.Module):
    qk_norm = True
    """Per-head (1 + w) RMSNorm on q and k (Gemma 3; Gemma 2 has none)."""

    def rope_params(self, config: Any, layer_type: str) -> tuple[float, dict[str, Any] | None]:
        return _rope_for_layer(config, layer_type)

    def __init__(self, config: Any, layer_idx: int, prefix: str) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.head_dim = get_head_dim(config)
        num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, config.num_attention_heads, num_kv, bias=bias, prefix=f"{prefix}.qkv_proj"
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, hidden, bias=bias, prefix=f"{prefix}.o_proj"
        )
        eps = float(config.rms_norm_eps)
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, eps)
        layer_type = layer_types(config)[layer_idx]
        theta, scaling = self.rope_params(config, layer_type)
        self.rotary_emb = get_rope(self.head_dim, self.head_dim, int(config.max_position_embeddings), theta, scaling)
        sliding = config.sliding_window if layer_type == "sliding_attention" else None
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            float(config.query_pre_attn_scalar) ** -0.5,
            num_kv_heads=self.num_kv_heads,
            sliding_window=sliding,
            prefix=f"{prefix}.attn",
            logits_soft_cap=getattr(config, "attn_logit_softcapping", None),
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            t = q.shape[0]
            q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).view(t, self.q_size)
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).view(t, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v.contiguous()))


class Gemma3MLP(nn.Module):
    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [inter] * 2, bias=False, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=False, prefix=f"{prefix}.down_proj")
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_new", "gelu"):
            raise ValueError(f"Gemma MLP activation {act!r} is not supported")
        self.approximate = "none" if act == "gelu" else "tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)


class Gemma3DecoderLayer(nn.Module):
    attention_cls: type[Gemma3Attention] = Gemma3Attention

    def __init__(self, config: Any, layer_idx: int, prefix: str) -> None:
        super().__init__()
        h, eps = config.hidden_size, float(config.rms_norm_eps)
        self.self_attn = self.attention_cls(config, layer_idx, f"{prefix}.self_attn")
        self.mlp = Gemma3MLP(config, f"{prefix}.mlp")
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x)))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    decoder_layer_cls: type[Gemma3DecoderLayer] = Gemma3DecoderLayer

    def __init__(self, config: Any, prefix: str = "model") -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens"
        )
        self.embed_scale = float(config.hidden_size) ** 0.5
        self.layers = nn.ModuleList(
            self.decoder_layer_cls(config, i, f"{prefix}.layers.{i}") for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, float(config.rms_norm_eps))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # HF multiplies by the scale rounded to the weights' dtype.
        return x * torch.tensor(self.embed_scale, dtype=torch.float32).to(x.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate: Any = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`inputs_embeds` (multimodal: the scaled token embeddings with image rows merged in, unscaled as
        HF merges them) replaces the embedding lookup; `intermediate` is unused (no pipeline stages)."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Llama's LM wrapper and loader (HF names q/k/v and gate/up fuse the same way) around Gemma3Model,
    plus `final_logit_softcapping`: logits = cap * tanh(logits / cap)."""

    model_cls = Gemma3Model  # type: ignore[assignment]
    supports_pp = False  # its own forward takes no previous stage's activations

    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__(hf_config, prefix)
        self.softcap = getattr(hf_config, "final_logit_softcapping", None)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)  # type: ignore[operator]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
