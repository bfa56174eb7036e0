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

from pagedllm.attention.ops.triton_paged_attn import paged_attention, request_order  # noqa: E402
from tests.gpu.test_triton_attention import run_case  # noqa: E402

CASES = [([1] * 7, [300, 1, 0, 129, 1000, 16, 64]), ([40, 1, 1, 9, 1], [0, 700, 3, 50, 128])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_lens,ctx_lens", CASES)
def test_any_order_same_output(dtype: torch.dtype, q_lens: list[int], ctx_lens: list[int]) -> None:
    """Decode batches and mixed batches (the order drives the decode launch only), the sorted order and a
    shuffled one: bit-identical to batch order, and right against the float64 reference."""
    n = len(q_lens)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    longest = request_order(torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), n)
    assert [seq_lens[i] for i in longest.tolist()] == sorted(seq_lens, reverse=True)
    shuffled = torch.randperm(n, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    case = {"num_heads": 12, "num_kv_heads": 3, "dtype": dtype, "seed": n}
    plain = run_case(q_lens, ctx_lens, **case)
    for order in (longest, shuffled):
        assert torch.equal(run_case(q_lens, ctx_lens, req_order=order, **case), plain)


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
    case = {"num_heads": 8, "num_kv_heads": 2, "num_splits": 4, "seed": 3}
    plain = run_case([1] * 4, [900, 3, 300, 64], **case)
    order = torch.tensor([3, 0, 2, 1], device=DEVICE)
    assert torch.equal(run_case([1] * 4, [900, 3, 300, 64], req_order=order, **case), plain)


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
