"""The fused MoE's routing and sum over k, old way against new, on the GPU (issue 18, W6's decode step).

Each variant is captured in ONE CUDA graph repeated for `--layers` layers (W6: 48), so that the replay time
includes the gaps between the kernels, which is what launches cost inside a decode step's graph:

* `route_old` / `route_new`: top-k + the expert-sorted layout; `fused_topk` + `moe_align_block_size` (a memset and
  three launches) against `route_and_align` (the count in the top-k launch: a memset and two);
* `mm+route_new` / `route_gate`: the router GEMM (torch) and then the routing, against the routing given the router
  weight (its split-K GEMM in a launch of its own that also zeroes the counts, the partials summed by the top-k);
* `block_sum` / `block_defer` / `block_new`: a whole MoE block and the next residual add + RMSNorm: router GEMM by
  torch with `moe_sum` then the norm; the norm summing the k parts instead (no `moe_sum` launch); that and the router
  GEMM in the routing. (Session 29's `block_old`, with the count in a launch of its own, is in benchmarks/NOTES.md.)

Per batch size, microseconds per layer. W6 shape by default (E=128, I=768, H=2048, top-8, bf16).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from benchmarks.moe_tune import add_shape_args
from pagedllm.benchmarks import floors
from pagedllm.model_executor.layers import triton_ops
from pagedllm.model_executor.layers.fused_moe import triton_moe, triton_routing


def graph_us_per_layer(fn: Callable[[], object], layers: int) -> float:
    """Median replay time of `fn` repeated `layers` times in one CUDA graph, per repetition (us)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(layers):
            fn()
    return floors._median_ms(g.replay, warmup=3, reps=15) * 1e3 / layers


def measure(t: int, w13: torch.Tensor, w2: torch.Tensor, gate: torch.Tensor, top_k: int, layers: int) -> dict:
    """us per layer of each variant at batch size t."""
    e, h, dev, dt = w13.shape[0], w13.shape[2], w13.device, w13.dtype
    x = torch.randn(t, h, device=dev, dtype=dt)
    residual = torch.randn(t, h, device=dev, dtype=dt)
    norm_w = torch.ones(h, device=dev, dtype=dt)
    logits = x @ gate.T
    bm = triton_moe._configs(x, w13, top_k)[0]["BLOCK_M"]

    def route_old() -> None:
        _, ids = triton_routing.fused_topk(logits, top_k, True)
        triton_routing.moe_align_block_size(ids, bm, e)

    def block(defer: bool, fused_router: bool) -> None:
        if fused_router:
            out = triton_moe.fused_moe(x, w13, w2, None, top_k, True, sum_experts=not defer, gate_weight=gate)
        else:
            out = triton_moe.fused_moe(x, w13, w2, x @ gate.T, top_k, True, sum_experts=not defer)
        triton_ops.fused_add_rms_norm(out, residual, norm_w, 1e-6)

    def route_mm() -> None:
        triton_routing.route_and_align(x @ gate.T, top_k, True, bm)

    row = {
        "route_old": graph_us_per_layer(route_old, layers),
        "route_new": graph_us_per_layer(lambda: triton_routing.route_and_align(logits, top_k, True, bm), layers),
        "mm+route_new": graph_us_per_layer(route_mm, layers),
        "route_gate": graph_us_per_layer(
            lambda: triton_routing.route_and_align(None, top_k, True, bm, gate=(x, gate)), layers
        ),
    }
    variants = (("block_sum", False, False), ("block_defer", True, False), ("block_new", True, True))
    for name, defer, fused_router in variants:
        row[name] = graph_us_per_layer(lambda d=defer, f=fused_router: block(d, f), layers)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    add_shape_args(p)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--batches", default="1,8,32,64,128,256,512")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    e, i, h, dev, dt = a.experts, a.inter, a.hidden, "cuda", torch.bfloat16
    w13 = torch.randn(e, 2 * i, h, device=dev, dtype=dt) * h**-0.5
    w2 = torch.randn(e, h, i, device=dev, dtype=dt) * i**-0.5
    gate = torch.randn(e, h, device=dev, dtype=dt) * h**-0.5
    report: dict[str, dict[str, float]] = {}
    for t in [int(x) for x in a.batches.split(",")]:
        row = measure(t, w13, w2, gate, a.top_k, a.layers)
        report[str(t)] = row
        print(f"T={t:5d} " + " ".join(f"{n}={v:7.2f}" for n, v in row.items()), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "us_per_layer": report}, f, indent=1)


if __name__ == "__main__":
    main()
