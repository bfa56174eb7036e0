"""The bf16 batch-1 row GEMV (`layers/triton_gemv.py`) on Llama-3.1-8B's per-rank shapes at tp=1 and tp=2 (issue 25:
W3 at tp=2 reads half of each weight, and the GEMV ran 8 % slower than half of tp=1's there, NOTES session 19):
each (BLOCK_N, BLOCK_K, warps) timed inside a CUDA graph (over weight copies that overflow L2) against the shipped
`row_gemv_config` and the weight-read floor (bytes / copy bandwidth measured here); every configuration is checked
against a float32 product first.

    PYTHONPATH=. python benchmarks/row_gemv_tp_sweep.py [--json out.json]

Prints, per shape, the shipped config's time, the best one's, and both ÷ the floor; then the per-layer sums
(qkv + o + gate_up + down) at each tp, shipped vs best."""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from triton.testing import do_bench_cudagraph

from pagedllm.benchmarks import floors
from pagedllm.model_executor.layers.triton_gemv import row_gemv, row_gemv_config

SHAPES = {  # (N, K) per rank
    1: {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    2: {"qkv": (3072, 4096), "o": (4096, 2048), "gate_up": (14336, 4096), "down": (4096, 7168)},
}
CONFIGS = list(itertools.product((1, 2, 4, 8), (256, 512, 1024, 2048), (2, 4, 8)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    bw = floors.copy_bandwidth_gbps("cuda")
    res: dict = {"copy_gbps": bw, "shapes": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    for tp, shapes in SHAPES.items():
        ship_sum = best_sum = floor_sum = 0.0
        for name, (n, k) in shapes.items():
            # Enough copies of the weight that together they overflow L2 (as a decode step's weights do):
            # each timed call streams all of them, so no copy is still cached when its turn comes again.
            copies = max(1, -(-(256 << 20) // (n * k * 2)))
            ws = [(torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16) for _ in range(copies)]
            w = ws[0]
            x = torch.randn(1, k, device="cuda", generator=g).to(torch.bfloat16)
            ref = x.float() @ w.float().t()
            floor_ms = n * k * 2 / (bw * 1e9) * 1e3
            times: dict[str, float] = {}
            for bn, bk, nw in CONFIGS:
                if bk > k:
                    continue
                cfg = (bn, bk, nw, 1)
                try:
                    y = row_gemv(x, w, config=cfg)
                except Exception as e:  # noqa: BLE001 - a config Triton cannot build: skip it
                    print(f"  {name} {cfg}: {type(e).__name__}")
                    continue
                if not torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2):
                    raise SystemExit(f"{name} {cfg}: wrong result")
                times[str(cfg)] = do_bench_cudagraph(
                    lambda x=x, cfg=cfg, ws=ws: [row_gemv(x, wc, config=cfg) for wc in ws], rep=30
                ) / len(ws)
            ship = str(row_gemv_config(n, k))
            best = min(times, key=times.__getitem__)
            ship_ms = times.get(ship) or (
                do_bench_cudagraph(lambda x=x, ws=ws: [row_gemv(x, wc) for wc in ws], rep=30) / len(ws)
            )
            ship_sum, best_sum, floor_sum = ship_sum + ship_ms, best_sum + times[best], floor_sum + floor_ms
            res["shapes"][f"tp{tp}_{name}"] = dict(n=n, k=k, floor_ms=floor_ms, shipped=ship, shipped_ms=ship_ms,
                                                   best=best, best_ms=times[best], all=times)  # fmt: skip
            bt = times[best]
            print(f"tp={tp} {name:8} N={n:6} K={k:6}  shipped {ship} {ship_ms * 1e3:7.1f} us "
                  f"({ship_ms / floor_ms:.2f}x)  best {best} {bt * 1e3:7.1f} us ({bt / floor_ms:.2f}x)")  # fmt: skip
        print(f"tp={tp} per layer: shipped {ship_sum * 1e3:.1f} us, best {best_sum * 1e3:.1f} us, floor "
              f"{floor_sum * 1e3:.1f} us; x32 layers: {ship_sum * 32:.3f} -> {best_sum * 32:.3f} ms")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
