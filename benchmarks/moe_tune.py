"""Tiles of the fused MoE grouped GEMMs (`pagedllm/model_executor/layers/fused_moe/configs.py`) timed on
the GPU for one shape (default W6: Qwen3-30B-A3B, E=128, I=768, H=2048, top-8) at several batch sizes.
Every GEMM is timed alone (the up GEMM with SiLU-and-mul in its epilogue unless PAGEDLLM_MOE_FUSED_SILU=0),
replayed from a CUDA graph (as decode runs; no launch overhead), for each tile;
per bucket the BLOCK_M with the least up + down time wins, with its best up and down tiles. Writes the
table as JSON (`--out`, the format of `fused_moe/tuned/*.json`) and prints, per bucket, the tuned and the
default time of the two GEMMs and the floor (bytes of the experts touched / copy bandwidth).

    python3 benchmarks/moe_tune.py --out $OUT/E128_N768_K2048.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable

import torch

from pagedllm.benchmarks import floors
from pagedllm.model_executor.layers.fused_moe import configs, triton_moe, triton_routing


def graph_ms(fn: Callable[[], object], reps: int = 20) -> float:
    """Median time of one replay of `fn` captured in a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return floors._median_ms(g.replay, warmup=3, reps=reps)


def candidates() -> list[configs.Config]:
    out = []
    for bm, bn, bk, stages in itertools.product((16, 32, 64), (32, 64, 128), (64, 128, 256), (3, 4)):
        if bk == 256 and (bm > 16 or bn == 128):
            continue
        if bm == 64 and bk == 128 and stages == 4:
            continue  # shared memory
        warps = 8 if bm * bn >= 64 * 128 else 4
        out.append(configs._cfg(bm, bn, bk, 8 if bm >= 64 else 1, warps, stages))
    # Prefill-sized tiles (timed only where experts get >= 2 rows on average).
    out += [configs._cfg(128, 128, 64, 8, 8, 3), configs._cfg(128, 64, 64, 8, 4, 3)]
    out += [
        configs._cfg(128, 128, 64, 8, 8, 4),
        configs._cfg(128, 64, 64, 8, 4, 4),
        configs._cfg(128, 64, 128, 8, 8, 3),
        configs._cfg(256, 64, 64, 8, 8, 3),
        configs._cfg(128, 128, 32, 8, 8, 4),
        configs._cfg(128, 128, 32, 8, 4, 4),
        configs._cfg(64, 128, 64, 8, 4, 3),
    ]
    return out


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """The MoE shape's options (default W6: Qwen3-30B-A3B's E=128, I=768, H=2048, top-8)."""
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=8)


def main() -> None:
    p = argparse.ArgumentParser()
    add_shape_args(p)
    p.add_argument("--batches", default="1,8,32,64,128,256,512,2048,8192")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    e, i, h, k = a.experts, a.inter, a.hidden, a.top_k
    dev = "cuda"
    gbps = floors.copy_bandwidth_gbps(dev)
    w13 = torch.randn(e, 2 * i, h, device=dev, dtype=torch.bfloat16) * h**-0.5
    w2 = torch.randn(e, h, i, device=dev, dtype=torch.bfloat16) * i**-0.5
    cands = candidates()
    buckets: dict[str, dict] = {}
    report = {}
    for t in [int(x) for x in a.batches.split(",")]:
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        logits = torch.randn(t, e, device=dev, dtype=torch.bfloat16)
        weights, ids = triton_routing.fused_topk(logits, k, True)
        touched = int(torch.unique(ids).numel())
        floor_ms = touched * 3 * i * h * 2 / (gbps * 1e9) * 1e3
        inter = torch.empty(t * k, 2 * i, device=dev, dtype=torch.bfloat16)
        act = torch.randn(t * k, i, device=dev, dtype=torch.bfloat16)
        out = torch.empty(t * k, h, device=dev, dtype=torch.bfloat16)
        wflat = weights.reshape(-1)

        def gemms(up: configs.Config, down: configs.Config, bufs: tuple = (x, ids, inter, act, out, wflat)) -> tuple:
            """(up ms, down ms) with these tiles (the buffers bound now: called within this iteration)."""
            xb, idb, interb, actb, outb, wb = bufs
            s, eids, npp = triton_routing.moe_align_block_size(idb, up["BLOCK_M"], e)
            if triton_moe.fused_silu():  # the up GEMM writes silu(gate) * up
                t_up = graph_ms(lambda: triton_moe._grouped_gemm(xb, w13, actb, None, s, eids, npp, k, up, True))
            else:
                t_up = graph_ms(lambda: triton_moe._grouped_gemm(xb, w13, interb, None, s, eids, npp, k, up))
            t_dn = graph_ms(lambda: triton_moe._grouped_gemm(actb, w2, outb, wb, s, eids, npp, 1, down))
            return t_up, t_dn

        d_up, d_dn = gemms(*configs.default_config(e, t * k))
        best_up: dict[int, tuple[float, configs.Config]] = {}
        best_dn: dict[int, tuple[float, configs.Config]] = {}
        for c in cands:
            bm = c["BLOCK_M"]
            if (bm > 16 and t * k / e < 2) or (bm < 64 and t >= 4096):  # (big batches: prefill tiles only)
                continue
            try:
                tu, td = gemms(c, c)
            except Exception:  # noqa: BLE001 - out of resources for this tile
                continue
            if tu < best_up.get(bm, (1e9, c))[0]:
                best_up[bm] = (tu, c)
            if td < best_dn.get(bm, (1e9, c))[0]:
                best_dn[bm] = (td, c)
        bm = min(best_up, key=lambda m: best_up[m][0] + best_dn[m][0])
        tuned_ms = best_up[bm][0] + best_dn[bm][0]
        buckets[str(t)] = {"up": best_up[bm][1], "down": best_dn[bm][1]}
        report[t] = {"tuned_ms": tuned_ms, "default_ms": d_up + d_dn, "floor_ms": floor_ms, "touched": touched}
        print(
            f"T={t:5d}: up+down tuned {tuned_ms:.3f} ms (BLOCK_M {bm}), default {d_up + d_dn:.3f} ms; "
            f"floor {floor_ms:.3f} ms ({touched} experts); up {best_up[bm][1]}; down {best_dn[bm][1]}",
            flush=True,
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                {
                    "shape": [e, i, h],
                    "gpu": torch.cuda.get_device_name(),
                    "copy_GBps": gbps,
                    "report": report,
                    "buckets": buckets,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
