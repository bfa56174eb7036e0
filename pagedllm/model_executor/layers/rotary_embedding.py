"""Rotary position embeddings (neox style: rotate_half over the two halves of the rotary dims).

inv_freq and the cos/sin cache are computed in float32 exactly as HF transformers does, and the rotation
is done in the query's dtype with the cache cast to it, so results match HF bit for bit in float32.
"""

from __future__ import annotations

import json
import math
import weakref
from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers import cpu_ops


def _default_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / rotary_dim
    return 1.0 / (base**exponent)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 / 3.2 frequency rescaling (high frequencies kept, low divided by factor, smooth between)."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _longrope(base: float, rotary_dim: int, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE (HF `_compute_longrope_parameters`): per-frequency factors, `long_factor` or
    `short_factor`, and cos/sin scaled by the attention factor sqrt(1 + ln(s) / ln(original)) where
    s = max_position_embeddings / original_max_position_embeddings. HF switches factors per forward (long once
    the sequence passes the original length); as vLLM, the factors are chosen once here: long when the engine's
    max_model_len exceeds the original length, else short (equal to HF for every sequence in either case except
    the sequences shorter than the original length on an engine allowed longer ones)."""
    orig = int(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or scaling["max_position_embeddings"] / orig)
    attn = scaling.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    use_long = int(scaling.get("max_model_len", orig)) > orig
    ext = torch.tensor(scaling["long_factor" if use_long else "short_factor"], dtype=torch.float32)
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    return 1.0 / (ext * base**exponent), float(attn)


class RotaryEmbedding(nn.Module):
    cos_sin_cache: torch.Tensor

    """Applies RoPE to q [T, H*D] and k [T, KVH*D] (or [T, H, D]) at the given positions [T]."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool = True,
        inv_freq: torch.Tensor | None = None,
        mscale: float = 1.0,
    ) -> None:
        super().__init__()
        if not is_neox_style:
            raise NotImplementedError("only neox-style (rotate_half) rotary embeddings are implemented")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.is_neox_style = is_neox_style
        if inv_freq is None:
            inv_freq = _default_inv_freq(base, rotary_dim)
        self.mscale = mscale
        """cos and sin are multiplied by it (LongRoPE's attention factor)."""
        self.register_buffer("cos_sin_cache", self._compute_cos_sin_cache(inv_freq), persistent=False)

    def _compute_cos_sin_cache(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """[max_positions, rotary_dim]: cos of the rotary_dim/2 frequencies, then their sin (float32)."""
        inv_freq = inv_freq.to(torch.float32).cpu()
        t = torch.arange(self.max_position_embeddings, dtype=torch.int64, device="cpu").to(torch.float32)
        freqs = t[:, None] * inv_freq[None, :]
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        if self.mscale != 1.0:
            cache = cache * self.mscale
        return cache.to(torch.get_default_device())

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        x3 = x.view(t, -1, self.head_size)
        rot = x3[..., : self.rotary_dim]
        half = self.rotary_dim // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        out1 = x1 * cos - x2 * sin
        out2 = x2 * cos + x1 * sin
        if self.rotary_dim == self.head_size:
            return torch.cat((out1, out2), dim=-1).view_as(x)
        return torch.cat((out1, out2, x3[..., self.rotary_dim :]), dim=-1).view_as(x)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if cpu_ops.usable(query) and cpu_ops.rotary_(
            positions,
            query,
            key,
            self.cos_sin_cache,
            self.head_size,
            self.rotary_dim,
        ):
            return query, key  # rotated in place by one C pass
        cos_sin = self.cos_sin_cache.index_select(0, positions.flatten())
        half = self.rotary_dim // 2
        cos = cos_sin[:, None, :half]
        sin = cos_sin[:, None, half:]
        q = self._rotate(query, cos.to(query.dtype), sin.to(query.dtype))
        k = self._rotate(key, cos.to(key.dtype), sin.to(key.dtype))
        return q, k

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
            f"max_position_embeddings={self.max_position_embeddings}, base={self.base}"
        )


_SHARED: weakref.WeakValueDictionary[tuple, RotaryEmbedding] = weakref.WeakValueDictionary()
"""Live rotary embeddings by their arguments and device: every layer of a model (and models built alike on the
same device) shares one module and its read-only cos/sin cache, as vLLM's `get_rope` does. A cache per layer
held 32 x 64 MiB for Llama-3.1-8B's 131,072 positions: 2 GiB taken from the KV cache."""


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
    is_neox_style: bool = True,
) -> RotaryEmbedding:
    """The rotary embedding for a HF `rope_scaling` / `rope_parameters` dict (None = default), shared with every
    caller that asks for the same one on the same default device."""
    key = (head_size, rotary_dim, max_position, float(base), json.dumps(rope_scaling, sort_keys=True, default=str),
           is_neox_style, str(torch.get_default_device()))  # fmt: skip
    rope = _SHARED.get(key)
    if rope is None:
        rope = _build_rope(head_size, rotary_dim, max_position, base, rope_scaling, is_neox_style)
        _SHARED[key] = rope
    return rope


def _build_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None,
    is_neox_style: bool,
) -> RotaryEmbedding:
    inv_freq = _default_inv_freq(base, rotary_dim)
    mscale = 1.0
    rtype = "default"
    if rope_scaling:
        rtype = rope_scaling.get("rope_type", rope_scaling.get("type", "default")) or "default"
    if rtype == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)  # type: ignore[arg-type]
    elif rtype == "linear":
        inv_freq = inv_freq / float(rope_scaling["factor"])  # type: ignore[index]
    elif rtype in ("longrope", "su"):
        inv_freq, mscale = _longrope(base, rotary_dim, rope_scaling)  # type: ignore[arg-type]
    elif rtype not in ("default", "mrope"):  # mrope: default frequencies (`models/qwen2_vl.py` splits them)
        raise NotImplementedError(f"rope scaling type {rtype!r} is not supported (default, linear, llama3, longrope)")
    return RotaryEmbedding(head_size, rotary_dim, max_position, base, is_neox_style, inv_freq, mscale)
