"""Decode GEMV sweep for the quantized W3 path (issue 19, acceptance 3): Llama-3.1-8B's four linear shapes at
M=1, each kernel configuration timed inside a CUDA graph (as W3's decode steps run), against the bf16 cuBLAS GEMV
and the weight-read floor (packed bytes / copy bandwidth measured here). Every configuration is checked against
the dequantized float32 product before it is timed.

    PYTHONPATH=. python benchmarks/gemv_tune.py [--only int4] [--out gemv_tune.json]

(The FP8 GEMV's sweep is benchmarks/w8a8_gemv_sweep.py, over weights streamed from HBM.)

Prints, per kernel family, the best configurations by the per-layer sum (qkv + o + gate_up + down) and the
shipped default's figure."""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
from triton.testing import do_bench_cudagraph

from pagedllm.benchmarks import floors
from pagedllm.model_executor.layers.quantization import int4_ops
from pagedllm.triton_utils import split_counters

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
GROUP = 128


def time_ms(fn) -> float:  # noqa: ANN001
    fn()
    return do_bench_cudagraph(fn, rep=30)


def int4_case(n: int, k: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randint(0, 16, (k, n), device="cuda", generator=g)
    qweight = int4_ops.tile_columns(int4_ops.pack_int4_rows(q))  # the layout the engine uses on the GPU
    zeros = torch.randint(0, 16, (k // GROUP, n), device="cuda", generator=g).to(torch.uint8)
    scales = (torch.rand(k // GROUP, n, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(1, k, device="cuda", generator=g).to(torch.bfloat16)
    ref = x.float() @ int4_ops.dequantize(qweight, zeros, scales, GROUP)
    nbytes = qweight.numel() * 4 + zeros.numel() + scales.numel() * 2
    return dict(x=x, qweight=qweight, zeros=zeros, scales=scales, ref=ref, bytes=nbytes)


def run_int4(c: dict, bn: int, br: int, mult: int, warps: int, stages: int, sms: int) -> torch.Tensor:
    x, qw = c["x"], c["qweight"]
    m, k = x.shape
    n = int4_ops.packed_shape(qw)[1]
    bk = br * 8
    n_blocks = triton.cdiv(n, bn)
    split = max(1, min(mult * sms // max(1, m * n_blocks), k // (bk * 4)))
    k_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    cnt = split_counters(x.device, m * n_blocks)
    int4_ops._int4_gemv_kernel[(m, n_blocks, split)](
        x, qw, c["zeros"], c["scales"], part, out, cnt, m, n, k, x.stride(0), out.stride(0), k_split, split,
        G=GROUP, BN=bn, BR=br, num_warps=warps, num_stages=stages, TILED=qw.dim() == 3,
    )  # fmt: skip
    return out


def sweep(name: str, cases: dict, configs: list[tuple], run, bw: float) -> list[dict]:  # noqa: ANN001
    floor_ms = sum(c["bytes"] for c in cases.values()) / bw * 1e3
    rows = []
    for cfg in configs:
        per_shape, ok = {}, True
        for shape, c in cases.items():
            try:
                out = run(c, *cfg).float()
            except Exception as e:  # noqa: BLE001  (an infeasible config, e.g. out of shared memory)
                print(f"{name} {cfg}: {type(e).__name__}")
                ok = False
                break
            err = ((out - c["ref"]).abs().max() / c["ref"].abs().max()).item()
            if err > 2e-2:
                print(f"{name} {cfg} {shape}: wrong (relative error {err:.3g})")
                ok = False
                break
            per_shape[shape] = time_ms(lambda c=c, cfg=cfg: run(c, *cfg))
        if ok:
            total = sum(per_shape.values())
            rows.append(dict(kernel=name, cfg=cfg, layer_ms=total, x_floor=total / floor_ms, shapes=per_shape))
    rows.sort(key=lambda r: r["layer_ms"])
    print(f"==== {name}: floor {floor_ms * 1e3:.1f} us per layer ({bw / 1e9:.0f} GB/s copy)")
    for r in rows[:8]:
        shapes = " ".join(f"{s} {v * 1e3:.1f}" for s, v in r["shapes"].items())
        print(f"  {r['cfg']}: {r['layer_ms'] * 1e3:.1f} us/layer = {r['x_floor']:.2f}x floor  ({shapes} us)")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["int4"], default=None)
    p.add_argument("--out", default="gemv_tune.json")
    args = p.parse_args()
    bw = floors.copy_bandwidth_gbps() * 1e9  # the floor every bench command uses
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    result: dict = {"device": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9}
    ws = {s: torch.randn(n, k, device="cuda").to(torch.bfloat16) for s, (n, k) in SHAPES.items()}
    xb = torch.randn(1, 4096, device="cuda").to(torch.bfloat16)
    xd = torch.randn(1, 14336, device="cuda").to(torch.bfloat16)
    bf16 = {s: time_ms(lambda w=w, s=s: torch.mm(xd if s == "down" else xb, w.t())) for s, w in ws.items()}
    bf16_floor = sum(w.numel() * 2 for w in ws.values()) / bw * 1e3
    print(f"bf16 cuBLAS: {sum(bf16.values()) * 1e3:.1f} us/layer = {sum(bf16.values()) / bf16_floor:.2f}x floor")
    result["bf16"] = {"layer_ms": sum(bf16.values()), "x_floor": sum(bf16.values()) / bf16_floor}
    del ws
    if args.only in (None, "int4"):
        cases = {s: int4_case(n, k) for s, (n, k) in SHAPES.items()}
        cfgs = [
            (bn, br, mult, w, st, sms)
            for bn, br, mult, w, st in itertools.product((64,), (8, 16), (2, 4, 8), (4, 8), (2, 3, 4))
        ]
        result["int4"] = sweep("int4", cases, cfgs, run_int4, bw)
        del cases
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
