"""Twins of activations (quantization/act_twin.py) on the device: the FP8 twin the RMSNorm / add-RMSNorm and
SiLU-mul kernels write is `w8a8_ops.quantize_rows` of their output (the same scales and e4m3 codes to the bit),
the FP8 decode GEMV and the GEMM path reading it match the emulated W8A8 math / the path without it; the q8
twin (GGUF's int8 GEMV) is `gguf_triton.quantize_q8` of the output, and the GEMV on it gives the GEMV's
result without it (the linking of producers is tested on the CPU,
tests/model_executor/quantization/test_act_twin.py). GPU only: the Triton interpreter converts to e4m3
wrongly."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from pagedllm.model_executor.layers import triton_ops  # noqa: E402
from pagedllm.model_executor.layers.quantization import act_twin, w8a8_ops  # noqa: E402

FP8 = w8a8_ops.FP8_DTYPE


def _same_quantization(out: torch.Tensor) -> None:
    twin = act_twin.twin_of(out)
    assert twin is not None
    q, s = twin
    ref_q, ref_s = w8a8_ops.quantize_rows(out.reshape(-1, out.shape[-1]), FP8)
    assert torch.equal(s, ref_s)
    assert torch.equal(q.view(torch.int8), ref_q.view(torch.int8))


def _near(out: torch.Tensor, plain: torch.Tensor) -> None:
    """The 16-bit output as the plain kernel's, but for rare elements one ulp apart (act_twin.wants_twin)."""
    off = out != plain
    assert int(off.sum()) <= max(1, out.numel() // 100)
    torch.testing.assert_close(out, plain, rtol=2**-7, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "cols"), [(1, 4096), (3, 576), (4, 1000), (300, 4096), (37, 1000)])
def test_norm_twins_are_the_quantizer(dtype: torch.dtype, rows: int, cols: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows * cols)
    x = (torch.randn(rows, cols, device="cuda", generator=g) * 3).to(dtype)
    r = torch.randn(rows, cols, device="cuda", generator=g).to(dtype)
    w = (torch.rand(cols, device="cuda", generator=g) + 0.5).to(dtype)
    plain = triton_ops.rms_norm(x, w, 1e-6)
    out = triton_ops.rms_norm(x, w, 1e-6, twin_kind="fp8")
    assert act_twin.twin_of(plain) is None
    _near(out, plain)
    _same_quantization(out)
    out2, res2 = triton_ops.fused_add_rms_norm(x, r, w, 1e-6, twin_kind="fp8")
    ref2, ref_res = triton_ops.fused_add_rms_norm(x, r, w, 1e-6)
    _near(out2, ref2)
    assert torch.equal(res2, ref_res)
    assert act_twin.twin_of(res2) is None
    _same_quantization(out2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 4096, 6144), (1, 14336, 4096), (3, 1000, 200), (2, 576, 1536)])
def test_gemv_on_a_twin_matches_the_emulated_math(dtype: torch.dtype, m: int, k: int, n: int) -> None:
    """The GEMV given the twin multiplies exactly the quantizer's e4m3 row: float32 activations within 1e-5 of
    the emulated math's scale, 16-bit ones within 1e-2 (float16-pair sums, 16-bit output)."""
    g = torch.Generator(device="cuda").manual_seed(k + n)
    w, ws = w8a8_ops.quantize_weight_per_channel(torch.randn(n, k, device="cuda", generator=g) * 0.02, FP8)
    x = (torch.randn(m, k, device="cuda", generator=g) * 2).to(dtype)
    xq, xs = w8a8_ops.quantize_rows(x, FP8)
    ref = w8a8_ops._emulated(xq, xs, w, ws, None)
    twin_x = act_twin.attach(x.clone(), xq, xs)
    out = w8a8_ops.w8a8_linear(twin_x, w, ws, None, None)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert float((out.float() - ref).abs().max()) <= tol * float(ref.abs().max())
    # a twin of another row would change the result: the GEMV does read it
    other = act_twin.attach(x.clone(), *w8a8_ops.quantize_rows(x * 2, FP8))
    assert not torch.allclose(w8a8_ops.w8a8_linear(other, w, ws, None, None).float(), out.float(), rtol=0.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "d"), [(5, 14336), (64, 1000), (1024, 1536)])
def test_silu_twins_are_the_quantizer(dtype: torch.dtype, rows: int, d: int) -> None:
    """The one-program-a-row SiLU-mul with a twin writes the plain kernel's output to the bit, and its twin."""
    g = torch.Generator(device="cuda").manual_seed(rows + d)
    x = (torch.randn(rows, 2 * d, device="cuda", generator=g) * 3).to(dtype)
    x[0, :8] *= 40  # an outlier row
    plain = triton_ops.silu_and_mul(x)
    out = triton_ops.silu_and_mul(x, twin_kind="fp8")
    assert act_twin.twin_of(plain) is None
    assert torch.equal(out, plain)
    _same_quantization(out)


@pytest.mark.parametrize("m", [5, 17, 300])
def test_gemm_path_on_a_twin_is_the_path_without(m: int) -> None:
    """Batches above the GEMV's rows: `torch._scaled_mm` on the twin gives the result of quantizing in a pass of
    its own to the bit; a twin of other rows changes it (the GEMM does read the twin)."""
    if not w8a8_ops.fp8_supported(torch.device("cuda")):
        pytest.skip("no FP8 GEMM on this GPU")
    g = torch.Generator(device="cuda").manual_seed(m)
    k, n = 4096, 1040
    w, ws = w8a8_ops.quantize_weight_per_channel(torch.randn(n, k, device="cuda", generator=g) * 0.02, FP8)
    x = (torch.randn(m, k, device="cuda", generator=g) * 2).to(torch.bfloat16)
    plain = w8a8_ops.w8a8_linear(x, w, ws, None, None)
    twin_x = act_twin.attach(x.clone(), *w8a8_ops.quantize_rows(x, FP8))
    assert torch.equal(w8a8_ops.w8a8_linear(twin_x, w, ws, None, None), plain)
    other = act_twin.attach(x.clone(), *w8a8_ops.quantize_rows(x * 2, FP8))
    assert not torch.allclose(w8a8_ops.w8a8_linear(other, w, ws, None, None).float(), plain.float(), rtol=0.5)


def _same_q8(out: torch.Tensor) -> None:
    """The q8 twin is `quantize_q8` of the output: the same d and sums; quants equal but where the kernels'
    float contraction rounds a tie of x * 127 / amax differently (one step, in at most 1 % of the elements)."""
    from pagedllm.model_executor.layers.quantization import gguf_triton as gt

    twin = act_twin.twin_of(out)
    assert isinstance(twin, act_twin.Q8Act)
    ref = gt.quantize_q8(out.reshape(-1, out.shape[-1]))
    assert torch.equal(twin.d, ref.d)
    diff = (twin.q.int() - ref.q.int()).abs()
    assert int(diff.max()) <= 1 and int((diff > 0).sum()) <= max(1, diff.numel() // 100)
    torch.testing.assert_close(twin.s, ref.s, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "cols"), [(1, 4096), (3, 576), (8, 14336)])
def test_q8_twins_of_norms_and_silu(dtype: torch.dtype, rows: int, cols: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows + cols)
    x = (torch.randn(rows, cols, device="cuda", generator=g) * 3).to(dtype)
    r = torch.randn(rows, cols, device="cuda", generator=g).to(dtype)
    w = (torch.rand(cols, device="cuda", generator=g) + 0.5).to(dtype)
    out = triton_ops.rms_norm(x, w, 1e-6, twin_kind="q8")
    _near(out, triton_ops.rms_norm(x, w, 1e-6))
    _same_q8(out)
    out2, res2 = triton_ops.fused_add_rms_norm(x, r, w, 1e-6, twin_kind="q8")
    _near(out2, triton_ops.fused_add_rms_norm(x, r, w, 1e-6)[0])
    _same_q8(out2)
    act = triton_ops.silu_and_mul(torch.cat([x, r], dim=1), twin_kind="q8")
    assert torch.equal(act, triton_ops.silu_and_mul(torch.cat([x, r], dim=1)))
    _same_q8(act)


def test_gguf_gemv_reads_the_q8_twin() -> None:
    """The int8 GEMV given the producer's twin gives its result without it (the twin is the same
    quantization); a twin of other rows changes it (the GEMV does read it)."""
    import numpy as np
    from gguf import GGMLQuantizationType

    from pagedllm.model_executor.layers.quantization import gguf as gq
    from pagedllm.model_executor.layers.quantization import gguf_triton as gt
    from tests.model_executor.gguf_triton_check import random_blocks

    n, k = 1000, 2048
    raw = random_blocks("Q4_1", n, k, np.random.default_rng(0))
    w = gt.prepare(gq.GGUFWeight(int(GGMLQuantizationType["Q4_1"]), torch.from_numpy(raw), n, k), "cuda")
    x = torch.randn(1, k, device="cuda").bfloat16()
    plain = gq.gguf_matmul(x, [w])
    twin_x = act_twin.attach(x.clone(), gt.quantize_q8(x))
    assert torch.equal(gq.gguf_matmul(twin_x, [w]), plain)
    other = act_twin.attach(x.clone(), gt.quantize_q8(x * 2))
    assert not torch.allclose(gq.gguf_matmul(other, [w]).float(), plain.float(), rtol=0.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_q8_quantizer_is_the_reference_at_exact_halves(dtype: torch.dtype) -> None:
    """`_q8_quant_kernel` (and so every twin compared with it above) quantizes as `q8_activations` does,
    bit for bit, on inputs made of exact halves (x = amax * (j + 0.5) / 127): the product rounds before its
    fraction is taken (an FMA there rounded such halves the other way on sm_90, session 42)."""
    from pagedllm.model_executor.layers.quantization import gguf_triton as gt

    g = torch.Generator(device="cuda").manual_seed(7)
    amax = torch.rand(64, 1, device="cuda", generator=g) * 4 + 0.25
    j = torch.randint(-126, 126, (64, 32), device="cuda", generator=g).float()
    x = (amax * (j + 0.5) / 127).to(dtype)
    x[:, 0] = amax[:, 0].to(dtype)  # each group's amax as an element
    x = x.reshape(8, 256)
    a = gt.quantize_q8(x)
    got = (a.q.float().view(8, -1, 32) * a.d.unsqueeze(-1)).view(8, 256)
    assert torch.equal(got, gt.q8_activations(x))
