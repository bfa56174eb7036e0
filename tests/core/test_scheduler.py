"""The scheduler on its own (no model): token budget and chunked prefill, max_num_seqs, stop conditions,
preemption order, aborts, and async scheduling's in-flight placeholders."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedllm import EngineArgs
from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_utils import KVCacheGroup, KVCacheSpec
from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.messages import EngineCoreRequest, FinishReason
from pagedllm.sampling_params import SamplingParams
from tests.core.test_block_pool import FakeWorker, check_pool
from tests.utils_model import make_tiny_hf_model


def _sched(
    num_blocks: int = 64,
    budget: int = 16,
    max_seqs: int = 4,
    chunked: bool = True,
    policy: str = "fcfs",
    async_scheduling: bool = False,
    max_model_len: int = 96,
    idle_budget: int | None = None,
    conservativeness: float = 1.0,
) -> Scheduler:
    spec = KVCacheSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32)
    cfg = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        policy=policy,  # type: ignore[arg-type]
        async_scheduling=async_scheduling,
        idle_max_num_batched_tokens=idle_budget,
        schedule_conservativeness=conservativeness,
    )
    return Scheduler(cfg, [KVCacheGroup(["l0"], spec)], num_blocks, enable_prefix_caching=True)


def _add(s: Scheduler, rid: str, n_prompt: int, priority: int = 0, **kw: object) -> None:
    sp = SamplingParams(**kw)  # type: ignore[arg-type]
    base = 1000 * (len(s.requests) + 1)  # distinct prompts: no prefix-cache hits between requests
    s.add_request(EngineCoreRequest(rid, list(range(base, base + n_prompt)), sp, float(len(s.requests)), priority))


def _step(s: Scheduler, so: SchedulerOutput, tokens: dict[str, int]) -> dict[str, object]:
    """Feeds back one sampled token per request that completed its known tokens; returns outputs by id."""
    ids = list(so.num_scheduled_tokens)
    sampled = [[tokens[r]] if r in tokens else [] for r in ids]
    out = s.update_from_output(so, ModelRunnerOutput(ids, sampled))
    return {o.request_id: o for o in out.outputs}


def test_budget_chunks_a_long_prompt_and_decodes_go_first() -> None:
    s = _sched(budget=16)
    _add(s, "a", 5, max_tokens=8)
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 5}
    _step(s, so, {"a": 1})
    _add(s, "long", 40, max_tokens=4)
    so = s.schedule()
    # The running decode first (1 token), then the new prompt's first chunk fills the rest of the budget.
    assert so.num_scheduled_tokens == {"a": 1, "long": 15}
    assert so.total_num_scheduled_tokens == 16
    _step(s, so, {"a": 2})
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 1, "long": 15}
    assert [c for c in so.scheduled_cached_reqs.num_computed_tokens] == [6, 15]


def test_idle_budget_only_while_nothing_decodes() -> None:
    """`idle_max_num_batched_tokens`: prompts alone go in chunks of the idle budget; once a request decodes,
    every step keeps to max_num_batched_tokens (a new prompt's chunk beside it too)."""
    s = _sched(budget=16, idle_budget=40, max_model_len=200)
    _add(s, "long", 100, max_tokens=2)
    _add(s, "short", 5, max_tokens=8)
    assert s.step_budget() == 40
    so = s.schedule()
    assert so.num_scheduled_tokens == {"long": 40}  # FCFS: the head of the queue takes the whole budget
    _step(s, so, {})
    so = s.schedule()
    assert so.num_scheduled_tokens == {"long": 40}
    _step(s, so, {})
    so = s.schedule()
    assert so.num_scheduled_tokens == {"long": 20, "short": 5}  # "long"'s last chunk, then "short" fits
    _step(s, so, {"long": 1, "short": 1})
    assert s.step_budget() == 16  # both decode now
    _add(s, "next", 30, max_tokens=2)
    so = s.schedule()
    assert so.num_scheduled_tokens == {"long": 1, "short": 1, "next": 14}
    assert so.total_num_scheduled_tokens == 16


def test_idle_budget_defaults(tmp_path: Path) -> None:
    """The CPU default: steps of 256 tokens, 1,024 while nothing decodes; an explicit max_num_batched_tokens
    (or chunked prefill off) keeps one budget; an idle budget below the step budget is an error."""
    make_tiny_hf_model("llama", tmp_path)

    def budgets(**kw: object) -> tuple[int, int | None]:
        args = EngineArgs(str(tmp_path), device="cpu", max_model_len=200, **kw)  # type: ignore[arg-type]
        sc = args.create_engine_config().scheduler_config
        return sc.max_num_batched_tokens, sc.idle_max_num_batched_tokens

    assert budgets() == (256, 1024)
    assert budgets(max_num_batched_tokens=64) == (64, None)
    assert budgets(max_num_batched_tokens=64, idle_max_num_batched_tokens=512) == (64, 512)
    assert budgets(enable_chunked_prefill=False) == (256, None)
    with pytest.raises(ValueError, match="idle_max_num_batched_tokens: must be at least"):
        budgets(max_num_batched_tokens=64, idle_max_num_batched_tokens=32)


def test_without_chunked_prefill_a_prompt_over_the_budget_waits() -> None:
    s = _sched(budget=16, chunked=False, max_model_len=64)
    _add(s, "big", 20, max_tokens=2)
    _add(s, "small", 4, max_tokens=2)
    so = s.schedule()
    assert so.num_scheduled_tokens == {}  # FCFS: the head of the queue does not fit, nothing jumps it
    assert len(s.waiting) == 2


def test_max_num_seqs_limits_running() -> None:
    s = _sched(budget=64, max_seqs=2)
    for i in range(4):
        _add(s, f"r{i}", 3, max_tokens=4)
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["r0", "r1"]
    assert len(s.running) == 2 and len(s.waiting) == 2


@pytest.mark.parametrize(
    ("kw", "tokens", "reason", "stop_reason", "n_out"),
    [
        ({"max_tokens": 10}, [7, 2, 9], FinishReason.STOP, None, 2),  # eos (id 2)
        ({"max_tokens": 10, "ignore_eos": True}, [2, 2, 2], None, None, 3),
        ({"max_tokens": 10, "min_tokens": 3}, [2, 2, 2, 5], FinishReason.STOP, None, 3),
        ({"max_tokens": 10, "stop_token_ids": [9]}, [7, 9, 1], FinishReason.STOP, 9, 2),
        ({"max_tokens": 2}, [7, 8, 9], FinishReason.LENGTH, None, 2),
    ],
)
def test_stop_conditions(
    kw: dict, tokens: list[int], reason: FinishReason | None, stop_reason: int | None, n_out: int
) -> None:
    s = _sched()
    sp = SamplingParams(**kw)
    sp.eos_token_id = 2
    s.add_request(EngineCoreRequest("r", [100, 101, 102], sp, 0.0))
    outs = []
    for tok in tokens:
        so = s.schedule()
        if not so.num_scheduled_tokens:
            break
        out = _step(s, so, {"r": tok})["r"]
        outs.append(out)
        if out.finished:
            break
    assert sum(len(o.new_token_ids) for o in outs) == n_out
    assert outs[-1].finish_reason == reason
    if reason is not None:
        assert outs[-1].stop_reason == stop_reason
        assert "r" not in s.requests and not s.running
        assert s.kv.usage == 0.0


def test_max_model_len_caps_generation() -> None:
    s = _sched(max_model_len=8)
    _add(s, "r", 6, max_tokens=100)
    reasons = []
    for _ in range(5):
        so = s.schedule()
        if not so.num_scheduled_tokens:
            break
        reasons.append(_step(s, so, {"r": 5})["r"].finish_reason)
    assert reasons == [None, FinishReason.LENGTH]  # 6 prompt + 2 output = max_model_len


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_picks_the_lowest_ranked(policy: str) -> None:
    # 5 usable blocks of 4 tokens: three 6-token prompts take 2 blocks each once decoding past 8 tokens.
    s = _sched(num_blocks=7, budget=64, max_seqs=3, policy=policy, conservativeness=0.0)  # admit all: preempt
    _add(s, "a", 6, priority=5, max_tokens=20)
    _add(s, "b", 6, priority=0, max_tokens=20)
    _add(s, "c", 6, priority=1, max_tokens=20)
    w = FakeWorker()
    preempted: list[str] = []
    for _ in range(10):
        so = s.schedule()
        preempted += sorted(so.preempted_req_ids)
        s.update_from_output(so, w.execute(so))
        check_pool(s)
        if preempted:
            break
    # FCFS: the latest arrival (c); priority: the highest priority value (a).
    assert preempted[0] == ("c" if policy == "fcfs" else "a")
    victim = s.requests[preempted[0]]
    assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0


def test_abort_frees_and_is_reported_to_the_worker() -> None:
    s = _sched()
    _add(s, "a", 5, max_tokens=8)
    _add(s, "b", 5, max_tokens=8)
    so = s.schedule()
    _step(s, so, {"a": 1, "b": 1})
    done = s.finish_requests(["a", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == ["a"]
    so = s.schedule()
    assert "a" in so.finished_req_ids and list(so.num_scheduled_tokens) == ["b"]
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests() and s.kv.usage == 0.0


def test_async_placeholders_do_not_overschedule() -> None:
    """With async scheduling the next step is scheduled before the last token is known: a request whose
    final token is already in flight is not scheduled again, and placeholders are settled by the output."""
    s = _sched(async_scheduling=True)
    _add(s, "r", 4, max_tokens=2)
    so1 = s.schedule()  # prefill; samples output 1 (in flight)
    assert s.requests["r"].num_output_placeholders == 1
    so2 = s.schedule()  # decode on the in-flight token; samples output 2, the last
    assert so2.num_scheduled_tokens == {"r": 1}
    assert s.requests["r"].num_output_placeholders == 2
    assert s.schedule().num_scheduled_tokens == {}  # its last token is in flight: nothing more to schedule
    _step(s, so1, {"r": 7})
    assert s.requests["r"].num_output_placeholders == 1
    out = _step(s, so2, {"r": 8})["r"]
    assert out.finish_reason == FinishReason.LENGTH and "r" not in s.requests


def _run(s: Scheduler, steps: int = 400) -> tuple[int, int]:
    """Runs the scheduler to completion with a fake worker: (tokens scheduled, preemptions)."""
    w = FakeWorker()
    tokens = 0
    for _ in range(steps):
        if not (s.running or len(s.waiting)):
            break
        so = s.schedule()
        tokens += so.total_num_scheduled_tokens
        s.update_from_output(so, w.execute(so))
        check_pool(s)
    assert not s.requests, "every request finishes"
    return tokens, s.num_preemptions


@pytest.mark.parametrize("conservativeness", [0.0, 1.0])
def test_admission_reserve_saves_the_recomputed_prefills(conservativeness: float) -> None:
    """W2 in small (core/admission.py): twelve 16-token prompts of 8 outputs each, a pool for ~8 of them. Admitting
    while prompts fit (vLLM, conservativeness 0) preempts once decodes grow and recomputes those prefills;
    keeping back the running requests' growth computes every token once."""
    s = _sched(num_blocks=33, budget=64, max_seqs=16, max_model_len=64, conservativeness=conservativeness)
    for i in range(12):
        _add(s, f"r{i}", 16, max_tokens=8, ignore_eos=True)
    tokens, preemptions = _run(s)
    ideal = 12 * (16 + 8 - 1)
    if conservativeness:
        assert (tokens, preemptions) == (ideal, 0)
    else:
        assert preemptions > 0 and tokens > ideal


def test_admission_reserve_never_holds_back_the_only_request() -> None:
    s = _sched(num_blocks=9, budget=64, max_seqs=4, max_model_len=64)
    _add(s, "a", 20, max_tokens=40, ignore_eos=True)  # its growth alone is more than the pool's 8 blocks
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 20}
    _add(s, "b", 4, max_tokens=4, ignore_eos=True)
    s.update_from_output(so, FakeWorker().execute(so))
    assert "b" not in s.schedule().num_scheduled_tokens  # a's growth keeps b waiting


def test_admission_reserve_counts_the_horizon_and_the_known_tokens() -> None:
    from pagedllm.core.admission import HORIZON, AdmissionReserve

    s = _sched(num_blocks=400, budget=8, max_seqs=4, max_model_len=1024)
    _add(s, "long", 20, max_tokens=900, ignore_eos=True)
    _add(s, "short", 4, max_tokens=8, ignore_eos=True)
    s.schedule()  # long's first 8 prompt tokens: 12 known tokens to go, then HORIZON outputs
    long, short = s.requests["long"], s.requests["short"]
    assert s.admission.blocks([long]) == (12 + HORIZON) // 4
    assert s.admission.blocks([short]) == (4 + 8) // 4  # max_tokens ends before the horizon
    assert AdmissionReserve(0.5, 4).blocks([long]) == (12 + HORIZON // 2) // 4
    assert not AdmissionReserve(0.0, 4).enabled
    with pytest.raises(ValueError, match="schedule_conservativeness"):
        AdmissionReserve(-1.0, 16)
