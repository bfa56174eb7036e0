"""Issue 20 (GPU part) on the CPU: the GGUF Triton kernels (`quantization.gguf_triton`) run under the Triton
interpreter against the `gguf` package's dequantization times a float64 matmul, every type, the decode GEMV
(M <= 8, split-K included) and the prefill dequant-GEMM (M > 8), odd N, mixed-type parts with a bias,
float16 activations, and the layer dispatch. The interpreter runs in a subprocess
(`gguf_triton_check.py`): TRITON_INTERPRET must be set before triton is imported and must not leak into
the other test modules of this process. The re-layout's torch reference (`gguf_triton.dequantize`) is
checked here directly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedllm.model_executor.layers.quantization import gguf as gq
from pagedllm.model_executor.layers.quantization import gguf_triton as gt
from pagedllm.model_executor.layers.quantization import gguf_triton_layout
from tests.interpreted import run_interpreted
from tests.model_executor.gguf_triton_check import CASES, TOL, TOL_FP16, TYPES, random_blocks, reference

pytest.importorskip("triton")

CHECK = Path(__file__).with_name("gguf_triton_check.py")


@pytest.fixture(scope="module")
def interpreted() -> dict[str, float]:
    """Every case's relative error, from one interpreter subprocess."""
    return json.loads(run_interpreted(CHECK))


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_gguf_reference(interpreted: dict[str, float], case: str) -> None:
    tol = TOL_FP16 if case == "fp16-gemm" else TOL
    assert case in interpreted
    assert interpreted[case] <= tol, f"{case}: relative error {interpreted[case]:.3g} > {tol}"


def test_interpreter_does_not_leak() -> None:
    assert os.environ.get("TRITON_INTERPRET") != "1"


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_matches_gguf(name: str) -> None:
    """The re-layout's decoding (torch) equals the gguf package's exactly (both are float32 products of
    the same float16 fields and integers)."""
    rng = np.random.default_rng(len(name))
    qtype = GGMLQuantizationType[name]
    qk = GGML_QUANT_SIZES[qtype][0]
    cols = 3 * qk
    raw = random_blocks(name, 7, cols, rng)
    w = gq.GGUFWeight(int(qtype), torch.from_numpy(raw), 7, cols)
    np.testing.assert_allclose(gt.dequantize(w).double().numpy(), reference(name, raw, cols), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", TYPES)
def test_prepared_layout(name: str) -> None:
    """The planes' shapes and bytes: the file's bytes, but for the K-quants' 6-bit scales decoded to one
    byte each (4 more bytes per 256 weights); Q4_K's scale fields in its two packed planes."""
    rng = np.random.default_rng(1)
    qtype = GGMLQuantizationType[name]
    qk, nbytes = GGML_QUANT_SIZES[qtype]
    rows, cols = 5, 2 * max(qk, 256)
    raw = random_blocks(name, rows, cols, rng)
    p = gt.prepare(gq.GGUFWeight(int(qtype), torch.from_numpy(raw), rows, cols))
    assert isinstance(p, gq.GGUFTritonWeight) and p.data.dtype == torch.int32
    assert p.data.shape == (rows, cols // (4 if name == "Q8_0" else 8))
    extra = 4 * cols // 256 * rows if name in ("Q4_K", "Q5_K") else 0
    assert p.nbytes == raw.size + extra
    if name == "Q4_K":  # d | dmin << 16, sc | mn << 8: the unpacked fields' bits
        assert p.dm is None and p.mn is None and p.d is not None and p.sc is not None
        assert p.d.dtype == torch.int32 and p.d.shape == (rows, cols // 256)
        assert p.sc.dtype == torch.int16 and p.sc.shape == (rows, cols // 32)
        _, f = gguf_triton_layout._unpack(int(qtype), torch.from_numpy(raw), cols)
        d = p.d.view(torch.int16).view(rows, -1, 2)
        assert torch.equal(d[..., 0], f["d"].view(torch.int16)) and torch.equal(d[..., 1], f["dm"].view(torch.int16))
        sm = p.sc.view(torch.uint8).view(rows, -1, 2)
        assert torch.equal(sm[..., 0], f["sc"]) and torch.equal(sm[..., 1], f["mn"])


def test_cuda_packing_is_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA a .gguf model is dequantized at load unless PAGEDLLM_GGUF_CUDA_PACKED=1 (the Triton kernels
    have not run on a GPU yet); the CPU keeps its packed default either way."""
    from types import SimpleNamespace

    from pagedllm.model_executor.model_loader.loader import _gguf_packed

    cfg = SimpleNamespace(quantization="gguf", dtype="float32")
    monkeypatch.delenv("PAGEDLLM_GGUF_CUDA_PACKED", raising=False)
    assert not _gguf_packed(cfg, "cuda")  # type: ignore[arg-type]
    monkeypatch.setenv("PAGEDLLM_GGUF_CUDA_PACKED", "1")
    assert _gguf_packed(cfg, "cuda")  # type: ignore[arg-type]
    assert _gguf_packed(cfg, "cpu")  # type: ignore[arg-type]


QKV_ROPE_CHECK = Path(__file__).with_name("gguf_qkv_rope_check.py")


def test_qkv_rope_epilogue_same_bits() -> None:
    """RoPE and the K / V cache write in the int8 qkv GEMV's epilogue leave the output and the cache bit for bit
    as the GEMV and the RoPE launch do (Q4_1 and Q4_K, 1 and 2 pairs a program, fp16 and bf16, a padded token
    and one past num_tokens), under the interpreter; every int8 type at Llama's heads on the GPU."""
    from tests.model_executor.gguf_qkv_rope_check import CASES as ROPE_CASES

    res = json.loads(run_interpreted(QKV_ROPE_CHECK))
    assert sorted(res) == sorted(ROPE_CASES)
    bad = {c: r for c, r in res.items() if r != {"out": 0, "cache": 0}}
    assert not bad, f"elements that differ: {bad}"


@pytest.mark.slow
def test_qkv_rope_model_same_logits() -> None:
    """The whole path (`LlamaAttention` -> the Triton backend's `qkv_rope` -> the GGUF linear's `apply_rope` -> the
    attention skipping its cache write) on a tiny float16 Llama with Q8_0-packed linears, under the interpreter:
    every decode's qkv launch takes the epilogue with `PAGEDLLM_QKV_ROPE` on and none with it off, and the logits
    are the same bits."""
    res = json.loads(run_interpreted(QKV_ROPE_CHECK, args=["model"]))
    assert res["epilogue_launches_1"] == 3 * 2 and res["epilogue_launches_0"] == 0, res  # 3 decodes x 2 layers
    assert res["max_diff"] == 0.0 and res["finite"] == 1.0, res
