"""HTTP control routes: /sleep, /wake_up, /is_sleeping (dev mode + --enable-sleep-mode), /collective_rpc,
/start_profile, /stop_profile, against a `pagedllm serve` subprocess with the default model (the server
tests are slow: ~2 min on the 2-core machine)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402
from fastapi import FastAPI  # noqa: E402

from pagedllm.entrypoints.openai.control_routes import add_control_routes  # noqa: E402
from tests.entrypoints.openai.test_server import ServerProcess  # noqa: E402

FLAGS = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20), "--dtype", "float32"]
BODY = {"model": "smol", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0}


def _paths(extra: dict, dev: bool, monkeypatch: pytest.MonkeyPatch) -> set[str]:
    monkeypatch.setenv("PAGEDLLM_SERVER_DEV_MODE", "1" if dev else "0")
    monkeypatch.delenv("PAGEDLLM_TORCH_PROFILER_DIR", raising=False)
    app = FastAPI()
    add_control_routes(app, SimpleNamespace(config=SimpleNamespace(extra=extra)))
    return {r.path for r in app.routes} & {"/sleep", "/wake_up", "/is_sleeping", "/collective_rpc", "/start_profile"}


def test_routes_are_guarded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sleep routes need dev mode AND sleep mode (as vLLM); profiling routes a trace directory."""
    assert _paths({"enable_sleep_mode": True}, dev=False, monkeypatch=monkeypatch) == set()
    assert _paths({"enable_sleep_mode": False}, dev=True, monkeypatch=monkeypatch) == {"/collective_rpc"}
    assert _paths({"enable_sleep_mode": True}, dev=True, monkeypatch=monkeypatch) == {
        "/sleep",
        "/wake_up",
        "/is_sleeping",
        "/collective_rpc",
    }
    prof = {"profiler_config": {"torch_profiler_dir": "/tmp/x"}}
    assert _paths(prof, dev=False, monkeypatch=monkeypatch) == {"/start_profile"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    traces = tmp_path_factory.mktemp("server_traces")
    cfg = json.dumps({"profiler": "torch", "torch_profiler_dir": str(traces)})
    srv = ServerProcess(
        ["--served-model-name", "smol", "--enable-sleep-mode", "--profiler-config", cfg, *FLAGS],
        env={"PAGEDLLM_SERVER_DEV_MODE": "1"},
    )
    try:
        srv.wait_ready()
        yield srv, traces
    finally:
        srv.stop()


def _complete(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=BODY, timeout=120)


@pytest.mark.slow
def test_sleep_wake_over_http(server: tuple[ServerProcess, Path]) -> None:
    url = server[0].url
    assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": False}
    ref = _complete(url).json()["choices"][0]["text"]
    assert httpx.post(url + "/sleep", params={"level": 1}).status_code == 200
    assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": True}
    r = _complete(url)
    assert r.status_code == 503 and "sleeping" in r.json()["error"]["message"]
    r = httpx.post(url + "/sleep", params={"level": 7})
    assert r.status_code == 400 and "level" in r.json()["error"]["message"]
    assert httpx.post(url + "/wake_up", params={"tags": ["weights", "kv_cache"]}).status_code == 200
    assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": False}
    assert _complete(url).json()["choices"][0]["text"] == ref
    # Level 0: a request sent while paused waits, and finishes after wake_up(tags=scheduling).
    assert httpx.post(url + "/sleep", params={"level": 0}).status_code == 200
    result: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: result.setdefault("r", _complete(url)))
    t.start()
    t.join(3.0)
    assert t.is_alive(), "the request finished while scheduling was paused"
    assert httpx.post(url + "/wake_up", params={"tags": ["scheduling"]}).status_code == 200
    t.join(60)
    assert result["r"].json()["choices"][0]["text"] == ref


@pytest.mark.slow
def test_collective_rpc_and_profile_over_http(server: tuple[ServerProcess, Path]) -> None:
    url, traces = server
    r = httpx.post(url.url + "/collective_rpc", json={"method": "determine_num_blocks"})
    assert r.status_code == 200 and isinstance(r.json()["results"][0], int) and len(r.json()["results"]) == 1
    r = httpx.post(url.url + "/collective_rpc", json={"method": "get_kv_cache_specs"})  # not msgpack-able
    assert r.status_code == 500 and "Encoding objects" in r.json()["error"]["message"]
    assert httpx.get(url.url + "/health").status_code == 200  # the core survived it
    r = httpx.post(url.url + "/collective_rpc", json={"method": "no_such_method"})
    assert r.status_code == 400 and "no_such_method" in r.json()["error"]["message"]
    assert httpx.post(url.url + "/start_profile").status_code == 200
    assert _complete(url.url).status_code == 200
    assert httpx.post(url.url + "/stop_profile").status_code == 200
    files = list(traces.glob("*.json"))
    assert len(files) == 1
    with open(files[0]) as f:
        assert json.load(f)["traceEvents"]
    assert os.path.getsize(files[0]) > 0
