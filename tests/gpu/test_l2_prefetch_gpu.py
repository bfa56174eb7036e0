"""The norms and the SiLU-mul asking L2 for later weights (layers/l2_prefetch.py) on the device: the outputs and
twins are those of the kernels without the table, bit for bit (the prefetch is a hint; its PTX is checked on
the CPU in tests/test_pdl.py, the attention's case in tests/gpu/test_triton_attention.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from pagedllm.model_executor.layers import triton_ops  # noqa: E402
from pagedllm.model_executor.layers.l2_prefetch import prefetch_table  # noqa: E402
from pagedllm.model_executor.layers.quantization import act_twin  # noqa: E402


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a, b)
    ta, tb = act_twin.twin_of(a), act_twin.twin_of(b)
    assert (ta is None) == (tb is None)
    for x, y in zip(ta or (), tb or (), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("twin", [None, "q8"])
@pytest.mark.parametrize("rows", [1, 8])
def test_norm_and_silu_with_a_prefetch_table(twin: str | None, rows: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows)
    weights = [torch.randint(-(2**31), 2**31 - 1, (4096, 512), device="cuda", dtype=torch.int32, generator=g),
               torch.randn(4096, 128, device="cuda", generator=g).half()]  # fmt: skip
    table = prefetch_table(weights, prefix_bytes=5 << 20)
    assert table is not None and table.shape == (2, 2)
    x = torch.randn(rows, 4096, device="cuda", generator=g).bfloat16()
    r = torch.randn(rows, 4096, device="cuda", generator=g).bfloat16()
    w = (torch.rand(4096, device="cuda", generator=g) + 0.5).bfloat16()
    _same(triton_ops.rms_norm(x, w, 1e-6, twin, table), triton_ops.rms_norm(x, w, 1e-6, twin))
    out, res = triton_ops.fused_add_rms_norm(x, r, w, 1e-6, twin, table)
    ref, ref_res = triton_ops.fused_add_rms_norm(x, r, w, 1e-6, twin)
    _same(out, ref)
    assert torch.equal(res, ref_res)
    gu = torch.randn(rows, 2 * 14336, device="cuda", generator=g).bfloat16()
    _same(triton_ops.silu_and_mul(gu, twin, table), triton_ops.silu_and_mul(gu, twin))
