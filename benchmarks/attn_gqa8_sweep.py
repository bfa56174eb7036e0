"""Paged-attention launch sweep for W6's attention shape (Qwen3-30B-A3B: 32 q heads, 4 kv heads, head 128, bf16,
block 16), GPU only: the decode kernel on W1-like batches (K/V bytes read / time against the copy bandwidth,
CUDA-graph replays) under tile / warp / stage / split-KV choices, and causal prefill (TFLOP/s) under prefill tiles.
The launch heuristics (`launch_config`, `choose_num_splits`) were tuned on Qwen3-0.6B / Llama-8B heads (GQA groups
2 and 4); this checks them for group 8.

    PYTHONPATH=. python3 benchmarks/attn_gqa8_sweep.py --out $OUT/attn_gqa8.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

import benchmarks.attn_microbench as mb
from pagedllm.attention.ops.triton_paged_attn import choose_num_splits, launch_config


def decode_sweep(batch: int, lo: int, hi: int, copy_gbps: float) -> dict:
    g = torch.Generator().manual_seed(batch)
    seq = torch.randint(lo, hi + 1, (batch,), generator=g).tolist()
    b = mb.DecodeBatch(seq, 16)
    auto_cfg = launch_config(mb.D, mb.H // mb.KVH, torch.bfloat16, 1)
    auto_split = choose_num_splits(batch, mb.KVH, 1, torch.device("cuda"))
    base = b.run(num_splits=auto_split).clone()
    floor_us = b.io_bytes / (copy_gbps * 1e9) * 1e6
    out: dict = {"batch": batch, "ctx": [lo, hi], "default": list(auto_cfg), "default_split": auto_split}
    out["floor_us"] = floor_us
    rows = []
    t = mb.bench(lambda: b.run(num_splits=auto_split))
    rows.append(("default", t))
    for tn, nw, ns, sp in itertools.product((32, 64, 128), (2, 4, 8), (2, 3), (1, 2)):
        cfg = dict(block_m=16, tile_n=tn, num_warps=nw, num_stages=ns)
        try:
            e = mb.rel_err(b.run(num_splits=sp, **cfg), base)
            assert e < 1e-2, e
            t = mb.bench(lambda cfg=cfg, sp=sp: b.run(num_splits=sp, **cfg), reps=1)
        except Exception as exc:  # out of shared memory and the like
            print(f"  n{tn} w{nw} s{ns} split{sp}: {type(exc).__name__}", flush=True)
            continue
        rows.append((f"n{tn} w{nw} s{ns} split{sp}", t))
    rows.sort(key=lambda r: r[1])
    for name, t in rows[:12] + [r for r in rows if r[0] == "default"]:
        x = t * 1e3 / floor_us
        print(f"decode b{batch} ctx U[{lo},{hi}] {name:24s} {t * 1e3:8.1f} us  {x:5.2f}x floor", flush=True)
    out["rows"] = [{"cfg": n, "us": t * 1e3, "x_floor": t * 1e3 / floor_us} for n, t in rows]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    mb.H, mb.KVH = 32, 4
    torch.manual_seed(0)
    res: dict = {"device": torch.cuda.get_device_name()}
    res["floors"] = fl = mb.floors()
    print(f"floors: copy {fl['copy_GBps']:.0f} GB/s, matmul {fl['bf16_matmul_TFLOPs']:.0f} TFLOP/s", flush=True)
    res["decode"] = [decode_sweep(n, lo, hi, fl["copy_GBps"]) for n, lo, hi in ((256, 100, 1100), (64, 500, 2000))]
    mb.PREFILL_TILES = (
        (128, 32, 4, 3),
        (128, 64, 4, 3),
        (128, 64, 8, 3),
        (128, 128, 8, 2),
        (128, 64, 8, 2),
        (256, 64, 8, 2),
        (256, 32, 8, 3),
        (64, 64, 4, 3),
        (128, 32, 8, 3),
    )
    res["prefill"] = [mb.prefill_case(n, L, 32, 4)[0] for n, L in ((16, 1024), (32, 512))]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
