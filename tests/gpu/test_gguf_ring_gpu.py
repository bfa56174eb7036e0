"""The ring GEMV (`gguf_ring_gemv`, Gluon, sm_90) on the device: one activation row of 4-bit GGUF weights.

Against the activations exactly as the GPU quantizer wrote them (int8 quants times their group's d) times the
`gguf` package's dequantized weights in float64: the kernel's only error is its float32 sums (relative 1e-5
of the largest output); a layout, ring-slot or tile error is O(1). Shapes: Llama-3.1-8B's, N odd (clamped rows
of the last tile), fewer tiles than programs, several tiles a program, K of 1 to 14 stages; launches with and
without PDL and each dependents' trigger; CUDA-graph replay; and `gguf_matmul` taking it under
`PAGEDLLM_GGUF_RING`."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from pagedllm.model_executor.layers.quantization import gguf as gq  # noqa: E402
from pagedllm.model_executor.layers.quantization import gguf_ring_gemv as rg  # noqa: E402
from pagedllm.model_executor.layers.quantization import gguf_triton as gt  # noqa: E402
from tests.gpu.test_gguf_gpu import _weight  # noqa: E402

if not rg.HAS_GLUON or torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("needs Gluon and a GPU of compute capability 9+", allow_module_level=True)

SHAPES = [(4096, 4096), (6144, 4096), (1027, 14336), (4096, 14336), (28672, 4096), (333, 2048), (5, 1024)]
CONFIGS = [rg.RingConfig(), rg.RingConfig(4, 1024, 4, 4, 1), rg.RingConfig(8, 1024, 8, 4, 2)]
PDL = {"PDL": 1, "launch_pdl": True}


def _run(name: str, n: int, k: int, config: rg.RingConfig, pdl: dict, trigger: int = 0) -> None:
    w, ref = _weight(name, n, k)
    x = torch.randn(1, k, device="cuda").bfloat16()
    q8 = gt.quantize_q8(x)
    ptrs, strides = gt._args(w)
    out = torch.full((1, n), float("nan"), device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    xq = q8.q.view(torch.int32)
    rg.gguf_ring_gemv(xq, q8.d, q8.s, ptrs, strides, w.qtype, n, k, out, sms, config, pdl, trigger)
    xf = (q8.q.double().view(1, k // 32, 32) * q8.d.double().view(1, k // 32, 1)).view(1, k)
    exact = xf @ ref.T
    err = ((out.double() - exact).abs().max() / exact.abs().max()).item()
    assert err <= 1e-5, f"{name} {n}x{k} {config}: relative error {err:.3g}"


@pytest.mark.parametrize("config", CONFIGS, ids=["default", "4x1024", "8x1024"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K"])
def test_ring_gemv(name: str, shape: tuple[int, int], config: rg.RingConfig) -> None:
    n, k = shape
    if name == "Q4_K" and k % 256:
        pytest.skip("K is not a multiple of the block")
    _run(name, n, k, config, {})


@pytest.mark.parametrize("pre", [-1, 0, 1])
@pytest.mark.parametrize("trigger", [0, 1, 2])
@pytest.mark.parametrize("name", ["Q4_1", "Q4_K"])
def test_ring_gemv_pdl(name: str, trigger: int, pre: int) -> None:
    for n, k in ((4096, 4096), (4096, 14336)):
        _run(name, n, k, rg.RingConfig(pre=pre), PDL, trigger)


@pytest.mark.parametrize("name", ["Q4_1", "Q4_K"])
def test_ring_in_cuda_graph_through_gguf_matmul(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`gguf_matmul` on one bf16 row takes the ring GEMV under PAGEDLLM_GGUF_RING=1 (counted), captured once
    and replayed with new activations; the Triton kernel's output within its own tolerance."""
    monkeypatch.setenv("PAGEDLLM_GGUF_RING", "1")
    calls = []
    real = gt.gguf_ring_gemv
    monkeypatch.setattr(gt, "gguf_ring_gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    w, ref = _weight(name, 4096, 4096)
    x = torch.randn(1, 4096, device="cuda").bfloat16()
    gq.gguf_matmul(x, [w], out_dtype=torch.float32)
    assert calls, "gguf_matmul did not take the ring GEMV"
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gq.gguf_matmul(x, [w], out_dtype=torch.float32)
    for seed in (1, 2):
        x.copy_(torch.randn(1, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        exact = gt.q8_activations(x).double() @ ref.T
        assert ((out.double() - exact).abs().max() / exact.abs().max()).item() <= 2e-3
        monkeypatch.setenv("PAGEDLLM_GGUF_RING", "0")
        triton_out = gq.gguf_matmul(x, [w], out_dtype=torch.float32)
        monkeypatch.setenv("PAGEDLLM_GGUF_RING", "1")
        torch.testing.assert_close(out, triton_out, rtol=1e-5, atol=1e-5 * triton_out.abs().max().item())
