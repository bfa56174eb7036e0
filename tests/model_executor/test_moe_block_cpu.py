"""The MoE block's interfaces with the rest of the layer, on the CPU (issue 18): which routers may run inside the
fused routing (`fusable_router`), which blocks leave the sum over k to the next norm (`SparseMoeBlock.defer_sum`),
and `RMSNorm` with a residual taking [T, k, H] parts (the fallback path sums them first)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedllm.model_executor.layers import batch_invariant
from pagedllm.model_executor.layers.fused_moe.layer import FusedMoE, fusable_router
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.linear import LinearMethodBase, ReplicatedLinear, UnquantizedLinearMethod
from pagedllm.model_executor.models.moe_common import SparseMoeBlock


def _gate(bias: bool = False) -> ReplicatedLinear:
    gate = ReplicatedLinear(16, 4, bias=bias, prefix="mlp.gate")
    torch.nn.init.normal_(gate.weight)
    return gate


def test_only_a_plain_linear_router_is_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(3, 16)
    assert fusable_router(_gate(), x)
    assert not fusable_router(_gate(bias=True), x)
    assert not fusable_router(_gate(), x.to(torch.bfloat16))  # another dtype than the router's
    hooked = _gate()
    hooked.register_forward_hook(lambda *a: None)  # e.g. LoRA: its hook must see the router's forward
    assert not fusable_router(hooked, x)

    class OtherMethod(UnquantizedLinearMethod):  # a quantized router stands in as another linear method
        pass

    quantized = _gate()
    quantized.quant_method = OtherMethod()
    assert isinstance(quantized.quant_method, LinearMethodBase) and not fusable_router(quantized, x)
    monkeypatch.setattr(batch_invariant, "enabled", lambda: True)
    assert not fusable_router(_gate(), x)


def test_the_cpu_path_takes_the_router_layer_or_its_logits() -> None:
    """`FusedMoE.forward` given the router layer equals given the router's logits (CPU: torch path)."""
    torch.manual_seed(0)
    moe = FusedMoE(4, 2, 16, 8, renormalize=True)
    torch.nn.init.normal_(moe.w13_weight)
    torch.nn.init.normal_(moe.w2_weight)
    gate, x = _gate(), torch.randn(5, 16)
    assert torch.equal(moe(x, gate), moe(x, gate(x)))
    assert torch.equal(moe(x, gate, sum_experts=False), moe(x, gate(x)))  # the CPU path always sums


@pytest.mark.parametrize(("shared", "defer"), [(0, True), (8, False)])
def test_defer_sum_only_without_a_shared_expert(shared: int, defer: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    config = SimpleNamespace(hidden_size=16, num_experts=4, num_experts_per_tok=2)
    assert SparseMoeBlock(config, 8, True, shared_intermediate_size=shared).defer_sum is defer
    monkeypatch.setenv("PAGEDLLM_MOE_DEFER_SUM", "0")
    assert SparseMoeBlock(config, 8, True).defer_sum is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_sums_parts_before_the_residual_add(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    norm = RMSNorm(16).to(dtype)
    parts, residual = torch.randn(3, 4, 16).to(dtype), torch.randn(3, 16).to(dtype)
    out, res = norm(parts, residual.clone())
    ref_out, ref_res = norm(parts.sum(dim=1), residual.clone())
    assert torch.equal(out, ref_out) and torch.equal(res, ref_res)
