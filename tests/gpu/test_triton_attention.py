"""Triton paged attention vs a float64 reference on random paged batches (GPU; `pytest -m gpu tests/gpu`).

Every case: a cache filled with NaN, each request's blocks drawn at random (block 0 never used, so
stray block-table reads hit NaN), the cached prefix written directly, this step's K/V written by
`reshape_and_cache` from strided views of a fused qkv tensor, output poisoned with NaN. The reference
gathers each request's K/V from its own copy of the data, not from the cache.

Runs on CPU under the Triton interpreter too (TRITON_INTERPRET=1), for debugging without a GPU; Triton
3.6's interpreter needs two local fixes for that (scalar `__index__` under numpy >= 2.4, and bf16 `tl.dot`,
which it multiplies as raw uint16 bits), so trust only its fp32/fp16 results.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.gpu.triton_env import DEVICE, INTERPRET, require_triton_device  # noqa: E402

pytestmark = pytest.mark.gpu

require_triton_device()

from pagedllm.attention.ops.triton_paged_attn import paged_attention, reshape_and_cache  # noqa: E402

# Relative error bounds ||out - ref|| / ||ref||: fp32 runs with IEEE dots (no TF32).
REL_TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


class Batch:
    """A random paged batch: requests with `ctx_lens[r]` cached tokens and `q_lens[r]` new ones."""

    def __init__(
        self,
        q_lens: list[int],
        ctx_lens: list[int],
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        block_size: int,
        dtype: torch.dtype,
        seed: int,
        extra_blocks: int = 3,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.q_lens, self.ctx_lens = q_lens, ctx_lens
        self.seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
        self.h, self.kvh, self.d, self.bs, self.dtype = num_heads, num_kv_heads, head_size, block_size, dtype
        nblk = [max(1, math.ceil(s / block_size)) for s in self.seq_lens]
        num_blocks = 1 + sum(nblk) + extra_blocks
        perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # block 0 stays NaN
        max_blocks = max(nblk) + 2
        self.block_table = torch.zeros(len(q_lens), max_blocks, dtype=torch.int32)
        self.blocks: list[list[int]] = []
        for r, n in enumerate(nblk):
            ids, perm = perm[:n], perm[n:]
            self.blocks.append(ids)
            self.block_table[r, :n] = torch.tensor(ids, dtype=torch.int32)
        # Full per-request K/V (rounded to dtype), the reference's source of truth.
        self.k = [torch.randn(s, num_kv_heads, head_size, generator=g).to(dtype) for s in self.seq_lens]
        self.v = [torch.randn(s, num_kv_heads, head_size, generator=g).to(dtype) for s in self.seq_lens]
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
        for r, c in enumerate(ctx_lens):
            for p in range(c):
                b, o = self.blocks[r][p // block_size], p % block_size
                self.k_cache[b, o] = self.k[r][p]
                self.v_cache[b, o] = self.v[r][p]
        # This step's tokens as strided views of one fused [T, (H + 2 KVH) * D] tensor.
        t = sum(q_lens)
        self.num_tokens = t
        qkv = torch.empty(t, (num_heads + 2 * num_kv_heads) * head_size, dtype=dtype)
        qkv[:, : num_heads * head_size] = torch.randn(t, num_heads * head_size, generator=g).to(dtype)
        slots = []
        i = 0
        for r, (c, q) in enumerate(zip(ctx_lens, q_lens)):
            kv_new = torch.cat([self.k[r][c:], self.v[r][c:]], dim=1).reshape(q, -1)
            qkv[i : i + q, num_heads * head_size :] = kv_new
            for p in range(c, c + q):
                slots.append(self.blocks[r][p // block_size] * block_size + p % block_size)
            i += q
        self.qkv = qkv
        self.slot_mapping = torch.tensor(slots, dtype=torch.int64)
        self.query_start_loc = torch.tensor([0] + list(itertools_accumulate(q_lens)), dtype=torch.int32)

    def views(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, h, kvh, d = self.num_tokens, self.h, self.kvh, self.d
        q = qkv[:, : h * d].view(t, h, d)
        k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
        v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
        return q, k, v

    def reference(
        self, scale: float, window: int | None, causal: bool = True, softcap: float | None = None
    ) -> torch.Tensor:
        q_all = self.views(self.qkv)[0].double()
        out = torch.zeros(self.num_tokens, self.h, self.d, dtype=torch.float64)
        grp = self.h // self.kvh
        i = 0
        for r, (c, ql) in enumerate(zip(self.ctx_lens, self.q_lens)):
            s_len = c + ql
            k = self.k[r].double().repeat_interleave(grp, dim=1)  # [S, H, D]
            v = self.v[r].double().repeat_interleave(grp, dim=1)
            q = q_all[i : i + ql]
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            qpos = torch.arange(c, s_len)[:, None]
            kpos = torch.arange(s_len)[None, :]
            ok = torch.ones(ql, s_len, dtype=torch.bool)
            if causal:
                ok &= kpos <= qpos
            if window is not None:
                ok &= kpos > qpos - window
            scores = scores.masked_fill(~ok, float("-inf"))
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked row -> zeros
            out[i : i + ql] = torch.einsum("hqk,khd->qhd", probs, v)
            i += ql
        return out


def itertools_accumulate(xs: list[int]) -> list[int]:
    out, s = [], 0
    for x in xs:
        s += x
        out.append(s)
    return out


def run_case(
    q_lens: list[int],
    ctx_lens: list[int],
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
    num_splits: int = 1,
    causal: bool = True,
    seed: int = 0,
    two_launches: bool = True,
    q_scale: float = 1.0,
    softcap: float | None = None,
    req_order: torch.Tensor | None = None,
    **overrides: int,
) -> torch.Tensor:
    """two_launches: pass num_decodes (as the backend does), so mixed batches run decode + chunk launches.
    Returns the output (float64, on the CPU) after checking it against the float64 reference."""
    if INTERPRET and dtype == torch.bfloat16:
        pytest.skip("the Triton 3.6 interpreter truncates float32 -> bfloat16 (GPU only)")
    b = Batch(q_lens, ctx_lens, num_heads, num_kv_heads, head_size, block_size, dtype, seed)
    if q_scale != 1.0:  # wider score ranges: running maxima that jump by more than 2^8 between key tiles
        b.qkv[:, : num_heads * head_size] = (b.qkv[:, : num_heads * head_size].double() * q_scale).to(dtype)
    dev = DEVICE
    k_cache, v_cache = b.k_cache.to(dev), b.v_cache.to(dev)
    qkv = b.qkv.to(dev)
    q, k, v = b.views(qkv)
    slot_mapping = b.slot_mapping.to(dev)
    reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    # The cache now holds every request's whole K/V, and nothing else was touched.
    for r in range(len(q_lens)):
        flat_k = k_cache[b.blocks[r]].flatten(0, 1)[: b.seq_lens[r]].cpu()
        flat_v = v_cache[b.blocks[r]].flatten(0, 1)[: b.seq_lens[r]].cpu()
        assert torch.equal(flat_k, b.k[r]) and torch.equal(flat_v, b.v[r]), f"cache write wrong for request {r}"
    assert torch.isnan(k_cache[0].float()).all() and torch.isnan(v_cache[0].float()).all()

    out = torch.full((b.num_tokens, num_heads, head_size), float("nan"), dtype=dtype, device=dev)
    scale = head_size**-0.5
    paged_attention(
        q,
        k_cache,
        v_cache,
        out,
        b.block_table.to(dev),
        torch.tensor(b.seq_lens, dtype=torch.int32, device=dev),
        b.query_start_loc.to(dev),
        num_actual_tokens=b.num_tokens,
        num_reqs=len(q_lens),
        max_query_len=max(q_lens),
        scale=scale,
        sliding_window=window,
        causal=causal,
        num_splits=num_splits,
        num_decodes=sum(q == 1 for q in q_lens) if two_launches else None,
        logits_soft_cap=softcap,
        req_order=req_order,
        **overrides,
    )
    ref = b.reference(scale, window, causal, softcap)
    got = out.double().cpu()
    assert not torch.isnan(got).any(), "output has NaN (unwritten rows or stray cache reads)"
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < REL_TOL[dtype], f"relative error {rel:.3e} >= {REL_TOL[dtype]:.1e}"
    return got


# ---- decode batches over every block size x head size --------------------------------------------


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_decode_block_and_head_sizes(block_size: int, head_size: int) -> None:
    ctx = [0, 1, block_size - 1, block_size, 3 * block_size + 5, 150]
    run_case([1] * len(ctx), ctx, head_size=head_size, block_size=block_size, seed=block_size + head_size)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_decode_half_precision(dtype: torch.dtype, head_size: int) -> None:
    ctx = [5, 77, 200, 31, 1000]
    run_case([1] * len(ctx), ctx, num_heads=16, num_kv_heads=8, head_size=head_size, dtype=dtype, seed=head_size)


# ---- group sizes (GQA / MQA) on mixed batches ------------------------------------------------------


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_sizes_mixed(group: int, dtype: torch.dtype) -> None:
    kvh = 2
    # A fresh prompt, a chunk after a cached prefix, ragged decodes, a one-token prefix chunk.
    q_lens = [37, 20, 1, 1, 1, 2]
    ctx_lens = [0, 45, 16, 63, 100, 30]
    run_case(q_lens, ctx_lens, num_heads=kvh * group, num_kv_heads=kvh, dtype=dtype, seed=group)


@pytest.mark.parametrize("group", [1, 3, 8])
def test_mixed_single_launch(group: int) -> None:
    """Without num_decodes a mixed batch runs as one launch with the chunk-sized tiles."""
    q_lens, ctx_lens = [37, 1, 20, 1, 1], [0, 16, 45, 63, 300]
    run_case(q_lens, ctx_lens, num_heads=2 * group, num_kv_heads=2, dtype=torch.bfloat16, two_launches=False)
    run_case(q_lens, ctx_lens, num_heads=2 * group, num_kv_heads=2, two_launches=False, seed=1)


def test_mqa_single_kv_head() -> None:
    run_case([40, 1, 1], [10, 33, 90], num_heads=8, num_kv_heads=1, head_size=128, dtype=torch.bfloat16)


# ---- prefill chunks attending to cached prefixes ---------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_with_prefix(block_size: int, dtype: torch.dtype) -> None:
    q_lens = [130, 64, 17, 1, 1, 3]
    ctx_lens = [0, block_size * 2, 70, 5, 240, 1]
    run_case(q_lens, ctx_lens, num_heads=8, num_kv_heads=2, head_size=128, block_size=block_size, dtype=dtype)


def test_long_prefill_bf16_head256() -> None:
    run_case([300, 1], [20, 400], num_heads=8, num_kv_heads=4, head_size=256, dtype=torch.bfloat16, seed=3)


@pytest.mark.parametrize("head_size", [80, 96])
def test_non_power_of_two_head_size(head_size: int) -> None:
    run_case([25, 1, 1], [40, 17, 130], num_heads=6, num_kv_heads=2, head_size=head_size, seed=head_size)
    run_case([25, 1, 1], [40, 17, 130], num_heads=6, num_kv_heads=2, head_size=head_size, dtype=torch.bfloat16)


# ---- sliding window, non-causal --------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 7, 16, 64, 1000])
def test_sliding_window(window: int) -> None:
    q_lens = [90, 33, 1, 1, 1]
    ctx_lens = [0, 70, 5, 200, 64]
    run_case(q_lens, ctx_lens, num_heads=6, num_kv_heads=2, window=window, seed=window)


def test_sliding_window_split_kv_bf16() -> None:
    run_case(
        [1] * 4,
        [300, 20, 700, 64],
        num_heads=8,
        num_kv_heads=2,
        head_size=128,
        window=100,
        num_splits=8,
        dtype=torch.bfloat16,
    )


@pytest.mark.parametrize("num_splits", [1, 4])
def test_logits_soft_cap(num_splits: int) -> None:
    """Gemma 2's attention-logit soft-capping (a cap below the scores' range, so it changes the result),
    mixed decodes and chunks, with a sliding window, single-pass and split-KV."""
    q_lens, ctx_lens = [40, 1, 1, 7], [0, 90, 300, 20]
    run_case(q_lens, ctx_lens, window=64, softcap=0.7, q_scale=4.0, num_splits=num_splits, seed=11)
    if num_splits == 1:  # the cap matters: the uncapped reference is far from the capped one
        b = Batch(q_lens, ctx_lens, 4, 2, 64, 16, torch.float32, 11)
        capped, plain = b.reference(0.125, 64, True, 0.7), b.reference(0.125, 64, True)
        assert ((capped - plain).norm() / plain.norm()).item() > 0.05


def test_non_causal_decoder() -> None:
    run_case([12, 1, 5], [3, 40, 0], num_heads=4, num_kv_heads=2, causal=False)


# ---- split-KV (flash-decoding) path ----------------------------------------------------------------


@pytest.mark.parametrize("num_splits", [2, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kv_decode(num_splits: int, dtype: torch.dtype) -> None:
    # Includes contexts shorter than one tile per segment (empty segments must merge cleanly).
    ctx = [2000, 1, 15, 64, 513, 1200]
    run_case(
        [1] * len(ctx),
        ctx,
        num_heads=16,
        num_kv_heads=8,
        head_size=128,
        dtype=dtype,
        num_splits=num_splits,
        seed=num_splits,
    )


@pytest.mark.parametrize("chunk", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kv_merge_in_chunks(chunk: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """`PAGEDLLM_ATTN_MERGE_CHUNK`: the merge takes the segments a chunk at a time, merged online (contexts
    whose 16 segments all hold keys, and short ones with a few), within the reference's bound and close to
    the one-pass merge; a few-row request beside the decodes."""
    ctx, q_lens = [2000, 1, 15, 300, 4100], [1, 1, 1, 3, 1]
    kw = dict(num_heads=16, num_kv_heads=8, head_size=128, dtype=dtype, num_splits=16, seed=chunk)
    monkeypatch.setenv("PAGEDLLM_ATTN_MERGE_CHUNK", "0")
    one_pass = run_case(q_lens, ctx, **kw)  # type: ignore[arg-type]
    monkeypatch.setenv("PAGEDLLM_ATTN_MERGE_CHUNK", str(chunk))
    chunked = run_case(q_lens, ctx, **kw)  # type: ignore[arg-type]
    torch.testing.assert_close(chunked, one_pass, rtol=REL_TOL[dtype], atol=REL_TOL[dtype])


@pytest.mark.parametrize("late", [False, True], ids=["", "late"])
@pytest.mark.parametrize("window", [None, 200])
@pytest.mark.parametrize("num_splits", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_early_metadata(
    dtype: torch.dtype, num_splits: int, window: int | None, late: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`EARLY` (PDL decode launches: lengths, key range and first block ids read before the wait, segments past
    the keys leaving at once, block ids read a tile ahead): the plain launch's output bit for bit, over contexts of
    one to many key tiles per segment; with the successor's launch after the key tiles too (`LATE_TRIGGER`)."""
    monkeypatch.setenv("PAGEDLLM_ATTN_LATE_TRIGGER", "1" if late else "0")
    ctx, q_lens = [0, 5, 127, 128, 300, 1000, 2100], [1] * 7
    kw = dict(num_heads=8, num_kv_heads=2, head_size=128, dtype=dtype, num_splits=num_splits, window=window)
    plain = run_case(q_lens, ctx, seed=num_splits, early=False, **kw)  # type: ignore[arg-type]
    early = run_case(q_lens, ctx, seed=num_splits, early=True, **kw)  # type: ignore[arg-type]
    assert torch.equal(plain, early)


@pytest.mark.parametrize("tile", [16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_tile(dtype: torch.dtype, tile: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`PAGEDLLM_ATTN_ONE_ROW_TILE_N`: a single request's decode with smaller key tiles (more split-KV segments)
    against the float64 reference, contexts of one to many tiles a segment."""
    monkeypatch.setenv("PAGEDLLM_ATTN_ONE_ROW_TILE_N", str(tile))
    for ctx in (0, 5, 127, 300, 2100):
        run_case([1], [ctx], num_heads=8, num_kv_heads=2, head_size=128, dtype=dtype, num_splits=16, seed=ctx + tile)


@pytest.mark.parametrize("num_splits", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q", [5, 8, 10])
def test_few_query_rows(q: int, num_splits: int, dtype: torch.dtype) -> None:
    """Speculative verification's shape: k + 1 query rows per request in one tile (16 rows up to q = 5 with a
    group of 3, 32 rows up to q = 10), with decodes beside them, whole or split across key segments. Contexts
    put the rows' diagonal across a 128-key tile boundary, so some segments hold no key that the first rows
    may see (their partials are empty and must merge to nothing)."""
    ctx = [126, 0, 124, 300, 1000, 127, 2]
    q_lens = [q, q, 3, 1, q, 2, q]
    run_case(q_lens, ctx, num_heads=9, num_kv_heads=3, dtype=dtype, num_splits=num_splits, seed=q + num_splits)


def test_split_kv_mixed_batch() -> None:
    run_case([50, 1, 1], [100, 333, 7], num_heads=6, num_kv_heads=2, num_splits=4, seed=11)


@pytest.mark.parametrize("num_splits", [2, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(32, 8, 128), (9, 3, 64)])
def test_split_kv_q8_twin(
    heads: tuple[int, int, int], dtype: torch.dtype, num_splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The split-KV merge's q8_1 twin of its output (o_proj's int8 GEMV input, `PAGEDLLM_ATTN_Q8_TWIN`) equals
    the output quantized by the reference (`q8_activations`: d * q per group of 32, s = d * sum(q)), for groups
    of 4 and of 3 query heads (a padded head in the merge's tile), decodes and a few-row request beside them."""
    monkeypatch.setenv("PAGEDLLM_ATTN_Q8_TWIN", "1")
    from pagedllm.model_executor.layers.quantization import gguf_triton as gt

    num_heads, num_kv_heads, head_size = heads
    q_lens, ctx = [1, 1, 3, 1], [700, 5, 200, 64]
    t, k = sum(q_lens), num_heads * head_size
    twin = (
        torch.full((t, k), 99, dtype=torch.int8, device=DEVICE),
        torch.full((t, k // 32), float("nan"), device=DEVICE),
        torch.full((t, k // 32), float("nan"), device=DEVICE),
    )
    got = run_case(
        q_lens, ctx, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype,
        num_splits=num_splits, seed=num_splits, q8_twin=twin,
    )  # fmt: skip
    out = got.to(dtype).view(t, k)
    q, d, s = (x.cpu() for x in twin)
    deq = (q.float().view(t, -1, 32) * d[:, :, None]).view(t, k)
    assert torch.equal(deq, gt.q8_activations(out)), "the twin is not the output's quantization"
    assert torch.equal(s, d * q.view(t, -1, 32).sum(-1).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peaked_scores(dtype: torch.dtype) -> None:
    """Scores with a wide range (running maxima that jump by more than 2^8 between key tiles) on prompts,
    prefix chunks, decodes and split-KV decodes."""
    q_lens, ctx_lens = [200, 70, 1, 1, 33], [0, 130, 500, 17, 64]
    run_case(q_lens, ctx_lens, num_heads=8, num_kv_heads=2, dtype=dtype, q_scale=8.0, seed=7)
    run_case([1] * 4, [900, 3, 300, 64], num_heads=8, num_kv_heads=2, dtype=dtype, q_scale=8.0, seed=8, num_splits=4)


@pytest.mark.parametrize("block_m,tile_n", [(16, 16), (32, 32), (64, 128)])
def test_tile_overrides(block_m: int, tile_n: int) -> None:
    run_case(
        [70, 1, 1, 9],
        [3, 50, 129, 200],
        num_heads=8,
        num_kv_heads=2,
        block_size=32,
        block_m=block_m,
        tile_n=tile_n,
        seed=block_m,
    )


# ---- padding (CUDA-graph style) --------------------------------------------------------------------


def test_padded_requests_and_slots() -> None:
    """seq_len-0 padding requests give zeros; slot -1 tokens are not written; extra rows stay as they were."""
    dev = DEVICE
    h, kvh, d, bs = 4, 2, 64, 16
    b = Batch([1, 1], [20, 5], h, kvh, d, bs, torch.float32, seed=5)
    k_cache, v_cache = b.k_cache.to(dev), b.v_cache.to(dev)
    qkv = b.qkv.to(dev)
    q, k, v = b.views(qkv)
    # Two padded requests appended: one token each, seq_len 0, slot -1.
    pad_q = torch.randn(2, h, d, device=dev)
    q = torch.cat([q, pad_q])
    k = torch.cat([k, torch.randn(2, kvh, d, device=dev)])
    v = torch.cat([v, torch.randn(2, kvh, d, device=dev)])
    slots = torch.cat([b.slot_mapping.to(dev), torch.full((2,), -1, dtype=torch.int64, device=dev)])
    before = k_cache.clone()
    reshape_and_cache(k, v, k_cache, v_cache, slots)
    changed = (k_cache != before) & ~(torch.isnan(k_cache) & torch.isnan(before))
    assert int(changed.any(dim=(1, 2, 3)).sum()) <= 2  # only the two real tokens' blocks
    out = torch.full((5, h, d), float("nan"), device=dev)
    bt = torch.cat([b.block_table, torch.zeros(2, b.block_table.shape[1], dtype=torch.int32)]).to(dev)
    seq_lens = torch.tensor(b.seq_lens + [0, 0], dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32, device=dev)
    paged_attention(
        q, k_cache, v_cache, out, bt, seq_lens, qsl, num_actual_tokens=4, num_reqs=4, max_query_len=1, scale=d**-0.5
    )
    ref = b.reference(d**-0.5, None)
    got = out.double().cpu()
    assert ((got[:2] - ref).norm() / ref.norm()).item() < REL_TOL[torch.float32]
    assert torch.equal(got[2:4], torch.zeros_like(got[2:4]))
    assert torch.isnan(got[4]).all()  # beyond num_actual_tokens: untouched


# ---- the backend against the torch_native backend --------------------------------------------------


@pytest.mark.parametrize("window", [None, 24])
def test_backend_matches_torch_native(window: int | None) -> None:
    from pagedllm.attention.backends.abstract import AttentionType, CommonAttentionMetadata
    from pagedllm.attention.backends.torch_native import TorchNativeBackend
    from pagedllm.attention.backends.triton_attn import TritonAttentionBackend

    dev = torch.device(DEVICE)
    h, kvh, d, bs = 8, 2, 128, 16
    q_lens, ctx_lens = [33, 1, 1, 8], [0, 60, 17, 40]
    b = Batch(q_lens, ctx_lens, h, kvh, d, bs, torch.float32, seed=7)
    seq_lens = torch.tensor(b.seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=b.query_start_loc.to(dev),
        query_start_loc_cpu=b.query_start_loc,
        seq_lens=seq_lens.to(dev),
        seq_lens_cpu=seq_lens,
        num_computed_tokens_cpu=torch.tensor(ctx_lens, dtype=torch.int32),
        block_table=b.block_table.to(dev),
        slot_mapping=b.slot_mapping.to(dev),
        num_reqs=len(q_lens),
        num_actual_tokens=b.num_tokens,
        max_query_len=max(q_lens),
        max_seq_len=max(b.seq_lens),
    )
    outs = []
    for backend in (TritonAttentionBackend, TorchNativeBackend):
        shape = backend.get_kv_cache_shape(b.k_cache.shape[0], bs, kvh, d)
        kv = torch.stack([b.k_cache, b.v_cache])
        # torch_native gathers whole blocks and multiplies masked probabilities by them: no NaN poison.
        kv = torch.where(torch.isnan(kv), torch.randn(kv.shape).to(kv.dtype), kv).to(dev)
        assert tuple(kv.shape) == shape
        md = backend.get_builder_cls()(bs, window, dev).build(common)
        impl = backend.get_impl_cls()(h, d, d**-0.5, kvh, window, AttentionType.DECODER)
        q, k, v = b.views(b.qkv.to(dev))
        out = torch.full_like(q, float("nan"))
        impl.forward(q, k, v, kv, md, out)
        outs.append(out.double().cpu())
    rel = ((outs[0] - outs[1]).norm() / outs[1].norm()).item()
    assert rel < 1e-4, rel  # torch_native may use TF32-free SDPA; both are fp32


def test_backend_encoder_only() -> None:
    from pagedllm.attention.backends.abstract import AttentionType, CommonAttentionMetadata
    from pagedllm.attention.backends.triton_attn import TritonAttentionBackend

    dev = torch.device(DEVICE)
    h, kvh, d = 6, 2, 64
    lens = [5, 17, 1]
    qsl = torch.tensor([0, 5, 22, 23], dtype=torch.int32)
    t = 23
    q, k, v = torch.randn(t, h, d, device=dev), torch.randn(t, kvh, d, device=dev), torch.randn(t, kvh, d, device=dev)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(dev),
        query_start_loc_cpu=qsl,
        seq_lens=torch.tensor(lens, device=dev),
        seq_lens_cpu=torch.tensor(lens),
        num_computed_tokens_cpu=torch.zeros(3, dtype=torch.int32),
        block_table=torch.zeros(3, 1, dtype=torch.int32, device=dev),
        slot_mapping=torch.zeros(t, dtype=torch.long),
        num_reqs=3,
        num_actual_tokens=t,
        max_query_len=17,
        max_seq_len=17,
        causal=False,
    )
    md = TritonAttentionBackend.get_builder_cls()(16, None, dev).build(common)
    impl = TritonAttentionBackend.get_impl_cls()(h, d, d**-0.5, kvh, None, AttentionType.ENCODER_ONLY)
    out = torch.full_like(q, float("nan"))
    impl.forward(q, k, v, None, md, out)
    for r in range(3):
        q0, q1 = int(qsl[r]), int(qsl[r + 1])
        kk = k[q0:q1].double().repeat_interleave(3, dim=1)
        vv = v[q0:q1].double().repeat_interleave(3, dim=1)
        p = torch.softmax(torch.einsum("qhd,khd->hqk", q[q0:q1].double(), kk) * d**-0.5, -1)
        ref = torch.einsum("hqk,khd->qhd", p, vv)
        assert torch.allclose(out[q0:q1].double(), ref, atol=1e-4, rtol=1e-4)
