"""Calls the C paged-attention kernels of the CPU backend (`pagedllm/csrc/paged_attn.c`).

`available()` is False where the kernels cannot be built (no C compiler, `PAGEDLLM_CPU_KERNELS=0`); the
backend then keeps its pure-PyTorch path.

FP8 caches (`kv_cache_dtype="fp8"` / `"fp8_e5m2"`, attention/kv_quant.py) are read and written in place too:
`paged_decode` and `reshape_and_cache` then take the layer's `kv_scales` (float32 [1] tensors), with the same
semantics as kv_quant.quantize / dequantize (`supports_fp8` says whether the kernels take such a layer).
"""

from __future__ import annotations

import ctypes

import torch

from pagedllm import csrc
from pagedllm.attention import kv_quant

_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
# (query or new K/V dtype, cache dtype) -> the kernels' suffix; a bfloat16 cache under float32 activations
# is `kv_cache_dtype="bfloat16"` with a float32 model.
_SUFFIX = {
    (torch.float32, torch.float32): "f32",
    (torch.bfloat16, torch.bfloat16): "bf16",
    (torch.float32, torch.bfloat16): "f32_kbf16",
}
# (query or new K/V dtype, FP8 cache dtype) -> suffix; these kernels take the K and V scales as well.
_FP8_SUFFIX = {
    (torch.float32, torch.float8_e4m3fn): "f32_kfp8e4m3",
    (torch.float32, torch.float8_e5m2): "f32_kfp8e5m2",
    (torch.bfloat16, torch.float8_e4m3fn): "bf16_kfp8e4m3",
    (torch.bfloat16, torch.float8_e5m2): "bf16_kfp8e5m2",
}
_i64, _i32, _f32, _p, _int = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
_lib: ctypes.CDLL | None = None
# (..., scale, window, threads) and (..., slots, num_tokens, row): an FP8 kernel's arguments add its K and V scales
_DECODE_ARGS = [_p, _i64, _p, _p, _p, _i64, _p, _p, _p, _i64] + [_int] * 5 + [_f32, _i32, _int]
_WRITE_ARGS = [_p, _i64, _p, _i64, _p, _p, _p, _i64, _i64]


def available() -> bool:
    """Whether the kernels can be used (built on the first call)."""
    global _lib
    if _lib is None:
        lib = csrc.load()
        if lib is None:
            return False
        for sfx in _SUFFIX.values():
            csrc.declare(lib, f"paged_decode_{sfx}", _int, _DECODE_ARGS)
            csrc.declare(lib, f"reshape_and_cache_{sfx}", None, _WRITE_ARGS)
        for sfx in _FP8_SUFFIX.values():  # the same, plus the K and V scales (after `scale`, after `row`)
            csrc.declare(lib, f"paged_decode_{sfx}", _int, _DECODE_ARGS[:-2] + [_f32, _f32] + _DECODE_ARGS[-2:])
            csrc.declare(lib, f"reshape_and_cache_{sfx}", None, _WRITE_ARGS + [_f32, _f32])
        _lib = lib
    return True


def _shape_ok(num_heads: int, num_kv_heads: int, head_size: int) -> bool:
    return num_heads % num_kv_heads == 0 and num_heads <= 128 and head_size <= 512


def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_size: int) -> bool:
    return dtype in _DTYPES and _shape_ok(num_heads, num_kv_heads, head_size) and available()


def supports_fp8(cache_dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_size: int) -> bool:
    """Whether the kernels read and write an FP8 cache of `cache_dtype` for this layer shape."""
    return kv_quant.is_fp8(cache_dtype) and _shape_ok(num_heads, num_kv_heads, head_size) and available()


def _suffix(act: torch.dtype, cache: torch.dtype) -> str | None:
    return _SUFFIX.get((act, cache)) or _FP8_SUFFIX.get((act, cache))


def _scales(kv_scales: tuple[torch.Tensor, torch.Tensor] | None, what: str) -> tuple[float, float]:
    if kv_scales is None:
        raise ValueError(f"{what}: an FP8 KV cache needs the layer's kv_scales (k_scale, v_scale)")
    return float(kv_scales[0]), float(kv_scales[1])


def _rows_ok(t: torch.Tensor) -> bool:
    """[T, heads, head_size] with each token's heads contiguous (any token stride)."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def can_decode(query: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `paged_decode` takes these tensors as they are (else the caller uses its PyTorch path)."""
    return (
        _rows_ok(query)
        and _rows_ok(out)
        and query.dtype == out.dtype
        and _suffix(query.dtype, k_cache.dtype) is not None
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """k_cache/v_cache: [num_blocks, block_size, kvh, hd] contiguous; key/value: [T, kvh, hd]. An FP8 cache
    stores kv_quant.quantize(x, scale) with the layer's `kv_scales`, to the bit."""
    assert _lib is not None
    if not _rows_ok(key):
        key = key.contiguous()
    if not _rows_ok(value):
        value = value.contiguous()
    fp8 = kv_quant.is_fp8(k_cache.dtype)
    if _suffix(key.dtype, k_cache.dtype) is None:  # (an FP8 cache quantizes from float32, as kv_quant does)
        to = torch.float32 if fp8 else k_cache.dtype
        key, value = key.to(to), value.to(to)
    slots = slots.to(torch.int64)
    fn = getattr(_lib, f"reshape_and_cache_{_suffix(key.dtype, k_cache.dtype)}")
    args = [
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        slots.numel(),
        key.shape[1] * key.shape[2],
    ]
    fn(*args, *(_scales(kv_scales, "reshape_and_cache") if fp8 else ()))


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    token_idx: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """One query token per request: out[token_idx[d]] = attention of query[token_idx[d]] over the first
    seq_lens[d] cached positions of request d (block_table row d). query/out: [T, num_heads, hd]. An FP8
    cache is read as cache * scale with the layer's `kv_scales` (K's folded into `scale`, V's applied to the
    output)."""
    assert _lib is not None
    assert can_decode(query, out, k_cache)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_table.stride(1) == 1
    block_table = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
    seq_lens = seq_lens.to(torch.int32).contiguous()
    token_idx = token_idx.to(torch.int64).contiguous()
    num_heads, hd = query.shape[1], query.shape[2]
    _, bs, kvh, _ = k_cache.shape
    sfx = _suffix(query.dtype, k_cache.dtype)
    fn = getattr(_lib, f"paged_decode_{sfx}")
    fp8_scales = _scales(kv_scales, "paged_decode") if kv_quant.is_fp8(k_cache.dtype) else ()
    rc = fn(
        query.data_ptr(),
        query.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_table.data_ptr(),
        block_table.stride(0),
        seq_lens.data_ptr(),
        token_idx.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        token_idx.numel(),
        num_heads,
        kvh,
        hd,
        bs,
        scale,
        *fp8_scales,
        sliding_window or 0,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"paged_decode: unsupported shape (heads {num_heads}, kv heads {kvh}, head size {hd})")
