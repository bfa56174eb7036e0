"""The CPU fast paths against their PyTorch references: the C paged-attention kernels (decode over the
paged cache, cache writes) and oneDNN-packed bf16 linears."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pagedllm.attention.backends.abstract import AttentionType
from pagedllm.attention.backends.torch_native import TorchNativeAttentionImpl, TorchNativeMetadata
from pagedllm.attention.ops import cpu_paged_attn
from pagedllm.model_executor.layers import cpu_gemm, cpu_ops
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.rotary_embedding import RotaryEmbedding

needs_kernels = pytest.mark.skipif(not cpu_paged_attn.available(), reason="no C compiler for the CPU kernels")


# (q heads, kv heads, head size, block size, sliding window) of the decode kernel tests: GQA groups of 1-12, a head
# size that is no power of two, windows shorter and longer than the kernel's 512-key parts.
DECODE_SHAPES = [
    (9, 3, 64, 16, None),
    (4, 4, 80, 8, None),
    (8, 2, 128, 16, 20),
    (12, 1, 32, 32, None),
    (8, 2, 64, 16, 700),
]


def _torch_path_decode(
    query: torch.Tensor,
    tok_idx: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    bt: torch.Tensor,
    seq_lens: torch.Tensor,
    shape: tuple[int, int, float, int, int | None],
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The attention backend's PyTorch decode (its path without the C kernels) of the rows `tok_idx`;
    `shape`: (num_heads, head_size, scale, num_kv_heads, sliding window)."""
    num_heads, hd, scale, kvh, window = shape
    impl = TorchNativeAttentionImpl(num_heads, hd, scale, kvh, window, AttentionType.DECODER)
    if kv_scales is not None:
        impl.kv_scales = kv_scales
    md = TorchNativeMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        num_actual_tokens=0,
        causal=True,
        decode_token_idx=tok_idx,
        decode_block_table=bt,
        decode_seq_lens=seq_lens,
        prefills=[],
        spans=[],
    )
    return impl._decode(query[tok_idx], k_cache, v_cache, md)


def _reference_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    bt: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Float64, one request at a time, straight from the definition."""
    d_reqs, num_heads, hd = q.shape
    _, bs, kvh, _ = k_cache.shape
    g = num_heads // kvh
    out = torch.empty(d_reqs, num_heads, hd, dtype=torch.float64)
    for d in range(d_reqs):
        n = int(seq_lens[d])
        pos = torch.arange(n)
        slots = bt[d, pos // bs].long() * bs + pos % bs
        k = k_cache.reshape(-1, kvh, hd)[slots].double()  # [n, kvh, hd]
        v = v_cache.reshape(-1, kvh, hd)[slots].double()
        start = max(0, n - window) if window else 0
        for h in range(num_heads):
            s = (k[start:, h // g] @ q[d, h].double()) * scale
            out[d, h] = torch.softmax(s, 0) @ v[start:, h // g]
    return out


@needs_kernels
@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
)
@pytest.mark.parametrize("num_heads,kvh,hd,bs,window", DECODE_SHAPES)
def test_paged_decode_matches_reference(
    dtype: torch.dtype, cache_dtype: torch.dtype, num_heads: int, kvh: int, hd: int, bs: int, window: int | None
) -> None:
    """Float32 or bfloat16 throughout, and float32 queries over a bfloat16 cache (kv_cache_dtype="bfloat16")."""
    g = torch.Generator().manual_seed(num_heads * 100 + hd)
    num_blocks, d_reqs = 64, 7
    k_cache = torch.randn(num_blocks, bs, kvh, hd, generator=g).to(cache_dtype)
    v_cache = torch.randn(num_blocks, bs, kvh, hd, generator=g).to(cache_dtype)
    # 600 and 1,100 keys span two and three of the kernel's 512-key parts (merged after)
    seq_lens = torch.tensor([1, 2, 31, 32, 33, 600, 1100][:d_reqs], dtype=torch.int32)
    max_nb = (int(seq_lens.max()) + bs - 1) // bs
    bt = torch.randint(0, num_blocks, (d_reqs, max_nb), generator=g, dtype=torch.int32)
    bt[1, 0] = bt[0, 0]  # a shared (prefix-cached) block
    # The decode tokens sit at scattered rows of a larger batch, as in a mixed prefill/decode step.
    num_tokens = 12
    query = torch.randn(num_tokens, num_heads, hd, generator=g).to(dtype)
    tok_idx = torch.tensor([0, 2, 3, 5, 8, 10, 11][:d_reqs])
    out = torch.full_like(query, 7.0)
    scale = hd**-0.5
    cpu_paged_attn.paged_decode(query, k_cache, v_cache, bt, seq_lens, tok_idx, out, scale, window)

    ref = _reference_decode(query[tok_idx], k_cache, v_cache, bt, seq_lens, scale, window)
    tol = 2e-5 if dtype == torch.float32 else 1e-2  # (a bf16 cache's values are exact in the float64 reference)
    torch.testing.assert_close(out[tok_idx].double(), ref, atol=tol, rtol=tol)
    untouched = torch.ones(num_tokens, dtype=torch.bool)
    untouched[tok_idx] = False
    assert bool((out[untouched] == 7.0).all()), "rows of other tokens must not be written"

    # The backend's PyTorch path (used without the kernels) agrees too.
    torch_out = _torch_path_decode(query, tok_idx, k_cache, v_cache, bt, seq_lens, (num_heads, hd, scale, kvh, window))
    torch.testing.assert_close(torch_out.double(), ref, atol=tol, rtol=tol)


def check_batch_and_thread_invariant(k_cache: torch.Tensor, v_cache: torch.Tensor, g: Any, *extra: Any) -> None:
    """`paged_decode` over four requests (contexts 1,500 / 40 / 700 / 3, fragmented blocks) gives each request the
    same bits alone as batched, with one thread as with two (`extra`: its trailing arguments, e.g. kv_scales)."""
    seq_lens = torch.tensor([1500, 40, 700, 3], dtype=torch.int32)
    bt = torch.randint(0, 200, (4, 94), generator=g, dtype=torch.int32)
    query = torch.randn(4, 9, 64, generator=g)
    runs = []
    threads = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            out = torch.empty_like(query)
            idx = torch.arange(4)
            cpu_paged_attn.paged_decode(query, k_cache, v_cache, bt, seq_lens, idx, out, 0.125, None, *extra)
            runs.append(out)
            for d in range(4):
                alone = torch.empty_like(query[:1])
                cpu_paged_attn.paged_decode(
                    query[d : d + 1], k_cache, v_cache, bt[d : d + 1], seq_lens[d : d + 1],
                    torch.zeros(1, dtype=torch.long), alone, 0.125, None, *extra,
                )  # fmt: skip
                assert torch.equal(alone[0], out[d])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(runs[0], runs[1])


@needs_kernels
def test_paged_decode_is_batch_and_thread_invariant() -> None:
    """A long context is split into fixed 512-key parts merged in order: a request's output is the same bits
    alone or batched, with one thread or two."""
    g = torch.Generator().manual_seed(5)
    k_cache = torch.randn(200, 16, 3, 64, generator=g)
    v_cache = torch.randn(200, 16, 3, 64, generator=g)
    check_batch_and_thread_invariant(k_cache, v_cache, g)


@needs_kernels
@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
)
def test_reshape_and_cache_matches_index_copy(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """Rows copied, or rounded to bfloat16 exactly as torch's conversion does (ties and subnormals included;
    a NaN stays a NaN, whatever its payload)."""
    num_blocks, bs, kvh, hd, t = 16, 16, 3, 64, 40
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(t, (2 + 2 * kvh) * hd, generator=g).to(dtype)  # key/value as strided column slices
    qkv[0, 2 * hd : 2 * hd + 4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(2**-130), float("nan")])  # ties etc.
    key = qkv[:, 2 * hd : (2 + kvh) * hd].view(t, kvh, hd)
    value = qkv[:, (2 + kvh) * hd :].view(t, kvh, hd)
    slots = torch.randperm(num_blocks * bs, generator=g)[:t]
    k_cache = torch.zeros(num_blocks, bs, kvh, hd, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    cpu_paged_attn.reshape_and_cache(key, value, k_cache, v_cache, slots)
    k_ref = torch.zeros_like(k_cache)
    v_ref = torch.zeros_like(v_cache)
    k_ref.view(-1, kvh, hd).index_copy_(0, slots, key.to(cache_dtype))
    v_ref.view(-1, kvh, hd).index_copy_(0, slots, value.to(cache_dtype))
    nan = k_ref.isnan()
    assert bool(k_cache[nan].isnan().all()) and int(nan.sum()) == 1
    k_cache[nan] = k_ref[nan] = 0
    for got, ref in ((k_cache, k_ref), (v_cache, v_ref)):
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16))  # as bits


@pytest.mark.skipif(not cpu_gemm.can_pack(torch.empty(2, 2, dtype=torch.bfloat16)), reason="no oneDNN bf16 packing")
@pytest.mark.parametrize("m", [0, 1, 5, 64])
def test_packed_linear_matches_f_linear(m: int) -> None:
    g = torch.Generator().manual_seed(m)
    lin = torch.nn.Linear(96, 40, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 96, generator=g))
        lin.bias.copy_(torch.randn(40, generator=g))
    x = torch.randn(m, 96, generator=g).to(torch.bfloat16)
    expect = F.linear(x.float(), lin.weight.float(), lin.bias.float())
    assert cpu_gemm.pack_module(lin, release=True)
    assert lin.weight.numel() == 0  # the plain copy is released
    got = cpu_gemm.packed_linear(x, lin.packed_weight, lin.bias, lin.packed_out_features)
    assert got.shape == (m, 40) and got.dtype == torch.bfloat16
    # bf16 output rounding: half an ulp of values up to ~40 is 0.125.
    torch.testing.assert_close(got.float(), expect, atol=0.25, rtol=1e-2)


needs_layers = pytest.mark.skipif(not cpu_ops.usable(torch.ones(1)), reason="no C compiler for the CPU kernels")


def _torch_rms(x: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None):  # noqa: ANN202
    """RMSNorm's PyTorch path (HF semantics), kept as the reference."""
    norm = RMSNorm(x.shape[-1], eps).to(x.dtype)
    norm.weight.data.copy_(w)
    if residual is None:
        return norm._norm(x)
    s = x + residual
    return norm._norm(s), s


@needs_layers
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 200])
def test_fused_rms_norm_matches_torch(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    cols = 576
    base = torch.randn(rows, cols + 64, generator=g).to(dtype)
    x = base[:, 32 : 32 + cols]  # a strided row view, as a projection's slice would be
    w = (1 + 0.1 * torch.randn(cols, generator=g)).to(dtype)
    res = torch.randn(rows, cols, generator=g).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.0, "rtol": 1e-2}

    out = cpu_ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(out, _torch_rms(x, w, 1e-5, None), **tol)

    ref_out, ref_res = _torch_rms(x, w, 1e-5, res.clone())
    got = cpu_ops.rms_norm(x, w, 1e-5, res)
    assert got is not None and got[1] is res  # the residual is updated in place
    assert torch.equal(res, ref_res)  # x + residual: one rounding, identical
    torch.testing.assert_close(got[0], ref_out, **tol)


@needs_layers
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_fused_rotary_is_bitwise_torch(dtype: torch.dtype, rotary_dim: int) -> None:
    """Same roundings as the PyTorch path (products rounded, no FMA): identical results."""
    g = torch.Generator().manual_seed(rotary_dim)
    t, hq, hk, d = 37, 9, 3, 64
    rope = RotaryEmbedding(d, rotary_dim, 4096, 10000.0)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(dtype)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    positions = torch.randint(0, 4096, (t,), generator=g)
    q_ref, k_ref = q.clone(), k.clone()
    assert cpu_ops.rotary_(positions, q, k, rope.cos_sin_cache, d, rotary_dim)
    cos_sin = rope.cos_sin_cache.index_select(0, positions)
    half = rotary_dim // 2
    cos, sin = cos_sin[:, None, :half].to(dtype), cos_sin[:, None, half:].to(dtype)
    assert torch.equal(q, rope._rotate(q_ref, cos, sin)) and torch.equal(k, rope._rotate(k_ref, cos, sin))
    with pytest.raises(IndexError, match="position"):
        cpu_ops.rotary_(torch.tensor([4096] * t), q, k, rope.cos_sin_cache, d, rotary_dim)


@needs_layers
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_silu_and_mul_matches_torch(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    x = (4 * torch.randn(33, 2 * 1536, generator=g)).to(dtype)
    ref = F.silu(x[:, :1536]) * x[:, 1536:]
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(cpu_ops.silu_and_mul(x), ref, **tol)
