"""Issue 19 on the device: the quantized GEMM kernels against dequantized float32 references, and the
engine on tiny quantized checkpoints against the dequantized HF model.

Kernels (random shapes incl. M=1, N not a multiple of the 64-wide tile, K an odd number of groups, groups
32/64/128): the int4 dequant-GEMM (prefill) and split-K GEMV (decode, M <= 8): float32 within 1e-5 of the
reference's scale (IEEE dot products), fp16/bf16 within 1e-2 (the dequantized tile is rounded to the
activation dtype); the per-token activation quantization (FP8 / INT8) equal to the torch path's codes;
the FP8 (`torch._scaled_mm`) and INT8 (`torch._int_mm`) GEMMs within 1e-2 of the emulated
math (bf16 output). The kernels also run on the CPU under TRITON_INTERPRET=1 (float32, small shapes)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.gpu.triton_env import DEVICE, INTERPRET, require_triton_device

pytestmark = pytest.mark.gpu

require_triton_device()

from pagedllm.model_executor.layers.quantization import int4_ops, w8a8_ops  # noqa: E402
from tests.model_executor.quantization import quant_ref as qr  # noqa: E402

# (M, K, N, group)
# (m, k, n, group); (2, 2048, 128, 128) splits K over programs (the last one of a column block sums the partials)
INT4_SHAPES = [(1, 96, 200, 32), (3, 192, 72, 64), (8, 384, 136, 128), (2, 2048, 128, 128), (17, 160, 200, 32),
               (33, 256, 64, 128)]  # fmt: skip
if not INTERPRET:
    INT4_SHAPES += [(1, 4096, 6144, 128), (5, 14336, 4096, 128), (64, 4096, 28672, 64), (300, 1024, 520, 32)]
DTYPES = [torch.float32] + ([] if INTERPRET else [torch.float16, torch.bfloat16])
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def _int4_problem(m: int, k: int, n: int, group: int, dtype: torch.dtype, seed: int = 0):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    q, z, s = qr.quantize_int4(w, group)
    s = s.to(dtype)
    ref_w = qr.int4_dequant(q, z, s, group)
    x = torch.randn(m, k, generator=g).to(dtype)
    ref = x.float() @ ref_w
    qweight = qr.pack_gptq_qweight(q).to(DEVICE)
    return x.to(DEVICE), qweight, z.to(torch.uint8).to(DEVICE), s.to(DEVICE), ref


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", INT4_SHAPES)
def test_int4_kernels_match_dequantized_reference(
    shape: tuple[int, int, int, int], dtype: torch.dtype, tiled: bool
) -> None:
    """Row-major packed weights and the GPU's column-tiled ones (`tile_columns`, where N is a multiple of 64)."""
    m, k, n, group = shape
    x, qweight, zeros, scales, ref = _int4_problem(m, k, n, group, dtype)
    if tiled:
        if n % int4_ops.TILE_N:
            pytest.skip("column tiles need N to be a multiple of 64")
        rows = qweight
        qweight = int4_ops.tile_columns(rows)
        assert qweight.dim() == 3 and torch.equal(int4_ops.untile_columns(qweight), rows)
    scale = float(ref.abs().max())
    outs = {"gemm": int4_ops.int4_gemm_triton(x, qweight, zeros, scales, group)}
    if m <= int4_ops.GEMV_MAX_M:
        outs["gemv"] = int4_ops.int4_gemv_triton(x, qweight, zeros, scales, group)
        outs["gemv again"] = int4_ops.int4_gemv_triton(x, qweight, zeros, scales, group)  # counters were reset
    outs["dispatch"] = int4_ops.int4_linear(x, qweight, zeros, scales, group, None)
    for name, out in outs.items():
        assert out.dtype == dtype and out.shape == (m, n)
        err = float((out.float().cpu() - ref).abs().max())
        assert err <= TOL[dtype] * scale, f"{name} {shape} {dtype}: error {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("qdtype", [w8a8_ops.FP8_DTYPE, torch.int8])
@pytest.mark.parametrize("static", [False, True])
def test_per_token_quantization_matches_torch(qdtype: torch.dtype, static: bool) -> None:
    if INTERPRET and qdtype == w8a8_ops.FP8_DTYPE:
        pytest.skip("the Triton 3.x interpreter converts to float8e4nv wrongly (125.1 -> 64); GPU only")
    x = (torch.randn(37, 520) * 3 * torch.exp(torch.randn(37, 1) * 2)).to(DEVICE)
    x[5] = 0.0  # an all-zero row keeps a finite scale
    static_scale = torch.tensor(0.02, device=DEVICE) if static else None
    q, s = w8a8_ops.quantize_rows(x, qdtype, static_scale)
    q_ref, s_ref = w8a8_ops._quantize_rows_torch(x, qdtype, static_scale)
    # torch on CUDA divides by a Python scalar as a product with its reciprocal: the scale may be an ulp apart
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    # each quotient is rounded as torch's `/` by our scale (Markstein's correction, w8a8_ops._div_rn)
    fp8 = qdtype == w8a8_ops.FP8_DTYPE
    quot = x.float() / s
    ref = quot.clamp(-w8a8_ops.FP8_MAX, w8a8_ops.FP8_MAX) if fp8 else quot.round().clamp(-128, 127)
    assert torch.equal(q.view(torch.int8), ref.to(qdtype).view(torch.int8))
    assert float((q.float() != q_ref.float()).float().mean()) < 1e-3  # the torch path's codes, but for rare flips


@pytest.mark.skipif(INTERPRET, reason="torch._scaled_mm / torch._int_mm need a GPU")
@pytest.mark.parametrize("qdtype", [w8a8_ops.FP8_DTYPE, torch.int8])
@pytest.mark.parametrize("m", [1, 7, 16, 17, 256])
def test_w8a8_gemm_matches_emulation(qdtype: torch.dtype, m: int) -> None:
    if qdtype == w8a8_ops.FP8_DTYPE and not w8a8_ops.fp8_supported(torch.device("cuda")):
        pytest.skip("no FP8 on this GPU")
    torch.manual_seed(0)
    k, n = 4096, 1040
    w, ws = w8a8_ops.quantize_weight_per_channel(torch.randn(n, k, device="cuda") * 0.02, qdtype)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = w8a8_ops.w8a8_linear(x, w, ws, None, bias)
    xq, xs = w8a8_ops.quantize_rows(x, qdtype)
    ref = w8a8_ops._emulated(xq, xs, w, ws, bias)
    assert out.dtype == torch.bfloat16
    err = float((out.float() - ref).abs().max())
    assert err <= 1e-2 * float(ref.abs().max())


@pytest.mark.parametrize("qdtype", [w8a8_ops.FP8_DTYPE, torch.int8])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 300, 72), (4, 520, 33), (2, 4096, 1040)])
@pytest.mark.parametrize("static", [False, True])
def test_w8a8_decode_gemv(qdtype: torch.dtype, m: int, k: int, n: int, static: bool) -> None:
    """The decode GEMV with the per-token quantization fused in: the emulated W8A8 math (torch quantizer,
    float32 products) within 1e-5 of the output's scale in float32, 1e-2 in bf16."""
    if INTERPRET and qdtype == w8a8_ops.FP8_DTYPE:
        pytest.skip("the Triton interpreter converts to float8e4nv wrongly; GPU only")
    if INTERPRET and k > 1024:
        pytest.skip("large shape: GPU only")
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    w, ws = w8a8_ops.quantize_weight_per_channel(torch.randn(n, k, generator=g) * 0.02, qdtype)
    x = (torch.randn(m, k, generator=g) * 2).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    static_scale = torch.tensor(0.02) if static else None
    xq, xs = w8a8_ops._quantize_rows_torch(x, qdtype, static_scale)
    ref = w8a8_ops._emulated(xq, xs, w, ws, bias)
    dev = torch.device(DEVICE)
    out = w8a8_ops.w8a8_gemv(x.to(dev), w.to(dev), ws.to(dev), static_scale.to(dev) if static else None, bias.to(dev))
    err = float((out.float().cpu() - ref).abs().max())
    assert err <= (1e-5 if dtype == torch.float32 else 1e-2) * float(ref.abs().max()), err


@pytest.mark.skipif(INTERPRET, reason="needs a GPU")
def test_fp8_device_check() -> None:
    from pagedllm.model_executor.layers.quantization.fp8 import check_fp8_device

    dev = torch.device("cuda")
    if w8a8_ops.fp8_supported(dev):
        check_fp8_device(dev, "quantization='fp8'")
    else:
        with pytest.raises(ValueError, match="compute capability"):
            check_fp8_device(dev, "quantization='fp8'")


# ---- the engine on tiny quantized checkpoints (float32 model, CUDA graphs on) ------------------------

ENGINE_CASES = ["int4-awq-32", "int4-gptq-128", "ct-int8-dynamic", "fp8-online", "ct-fp8-static", "fp8-fp8-dynamic"]


@pytest.mark.skipif(INTERPRET, reason="the engine test needs a GPU")
@pytest.mark.parametrize("case", ENGINE_CASES)
def test_engine_on_quantized_checkpoint_matches_reference(case: str, tmp_path) -> None:  # noqa: ANN001
    from pagedllm import LLM, SamplingParams, TokensPrompt
    from tests.hf_utils import compare_greedy, hf_greedy
    from tests.model_executor.quantization.test_quant_checkpoints import build_case
    from tests.utils_model import VOCAB

    if ("fp8" in case) and not w8a8_ops.fp8_supported(torch.device("cuda")):
        pytest.skip("no FP8 on this GPU")
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 5, 17, 40, 9, 30, 3, 12)]
    ref_model, path, kwargs = build_case(case, tmp_path, prompts)
    refs = [hf_greedy(ref_model, p, 16) for p in prompts]
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=128, kv_cache_memory_bytes=64 << 20,
              max_num_batched_tokens=32, **kwargs)  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    # int4 (weight-only) sums in float32: the float32 policy. The 8-bit formats quantize activations: the
    # reference fake-quantizes them as the engine does (IEEE division, round to nearest even), but a 1-ulp
    # difference upstream (the norm kernels) can still put a value on the other side of a rounding boundary,
    # one FP8 / int8 step (1/16 relative) instead of an ulp: the bf16 policy's tie bound for those.
    tol_dtype = torch.float32 if case.startswith("int4") else torch.bfloat16
    for p, o, r in zip(prompts, outs, refs):
        compare_greedy(ref_model, p, list(o.outputs[0].token_ids), r, tol_dtype)


# ---- FP8 KV cache: the cache write quantizes, the attention kernel dequantizes ----------------------

KV_CASES = [([1, 1, 1], [5, 40, 17]), ([7, 1, 20], [0, 33, 9]), ([1], [150])]  # (one request: 32-key tiles)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize(("q_lens", "ctx_lens"), KV_CASES)
def test_fp8_kv_cache_kernels(kv_dtype: torch.dtype, q_lens: list[int], ctx_lens: list[int]) -> None:
    """`reshape_and_cache` stores fp8(x / scale) (the torch quantizer's bytes, saturated), and
    `paged_attention` over the FP8 cache with the scales equals the same kernel over a float32 cache holding
    the dequantized values (1e-5 relative in float32; 1e-2 in bf16, which rounds the dequantized K/V)."""
    from pagedllm.attention import kv_quant
    from pagedllm.attention.ops.triton_paged_attn import paged_attention, request_order, reshape_and_cache

    if INTERPRET and kv_dtype == torch.float8_e4m3fn:
        pytest.skip("the Triton interpreter converts to float8e4nv wrongly; GPU only")
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    h, kvh, d, bs = 4, 2, 64, 16
    seq = [c + q for c, q in zip(ctx_lens, q_lens)]
    nblk = [(s + bs - 1) // bs for s in seq]
    num_blocks = 1 + sum(nblk)
    block_table = torch.zeros(len(seq), max(nblk), dtype=torch.int32)
    slots_all, next_blk = [], 1
    for r, n in enumerate(nblk):
        block_table[r, :n] = torch.arange(next_blk, next_blk + n, dtype=torch.int32)
        slots_all.append([(next_blk + p // bs) * bs + p % bs for p in range(seq[r])])
        next_blk += n
    k = torch.randn(sum(seq), kvh, d, generator=g).to(dtype) * 3
    v = torch.randn(sum(seq), kvh, d, generator=g).to(dtype) * 3
    k[0, 0, 0] = 1e4  # saturates
    ks = torch.tensor([0.02], device=DEVICE)
    vs = torch.tensor([0.05], device=DEVICE)
    slots = torch.tensor([s for row in slots_all for s in row], dtype=torch.int64)
    kc = torch.zeros(num_blocks, bs, kvh, d, dtype=kv_dtype, device=DEVICE)
    vc = torch.zeros_like(kc)
    reshape_and_cache(k.to(DEVICE), v.to(DEVICE), kc, vc, slots.to(DEVICE), (ks, vs))
    for cache, x, sc in ((kc, k, ks), (vc, v, vs)):
        ref_q = kv_quant.quantize(x, sc.cpu(), kv_dtype)
        got = cache.view(torch.uint8).view(-1, kvh, d).cpu()[slots].view(kv_dtype)
        if not INTERPRET:  # the interpreter's float32 -> float8 conversion is off by up to two steps
            assert torch.equal(got.view(torch.uint8), ref_q.view(torch.uint8))

    q_tokens = sum(q_lens)
    query = (torch.randn(q_tokens, h, d, generator=g) * 0.5).to(dtype).to(DEVICE)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    seq_t = torch.tensor(seq, dtype=torch.int32, device=DEVICE)
    bt = block_table.to(DEVICE)
    kw = dict(num_actual_tokens=q_tokens, num_reqs=len(seq), max_query_len=max(q_lens), scale=d**-0.5)
    kf = kv_quant.dequantize(kc, ks, dtype)
    vf = kv_quant.dequantize(vc, vs, dtype)
    ref = torch.empty_like(query)
    paged_attention(query, kf, vf, ref, bt, seq_t, qsl, **kw)  # type: ignore[arg-type]
    # As the engine launches it too: a mixed batch's decodes apart (num_decodes), a decode batch longest first
    # (req_order), and split into two key segments.
    n_dec = sum(q == 1 for q in q_lens)
    variants: list[dict] = [{}, {"split": 2}]
    variants.append({"num_decodes": n_dec} if n_dec < len(q_lens) else {"req_order": request_order(seq_t, len(seq))})
    for extra in variants:
        out = torch.empty_like(query)
        split = extra.pop("split", 1)
        if split > 1 and max(q_lens) > 1:
            continue
        paged_attention(query, kc, vc, out, bt, seq_t, qsl, kv_scales=(ks, vs), num_splits=split, **kw, **extra)  # type: ignore[arg-type]
        err = float((out.float() - ref.float()).norm() / ref.float().norm())
        assert err < (1e-5 if dtype == torch.float32 else 1e-2), (extra, split, err)


@pytest.mark.skipif(INTERPRET, reason="the engine test needs a GPU")
@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e5m2"])
def test_engine_fp8_kv_cache_matches_reference(kv_dtype: str, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The engine with an FP8 KV cache on the GPU (decode CUDA graphs, chunked prefill, prefix-cache hits on
    the second round) against HF's float32 model whose attention sees the same fake-quantized K/V."""
    from safetensors.torch import load_file, save_file

    from pagedllm import LLM, SamplingParams, TokensPrompt
    from tests.hf_utils import compare_greedy, hf_greedy
    from tests.model_executor.quantization.test_kv_cache_fp8 import DTYPES, FP8KVReference
    from tests.utils_model import VOCAB, make_tiny_hf_model

    rng = random.Random(0)
    base = [rng.randrange(VOCAB) for _ in range(20)]
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 5, 40, 9)] + [base + [1, 2], base + [3]]
    model = make_tiny_hf_model("llama", tmp_path)
    ref = FP8KVReference(monkeypatch, DTYPES[kv_dtype])
    scales = ref.calibrate(model, prompts)
    state = load_file(str(tmp_path / "model.safetensors"))
    for i, (ks, vs) in scales.items():
        state[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(ks)
        state[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(vs)
    save_file(state, str(tmp_path / "model.safetensors"))
    ref.scales = scales
    model = model.to("cuda")
    refs = [hf_greedy(model, p, 16) for p in prompts]
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, max_model_len=128,
              kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=32, kv_cache_dtype=kv_dtype)  # fmt: skip
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    assert runner.cuda_graphs is not None
    assert all(c.dtype == DTYPES[kv_dtype] for c in runner.kv_caches.values())
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False)
    for _ in range(2):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        for p, o, r in zip(prompts, outs, refs):
            compare_greedy(model, p, list(o.outputs[0].token_ids), r, torch.float32)
