"""`LlamaModel.defer_tp_reductions` (CPU, one rank): o_proj / down_proj leave their sums un-reduced and every
RMSNorm given a residual reduces instead (`distributed/fused_allreduce_norm.py` does it in one kernel on two
GPUs). At tp=1 the all-reduce is the identity, so the model's logits must not change bit for bit, whether the
reduce callback computes the add + norm itself or declines (None: the norm all-reduces and normalizes as usual);
and the callback must run once per norm that follows a row-parallel layer."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedllm.model_executor.layers.linear import RowParallelLinear
from pagedllm.model_executor.model_loader import load_model
from tests.utils_model import VOCAB, PagedModelRunner, make_model_config, make_tiny_hf_model

torch.set_num_threads(2)


def _load(variant: str, path: Any) -> Any:
    hf = make_tiny_hf_model(variant, path)
    return load_model(make_model_config(str(path), hf.config), "auto", torch.device("cpu"))


def _add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[Any, Any]:
    """The reference math of RMSNorm(x, residual)."""
    h = x + residual
    hf = h.float()
    return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype), h


@pytest.mark.parametrize("variant", ["llama", "qwen3_mqa"])
@pytest.mark.parametrize("computes", [True, False], ids=["callback-computes", "callback-declines"])
def test_deferred_reductions_keep_logits(variant: str, computes: bool, tmp_path: Any) -> None:
    model = _load(variant, tmp_path)
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(3))
    want = PagedModelRunner(model).step(ids)
    inner = model.model
    assert inner.supports_deferred_tp_reductions()
    calls: list[int] = []

    def reduce(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> Any:
        calls.append(x.shape[0])
        return _add_norm(x, residual, weight, eps) if computes else None

    inner.defer_tp_reductions(reduce, 1 << 20)
    rows = [m for m in model.modules() if isinstance(m, RowParallelLinear)]
    assert rows and all(m.defer_rows == 1 << 20 for m in rows)
    got = PagedModelRunner(model).step(ids)
    layers = len(inner.stage_layers)
    assert len(calls) == 2 * layers  # post-attention norms, input norms after the first layer, the final norm
    if computes:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    else:
        assert torch.equal(got, want)


def test_layers_with_a_bias_after_the_sum_are_not_deferred(tmp_path: Any) -> None:
    """A row-parallel bias is added once after the all-reduce: such a layer keeps its own reduction."""
    model = _load("llama_linear_rope_bias", tmp_path)
    assert not model.model.supports_deferred_tp_reductions()


def test_batches_above_the_limit_reduce_in_the_linears(tmp_path: Any) -> None:
    """Above `max_rows` the row-parallel layers reduce their own outputs (at tp=1 the identity) and the norms
    do not call the callback: the logits are unchanged bit for bit."""
    model = _load("llama", tmp_path)
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(3))
    want = PagedModelRunner(model).step(ids)
    calls: list[int] = []

    def reduce(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> Any:
        calls.append(x.shape[0])
        return _add_norm(x, residual, weight, eps)

    model.model.defer_tp_reductions(reduce, 23)
    got = PagedModelRunner(model).step(ids)
    assert calls == []
    assert torch.equal(got, want)


@pytest.mark.parametrize("max_rows", [20, 30])
def test_chunked_mlps_defer_as_the_whole_batch(max_rows: int, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the MLPs in chunks of 7 (`chunk_mlps`), each chunk's down_proj reduces, or leaves the sum to the
    norm, as the whole 24-token batch does: every chunk reduced in the linear above the limit (20), none below
    it (30), where the norms reduce. (Two ranks simulated: the reductions are the identity, counted.)"""
    from pagedllm.model_executor.layers import linear
    from pagedllm.model_executor.models.llama import chunk_mlps

    model = _load("llama", tmp_path)
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(3))
    want = PagedModelRunner(model).step(ids)
    chunk_mlps(model, 7)
    reduced: list[int] = []
    monkeypatch.setattr(linear, "tensor_model_parallel_all_reduce", lambda x: reduced.append(x.shape[0]) or x)
    for m in model.modules():
        if isinstance(m, RowParallelLinear):
            m.tp_size = 2  # the reduce decision runs; the identity "all-reduce" keeps the math of one rank
    norm_calls: list[int] = []

    def reduce(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> Any:
        norm_calls.append(x.shape[0])
        return _add_norm(x, residual, weight, eps)

    model.model.defer_tp_reductions(reduce, max_rows)
    got = PagedModelRunner(model).step(ids)
    layers = len(model.model.stage_layers)
    if max_rows < 24:
        assert norm_calls == [] and reduced == [24, 7, 7, 7, 3] * layers  # o_proj whole, down_proj by chunks
    else:
        assert reduced == [] and len(norm_calls) == 2 * layers
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
