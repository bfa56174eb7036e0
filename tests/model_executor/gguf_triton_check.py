"""The GGUF Triton kernels against the `gguf` package's dequantization times a float64 matmul, run by
`test_gguf_triton.py` in a subprocess with TRITON_INTERPRET=1 (the interpreter must be chosen before
triton is imported, and must not leak into the other test modules of a pytest process):

    TRITON_INTERPRET=1 python tests/model_executor/gguf_triton_check.py   # prints one JSON object

Also imported (without running anything) for `CASES`, `random_blocks` and `reference`, which the GPU
tests share. Each case's figure is max |out - ref| / max |ref|."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np

# ggml type names with a kernel, and the offsets of each block's float16 fields (random bytes there could
# be inf / NaN).
TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
INT8 = ["Q4_0", "Q4_1", "Q8_0", "Q4_K"]  # the types the int8-activation GEMV takes
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
# (M, N, K in blocks of the type): M <= 8 runs the GEMV (K = 32 blocks of 32 / 4 of 256 splits K over
# programs), M > 8 the dequant-GEMM; N odd and not a multiple of the tiles.
SHAPES_32 = [(1, 33, 3), (3, 257, 2), (1, 40, 32), (2, 19, 33), (17, 33, 3), (20, 70, 5)]
SHAPES_256 = [(1, 33, 1), (3, 257, 2), (1, 40, 4), (2, 19, 5), (17, 33, 2), (20, 70, 1)]
CASES = [f"{t}-{m}x{n}x{kb}" for t in TYPES for m, n, kb in (SHAPES_256 if t.endswith("_K") else SHAPES_32)]
# The decode GEMV with float16 activations (the int8-activation IDP4A kernel for Q4_0 / Q4_1 / Q4_K / Q8_0,
# emulated under the interpreter), against the activations quantized as it does (`gguf_triton.q8_activations`).
CASES += [f"{c}-fp16" for c in CASES if int(c.split("-")[1].split("x")[0]) <= 8]
CASES += ["mixed-parts-2", "mixed-parts-19", "fp16-gemv", "fp16-gemm", "layer-dispatch"]
# Explicit decode-GEMV launches (BN, BK, warps, stages, split) at M = 5, N = 37 (odd, not a multiple of BN),
# K = 640 (20 blocks of 32) / 768 (3 super-blocks): K a multiple of BK and split 1 (no masks, direct store),
# and K not a multiple of BK with split-K (masked last step, partials summed by the last program).
# The stages-2 configurations: more launches over 2-5 K steps a program (stages change no kernel's code).
GEMV_CONFIGS = {
    "32": [(16, 128, 4, 1, 1), (32, 256, 4, 1, 3), (32, 128, 4, 2, 2), (16, 256, 4, 2, 1)],
    "256": [
        (16, 256, 4, 1, 1),
        (16, 512, 4, 1, 2),
        (16, 256, 4, 2, 1),
        (16, 512, 4, 2, 1),
        (16, 512, 4, 1, 2, 1),
        (16, 256, 4, 1, 1, 5),
    ],
}
# (a sixth field: `GemvConfig.flags`, OPQ / NOPRE: no-ops under the interpreter, run for the launcher's path)
CASES += [f"cfg-{t}-" + "x".join(map(str, c)) for t in TYPES for c in GEMV_CONFIGS["256" if t.endswith("_K") else "32"]]
CASES += [f"{c}-fp16" for c in CASES if c.startswith("cfg-")]
# The int8 GEMV reading its first step's weights before the PDL wait (the CUDA default; a no-op wait here).
CASES += [f"{c}-pre" for c in CASES if c.startswith("cfg-") and c.endswith("-fp16") and c.split("-")[1] in INT8]
TOL = 1e-5  # float32 activations, IEEE dot products; the IDP4A GEMV against its quantized activations (~1e-7)
TOL_FP16 = 2e-3  # float16 activations: the GEMM's dequantized tile is rounded to float16


def random_blocks(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Weights of type `name` [rows, row_bytes] uint8: quantized from floats by gguf's own quantizer where
    it has one, else random block bytes with small finite float16 scales (every quant bit pattern)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[name]
    qk, nbytes = GGML_QUANT_SIZES[qtype]
    try:
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.1, qtype)
    except NotImplementedError:
        pass
    raw = rng.integers(0, 256, size=(rows, cols // qk, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        scale = rng.uniform(-0.02, 0.02, size=(rows, cols // qk)).astype(np.float16)
        raw[:, :, off : off + 2] = scale.view(np.uint8).reshape(rows, cols // qk, 2)
    return raw.reshape(rows, -1)


def reference(name: str, raw: np.ndarray, cols: int) -> np.ndarray:
    """The `gguf` package's dequantization, float64 [rows, cols]."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(raw, GGMLQuantizationType[name]).reshape(raw.shape[0], cols).astype(np.float64)


def _rel(out: Any, ref: Any) -> float:
    return float((out.double() - ref).abs().max() / ref.abs().max())


def run() -> dict[str, float]:
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from pagedllm.model_executor.layers.quantization import gguf as gq
    from pagedllm.model_executor.layers.quantization import gguf_triton as gt

    rng = np.random.default_rng(0)
    torch.manual_seed(0)

    def weight(name: str, n: int, k: int) -> tuple[gq.GGUFWeight, torch.Tensor]:
        raw = random_blocks(name, n, k, rng)
        w = gq.GGUFWeight(int(GGMLQuantizationType[name]), torch.from_numpy(raw), n, k)
        return w, torch.from_numpy(reference(name, raw, k))

    def exact(x: torch.Tensor, w: gq.GGUFWeight, ref: torch.Tensor) -> torch.Tensor:
        """x @ ref.T in float64, x as the kernel sees it (int8 per group of 32 for the IDP4A GEMV)."""
        xs = gt.q8_activations(x) if x.shape[0] <= gt.GEMV_MAX_M and gt.int8_activations(w.qtype, x.dtype) else x
        return xs.double() @ ref.T

    res: dict[str, float] = {}
    for case in CASES:
        name, _, shape = case.partition("-")
        if name not in TYPES:
            continue
        shape, _, tag = shape.partition("-")
        m, n, kb = (int(v) for v in shape.split("x"))
        k = kb * GGML_QUANT_SIZES[GGMLQuantizationType[name]][0]
        w, ref = weight(name, n, k)
        x = torch.randn(m, k).to(torch.float16 if tag == "fp16" else torch.float32)
        res[case] = _rel(gq.gguf_matmul(x, [gt.prepare(w)], out_dtype=torch.float32), exact(x, w, ref))
    for case in CASES:
        if case.startswith("cfg-"):
            _, name, cfg, *tag = case.split("-")
            k = 768 if name.endswith("_K") else 640
            w, ref = weight(name, 37, k)
            x = torch.randn(5, k).to(torch.float16 if tag else torch.float32)
            out = torch.full((5, 37), float("nan"))
            cfg_t = gt.GemvConfig(*(int(v) for v in cfg.split("x")))
            gt.gguf_gemv_triton(x, gt.prepare(w), out, 4, cfg_t, preload="pre" in tag)
            res[case] = _rel(out, exact(x, w, ref))
    # Parts of three types writing slices of one output, a bias, float32 logits from float16 activations.
    k = 512
    ws = [weight(t, n, k) for t, n in (("Q4_K", 24), ("Q6_K", 9), ("Q8_0", 40))]
    parts: list[gq.GGUFWeight] = [gt.prepare(w) for w, _ in ws]
    ref_w = torch.cat([r for _, r in ws])
    bias = torch.randn(ref_w.shape[0])
    for m in (2, 19):
        x = torch.randn(m, k)
        res[f"mixed-parts-{m}"] = _rel(gq.gguf_matmul(x, parts, bias), x.double() @ ref_w.T + bias.double())
    for m, tag in ((3, "gemv"), (18, "gemm")):
        x = torch.randn(m, k).half()
        out = gq.gguf_matmul(x, parts, out_dtype=torch.float32)
        ref_x = torch.cat([exact(x, p, r) for p, (_, r) in zip(parts, ws, strict=True)], dim=1)
        res[f"fp16-{tag}"] = _rel(out, ref_x) if out.dtype == torch.float32 else float("inf")
    # A linear layer whose GGUFLinearMethod holds prepared parts dispatches to the Triton path.
    from pagedllm.model_executor.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(k, ref_w.shape[0], bias=False, params_dtype=torch.float32)
    gq.install(layer, parts)
    x = torch.randn(2, 5, k)
    out = layer(x)
    res["layer-dispatch"] = _rel(out.view(10, -1), x.view(10, k).double() @ ref_w.T)
    return res


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (set before triton is imported)")
    print(json.dumps(run()))
