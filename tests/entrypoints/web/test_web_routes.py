"""Web UI routes without a browser: `--disable-web-ui`, and the O(1) KV-block counts behind the grid."""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest

from pagedllm.core.block_pool import BlockPool
from pagedllm.platforms import current_platform
from tests.entrypoints.openai.test_server import ServerProcess
from tests.entrypoints.web.conftest import API_KEY, SERVER_FLAGS


@pytest.mark.slow
def test_pages_public_and_stats_need_key(web_server: Any) -> None:
    for path in ("/", "/dashboard", "/ui/chat.js", "/ui/dashboard.js", "/ui/common.js", "/ui/style.css"):
        assert httpx.get(web_server.url + path).status_code == 200, path
    assert httpx.get(web_server.url + "/dashboard/api/stats").status_code == 401
    # Only the shipped files are public: anything else under /ui is behind the key like any route.
    assert httpx.get(web_server.url + "/ui/missing.js").status_code == 401
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(web_server.url + "/ui/missing.js", headers=auth).status_code == 404
    r = httpx.get(web_server.url + "/dashboard/api/stats", headers=auth)
    body = r.json()
    # The built-in packed SmolLM2's cache: bfloat16 where the CPU computes it natively, else float32
    # (config.resolve_kv_cache_dtype_name); a block holds K and V of 30 layers x 16 tokens x 3 kv heads x 64, and
    # one block of the budget is held back.
    elem = 2 if current_platform.cpu_has_native_bf16() else 4
    blocks = (32 << 20) // (2 * 30 * 16 * 3 * 64 * elem) - 1
    assert r.status_code == 200 and body["available"] and body["kv_blocks"]["total"] == blocks


@pytest.mark.slow
def test_disable_web_ui() -> None:
    srv = ServerProcess(["--disable-web-ui", *SERVER_FLAGS])
    try:
        srv.wait_ready()
        for path in ("/", "/dashboard", "/ui/chat.js", "/dashboard/api/stats"):
            assert httpx.get(srv.url + path).status_code == 404, path
        assert httpx.get(srv.url + "/v1/models").status_code == 200
    finally:
        srv.stop()


def test_snapshot_counts_track_pool() -> None:
    rng = random.Random(0)
    pool = BlockPool(64, enable_caching=True)
    held: list[list[Any]] = []
    for step in range(2000):
        op = rng.random()
        if op < 0.4 and pool.num_free_blocks:
            blocks = pool.get_new_blocks(rng.randint(1, min(4, pool.num_free_blocks)))
            for b in blocks:
                if rng.random() < 0.6:
                    pool.cache_block(b, rng.randbytes(2))  # small hash space: duplicates and hits happen
            held.append(blocks)
        elif op < 0.6 and pool.cached:
            hit = rng.choice(list(pool.cached.values()))
            pool.touch([hit])
            held.append([hit])
        elif held:
            pool.free_blocks(reversed(held.pop(rng.randrange(len(held)))))
        if step % 500 == 499 and not held:
            assert pool.reset_prefix_cache()
        pool.check_invariants()
        total, in_use, cached_free = pool.snapshot_counts()
        assert total == 63 and in_use == 63 - pool.num_free_blocks
        assert cached_free == sum(1 for b in pool.blocks[1:] if b.ref_cnt == 0 and b.block_hash is not None)


def test_dashboard_numbers_are_the_metrics_numbers() -> None:
    """`read_registry` (the dashboard's source) against `/metrics`' own text for the same registry."""
    from prometheus_client.parser import text_string_to_metric_families

    from pagedllm.entrypoints.web.stats import read_registry
    from pagedllm.messages import SchedulerStats
    from pagedllm.metrics.prometheus import PrometheusStatLogger

    prom = PrometheusStatLogger("m", 2048)
    rng = random.Random(1)
    for step in range(50):
        prom.record(
            SchedulerStats(
                num_running_reqs=rng.randint(0, 9),
                num_waiting_reqs=rng.randint(0, 3),
                kv_cache_usage=rng.random(),
                prefix_cache_queries=rng.randint(0, 64),
                prefix_cache_hits=rng.randint(0, 16),
                num_preemptions=step // 10,
            ),
            None,
        )
        prom.prompt_tokens.inc(rng.randint(0, 50))
        prom.generation_tokens.inc(rng.randint(0, 8))
        prom.ttft.observe(rng.uniform(0, 3))
        prom.itl.observe(rng.uniform(0, 0.3))
        prom.request_success[rng.choice(["stop", "length", "abort"])].inc()
    scraped = {
        (s.name, s.labels.get("le"), s.labels.get("finished_reason")): s.value
        for fam in text_string_to_metric_families(prom.render().decode())
        for s in fam.samples
    }
    shown = read_registry(prom)
    names = {
        "running": "num_requests_running",
        "waiting": "num_requests_waiting",
        "kv_cache_usage": "kv_cache_usage_perc",
        "preemptions": "num_preemptions_total",
        "prefix_cache_queries": "prefix_cache_queries_total",
        "prefix_cache_hits": "prefix_cache_hits_total",
        "prompt_tokens": "prompt_tokens_total",
        "generation_tokens": "generation_tokens_total",
    }
    for key, name in names.items():
        assert shown[key] == scraped[(f"pagedllm:{name}", None, None)], key
    for reason in ("stop", "length", "abort"):
        assert shown["requests"][reason] == scraped[("pagedllm:request_success_total", None, reason)]
    for key, name in (("ttft", "time_to_first_token_seconds"), ("itl", "inter_token_latency_seconds")):
        hist = shown[key]
        assert hist["count"] == scraped[(f"pagedllm:{name}_count", None, None)] == 50
        assert hist["sum"] == scraped[(f"pagedllm:{name}_sum", None, None)]
        for le, cum in zip(hist["le"], hist["cumulative"]):
            le_text = "+Inf" if le is None else repr(float(le))
            assert cum == scraped[(f"pagedllm:{name}_bucket", le_text, None)], (key, le)
