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
}

# Dense architectures added with issue 18.
DENSE_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "phi3": ("Phi3Config", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
}


def tiny_config(variants: dict[str, tuple[str, dict[str, Any]]], name: str) -> Any:
    import transformers

    cls_name, overrides = variants[name]
    return getattr(transformers, cls_name)(**{**TINY_COMMON, **overrides})
