"""Triton paged attention with per-token key limits (Gemma 3's bidirectional image spans) vs a float64
reference on random paged batches (GPU, or the CPU under TRITON_INTERPRET=1): a query token sees keys
up to its limit (the end of its image) and, on sliding-window layers, not before its window."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.triton_env import DEVICE, require_triton_device

pytestmark = pytest.mark.gpu

require_triton_device()

from pagedllm.attention.ops.triton_paged_attn import paged_attention, reshape_and_cache  # noqa: E402
from tests.gpu.test_triton_attention import Batch  # noqa: E402

Q_LENS = [40, 1, 25, 9]
CTX_LENS = [0, 30, 16, 12]
SPANS = [[(5, 21), (30, 33)], [], [(16, 36)], [(10, 17)]]
"""Per request, image spans [start, end) in positions; request 2's starts at its chunk's start, request 3's
began in the cached prefix (a prefix-cache hit inside an image). Request 1 is a decode."""


def key_limits() -> list[int]:
    out = []
    for c, q, spans in zip(CTX_LENS, Q_LENS, SPANS):
        for p in range(c, c + q):
            out.append(next((e - 1 for s, e in spans if s <= p < e), p))
    return out


def reference(b: Batch, scale: float, window: int | None, limits: list[int] | None) -> torch.Tensor:
    q_all = b.views(b.qkv)[0].double()
    out = torch.zeros(b.num_tokens, b.h, b.d, dtype=torch.float64)
    grp, i = b.h // b.kvh, 0
    for r, (c, ql) in enumerate(zip(b.ctx_lens, b.q_lens)):
        k = b.k[r].double().repeat_interleave(grp, dim=1)
        v = b.v[r].double().repeat_interleave(grp, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_all[i : i + ql], k) * scale
        qpos = torch.arange(c, c + ql)[:, None]
        kpos = torch.arange(c + ql)[None, :]
        lim = qpos if limits is None else torch.tensor(limits[i : i + ql])[:, None]
        ok = kpos <= lim
        if window is not None:
            ok &= kpos > qpos - window
        probs = torch.softmax(scores.masked_fill(~ok, float("-inf")), dim=-1)
        out[i : i + ql] = torch.einsum("hqk,khd->qhd", probs, v)
        i += ql
    return out


@pytest.mark.parametrize(
    ("window", "num_splits", "block_m"),
    [(None, 1, None), (7, 1, None), (None, 4, None), (None, 1, 16), (12, 1, 16)],
)
def test_key_limits_match_reference(window: int | None, num_splits: int, block_m: int | None) -> None:
    b = Batch(Q_LENS, CTX_LENS, 4, 2, 32, 16, torch.float32, seed=3)
    k_cache, v_cache = b.k_cache.to(DEVICE), b.v_cache.to(DEVICE)
    qkv = b.qkv.to(DEVICE)
    q, k, v = b.views(qkv)
    reshape_and_cache(k, v, k_cache, v_cache, b.slot_mapping.to(DEVICE))
    out = torch.full((b.num_tokens, 4, 32), float("nan"), dtype=torch.float32, device=DEVICE)
    limits = key_limits()
    overrides = {"block_m": block_m} if block_m else {}  # 16 rows = 8 tokens: tiles end inside images
    paged_attention(
        q,
        k_cache,
        v_cache,
        out,
        b.block_table.to(DEVICE),
        torch.tensor(b.seq_lens, dtype=torch.int32, device=DEVICE),
        b.query_start_loc.to(DEVICE),
        num_actual_tokens=b.num_tokens,
        num_reqs=len(Q_LENS),
        max_query_len=max(Q_LENS),
        scale=32**-0.5,
        sliding_window=window,
        num_splits=num_splits,
        num_decodes=1,
        key_limit=torch.tensor(limits, dtype=torch.int32, device=DEVICE),
        **overrides,  # type: ignore[arg-type]
    )
    ref = reference(b, 32**-0.5, window, limits)
    got = out.double().cpu()
    assert not torch.isnan(got).any()
    assert ((got - ref).norm() / ref.norm()).item() < 2e-5
    causal = reference(b, 32**-0.5, window, None)  # the limits matter: plain causal attention differs
    assert ((causal - ref).norm() / ref.norm()).item() > 1e-2
