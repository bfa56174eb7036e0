"""Decode linears at a few rows (issue 23: speculative verification at batch 1 runs M = k + 1 rows): cuBLAS
(`F.linear`) against the few-row GEMV (`triton_gemv.rows_gemv`, each of `CONFIGS` and the default) and, at one
row, the row GEMV, per model shape.

Every layer's four linears (qkv, o, gate_up, down) with their own weights, all layers in one CUDA graph (the
weights stream from HBM as in a decode step, and the launch gaps are those of a graph); the time per step is
the graph's replay time.

    python benchmarks/rows_gemv_bench.py [--rows 1,2,4,5,8] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.model_executor.layers import triton_gemv

# (hidden, q width, kv width, intermediate, layers)
SHAPES = {
    "smollm2-135m": (576, 576, 192, 1536, 30),
    "qwen3-0.6b": (1024, 2048, 1024, 3072, 28),
    "llama-3.1-8b": (4096, 4096, 1024, 14336, 8),
}


# (BLOCK_N, BLOCK_K, num_warps, num_stages) swept for the few-row GEMV
CONFIGS = [(bn, bk, 4, 1) for bn in (2, 4, 8) for bk in (64, 128, 256) if bn * bk <= 1024] + [
    (4, 128, 2, 1),
    (8, 64, 2, 1),
]


def linears(hidden: int, q: int, kv: int, inter: int) -> list[tuple[int, int]]:
    """(n, k) of a layer's qkv, o, gate_up and down projections."""
    return [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]


def step_time(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], xs: dict, ws: list, reps: int = 50) -> float:
    """Microseconds per replay of a graph running `fn` over every weight in `ws`."""

    def body() -> None:
        for w in ws:
            fn(xs[w.shape[1]], w)

    body()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,5,8")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    dt = torch.bfloat16
    out = []
    print(f"{torch.cuda.get_device_name()}: us per step (all layers' 4 linears in one graph)")
    cols = ("cublas", "rows_gemv", "best", "best cfg", "row_gemv", "rows/cub")
    print(f"{'model':14} {'M':>3} " + " ".join(f"{c:>9}" for c in cols))
    for name, (hidden, q, kv, inter, layers) in SHAPES.items():
        shapes = linears(hidden, q, kv, inter)
        ws = [torch.randn(n, k, dtype=dt, device="cuda") / k**0.5 for _ in range(layers) for n, k in shapes]
        for m in rows:
            xs = {k: torch.randn(m, k, dtype=dt, device="cuda") for _, k in shapes}
            cub = step_time(lambda x, w: F.linear(x, w), xs, ws)
            one = step_time(lambda x, w: triton_gemv.row_gemv(x, w), xs, ws) if m == 1 else float("nan")
            sweep: dict[str, float] = {}
            dflt = float("nan")
            if 2 <= m <= triton_gemv.ROWS_GEMV_MAX_M:
                dflt = step_time(lambda x, w: triton_gemv.rows_gemv(x, w), xs, ws)
                for cfg in CONFIGS:
                    sweep[str(cfg)] = step_time(lambda x, w, c=cfg: triton_gemv.rows_gemv(x, w, config=c), xs, ws)
            best = min(sweep, key=sweep.__getitem__) if sweep else "-"
            bt = sweep.get(best, float("nan"))
            print(
                f"{name:14} {m:3d} {cub:9.1f} {dflt:9.1f} {bt:9.1f} {best:>9} {one:9.1f} {dflt / cub:8.2f}",
                flush=True,
            )
            out.append(
                {"model": name, "m": m, "cublas_us": cub, "rows_gemv_us": dflt, "row_gemv_us": one, "sweep": sweep}
            )
        del ws
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
