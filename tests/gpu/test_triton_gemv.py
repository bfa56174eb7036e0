"""The few-row GEMV (`triton_gemv.rows_gemv`, 2..8 rows on the CUDA cores) against a float32 product, on
even and ragged shapes, with and without bias; and the linear layer's dispatch to it (also on the CPU under
TRITON_INTERPRET=1, in float16: the interpreter mishandles bfloat16)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.triton_env import DEVICE, INTERPRET, require_triton_device

pytestmark = pytest.mark.gpu

require_triton_device()

from pagedllm.model_executor.layers import triton_gemv  # noqa: E402

DTYPES = [torch.float16] if INTERPRET else [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [2, 3, 5, 8])
@pytest.mark.parametrize(("n", "k", "bias"), [(960, 576, False), (576, 1536, True), (100, 300, True), (48, 80, False)])
def test_rows_gemv_matches_float32(m: int, n: int, k: int, bias: bool, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    y = triton_gemv.rows_gemv(x, w, b)
    ref = x.float() @ w.float().T + (b.float() if b is not None else 0.0)
    assert y.dtype == dtype and y.shape == (m, n)
    # one rounding of the float32 accumulator to 16 bits (bf16: 2^-8 relative), plus summation order
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(y.float(), ref, atol=tol, rtol=tol)


def test_linear_dispatch_to_rows_gemv(monkeypatch: pytest.MonkeyPatch) -> None:
    """2..PAGEDLLM_ROWS_GEMV_MAX_M rows take it, one row the row GEMV, more rows the library GEMM."""
    monkeypatch.setenv("PAGEDLLM_ROWS_GEMV_MAX_M", "8")
    triton_gemv._rows_gemv_max_m.cache_clear()
    dtype = DTYPES[0]
    w = torch.randn(64, 32).to(DEVICE, dtype)
    enabled = [triton_gemv.rows_gemv_enabled(torch.zeros(m, 32, dtype=dtype, device=DEVICE), w) for m in (1, 2, 8, 9)]
    on_device = DEVICE == "cuda"
    triton_gemv._rows_gemv_max_m.cache_clear()
    assert enabled == [False, on_device, on_device, False]
