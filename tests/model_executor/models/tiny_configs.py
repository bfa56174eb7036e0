"""Tiny HF configs of the architectures added with issue 18, built on `tests.utils_model.TINY_COMMON`."""

from __future__ import annotations

from typing import Any

from tests.utils_model import TINY_COMMON

# Routed experts: more experts than top-k; Qwen2-MoE adds its gated shared expert, Qwen3-MoE one dense
# layer (`mlp_only_layers`) next to a sparse one.
MOE_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
    ),
    "qwen3_moe_dense_layer": (
        "Qwen3MoeConfig",
        {
            "head_dim": 32,
            "num_experts": 6,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "norm_topk_prob": False,
            "mlp_only_layers": [1],
        },
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": False,
        },
    ),
    "mixtral": ("MixtralConfig", {"num_local_experts": 6, "num_experts_per_tok": 2, "intermediate_size": 48}),
    "olmoe": (
        "OlmoeConfig",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "norm_topk_prob": True,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
}

# Dense architectures added with issue 18.
DENSE_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "phi3": ("Phi3Config", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "gpt2": (
        "GPT2Config",
        {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "bos_token_id": 1, "eos_token_id": 2},
    ),
    "opt": (
        "OPTConfig",
        {"ffn_dim": 128, "word_embed_proj_dim": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # opt-350m's layout: post-LayerNorm blocks, a narrower embedding projected in and out.
    "opt_post_ln_proj": (
        "OPTConfig",
        {
            "ffn_dim": 128,
            "word_embed_proj_dim": 32,
            "do_layer_norm_before": False,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
}
DENSE_VARIANTS["gemma3"] = (
    "Gemma3TextConfig",
    {
        "head_dim": 32,
        "query_pre_attn_scalar": 24,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        },
        "final_logit_softcapping": 30.0,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
)
# Gemma 2: a small attention-logit cap so that it bites on a tiny model's scores.
DENSE_VARIANTS["gemma2"] = (
    "Gemma2Config",
    {
        "head_dim": 32,
        "query_pre_attn_scalar": 24,
        "sliding_window": 8,
        "attn_logit_softcapping": 1.5,
        "final_logit_softcapping": 30.0,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
)
# Granite's four scalars, away from 1 so that a missing one shows.
DENSE_VARIANTS["granite"] = (
    "GraniteConfig",
    {
        "embedding_multiplier": 3.0,
        "attention_multiplier": 0.05,
        "residual_multiplier": 0.4,
        "logits_scaling": 2.5,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
)
# Configs with their own names for the sizes: built from these keys of TINY_COMMON only.
_OWN_NAMES = {
    "GPT2Config": ("vocab_size",),
    "OPTConfig": ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings"),
}


def tiny_config(variants: dict[str, tuple[str, dict[str, Any]]], name: str) -> Any:
    import transformers

    cls_name, overrides = variants[name]
    common = TINY_COMMON
    if cls_name in _OWN_NAMES:
        common = {k: TINY_COMMON[k] for k in _OWN_NAMES[cls_name]}
    return getattr(transformers, cls_name)(**{**common, **overrides})
