"""W2-shaped decode attention over a bf16 and an FP8 paged cache, default launch vs a tile sweep (run on a GPU).

    PYTHONPATH=. python3 benchmarks/attn_fp8_sweep.py [--json out.json] [--batches 256 1000]

Issue 19's W2-KV8 gains +4.7 % over bf16 W2 where vLLM gains +10 %: the FP8 cache runs the bf16 cache's decode tiles
(`launch_config`: 128 keys, 4 warps, 2 stages; 64 keys when requests run longest first), which move half the bytes
per tile. This times the decode launch alone for Llama-3.1-8B's attention (32 q / 8 kv heads, head 128, block 16) at
W2's decode batches (contexts U[1024, 1152], a fragmented cache), as the engine runs it (`req_order`, CUDA graph
replay), and every (TILE_N, warps, stages) of the sweep with the same grid; for the FP8 cache, the kernel with its
dots in float16 (the default) and in bfloat16 (`PAGEDLLM_FP8_ATTN_F16=0`); reports us, GB/s of K/V read and the
fraction of the copy bandwidth. Each FP8 result is checked against the bf16 kernel on the dequantized cache.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os

import torch
from attn_microbench import bench, floors

from pagedllm.attention.ops.triton_paged_attn import paged_attention, request_order

H, KVH, D, BS = 32, 8, 128, 16  # Llama-3.1-8B


def make_batch(n: int, dtype: torch.dtype, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed + n)
    seq = torch.randint(1024, 1153, (n,), generator=g).tolist()
    nblk = [math.ceil(s / BS) for s in seq]
    perm = torch.randperm(sum(nblk) + 1, generator=g)
    bt = torch.zeros(n, max(nblk), dtype=torch.int32)
    i = 0
    for r, k in enumerate(nblk):
        bt[r, :k] = perm[i : i + k].to(torch.int32)
        i += k
    shape = (sum(nblk) + 1, BS, KVH, D)
    k = torch.randn(shape, device="cuda")
    v = torch.randn(shape, device="cuda")
    k, v = k.to(dtype), v.to(dtype)
    sl = torch.tensor(seq, dtype=torch.int32, device="cuda")
    return {
        "q": torch.randn(n, H, D, dtype=torch.bfloat16, device="cuda"),
        "k": k,
        "v": v,
        "bt": bt.cuda(),
        "sl": sl,
        "qsl": torch.arange(n + 1, dtype=torch.int32, device="cuda"),
        "order": request_order(sl, n),
        "kv_bytes": sum(seq) * KVH * D * 2 * k.element_size(),
        "n": n,
    }


def run(b: dict, out: torch.Tensor, ordered: bool = True, **cfg) -> torch.Tensor:
    fp8 = b["k"].element_size() == 1
    one = torch.ones(1, dtype=torch.float32, device="cuda")
    return paged_attention(
        b["q"],
        b["k"],
        b["v"],
        out,
        b["bt"],
        b["sl"],
        b["qsl"],
        num_actual_tokens=b["n"],
        num_reqs=b["n"],
        max_query_len=1,
        scale=D**-0.5,
        kv_scales=(one, one) if fp8 else None,
        req_order=b["order"] if ordered else None,
        **cfg,
    )


def measure(b: dict, ref: torch.Tensor, label: str, cfg: dict, copy: float, ordered: bool = True) -> dict | None:
    """One launch configuration: us (CUDA graph replay), GB/s of K/V, error against the bf16 reference."""
    name = "fp8" if b["k"].element_size() == 1 else "bf16"
    out = torch.empty_like(b["q"])
    try:
        got = run(b, out, ordered, **cfg).clone()
        err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        us = bench(lambda: run(b, out, ordered, **cfg), reps=3) * 1e3
    except Exception as e:  # a configuration that does not fit shared memory
        print(f"{name} n={b['n']} {label}: {type(e).__name__}", flush=True)
        return None
    gbs = b["kv_bytes"] / (us * 1e-6) / 1e9
    print(f"{name:4} n={b['n']:5} {label:40} {us:8.1f} us {gbs:7.0f} GB/s {gbs / copy:5.2f}x err {err:.1e}", flush=True)
    return {"cache": name, "batch": b["n"], "cfg": label, "us": us, "GBps": gbs, "of_copy": gbs / copy, "err": err}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 1000])
    ap.add_argument("--quick", action="store_true", help="a smaller sweep (TILE_N 64 / 128, stages 2 / 3)")
    args = ap.parse_args()
    fl = floors()
    copy = fl["copy_GBps"]
    print(f"copy {copy:.0f} GB/s, bf16 matmul {fl['bf16_matmul_TFLOPs']:.0f} TFLOP/s", flush=True)
    rows: list[dict | None] = []
    for n in args.batches:
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            b = make_batch(n, dtype)
            ref_b = dict(b, k=b["k"].to(torch.bfloat16), v=b["v"].to(torch.bfloat16))
            ref = run(ref_b, torch.empty_like(b["q"])).clone()
            # FP8: the kernel with its dots in float16 (the default), then in bfloat16 (PAGEDLLM_FP8_ATTN_F16=0).
            # --quick sweeps the first variant only (bf16 caches: the defaults only).
            fp8 = dtype != torch.bfloat16
            for i, f16 in enumerate(("1", "0") if fp8 else ("1",)):
                os.environ["PAGEDLLM_FP8_ATTN_F16"] = f16
                tag = f" f16={f16}" if fp8 else ""
                rows.append(measure(b, ref, "default (ordered)" + tag, {}, copy))
                rows.append(measure(b, ref, "default (unordered)" + tag, {}, copy, ordered=False))
                if args.quick and (i > 0 or not fp8):
                    continue
                tiles = ((64, 128), (4, 8), (2, 3)) if args.quick else ((64, 128, 256), (4, 8), (2, 3, 4))
                for tn, nw, ns in itertools.product(*tiles):
                    if tn * D * b["k"].element_size() * 2 * ns > 200_000:
                        continue
                    cfg = {"block_m": 16, "tile_n": tn, "num_warps": nw, "num_stages": ns}
                    rows.append(measure(b, ref, f"tile {tn} warps {nw} stages {ns}{tag}", cfg, copy))
    best: dict = {}
    for r in rows:
        if r is None:
            continue
        key = (r["cache"], r["batch"])
        if r["err"] < 2e-2 and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    print("best:")
    for r in best.values():
        print(f"  {r['cache']} n={r['batch']}: {r['cfg']} {r['us']:.1f} us ({r['of_copy']:.2f}x copy)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"floors": fl, "rows": [r for r in rows if r]}, f, indent=1)


if __name__ == "__main__":
    main()
