"""API servers run on uvloop where it is installed (`server_main.run_event_loop`); `PAGEDLLM_UVLOOP=0` keeps
asyncio's own loop."""

from __future__ import annotations

import asyncio

import pytest

from pagedllm.entrypoints.openai.server_main import run_event_loop


async def _loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


def _run() -> str:
    out: list[str] = []

    async def main() -> int:
        out.append(await _loop_module())
        return 0

    assert run_event_loop(main()) == 0
    return out[0]


def test_uvloop_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("uvloop")
    monkeypatch.delenv("PAGEDLLM_UVLOOP", raising=False)
    assert _run().startswith("uvloop")


def test_asyncio_loop_when_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_UVLOOP", "0")
    assert _run().startswith("asyncio")
