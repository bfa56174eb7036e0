"""The attention launches a whole-step CUDA graph is captured with (worker/mixed_graph.py) on a padded mixed batch:
requests padded with empty ones (query offsets repeating the token count, seq_len 0), token rows padded with
finite garbage and slot -1, and the host values fixed by `launch_shape` (a long query and one decode: both
launches, prefill tiles over an upper-bound grid). The real rows must equal a float64 reference and the cache
must hold exactly the real tokens' K/V. Through the Triton backend's builder and impl, as the graph runs them
(GPU, or the CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.triton_env import DEVICE, require_triton_device

pytestmark = pytest.mark.gpu

require_triton_device()

from pagedllm.attention.backends.abstract import AttentionType, CommonAttentionMetadata  # noqa: E402
from pagedllm.attention.backends.triton_attn import (  # noqa: E402
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)
from pagedllm.worker.mixed_graph import launch_shape  # noqa: E402
from tests.gpu.test_triton_attention import REL_TOL, Batch  # noqa: E402


@pytest.mark.parametrize(
    ("q_lens", "ctx_lens", "size", "num_reqs", "window"),
    [
        ([1, 37, 1, 9, 1], [20, 0, 3, 14, 40], 64, 16, None),  # decodes around chunks, some with a cached prefix
        ([50], [7], 64, 64, None),  # one chunk alone: the decode launch finds only empty requests
        ([1, 1, 2, 17], [33, 5, 9, 0], 64, 8, 12),  # a 2-token chunk and a sliding window
    ],
)
def test_padded_launch_matches_reference(
    q_lens: list[int], ctx_lens: list[int], size: int, num_reqs: int, window: int | None
) -> None:
    h, kvh, d, bs, dtype = 8, 2, 64, 16, torch.float32
    b = Batch(q_lens, ctx_lens, h, kvh, d, bs, dtype, seed=3)
    n, nr = b.num_tokens, len(q_lens)
    dev = DEVICE
    # Padded inputs, as MixedGraphRunner.run lays them out.
    qkv = torch.randn(size, b.qkv.shape[1], dtype=dtype)  # padded rows: finite garbage
    qkv[:n] = b.qkv
    qkv = qkv.to(dev)
    slots = torch.full((size,), -1, dtype=torch.int64)
    slots[:n] = b.slot_mapping
    qsl = torch.full((num_reqs + 1,), n, dtype=torch.int32)
    qsl[: nr + 1] = b.query_start_loc
    seq = torch.zeros(num_reqs, dtype=torch.int32)
    seq[:nr] = torch.tensor(b.seq_lens, dtype=torch.int32)
    table = torch.zeros(num_reqs, b.block_table.shape[1], dtype=torch.int32)
    table[:nr] = b.block_table
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(dev),
        query_start_loc_cpu=launch_shape(size, num_reqs),
        seq_lens=seq.to(dev),
        seq_lens_cpu=torch.ones(num_reqs, dtype=torch.int32),
        num_computed_tokens_cpu=torch.zeros(num_reqs, dtype=torch.int32),
        block_table=table.to(dev),
        slot_mapping=slots.to(dev),
        num_reqs=num_reqs,
        num_actual_tokens=size,
        max_query_len=size,
        max_seq_len=256,
    )
    md = TritonAttentionMetadataBuilder(bs, window, torch.device(dev)).build(common)
    assert md.num_decodes == (1 if num_reqs > 1 else 0)  # the two-launch split, whatever the step holds
    impl = TritonAttentionImpl(h, d, d**-0.5, kvh, window, AttentionType.DECODER)
    impl.kv_scales = (torch.ones(1, device=dev), torch.ones(1, device=dev))
    q = qkv[:, : h * d].view(size, h, d)
    k = qkv[:, h * d : (h + kvh) * d].view(size, kvh, d)
    v = qkv[:, (h + kvh) * d :].view(size, kvh, d)
    kv_cache = torch.stack([b.k_cache, b.v_cache]).to(dev)
    out = torch.full((size, h, d), float("nan"), dtype=dtype, device=dev)
    impl.forward(q, k, v, kv_cache, md, out)

    ref = b.reference(d**-0.5, window)
    got = out[:n].double().cpu()
    rel = (got - ref).norm() / ref.norm()
    assert rel < REL_TOL[dtype], f"relative error {rel:.2e}"
    # The cache holds every real token's K/V and nothing from the padded rows (block 0 and spares stay NaN).
    for r in range(nr):
        flat_k = kv_cache[0][b.blocks[r]].flatten(0, 1)[: b.seq_lens[r]].cpu()
        assert torch.equal(flat_k, b.k[r]), f"request {r}'s keys"
    used = {blk for blocks in b.blocks for blk in blocks}
    spare = [i for i in range(kv_cache.shape[1]) if i not in used]
    assert torch.isnan(kv_cache[:, spare].float()).all(), "a padded row was written to the cache"
