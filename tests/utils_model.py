"""Helpers to run pagedllm models without the engine, and tiny random HF checkpoints to test them on.

`PagedModelRunner` binds a KV cache to every Attention module and runs one request at a time through the
paged attention path (prefill chunks and single-token decodes), the way the model runner does.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from pagedllm.attention.backends.abstract import CommonAttentionMetadata
from pagedllm.attention.layer import Attention
from pagedllm.config import ModelConfig
from pagedllm.forward_context import set_forward_context

VOCAB = 256

TINY_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # With rope_theta=100 the tiny head_dim's frequencies fall in all three llama3 regimes.
    "original_max_position_embeddings": 64,
}

# name -> (HF config class name, overrides)
TINY_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama3_tied": (
        "LlamaConfig",
        {"rope_scaling": LLAMA3_ROPE, "rope_theta": 100.0, "tie_word_embeddings": True},
    ),
    "llama_linear_rope_bias": (
        "LlamaConfig",
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "attention_bias": True, "mlp_bias": True},
    ),
    "mistral_sliding": ("MistralConfig", {"sliding_window": 8}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": False}),
    "qwen2_sliding": (
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    "qwen3_mqa": ("Qwen3Config", {"head_dim": 32, "num_key_value_heads": 1}),
}


def tiny_hf_config(variant: str) -> Any:
    import transformers

    cls_name, overrides = TINY_VARIANTS[variant]
    kwargs = {**TINY_COMMON, **overrides}
    return getattr(transformers, cls_name)(**kwargs)


def make_tiny_hf_model(
    variant: str,
    out_dir: str | os.PathLike[str],
    seed: int = 0,
    config: Any | None = None,
    overrides: dict[str, Any] | None = None,
) -> nn.Module:
    """Random float32 HF model of `variant` (or of the given HF `config`; config attributes `overrides`
    applied), saved as safetensors to out_dir. Output layer scaled by 10 so the logits are peaked
    (differences in the forward show up in them)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = config if config is not None else tiny_hf_config(variant)
    for k, v in (overrides or {}).items():
        setattr(config, k, v)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)  # also the embedding when tied
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                # Non-trivial biases and norm weights so that loading mistakes are visible.
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.eval()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return model


def make_model_config(model_dir: str, hf_config: Any, dtype: torch.dtype = torch.float32) -> ModelConfig:
    """A ModelConfig for a local HF directory, without the engine's argument handling."""
    from pagedllm.transformers_utils.config import get_sliding_window

    return ModelConfig(
        model=str(model_dir),
        tokenizer=str(model_dir),
        tokenizer_mode="auto",
        skip_tokenizer_init=True,
        dtype=dtype,
        seed=0,
        max_model_len=int(getattr(hf_config, "max_position_embeddings", 256)),
        revision=None,
        hf_config=hf_config,
        gguf_file=None,
        model_dir=str(model_dir),
        generation_config_mode="auto",
        generation_defaults={},
        max_logprobs=20,
        sliding_window=get_sliding_window(hf_config),
    )


class PagedModelRunner:
    """Runs one request through `model` over a paged KV cache (blocks 0..num_blocks-1 in order)."""

    def __init__(self, model: nn.Module, num_blocks: int = 16, block_size: int = 16) -> None:
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        param = next(model.parameters())
        self.device = param.device
        self.layers: dict[str, Attention] = {m.layer_name: m for m in model.modules() if isinstance(m, Attention)}
        for layer in self.layers.values():
            shape = layer.backend.get_kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, layer.head_size)
            layer.kv_cache = torch.zeros(shape, dtype=param.dtype, device=self.device)
        self.num_computed = 0

    def _metadata(self, num_new: int) -> dict[str, Any]:
        c = self.num_computed
        seq_len = c + num_new
        if seq_len > self.num_blocks * self.block_size:
            raise ValueError("sequence longer than the KV cache")
        qsl = torch.tensor([0, num_new], dtype=torch.int32)
        seq_lens = torch.tensor([seq_len], dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=qsl.to(self.device),
            query_start_loc_cpu=qsl,
            seq_lens=seq_lens.to(self.device),
            seq_lens_cpu=seq_lens,
            num_computed_tokens_cpu=torch.tensor([c], dtype=torch.int32),
            block_table=torch.arange(self.num_blocks, dtype=torch.int32, device=self.device)[None, :],
            slot_mapping=torch.arange(c, seq_len, dtype=torch.int64, device=self.device),
            num_reqs=1,
            num_actual_tokens=num_new,
            max_query_len=num_new,
            max_seq_len=seq_len,
        )
        built: dict[int | None, Any] = {}
        out: dict[str, Any] = {}
        for name, layer in self.layers.items():
            sw = layer.sliding_window
            if sw not in built:
                builder = layer.backend.get_builder_cls()(self.block_size, sw, self.device)
                built[sw] = builder.build(common)
            out[name] = built[sw]
        return out

    @torch.no_grad()
    def step(self, token_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """Feeds the next tokens of the request; returns their logits [n, vocab] (float32)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(-1)
        n = ids.numel()
        positions = torch.arange(self.num_computed, self.num_computed + n, device=self.device)
        with set_forward_context(self._metadata(n)):
            hidden = self.model(ids, positions)
        self.num_computed += n
        return self.model.compute_logits(hidden).float()
