"""The split-row argmax (`sample/triton_argmax.py`) against torch's argmax: first index on ties, NaN wins,
all -inf rows, one chunk and many, float32 and bf16 (on the CPU under TRITON_INTERPRET=1, float32)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.triton_env import DEVICE, INTERPRET, require_triton_device

pytestmark = pytest.mark.gpu

require_triton_device()

from pagedllm.sample import triton_argmax  # noqa: E402

DTYPES = [torch.float32] + ([] if INTERPRET else [torch.bfloat16])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "vocab", "sms"), [(1, 5000, 4), (3, 4097, 8), (2, 1000, 1), (5, 70000, 132)])
def test_split_argmax_matches_torch(dtype: torch.dtype, rows: int, vocab: int, sms: int) -> None:
    g = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, generator=g)
    x = (x * 4).round() / 4  # coarse values: many ties, the first index must win
    x[0, vocab // 2] = x.max() + 1
    x[0, vocab - 1] = x.max()  # a tie with an earlier column
    if rows > 1:
        x[1] = float("-inf")  # all masked: index 0
    if rows > 2:
        x[2, 7] = float("nan")  # NaN wins
    x = x.to(dtype)
    got = triton_argmax.split_argmax(x.to(DEVICE), sms).cpu()
    assert torch.equal(got, torch.argmax(x, dim=-1)), (got, torch.argmax(x, dim=-1))


@pytest.mark.skipif(INTERPRET, reason="needs a GPU")
def test_argmax_rows_replays_in_a_cuda_graph() -> None:
    """The counters are left at zero by every launch: replays of a captured graph keep answering right."""
    x = torch.randn(2, 128256, device="cuda")
    out = triton_argmax.argmax_rows(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_argmax.argmax_rows(x)
    for seed in range(3):
        x.copy_(torch.randn(2, 128256, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        assert torch.equal(out.cpu(), torch.argmax(x, dim=-1).cpu())


@pytest.mark.skipif(INTERPRET, reason="Triton compiles")
def test_one_compiled_variant_serves_every_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The split follows the row count at run time: after one launch, other row counts compile nothing (a compile
    while serving is a stall)."""
    from triton import knobs

    x = torch.randn(64, 151_936, device=DEVICE)
    triton_argmax.argmax_rows(x[:1])
    compiled: list[str] = []

    def hook(**kw: object) -> bool:
        compiled.append(str(kw["repr"])[:120])
        return False

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", hook)
    for rows in (2, 3, 5, 17, 33, 64):
        assert torch.equal(triton_argmax.argmax_rows(x[:rows]), x[:rows].argmax(dim=-1))
    assert compiled == []
