"""The FP8 KV cache's per-layer scales (`Attention.k_scale` / `v_scale`, see kv_quant.py): read from the
checkpoint at load, or computed from the first real batch (`calculate_kv_scales`)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.attention.kv_quant import is_fp8
from pagedllm.attention.layer import Attention

logger = logging.getLogger(__name__)

# `calculate_kv_scales`: the first batch's amax maps to these FP8 values, not to the format's maximum (448 for
# e4m3), so that later tokens up to 2.2x (K) / 4.5x (V) larger are not clipped (vLLM's K_SCALE_CONSTANT and
# V_SCALE_CONSTANT). Mapping amax to 448 clipped: SmolLM2's FP8-KV perplexity 19.51 against 18.69 with these
# (bf16 18.88; benchmarks/NOTES.md, session 34).
K_SCALE_RANGE = 200.0
V_SCALE_RANGE = 100.0

_SCALE_NAME = re.compile(r"^(.*?)\.(?:(k|v)_scale|(k|v)_proj\.output_scale)$")


def split_kv_scales(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Passes the checkpoint's tensors through, except per-layer K/V cache scales, which are copied into
    the matching attention layer's `k_scale` / `v_scale` (a checkpoint without them keeps 1.0)."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Attention)}
    n = 0
    for name, tensor in weights:
        match = _SCALE_NAME.match(name)
        if match is None:
            yield name, tensor
            continue
        base, which = match.group(1), match.group(2) or match.group(3)
        layer = layers.get(f"{base}.attn") or layers.get(base)
        if layer is None:
            yield name, tensor
            continue
        buf: torch.Tensor = getattr(layer, f"{which}_scale")
        buf.copy_(tensor.reshape(-1)[:1].float())
        n += 1
    if n:
        logger.info("KV cache: %d per-layer k/v scales read from the checkpoint", n)


def arm_scale_calculation(model: nn.Module) -> None:
    """`calculate_kv_scales`: the next forward of each attention layer that writes the cache sets its
    scales to amax(|k|) / K_SCALE_RANGE and amax(|v|) / V_SCALE_RANGE first (once; the wrapper then removes
    itself, so later steps pay nothing)."""
    for layer in model.modules():
        if isinstance(layer, Attention) and layer.kv_cache is not None and is_fp8(layer.kv_cache.dtype):
            layer.forward = _ScaleCalculation(layer)  # type: ignore[method-assign]


class _ScaleCalculation:
    def __init__(self, layer: Any) -> None:
        self.layer = layer

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: Any = None, kv_written: bool = False
    ) -> torch.Tensor:
        assert not kv_written, "an FP8 cache is never written by the projection (TritonAttentionImpl.qkv_rope)"
        layer = self.layer
        if k.shape[0]:
            if rotary is not None:  # the cache stores rotated keys: rotate first (in place, as the layer would)
                from pagedllm.attention.ops.triton_rope_cache import apply_rotary_

                apply_rotary_(rotary, q, k, layer.head_size)
                rotary = None
            layer.k_scale.copy_((k.abs().amax().float() / K_SCALE_RANGE).clamp(min=1e-8).reshape(1))
            layer.v_scale.copy_((v.abs().amax().float() / V_SCALE_RANGE).clamp(min=1e-8).reshape(1))
            del layer.forward  # back to the class's forward
        return type(layer).forward(layer, q, k, v, rotary)
