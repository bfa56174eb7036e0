"""The blocked C prefill attention (`csrc/prefill_attn.c`, and `csrc/prefill_attn_dot.c` for a bfloat16 cache)
against a float64 dense masked softmax, and the CPU backend's prefill through it against its PyTorch (SDPA)
path."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pagedllm.attention.ops import cpu_prefill_attn

needs_kernel = pytest.mark.skipif(not cpu_prefill_attn.available(), reason="no C compiler for the CPU kernels")


@dataclass
class Chunk:
    q_start: int
    q_end: int
    context_len: int
    seq_len: int
    blocks: torch.Tensor


def _reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, c: Chunk, scale: float, window: int | None
) -> torch.Tensor:
    """Float64, from the definition: query position p sees keys max(0, p - window + 1) .. p."""
    _, bs, kvh, hd = k_cache.shape
    heads = q.shape[1]
    pos = torch.arange(c.seq_len)
    slots = c.blocks[pos // bs].long() * bs + pos % bs
    k = k_cache.reshape(-1, kvh, hd)[slots].double().repeat_interleave(heads // kvh, dim=1)  # [S, H, hd]
    v = v_cache.reshape(-1, kvh, hd)[slots].double().repeat_interleave(heads // kvh, dim=1)
    qd = q[c.q_start : c.q_end].double()
    scores = torch.einsum("qhd,khd->hqk", qd, k) * scale
    q_pos = torch.arange(c.context_len, c.seq_len)[:, None]
    mask = pos[None, :] <= q_pos
    if window:
        mask &= pos[None, :] > q_pos - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)


def _case(
    lens: list[tuple[int, int]],
    heads: int,
    kvh: int,
    hd: int,
    dtype: torch.dtype,
    seed: int,
    bs: int = 16,
    cache_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[Chunk]]:
    """Chunks (context_len, chunk length) packed one after another in a batch with a gap row between them,
    each over its own random, non-contiguous blocks of a shared cache (of `cache_dtype`, default `dtype`)."""
    cache_dtype = cache_dtype or dtype
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // bs) for c, n in lens]
    num_blocks = sum(need) + 5
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    k_cache = torch.randn(num_blocks, bs, kvh, hd, generator=g).to(cache_dtype)
    v_cache = torch.randn(num_blocks, bs, kvh, hd, generator=g).to(cache_dtype)
    chunks, row, b = [], 1, 0
    for (ctx, n), nb in zip(lens, need):
        chunks.append(Chunk(row, row + n, ctx, ctx + n, perm[b : b + nb]))
        row, b = row + n + 1, b + nb
    query = (torch.randn(row, heads, hd, generator=g) * 2).to(dtype)
    return query, k_cache, v_cache, chunks


CASES = [
    # (context_len, chunk length) per request, heads, kv heads, head size, window
    ([(0, 1), (0, 7), (0, 33)], 9, 3, 64, None),
    ([(0, 257), (5, 1), (40, 7)], 4, 1, 64, None),
    ([(0, 1000)], 9, 3, 64, None),
    ([(100, 157), (16, 33)], 8, 2, 128, None),
    ([(33, 100), (0, 70)], 8, 8, 80, None),
    ([(0, 257), (300, 60)], 6, 2, 64, 50),
    ([(0, 130)], 12, 3, 128, 128),
    ([(7, 1)], 2, 2, 32, 1),
    ([(0, 50), (10, 23)], 40, 1, 72, None),  # a large group: the dot kernel's items of 5 sub-tiles
    ([(0, 9)], 130, 1, 40, None),  # a group over 96 rows: one position per sub-tile
    ([(0, 400)], 40, 1, 72, None),  # enough items for the dot kernel's 768-row items: 10 sub-tiles each
    ([(0, 600), (200, 300)], 6, 2, 64, 50),  # 768-row items under a sliding window
]


F32, BF16 = torch.float32, torch.bfloat16
# (query/output dtype, cache dtype, bfloat16 dot products allowed)
KINDS = [(F32, F32, True), (BF16, BF16, True), (BF16, BF16, False), (F32, BF16, True), (F32, BF16, False)]


@needs_kernel
@pytest.mark.parametrize("dtype,cache_dtype,dot", KINDS)
@pytest.mark.parametrize("lens,heads,kvh,hd,window", CASES)
def test_prefill_matches_float64_reference(
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    dot: bool,
    lens: list[tuple[int, int]],
    heads: int,
    kvh: int,
    hd: int,
    window: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PAGEDLLM_CPU_PREFILL_DOT", "1" if dot else "0")
    seed = heads * 1000 + hd + len(lens)
    query, k_cache, v_cache, chunks = _case(lens, heads, kvh, hd, dtype, seed=seed, cache_dtype=cache_dtype)
    out = torch.full_like(query, 7.0)
    scale = hd**-0.5
    cpu_prefill_attn.prefill(query, k_cache, v_cache, chunks, out, scale, window)
    used_dot = cpu_prefill_attn.uses_dot(dtype, cache_dtype, hd)
    assert used_dot == (dot and cache_dtype == BF16 and _dot_isa())
    # float32: accumulation-order differences only; bf16 output: inputs exact, the output rounded once (2^-9);
    # bf16 products: P rounded (2^-9 relative), and float32 queries rounded too, which moves each score by up
    # to ~2^-9 of |q| |k| (queries here are 2 x randn: up to ~1e-2 at the output).
    if dtype == F32 and not used_dot:
        rtol, atol = 1e-5, 1e-5
    else:
        rtol, atol = (2e-2, 2e-2) if dtype == F32 else (8e-3, 8e-3)
    for c in chunks:
        ref = _reference(query, k_cache, v_cache, c, scale, window)
        torch.testing.assert_close(out[c.q_start : c.q_end].double(), ref, rtol=rtol, atol=atol)
    written = torch.zeros(query.shape[0], dtype=torch.bool)
    for c in chunks:
        written[c.q_start : c.q_end] = True
    assert bool((out[~written] == 7.0).all()), "rows outside the chunks must not be written"


def _dot_isa() -> bool:
    """Whether this CPU and build have the bfloat16 dot-product kernel (AVX512-BF16)."""
    return cpu_prefill_attn.available() and cpu_prefill_attn.uses_dot(F32, BF16, 64)


@needs_kernel
def test_prefill_dot_rounds_like_bf16_products() -> None:
    """The dot kernel's error is bfloat16 rounding of Q and P, not more: against a float64 reference whose
    queries are rounded to bf16 first, its error is well under the float32-query one's bound."""
    if not _dot_isa():
        pytest.skip("no AVX512-BF16 here: the float32-math kernel runs (tested above)")
    query, k_cache, v_cache, chunks = _case([(0, 300), (40, 90)], 9, 3, 64, F32, seed=11, cache_dtype=BF16)
    out = torch.zeros_like(query)
    cpu_prefill_attn.prefill(query, k_cache, v_cache, chunks, out, 0.125, None)
    q_rounded = query.to(BF16).float()
    for c in chunks:
        ref = _reference(q_rounded, k_cache, v_cache, c, 0.125, None)
        err = (out[c.q_start : c.q_end].double() - ref).abs()
        # P rounded to bf16 (relative 2^-9 each, averaging out over the keys): mean error far below 2^-9.
        assert float(err.max()) < 4e-3 and float(err.mean()) < 4e-4, (float(err.max()), float(err.mean()))


@needs_kernel
def test_dot_item_size_changes_no_bit() -> None:
    """The dot kernel takes 768-row work items where a step has at least 4 a thread, else 384 (`item_rows`):
    both share the same 96-row sub-tiles, so the output is bit-identical (one thread: 768; eight: 384)."""
    if not _dot_isa():
        pytest.skip("no AVX512-BF16 here")
    query, k_cache, v_cache, chunks = _case([(0, 1000), (24, 512)], 9, 3, 64, F32, seed=5, cache_dtype=BF16)
    outs = []
    for threads in (1, 8):
        out = torch.zeros_like(query)
        cpu_prefill_attn.prefill(query, k_cache, v_cache, chunks, out, 0.125, None, num_threads=threads)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@needs_kernel
def test_strided_query_and_one_thread() -> None:
    """Query rows as a strided slice of a fused QKV tensor (as the models pass them), one thread."""
    heads, kvh, hd = 9, 3, 64
    query, k_cache, v_cache, chunks = _case([(20, 45)], heads, kvh, hd, torch.float32, seed=3)
    qkv = torch.randn(query.shape[0], (heads + 2 * kvh) * hd)
    qkv[:, : heads * hd] = query.reshape(query.shape[0], -1)
    q = qkv[:, : heads * hd].view(-1, heads, hd)
    assert not q.is_contiguous()
    out = torch.zeros_like(query)
    cpu_prefill_attn.prefill(q, k_cache, v_cache, chunks, out, 0.125, None, num_threads=1)
    ref = _reference(query, k_cache, v_cache, chunks[0], 0.125, None)
    torch.testing.assert_close(out[chunks[0].q_start : chunks[0].q_end].double(), ref, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype,cache_dtype", [(F32, F32), (BF16, BF16), (F32, BF16)])
@pytest.mark.parametrize("window", [None, 24])
def test_backend_prefill_through_kernel_matches_sdpa_path(
    dtype: torch.dtype, cache_dtype: torch.dtype, window: int | None
) -> None:
    """`TorchNativeAttentionImpl.forward` with a fresh prompt, a chunk over a cached prefix and a decode in one
    step: the C prefill kernel against the backend's SDPA path (the kernel switched off), same cache."""
    from pagedllm.attention.backends.abstract import AttentionType
    from pagedllm.attention.backends.torch_native import PrefillSpan, TorchNativeAttentionImpl, TorchNativeMetadata

    heads, kvh, hd, bs = 9, 3, 64, 16
    g = torch.Generator().manual_seed(7)
    kv_cache = torch.randn(2, 40, bs, kvh, hd, generator=g).to(cache_dtype)  # positions < context_len: "cached"
    # (context_len, new tokens) per request; the last one decodes.
    reqs = [(0, 37), (50, 20), (30, 1)]
    perm = torch.randperm(40, generator=g)
    tables, slots, row, b = [], [], 0, 0
    spans = []
    for ctx, n in reqs:
        nb = -(-(ctx + n) // bs)
        blocks = perm[b : b + nb].to(torch.int32)
        b += nb
        pos = torch.arange(ctx, ctx + n)
        slots.append(blocks[pos // bs].long() * bs + pos % bs)
        if n > 1:
            spans.append(PrefillSpan(row, row + n, ctx, ctx + n, blocks))
        tables.append(blocks)
        row += n
    query = torch.randn(row, heads, hd, generator=g).to(dtype)
    key = torch.randn(row, kvh, hd, generator=g).to(dtype)
    value = torch.randn(row, kvh, hd, generator=g).to(dtype)
    md = TorchNativeMetadata(
        slot_mapping=torch.cat(slots),
        num_actual_tokens=row,
        causal=True,
        decode_token_idx=torch.tensor([row - 1]),
        decode_block_table=tables[2][None],
        decode_seq_lens=torch.tensor([31], dtype=torch.int32),
        prefills=spans,
        spans=[],
        num_reqs=3,
    )
    outs = []
    for use_kernel in (True, False):
        impl = TorchNativeAttentionImpl(heads, hd, hd**-0.5, kvh, window, AttentionType.DECODER)
        if not use_kernel:
            impl._use_c_prefill = False  # decided once, at the first forward: the SDPA path
        out = torch.zeros_like(query)
        impl.forward(query, key, value, kv_cache.clone(), md, out)
        assert impl._use_c_prefill is use_kernel
        outs.append(out)
    tol = 2e-5 if dtype == cache_dtype == F32 else 2e-2
    torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=tol, atol=tol)
