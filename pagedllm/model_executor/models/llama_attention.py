"""Llama-family self-attention (`LlamaAttention`: fused q/k/v projection, optional per-head q/k RMSNorm, RoPE,
paged attention, output projection) and the config helpers it sizes itself with (`get_head_dim`,
`layer_sliding_window`). The attention of the Llama decoder (`models/llama.py`) and of the models built on it
(Qwen2 / Qwen3 and Granite through its options, OLMoE and Qwen2-VL by subclassing); apart from `llama.py` so that
the decoder, the model and its weight loading read on their own."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.attention.backends.abstract import RotaryArgs
from pagedllm.attention.layer import Attention
from pagedllm.attention.qkv_rope import QKVRope
from pagedllm.distributed.parallel_state import get_tensor_model_parallel_world_size
from pagedllm.model_executor.layers import triton_ops
from pagedllm.model_executor.layers.fused_linear import QKVParallelLinear
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.linear import RowParallelLinear
from pagedllm.model_executor.layers.rotary_embedding import get_rope
from pagedllm.transformers_utils.config import get_rope_params, get_sliding_window


def get_head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def layer_sliding_window(config: Any, layer_idx: int) -> int | None:
    """Sliding window of layer `layer_idx`, honouring per-layer `layer_types` where the config has them."""
    window = get_sliding_window(config)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_idx < len(layer_types):
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window


class LlamaAttention(nn.Module):
    """Self-attention. `qkv_bias` / `o_bias` add projection biases (Qwen2 has the first only); `qk_norm`
    adds per-head RMSNorm on q and k before RoPE (Qwen3); `scale` replaces head_dim^-0.5 (Granite)."""

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        scale: float | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.hidden_size = config.hidden_size
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = getattr(config, "num_key_value_heads", None) or self.total_num_heads
        self.head_dim = get_head_dim(config)
        self.qkv_proj = QKVParallelLinear(
            self.hidden_size,
            self.head_dim,
            self.total_num_heads,
            self.total_num_kv_heads,
            bias=qkv_bias,
            prefix=f"{prefix}.qkv_proj",
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        assert self.num_heads * tp_size == self.total_num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            self.total_num_heads * self.head_dim, self.hidden_size, bias=o_bias, prefix=f"{prefix}.o_proj"
        )
        self.qk_norm = qk_norm
        if qk_norm:
            eps = float(getattr(config, "rms_norm_eps", 1e-6))
            self.q_norm = RMSNorm(self.head_dim, eps=eps)
            self.k_norm = RMSNorm(self.head_dim, eps=eps)
        theta, scaling = get_rope_params(config)
        rotary_dim = int(self.head_dim * float(getattr(config, "partial_rotary_factor", 1.0) or 1.0))
        self.rotary_emb = get_rope(
            self.head_dim,
            rotary_dim,
            int(getattr(config, "max_position_embeddings", 2048)),
            theta,
            scaling,
        )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            scale if scale is not None else self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            sliding_window=layer_sliding_window(config, layer_idx),
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        rope = self._qkv_rope(positions, hidden_states)
        if rope is not None:
            qkv = self.qkv_proj.forward_rope(hidden_states, rope)
            if qkv is not None:  # rotated, and the new K / V in the cache
                q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
                return self.o_proj(self.attn(q, k, v, kv_written=True))
        return self.forward_qkv(positions, self.qkv_proj(hidden_states))

    def _qkv_rope(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> QKVRope | None:
        """RoPE and the cache write for the projection's kernel to do (`Attention.qkv_rope`): the plain layer
        (no q/k norm, `forward_qkv` not overridden) on the Triton path, where the backend offers it."""
        rope = self.rotary_emb
        if (
            hidden_states.shape[0] > 8  # (decode batches only: no GEMV kernel takes more rows)
            or self.qk_norm
            or type(self).forward_qkv is not LlamaAttention.forward_qkv
            or not triton_ops.use_triton_ops(hidden_states)
            or rope.cos_sin_cache.dtype != torch.float32
        ):
            return None
        return self.attn.qkv_rope(RotaryArgs(positions, rope.cos_sin_cache, rope.rotary_dim))

    def forward_qkv(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """The layer after its q/k/v projection (`qkv` [T, q_size + 2 * kv_size])."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if triton_ops.use_triton_ops(qkv) and self.rotary_emb.cos_sin_cache.dtype == torch.float32:
            # The Triton kernels take strided views; RoPE runs inside the attention layer's cache write.
            return self.o_proj(self.attn(q, k, v, rotary=self._rotary_args(positions, q, k)))
        if self.qk_norm:
            t = q.shape[0]
            q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).view(t, self.q_size)
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).view(t, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        attn_out = self.attn(q, k, v.contiguous())
        return self.o_proj(attn_out)

    def _rotary_args(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> RotaryArgs:
        """CUDA path: RoPE (after the per-head q/k norm where the model has one) as one Triton pass over q
        and k, the row views of the fresh qkv output. Partial rotary with a q/k norm cannot share that
        pass: the norm runs first here, in place."""
        rope = self.rotary_emb
        if not self.qk_norm:
            return RotaryArgs(positions, rope.cos_sin_cache, rope.rotary_dim)
        if rope.rotary_dim == self.head_dim and self.q_norm.weight.dtype == q.dtype:
            return RotaryArgs(
                positions,
                rope.cos_sin_cache,
                rope.rotary_dim,
                self.q_norm.weight,
                self.k_norm.weight,
                self.q_norm.variance_epsilon,
            )
        t = q.shape[0]
        q.copy_(self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).view(t, self.q_size))
        k.copy_(self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).view(t, self.kv_size))
        return RotaryArgs(positions, rope.cos_sin_cache, rope.rotary_dim)
