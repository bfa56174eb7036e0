"""Vectorized host code against per-request reference loops.

- `TorchNativeMetadataBuilder.build`: array ops over the batch against the per-request loop it replaced,
  on random mixes of decodes, prefill chunks, empty rows and encoder-only (non-causal) batches.
- `random_sample` against its literal formula (the same tokens and the same generator use).
- The block hasher's inlined path (requests without salt or LoRA) against `hash_block_tokens` chains.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.attention.backends.abstract import CommonAttentionMetadata
from pagedllm.attention.backends.torch_native import PrefillSpan, TorchNativeMetadata, TorchNativeMetadataBuilder


def _reference_build(block_size: int, common: CommonAttentionMetadata) -> TorchNativeMetadata:
    """The per-request loop `TorchNativeMetadataBuilder.build` had before it was vectorized."""
    qsl = common.query_start_loc_cpu.tolist()
    seq_lens = common.seq_lens_cpu.tolist()
    ctx = common.num_computed_tokens_cpu.tolist()
    decode_rows: list[int] = []
    prefills: list[PrefillSpan] = []
    spans: list[tuple[int, int]] = []
    bs = block_size
    for r in range(common.num_reqs):
        q0, q1 = qsl[r], qsl[r + 1]
        spans.append((q0, q1))
        if q1 - q0 == 1 and common.causal:
            decode_rows.append(r)
        elif q1 > q0:
            nb = (seq_lens[r] + bs - 1) // bs
            prefills.append(PrefillSpan(q0, q1, ctx[r], seq_lens[r], common.block_table[r, :nb]))
    dec_idx = dec_bt = dec_sl = None
    if decode_rows:
        rows = torch.tensor(decode_rows, dtype=torch.long, device=common.block_table.device)
        dec_sl = common.seq_lens[rows]
        nb = (max(seq_lens[r] for r in decode_rows) + bs - 1) // bs
        dec_bt = common.block_table[rows, :nb]
        dec_idx = common.query_start_loc[rows].long()
    return TorchNativeMetadata(
        common.slot_mapping, common.num_actual_tokens, common.causal, dec_idx, dec_bt, dec_sl, prefills, spans
    )


def _common(qlens: list[int], ctx: list[int], block_size: int, causal: bool) -> CommonAttentionMetadata:
    n = len(qlens)
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(qlens, dtype=torch.int32), 0)
    seq = torch.tensor([c + q for c, q in zip(ctx, qlens)], dtype=torch.int32)
    max_blocks = max(1, (int(seq.max()) + block_size - 1) // block_size) if n else 1
    bt = torch.randint(0, 1000, (n, max_blocks + 2), dtype=torch.int32)
    total = int(qsl[-1])
    return CommonAttentionMetadata(
        query_start_loc=qsl.clone(),
        query_start_loc_cpu=qsl,
        seq_lens=seq.clone(),
        seq_lens_cpu=seq,
        num_computed_tokens_cpu=torch.tensor(ctx, dtype=torch.int32),
        block_table=bt,
        slot_mapping=torch.arange(total, dtype=torch.int64),
        num_reqs=n,
        num_actual_tokens=total,
        max_query_len=max(qlens, default=0),
        max_seq_len=int(seq.max()) if n else 0,
        causal=causal,
    )


def _assert_same(a: TorchNativeMetadata, b: TorchNativeMetadata) -> None:
    assert a.num_actual_tokens == b.num_actual_tokens and a.causal == b.causal
    assert a.slot_mapping is b.slot_mapping
    for x, y in (
        (a.decode_token_idx, b.decode_token_idx),
        (a.decode_block_table, b.decode_block_table),
        (a.decode_seq_lens, b.decode_seq_lens),
    ):
        assert (x is None) == (y is None)
        if x is not None and y is not None:
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    assert a.spans == b.spans
    assert all(type(q0) is int and type(q1) is int for q0, q1 in a.spans)
    assert len(a.prefills) == len(b.prefills)
    for p, q in zip(a.prefills, b.prefills):
        assert (p.q_start, p.q_end, p.context_len, p.seq_len) == (q.q_start, q.q_end, q.context_len, q.seq_len)
        assert all(type(v) is int for v in (p.q_start, p.q_end, p.context_len, p.seq_len))
        assert p.blocks.dtype == q.blocks.dtype and torch.equal(p.blocks, q.blocks)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("causal", [True, False])
def test_metadata_build_matches_per_request_loop(seed: int, causal: bool) -> None:
    rng = random.Random(seed)
    bs = rng.choice([4, 16])
    n = rng.choice([1, 2, 7, 33, 256])
    kind = seed % 4  # 0: all decodes, 1: all prefills, 2: mixed with empty rows, 3: mostly decodes
    qlens, ctx = [], []
    for _ in range(n):
        if kind == 0 or (kind == 3 and rng.random() < 0.9):
            q = 1
        elif kind == 1:
            q = rng.randint(2, 40)
        else:
            q = rng.choice([0, 1, 1, 2, 17])
        qlens.append(q)
        ctx.append(rng.randint(0, 200))
    common = _common(qlens, ctx, bs, causal)
    _assert_same(TorchNativeMetadataBuilder(bs, None, torch.device("cpu")).build(common), _reference_build(bs, common))


def test_metadata_build_no_requests() -> None:
    common = _common([], [], 16, True)
    _assert_same(TorchNativeMetadataBuilder(16, None, torch.device("cpu")).build(common), _reference_build(16, common))


def _random_sample_literal(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """`random_sample` as first written: argmax(probs / q), q = -log(clamp(U, tiny))."""
    u = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        u.uniform_()
    for row, gen in generators.items():
        u[row].uniform_(generator=gen)
    q = u.clamp_(min=torch.finfo(u.dtype).tiny).log_().neg_()
    return probs.div_(q).max(dim=-1).indices


@pytest.mark.parametrize("vocab", [1, 2, 32, 1000])
@pytest.mark.parametrize("seeded", [(), (0,), (0, 3, 5), tuple(range(8))])
def test_random_sample_matches_literal_formula(vocab: int, seeded: tuple[int, ...]) -> None:
    """The same draws and the same tokens, on peaked, flat (ties), zero and non-finite probabilities."""
    from pagedllm.sample.sampler import random_sample

    for trial in range(20):
        g = torch.Generator().manual_seed(trial)
        logits = torch.randn(8, vocab, generator=g) * (10.0 if trial % 2 else 0.1)
        if trial % 5 == 0:
            logits[1] = 0.0  # flat row: every token ties before the noise
            logits[2, : max(1, vocab // 2)] = -float("inf")  # zero probabilities
        probs = logits.softmax(dim=-1)
        if trial == 7:
            probs[4, 0] = float("nan")
            probs[5, -1] = float("inf")
        torch.manual_seed(100 + trial)
        a = _random_sample_literal(probs.clone(), {r: torch.Generator().manual_seed(r) for r in seeded})
        after_a = torch.rand(())  # the global generator is left in the same state
        torch.manual_seed(100 + trial)
        b = random_sample(probs.clone(), {r: torch.Generator().manual_seed(r) for r in seeded})
        after_b = torch.rand(())
        assert torch.equal(a, b), (trial, a, b)
        assert torch.equal(after_a, after_b)


def test_uniform_tiny_is_clamped_uniform() -> None:
    """The identity `random_sample` relies on, over enough draws to see exact zeros (p = 2^-24 each)."""
    tiny = torch.finfo(torch.float32).tiny
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    zeros = 0
    for _ in range(4):
        a = torch.empty(1 << 24).uniform_(generator=g1).clamp_(min=tiny)
        b = torch.empty(1 << 24).uniform_(tiny, 1.0, generator=g2)
        zeros += int((a == tiny).sum())
        assert torch.equal(a, b)
    assert zeros > 0


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("salt,lora", [(None, None), ("s", None), (None, 3), ("s", 3)])
def test_block_hasher_matches_hash_chain(block_size: int, salt: str | None, lora: int | None) -> None:
    """Hashes from the request's first blocks and then a few tokens at a time (as decodes grow) equal the
    chain of `hash_block_tokens(parent, block, request_extra_keys(request, i))`."""
    from pagedllm.core.kv_cache_utils import NONE_HASH, hash_block_tokens, make_block_hasher, request_extra_keys
    from pagedllm.core.request import Request
    from pagedllm.sampling_params import SamplingParams

    rng = random.Random(block_size)
    for trial in range(5):
        prompt = [
            rng.randrange(-(2**40), 2**40) if trial == 4 else rng.randrange(50000) for _ in range(rng.randrange(0, 70))
        ]
        req = Request(
            f"r{trial}",
            prompt,
            SamplingParams(),
            0.0,
            100,
            cache_salt=salt,
            lora_id=lora,
            block_hasher=make_block_hasher(block_size),
        )
        for _ in range(30):
            for _ in range(rng.randrange(1, 6)):
                req.all_token_ids.append(rng.randrange(50000))
            if len(req.all_token_ids) >= req.next_hash_len:
                req.extend_block_hashes()
        toks = req.all_token_ids
        parent, want = NONE_HASH, []
        for i in range(len(toks) // block_size):
            parent = hash_block_tokens(parent, toks[i * block_size : (i + 1) * block_size], request_extra_keys(req, i))
            want.append(parent)
        assert req.block_hashes == want
