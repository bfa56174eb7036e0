"""Calls the C paged-attention kernels of the CPU backend (`pagedllm/csrc/paged_attn.c`).

`available()` is False where the kernels cannot be built (no C compiler, `PAGEDLLM_CPU_KERNELS=0`); the
backend then keeps its pure-PyTorch path.
"""

from __future__ import annotations

import ctypes

import torch

from pagedllm import csrc

_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
# (query or new K/V dtype, cache dtype) -> the kernels' suffix; a bfloat16 cache under float32 activations
# is `kv_cache_dtype="bfloat16"` with a float32 model.
_SUFFIX = {
    (torch.float32, torch.float32): "f32",
    (torch.bfloat16, torch.bfloat16): "bf16",
    (torch.float32, torch.bfloat16): "f32_kbf16",
}
_i64, _i32, _f32, _p, _int = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
_lib: ctypes.CDLL | None = None


def available() -> bool:
    """Whether the kernels can be used (built on the first call)."""
    global _lib
    if _lib is None:
        lib = csrc.load()
        if lib is None:
            return False
        for sfx in _SUFFIX.values():
            csrc.declare(
                lib,
                f"paged_decode_{sfx}",
                _int,
                [_p, _i64, _p, _p, _p, _i64, _p, _p, _p, _i64, _int, _int, _int, _int, _int, _f32, _i32, _int],
            )
            csrc.declare(lib, f"reshape_and_cache_{sfx}", None, [_p, _i64, _p, _i64, _p, _p, _p, _i64, _i64])
        _lib = lib
    return True


def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_size: int) -> bool:
    return dtype in _DTYPES and num_heads % num_kv_heads == 0 and num_heads <= 128 and head_size <= 512 and available()


def _rows_ok(t: torch.Tensor) -> bool:
    """[T, heads, head_size] with each token's heads contiguous (any token stride)."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def can_decode(query: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `paged_decode` takes these tensors as they are (else the caller uses its PyTorch path)."""
    return _rows_ok(query) and _rows_ok(out) and query.dtype == out.dtype and (query.dtype, k_cache.dtype) in _SUFFIX


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """k_cache/v_cache: [num_blocks, block_size, kvh, hd] contiguous; key/value: [T, kvh, hd]."""
    assert _lib is not None
    if not _rows_ok(key):
        key = key.contiguous()
    if not _rows_ok(value):
        value = value.contiguous()
    if (key.dtype, k_cache.dtype) not in _SUFFIX:
        key, value = key.to(k_cache.dtype), value.to(k_cache.dtype)
    slots = slots.to(torch.int64)
    fn = getattr(_lib, f"reshape_and_cache_{_SUFFIX[(key.dtype, k_cache.dtype)]}")
    fn(
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        slots.numel(),
        key.shape[1] * key.shape[2],
    )


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
) -> None:
    """One query token per request: out[token_idx[d]] = attention of query[token_idx[d]] over the first
    seq_lens[d] cached positions of request d (block_table row d). query/out: [T, num_heads, hd]."""
    assert _lib is not None
    assert can_decode(query, out, k_cache)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_table.stride(1) == 1
    block_table = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
    seq_lens = seq_lens.to(torch.int32).contiguous()
    token_idx = token_idx.to(torch.int64).contiguous()
    num_heads, hd = query.shape[1], query.shape[2]
    _, bs, kvh, _ = k_cache.shape
    fn = getattr(_lib, f"paged_decode_{_SUFFIX[(query.dtype, k_cache.dtype)]}")
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
        sliding_window or 0,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"paged_decode: unsupported shape (heads {num_heads}, kv heads {kvh}, head size {hd})")
