"""`triton_gemv.fused_gemv` (small-batch linear with RMSNorm / residual+RMSNorm / SiLU-and-mul folded in)
against the unfused reference: the layers' own PyTorch code and `F.linear`, same device and dtype (GPU;
on the CPU under TRITON_INTERPRET=1, float32 and float16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.triton_env import DEVICE, INTERPRET, require_triton_device  # noqa: E402

pytestmark = pytest.mark.gpu

require_triton_device()

from pagedllm.model_executor.layers import triton_gemv  # noqa: E402
from pagedllm.model_executor.layers.layernorm import RMSNorm  # noqa: E402

DTYPES = [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16])
# The GEMV sums K products in float32 in another order than the BLAS: a few ulps of the output dtype.
TOL = {torch.float32: (2e-4, 2e-4), torch.float16: (2e-2, 1e-2), torch.bfloat16: (1.5e-1, 3e-2)}


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    atol, rtol = TOL[ref.dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def _norm(k: int, dtype: torch.dtype, g: torch.Generator) -> RMSNorm:
    norm = RMSNorm(k, eps=1e-6)
    norm.weight.data = (1.0 + 0.3 * torch.randn(k, generator=g)).to(DEVICE, dtype)
    return norm


def _weights(n: int, k: int, dtype: torch.dtype, g: torch.Generator, bias: bool):  # noqa: ANN202
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    b = (0.1 * torch.randn(n, generator=g)).to(DEVICE, dtype) if bias else None
    return w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(48, 64), (300, 576), (1024, 1000)])
@pytest.mark.parametrize("bias", [False, True])
def test_add_norm_gemv(dtype: torch.dtype, m: int, n: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(m * 7 + n + k)
    norm = _norm(k, dtype, g)
    w, b = _weights(n, k, dtype, g, bias)
    x = (2 * torch.randn(m, k, generator=g)).to(DEVICE, dtype)
    res = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    x0, r0 = x.clone(), res.clone()
    y, new_res = triton_gemv.fused_gemv(x, w, b, norm_weight=norm.weight, residual=res, eps=1e-6)
    ref_res = x + res
    assert new_res is not None and torch.equal(new_res, ref_res)
    _close(y, F.linear(norm._norm(ref_res), w, b))
    assert torch.equal(x, x0) and torch.equal(res, r0)  # inputs untouched
    y2, none = triton_gemv.fused_gemv(x, w, b, norm_weight=norm.weight, eps=1e-6)  # norm only (first layer)
    assert none is None
    _close(y2, F.linear(norm._norm(x), w, b))
    y3, _ = triton_gemv.fused_gemv(x, w, b)  # plain GEMV
    _close(y3, F.linear(x, w, b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("n,k", [(64, 96), (576, 1536)])
def test_silu_mul_gemv(dtype: torch.dtype, m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m + n + k)
    w, _ = _weights(n, k, dtype, g, False)
    x = (2 * torch.randn(m, 2 * k, generator=g)).to(DEVICE, dtype)
    y, _ = triton_gemv.fused_gemv(x, w, silu_and_mul=True)
    _close(y, F.linear(F.silu(x[:, :k]) * x[:, k:], w))


def test_enabled_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(4, 8, device=DEVICE)
    monkeypatch.delenv("PAGEDLLM_FUSED_GEMV", raising=False)
    assert not triton_gemv.enabled(x)
    monkeypatch.setenv("PAGEDLLM_FUSED_GEMV", "1")
    assert triton_gemv.enabled(x) == (DEVICE == "cuda")
    assert not triton_gemv.enabled(torch.zeros(17, 8, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
def test_float32_out(dtype: torch.dtype) -> None:
    """The LM head's use: float32 logits from 16-bit activations and weights (no rounding of the sums)."""
    g = torch.Generator().manual_seed(11)
    w, _ = _weights(2000, 256, dtype, g, False)
    x = torch.randn(2, 256, generator=g).to(DEVICE, dtype)
    y, _ = triton_gemv.fused_gemv(x, w, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x.float() @ w.float().t(), atol=1e-3, rtol=1e-3)


# ---- single-row GEMV (batch-1 decode) ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (4096, 14336), (1000, 1000), (3, 70), (130, 2048)])
@pytest.mark.parametrize("bias", [False, True])
def test_row_gemv(dtype: torch.dtype, n: int, k: int, bias: bool) -> None:
    """Even and ragged (masked) shapes against F.linear, default and other tile configs."""
    g = torch.Generator().manual_seed(n + k)
    w, b = _weights(n, k, dtype, g, bias)
    x = torch.randn(1, k, generator=g).to(DEVICE, dtype)
    ref = F.linear(x, w, b)
    _close(triton_gemv.row_gemv(x, w, b), ref)
    _close(triton_gemv.row_gemv(x, w, b, config=(8, 256, 4, 2)), ref)


def test_row_gemv_routing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The linear layers take the row GEMV for one 16-bit CUDA row only when switched on."""
    w = torch.randn(64, 32, device=DEVICE, dtype=torch.float16)
    one = torch.randn(1, 32, device=DEVICE, dtype=torch.float16)
    monkeypatch.setattr(triton_gemv, "_ROW_GEMV", False)
    assert not triton_gemv.row_gemv_enabled(one, w)
    monkeypatch.setattr(triton_gemv, "_ROW_GEMV", True)
    assert triton_gemv.row_gemv_enabled(one, w) == (DEVICE != "cpu")
    assert not triton_gemv.row_gemv_enabled(torch.randn(2, 32, device=DEVICE, dtype=torch.float16), w)
    assert not triton_gemv.row_gemv_enabled(one.float(), w.float())
