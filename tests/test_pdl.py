"""Programmatic dependent launch (triton_utils.pdl_args): the setting's parsing, and, compiled for sm_90 on this
CPU box, the invariant every PDL kernel relies on: its programs wait for the predecessor (`griddepcontrol.wait`)
in the kernel's entry block, before any branch and before any global memory access (but the loads of weights
of the kernels that read theirs first). A kernel that touched memory first, or whose programs could return
without waiting, could read a predecessor's output before it is written (the GPU check of the whole engine is
benchmarks/pdl_check.py)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from pagedllm import triton_utils
from pagedllm.triton_utils import HAS_GDC, HAS_TRITON, pdl_args, pdl_mode_of


def test_pdl_mode_of() -> None:
    assert pdl_mode_of("1", True) == 1
    assert pdl_mode_of(" On ", True) == 1
    assert pdl_mode_of("0", True) == 0
    assert pdl_mode_of("1", False) == 0
    for bad in ("late", "early"):
        with pytest.raises(ValueError, match="PAGEDLLM_PDL"):
            pdl_mode_of(bad, True)


def test_pdl_early_kernels() -> None:
    """PAGEDLLM_PDL_EARLY picks the early kernels; PAGEDLLM_PDL=0 none; a misspelt name is an error naming the
    variable, not a silently ordinary launch."""
    assert pdl_mode_of("1", True, "recv", "push, recv") == 2
    assert pdl_mode_of("1", True, "gemv", "push+recv") == 1 and pdl_mode_of("1", True, "push", "push+recv") == 2
    assert pdl_mode_of("1", True, "gemv", "all") == 2
    assert pdl_mode_of("1", True, "gemv", "") == 1
    assert pdl_mode_of("0", True, "recv", "recv") == 0
    assert pdl_mode_of("1", False, "recv", "recv") == 0
    with pytest.raises(ValueError, match="PAGEDLLM_PDL_EARLY"):
        pdl_mode_of("1", True, "recv", "recieve")
    with pytest.raises(ValueError, match="kernel name"):
        pdl_mode_of("1", True, "gemm", "")
    assert set(triton_utils.KERNELS) >= {"norm", "gemv", "push", "recv"}


def test_no_pdl_off_cuda() -> None:
    assert pdl_args(torch.zeros(1, 8, dtype=torch.bfloat16), "norm") == {}


def test_pdl_only_in_one_row_16_bit_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """PDL only where every kernel boundary is between kernels of ours (triton_utils): one token, 16-bit
    activations, the row GEMVs on (with them off, cuBLAS follows the norms)."""
    from pagedllm import envs

    one, many = torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(16, 8, dtype=torch.bfloat16)
    assert triton_utils.one_row_step(one, 1) and triton_utils.one_row_step(one.half(), 1)
    assert not triton_utils.one_row_step(many, 16) and not triton_utils.one_row_step(one.float(), 1)
    monkeypatch.setattr(envs, "PAGEDLLM_ROW_GEMV", False, raising=False)
    triton_utils.row_gemv_on.cache_clear()
    try:
        assert not triton_utils.one_row_step(one, 1)
    finally:
        monkeypatch.undo()
        triton_utils.row_gemv_on.cache_clear()


def test_pdl_off_names_known_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm import envs

    monkeypatch.setattr(envs, "PAGEDLLM_PDL_OFF", "pull+norm", raising=False)
    triton_utils._pdl_switches.cache_clear()
    try:
        assert triton_utils._pdl_switches()[1] == {"pull", "norm"}
        monkeypatch.setattr(envs, "PAGEDLLM_PDL_OFF", "pul", raising=False)
        triton_utils._pdl_switches.cache_clear()
        with pytest.raises(ValueError, match="PAGEDLLM_PDL_OFF"):
            triton_utils._pdl_switches()
    finally:
        monkeypatch.undo()
        triton_utils._pdl_switches.cache_clear()


_MEM = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:ld|st|atom|red|cp\.async|prefetch)\.(?!param|shared|local|const)", re.M)


_EARLY_EXITS = {"paged_attn_early", "paged_attn_early_rope", "paged_attn_early_late"}
"""Kernels whose programs may leave before the wait (the decode attention's segments past the keys: segment 0 of
the first request always waits, so the launch cannot complete before its predecessor)."""
_PRELOADS = {
    "add_rms_norm_twin",
    "add_rms_norm_q8_twin",
    "add_rms_norm_q8_twin_split",
    "rope_cache",
    "gguf_gemv_int8_rope",
} | _EARLY_EXITS
"""Kernels that read before the wait what no kernel of a step writes: weights (the norms'), the step's uploaded
inputs (positions, slots, query starts, lengths, block tables) and constant tables (RoPE's cos / sin)."""


def _kernels() -> list[tuple[str, Any, dict[str, Any], dict[str, str]]]:
    from pagedllm.attention.ops import triton_paged_attn_kernels as attn
    from pagedllm.attention.ops import triton_rope_cache as rope
    from pagedllm.distributed import fused_allreduce_norm as pull
    from pagedllm.distributed import push_allreduce as push
    from pagedllm.model_executor.layers import triton_gemv, triton_ops
    from pagedllm.model_executor.layers.quantization import gguf_triton_int8 as gguf_int8
    from pagedllm.model_executor.layers.quantization import gguf_triton_kernels as gguf_kern
    from pagedllm.model_executor.layers.quantization import w8a8_ops

    bf = "*bf16"
    gemv_ptrs = dict(x_ptr=bf, w_ptr=bf, b_ptr=bf, y_ptr=bf, a_ptr=bf, slot_ptr="*i32", s_ptr="*fp32")
    gemv_ptrs.update(part_ptr="*fp32", cnt_ptr="*i32", epoch_ptr="*i64", push_addr="i64")
    gemv = dict(HAS_BIAS=False, HAS_LORA=False, EVEN=True, EVEN_A=True, PUSH=False, GLU=False, BLOCK_N=1, BLOCK_K=512)
    norm_ptrs = dict(x_ptr=bf, res_ptr=bf, out_ptr=bf, res_out_ptr=bf, w_ptr=bf, eps="fp32", q_ptr="*fp8e4nv")
    norm_ptrs.update(qs_ptr="*fp32", recv_ptr="*i16", epoch_ptr="*i64", buf_ptrs="*u64", flag_ptrs="*u64")
    norm = dict(HAS_RESIDUAL=True, BLOCK=4096, PARTS=1, QUANT=1, SPLIT=1)
    q8_ptrs = dict(norm_ptrs, q_ptr="*i8", qs_ptr="*fp32", qm_ptr="*fp32", d_ptr="*fp32", s_ptr="*fp32")
    gguf_ptrs = dict(x_ptr=bf, xq_ptr="*i32", xd_ptr="*fp32", xs_ptr="*fp32", lo_ptr="*i32", hi_ptr="*i32")
    gguf_ptrs.update(d_ptr="*fp16", dm_ptr="*fp16", sc_ptr="*u8", mn_ptr="*u8", part_ptr="*fp32", out_ptr=bf)
    gguf_ptrs.update(cnt_ptr="*i32", pos_ptr="*i64", cos_sin_ptr="*fp32", slot_ptr="*i64", kv_ptr=bf)
    gguf8 = dict(QT=3, BN=2, BK=1024, EVEN_K=True, ASM=True, PRE=False, HEAD=0, CACHE_BLOCK=1)
    gguf_f = dict(QT=14, EPW=8, G=16, BN=64, BK=256, EVEN_K=True)
    w8_ptrs = dict(x_ptr=bf, w_ptr="*fp8e4nv", ws_ptr="*fp32", out_ptr=bf, xq_ptr="*fp8e4nv", xs_ptr="*fp32")
    w8_ptrs.update(static_ptr="*fp32", bias_ptr="*fp32")
    w8 = dict(QMAX=448.0, IS_INT=False, STATIC=False, HAS_BIAS=False, BN=16, BK=512, AB=4096, H2=True, FLUSH=4)
    attn_ptrs = dict(out_ptr=bf, q_ptr=bf, k_cache_ptr=bf, v_cache_ptr=bf, block_table_ptr="*i32")
    attn_ptrs.update(seq_lens_ptr="*i32", qsl_ptr="*i32", part_out_ptr="*fp32", part_m_ptr="*fp32")
    attn_ptrs.update(part_l_ptr="*fp32", k_scale_ptr="*fp32", v_scale_ptr="*fp32", key_limit_ptr="*i32")
    attn_ptrs.update(order_ptr="*i32", qk_scale="fp32", softcap="fp32", count_ptr="*i32")
    attn_ptrs.update(tq_ptr="*i8", td_ptr="*fp32", ts_ptr="*fp32", pos_ptr="*i64", cos_sin_ptr="*fp32")
    attn_ptrs.update(knew_ptr=bf, vnew_ptr=bf, slot_ptr="*i64")
    attn_c = dict(GROUP=4, HEAD_SIZE=128, HEAD_PAD=128, BLOCK_SIZE=16, BLOCK_M=16, BLOCK_Q=4, TILE_N=64, CAUSAL=True)
    attn_c.update(USE_WINDOW=False, NUM_SEGMENTS=16, DOT_PREC="tf32", FILTER=1, DIRECT=True, SOFTCAP=False)
    attn_c.update(KV_FP8=False, KEY_LIMIT=False, ORDERED=False, FP8_F16=False, MERGE_HEADS=4, TWIN=False, ROPE=False)
    attn_c.update(SEG_CHUNK=16, EARLY=False, LATE_TRIGGER=False)
    rope_ptrs = dict(q_ptr=bf, k_ptr=bf, pos_ptr="*i64", cos_sin_ptr="*fp32", qw_ptr=bf, kw_ptr=bf, eps="fp32")
    rope_ptrs.update(v_ptr=bf, slot_ptr="*i64", k_cache_ptr=bf, v_cache_ptr=bf)
    rope_c = dict(HEAD_SIZE=128, HALF=64, BLOCK_H=32, BLOCK_KH=8, BLOCK_HALF=64, HAS_NORM=False, WRITE_CACHE=True)
    rope_c.update(CACHE_BLOCK=16, BLOCK_D=128)
    return [
        ("row_gemv", triton_gemv._row_gemv_kernel, gemv, gemv_ptrs),
        ("row_gemv_glu", triton_gemv._row_gemv_kernel, dict(gemv, GLU=True), gemv_ptrs),
        ("row_gemv_push", triton_gemv._row_gemv_kernel, dict(gemv, PUSH=True), gemv_ptrs),
        ("row_gemv_lora", triton_gemv._row_gemv_kernel, dict(gemv, HAS_LORA=True, BLOCK_N=16), gemv_ptrs),
        (
            "add_rms_norm_twin",
            triton_ops._rms_norm_kernel,
            norm,
            norm_ptrs,
        ),
        ("silu_and_mul", triton_ops._silu_and_mul_kernel, dict(BLOCK=1024, QUANT=0), norm_ptrs),
        ("silu_and_mul_fp8_twin", triton_ops._silu_and_mul_kernel, dict(BLOCK=16384, QUANT=1), norm_ptrs),
        ("silu_and_mul_q8_twin", triton_ops._silu_and_mul_kernel, dict(BLOCK=1024, QUANT=2), q8_ptrs),
        ("add_rms_norm_q8_twin", triton_ops._rms_norm_kernel, dict(norm, QUANT=2), q8_ptrs),
        ("add_rms_norm_q8_twin_split", triton_ops._rms_norm_kernel, dict(norm, QUANT=2, SPLIT=8), q8_ptrs),
        ("gguf_q8_quant", gguf_int8._q8_quant_kernel, dict(BLOCK=1024), q8_ptrs),
        ("gguf_gemv_int8", gguf_int8._gguf_gemv_q8a_kernel, gguf8, gguf_ptrs),
        ("gguf_gemv_int8_rope", gguf_int8._gguf_gemv_q8a_kernel, dict(gguf8, HEAD=128, CACHE_BLOCK=16), gguf_ptrs),
        ("gguf_gemv_float", gguf_kern._gguf_gemv_kernel, gguf_f, gguf_ptrs),
        ("w8a8_gemv", w8a8_ops._w8a8_gemv_kernel, dict(w8, EVEN=True, PIPE=3, PRE=False), w8_ptrs),
        ("w8a8_gemv_pre", w8a8_ops._w8a8_gemv_kernel, dict(w8, EVEN=False, PIPE=3, PRE=True), w8_ptrs),
        ("push_recv_norm", push._recv_add_norm_kernel, dict(RANK=1, BLOCK=4096), norm_ptrs),
        (
            "pull_allreduce_norm",
            pull._all_reduce_add_norm_kernel,
            dict(RANK=0, WORLD=2, MAXP=128, BLOCK=4096),
            norm_ptrs,
        ),
        ("rope_cache", rope._rope_kernel, rope_c, rope_ptrs),
        ("paged_attn", attn._paged_attn_kernel, attn_c, attn_ptrs),
        ("paged_attn_one_segment", attn._paged_attn_kernel, dict(attn_c, NUM_SEGMENTS=1), attn_ptrs),
        ("paged_attn_q8_twin", attn._paged_attn_kernel, dict(attn_c, TWIN=True), attn_ptrs),
        ("paged_attn_merge_chunk", attn._paged_attn_kernel, dict(attn_c, TWIN=True, SEG_CHUNK=4), attn_ptrs),
        ("paged_attn_rope", attn._paged_attn_kernel, dict(attn_c, ROPE=True, TWIN=True), attn_ptrs),
        ("paged_attn_rope_one_segment", attn._paged_attn_kernel, dict(attn_c, ROPE=True, NUM_SEGMENTS=1), attn_ptrs),
        ("paged_attn_early", attn._paged_attn_kernel, dict(attn_c, EARLY=True, TWIN=True), attn_ptrs),
        (
            "paged_attn_early_late",
            attn._paged_attn_kernel,
            dict(attn_c, EARLY=True, TWIN=True, LATE_TRIGGER=True),
            attn_ptrs,
        ),
        ("paged_attn_early_rope", attn._paged_attn_kernel, dict(attn_c, EARLY=True, ROPE=True), attn_ptrs),
    ]


def _ptx(fn: Any, consts: dict[str, Any], ptrs: dict[str, str]) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            constexprs[(i,)] = consts[name]
        else:
            signature[name] = ptrs.get(name, "i32")
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs={})
    options = {"num_warps": 4, "num_stages": 1, "launch_pdl": True}
    return str(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"])


def _ptx_or_skip(fn: Any, consts: dict[str, Any], ptrs: dict[str, str]) -> str:
    """`_ptx`, the test skipped where this Triton build cannot compile for sm_90 (no ptxas, no NVIDIA backend);
    a kernel that does not compile fails it."""
    from triton.compiler.errors import CompilationError

    try:
        return _ptx(fn, consts, ptrs)
    except CompilationError:
        raise
    except Exception as e:
        pytest.skip(f"no sm_90 compile here: {type(e).__name__}: {str(e)[:200]}")


@pytest.mark.skipif(not (HAS_TRITON and HAS_GDC), reason="needs a Triton with grid dependency control")
@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("name", [k[0] for k in _kernels()] if HAS_TRITON else [])
def test_wait_comes_first(name: str, mode: int) -> None:
    _, fn, consts, ptrs = next(k for k in _kernels() if k[0] == name)
    ptx = _ptx_or_skip(fn, dict(consts, PDL=mode), ptrs)
    body = ptx[ptx.index("{", ptx.index(".entry")) :]
    wait = body.find("griddepcontrol.wait")
    assert wait >= 0, "the kernel never waits for its predecessor"
    before = body[:wait]
    if name in _PRELOADS:  # loads only (of weights, which no kernel of a step writes)
        ops = [m.group(0).strip() for m in _MEM.finditer(before)]
        assert ops and all(re.search(r"\bld\.", op) for op in ops), ops
    else:
        assert not _MEM.search(before), f"memory access before the wait: {_MEM.search(before)}"
    if name not in _EARLY_EXITS:
        assert not re.search(r"^\s*(?:@!?%p\d+\s+)?(?:bra|ret)\b", before, re.M), "a branch before the wait"
    assert ("griddepcontrol.launch_dependents" in body) == (mode == 2)
    assert triton_utils.pdl_mode_of("1", True, "norm", "all" if mode == 2 else "") == mode


@pytest.mark.skipif(not (HAS_TRITON and HAS_GDC), reason="needs a Triton with grid dependency control")
@pytest.mark.parametrize("variant", ["Q4_1", "Q4_1-opq", "Q4_K-opq", "Q4_1-opq-rope", "Q4_K-opq-rope"])
def test_gguf_preload_only_reads_before_the_wait(variant: str) -> None:
    """The int8 GGUF GEMV's PRE variant (the CUDA default) reads its first step's weights before waiting:
    loads only (weights no kernel of the step writes), no store or atomic, and the wait still comes; with the
    `GemvConfig.flags` variants too, and with the RoPE epilogue (its positions, cos / sin and slots read early
    too: the step's inputs and a constant table)."""
    from pagedllm.model_executor.layers.quantization import gguf_triton_int8 as gguf_int8

    bf = "*bf16"
    ptrs = dict(xq_ptr="*i32", xd_ptr="*fp32", xs_ptr="*fp32", lo_ptr="*i32", d_ptr="*fp16", dm_ptr="*fp16")
    ptrs.update(sc_ptr="*u8", mn_ptr="*u8", part_ptr="*fp32", out_ptr=bf, cnt_ptr="*i32")
    ptrs.update(pos_ptr="*i64", cos_sin_ptr="*fp32", slot_ptr="*i64", kv_ptr=bf)
    qt = 12 if variant.startswith("Q4_K") else 3
    if qt == 12:  # its packed scale planes
        ptrs.update(d_ptr="*i32", dm_ptr="*i32", sc_ptr="*i16", mn_ptr="*i16")
    consts = dict(QT=qt, BN=2, BK=1024, EVEN_K=True, ASM=True, PRE=True, PDL=1, OPQ="opq" in variant)
    consts.update(HEAD=128 if variant.endswith("rope") else 0, CACHE_BLOCK=16)
    ptx = _ptx_or_skip(gguf_int8._gguf_gemv_q8a_kernel, consts, ptrs)
    body = ptx[ptx.index("{", ptx.index(".entry")) :]
    wait = body.find("griddepcontrol.wait")
    assert wait >= 0
    before = [m.group(0).strip() for m in _MEM.finditer(body[:wait])]
    assert before and all(re.search(r"\bld\.", op) for op in before), before


@pytest.mark.skipif(not (HAS_TRITON and HAS_GDC), reason="needs a Triton with grid dependency control")
@pytest.mark.parametrize(
    "name", ["gguf_q8_quant", "add_rms_norm_q8_twin", "silu_and_mul_q8_twin", "paged_attn_q8_twin"]
)
def test_q8_quantizer_rounds_the_product_first(name: str) -> None:
    """`quant_groups_q8` splits v = x * (127 / amax) into trunc and fraction from the rounded product (roundf, as
    `gguf_triton.q8_activations` and llama.cpp): on sm_90 a plain product feeding `v - t` became an FMA, which
    turned exact halves of 16-bit inputs the other way (session 42's GPU twin test). Its `mul.rn` cannot fuse."""
    _, fn, consts, ptrs = next(k for k in _kernels() if k[0] == name)
    ptx = _ptx_or_skip(fn, dict(consts, PDL=1), ptrs)
    lines = ptx.splitlines()
    cut = [i for i, line in enumerate(lines) if "cvt.rzi.s32.f32" in line]
    assert cut, "no truncation: the quantizer is not in this kernel"
    window = lines[cut[0] - 40 : cut[-1] + 40]
    assert any("mul.rn" in line for line in window)
    assert not any(re.search(r"\bfma\.rn(\.ftz)?\.f32", line) for line in window), "the fraction came from an FMA"


@pytest.mark.skipif(not (HAS_TRITON and HAS_GDC), reason="needs a Triton with grid dependency control")
@pytest.mark.parametrize("dt", ["*bf16", "*fp16", "*fp32"])
def test_rope_rounds_each_product(dt: str) -> None:
    """RoPE's `x1 * cos - x2 * sin` rounds each product as the PyTorch reference does (`triton_utils.mul_rn`):
    with plain products the sm_90 code of the RoPE kernel held FMAs (16-bit: half-precision FMAs, the first
    product unrounded; session 43's GPU test of the attention's own RoPE found them as 1-ulp key differences).
    The RoPE kernel has no FMA left; the attention's RoPE adds none to the attention's."""
    import re

    ks = {k[0]: k for k in _kernels()}

    def fmas(name: str) -> int:
        _, fn, consts, ptrs = ks[name]
        typed = {k: (dt if v == "*bf16" else v) for k, v in ptrs.items()}
        ptx = _ptx_or_skip(fn, dict(consts, PDL=1, **({"TWIN": False} if "attn" in name else {})), typed)
        return len(re.findall(r"\bfma\.rn\.", ptx))

    assert fmas("rope_cache") == 0
    assert fmas("paged_attn_rope_one_segment") == fmas("paged_attn_one_segment")
    assert fmas("paged_attn_rope") == fmas("paged_attn")
