"""Async scheduling (the next step scheduled and launched before the current one's tokens are read) gives
exactly the outputs of synchronous scheduling: greedy, seeded sampling, n > 1, stop tokens, max_tokens,
penalties (which force synchronous steps), and under preemption; and it really schedules ahead."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.conftest import PROMPTS

SPS = [
    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=7, max_tokens=33),
    SamplingParams(temperature=1.0, seed=3, max_tokens=25, n=3),
    SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[13]),
    SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3),  # sync steps
]


def _run(path: str, async_scheduling: bool, **kw: object) -> tuple[list, LLM]:
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=256 << 20,
        async_scheduling=async_scheduling,
        **kw,
    )
    outs = []
    for sp in SPS:
        res = llm.generate(PROMPTS[:10], sp, use_tqdm=False)
        outs.append([([list(c.token_ids) for c in o.outputs], [c.finish_reason for c in o.outputs]) for o in res])
    return outs, llm


@pytest.mark.parametrize(
    "blocks", [pytest.param(None, marks=pytest.mark.slow), 40], ids=["roomy", "preempting"]
)  # CI time: slow-marked, run by hand (pytest -m slow)
def test_async_equals_sync(smollm2_path: str, blocks: int | None) -> None:
    kw = {} if blocks is None else {"num_gpu_blocks_override": blocks, "schedule_conservativeness": 0.0}
    sync_outs, _ = _run(smollm2_path, False, **kw)
    async_outs, llm = _run(smollm2_path, True, **kw)
    for sp, a, b in zip(SPS, sync_outs, async_outs):
        assert a == b, f"outputs differ for {sp}"
    core = llm.llm_engine.engine_core.engine_core
    assert core.num_steps_ahead > 50  # steps really were launched ahead
    if blocks is not None:
        assert core.scheduler.num_preemptions > 0
    core.step()  # drain a step still in flight
    assert not core.has_unfinished_requests()
    assert core.scheduler.kv.pool.num_free_blocks == core.scheduler.kv.pool.num_blocks - 1  # all free again
