"""Decode attention on the paged KV cache in two physical layouts, the same kernel and data (GPU only):

* NHD, the engine's: [num_blocks, block_size, num_kv_heads, head_size]. One kv head's 16 keys of a block are
  256-byte rows (bf16, head 128) 1 KB apart, the other heads' rows between them;
* HND: [num_blocks, num_kv_heads, block_size, head_size], exposed as an NHD-shaped strided view (the kernel takes
  the cache's strides). One kv head's keys of a block are one contiguous 4 KB run.

The question (issue 18, W6): does the decode kernel's 1.2-1.5x over its K/V bytes come from the strided rows?
Prints microseconds per launch (CUDA-graph replays) and the ratio to the K/V-bytes floor at the measured copy
bandwidth, per shape and layout, and checks that both layouts give the same output.

    PYTHONPATH=. python3 benchmarks/attn_layout_ab.py --out $OUT/attn_layout.json
"""

from __future__ import annotations

import argparse
import json

import torch

import benchmarks.attn_microbench as mb
from pagedllm.benchmarks import floors

# (name, q heads, kv heads, batch, context range)
CASES = [
    ("W6 b256", 32, 4, 256, (100, 1100)),
    ("W6 b64", 32, 4, 64, (500, 2000)),
    ("W1 b256", 16, 8, 256, (100, 1100)),
]


def hnd_view(cache: torch.Tensor) -> torch.Tensor:
    """The same values in an HND-laid-out buffer, as an NHD-shaped view."""
    nb, bs, kvh, d = cache.shape
    phys = cache.permute(0, 2, 1, 3).contiguous()  # [nb, kvh, bs, d]
    return phys.permute(0, 2, 1, 3)  # NHD shape, HND strides


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    gbps = floors.copy_bandwidth_gbps("cuda")
    report = {}
    for name, h, kvh, batch, (lo, hi) in CASES:
        b = mb.random_decode_batch(h, kvh, batch, lo, hi)
        floor_us = b.kv_bytes / (gbps * 1e9) * 1e6
        nhd = b.run().clone()
        t_nhd = mb.bench(lambda b=b: b.run()) * 1e3
        b.k_cache, b.v_cache = hnd_view(b.k_cache), hnd_view(b.v_cache)
        hnd = b.run().clone()
        t_hnd = mb.bench(lambda b=b: b.run()) * 1e3
        same = torch.equal(nhd, hnd)
        report[name] = {"nhd_us": t_nhd, "hnd_us": t_hnd, "floor_us": floor_us, "same_output": same}
        print(
            f"{name}: NHD {t_nhd:6.1f} us ({t_nhd / floor_us:.2f}x)  HND {t_hnd:6.1f} us ({t_hnd / floor_us:.2f}x)"
            f"  floor {floor_us:.1f} us  same output: {same}",
            flush=True,
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "copy_GBps": gbps, "cases": report}, f, indent=1)


if __name__ == "__main__":
    main()
