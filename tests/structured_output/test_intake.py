"""The step loop's batched grammar work (session 18): the async token intake as one xgrammar call
(`StructuredOutputManager.pre_accept` -> `matchers.feed_batch`), the fill reading termination from the request
states, and the CPU mask apply. A mistake in any of them would be silent (a request constrained by the wrong
state, or one request's rejection or termination landing on another), so each is checked against the per-request
path it replaces."""

from __future__ import annotations

import numpy as np
import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from pagedllm.sampling_params import StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output import matchers as matchers_mod  # noqa: E402
from pagedllm.structured_output.apply import _apply_cpu  # noqa: E402
from pagedllm.structured_output.backend import XgrammarBackend  # noqa: E402
from pagedllm.structured_output.config import StructuredOutputsConfig  # noqa: E402
from pagedllm.structured_output.manager import GrammarBitmask, StructuredOutputManager  # noqa: E402
from pagedllm.structured_output.matchers import RequestGrammar  # noqa: E402
from pagedllm.transformers_utils.config import default_model_path  # noqa: E402
from pagedllm.transformers_utils.tokenizer import get_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def env() -> tuple:
    tok = get_tokenizer(default_model_path())
    be = XgrammarBackend(tok, len(tok), [tok.eos_token_id], StructuredOutputsConfig())
    return tok, be


def _state(be: XgrammarBackend, compiled: object, prefix: list[int]) -> RequestGrammar:
    st = RequestGrammar(None, True)  # type: ignore[arg-type]
    st.matcher = be.matcher(compiled)
    st.stop_ids = frozenset(st.matcher.stop_token_ids)
    for t in prefix:
        assert st.matcher.accept_token(t)
    return st


@pytest.mark.parametrize("raw", [True, False], ids=["one-ffi-call", "public-wrapper"])
def test_batch_intake_marks_each_request_alone(env: tuple, raw: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight requests, one step: rejected tokens, a termination, a failed request, a multi-token request, a
    finished one and one still reasoning; each ends exactly as the per-request loop (`_feed`) leaves it."""
    tok, be = env
    if not raw:  # the fallback for an xgrammar without the raw binding
        monkeypatch.setattr(matchers_mod, "_raw_batch_accept", lambda: None)
    digits = be.compile(StructuredOutputsParams(regex="[0-9]{1,3}"))
    yes = be.compile(StructuredOutputsParams(choice=["yes"]))
    one = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    seven, x, eos = one("7")[0], one("x")[0], tok.eos_token_id
    plan = {  # request -> (grammar, accepted prefix, this step's tokens)
        "ok": (digits, [], [seven]),
        "bad": (digits, [], [x]),
        "ok2": (digits, [seven], [seven]),
        "ends": (yes, one("yes"), [eos]),
        "bad2": (yes, [], [x]),
        "failed": (digits, [], [x]),
        "multi": (digits, [], [seven, seven]),
        "multi_bad": (digits, [], [seven, x, seven]),
        "empty": (digits, [], []),
    }
    got = StructuredOutputManager(StructuredOutputsConfig(), lambda: be, len(tok))
    ref = StructuredOutputManager(StructuredOutputsConfig(), lambda: be, len(tok))
    for rid, (g, prefix, _) in plan.items():
        got.states[rid] = _state(be, g, prefix)
        ref.states[rid] = _state(be, g, prefix)
    for m in (got, ref):
        m.states["thinking"] = _state(be, digits, [])
        m.states["thinking"].reasoning_ended = False
        m.states["done"] = _state(be, yes, one("yes") + [eos])
        m.states["done"].terminated = True
    ids = [*plan, "thinking", "done", "plain"]
    sampled = [plan[r][2] for r in plan] + [[x], [x], [x]]
    got.pre_accept(ids, sampled, {"failed": "a logits processor raised"})
    for rid, tokens in zip(ids, sampled):  # the reference: the per-request loop it replaces
        st = ref.states.get(rid)
        if st is None or not tokens or rid == "failed" or not st.reasoning_ended or st.terminated:
            continue
        st.num_seen += len(tokens)
        StructuredOutputManager._feed(st, tokens)
    summary = lambda m: {r: (s.error, s.terminated, s.num_seen) for r, s in m.states.items()}  # noqa: E731
    assert summary(got) == summary(ref)
    s = got.states
    assert s["bad"].error and s["bad2"].error and s["multi_bad"].error
    assert not any(s[r].error for r in ("ok", "ok2", "ends", "failed", "multi", "thinking", "done"))
    assert s["ends"].terminated and not any(s[r].terminated for r in ("ok", "ok2", "bad", "multi"))
    assert s["failed"].num_seen == 0 and s["thinking"].num_seen == 0 and s["ok"].num_seen == 1
    # The matchers advanced by exactly the accepted tokens: the same next-token masks as the reference's.
    for rid in plan:
        if got.states[rid].terminated:
            continue  # (xgrammar refuses to fill a terminated matcher's mask)
        a, b = xgr.allocate_token_bitmask(1, be.valid_vocab), xgr.allocate_token_bitmask(1, be.valid_vocab)
        got.states[rid].matcher.fill_next_token_bitmask(a)
        ref.states[rid].matcher.fill_next_token_bitmask(b)
        assert torch.equal(a, b), rid
    got.shutdown()
    ref.shutdown()


def test_fill_reads_termination_from_states(env: tuple) -> None:
    """A terminated request's row is left all-allowed, the others equal xgrammar's own fill."""
    tok, be = env
    digits = be.compile(StructuredOutputsParams(regex="[0-9]{1,3}"))
    sts = [_state(be, digits, []) for _ in range(3)]
    sts[1].terminated = True  # as the intake marks it (its matcher itself is not asked)
    bm = GrammarBitmask([st.matcher for st in sts], be.valid_vocab, xgr.BatchGrammarMatcher(1), states=sts)
    mask, rows = bm.narrow()
    assert rows == [0, 2]
    assert (mask[1] == -1).all()
    ref = xgr.allocate_token_bitmask(1, be.valid_vocab)
    sts[0].matcher.fill_next_token_bitmask(ref)
    assert torch.equal(mask[0], ref[0]) and torch.equal(mask[2], ref[0])


@pytest.mark.parametrize("open_frac", [0.003, 0.5, 0.99])
@pytest.mark.parametrize("vocab", [1013, 1024])
@pytest.mark.parametrize("pad", [0, 37])
def test_cpu_apply(open_frac: float, vocab: int, pad: int) -> None:
    """Both CPU paths (xgrammar's kernel over whole words for mostly-open masks, unpack + where otherwise) mask
    exactly the 0 bits, also next to an all-allowed row (which trips xgrammar's own kernel when vocab % 32:
    checked below, so a fixed xgrammar shows up here); logits past `vocab` (padding) are left alone."""
    rng = np.random.default_rng(0)
    n = 6
    allowed = rng.random((n, vocab)) < open_frac
    allowed[3] = True  # an unconstrained row, followed by a constrained one
    bits = np.packbits(np.pad(allowed, ((0, 0), (0, -vocab % 32))), axis=1, bitorder="little")
    mask = torch.from_numpy(bits.view(np.int32).copy())
    logits = torch.randn(n, vocab + pad)
    want = logits.clone()
    want[:, :vocab][torch.from_numpy(~allowed)] = float("-inf")
    got = logits.clone()
    _apply_cpu(got, mask, vocab)
    assert torch.equal(got, want)
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, mask, vocab_size=vocab)
    wrong = torch.isinf(theirs) != torch.isinf(want)
    if vocab % 32 and not pad and open_frac == 0.99:
        assert wrong.nonzero().tolist() == [[4, 0]]  # the row after the all-allowed one, its id 0
    elif vocab % 32 == 0:
        assert not wrong.any()


def test_worker_intake_and_fill_equal_inline(env: tuple) -> None:
    """Async scheduling with the worker thread (`overlap.StepJobs`): step N's sampled ids reported by the runner,
    step N+1 chained, its mask asked for. The request states (published only at the mask) and the mask equal
    the inline path's (`pre_accept` then the fill); a request terminated by N's token gets an unconstrained row,
    a rejected one its error, and nothing is published before N+1's mask is asked for."""
    from pagedllm.core.scheduler_output import CachedRequestData, SchedulerOutput
    from pagedllm.executor.abstract import StepFuture

    tok, be = env
    digits = be.compile(StructuredOutputsParams(regex="[0-9]{1,3}"))
    yes = be.compile(StructuredOutputsParams(choice=["yes"]))
    one = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    seven, x, eos = one("7")[0], one("x")[0], tok.eos_token_id
    plan = {"a": (digits, [], seven), "b": (digits, [], x), "c": (yes, one("yes"), eos), "d": (digits, [seven], seven)}
    req_ids = ["plain", *plan]  # the runner's rows; "plain" has no grammar
    sampled = torch.tensor([x] + [t for _, _, t in plan.values()])

    class Req:
        def __init__(self, rid: str) -> None:
            self.request_id, self.num_computed_tokens, self.num_tokens = rid, 5, 5

    out: dict[str, tuple] = {}
    for mode in ("worker", "inline"):
        mgr = StructuredOutputManager(StructuredOutputsConfig(), lambda: be, len(tok), fill_threads=1)
        mgr._backend = be
        for rid, (g, prefix, _) in plan.items():
            st = _state(be, g, prefix)
            mgr.states[rid] = mgr._active[rid] = st
        reqs = {rid: Req(rid) for rid in req_ids}
        # Step N: its rows, its sampler "launched".
        so_n = SchedulerOutput([], CachedRequestData(), {r: 1 for r in req_ids}, len(req_ids))
        mgr.prepare(so_n, reqs)
        bm_n = so_n.grammar_bitmask
        assert isinstance(bm_n, GrammarBitmask) and bm_n.on_sampled is not None
        bm_n.narrow()
        if mode == "worker":
            bm_n.on_sampled(req_ids, np.arange(len(req_ids)), sampled, None, None)
        # Step N+1, scheduled before N's tokens are read.
        so_n1 = SchedulerOutput([], CachedRequestData(), {r: 1 for r in req_ids}, len(req_ids))
        mgr.prepare(so_n1, reqs)

        def result() -> object:
            from pagedllm.core.scheduler_output import ModelRunnerOutput

            return ModelRunnerOutput(req_ids, [[int(t)] for t in sampled], None, {}, {})

        mgr.chain(so_n1, StepFuture(result))  # type: ignore[arg-type]
        assert not any(st.num_seen or st.error or st.terminated for st in mgr.states.values())  # nothing yet
        mask, rows = so_n1.grammar_bitmask.narrow()  # type: ignore[union-attr]
        out[mode] = (mask.clone(), rows, {r: (s.num_seen, s.error, s.terminated) for r, s in mgr.states.items()})
        mgr.shutdown()
    assert torch.equal(out["worker"][0], out["inline"][0]) and out["worker"][1:] == out["inline"][1:]
    states = out["worker"][2]
    assert states["b"][1] and states["c"][2] and not states["a"][1] and not states["d"][2]
    assert out["worker"][1] == [0, 1, 3]  # "c" terminated by N's token: its row left unconstrained


def test_step_intake_by_row_map_equals_by_request_id(env: tuple) -> None:
    """The worker's intake picks a step's constrained rows from the CUDA apply's row map (`logit_rows`) when it
    has one, else by request id: the same states and positions either way (a terminated state and a row without
    a grammar skipped), and the tokens go into the matchers."""
    from pagedllm.structured_output.overlap import StepJobs

    tok, be = env
    digits = be.compile(StructuredOutputsParams(regex="[0-9]{1,3}"))
    sts = {f"r{i}": _state(be, digits, []) for i in range(3)}
    sts["r1"].terminated = True
    req_ids = ["free", "r2", "r0", "r1"]  # logits rows; "free" has no grammar
    rows = {"r0": 0, "r1": 1, "r2": 2}  # mask rows (the scheduler's order)
    one = tok.encode("7", add_special_tokens=False)[0]
    picked = {}
    for mapped in (False, True):
        fresh = {rid: _state(be, digits, []) for rid in sts}
        fresh["r1"].terminated = True
        bm = GrammarBitmask([st.matcher for st in fresh.values()], be.valid_vocab, None, states=list(fresh.values()))  # type: ignore[arg-type]
        bm.logit_rows = [rows.get(r) for r in req_ids] if mapped else None
        jobs = StepJobs(fresh)
        host = torch.tensor([one] * 4)
        jobs.sampled(rows, bm, req_ids, np.arange(4), host, None, None)
        job = jobs.pending
        assert job is not None
        picked[mapped] = sorted((next(r for r, s in fresh.items() if s is st), j) for st, j in job.picked)
        jobs.publish()
        assert [fresh[r].num_seen for r in ("r0", "r1", "r2")] == [1, 0, 1]
        jobs.shutdown()
    assert picked[False] == picked[True] == [("r0", 2), ("r2", 1)]
