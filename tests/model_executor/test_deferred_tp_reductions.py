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

    inner.defer_tp_reductions(reduce)
    rows = [m for m in model.modules() if isinstance(m, RowParallelLinear)]
    assert rows and not any(m.reduce_results for m in rows)
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
