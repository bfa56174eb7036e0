"""Faults (issue 14, acceptance 3) that need their own server: KV-cache exhaustion. 100 long prompts
against a cache that holds a fraction of them: the scheduler preempts and recomputes, every request
finishes with its full output, equal (float32, greedy) to the same prompt run alone. (The engine core
killed: tests/entrypoints/openai/test_server_kill.py; a client socket reset mid-SSE: test_hostile.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from tests.entrypoints.openai.test_server import ServerProcess
from tests.stress.conftest import API_KEY, STRESS_FLAGS, auth, metric

NUM_BLOCKS = 96  # x 16 tokens: about 10 of the 100 prompts fit at once
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def small_kv_server() -> Iterator[ServerProcess]:
    flags = [f for f in STRESS_FLAGS if f != "--trust-request-chat-template"]
    extra = ["--num-gpu-blocks-override", str(NUM_BLOCKS), "--no-enable-prefix-caching", "--max-model-len", "512",
             "--schedule-conservativeness", "0"]  # fmt: skip
    with ServerProcess([*flags, *extra]) as srv:
        yield srv


@pytest.mark.slow
def test_kv_exhaustion_preempts_and_all_finish(small_kv_server: ServerProcess) -> None:
    assert API_KEY
    prompts = [f"Item {i}: " + "a list of many words about nothing in particular, " * 12 for i in range(100)]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=1800, limits=httpx.Limits(max_connections=200)) as c:
            body = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(
                *(
                    c.post(small_kv_server.url + "/v1/completions", headers=auth(), json={**body, "prompt": p})
                    for p in prompts
                )
            )

    results = asyncio.run(run())
    assert all(r.status_code == 200 for r in results), [r.text for r in results if r.status_code != 200][:2]
    assert all(r.json()["usage"]["completion_tokens"] == MAX_TOKENS for r in results)
    assert metric(small_kv_server, "num_preemptions_total") > 0
    for i in (0, 57, 99):  # alone (nothing to preempt it) the same greedy text
        alone = httpx.post(
            small_kv_server.url + "/v1/completions",
            headers=auth(),
            json={"prompt": prompts[i], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
            timeout=600,
        )
        assert alone.json()["choices"][0]["text"] == results[i].json()["choices"][0]["text"]
    assert metric(small_kv_server, "num_requests_running") == 0
    assert metric(small_kv_server, "kv_cache_usage_perc") == 0
