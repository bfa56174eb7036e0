"""Decode attention with its (request, kv head) programs in batch order against longest request first (GPU only).

The question (issue 18, W6): with one 128-key-tile program per SM, the launch order is the schedule, and a long
request that starts last is the launch's tail. Does `request_order` (one device sort per step, shared by every
layer) close part of the kernel's gap to its K/V bytes? Prints microseconds per launch (CUDA-graph replays),
the ratio to the K/V-bytes floor at the measured copy bandwidth, the sort's own time, and a few tile
configurations under the sorted order; checks that each configuration's output is the same in either order.

    PYTHONPATH=. python3 benchmarks/attn_order_ab.py --out $OUT/attn_order.json
"""

from __future__ import annotations

import argparse
import json

import torch

import benchmarks.attn_microbench as mb
from pagedllm.attention.ops.triton_paged_attn import request_order
from pagedllm.benchmarks import floors

# (name, q heads, kv heads, batch, context range)
CASES = [
    ("W6 b256", 32, 4, 256, (100, 1100)),
    ("W6 b256 long", 32, 4, 256, (500, 2000)),
    ("W6 b224", 32, 4, 224, (100, 1500)),
    ("W6 b192", 32, 4, 192, (100, 1500)),
    ("W6 b160", 32, 4, 160, (200, 1500)),
    ("W6 b128", 32, 4, 128, (300, 1500)),
    ("W6 b96", 32, 4, 96, (300, 1800)),
    ("W6 b64", 32, 4, 64, (500, 2000)),
    ("W1 b256", 16, 8, 256, (100, 1100)),
    ("W1 b128", 16, 8, 128, (300, 1500)),
]
# (TILE_N, num_warps, num_stages) tried under the sorted order; the defaults are (128, 4, 2), and (64, 4, 2) for
# longest-first launches of at least SMALL_TILE_WAVES programs per SM.
TILES = [(128, 4, 2), (64, 4, 2), (64, 8, 2), (32, 4, 3)]
# Batches of one or two waves of programs (`--splits`): the split-KV launch at 2 and 4 segments, by tile.
SPLIT_CASES = [
    ("W6 b40", 32, 4, 40, (500, 2000)),
    ("W6 b64", 32, 4, 64, (500, 2000)),
    ("W6 b96", 32, 4, 96, (300, 1800)),
    ("W6 b128", 32, 4, 128, (300, 1500)),
]


def split_sweep(gbps: float) -> dict:
    """us per launch of each (segments, tile) against the default launch, for SPLIT_CASES."""
    report = {}
    for name, h, kvh, batch, (lo, hi) in SPLIT_CASES:
        b = mb.random_decode_batch(h, kvh, batch, lo, hi)
        floor_us = b.kv_bytes / (gbps * 1e9) * 1e6
        order = request_order(b.seq_lens, batch)
        row = {"floor_us": floor_us, "default_us": mb.bench(lambda b=b, o=order: b.run(req_order=o)) * 1e3}
        for splits in (2, 4):
            for tn in (128, 64):
                cfg = {"block_m": 16, "tile_n": tn, "num_warps": 4, "num_stages": 2}
                row[f"split{splits}/tile{tn}"] = mb.bench(lambda b=b, s=splits, c=cfg: b.run(num_splits=s, **c)) * 1e3
        print(name, f"floor {floor_us:.1f}", {k: round(v, 1) for k, v in row.items()}, flush=True)
        report[name] = row
    return report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--splits", action="store_true", help="the split-KV sweep (SPLIT_CASES) only")
    a = ap.parse_args()
    gbps = floors.copy_bandwidth_gbps("cuda")
    report = {}
    for name, h, kvh, batch, (lo, hi) in [] if a.splits else CASES:
        b = mb.random_decode_batch(h, kvh, batch, lo, hi)
        floor_us = b.kv_bytes / (gbps * 1e9) * 1e6
        t_plain = mb.bench(lambda b=b: b.run()) * 1e3
        order = request_order(b.seq_lens, batch)
        t_sort = mb.bench(lambda b=b, n=batch: request_order(b.seq_lens, n)) * 1e3
        t_ord = mb.bench(lambda b=b, o=order: b.run(req_order=o)) * 1e3
        row = {
            "floor_us": floor_us,
            "plain_us": t_plain,
            "ordered_us": t_ord,
            "sort_us": t_sort,
            "same_output": True,  # per tile configuration below: ordered against batch order
            "tiles": {},
        }
        print(
            f"{name}: batch order {t_plain:6.1f} us ({t_plain / floor_us:.2f}x)  longest first {t_ord:6.1f} us"
            f" ({t_ord / floor_us:.2f}x)  sort {t_sort:.1f} us  floor {floor_us:.1f} us",
            flush=True,
        )
        for tn, nw, ns in TILES:
            cfg = {"block_m": 16 if h // kvh <= 16 else 32, "tile_n": tn, "num_warps": nw, "num_stages": ns}
            plain = b.run(**cfg).clone()
            row["same_output"] &= torch.equal(plain, b.run(req_order=order, **cfg))
            t_plain_c = mb.bench(lambda b=b, c=cfg: b.run(**c)) * 1e3
            t_c = mb.bench(lambda b=b, o=order, c=cfg: b.run(req_order=o, **c)) * 1e3
            row["tiles"][f"{tn}/{nw}/{ns}"] = {"plain_us": t_plain_c, "ordered_us": t_c}
            print(f"    tile {tn} warps {nw} stages {ns}: batch order {t_plain_c:6.1f} us, longest first {t_c:6.1f} us")
        print(f"    same output in either order, every tile: {row['same_output']}", flush=True)
        report[name] = row
    if a.splits:
        report = split_sweep(gbps)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "copy_GBps": gbps, "cases": report}, f, indent=1)


if __name__ == "__main__":
    main()
