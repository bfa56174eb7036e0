"""The host fast paths agree with the general paths they skip.

- Scheduler: `Request.kv_fast_limit` (no allocate_slots call while a decode stays inside its blocks), the
  single-group block growth in allocate_slots, and the stop pre-check (`stop_len` / `stop_token_set`)
  against a scheduler that always takes the general KV path and always runs the full stop check.
- Output processor: the FINAL_ONLY "quiet" path against the general per-request path.
- Model runner: the cached request order, the cached per-row sampling lists and the by-row token append in
  `finish_step`, against the same engine with those caches off (tokens, finish reasons, logprobs).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_utils import KVCacheGroup, KVCacheSpec
from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.core.stop import check_stop
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from tests.core.test_block_pool import FakeWorker, check_pool


class _Everything:
    """A stop-token set that contains every token: forces the full stop check."""

    def __contains__(self, _: object) -> bool:
        return True


def _scheduler(num_blocks: int, budget: int, caching: bool, general: bool) -> Scheduler:
    spec = KVCacheSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32)
    cfg = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=96,
        enable_chunked_prefill=True,
        policy="fcfs",
        schedule_conservativeness=0.0,  # (the reference's requests carry stop_len 0: no admission reserve in either)
    )
    s = Scheduler(cfg, [KVCacheGroup(["l0"], spec)], num_blocks, caching)
    if general:
        s.kv._fast_decode = False  # every allocation through the general path; kv_fast_limit stays 0
    return s


@pytest.mark.parametrize("seed", range(8))
def test_scheduler_fast_paths_match_general(seed: int) -> None:
    rng = random.Random(seed)
    caching = seed % 2 == 0
    num_blocks = rng.choice([20, 30, 80])
    budget = rng.choice([8, 16, 64])
    fast = _scheduler(num_blocks, budget, caching, general=False)
    ref = _scheduler(num_blocks, budget, caching, general=True)
    workers = (FakeWorker(), FakeWorker())
    prefix = [rng.randrange(1000) for _ in range(9)]
    live: list[str] = []
    hits = 0
    for step in range(250):
        if rng.random() < 0.25 and len(live) < 16:
            rid = f"r{step}"
            prompt = (prefix if rng.random() < 0.5 else []) + [rng.randrange(1000) for _ in range(rng.randrange(1, 25))]
            kind = rng.randrange(4)
            # FakeWorker samples (sum of the last 3 tokens * 31 + 7) % 1000: pick stop ids it will meet.
            max_tokens = rng.randrange(1, 40)
            sp = SamplingParams(
                max_tokens=max_tokens,
                ignore_eos=kind == 0,
                stop_token_ids=[rng.randrange(1000) for _ in range(30)] if kind == 1 else None,
                min_tokens=min(rng.randrange(0, 6), max_tokens) if kind == 2 else 0,
            )
            eos = rng.randrange(1000) if kind != 0 else None
            sp.eos_token_id = eos
            if kind == 2:
                sp.all_stop_token_ids = [eos] if eos is not None else []
            for s in (fast, ref):
                s.add_request(EngineCoreRequest(rid, list(prompt), sp, float(step)))
            ref.requests[rid].stop_token_set = _Everything()  # type: ignore[assignment]
            ref.requests[rid].stop_len = 0
            live.append(rid)
        elif rng.random() < 0.05 and live:
            rid = rng.choice(live)
            for s in (fast, ref):
                s.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            live.remove(rid)
        so_f, so_r = fast.schedule(), ref.schedule()
        assert so_f == so_r, f"step {step}: scheduler outputs differ"
        assert so_f.total_num_scheduled_tokens <= budget
        for s in (fast, ref):  # (both schedulers run the scheduling loops) every computed slot has a block
            for r in s.running:
                assert len(s.kv.managers[0].req_blocks.get(r.request_id, ())) * 4 >= r.num_computed_tokens
        hits += sum(1 for r in fast.running if r.kv_fast_limit > 0)
        out_f = fast.update_from_output(so_f, workers[0].execute(so_f))
        out_r = ref.update_from_output(so_r, workers[1].execute(so_r))
        assert out_f.outputs == out_r.outputs, f"step {step}: core outputs differ"
        for o in out_f.outputs:
            if o.finished:
                live.remove(o.request_id)
        check_pool(fast)
        assert list(fast.kv.pool._free) == list(ref.kv.pool._free)
        assert {h: b.block_id for h, b in fast.kv.pool.cached.items()} == {
            h: b.block_id for h, b in ref.kv.pool.cached.items()
        }
    assert hits > 0, "the fast path was never taken"


def test_stop_precheck_never_misses() -> None:
    """Below stop_len, a token outside stop_token_set never stops a request (whatever min_tokens)."""
    s = _scheduler(200, 64, False, general=False)
    rng = random.Random(0)
    for i in range(200):
        max_tokens = rng.randrange(1, 20)
        sp = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=rng.random() < 0.3,
            stop_token_ids=[rng.randrange(50) for _ in range(rng.randrange(3))] or None,
            min_tokens=min(rng.randrange(0, 4), max_tokens),
        )
        sp.eos_token_id = rng.choice([None, rng.randrange(50)])
        s.add_request(EngineCoreRequest(f"q{i}", [1] * rng.randrange(1, 60), sp, 0.0))
        req = s.requests[f"q{i}"]
        for _ in range(40):
            tok = rng.randrange(50)
            req.append_output_token_ids([tok])
            may_stop = len(req.all_token_ids) >= req.stop_len or tok in req.stop_token_set
            status = req.status
            if check_stop(req, tok, s.max_model_len):
                assert may_stop
                break
            req.status = status


def _core_out(rid: str, toks: list[int], finish: FinishReason | None = None, cached: int = 0) -> EngineCoreOutput:
    return EngineCoreOutput(rid, toks, finish, None, cached)


@pytest.mark.parametrize("log_stats", [True, False])
def test_output_processor_quiet_path_matches_general(log_stats: bool) -> None:
    kinds = [
        RequestOutputKind.FINAL_ONLY,
        RequestOutputKind.FINAL_ONLY,
        RequestOutputKind.CUMULATIVE,
        RequestOutputKind.DELTA,
    ]
    procs = [OutputProcessor(None, log_stats=log_stats) for _ in range(2)]
    for i, kind in enumerate(kinds * 3):
        sp = SamplingParams(max_tokens=50, detokenize=False, output_kind=kind)
        req = EngineCoreRequest(f"r{i}", [1, 2, 3 + i], sp, arrival_time=1.0)
        for p in procs:
            p.add_request(req, None)
    for st in procs[1].request_states.values():
        st.quiet = False  # the reference: the general path for everyone
    assert any(st.quiet for st in procs[0].request_states.values())
    rng = random.Random(1)
    live = list(procs[0].request_states)
    for step in range(30):
        outs = []
        for rid in list(live):
            r = rng.random()
            finish = FinishReason.LENGTH if r < 0.08 else None
            toks = [] if r > 0.9 else [rng.randrange(100) for _ in range(rng.choice([1, 1, 1, 2]))]
            outs.append(_core_out(rid, toks, finish, cached=rng.choice([0, 0, 16])))
            if finish is not None:
                live.remove(rid)
        now = 10.0 + step
        a, b = (p.process_outputs(list(outs), now) for p in procs)
        assert a.request_outputs == b.request_outputs
        assert a.reqs_to_abort == b.reqs_to_abort
        assert a.iteration_stats == b.iteration_stats
    for rid, st in procs[0].request_states.items():
        ref = procs[1].request_states[rid]
        assert st.metrics == ref.metrics and st.detokenizer.token_ids == ref.detokenizer.token_ids
        assert st.num_cached_tokens == ref.num_cached_tokens


# ---- model runner: cached order / row lists / by-row append vs. rebuilt every step --------------------

RUNNER_SPS = [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=5, max_tokens=21, top_p=0.9),
    SamplingParams(temperature=0.7, seed=11, max_tokens=18, min_tokens=6, stop_token_ids=[3, 7, 11]),
    SamplingParams(temperature=1.0, seed=2, max_tokens=15, logprobs=2),
    SamplingParams(temperature=0.8, seed=9, max_tokens=20, repetition_penalty=1.2, n=2),
    SamplingParams(temperature=0.6, max_tokens=17, top_k=5, seed=4, output_kind=RequestOutputKind.FINAL_ONLY),
]


def _dummy_llm(async_scheduling: bool, **kw: object):  # noqa: ANN202
    from pagedllm import LLM
    from pagedllm.benchmarks.workloads import load_workloads_module

    cfg_dir = load_workloads_module().MODELS["qwen3-0.6b"]
    return LLM(
        cfg_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
        device="cpu",
        max_model_len=256,
        kv_cache_memory_bytes=64 << 20,
        hf_overrides={"num_hidden_layers": 1},
        async_scheduling=async_scheduling,
        max_num_batched_tokens=96,
        seed=0,
        **kw,
    )


def _generate(llm, prompts: list[list[int]]) -> list:  # noqa: ANN001
    from pagedllm import TokensPrompt

    results = []
    for sp in RUNNER_SPS:
        sp.detokenize = False
        res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        results.append(
            [
                [
                    (
                        list(c.token_ids),
                        c.finish_reason,
                        None if c.logprobs is None else [sorted(d.items()) for d in c.logprobs],
                    )
                    for c in o.outputs
                ]
                for o in res
            ]
        )
    return results


@pytest.mark.parametrize(
    "async_scheduling",
    [pytest.param(False, marks=pytest.mark.slow), pytest.param(True, marks=pytest.mark.slow)],
    ids=["sync", "async"],
)  # CI time: slow-marked, run by hand (pytest -m slow)
def test_model_runner_caches_match_rebuild(async_scheduling: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.worker.model_runner import ModelRunner
    from pagedllm.worker.sampling_batch import SamplingBatch
    from pagedllm.worker.step_inputs import StepInputBuilder

    rng = random.Random(3)
    prompts = [[rng.randrange(1, 1000) for _ in range(rng.randrange(3, 60))] for _ in range(12)]
    stats = {"order_hits": 0, "rows_hits": 0, "finish_fast": 0, "states_hits": 0}
    same_ids = [0]
    orig_order, orig_rows = StepInputBuilder._request_order, SamplingBatch.row_lists
    orig_finish, orig_states = ModelRunner.finish_step, ModelRunner._update_states

    def counting_states(self, so):  # noqa: ANN001, ANN202
        before = self.updater._rows_memo
        out = orig_states(self, so)
        stats["states_hits"] += self.updater._rows_memo is before and before is not None
        if async_scheduling:  # the in-flight index and the patch shortcut can reuse the last step's ids
            fl = self.in_flight
            same_ids[0] += fl._sampled is not None and fl._ids == list(so.num_scheduled_tokens)
        return out

    def counting_order(self, so):  # noqa: ANN001, ANN202
        before = self._order
        out = orig_order(self, so)
        stats["order_hits"] += self._order is before and before is not None
        return out

    def counting_rows(self, rows):  # noqa: ANN001, ANN202
        before = self.last
        out = orig_rows(self, rows)
        stats["rows_hits"] += out is before
        return out

    def counting_finish(self, step):  # noqa: ANN001, ANN202
        batch = self.input_batch
        stats["finish_fast"] += step.sample_outputs is not None and step.batch_version == batch.version
        return orig_finish(self, step)

    monkeypatch.setattr(StepInputBuilder, "_request_order", counting_order)
    monkeypatch.setattr(SamplingBatch, "row_lists", counting_rows)
    monkeypatch.setattr(ModelRunner, "finish_step", counting_finish)
    monkeypatch.setattr(ModelRunner, "_update_states", counting_states)
    fast = _generate(_dummy_llm(async_scheduling), prompts)
    assert min(stats.values()) > 20, stats  # the cached paths really ran
    assert same_ids[0] > 10 or not async_scheduling, same_ids  # (steps of the sampling params without penalties)

    def rebuild_order(self, so):  # noqa: ANN001, ANN202
        self._order = None
        return orig_order(self, so)

    def rebuild_rows(self, rows):  # noqa: ANN001, ANN202
        self.last = None
        return orig_rows(self, rows)

    def rebuild_states(self, so):  # noqa: ANN001, ANN202
        self.updater._rows_memo = None
        self.in_flight._ids = ["(none)"]  # no in-flight index reuse, no patch shortcut: the general paths
        return orig_states(self, so)

    def general_finish(self, step):  # noqa: ANN001, ANN202
        step.sample_outputs = None
        return orig_finish(self, step)

    monkeypatch.setattr(StepInputBuilder, "_request_order", rebuild_order)
    monkeypatch.setattr(SamplingBatch, "row_lists", rebuild_rows)
    monkeypatch.setattr(ModelRunner, "finish_step", general_finish)
    monkeypatch.setattr(ModelRunner, "_update_states", rebuild_states)
    ref = _generate(_dummy_llm(async_scheduling), prompts)
    for sp, a, b in zip(RUNNER_SPS, fast, ref):
        assert a == b, f"outputs differ for {sp}"


@pytest.mark.parametrize("multi", [False, True], ids=["one-block", "mixed"])
def test_append_block_ids_rows_matches_per_row(multi: bool) -> None:
    from pagedllm.worker.input_batch import InputBatch

    rng = random.Random(4)
    batches = [InputBatch(8, 64, 16, 2) for _ in range(2)]
    for b in batches:
        b.num_blocks[:, :] = [[rng.randrange(5) for _ in range(8)] for _ in range(2)] if b is batches[0] else 0
    batches[1].num_blocks[:, :] = batches[0].num_blocks
    rows = [5, 1, 6, 2]
    new = [
        tuple([rng.randrange(100) for _ in range(rng.choice([1, 2]) if multi else 1)] for _ in range(2)) for _ in rows
    ]
    batches[0].append_block_ids_rows(rows, new)
    for row, ids in zip(rows, new):
        batches[1].append_block_ids(row, ids)
    assert (batches[0].num_blocks == batches[1].num_blocks).all()
    for g in range(2):
        assert (batches[0].block_tables[g] == batches[1].block_tables[g]).all()


def _forced_general(result: ModelRunnerOutput) -> ModelRunnerOutput:
    """The same result with an all-None logprobs list: update_from_output then takes its general loop."""
    return ModelRunnerOutput(result.req_ids, result.sampled_token_ids, [None] * len(result.req_ids))


def _req_state(s: Scheduler) -> dict:
    return {
        rid: (
            r.status,
            list(r.output_token_ids),
            list(r.all_token_ids),
            list(r.block_hashes),
            r.stop_reason,
            r.num_output_placeholders,
        )
        for rid, r in s.requests.items()
    }


@pytest.mark.parametrize("seed", range(6))
def test_update_plain_matches_general_loop(seed: int) -> None:
    """update_from_output without a logprobs list against the same step with an all-None list: the same core
    outputs, request states, block hashes and pool, over EOS / stop tokens / min_tokens / max_tokens /
    max_model_len stops, aborts and prefix-cache sharing."""
    rng = random.Random(100 + seed)
    caching = seed % 2 == 0
    plain = _scheduler(60, rng.choice([8, 64]), caching, general=False)
    ref = _scheduler(60, plain.config.max_num_batched_tokens, caching, general=False)
    workers = (FakeWorker(), FakeWorker())
    live: list[str] = []
    taken = 0
    for step in range(200):
        if rng.random() < 0.3 and len(live) < 12:
            rid = f"r{step}"
            prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
            max_tokens = rng.randrange(1, 80)
            kind = rng.randrange(3)
            sp = SamplingParams(
                max_tokens=max_tokens,
                ignore_eos=kind == 0,
                stop_token_ids=[rng.randrange(1000) for _ in range(40)] if kind == 1 else None,
                min_tokens=min(rng.randrange(0, 6), max_tokens) if kind == 2 else 0,
            )
            sp.eos_token_id = rng.randrange(1000) if kind != 0 else None
            if kind == 2:
                sp.all_stop_token_ids = [sp.eos_token_id]
            for s in (plain, ref):
                s.add_request(EngineCoreRequest(rid, list(prompt), sp, float(step)))
            live.append(rid)
        elif rng.random() < 0.05 and live:
            rid = rng.choice(live)
            for s in (plain, ref):
                s.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            live.remove(rid)
        so_p, so_r = plain.schedule(), ref.schedule()
        assert so_p == so_r
        res_p = workers[0].execute(so_p)
        res_r = workers[1].execute(so_r)
        taken += sum(1 for t in res_p.sampled_token_ids if t)
        out_p = plain.update_from_output(so_p, res_p)
        out_r = ref.update_from_output(so_r, _forced_general(res_r))
        assert out_p.outputs == out_r.outputs, f"step {step}"
        assert _req_state(plain) == _req_state(ref)
        assert [r.request_id for r in plain.running] == [r.request_id for r in ref.running]
        for o in out_p.outputs:
            if o.finished:
                live.remove(o.request_id)
        assert {h: b.block_id for h, b in plain.kv.pool.cached.items()} == {
            h: b.block_id for h, b in ref.kv.pool.cached.items()
        }
    assert taken > 100


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_update_plain_multi_token_and_preempted(async_scheduling: bool) -> None:
    """update_from_output with and without a logprobs list: several tokens for one request (one of them
    a stop token), and (async scheduling) a request preempted while its token was in flight."""
    results = []
    for general in (False, True):
        s = _scheduler(60, 64, True, general=False)
        s.async_scheduling = async_scheduling
        for i in range(3):
            sp = SamplingParams(max_tokens=20, stop_token_ids=[77])
            s.add_request(EngineCoreRequest(f"m{i}", list(range(10 + i)), sp, float(i)))
        so = s.schedule()
        assert len(so.num_scheduled_tokens) == 3
        victim = s.requests["m2"]
        s._preempt(victim)
        res = ModelRunnerOutput(["m0", "m1", "m2"], [[5, 6, 7], [8, 77, 9], [11]])
        out = s.update_from_output(so, _forced_general(res) if general else res)
        results.append((out.outputs, _req_state(s), [r.request_id for r in s.running], len(s.waiting)))
    assert results[0] == results[1]
    outs = {o.request_id: o for o in results[0][0]}
    assert outs["m0"].new_token_ids == [5, 6, 7] and outs["m1"].new_token_ids == [8, 77]
    assert outs["m1"].finish_reason == FinishReason.STOP and outs["m1"].stop_reason == 77
    assert ("m2" in outs) == async_scheduling


@pytest.mark.parametrize("seed", range(4))
def test_append_tokens_matches_per_row(seed: int) -> None:
    """InputBatch.append_tokens (one indexed write when every row has room, else masked) against
    per-row appends that drop tokens past max_model_len."""
    from pagedllm.worker.input_batch import InputBatch

    rng = np.random.default_rng(seed)
    batch = InputBatch(16, 32, 4, 1)
    ref_tokens = np.zeros((16, 32), dtype=np.int64)
    ref_n = np.zeros(16, dtype=np.int64)
    for _ in range(100):
        rows = rng.permutation(16)[: rng.integers(0, 17)].astype(np.int64)
        toks = rng.integers(0, 1000, len(rows)).astype(np.int64)
        batch.append_tokens(rows, toks)
        for r, t in zip(rows.tolist(), toks.tolist()):
            if ref_n[r] < 32:
                ref_tokens[r, ref_n[r]] = t
            ref_n[r] += 1
        assert np.array_equal(batch.num_tokens, ref_n) and np.array_equal(batch.token_ids, ref_tokens)
    assert ref_n.max() > 32  # the masked path ran too


@pytest.mark.parametrize("seed", range(4))
def test_scheduler_fast_loop_async_ahead(seed: int) -> None:
    """Async scheduling with each step scheduled before the previous one's tokens are back (the engine's
    pattern): the fast running loop (pending tokens in flight, stop_len test) against the general loop
    (a scheduler whose kv_fast_limit stays 0, so the fast loop never records), step by step."""
    rng = random.Random(200 + seed)
    caching = seed % 2 == 0
    fast = _scheduler(80, rng.choice([16, 64]), caching, general=False)
    ref = _scheduler(80, fast.config.max_num_batched_tokens, caching, general=True)
    for s in (fast, ref):
        s.async_scheduling = True
    pending_so: list = []
    scheduled_with_pending = 0
    for step in range(150):
        if rng.random() < 0.3 and len(fast.requests) < 10:
            rid = f"a{step}"
            prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
            # Short max_tokens and long prompts reach max_tokens / max_model_len (96) with a token in flight.
            sp = SamplingParams(max_tokens=rng.randrange(1, 70), ignore_eos=True)
            for s in (fast, ref):
                s.add_request(EngineCoreRequest(rid, list(prompt), sp, float(step)))
        before = {r.request_id: r.num_output_placeholders for r in fast.running}
        scheduled_with_pending += sum(1 for p in before.values() if p)
        so_f, so_r = fast.schedule(), ref.schedule()
        assert so_f == so_r, f"step {step}"
        assert [(r.request_id, r.num_computed_tokens, r.num_output_placeholders) for r in fast.running] == [
            (r.request_id, r.num_computed_tokens, r.num_output_placeholders) for r in ref.running
        ]
        # The requests this step samples for: those whose placeholders went up.
        samples = [
            rid for rid in so_f.num_scheduled_tokens if fast.requests[rid].num_output_placeholders > before.get(rid, 0)
        ]
        pending_so.append((so_f, so_r, samples, step))
        if len(pending_so) == 2 or step == 149:
            so_f0, so_r0, samples0, step0 = pending_so.pop(0)
            ids = list(so_f0.num_scheduled_tokens)
            toks = [[(hash(rid) + step0) % 1000] if rid in samples0 else [] for rid in ids]
            out_f = fast.update_from_output(so_f0, ModelRunnerOutput(ids, toks))
            out_r = ref.update_from_output(so_r0, ModelRunnerOutput(ids, [list(t) for t in toks]))
            assert out_f.outputs == out_r.outputs
    assert scheduled_with_pending > 20
