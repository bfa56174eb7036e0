"""The Triton kernels of n-gram speculation under async scheduling (`spec_decode/triton_ngram.py`) against their
PyTorch versions (`spec_decode/async_ngram.py`): the greedy verdict + append + next proposals, the append +
proposals after a rejection sampler, and the verification graph's input fix-up (also on the CPU under
TRITON_INTERPRET=1)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.gpu.triton_env import DEVICE, require_triton_device

pytestmark = pytest.mark.gpu

require_triton_device()

from pagedllm.sample.rejection_sampler import VerifyOutput, greedy_verify  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402
from pagedllm.spec_decode import triton_ngram  # noqa: E402
from pagedllm.spec_decode.async_ngram import DeviceHistory, fixup_graph_inputs  # noqa: E402
from pagedllm.worker.input_batch import CachedRequestState  # noqa: E402


def _history(seed: int, k: int, n_min: int, n_max: int, max_len: int = 300) -> tuple[DeviceHistory, list[str]]:
    rng = np.random.default_rng(seed)
    hist = DeviceHistory(8, max_len, k, n_min, n_max, torch.device(DEVICE))
    ids = []
    for i in range(6):
        n = int(rng.integers(1, max_len - 2 * k - 2))
        toks = rng.integers(0, int(rng.integers(2, 7)), size=n).tolist()  # small alphabets: many matches
        hist.add(CachedRequestState(f"r{i}", toks[:1], toks[1:], SamplingParams(), None, [[]], 0))
        hist.drafts[hist.slot_of[f"r{i}"]] = torch.from_numpy(rng.integers(0, 7, size=k))
        ids.append(f"r{i}")
    return hist, ids


def _same(a: DeviceHistory, b: DeviceHistory, slots: np.ndarray) -> None:
    for s in slots.tolist():
        n = int(a.lens[s])
        assert n == int(b.lens[s])
        assert torch.equal(a.hist[s, :n].cpu(), b.hist[s, :n].cpu())
    s_t = torch.from_numpy(slots)
    assert torch.equal(a.num_real[s_t.to(a.lens.device)].cpu(), b.num_real[s_t.to(b.lens.device)].cpu())
    for s in slots.tolist():
        r = int(a.num_real[s])
        assert torch.equal(a.drafts[s, :r].cpu(), b.drafts[s, :r].cpu()), s


@pytest.mark.parametrize(("k", "n_min", "n_max"), [(4, 2, 4), (3, 1, 3), (1, 1, 1)])
def test_verify_append_propose_matches_torch(k: int, n_min: int, n_max: int) -> None:
    tri, ids = _history(k * 10 + n_min, k, n_min, n_max)
    ref = copy.deepcopy(tri)
    ref.device = torch.device("cpu")
    for t in ("hist", "lens", "drafts", "num_real"):
        setattr(ref, t, getattr(ref, t).cpu())
    rng = np.random.default_rng(k)
    for _ in range(3):  # a few steps in a row: each step's proposals come from the last one's history
        pick = ids[: int(rng.integers(1, len(ids) + 1))]
        slots = tri.slots(pick)
        nd = rng.integers(0, k + 1, size=len(pick))
        n_rows = nd + 1
        starts = np.cumsum(n_rows) - n_rows
        # argmax rows: agree with the proposals for a random prefix, then something else
        am = []
        for s, d in zip(slots.tolist(), nd.tolist()):
            props = ref.drafts[s, :d].tolist()
            keep = int(rng.integers(0, d + 1))
            am += props[:keep] + [int(rng.integers(0, 7)) for _ in range(d + 1 - keep)]
        am_t = torch.tensor(am, dtype=torch.int64)
        want = greedy_verify(am_t, ref.draft_ids(slots, nd), nd)
        real_ref = torch.minimum(ref.num_real[torch.from_numpy(slots)], torch.from_numpy(nd))
        ref.append_and_propose(torch.from_numpy(slots), want.token_ids, want.num_emitted, ref.width)
        dev = torch.device(DEVICE)
        tok, cnt, real = triton_ngram.verify_append_propose(
            tri, torch.from_numpy(slots).to(dev), torch.from_numpy(nd).to(dev), torch.from_numpy(starts).to(dev),
            am_t.to(dev),
        )  # fmt: skip
        assert torch.equal(cnt.cpu(), want.num_emitted)
        w = want.token_ids.shape[1]
        assert torch.equal(tok[:, :w].cpu(), want.token_ids) and bool((tok[:, w:] == -1).all())
        assert torch.equal(real.cpu(), real_ref)
        _same(tri, ref, slots)
        # the same append + proposals from a rejection sampler's output
        out = VerifyOutput(want.token_ids, want.num_emitted, want.token_rows)
        ref.append_and_propose(torch.from_numpy(slots), out.token_ids, out.num_emitted, ref.width)
        padded = torch.nn.functional.pad(out.token_ids, (0, k + 1 - w), value=-1).to(dev)
        triton_ngram.verify_append_propose(
            tri, torch.from_numpy(slots).to(dev), torch.from_numpy(nd).to(dev), None, None, padded,
            out.num_emitted.to(dev),
        )  # fmt: skip
        _same(tri, ref, slots)


def test_fixup_matches_torch() -> None:
    k, bs, max_len = 3, 16, 200
    hist, ids = _history(7, k, 1, 3, max_len)
    lens = hist.lens.clone()
    lens[hist.slot_of["r2"]] = max_len - 1  # rows past max_model_len get slot -1
    hist.lens.copy_(lens)
    n, q = len(ids), k + 1
    dev = torch.device(DEVICE)

    def graphs() -> SimpleNamespace:
        tables = [(torch.arange(n * (max_len // bs + 1), dtype=torch.int32).view(n, -1) * 7 + 3).to(dev)]
        z = torch.zeros(n * q, dtype=torch.long, device=dev)
        return SimpleNamespace(q=q, positions=z.clone(), input_ids=z.clone(), block_tables=tables,
                               seq_lens=torch.zeros(n, dtype=torch.int32, device=dev), slots=[z.clone()])  # fmt: skip

    slots = torch.from_numpy(hist.slots(ids)).to(dev)
    nd = torch.tensor([3, 0, 2, 3, 1, 3], device=dev)
    a, b = graphs(), graphs()
    fixup_graph_inputs(a, hist, slots, nd, [bs], max_len)
    triton_ngram.fixup_graph_inputs(b, hist, slots, nd, [bs], max_len)
    for name in ("positions", "input_ids", "seq_lens"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(a.slots[0], b.slots[0])
    assert int((a.slots[0] == -1).sum()) > 0


def test_padded_requests_are_skipped() -> None:
    """A fused graph's padded requests (proposal count -1) leave their graph rows and the histories as they are."""
    k, bs, max_len = 3, 16, 200
    hist, ids = _history(11, k, 1, 3, max_len)
    dev = torch.device(DEVICE)
    n, q = len(ids), k + 1
    tables = [(torch.arange(n * (max_len // bs + 1), dtype=torch.int32).view(n, -1) * 5 + 1).to(dev)]
    g = SimpleNamespace(q=q, positions=torch.full((n * q,), 7, dtype=torch.long, device=dev),
                        input_ids=torch.full((n * q,), 9, dtype=torch.long, device=dev), block_tables=tables,
                        seq_lens=torch.full((n,), 3, dtype=torch.int32, device=dev),
                        slots=[torch.full((n * q,), -1, dtype=torch.long, device=dev)])  # fmt: skip
    slots = torch.from_numpy(hist.slots(ids)).to(dev)
    nd = torch.tensor([2, -1, 3, -1, 0, -1], device=dev)
    live = (nd >= 0).cpu()
    before = copy.deepcopy(hist)
    triton_ngram.fixup_graph_inputs(g, hist, slots, nd, [bs], max_len)
    rows = live.repeat_interleave(q)
    assert bool((g.positions.cpu()[~rows] == 7).all()) and bool((g.input_ids.cpu()[~rows] == 9).all())
    assert bool((g.slots[0].cpu()[~rows] == -1).all()) and bool((g.seq_lens.cpu()[~live] == 3).all())
    assert bool((g.seq_lens.cpu()[live] != 3).all())
    starts = torch.arange(n, device=dev) * q
    am = torch.randint(0, 7, (n * q,), device=dev)
    _, cnt, _ = triton_ngram.verify_append_propose(hist, slots, nd, starts, am)
    for i, rid in enumerate(ids):
        s = hist.slot_of[rid]
        if bool(live[i]):
            assert int(hist.lens[s]) == int(before.lens[s]) + int(cnt[i])
        else:
            assert int(hist.lens[s]) == int(before.lens[s])
            assert torch.equal(hist.hist[s].cpu(), before.hist[s].cpu())
            assert torch.equal(hist.drafts[s].cpu(), before.drafts[s].cpu())
            assert int(hist.num_real[s]) == int(before.num_real[s])
