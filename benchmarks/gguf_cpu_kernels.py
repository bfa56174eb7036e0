"""The CPU's GGUF matmul kernels on one whole SmolLM2-135M token's linears (30 layers of Q4_1 qkv / o / gate_up /
down and the Q8_0 LM head, random blocks; 96 MB, more than the caches hold, as in a real step), at several
activation row counts, three ways alternating in one process (min of the rounds):

- `rows`: the row kernels of `csrc/gguf_mm.c` on the file's layout (`gguf.set_tile(False)`);
- `tile`: AVX-512 VNNI's column-tile kernel (`csrc/gguf_tile.c`) on the file's layout;
- `tiled`: the same kernel on the layout `gguf.tile` re-lays at load (what the engine runs).

    PYTHONPATH=. python benchmarks/gguf_cpu_kernels.py --threads 2 --rows 1 4 16 64
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from pagedllm.model_executor.layers.quantization import gguf as gq

SHAPES = [(3, 960, 576), (3, 576, 576), (3, 3072, 576), (3, 576, 1536)]  # (ggml type, N, K) per layer
LM_HEAD = (8, 49152, 576)


def random_weight(qtype: int, n: int, k: int, rng: np.random.Generator) -> gq.GGUFWeight:
    """Random blocks with a small float16 scale (and Q4_1 min) in every block."""
    qk, nbytes = gq._BLOCK[qtype]
    raw = rng.integers(0, 256, size=(n, k // qk, nbytes), dtype=np.uint8)
    raw[:, :, 0:2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    if qtype == 3:
        raw[:, :, 2:4] = np.array([-0.05], dtype=np.float16).view(np.uint8)
    return gq.GGUFWeight(qtype, torch.from_numpy(raw.reshape(n, -1)), n, k)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 4, 16, 64])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if gq.set_isa(-1) != 2:
        raise SystemExit(f"the column-tile kernel needs AVX-512 VNNI; this CPU's GGUF kernels are {gq.isa_name()}")
    rng = np.random.default_rng(0)
    file_layout = [random_weight(t, n, k, rng) for _ in range(30) for t, n, k in SHAPES]
    file_layout.append(random_weight(*LM_HEAD, rng))
    tiled = [gq.tile(w) for w in file_layout]
    ways = {"rows": (file_layout, False), "tile": (file_layout, True), "tiled": (tiled, True)}
    results: dict[str, dict[str, float]] = {}
    for m in args.rows:
        xs = {k: torch.randn(m, k) for k in {w.cols for w in file_layout}}
        best = dict.fromkeys(ways, float("inf"))
        for _ in range(args.rounds):
            for name, (weights, tile_on) in ways.items():
                gq.set_tile(tile_on)
                t = time.perf_counter()
                for w in weights:
                    gq.gguf_matmul(xs[w.cols], [w])
                best[name] = min(best[name], time.perf_counter() - t)
        gq.set_tile(True)
        macs = m * sum(w.rows * w.cols for w in file_layout)
        results[str(m)] = {f"{k}_ms": v * 1e3 for k, v in best.items()}
        print(
            f"rows {m:3d}: "
            + " | ".join(f"{k} {v * 1e3:7.2f} ms {macs / v / 1e9:5.1f} GMAC/s" for k, v in best.items())
            + f" | tiled vs rows {best['rows'] / best['tiled']:.2f}x",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
