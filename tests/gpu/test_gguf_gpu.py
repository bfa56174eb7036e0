"""Issue 20 on the device: the GGUF Triton kernels (`quantization.gguf_triton`) on CUDA and a .gguf model kept
packed on the GPU.

Kernels, every type, M = 1 / 5 (the split-K decode GEMV) and 33 / 300 (the dequant-GEMM), N odd and K a
few blocks up to Llama-3.1-8B's 14336: float32 activations with IEEE dot products against the `gguf`
package's dequantization times a float64 matmul (relative error <= 1e-5), bfloat16 activations within
2e-2 of the largest output (the GEMM rounds the dequantized tile to bf16, the reference does not; the decode
GEMV quantizes 16-bit activations to int8 per group of 32 for Q4_0 / Q4_1 / Q4_K / Q8_0, checked against
that quantization within 2e-3). A decode
GEMV captured in a CUDA graph replays correctly with new inputs (the split-K counters are reset by the
kernel). The engine: the SmolLM2 Q4_1 GGUF (Q8_0 LM head) packed on CUDA gives the same greedy tokens in
float32 as the same file dequantized at load (`gguf_dequantize=True`). The same kernel checks run on the
CPU under the Triton interpreter at small shapes (tests/model_executor/test_gguf_triton.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

from pagedllm.model_executor.layers.quantization import gguf as gq  # noqa: E402
from pagedllm.model_executor.layers.quantization import gguf_triton as gt  # noqa: E402
from tests.model_executor.gguf_qkv_rope_check import GPU_CASES as ROPE_CASES  # noqa: E402
from tests.model_executor.gguf_qkv_rope_check import run_case as run_rope_case  # noqa: E402
from tests.model_executor.gguf_triton_check import TYPES, random_blocks, reference  # noqa: E402

SHAPES = [(1, 4096, 4096), (1, 1027, 14336), (5, 333, 2048), (33, 515, 1024), (300, 1000, 2304)]  # (M, N, K)


@pytest.fixture(autouse=True)
def _ieee() -> object:
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _weight(name: str, n: int, k: int, seed: int = 0) -> tuple[gq.GGUFTritonWeight, torch.Tensor]:
    raw = random_blocks(name, n, k, np.random.default_rng(seed))
    w = gq.GGUFWeight(int(GGMLQuantizationType[name]), torch.from_numpy(raw), n, k)
    return gt.prepare(w, "cuda"), torch.from_numpy(reference(name, raw, k)).cuda()


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
@pytest.mark.parametrize("name", TYPES)
def test_kernels_float32_and_bf16(name: str, shape: tuple[int, int, int]) -> None:
    m, n, k = shape
    if k % GGML_QUANT_SIZES[GGMLQuantizationType[name]][0]:
        pytest.skip("K is not a multiple of the block")
    w, ref = _weight(name, n, k)
    x = torch.randn(m, k, device="cuda")
    exact = x.double() @ ref.T
    out = gq.gguf_matmul(x, [w])
    assert out.dtype == torch.float32
    err = ((out.double() - exact).abs().max() / exact.abs().max()).item()
    assert err <= 1e-5, f"float32: relative error {err:.3g}"
    xb = x.bfloat16()
    out_b = gq.gguf_matmul(xb, [w])
    assert out_b.dtype == torch.bfloat16
    exact_b = xb.double() @ ref.T
    err_b = ((out_b.double() - exact_b).abs().max() / exact_b.abs().max()).item()
    assert err_b <= 2e-2, f"bfloat16: relative error {err_b:.3g}"


def test_mixed_parts_bias_float32_logits() -> None:
    k = 2048
    ws = [_weight(t, n, k, seed=i) for i, (t, n) in enumerate((("Q4_K", 300), ("Q6_K", 77), ("Q8_0", 129)))]
    parts = [w for w, _ in ws]
    ref = torch.cat([r for _, r in ws])
    bias = torch.randn(ref.shape[0], device="cuda")
    for m in (1, 7, 40):
        x = torch.randn(m, k, device="cuda").bfloat16()
        out = gq.gguf_matmul(x, parts, bias, out_dtype=torch.float32)
        assert out.dtype == torch.float32
        exact = x.double() @ ref.T + bias.double()
        assert ((out.double() - exact).abs().max() / exact.abs().max()).item() <= 2e-2


INT8_SHAPES = [(1, 6144, 4096), (1, 4096, 14336), (5, 333, 2048), (8, 1027, 1280)]  # (M, N, K)


@pytest.mark.parametrize("shape", INT8_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in INT8_SHAPES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K"])
def test_int8_activation_gemv(name: str, dtype: torch.dtype, shape: tuple[int, int, int]) -> None:
    """16-bit activations take the IDP4A GEMV: against the activations quantized as it does
    (`gguf_triton.q8_activations`) times the dequantized weights in float64. The bound leaves room for a
    quant off by one where the GPU's float rounding differs from torch's at a tie (~4e-4 each, seen on the
    CPU's interpreter against a torch that divided by a reciprocal); a layout error is O(1)."""
    m, n, k = shape
    if k % GGML_QUANT_SIZES[GGMLQuantizationType[name]][0]:
        pytest.skip("K is not a multiple of the block")
    w, ref = _weight(name, n, k)
    x = torch.randn(m, k, device="cuda").to(dtype)
    assert gt.int8_activations(w.qtype, x.dtype)
    out = gq.gguf_matmul(x, [w], out_dtype=torch.float32)
    exact = gt.q8_activations(x).double() @ ref.T
    err = ((out.double() - exact).abs().max() / exact.abs().max()).item()
    assert err <= 2e-3, f"relative error {err:.3g} against the int8 activations"


VARIANT_LAUNCHES = [(4, 512, 1, 1, 1), (2, 4096, 2, 1, 1), (2, 1024, 2, 1, 3)]


@pytest.mark.parametrize("preload", [False, True], ids=["plain", "pre"])
@pytest.mark.parametrize("launch", VARIANT_LAUNCHES, ids=["x".join(map(str, c)) for c in VARIANT_LAUNCHES])
@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q4_K"])
def test_int8_gemv_variants_same_bits(name: str, launch: tuple[int, ...], preload: bool) -> None:
    """The int8 GEMV's OPQ variant (`GemvConfig.flags`: scale loads in their users' layout) does the same
    arithmetic in the same order: bit for bit the plain launch, M = 1 and 3, N odd, split-K too."""
    w, _ = _weight(name, 1031, 4096)
    for m in (1, 3):
        x = torch.randn(m, 4096, device="cuda").to(torch.bfloat16)
        outs = []
        for flags in (0, gt.OPQ):
            out = torch.full((m, 1031), float("nan"), device="cuda")
            gt.gguf_gemv_triton(x, w, out, config=gt.GemvConfig(*launch, flags), preload=preload)
            outs.append(out)
        assert not outs[0].isnan().any()
        for out in outs[1:]:
            torch.testing.assert_close(out, outs[0], rtol=0, atol=0)


@pytest.mark.parametrize("variant", [(0, False), (gt.OPQ, True)], ids=["plain", "opq-pre"])
@pytest.mark.parametrize("case", ROPE_CASES)
def test_qkv_rope_epilogue_same_bits(case: str, variant: tuple[int, bool]) -> None:
    """The int8 qkv GEMV with RoPE and the K / V cache write in its epilogue: bit for bit the GEMV followed by the
    RoPE launch, output and cache (`gguf_qkv_rope_check`; also under the interpreter in CI)."""
    assert run_rope_case(case, "cuda", *variant) == {"out": 0, "cache": 0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", ["Q4_1", "Q4_K", "Q6_K"])
def test_decode_gemv_in_cuda_graph(name: str, dtype: torch.dtype) -> None:
    """Captured once, replayed with new activations (twice, so the split-K counters must be back at 0)."""
    w, ref = _weight(name, 4096, 4096)
    x = torch.randn(1, 4096, device="cuda").to(dtype)
    gq.gguf_matmul(x, [w])  # eager first: compiles, allocates the split-K counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gq.gguf_matmul(x, [w])
    for seed in (1, 2):
        x.copy_(torch.randn(1, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        q8 = gt.int8_activations(w.qtype, x.dtype)
        exact = (gt.q8_activations(x) if q8 else x).double() @ ref.T
        tol = 6e-3 if q8 else 1e-5 if dtype == torch.float32 else 2e-2  # (bf16 out: rounded to 2^-9)
        assert ((out.double() - exact).abs().max() / exact.abs().max()).item() <= tol
        torch.testing.assert_close(out, gq.gguf_matmul(x, [w]), rtol=0, atol=0)  # the eager call: same bits


def test_engine_packed_on_cuda_matches_dequantized(
    smollm2_path: str, smollm2_prompt_ids: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy tokens of the packed engine (decode CUDA graphs, Triton kernels) equal the dequantized one's
    (float32 both: only the summation order differs) on 5 prompts x 24 tokens."""
    from pagedllm import LLM, SamplingParams, TokensPrompt
    from pagedllm.model_executor.layers.linear import LinearBase

    prompts = [TokensPrompt(prompt_token_ids=p) for p in smollm2_prompt_ids[:5]]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kw = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=256 << 20)
    monkeypatch.setenv("PAGEDLLM_GGUF_CUDA_PACKED", "1")  # opt-in until verified on a GPU
    packed = LLM(smollm2_path, **kw)
    runner = packed.llm_engine.engine_core.engine_core.executor.worker.model_runner
    linears = [m for m in runner.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(isinstance(p, gq.GGUFTritonWeight) for m in linears for p in m.quant_method.parts)
    assert all(isinstance(p, gq.GGUFTritonWeight) for p in runner.model.lm_head.gguf_weight)
    assert runner.cuda_graphs is not None
    ours = [list(o.outputs[0].token_ids) for o in packed.generate(prompts, sp, use_tqdm=False)]
    del packed, runner, linears
    torch.cuda.empty_cache()
    dense = LLM(smollm2_path, gguf_dequantize=True, **kw)
    ref = [list(o.outputs[0].token_ids) for o in dense.generate(prompts, sp, use_tqdm=False)]
    assert ours == ref
