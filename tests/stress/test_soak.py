"""Soak (issue 14, acceptance 1): many concurrent greedy streams, a fifth of the clients disconnecting at
random points. 0 5xx; every surviving stream complete and equal to the non-streamed result of its prompt;
afterwards nothing running, every KV block free (from /metrics: kv_cache_usage_perc back to its idle
value, i.e. only the prefix cache's evictable blocks, which the scheduler counts free), the server's RSS
within 10%. The CI smoke runs 100 streams; the slow version 1,000."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from tests.entrypoints.openai.test_server import ServerProcess
from tests.stress.conftest import auth, metric, rss_bytes

PROMPTS = [f"Write a word about the number {i}:" for i in range(8)]
MAX_TOKENS = 6


async def _reference(client: httpx.AsyncClient, url: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for p in PROMPTS:
        r = await client.post(
            url + "/v1/completions", headers=auth(), json={"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}
        )
        assert r.status_code == 200, r.text
        out[p] = r.json()["choices"][0]["text"]
    return out


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, drop_after: int | None) -> tuple[int, str, bool]:
    """(status, text, finished); `drop_after` chunks then disconnect (None: read to the end)."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text, finished, chunks = "", False, 0
    async with client.stream("POST", url + "/v1/completions", headers=auth(), json=body) as r:
        if r.status_code != 200:
            return r.status_code, (await r.aread()).decode(), False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                finished = True
                break
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            chunks += 1
            if drop_after is not None and chunks >= drop_after:
                return r.status_code, text, False  # leaving the block closes the connection mid-stream
    return 200, text, finished


def run_soak(server: ServerProcess, num_streams: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    pid = server.proc.pid

    async def main() -> None:
        limits = httpx.Limits(max_connections=num_streams + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=1800, limits=limits) as client:
            ref = await _reference(client, server.url)
            idle_kv = metric(server, "kv_cache_usage_perc")
            rss0 = rss_bytes(pid)
            plan = [
                (PROMPTS[i % len(PROMPTS)], rng.randint(0, MAX_TOKENS - 1) if rng.random() < 0.2 else None)
                for i in range(num_streams)
            ]
            results = await asyncio.gather(*(_stream(client, server.url, p, d) for p, d in plan))
            statuses = [s for s, _, _ in results]
            assert not [s for s in statuses if s >= 500], statuses
            assert all(s == 200 for s in statuses), [r for r in results if r[0] != 200][:3]
            survivors = [(p, res) for (p, d), res in zip(plan, results) if d is None]
            assert survivors
            for prompt, (_, text, finished) in survivors:
                assert finished and text == ref[prompt], (prompt, text, ref[prompt])
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if (
                    metric(server, "num_requests_running") == 0
                    and metric(server, "num_requests_waiting") == 0
                    and metric(server, "kv_cache_usage_perc") <= idle_kv
                ):
                    break
                await asyncio.sleep(0.5)
            assert metric(server, "num_requests_running") == 0
            assert metric(server, "num_requests_waiting") == 0
            assert metric(server, "kv_cache_usage_perc") <= idle_kv
            assert rss_bytes(pid) <= rss0 * 1.10, (rss0, rss_bytes(pid))

    asyncio.run(main())


def test_soak_smoke(stress_server: ServerProcess) -> None:
    run_soak(stress_server, 100)


@pytest.mark.slow
def test_soak_1000_streams(stress_server: ServerProcess) -> None:
    run_soak(stress_server, 1000, seed=1)
