"""FP8 KV cache (`kv_cache_dtype="fp8" | "fp8_e4m3" | "fp8_e5m2"`, as vLLM): the paged cache stores K and V
in 8 bits with one float32 scale per layer for K and one for V (`Attention.k_scale` / `v_scale`):
cache = fp8(x / scale), read back as cache * scale. The scales come from the checkpoint (`k_scale` /
`v_scale`, or vLLM's older `k_proj.output_scale` / `v_proj.output_scale`) when present, else 1.0, or are
computed from the first real batch with `calculate_kv_scales` (amax / fp8 max per layer).

With the feature off nothing here runs: the layers carry their two scale tensors and nothing reads them.
The scales' loading and `calculate_kv_scales` live in `kv_scales.py`.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bfloat16": torch.bfloat16,  # not quantization: 16 bits under a float32 model (the CPU; see config.py)
    "float32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


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
