"""Calls the blocked (flash-style) C prefill attention of the CPU backend (`pagedllm/csrc/prefill_attn.c`).

Causal attention of each prefill chunk's query tokens (positions context_len .. seq_len - 1) over keys
0 .. position read straight from the paged KV cache (the chunk's own K/V are written there first), GQA by
indexing, an optional sliding window, float32 or bfloat16 (float32 math). It replaces, on the CPU, per-request
SDPA after repeat_interleave (and, for chunks with a cached prefix, a K/V gather plus a dense mask).
Queries and outputs are float32 or bfloat16; the cache is the same dtype or bfloat16 under float32 queries
(`kv_cache_dtype="bfloat16"`). A bfloat16 cache takes the bfloat16 dot-product kernel
(`csrc/prefill_attn_dot.c`: Q and P rounded to bfloat16, float32 sums) where the CPU has AVX512-BF16,
unless `PAGEDLLM_CPU_PREFILL_DOT=0`.

`available()` is False where the kernels cannot be built (no C compiler, `PAGEDLLM_CPU_KERNELS=0`) or
`PAGEDLLM_CPU_PREFILL_ATTN=0`; the backend then keeps its PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import Protocol

import torch

from pagedllm import csrc, envs

_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
# (query dtype, cache dtype) -> the float32-math kernel's name
_KERNELS = {
    (torch.float32, torch.float32): "prefill_attn_f32",
    (torch.bfloat16, torch.bfloat16): "prefill_attn_bf16",
    (torch.float32, torch.bfloat16): "prefill_attn_f32_kbf16",
}
_i64, _i32, _f32, _p, _int = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
_lib: ctypes.CDLL | None = None
MAX_HEAD = 512
MAX_GROUP = 256


class Chunk(Protocol):
    """One request's prefill chunk (the backend's `PrefillSpan`)."""

    q_start: int  # first query row in the flattened batch
    q_end: int
    context_len: int  # positions already cached before the chunk
    seq_len: int  # context_len + chunk length
    blocks: torch.Tensor  # block ids covering seq_len positions


def available() -> bool:
    """Whether the kernel can be used (the library is built on the first call)."""
    global _lib
    if not envs.PAGEDLLM_CPU_PREFILL_ATTN:
        return False
    if _lib is None:
        lib = csrc.load()
        if lib is None:
            return False
        args: list[object] = [
            _p, _i64, _p, _p, _p, _i64, _p, _p, _p, _int, _p, _i64, _int, _int, _int, _int, _f32, _i32, _int,
        ]  # fmt: skip
        for name in _KERNELS.values():
            csrc.declare(lib, name, _int, args)
        csrc.declare(lib, "prefill_dot_supports", _int, [_int])
        for sfx in _DTYPES.values():
            if hasattr(lib, f"prefill_attn_dot_{sfx}"):  # built where the compiler targets AVX512-BF16
                csrc.declare(lib, f"prefill_attn_dot_{sfx}", _int, args)
        _lib = lib
    return True


def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_size: int) -> bool:
    """Cache dtype and head shape the kernel handles (FP8 caches and soft-capping are the caller's to exclude)."""
    return (
        dtype in _DTYPES
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_size <= MAX_HEAD
        and available()
    )


def _rows_ok(t: torch.Tensor) -> bool:
    """[T, heads, head_size] with each token's heads contiguous (any token stride)."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def can_run(query: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `prefill` takes these tensors as they are (query and output of one dtype, a cache of that
    dtype or bfloat16)."""
    return (
        _rows_ok(query)
        and _rows_ok(out)
        and query.dtype == out.dtype
        and (query.dtype, k_cache.dtype) in _KERNELS
        and k_cache.is_contiguous()
    )


def uses_dot(query_dtype: torch.dtype, cache_dtype: torch.dtype, head_size: int) -> bool:
    """Whether `prefill` runs the bfloat16 dot-product kernel for these dtypes (see the module's doc)."""
    assert _lib is not None, "call available() first"
    return cache_dtype == torch.bfloat16 and envs.PAGEDLLM_CPU_PREFILL_DOT and _dot_built(query_dtype, head_size)


@functools.cache
def _dot_built(query_dtype: torch.dtype, head_size: int) -> bool:
    """Whether this build has the dot kernel for these queries and head size (fixed for the process)."""
    assert _lib is not None
    return hasattr(_lib, f"prefill_attn_dot_{_DTYPES[query_dtype]}") and bool(_lib.prefill_dot_supports(head_size))


def prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunks: Sequence[Chunk],
    out: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    num_threads: int | None = None,
) -> None:
    """out[c.q_start : c.q_end] = causal attention of those query rows over the cached positions of each
    chunk, in one call for all chunks. query/out: [T, num_heads, head_size]; k_cache/v_cache:
    [num_blocks, block_size, num_kv_heads, head_size], contiguous."""
    assert _lib is not None, "call available() first"
    assert can_run(query, out, k_cache) and v_cache.is_contiguous() and v_cache.dtype == k_cache.dtype
    if not chunks:
        return
    width = max(c.blocks.numel() for c in chunks)
    table = torch.zeros(len(chunks), max(width, 1), dtype=torch.int32)
    for i, c in enumerate(chunks):
        table[i, : c.blocks.numel()] = c.blocks
    q_start = torch.tensor([c.q_start for c in chunks], dtype=torch.int64)
    ctx = torch.tensor([c.context_len for c in chunks], dtype=torch.int32)
    seq = torch.tensor([c.seq_len for c in chunks], dtype=torch.int32)
    for c in chunks:
        assert c.q_end - c.q_start == c.seq_len - c.context_len, "chunk length != seq_len - context_len"
    num_heads, hd = query.shape[1], query.shape[2]
    _, bs, kvh, _ = k_cache.shape
    if uses_dot(query.dtype, k_cache.dtype, hd):
        fn = getattr(_lib, f"prefill_attn_dot_{_DTYPES[query.dtype]}")
    else:
        fn = getattr(_lib, _KERNELS[(query.dtype, k_cache.dtype)])
    rc = fn(
        query.data_ptr(),
        query.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        table.data_ptr(),
        table.stride(0),
        q_start.data_ptr(),
        ctx.data_ptr(),
        seq.data_ptr(),
        len(chunks),
        out.data_ptr(),
        out.stride(0),
        num_heads,
        kvh,
        hd,
        bs,
        scale,
        sliding_window or 0,
        num_threads or torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"prefill_attn: failed ({rc}): heads {num_heads}, kv heads {kvh}, head size {hd}")
