"""Acceptance 5: killing the engine-core process fails in-flight streams with an SSE error event, turns
/health to 503 (or closes the port), and makes the server exit non-zero within 10 s."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402

from tests.entrypoints.openai.test_server import ENGINE_FLAGS, ServerProcess  # noqa: E402


# CI time: the two-API-server case is slow-marked, run by hand (pytest -m slow)
@pytest.mark.parametrize("api_servers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_engine_core_death(api_servers: int) -> None:
    """With two API servers (`--api-server-count 2`), each fails its own streams and exits, and the
    supervising process exits non-zero."""
    srv = ServerProcess(["--disable-log-requests", "--api-server-count", str(api_servers), *ENGINE_FLAGS])
    try:
        srv.wait_ready()
        results: list[list[str]] = []
        started = threading.Barrier(5)

        def stream() -> None:
            lines: list[str] = []
            with (
                httpx.Client(timeout=60) as c,
                c.stream(
                    "POST",
                    srv.url + "/v1/completions",
                    json={"prompt": "Count:", "max_tokens": 900, "ignore_eos": True, "stream": True},
                ) as r,
            ):
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        if len(lines) == 2:
                            started.wait(60)
            results.append(lines)

        threads = [threading.Thread(target=stream) for _ in range(4)]
        for t in threads:
            t.start()
        started.wait(120)
        os.kill(srv.core_pid(), signal.SIGKILL)
        killed = time.monotonic()
        health: int | None = 200
        while health == 200 and time.monotonic() - killed < 5:
            try:
                health = httpx.get(srv.url + "/health", timeout=5).status_code
            except httpx.TransportError:
                health = None  # port already closed: also acceptable
            time.sleep(0.05)
        assert health in (503, None)
        srv.proc.wait(10)
        assert time.monotonic() - killed < 10
        assert srv.proc.returncode not in (0, None)
        for t in threads:
            t.join(10)
        assert len(results) == 4
        for lines in results:
            assert lines[-1] == "[DONE]"
            assert '"error"' in lines[-2] and "engine core" in lines[-2]
    finally:
        srv.stop()
