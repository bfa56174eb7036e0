"""The worker's start-up memory check (CUDA, exercised here with the CUDA queries replaced): as vLLM, the
non-PyTorch memory present at start (the CUDA context) is not charged to the KV cache later; where less than
`gpu_memory_utilization` of the device is free at start, everything outside PyTorch stays charged."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pagedllm.worker.worker import Worker

GIB = 1 << 30


def _fake(monkeypatch: pytest.MonkeyPatch, free: int, total: int, reserved: int) -> None:
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: reserved)


def _worker(util: float, kv_bytes: int | None = None) -> Any:
    cache = SimpleNamespace(gpu_memory_utilization=util, kv_cache_memory_bytes=kv_bytes, num_gpu_blocks_override=None)
    return SimpleNamespace(config=SimpleNamespace(cache_config=cache))


def test_context_memory_at_start_is_not_charged(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake(monkeypatch, free=79 * GIB, total=80 * GIB, reserved=GIB // 2)
    assert Worker._check_free_memory(_worker(0.9)) == GIB // 2


def test_too_little_free_memory_charges_everything(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _fake(monkeypatch, free=40 * GIB, total=80 * GIB, reserved=0)
    with caplog.at_level(logging.WARNING):
        assert Worker._check_free_memory(_worker(0.9)) == 0
    assert "gpu_memory_utilization" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # an explicit KV size: nothing to warn about
        assert Worker._check_free_memory(_worker(0.9, kv_bytes=GIB)) == 0
    assert caplog.text == ""
