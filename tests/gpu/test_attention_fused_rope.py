"""A decode launch doing RoPE and the new token's cache write itself (`triton_paged_attn.DecodeRope`) against
the two launches it replaces (`rotary_embedding_` with its cache write, then the attention): the output and
both caches bit for bit (NaN where nothing was written), on random paged batches (`test_triton_attention.Batch`:
caches poisoned with NaN, blocks at random), one and sixteen split-KV segments, a padding row (slot -1).
GPU, or the CPU under TRITON_INTERPRET=1 (float32 / float16 there)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.triton_env import DEVICE, INTERPRET, require_triton_device

pytestmark = pytest.mark.gpu

require_triton_device()

from pagedllm.attention.ops.triton_paged_attn import DecodeRope, paged_attention, request_order  # noqa: E402
from pagedllm.attention.ops.triton_rope_cache import KVCacheWrite, rotary_embedding_  # noqa: E402
from tests.gpu.test_triton_attention import Batch  # noqa: E402


def _cos_sin(head_size: int, positions: int) -> torch.Tensor:
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size))
    f = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    return torch.cat([f.cos(), f.sin()], dim=-1).to(DEVICE)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 16, "ordered"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_size"), [(4, 2, 64), (32, 8, 128)])
def test_decode_rope_in_the_attention(
    dtype: torch.dtype, num_splits: int | str, heads: int, kv_heads: int, head_size: int
) -> None:
    """ "ordered": one segment, the programs in longest-first order (large decode batches' launch)."""
    if INTERPRET and dtype == torch.bfloat16:
        pytest.skip("the Triton 3.6 interpreter truncates float32 -> bfloat16 (GPU only)")
    ctx = [0, 5, 16, 130, 700, 37]
    ordered = num_splits == "ordered"
    b = Batch([1] * len(ctx), ctx, heads, kv_heads, head_size, 16, dtype, seed=head_size + len(str(num_splits)))
    slots = b.slot_mapping.clone()
    slots[-1] = -1  # a padded row (CUDA graphs): nothing written, its key reads the poisoned cache
    positions = torch.tensor(ctx, dtype=torch.int64, device=DEVICE)
    cos_sin = _cos_sin(head_size, 1024)
    seq_lens = torch.tensor(b.seq_lens, dtype=torch.int32, device=DEVICE)
    kw = dict(
        block_table=b.block_table.to(DEVICE),
        seq_lens=seq_lens,
        query_start_loc=b.query_start_loc.to(DEVICE),
        num_actual_tokens=b.num_tokens,
        num_reqs=len(ctx),
        max_query_len=1,
        scale=head_size**-0.5,
        num_splits=1 if ordered else num_splits,
        num_decodes=len(ctx),
        req_order=request_order(seq_lens, len(ctx)) if ordered else None,
    )
    results = []
    for fused in (False, True):
        kc, vc, qkv = (t.to(DEVICE, copy=True) for t in (b.k_cache, b.v_cache, b.qkv))  # (path A writes them)
        q, k, v = b.views(qkv)
        slot = slots.to(DEVICE)
        out = torch.full((b.num_tokens, heads, head_size), float("nan"), dtype=dtype, device=DEVICE)
        if fused:
            rope = DecodeRope(positions, cos_sin, k, v, slot)
            paged_attention(q, kc, vc, out, rope=rope, **kw)  # type: ignore[arg-type]
        else:
            cache = KVCacheWrite(v, kc, vc, slot, b.num_tokens)
            rotary_embedding_(positions, q.view(b.num_tokens, -1), k.view(b.num_tokens, -1), cos_sin, head_size,
                              head_size, cache=cache)  # fmt: skip
            paged_attention(q, kc, vc, out, **kw)  # type: ignore[arg-type]
        results.append((out.cpu(), kc.cpu(), vc.cpu()))
    (out0, k0, v0), (out1, k1, v1) = results
    assert not torch.isnan(out0[:-1]).any(), "rows with a written key must be finite"
    _same(k1, k0)
    _same(v1, v0)
    _same(out1, out0)
