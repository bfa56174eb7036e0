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


def test_profile_forward_spreads_the_tokens_and_skips_attention(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The profiling forward (`warmup.profile_forward`), as vLLM's profile run: the step's tokens over several
    requests, the logits of each request's last token, and no attention kernel (whose real versions allocate
    nothing beyond their output; SDPA would hold [heads, n, n] scores)."""
    import torch.nn.functional as F

    from pagedllm.attention.layer import Attention
    from pagedllm.model_executor.model_loader import load_model
    from pagedllm.worker import warmup
    from tests.utils_model import make_model_config, make_tiny_hf_model

    hf = make_tiny_hf_model("llama", tmp_path)
    model = load_model(make_model_config(str(tmp_path), hf.config), "auto", torch.device("cpu"))
    layers = [m for m in model.modules() if isinstance(m, Attention)]

    def no_sdpa(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("attention ran in the profiling forward")

    monkeypatch.setattr(F, "scaled_dot_product_attention", no_sdpa)
    logits_rows: list[int] = []
    compute = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda h: logits_rows.append(h.shape[0]) or compute(h))
    names = [m.layer_name for m in layers]
    warmup.profile_forward(model, layers[0].backend, names, 100, 7, 16, torch.device("cpu"))
    assert logits_rows == [7]
