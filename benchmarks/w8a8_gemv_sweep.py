"""The FP8 W8A8 decode GEMV (issue 19, W3-FP8) on Llama-3.1-8B's four linear shapes at M=1, streamed over weight
copies that overflow L2 (as a decode step's weights do), each candidate timed inside a CUDA graph against the
weight-read floor (FP8 bytes / copy bandwidth measured here). Every candidate is checked against the float32
product of the quantized operands first (its relative error is printed).

Why: W3-FP8 gains only 14 % from the H100 to the H200 (4.21 -> 3.64 ms) where bf16's W3 gains 24 %: the shipped
kernel (`w8a8_ops._w8a8_gemv_kernel`) spends ~2.5 instructions a weight plus the activation's quantization redone
by every program, so on the H200's bandwidth it is bound by issue, not bytes. Candidates:

    ship    the shipped kernel (BN rows x BK, in-kernel per-token quantization), PIPE stages of cp.async or none
    pre     the same loop over an activation quantized beforehand (what fusing the quantization into the
            producer would buy); timed with and without the separate `quantize_rows` launch
    h2      weights and activation converted to float16 pairs and multiplied-added by `fma.rn.f16x2` into
            float16 partial sums (the activation scaled by 2^-8 so that no partial sum can overflow), flushed to
            float32 every FLUSH steps: ~1.25 instructions a weight instead of 2.5
    tc      the tensor cores: tl.dot of the activation row (broadcast to 16 rows) with the [BN, BK] weight tile,
            split-K with the last program of a column block summing the partials

    PYTHONPATH=. python benchmarks/w8a8_gemv_sweep.py [--only ship pre h2 tc] [--json out.json]
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
def _x_scale(x_ptr, K, QMAX: tl.constexpr, BK: tl.constexpr):
    offs = tl.arange(0, BK)
    amax = tl.zeros([BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + k0 + offs).to(tl.float32)))
    return tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), QMAX), 1e-10)


@triton.jit
def _pre_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr,
                PIPE: tl.constexpr):  # fmt: skip
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=PIPE):
        xq = tl.load(xq_ptr + k0 + offs_k).to(tl.float32)
        w = tl.load(w_ptr + offs_n[:, None] * K + (k0 + offs_k)[None, :])
        acc += w.to(tl.float32) * xq[None, :]
    res = tl.sum(acc, axis=1) * tl.load(xs_ptr) * tl.load(ws_ptr + offs_n)
    tl.store(out_ptr + offs_n, res.to(out_ptr.dtype.element_ty))


@triton.jit
def _fma_f16x2(a, b, c):
    return tl.inline_asm_elementwise(
        "fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.float16, is_pure=True, pack=2
    )


@triton.jit
def _h2_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, N, K, QMAX: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               FLUSH: tl.constexpr, PIPE: tl.constexpr):  # fmt: skip
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    scale = _x_scale(x_ptr, K, QMAX, BK)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in tl.range(0, K, BK * FLUSH, num_stages=PIPE):
        a16 = tl.zeros([BN, BK], dtype=tl.float16)
        for j in tl.static_range(FLUSH):
            kk = k0 + j * BK + offs_k
            xq = tl.clamp(tl.load(x_ptr + kk).to(tl.float32) / scale, -QMAX, QMAX).to(w_ptr.dtype.element_ty)
            # e4m3 -> float16 is exact; x 2^-8 keeps |w x| <= 448 * 1.75 and a FLUSH-term sum far below 65,504
            xh = xq.to(tl.float16) * 0.00390625
            w = tl.load(w_ptr + offs_n[:, None] * K + kk[None, :]).to(tl.float16)
            a16 = _fma_f16x2(w, tl.broadcast_to(xh[None, :], [BN, BK]), a16)
        acc += a16.to(tl.float32)
    res = tl.sum(acc, axis=1) * (256.0 * scale) * tl.load(ws_ptr + offs_n)
    tl.store(out_ptr + offs_n, res.to(out_ptr.dtype.element_ty))


@triton.jit
def _tc_kernel(x_ptr, w_ptr, ws_ptr, part_ptr, out_ptr, cnt_ptr, N, K, K_SPLIT, SPLIT: tl.constexpr,
               QMAX: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PIPE: tl.constexpr,
               IMPRECISE: tl.constexpr, W_AS_A: tl.constexpr):  # fmt: skip
    pid_n = tl.program_id(0)
    sp = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    rows = tl.arange(0, 16)
    scale = _x_scale(x_ptr, K, QMAX, BK)
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


@triton.jit
def _x_scale_wide(x_ptr, K, QMAX: tl.constexpr, AB: tl.constexpr):
    """The row's scale read in AB-wide blocks (one or two L2 round trips, not K / BK of them)."""
    offs = tl.arange(0, AB)
    amax = tl.zeros([AB], dtype=tl.float32)
    for k0 in range(0, K, AB):
        amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)))
    return tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), QMAX), 1e-10)


@triton.jit
def _v2_kernel(x_ptr, xq_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, N, K, QMAX: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, PIPE: tl.constexpr, AB: tl.constexpr, H2: tl.constexpr, PRE: tl.constexpr,
               FLUSH: tl.constexpr):  # fmt: skip
    """v2: the scale from one wide pass (or pre-quantized x: PRE), x times the reciprocal (the e4m3 conversion
    saturates, so no clamp); H2: float16-pair FMAs flushed to float32 every FLUSH steps."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    if PRE:
        scale = tl.load(xs_ptr)
        inv = 1.0
    else:
        scale = _x_scale_wide(x_ptr, K, QMAX, AB)
        inv = 1.0 / scale
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in tl.range(0, K, BK * FLUSH, num_stages=PIPE):
        if H2:
            a16 = tl.zeros([BN, BK], dtype=tl.float16)
        for j in tl.static_range(FLUSH):
            kk = k0 + j * BK + offs_k
            if PRE:
                xq = tl.load(xq_ptr + kk)
            else:
                xq = (tl.load(x_ptr + kk).to(tl.float32) * inv).to(w_ptr.dtype.element_ty)
            w = tl.load(w_ptr + offs_n[:, None] * K + kk[None, :])
            if H2:
                xh = xq.to(tl.float16) * 0.00390625
                a16 = _fma_f16x2(w.to(tl.float16), tl.broadcast_to(xh[None, :], [BN, BK]), a16)
            else:
                acc += w.to(tl.float32) * xq.to(tl.float32)[None, :]
        if H2:
            acc += a16.to(tl.float32)
    res = tl.sum(acc, axis=1) * ((256.0 if H2 else 1.0) * scale) * tl.load(ws_ptr + offs_n)
    tl.store(out_ptr + offs_n, res.to(out_ptr.dtype.element_ty))


def run_v2(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, bn: int, bk: int, warps: int, pipe: int, h2: int,
           pre_q: int, flush: int, pre: tuple | None = None) -> torch.Tensor:  # fmt: skip
    n, k = w.shape
    xq, xs = pre if pre_q and pre is not None else (x, ws)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _v2_kernel[(n // bn,)](
        x, xq, xs, w, ws, out, n, k, QMAX=QMAX, BN=bn, BK=bk, PIPE=pipe, AB=min(triton.next_power_of_2(k), 8192),
        H2=bool(h2), PRE=bool(pre_q), FLUSH=flush, num_warps=warps,
    )  # fmt: skip
    return out


def run_ship(
    x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, bn: int, bk: int, warps: int, pipe: int
) -> torch.Tensor:
    n, k = w.shape
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    w8a8_ops._w8a8_gemv_kernel[(1, triton.cdiv(n, bn))](
        x, w, ws, ws, ws, out, n, k, x.stride(0), out.stride(0), QMAX=QMAX, IS_INT=False, STATIC=False,
        HAS_BIAS=False, BN=bn, BK=bk, num_warps=warps, num_stages=4, PIPE=pipe,
    )  # fmt: skip
    return out


def run_pre(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, bn: int, bk: int, warps: int, pipe: int,
            quant: bool = True, pre: tuple | None = None) -> torch.Tensor:  # fmt: skip
    n, k = w.shape
    xq, xs = w8a8_ops.quantize_rows(x, w.dtype) if quant or pre is None else pre
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _pre_kernel[(n // bn,)](xq, xs, w, ws, out, n, k, BN=bn, BK=bk, PIPE=pipe, num_warps=warps)
    return out


def run_h2(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, bn: int, bk: int, warps: int, pipe: int,
           flush: int) -> torch.Tensor:  # fmt: skip
    n, k = w.shape
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _h2_kernel[(n // bn,)](x, w, ws, out, n, k, QMAX=QMAX, BN=bn, BK=bk, FLUSH=flush, PIPE=pipe, num_warps=warps)
    return out


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
        IMPRECISE=imprecise, W_AS_A=bool(w_as_a), num_warps=warps,
    )  # fmt: skip
    return out


def candidates(only: list[str]) -> list[tuple]:
    c: list[tuple] = []
    if "ship" in only:
        c += [("ship", run_ship, cfg) for cfg in itertools.product((16, 32), (512, 1024), (4, 8), (1, 3))]
    if "pre" in only:
        c += [("pre", run_pre, cfg) for cfg in itertools.product((16, 32), (512,), (4, 8), (1, 3))]
    if "h2" in only:
        c += [("h2", run_h2, cfg) for cfg in itertools.product((16, 32), (256, 512), (4, 8), (1, 3), (4,))]
    if "v2" in only:  # (bn, bk, warps, pipe, h2, pre-quantized x, flush)
        c += [("v2", run_v2, cfg) for cfg in [
            (16, 512, 4, 1, 0, 0, 1), (16, 512, 4, 3, 0, 0, 1), (16, 1024, 4, 3, 0, 0, 1), (8, 512, 4, 3, 0, 0, 1),
            (16, 512, 2, 3, 0, 0, 1), (32, 512, 4, 3, 0, 0, 1), (16, 512, 4, 4, 0, 0, 1), (16, 512, 4, 3, 0, 0, 2),
            (16, 512, 4, 3, 1, 0, 2), (16, 512, 4, 3, 1, 0, 4), (16, 256, 4, 3, 1, 0, 4), (8, 512, 4, 3, 1, 0, 4),
            (16, 512, 4, 3, 0, 1, 1), (16, 512, 4, 3, 1, 1, 4), (8, 512, 4, 3, 1, 1, 4), (16, 512, 4, 4, 1, 1, 2),
        ]]  # fmt: skip
    if "tc" in only:
        c += [("tc", run_tc, cfg) for cfg in itertools.product((32, 64), (128, 256), (4,), (3,), (1, 2, 4), (0,), (0,))]
        c += [
            ("tc", run_tc, cfg) for cfg in itertools.product((64,), (128, 256), (4,), (3, 4), (1, 2, 4), (0, 32), (1,))
        ]
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", default=["ship", "pre", "h2", "tc"])
    ap.add_argument("--json", default=None)
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
    for kind, fn, cfg in candidates(args.only):
        per, errs, ok = {}, {}, True
        variants = [("", {})] + ([(" (pre-quantized x)", {"quant": False})] if kind == "pre" else [])
        for label, kw in variants:
            per, errs, ok = {}, {}, True
            for name, c in cases.items():
                flush = cfg[4] if kind == "h2" else (cfg[6] if kind == "v2" else 1)
                if c["n"] % cfg[0] or c["k"] % (cfg[1] * flush) or cfg[1] > c["k"]:
                    ok = False
                    break
                extra = dict(kw, pre=c["pre"]) if kind in ("pre", "v2") else {}
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
                    lambda c=c, extra=extra, fn=fn, cfg=cfg: [
                        fn(c["x"], wq, wsc, *cfg, **extra) for wq, wsc in c["ws"]
                    ],
                    rep=30,
                ) / len(c["ws"])
            if ok:
                tot = sum(per.values())
                rows.append(dict(kind=kind + label, cfg=cfg, layer_ms=tot, x_floor=tot / floor_layer, shapes=per,
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
    ship = [r for r in rows if r["kind"] == "ship" and r["cfg"][:4] == (16, 512, 4, 1)]
    if ship:
        print(f"shipped launch (16, 512, 4 warps, PIPE 1): {ship[0]['layer_ms'] * 1e3:.1f} us/layer = "
              f"{ship[0]['x_floor']:.2f}x floor")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_GBps=bw / 1e9, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
