"""Decode-sized dense GEMMs: cuBLAS (`F.linear`) against Triton tile configurations (GPU only).

The question (issue 18, W6): W6's q/k/v and o projections take 10.8 and 10.5 us a layer at 256 rows, 1.4-1.7x
their FLOPs at the measured matmul rate (benchmarks/NOTES.md, session 16's split). Does a plain Triton GEMM
(the batch-invariant kernel's, `batch_invariant_gpu._bi_matmul_kernel`, with its tiles swept) beat cuBLAS on
these shapes? Prints us per GEMM (CUDA-graph replays) and the floors (bytes at copy bandwidth, FLOPs at the
measured matmul rate) per shape and batch, and the best Triton configuration.

    PYTHONPATH=. python3 benchmarks/dense_gemm_ab.py --out $OUT/dense_gemm.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton
import triton.testing as tt

from pagedllm.benchmarks import floors
from pagedllm.model_executor.layers.batch_invariant_gpu import _bi_matmul_kernel

# (name, N, K): W6's fused q/k/v (32 + 2 x 4 heads of 128) and o projections
SHAPES = [("W6 qkv", 5120, 2048), ("W6 o", 2048, 4096)]
BATCHES = [64, 128, 192, 256]
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
CONFIGS = [
    (bm, bn, bk, w, s)
    for bm, bn, bk, w, s in itertools.product((64, 128), (64, 128), (64, 128), (4, 8), (3, 4))
    if not (bm == 128 and bn == 128 and w == 4)
]


def triton_linear(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, cfg: tuple[int, ...]) -> None:
    bm, bn, bk, warps, stages = cfg
    m, k = x.shape
    n = w.shape[0]
    _bi_matmul_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
        x, w, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=False, DOT_PREC="tf32", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def time_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return tt.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3


def blas_variants(out: str | None) -> None:
    """`F.linear` under each of torch's BLAS back ends, and the transposed product W @ x^T (other heuristics)."""
    report: dict = {"gpu": torch.cuda.get_device_name(), "cases": {}}
    w1 = [("W1 qkv", 4096, 1024), ("W1 o", 1024, 2048), ("W1 gate_up", 6144, 1024), ("W1 down", 1024, 3072)]
    shapes = SHAPES + w1
    for (name, n, k), m in itertools.product(shapes, BATCHES):
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        row = {}
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            row[lib] = time_us(lambda x=x, w=w: F.linear(x, w))
        torch.backends.cuda.preferred_blas_library("cublas")
        row["W@xT"] = time_us(lambda x=x, w=w: torch.mm(w, x.t()))
        print(f"{name} M={m}: " + ", ".join(f"{k} {v:.2f} us" for k, v in row.items()), flush=True)
        report["cases"][f"{name} M={m}"] = row
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--blas", action="store_true", help="cuBLAS against cuBLASLt and the transposed product only")
    a = ap.parse_args()
    if a.blas:
        blas_variants(a.out)
        return
    gbps = floors.copy_bandwidth_gbps("cuda")
    tflops = floors.matmul_tflops("cuda")
    report: dict = {"gpu": torch.cuda.get_device_name(), "copy_GBps": gbps, "matmul_TFLOPs": tflops, "cases": {}}
    for (name, n, k), m in itertools.product(SHAPES, BATCHES):
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        ref = F.linear(x, w)
        t_cublas = time_us(lambda x=x, w=w: F.linear(x, w))
        results = {}
        for cfg in CONFIGS:
            try:
                triton_linear(x, w, y, cfg)
            except Exception as e:  # out of shared memory / registers: not a candidate
                results[str(cfg)] = repr(e)[:80]
                continue
            err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            results[str(cfg)] = (time_us(lambda x=x, w=w, y=y, c=cfg: triton_linear(x, w, y, c)), err)
        timed = {c: r for c, r in results.items() if isinstance(r, tuple)}
        best = min(timed, key=lambda c: timed[c][0])
        bytes_us = (n * k + m * k + m * n) * 2 / (gbps * 1e9) * 1e6
        flops_us = 2 * m * n * k / (tflops * 1e12) * 1e6
        print(
            f"{name} M={m}: cuBLAS {t_cublas:.2f} us, best Triton {timed[best][0]:.2f} us {best} (max rel err"
            f" {timed[best][1]:.1e}); floors: bytes {bytes_us:.2f} us, FLOPs {flops_us:.2f} us",
            flush=True,
        )
        report["cases"][f"{name} M={m}"] = {"cublas_us": t_cublas, "best": best, "triton": results}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
