"""The decode launch's longest-first request order (`triton_paged_attn.request_order`, issue 18's W6): any
order of the (request, kv head) programs gives the same output, bit for bit, as the launch in batch order,
and the backend sorts once per forward, inside a CUDA graph when one is captured (GPU; `pytest -m gpu`).

The kernel parts also run under the Triton interpreter (TRITON_INTERPRET=1); the backend parts need a GPU
(the order is only used on CUDA devices with more (request, kv head) pairs than SMs)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.triton_env import DEVICE, INTERPRET, require_triton_device

pytestmark = pytest.mark.gpu

require_triton_device()

from pagedllm.attention.ops.triton_paged_attn import paged_attention, request_order, reshape_and_cache  # noqa: E402
from tests.gpu.test_triton_attention import REL_TOL, Batch  # noqa: E402


def _attend(b: Batch, order: torch.Tensor | None, num_splits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, float64 reference) of one paged_attention call over the batch, with `order` as req_order."""
    dev = DEVICE
    k_cache, v_cache = b.k_cache.to(dev), b.v_cache.to(dev)
    q, k, v = b.views(b.qkv.to(dev))
    reshape_and_cache(k, v, k_cache, v_cache, b.slot_mapping.to(dev))
    out = torch.full((b.num_tokens, b.h, b.d), float("nan"), dtype=b.dtype, device=dev)
    paged_attention(
        q,
        k_cache,
        v_cache,
        out,
        b.block_table.to(dev),
        torch.tensor(b.seq_lens, dtype=torch.int32, device=dev),
        b.query_start_loc.to(dev),
        num_actual_tokens=b.num_tokens,
        num_reqs=len(b.q_lens),
        max_query_len=max(b.q_lens),
        scale=b.d**-0.5,
        num_splits=num_splits,
        num_decodes=sum(q == 1 for q in b.q_lens),
        req_order=order,
    )
    return out.cpu(), b.reference(b.d**-0.5, None)


CASES = [([1] * 7, [300, 1, 0, 129, 1000, 16, 64]), ([40, 1, 1, 9, 1], [0, 700, 3, 50, 128])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_lens,ctx_lens", CASES)
def test_any_order_same_output(dtype: torch.dtype, q_lens: list[int], ctx_lens: list[int]) -> None:
    """Decode batches and mixed batches (the order drives the decode launch only), the sorted order and a
    shuffled one: bit-identical to batch order, and right against the float64 reference."""
    if INTERPRET and dtype == torch.bfloat16:
        pytest.skip("the Triton 3.6 interpreter truncates float32 -> bfloat16 (GPU only)")
    b = Batch(q_lens, ctx_lens, 12, 3, 64, 16, dtype, seed=len(q_lens))
    plain, ref = _attend(b, None)
    seq_lens = torch.tensor(b.seq_lens, dtype=torch.int32, device=DEVICE)
    longest = request_order(seq_lens, len(q_lens))
    assert [b.seq_lens[i] for i in longest.tolist()] == sorted(b.seq_lens, reverse=True)
    shuffled = torch.randperm(len(q_lens), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    for order in (longest, shuffled):
        got, _ = _attend(b, order)
        assert torch.equal(got, plain)
    rel = ((plain.double() - ref).norm() / ref.norm()).item()
    assert rel < REL_TOL[dtype], rel


@pytest.mark.parametrize("n", [1, 7, 64, 65, 300])
def test_request_order_is_a_stable_descending_sort(n: int) -> None:
    """Many ties (lengths from a few values) and sizes across the kernel's 64-row blocks: torch's stable sort."""
    g = torch.Generator().manual_seed(n)
    lens = torch.randint(0, 5, (n,), generator=g, dtype=torch.int32) * 100
    got = request_order(lens.to(DEVICE), n).cpu()
    assert got.dtype == torch.int32
    assert torch.equal(got.long(), torch.argsort(lens, descending=True, stable=True))


def test_split_launches_ignore_the_order() -> None:
    """A split-KV launch runs its own grid; an order passed with it changes nothing."""
    b = Batch([1] * 4, [900, 3, 300, 64], 8, 2, 64, 16, torch.float32, seed=3)
    plain, _ = _attend(b, None, num_splits=4)
    got, _ = _attend(b, torch.tensor([3, 0, 2, 1], device=DEVICE), num_splits=4)
    assert torch.equal(got, plain)


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="the order is used on CUDA devices only")
@pytest.mark.parametrize("waves", [1, 6])
def test_backend_sorts_once_per_forward_inside_a_graph(waves: int) -> None:
    """Two layers sharing one step's metadata, captured in a CUDA graph as the decode graphs are (a warm-up
    forward, then the capture): the first layer owns the sort, the graph replays it on the replayed lengths,
    and both layers' outputs equal the unordered launch's with the same tiles (`waves` programs per SM: from
    SMALL_TILE_WAVES on, the ordered launch takes 64-key tiles)."""
    from pagedllm.attention.backends.abstract import AttentionType, CommonAttentionMetadata
    from pagedllm.attention.backends.triton_attn import TritonAttentionBackend
    from pagedllm.attention.ops.triton_paged_attn import launch_config, ordered_tile_n, wants_request_order
    from pagedllm.triton_utils import num_sms

    dev = torch.device("cuda")
    h, kvh, d, bs = 16, 4, 128, 16
    n = waves * num_sms(dev) // kvh + 8  # more (request, kv head) pairs than SMs
    assert wants_request_order(n, kvh, n, 1, dev)
    g = torch.Generator().manual_seed(0)
    max_blocks = 64
    num_blocks = n * max_blocks + 1
    kv = torch.randn(2, num_blocks, bs, kvh, d, generator=g).to(torch.bfloat16).to(dev)
    block_table = (torch.randperm(num_blocks - 1, generator=g)[: n * max_blocks] + 1).view(n, max_blocks)
    block_table = block_table.to(torch.int32).to(dev)
    seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(dev),
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens,
        seq_lens_cpu=torch.ones(n, dtype=torch.int32),
        num_computed_tokens_cpu=torch.zeros(n, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=dev),
        num_reqs=n,
        num_actual_tokens=n,
        max_query_len=1,
        max_seq_len=max_blocks * bs,
    )
    md = TritonAttentionBackend.get_builder_cls()(bs, None, dev).build(common)
    layers = [TritonAttentionBackend.get_impl_cls()(h, d, d**-0.5, kvh, None, AttentionType.DECODER) for _ in range(2)]
    for layer in layers:
        layer.configure()
    q = torch.randn(n, h, d, generator=g).to(torch.bfloat16).to(dev)
    k = torch.zeros(n, kvh, d, dtype=torch.bfloat16, device=dev)
    v = torch.zeros_like(k)
    outs = [torch.empty_like(q) for _ in layers]

    def forward() -> None:
        for layer, out in zip(layers, outs):
            layer.forward(q, k, v, kv, md, out)

    seq_lens.copy_(torch.randint(1, max_blocks * bs, (n,), generator=g, dtype=torch.int32))
    forward()  # warm-up, as capture_ladder runs before capturing
    assert md.order_owner == id(layers[0])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for seed in range(3):
        g.manual_seed(seed + 10)
        lens = torch.randint(1, max_blocks * bs, (n,), generator=g, dtype=torch.int32)
        seq_lens.copy_(lens)
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert md.req_order is not None
        assert lens[md.req_order.cpu()].tolist() == sorted(lens.tolist(), reverse=True)
        plain = torch.empty_like(q)
        bm, tn, nw, ns = launch_config(d, h // kvh, q.dtype, 1)
        tn = ordered_tile_n(tn, n * kvh, dev)
        assert tn == (64 if waves >= 6 else 128)
        paged_attention(
            q, kv[0], kv[1], plain, block_table, seq_lens, qsl.to(dev),
            num_actual_tokens=n, num_reqs=n, max_query_len=1, scale=d**-0.5,
            block_m=bm, tile_n=tn, num_warps=nw, num_stages=ns,
        )  # fmt: skip
        for out in outs:
            assert torch.equal(out, plain)
