"""The C decode kernel and cache write over an FP8 KV cache (`kv_cache_dtype="fp8"` / `"fp8_e5m2"`) against
PyTorch: the decode against a float64 reference over the dequantized cache (cache * scale, attention/kv_quant.py)
and the backend's PyTorch decode path; the write bit for bit against `kv_quant.quantize` + index_copy_; every
FP8 code's value against torch's."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention import kv_quant
from pagedllm.attention.ops import cpu_paged_attn
from tests.csrc.test_cpu_kernels import (
    DECODE_SHAPES,
    _reference_decode,
    _torch_path_decode,
    check_batch_and_thread_invariant,
)

pytestmark = pytest.mark.skipif(not cpu_paged_attn.available(), reason="no C compiler for the CPU kernels")
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _scales(k: float, v: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([k]), torch.tensor([v])  # float32 [1], as Attention.k_scale / v_scale


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,kvh,hd,bs,window", DECODE_SHAPES)
def test_fp8_decode_matches_reference(
    cache_dtype: torch.dtype, dtype: torch.dtype, num_heads: int, kvh: int, hd: int, bs: int, window: int | None
) -> None:
    """GQA, contexts below and above the kernel's 512-key parts, sliding windows, non-unit scales."""
    g = torch.Generator().manual_seed(num_heads * 100 + hd)
    num_blocks, d_reqs = 64, 7
    kv_scales = _scales(0.037, 2.5)
    k_cache = kv_quant.quantize(torch.randn(num_blocks, bs, kvh, hd, generator=g) * 3, kv_scales[0], cache_dtype)
    v_cache = kv_quant.quantize(torch.randn(num_blocks, bs, kvh, hd, generator=g) * 9, kv_scales[1], cache_dtype)
    seq_lens = torch.tensor([1, 2, 31, 32, 33, 600, 1100], dtype=torch.int32)
    max_nb = (int(seq_lens.max()) + bs - 1) // bs
    bt = torch.randint(0, num_blocks, (d_reqs, max_nb), generator=g, dtype=torch.int32)
    bt[1, 0] = bt[0, 0]  # a shared (prefix-cached) block
    num_tokens = 12  # decode tokens at scattered rows of a larger batch
    query = torch.randn(num_tokens, num_heads, hd, generator=g).to(dtype)
    tok_idx = torch.tensor([0, 2, 3, 5, 8, 10, 11])
    out = torch.full_like(query, 7.0)
    scale = hd**-0.5
    assert cpu_paged_attn.supports_fp8(cache_dtype, num_heads, kvh, hd)
    assert cpu_paged_attn.can_decode(query, out, k_cache)
    cpu_paged_attn.paged_decode(query, k_cache, v_cache, bt, seq_lens, tok_idx, out, scale, window, kv_scales)

    k_deq = k_cache.double() * float(kv_scales[0])  # every FP8 value and its product are exact in float64
    v_deq = v_cache.double() * float(kv_scales[1])
    ref = _reference_decode(query[tok_idx], k_deq, v_deq, bt, seq_lens, scale, window)
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # (outputs of magnitude ~10: V's scale 2.5 times ~4)
    torch.testing.assert_close(out[tok_idx].double(), ref, atol=tol, rtol=tol)
    untouched = torch.ones(num_tokens, dtype=torch.bool)
    untouched[tok_idx] = False
    assert bool((out[untouched] == 7.0).all()), "rows of other tokens must not be written"

    # The backend's PyTorch path (its fallback) agrees too.
    shape = (num_heads, hd, scale, kvh, window)
    torch_out = _torch_path_decode(query, tok_idx, k_cache, v_cache, bt, seq_lens, shape, kv_scales)
    torch.testing.assert_close(torch_out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_codes_exact(cache_dtype: torch.dtype, dtype: torch.dtype) -> None:
    """One key: the output is V's row times v_scale exactly, so a row holding all 256 codes reads each code's
    value (subnormals, e5m2's infinities, NaNs where torch has them)."""
    hd = 256
    codes = torch.arange(256, dtype=torch.uint8).view(cache_dtype)
    k_cache = torch.zeros(1, 1, 1, hd, dtype=cache_dtype)
    v_cache = codes.view(1, 1, 1, hd).clone()
    query = torch.ones(1, 2, hd, dtype=dtype)
    out = torch.empty_like(query)
    kv_scales = _scales(0.5, 3.0)
    one = torch.ones(1, dtype=torch.int32)
    cpu_paged_attn.paged_decode(
        query, k_cache, v_cache, torch.zeros(1, 1, dtype=torch.int32), one, torch.zeros(1), out, 1.0, None, kv_scales
    )
    expected = (codes.float() * 3.0).to(dtype)
    for h in range(2):
        got = out[0, h]
        nan = expected.isnan()
        assert torch.equal(got.isnan(), nan)
        assert torch.equal(got[~nan], expected[~nan])  # (-0.0 reads +0.0: the sums start at +0, as a matmul's)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_scale", [1.0, 0.0173, 7.0])
def test_fp8_cache_write_matches_kv_quant(cache_dtype: torch.dtype, dtype: torch.dtype, k_scale: float) -> None:
    """Bit for bit the PyTorch path's write (kv_quant.quantize: x / scale saturated, round to nearest-even):
    every bfloat16 value (ties between FP8 codes, subnormals, values past the range, inf and NaN), and in
    float32 each of them one ulp up and down."""
    kvh, hd = 2, 64
    row = kvh * hd
    x = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    if dtype == torch.float32:
        bits = x.view(torch.int32)
        x = torch.cat([x, (bits + 1).view(torch.float32), (bits - 1).view(torch.float32)])
        x = x * k_scale  # a scaled input divides back to (about) the pattern
    x = x.to(dtype)
    n_tok = -(-x.numel() // row)
    x = torch.cat([x, torch.zeros(n_tok * row - x.numel(), dtype=dtype)]).view(n_tok, kvh, hd)
    kv_scales = _scales(k_scale, 0.25)
    value = x.flip(0).contiguous()
    num_slots = n_tok + 5
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(1))[:n_tok]
    slots[3] = -1  # padding: skipped
    k_cache = torch.zeros(num_slots, 1, kvh, hd, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    cpu_paged_attn.reshape_and_cache(x, value, k_cache, v_cache, slots, kv_scales)

    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    keep = slots >= 0
    for ref, src, s in ((k_ref, x, kv_scales[0]), (v_ref, value, kv_scales[1])):
        q = kv_quant.quantize(src[keep], s, cache_dtype).view(torch.uint8)
        ref.view(torch.uint8).view(-1, kvh, hd).index_copy_(0, slots[keep], q)
    for got, ref in ((k_cache, k_ref), (v_cache, v_ref)):
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))


def test_fp8_batch_and_thread_invariant() -> None:
    g = torch.Generator().manual_seed(5)
    kv_scales = _scales(0.05, 0.02)
    k_cache = kv_quant.quantize(torch.randn(200, 16, 3, 64, generator=g), kv_scales[0], torch.float8_e4m3fn)
    v_cache = kv_quant.quantize(torch.randn(200, 16, 3, 64, generator=g), kv_scales[1], torch.float8_e4m3fn)
    check_batch_and_thread_invariant(k_cache, v_cache, g, kv_scales)


def test_fp8_needs_scales() -> None:
    k_cache = torch.zeros(2, 16, 1, 64, dtype=torch.float8_e4m3fn)
    query = torch.zeros(1, 2, 64)
    one = torch.ones(1, dtype=torch.int32)
    bt = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="paged_decode: an FP8 KV cache needs the layer's kv_scales"):
        cpu_paged_attn.paged_decode(
            query, k_cache, k_cache, bt, one, torch.zeros(1), torch.empty_like(query), 1.0, None
        )
    with pytest.raises(ValueError, match="reshape_and_cache: an FP8 KV cache needs the layer's kv_scales"):
        cpu_paged_attn.reshape_and_cache(query[:, :1], query[:, :1], k_cache, k_cache, torch.zeros(1))
    assert not cpu_paged_attn.supports_fp8(torch.float8_e4m3fn, 9, 2, 64)  # heads not a multiple of kv heads
    assert not cpu_paged_attn.supports_fp8(torch.bfloat16, 8, 2, 64)
