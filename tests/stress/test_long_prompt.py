"""A long prompt no longer stalls everyone on the CPU (issue 14, finding 2): with the CPU's per-step
token budget (256 by default) a long prefill runs in chunks, so a short stream keeps getting tokens
between them, /metrics shows the long request running meanwhile, and a disconnect of the long request's
client stops its prefill at the next chunk."""

from __future__ import annotations

import threading
import time

import httpx

from tests.stress.conftest import auth, metric
from tests.test_server import ServerProcess

LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 170  # ~1,700 tokens: 7 chunks of 256
MAX_GAP_S = 3.0
"""Bound on the short stream's longest inter-token gap while the long prompt prefills (about 1 s per
chunk on an idle 2-core machine; the bound leaves room for a busy one). One unchunked step of this prompt
took over 10 s."""


def test_long_prefill_does_not_stall_short_stream(stress_server: ServerProcess) -> None:
    gaps: list[float] = []
    running_seen: list[float] = []

    def short_stream() -> None:
        body = {"prompt": "Count:", "max_tokens": 40, "ignore_eos": True, "stream": True, "temperature": 0}
        with (
            httpx.Client(timeout=300) as c,
            c.stream("POST", stress_server.url + "/v1/completions", headers=auth(), json=body) as r,
        ):
            last = None
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    now = time.monotonic()
                    if last is not None:
                        gaps.append(now - last)
                    last = now

    def long_request() -> None:
        body = {"prompt": LONG_PROMPT, "max_tokens": 1}
        r = httpx.post(stress_server.url + "/v1/completions", headers=auth(), json=body, timeout=300)
        assert r.status_code == 200, r.text

    short = threading.Thread(target=short_stream)
    short.start()
    time.sleep(1.0)
    long = threading.Thread(target=long_request)
    long.start()
    while long.is_alive():
        running_seen.append(metric(stress_server, "num_requests_running"))
        time.sleep(0.5)
    short.join()
    assert len(gaps) >= 30
    assert max(gaps) < MAX_GAP_S, sorted(gaps)[-5:]
    assert max(running_seen) >= 1  # the metrics were updated during the long prefill


def test_abort_lands_between_chunks(stress_server: ServerProcess) -> None:
    """The long request's client disconnects mid-prefill: the engine is idle again within ~2 chunks."""
    before = metric(stress_server, "prompt_tokens_total")
    body = {"prompt": LONG_PROMPT * 1, "max_tokens": 1}
    try:
        httpx.post(stress_server.url + "/v1/completions", headers=auth(), json=body, timeout=2.0)
    except httpx.TimeoutException:
        pass  # the client gave up: the server sees the disconnect
    t0 = time.monotonic()
    while metric(stress_server, "num_requests_running") > 0 and time.monotonic() - t0 < 30:
        time.sleep(0.1)
    assert metric(stress_server, "num_requests_running") == 0
    assert time.monotonic() - t0 < 2 * MAX_GAP_S
    # Not the whole prompt was prefilled: the abort stopped it between chunks.
    assert metric(stress_server, "prompt_tokens_total") - before < 1700
