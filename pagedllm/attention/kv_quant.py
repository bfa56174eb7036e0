"""FP8 KV cache (`kv_cache_dtype="fp8" | "fp8_e4m3" | "fp8_e5m2"`, as vLLM): the paged cache stores K and V
in 8 bits with one float32 scale per layer for K and one for V (`Attention.k_scale` / `v_scale`):
cache = fp8(x / scale), read back as cache * scale. The scales come from the checkpoint (`k_scale` /
`v_scale`, or vLLM's older `k_proj.output_scale` / `v_proj.output_scale`) when present, else 1.0, or are
computed from the first real batch with `calculate_kv_scales` (amax / fp8 max per layer).

With the feature off nothing here runs: the layers carry their two scale tensors and nothing reads them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
_SCALE_NAME = re.compile(r"^(.*?)\.(?:(k|v)_scale|(k|v)_proj\.output_scale)$")


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype; ValueError naming the field for an unknown value."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype: unknown value {kv_cache_dtype!r}; expected one of {', '.join(KV_CACHE_DTYPES)}"
        )
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x / scale saturated to the FP8 range, in `dtype` (the CPU cache write)."""
    m = fp8_max(dtype)
    return (x.float() / scale.float()).clamp_(-m, m).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale.float()).to(dtype)


def gather_dequantized(
    cache: torch.Tensor, blocks: torch.Tensor, length: int, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The first `length` positions of `blocks` of one FP8 cache half ([num_blocks, block_size, H, D]) as
    `dtype` values (gathered as bytes: the CPU has no FP8 index kernels)."""
    raw = cache.view(torch.uint8)[blocks].flatten(0, 1)[:length]
    return dequantize(raw.view(cache.dtype), scale, dtype)


def split_kv_scales(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Passes the checkpoint's tensors through, except per-layer K/V cache scales, which are copied into
    the matching attention layer's `k_scale` / `v_scale` (a checkpoint without them keeps 1.0)."""
    from pagedllm.attention.layer import Attention

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
        buf = layer.k_scale if which == "k" else layer.v_scale
        buf.copy_(tensor.reshape(-1)[:1].float())
        n += 1
    if n:
        logger.info("KV cache: %d per-layer k/v scales read from the checkpoint", n)


def arm_scale_calculation(model: nn.Module) -> None:
    """`calculate_kv_scales`: the next forward of each attention layer that writes the cache sets its
    scales to amax(|k|) / fp8 max and amax(|v|) / fp8 max first (once; the wrapper then removes itself,
    so later steps pay nothing)."""
    from pagedllm.attention.layer import Attention

    for layer in model.modules():
        if isinstance(layer, Attention) and layer.kv_cache is not None and is_fp8(layer.kv_cache.dtype):
            layer.forward = _ScaleCalculation(layer)  # type: ignore[method-assign]


class _ScaleCalculation:
    def __init__(self, layer: Any) -> None:
        self.layer = layer

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: Any = None) -> torch.Tensor:
        layer = self.layer
        m = fp8_max(layer.kv_cache.dtype)
        if k.shape[0]:
            if rotary is not None:  # the cache stores rotated keys: rotate first (in place, as the layer would)
                from pagedllm.attention.ops.triton_rope_cache import apply_rotary_

                apply_rotary_(rotary, q, k, layer.head_size)
                rotary = None
            layer.k_scale.copy_((k.abs().amax().float() / m).clamp(min=1e-8).reshape(1))
            layer.v_scale.copy_((v.abs().amax().float() / m).clamp(min=1e-8).reshape(1))
            del layer.forward  # back to the class's forward
        return type(layer).forward(layer, q, k, v, rotary)
