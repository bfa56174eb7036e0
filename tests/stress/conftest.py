"""One `pagedllm serve` (default model, float32 so that greedy outputs do not depend on the batch) for
the stress suite, with short client timeouts and request templates trusted (so the sandbox is tested)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402

from tests.entrypoints.openai.test_server import ServerProcess  # noqa: E402

API_KEY = "stress-key"
HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 2.0
STRESS_FLAGS = [
    "--api-key",
    API_KEY,
    "--max-model-len",
    "2048",
    "--kv-cache-memory-bytes",
    str(128 << 20),
    "--dtype",
    "float32",
    "--trust-request-chat-template",
    "--timeout-request-header",
    str(HEADER_TIMEOUT_S),
    "--timeout-request-body",
    str(BODY_TIMEOUT_S),
    "--disable-log-requests",
    "--uvicorn-log-level",
    "warning",
]


@pytest.fixture(scope="package")
def stress_server() -> Iterator[ServerProcess]:
    with ServerProcess(STRESS_FLAGS) as srv:
        yield srv


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def metric(server: ServerProcess, name: str, labels: str = "") -> float:
    """Sum of the samples of `pagedllm:<name>` whose label set contains `labels`."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"pagedllm:{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m and labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")
