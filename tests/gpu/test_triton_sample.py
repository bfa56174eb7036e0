"""One-pass Gumbel-max sampling (`triton_sample.gumbel_sample`): its draws follow softmax(l / T) per row,
masked tokens never come out, a seed repeats its draws, and on CUDA the sampler takes it for unseeded
random rows (greedy and seeded rows keep their paths). GPU; the kernel also runs on the CPU under
TRITON_INTERPRET=1 (fewer draws there)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.gpu.triton_env import DEVICE, INTERPRET, require_triton_device  # noqa: E402

pytestmark = pytest.mark.gpu

require_triton_device()

from pagedllm.sample import triton_sample  # noqa: E402

ROWS = 3000 if INTERPRET else 200_000


def _keys(n: int, seed: int) -> torch.Tensor:
    """Per-row Philox keys from one seed (rows draw independent streams)."""
    return torch.from_numpy(triton_sample.row_seeds(np.full(n, seed), np.arange(n))).to(DEVICE)


@pytest.mark.parametrize("in_kernel_keys", [False, True])
@pytest.mark.parametrize("temp", [0.5, 1.0, 2.0])
def test_draws_follow_softmax(temp: float, in_kernel_keys: bool) -> None:
    logits = torch.tensor([1.0, 0.0, 2.0, -1.0, float("-inf"), 0.5])
    x = logits.repeat(ROWS, 1).to(DEVICE)
    t = torch.full((ROWS,), temp, device=DEVICE)
    if in_kernel_keys:  # unseeded rows: keys made in the kernel from one base key and the row index
        ids = triton_sample.gumbel_sample(x, t, None, base_key=triton_sample.step_key()).cpu()
    else:
        ids = triton_sample.gumbel_sample(x, t, _keys(ROWS, 1234)).cpu()
    freq = torch.bincount(ids, minlength=6).double() / ROWS
    p = torch.softmax(logits.double() / temp, dim=0)
    assert freq[4] == 0  # -inf never drawn
    for i in range(6):
        sd = math.sqrt(max(p[i] * (1 - p[i]), 1e-12) / ROWS)
        assert abs(freq[i] - p[i]) < 5 * sd + 1e-9, (i, float(freq[i]), float(p[i]))


def test_long_rows_seed_and_ties() -> None:
    vocab = 3 * 4096 + 123  # several chunks, a partial last one
    x = torch.full((8, vocab), -5.0)
    x[:, 9000] = 60.0  # overwhelming: always drawn, from a later chunk
    x[1] = float("-inf")
    x[1, vocab - 1] = 0.0  # the only finite logit, in the partial chunk
    x = x.to(DEVICE)
    t = torch.ones(8, device=DEVICE)
    a = triton_sample.gumbel_sample(x, t, _keys(8, 7)).cpu()
    assert a[0] == 9000 and a[1] == vocab - 1 and all(a[i] == 9000 for i in range(2, 8))
    flat = torch.zeros(64, vocab, device=DEVICE)
    one, two = (triton_sample.gumbel_sample(flat, torch.ones(64, device=DEVICE), _keys(64, s)).cpu() for s in (3, 3))
    assert torch.equal(one, two)  # a seed repeats its draws
    other = triton_sample.gumbel_sample(flat, torch.ones(64, device=DEVICE), _keys(64, 4)).cpu()
    assert not torch.equal(one, other)
    assert len(set(one.tolist())) > 50  # rows draw independent streams
    # Keys made in the kernel: a base key repeats its draws, another base key differs, rows are independent.
    b1, b2 = (
        triton_sample.gumbel_sample(flat, torch.ones(64, device=DEVICE), None, base_key=k).cpu()
        for k in (2**61 + 5, 2**61 + 5)
    )
    assert torch.equal(b1, b2) and len(set(b1.tolist())) > 50
    b3 = triton_sample.gumbel_sample(flat, torch.ones(64, device=DEVICE), None, base_key=2**40 + 17).cpu()
    assert not torch.equal(b1, b3)
    fresh = [triton_sample.gumbel_sample(flat[:4], torch.ones(4, device=DEVICE), None).cpu() for _ in range(2)]
    assert not torch.equal(fresh[0], fresh[1])  # no base key: a fresh one per call


def test_rows_split_into_chunks_draw_the_same() -> None:
    """The noise of a column depends on its row's key and its index only: one program per row or a row cut into
    chunks (the last one partial) gives the same ids, ties and all -inf rows included."""
    vocab = 5 * 4096 + 77
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, vocab, generator=g) * 3
    x[2] = float("-inf")  # no finite logit: index 0, as one program reports it
    x[3] = 1.0  # all tied
    x[4, :8192] = float("-inf")  # the first two chunks' programs see nothing finite
    x = x.to(DEVICE)
    t = torch.tensor([0.7, 1.0, 1.0, 1.0, 1.3, 2.0], device=DEVICE)
    keys = _keys(6, 99)
    one = triton_sample.gumbel_sample(x, t, keys, split=1).cpu()
    for split in (2, 3, 6):
        assert torch.equal(triton_sample.gumbel_sample(x, t, keys, split=split).cpu(), one), split
    assert torch.equal(triton_sample.gumbel_sample(x, t, None, base_key=5, split=4).cpu(),
                       triton_sample.gumbel_sample(x, t, None, base_key=5, split=1).cpu())  # fmt: skip
    assert one[2] == 0


@pytest.mark.skipif(INTERPRET, reason="the sampler dispatches to the kernel on CUDA tensors only")
def test_sampler_uses_one_pass_for_unseeded_random_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm import SamplingParams
    from pagedllm.sample.sampler import Sampler
    from pagedllm.worker.sampling_batch import build_sampling_metadata

    calls = []
    real = triton_sample.gumbel_sample
    monkeypatch.setattr(triton_sample, "gumbel_sample", lambda *a, **k: calls.append(1) or real(*a, **k))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8), SamplingParams(temperature=1.0)]
    logits = torch.randn(3, 1000, device="cuda") * 3
    out = Sampler()(logits.clone(), build_sampling_metadata(params, 1000, device="cuda"))
    assert calls and int(out.sampled_token_ids[0]) == int(logits[0].argmax())
    calls.clear()
    gens = {1: torch.Generator(device="cuda").manual_seed(5)}
    seeded = [SamplingParams(temperature=0.8, seed=5), SamplingParams(temperature=0.8, seed=5)]
    a = Sampler()(logits[:2].clone(), build_sampling_metadata(seeded, 1000, generators=gens, device="cuda"))
    assert not calls and a.sampled_token_ids.shape == (2,)  # a batch with a seeded row keeps the generator path


@pytest.mark.skipif(INTERPRET, reason="the sampler dispatches to the kernel on CUDA tensors only")
def test_build_failure_falls_back_to_the_unfused_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm import SamplingParams
    from pagedllm.sample.sampler import Sampler
    from pagedllm.worker.sampling_batch import build_sampling_metadata

    class Broken:
        def __getitem__(self, grid):  # noqa: ANN001, ANN204
            def launch(*a, **k):  # noqa: ANN002, ANN003, ANN202
                raise RuntimeError("simulated compile failure")

            return launch

    monkeypatch.setattr(triton_sample, "_gumbel_argmax_kernel", Broken())
    monkeypatch.setattr(triton_sample, "_state", {"compiled": False, "broken": False})
    params = [SamplingParams(temperature=0.7)] * 4
    logits = torch.randn(4, 500, device="cuda")
    out = Sampler()(logits, build_sampling_metadata(params, 500, device="cuda"))
    assert out.sampled_token_ids.shape == (4,) and triton_sample._state["broken"]
    assert not triton_sample.usable(logits)


def test_per_row_keys() -> None:
    """Per-row Philox keys (seeded requests): a row's draws depend on its key alone, and keys from
    `row_seeds` give independent rows that still follow softmax(l / T)."""
    n = ROWS // 2
    logits = torch.tensor([0.5, 1.5, -0.5, 1.0])
    x = logits.repeat(n, 1).to(DEVICE)
    t = torch.full((n,), 0.8, device=DEVICE)
    keys = triton_sample.row_seeds(np.full(n, 42, dtype=np.int64), np.arange(n, dtype=np.int64))
    assert len(set(keys.tolist())) == n and (keys >= 0).all()
    assert np.array_equal(keys, triton_sample.row_seeds(np.full(n, 42), np.arange(n)))  # deterministic
    ids = triton_sample.gumbel_sample(x, t, torch.from_numpy(keys).to(DEVICE)).cpu()
    freq = torch.bincount(ids, minlength=4).double() / n
    p = torch.softmax(logits.double() / 0.8, dim=0)
    assert (freq - p).abs().max() < 5 * math.sqrt(0.25 / n)
    # The same key on another row, in another batch, draws the same token.
    one = triton_sample.gumbel_sample(x[:1], t[:1], torch.from_numpy(keys[7:8]).to(DEVICE)).cpu()
    assert int(one[0]) == int(ids[7])
