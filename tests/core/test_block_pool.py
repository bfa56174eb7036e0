"""Block-pool and scheduler invariants under a seeded random fuzz of add / step / abort / finish /
preempt, with a fake worker that "samples" deterministic tokens (no model needed)."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_pool import BlockPool
from pagedllm.core.kv_cache_utils import KVCacheGroup, KVCacheSpec
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.messages import EngineCoreRequest
from pagedllm.sampling_params import SamplingParams


class FakeWorker:
    """Tracks what the worker side would know and checks the scheduler's diffs are consistent."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.tokens.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        for rid, nc in zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens):
            self.computed[rid] = nc
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            n = so.num_scheduled_tokens[rid]
            self.computed[rid] += n
            assert self.computed[rid] <= len(self.tokens[rid])
            if self.computed[rid] == len(self.tokens[rid]):
                tok = (sum(self.tokens[rid][-3:]) * 31 + 7) % 1000
                self.tokens[rid].append(tok)
                sampled.append([tok])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids, sampled)


def make_scheduler(num_blocks: int, policy: str = "fcfs", budget: int = 64, caching: bool = True) -> Scheduler:
    spec = KVCacheSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32)
    cfg = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=96, enable_chunked_prefill=True, policy=policy
    )  # type: ignore[arg-type]
    return Scheduler(cfg, [KVCacheGroup(["l0"], spec)], num_blocks, caching)


def check_pool(s: Scheduler) -> None:
    pool: BlockPool = s.kv.pool
    pool.check_invariants()
    held: dict[int, int] = {}
    for m in s.kv.managers:
        for blocks in m.req_blocks.values():
            for b in blocks:
                if b is not pool.null_block:
                    held[b.block_id] = held.get(b.block_id, 0) + 1
    for b in pool.blocks[1:]:
        assert b.ref_cnt == held.get(b.block_id, 0), (b, held.get(b.block_id))


@pytest.mark.parametrize("seed", range(12))
def test_block_pool_fuzz(seed: int) -> None:
    rng = random.Random(seed)
    policy = "priority" if seed % 3 == 0 else "fcfs"
    s = make_scheduler(
        num_blocks=rng.choice([26, 30, 40, 80]), policy=policy, budget=rng.choice([8, 16, 64]), caching=seed % 2 == 0
    )
    w = FakeWorker()
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    live: list[str] = []
    finished: set[str] = set()
    for step in range(300):
        op = rng.random()
        if op < 0.25 and len(live) < 20:
            rid = f"r{step}"
            prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
            sp = SamplingParams(max_tokens=rng.randrange(1, 40), ignore_eos=True)
            s.add_request(EngineCoreRequest(rid, prompt, sp, float(step), priority=rng.randrange(3)))
            live.append(rid)
        elif op < 0.32 and live:
            rid = rng.choice(live)
            from pagedllm.core.request import RequestStatus

            s.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            live.remove(rid)
        so = s.schedule()
        assert so.total_num_scheduled_tokens <= s.config.max_num_batched_tokens
        out = s.update_from_output(so, w.execute(so))
        for o in out.outputs:
            if o.finished:
                live.remove(o.request_id)
                finished.add(o.request_id)
        check_pool(s)
    # Drain.
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        s.update_from_output(so, w.execute(so))
        check_pool(s)
    assert not s.has_unfinished_requests()
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks - 1, "blocks leaked"
    assert finished


def test_preemption_happens_and_recovers() -> None:
    s = make_scheduler(num_blocks=14, budget=64)
    w = FakeWorker()
    for i in range(4):
        s.add_request(
            EngineCoreRequest(
                f"r{i}", list(range(i * 10, i * 10 + 10)), SamplingParams(max_tokens=30, ignore_eos=True), float(i)
            )
        )
    outs: dict[str, list[int]] = {}
    while s.has_unfinished_requests():
        so = s.schedule()
        for o in s.update_from_output(so, w.execute(so)).outputs:
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        check_pool(s)
    assert s.num_preemptions > 0
    assert all(len(v) == 30 for v in outs.values())
    assert s.kv.pool.num_free_blocks == 13


def test_prefix_blocks_shared_in_same_step() -> None:
    s = make_scheduler(num_blocks=40, budget=256)
    w = FakeWorker()
    prompt = list(range(100, 121))  # 21 tokens: 5 full blocks
    s.add_request(EngineCoreRequest("a", prompt, SamplingParams(max_tokens=2), 0.0))
    s.add_request(EngineCoreRequest("b", prompt + [5], SamplingParams(max_tokens=2), 1.0))
    so = s.schedule()
    a_blocks = s.kv.get_block_ids("a")[0]
    b_blocks = s.kv.get_block_ids("b")[0]
    assert a_blocks[:5] == b_blocks[:5]
    assert so.num_scheduled_tokens["b"] == 2  # 20 tokens hit, 2 computed
    s.update_from_output(so, w.execute(so))
    assert s.kv.prefix_cache_hits == 20


def test_reset_prefix_cache_only_when_idle() -> None:
    s = make_scheduler(num_blocks=40)
    w = FakeWorker()
    s.add_request(EngineCoreRequest("a", list(range(12)), SamplingParams(max_tokens=3), 0.0))
    so = s.schedule()
    assert not s.reset_prefix_cache()
    while s.has_unfinished_requests():
        s.update_from_output(so, w.execute(so))
        so = s.schedule()
    assert s.kv.pool.cached
    assert s.reset_prefix_cache()
    assert not s.kv.pool.cached


def test_free_queue_reuses_written_blocks_first() -> None:
    """Freed blocks without a cached hash are taken before blocks never handed out (warm memory: the CPU cache
    is calloc'ed, so a first write page-faults), cached ones only after both (LRU, the prefix kept longest);
    after a prefix-cache reset the formerly cached blocks, holding nothing now, come first too."""
    pool = BlockPool(num_blocks=10, enable_caching=True)
    a = pool.get_new_blocks(4)  # ids 1-4
    pool.cache_block(a[0], b"h0")
    pool.cache_block(a[1], b"h1")
    pool.free_blocks(reversed(a))  # tail first: 4, 3 (uncached) to the front; 2, 1 (cached) to the end
    pool.check_invariants()
    assert pool.num_cached_free == 2
    assert [b.block_id for b in pool.get_new_blocks(3)] == [3, 4, 5]
    assert pool.get_cached_block(b"h1") is a[1]
    rest = pool.get_new_blocks(pool.num_free_blocks)
    assert [b.block_id for b in rest] == [6, 7, 8, 9, 2, 1]  # the cached ones last, the prefix (1) last of all
    assert not pool.cached and pool.num_cached_free == 0
    pool.free_blocks([pool.blocks[i] for i in range(1, 10)])
    b = pool.get_new_blocks(2)
    pool.cache_block(b[0], b"x")
    pool.cache_block(b[1], b"y")
    pool.free_blocks(b)  # cached: to the end
    assert pool.reset_prefix_cache()
    assert {blk.block_id for blk in pool.get_new_blocks(2)} == {blk.block_id for blk in b}
    pool.check_invariants()
