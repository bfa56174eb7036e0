"""Acceptance 4: a tensor-parallel worker killed mid-generation fails every in-flight request with an error
naming its rank within 10 s, and leaves no process behind (checked by listing children)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest

from pagedllm import LLM, EngineArgs, SamplingParams, TokensPrompt
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.executor.multiproc_executor import WorkerDiedError
from tests.executor.parallel_utils import tiny_prompts
from tests.utils_model import make_tiny_hf_model

FAIL_WITHIN_S = 10.0
IDLE_NOTICE_S = 30.0
"""Idle: typically ~1 s; generous because this shared 2-core box can be very loaded."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("llama")
    make_tiny_hf_model("llama", path)
    return str(path)


def _engine_kwargs(checkpoint: str) -> dict:
    return {
        "model": checkpoint,
        "dtype": "float32",
        "skip_tokenizer_init": True,
        "max_model_len": 256,
        "kv_cache_memory_bytes": 8 << 20,
        "tensor_parallel_size": 2,
    }


def _workers_of(pid: int) -> list[psutil.Process]:
    """The spawned worker processes under `pid` (not multiprocessing's resource tracker)."""
    return [p for p in psutil.Process(pid).children() if "resource_tracker" not in " ".join(p.cmdline())]


def _gone(procs: list[psutil.Process]) -> bool:
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            continue
    return True


def test_offline_engine_fails_fast_naming_the_rank(checkpoint: str) -> None:
    llm = LLM(**_engine_kwargs(checkpoint))
    engine = llm.llm_engine
    workers = _workers_of(os.getpid())
    assert len(workers) == 2
    pids = llm.collective_rpc(lambda worker: os.getpid())
    sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, detokenize=False)
    for i, p in enumerate(tiny_prompts()):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), sp)
    engine.step()
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - t0 < FAIL_WITHIN_S
    assert _gone(workers), "the other worker was left running"
    with pytest.raises(WorkerDiedError, match="rank 1"):  # later calls fail at once, no hang
        llm.collective_rpc("determine_num_blocks")
    llm.llm_engine.engine_core.shutdown()
    assert not [p for p in _workers_of(os.getpid()) if p.pid in pids]


def test_async_engine_fails_in_flight_requests_and_exits(checkpoint: str) -> None:
    engine = AsyncLLM.from_engine_args(EngineArgs(**_engine_kwargs(checkpoint)))
    core = psutil.Process(engine.engine_core.proc.pid)
    workers = _workers_of(core.pid)
    assert len(workers) == 2
    sp = SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True, detokenize=False)
    killed_at: list[float] = []

    async def one(i: int, prompt: list[int], started: asyncio.Event) -> BaseException | None:
        try:
            async for _ in engine.generate(TokensPrompt(prompt_token_ids=prompt), sp, f"r{i}"):
                started.set()
        except Exception as e:
            return e
        return None

    async def main() -> list[BaseException | None]:
        events = [asyncio.Event() for _ in tiny_prompts()]
        tasks = [asyncio.create_task(one(i, p, ev)) for i, (p, ev) in enumerate(zip(tiny_prompts(), events))]
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in events)), 60)
        workers[-1].send_signal(signal.SIGKILL)
        killed_at.append(time.monotonic())
        return await asyncio.wait_for(asyncio.gather(*tasks), FAIL_WITHIN_S)

    try:
        errors = asyncio.run(main())
        elapsed = time.monotonic() - killed_at[0]
        assert all(e is not None for e in errors), "a request finished although a worker died mid-way"
        assert all("rank" in str(e) for e in errors), [str(e) for e in errors]
        assert elapsed < FAIL_WITHIN_S
        engine.engine_core.proc.join(FAIL_WITHIN_S)  # the core exits (non-zero) ...
        assert engine.engine_core.proc.exitcode not in (0, None)
        deadline = time.monotonic() + 5
        while not _gone(workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(workers), "a worker outlived the engine core"  # ... and takes its workers along
    finally:
        engine.shutdown()


def test_idle_async_engine_notices_a_dead_worker(checkpoint: str) -> None:
    """No request running: the executor's watcher still notices, the core exits, the front end is errored."""
    engine = AsyncLLM.from_engine_args(EngineArgs(**_engine_kwargs(checkpoint)))
    try:
        workers = _workers_of(engine.engine_core.proc.pid)
        assert len(workers) == 2

        async def main() -> None:
            engine.start()
            workers[0].send_signal(signal.SIGKILL)
            deadline = time.monotonic() + IDLE_NOTICE_S
            while not engine.errored and time.monotonic() < deadline:
                await asyncio.sleep(0.1)

        asyncio.run(main())
        assert engine.errored
        assert "rank" in str(engine.dead_error)
        deadline = time.monotonic() + 5
        while not _gone(workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(workers)
    finally:
        engine.shutdown()
