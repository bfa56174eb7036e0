"""The FP8 W8A8 decode GEMV (issue 19, W3-FP8) on Llama-3.1-8B's four linear shapes at M=1, streamed over weight
copies that overflow L2 (as a decode step's weights do), each candidate timed inside a CUDA graph against the
weight-read floor (FP8 bytes / copy bandwidth measured here). Every candidate is checked against the float32
product of the quantized operands first (its relative error is printed).

Why (session 36, benchmarks/NOTES.md): W3-FP8 gained only 14 % from the H100 to the H200 where bf16's W3 gained
24 %: the GEMV was bound by instruction issue, not bytes. Candidates:

    gemv    the engine's kernel (`w8a8_ops.w8a8_gemv`) over launches (rows x K step, warps, cp.async stages,
            float16 pairs or float32 products), on the 16-bit row or on its FP8 twin (the row quantized
            beforehand by its producer, `quantization/act_twin.py`)
    tc      the tensor cores: tl.dot of the activation row (broadcast to 16 rows) with the [BN, BK] weight tile
            (or the weight tile as the A operand: wgmma's m64n16k32 e4m3 with float32 promotion), split-K with
            the last program of a column block summing the partials (1.58x the floor on an H200: not taken)

    PYTHONPATH=. python benchmarks/w8a8_gemv_sweep.py [--only gemv tc] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

from pagedllm.benchmarks import floors
from pagedllm.model_executor.layers.quantization import w8a8_ops
from pagedllm.triton_utils import split_counters

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
QMAX = w8a8_ops.FP8_MAX


@triton.jit
def _tc_kernel(x_ptr, w_ptr, ws_ptr, part_ptr, out_ptr, cnt_ptr, N, K, K_SPLIT, SPLIT: tl.constexpr,
               QMAX: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PIPE: tl.constexpr,
               IMPRECISE: tl.constexpr, W_AS_A: tl.constexpr, AB: tl.constexpr):  # fmt: skip
    pid_n = tl.program_id(0)
    sp = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    rows = tl.arange(0, 16)
    scale = w8a8_ops._row_scale(x_ptr, K, QMAX, AB)
    k_begin = sp * K_SPLIT
    if W_AS_A:  # [BN, BK] x [BK, 16]: the weight tile is the MMA's A operand (wgmma from shared memory at BN 64)
        acc_t = tl.zeros([BN, 16], dtype=tl.float32)
        for k0 in tl.range(k_begin, k_begin + K_SPLIT, BK, num_stages=PIPE):
            kk = k0 + offs_k
            xq = tl.clamp(tl.load(x_ptr + kk).to(tl.float32) / scale, -QMAX, QMAX).to(w_ptr.dtype.element_ty)
            xb = tl.broadcast_to(xq[:, None], [BK, 16])
            w = tl.load(w_ptr + offs_n[:, None] * K + kk[None, :])
            acc_t = tl.dot(w, xb, acc_t, max_num_imprecise_acc=IMPRECISE)
        res = tl.sum(tl.where(rows[None, :] == 0, acc_t, 0.0), axis=1)
    else:
        acc = tl.zeros([16, BN], dtype=tl.float32)
        for k0 in tl.range(k_begin, k_begin + K_SPLIT, BK, num_stages=PIPE):
            kk = k0 + offs_k
            xq = tl.clamp(tl.load(x_ptr + kk).to(tl.float32) / scale, -QMAX, QMAX).to(w_ptr.dtype.element_ty)
            xa = tl.broadcast_to(xq[None, :], [16, BK])
            w = tl.load(w_ptr + offs_n[:, None] * K + kk[None, :])
            acc = tl.dot(xa, tl.trans(w), acc, max_num_imprecise_acc=IMPRECISE)
        res = tl.sum(tl.where(rows[:, None] == 0, acc, 0.0), axis=0)
    if SPLIT == 1:
        tl.store(out_ptr + offs_n, (res * scale * tl.load(ws_ptr + offs_n)).to(out_ptr.dtype.element_ty))
    else:
        tl.store(part_ptr + sp * N + offs_n, res)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        tl.debug_barrier()
        if done == SPLIT - 1:
            tot = tl.zeros([BN], dtype=tl.float32)
            for i in range(0, SPLIT):
                tot += tl.load(part_ptr + i * N + offs_n, cache_modifier=".cg")
            tl.store(out_ptr + offs_n, (tot * scale * tl.load(ws_ptr + offs_n)).to(out_ptr.dtype.element_ty))
            tl.atomic_xchg(cnt_ptr + pid_n, 0)


def run_gemv(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, bn: int, bk: int, warps: int, stages: int,
             h2: int, twin: int, pre: tuple | None = None) -> torch.Tensor:  # fmt: skip
    launch = w8a8_ops.W8A8Launch(bn, bk, warps, stages, bool(h2))
    return w8a8_ops.w8a8_gemv(x, w, ws, None, None, pre if twin else None, launch)


def run_tc(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, bn: int, bk: int, warps: int, pipe: int,
           split: int, imprecise: int, w_as_a: int = 0) -> torch.Tensor:  # fmt: skip
    n, k = w.shape
    while k % (split * bk):
        split //= 2
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split, n, dtype=torch.float32, device=x.device) if split > 1 else out
    cnt = split_counters(x.device, n // bn, owner="w8a8_sweep")
    _tc_kernel[(n // bn, split)](
        x, w, ws, part, out, cnt, n, k, k // split, SPLIT=split, QMAX=QMAX, BN=bn, BK=bk, PIPE=pipe,
        IMPRECISE=imprecise, W_AS_A=bool(w_as_a), AB=min(triton.next_power_of_2(k), 8192), num_warps=warps,
    )  # fmt: skip
    return out


def candidates(only: list[str]) -> list[tuple]:
    c: list[tuple] = []
    if "gemv" in only:  # (bn, bk, warps, stages, float16 pairs, on the twin)
        c += [
            ("gemv", run_gemv, cfg) for cfg in itertools.product((8, 16, 32), (512,), (4,), (1, 3, 4), (0, 1), (0, 1))
        ]
        c += [("gemv", run_gemv, cfg) for cfg in itertools.product((16,), (256, 1024), (4, 8), (3,), (1,), (0, 1))]
    if "tc" in only:  # (bn, bk, warps, stages, split, max_num_imprecise_acc, weight tile as A)
        c += [("tc", run_tc, cfg) for cfg in itertools.product((32, 64), (128, 256), (4,), (3,), (1, 2, 4), (0,), (0,))]
        c += [
            ("tc", run_tc, cfg) for cfg in itertools.product((64,), (128, 256), (4,), (3, 4), (1, 2, 4), (0, 32), (1,))
        ]
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", default=["gemv", "tc"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="the engine's launch alone, on the row and on its twin")
    args = ap.parse_args()
    bw = floors.copy_bandwidth_gbps("cuda") * 1e9
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = {}
    for name, (n, k) in SHAPES.items():
        copies = max(1, -(-(256 << 20) // (n * k)))
        ws_ = []
        for _ in range(copies):
            wq, wsc = w8a8_ops.quantize_weight_per_channel(torch.randn(n, k, device="cuda", generator=g) * 0.02,
                                                           w8a8_ops.FP8_DTYPE)  # fmt: skip
            ws_.append((wq, wsc.contiguous()))
        x = torch.randn(1, k, device="cuda", generator=g).to(torch.bfloat16)
        xq, xs = w8a8_ops.quantize_rows(x, w8a8_ops.FP8_DTYPE)
        ref = ((xq.float() * xs) @ (ws_[0][0].float() * ws_[0][1][:, None]).t()).view(-1)
        cases[name] = dict(n=n, k=k, ws=ws_, x=x, ref=ref, pre=(xq, xs), floor_ms=n * k / bw * 1e3)
    floor_layer = sum(c["floor_ms"] for c in cases.values())
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s, FP8 floor {floor_layer * 1e3:.1f} us a layer")
    rows = []
    todo = [("gemv", run_gemv, (*w8a8_ops.W8A8Launch(), t)) for t in (0, 1)] if args.quick else candidates(args.only)
    for kind, fn, cfg in todo:
        per, errs, ok = {}, {}, True
        for name, c in cases.items():
            if c["n"] % cfg[0] or cfg[1] > c["k"]:
                ok = False
                break
            extra = {"pre": c["pre"]} if kind == "gemv" else {}
            try:
                y = fn(c["x"], *c["ws"][0], *cfg, **extra).float().view(-1)
            except Exception as e:  # noqa: BLE001 - a config Triton cannot build: skip it
                print(f"  {kind} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                ok = False
                break
            errs[name] = ((y - c["ref"]).abs().max() / c["ref"].abs().max()).item()
            if errs[name] > 2e-2:
                print(f"  {kind} {cfg} {name}: wrong (relative error {errs[name]:.3g})")
                ok = False
                break
            per[name] = do_bench_cudagraph(
                lambda c=c, extra=extra, fn=fn, cfg=cfg: [fn(c["x"], wq, wsc, *cfg, **extra) for wq, wsc in c["ws"]],
                rep=30,
            ) / len(c["ws"])
        if ok:
            tot = sum(per.values())
            rows.append(dict(kind=kind, cfg=cfg, layer_ms=tot, x_floor=tot / floor_layer, shapes=per,
                             max_rel_err=max(errs.values())))  # fmt: skip
    rows.sort(key=lambda r: r["layer_ms"])
    by_kind: dict[str, list] = {}
    for r in rows:
        by_kind.setdefault(r["kind"], []).append(r)
    for kind, rs in by_kind.items():
        print(f"==== {kind}")
        for r in rs[:5]:
            sh = " ".join(f"{s} {v * 1e3:.1f}" for s, v in r["shapes"].items())
            print(f"  {r['cfg']}: {r['layer_ms'] * 1e3:.1f} us/layer = {r['x_floor']:.2f}x floor ({sh} us),"
                  f" rel err {r['max_rel_err']:.2e}")  # fmt: skip
    d = w8a8_ops.W8A8Launch()
    for twin in (0, 1):
        ship = [r for r in rows if r["kind"] == "gemv" and r["cfg"] == (*d, twin)]
        if ship:
            r = ship[0]
            on = " on the twin" if twin else ""
            print(f"engine's launch {tuple(d)}{on}: {r['layer_ms'] * 1e3:.1f} us/layer = {r['x_floor']:.2f}x floor")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_GBps=bw / 1e9, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
