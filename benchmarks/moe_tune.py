"""Tiles of the fused MoE grouped GEMMs (`pagedllm/model_executor/layers/fused_moe/configs.py`) timed on
the GPU for one shape (default W6: Qwen3-30B-A3B, E=128, I=768, H=2048, top-8) at several batch sizes;
prints the best (up, down) pair per batch bucket as a Python literal for `configs.TUNED`, with its time
and the time of `default_config`, and the bytes-of-touched-experts floor at the measured copy bandwidth.

    python3 benchmarks/moe_tune.py --out $OUT/moe_tune.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from pagedllm.benchmarks import floors
from pagedllm.model_executor.layers.fused_moe import configs, triton_moe


def _time(fn, reps: int = 20) -> float:  # noqa: ANN001
    return floors._median_ms(fn, warmup=3, reps=reps)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--batches", default="1,8,32,64,128,256,512,2048,8192")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    e, i, h, k = a.experts, a.inter, a.hidden, a.top_k
    dev = "cuda"
    gbps = floors.copy_bandwidth_gbps(dev)
    w13 = torch.randn(e, 2 * i, h, device=dev, dtype=torch.bfloat16) * h**-0.5
    w2 = torch.randn(e, h, i, device=dev, dtype=torch.bfloat16) * i**-0.5
    cands = []
    for bm, bn, bk, stages in itertools.product((16, 32, 64), (64, 128), (64, 128), (3, 4)):
        if bm == 64 and bk == 128 and stages == 4:
            continue  # too much shared memory
        cands.append(configs._cfg(bm, bn, bk, 8 if bm >= 64 else 1, 8 if bm >= 64 else 4, stages))
    results = {}
    for t in [int(x) for x in a.batches.split(",")]:
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        logits = torch.randn(t, e, device=dev, dtype=torch.bfloat16)
        weights, ids = triton_moe.fused_topk(logits, k, True)
        touched = int(torch.unique(ids).numel())
        floor_ms = touched * 3 * i * h * 2 / (gbps * 1e9) * 1e3
        default = configs.default_config(e, t * k)
        t_default = _time(lambda: triton_moe.fused_experts(x, w13, w2, weights, ids, default))
        best: dict[int, tuple[float, dict]] = {}
        for c in cands:
            bm = c["BLOCK_M"]
            if bm > 16 and t * k / e < 4:
                continue
            try:
                ms = _time(lambda: triton_moe.fused_experts(x, w13, w2, weights, ids, (c, c)), reps=10)
            except Exception:  # noqa: BLE001 - out of resources for this tile
                continue
            if ms < best.get(bm, (1e9, {}))[0]:
                best[bm] = (ms, c)
        ms, c = min(best.values(), key=lambda v: v[0])
        results[t] = {"best_ms": ms, "config": c, "default_ms": t_default, "touched": touched, "floor_ms": floor_ms}
        print(
            f"T={t:5d}: best {ms:.3f} ms {c}; default {t_default:.3f} ms; floor {floor_ms:.3f} ms ({touched} experts)",
            flush=True,
        )
    print("TUNED[(%d, %d, %d)] = {" % (e, i, h))
    for t, r in results.items():
        print(f"    {t}: ({r['config']}, {r['config']}),")
    print("}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"copy_GBps": gbps, "gpu": torch.cuda.get_device_name(), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
