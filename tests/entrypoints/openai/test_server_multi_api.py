"""`pagedllm serve --api-server-count 2` (issue 17, acceptance 3): two API-server processes share the port and
one engine core. The server tests that matter for the new path run here against such a server (imported from
test_server.py, so they are the same tests): 64 concurrent streams equal their non-streamed results, client
disconnects abort, bad inputs get their 4xx without delaying others; plus: both API servers take connections.
The core-death test with two API servers is in test_server_kill.py. The whole of test_server.py runs this way
with PAGEDLLM_TEST_API_SERVERS=2 (by hand)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytestmark = pytest.mark.slow  # CI time (~90 s, a second server start): run by hand (pytest -m slow)
pytest.importorskip("fastapi")
pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")
import httpx  # noqa: E402
import openai  # noqa: E402

from tests.entrypoints.openai.test_server import (  # noqa: E402, F401  (tests run again with this module's server)
    API_KEY,
    ServerProcess,
    server_args,
    test_64_concurrent_streams_equal_non_streamed,
    test_async_client_streaming,
    test_bad_inputs,
    test_bad_inputs_do_not_delay_others,
    test_client_disconnect_aborts,
    test_n3_with_seed_and_stream_usage,
)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(server_args(api_server_count=2)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_both_api_servers_take_connections(server: ServerProcess) -> None:
    """16 open keep-alive connections: the kernel spreads them over both processes (SO_REUSEPORT); each
    process answers on its own. All of them at 1 process would happen with probability 2^-15."""
    children = [p for p in psutil.Process(server.proc.pid).children() if p.name() != "resource_tracker"]
    api = [p for p in children if server.port in _listening_ports(p)]
    assert len(api) == 2, f"expected 2 API-server processes listening on {server.port}, got {api}"
    clients = [httpx.Client(timeout=30) for _ in range(16)]
    try:
        for c in clients:
            assert c.get(server.url + "/health").status_code == 200  # opens and keeps one connection each
        served = [sum(1 for c in p.net_connections("tcp") if _is_client_conn(c, server.port)) for p in api]
        assert sum(served) == 16 and min(served) >= 1, served
    finally:
        for c in clients:
            c.close()


def _listening_ports(p: psutil.Process) -> set[int]:
    return {c.laddr.port for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN}


def _is_client_conn(c: psutil._common.pconn, port: int) -> bool:  # type: ignore[name-defined]
    return c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port
