"""The fused MoE's routing on the GPU (issue 18, W6's decode step), microseconds per layer.

Each variant is captured in ONE CUDA graph repeated for `--layers` layers (W6: 48), so that the replay time
includes the gaps between the kernels, which is what launches cost inside a decode step's graph:

* `route_logits`: a memset and the top-k launch that also lists each expert's pairs (`triton_routing.route`);
* `mm+route_logits` / `route_gate`: the router GEMM by torch then that, against the router GEMM in the routing's
  own launch (`router_partials`, which also zeroes the counts);
* `block_logits` / `block_gate`: a whole MoE block (the same two ways) with its grouped GEMMs, and the next
  residual add + RMSNorm summing the k expert outputs.

Session 29's figures for the earlier layouts (a placement launch, `moe_sum`) are in benchmarks/NOTES.md.
W6 shape by default (E=128, I=768, H=2048, top-8, bf16).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

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
    h, dev, dt = w13.shape[2], w13.device, w13.dtype
    x = torch.randn(t, h, device=dev, dtype=dt)
    residual = torch.randn(t, h, device=dev, dtype=dt)
    norm_w = torch.ones(h, device=dev, dtype=dt)
    logits = x @ gate.T

    def block(fused_router: bool) -> None:
        if fused_router:
            out = triton_moe.fused_moe(x, w13, w2, None, top_k, True, sum_experts=False, gate_weight=gate)
        else:
            out = triton_moe.fused_moe(x, w13, w2, x @ gate.T, top_k, True, sum_experts=False)
        triton_ops.fused_add_rms_norm(out, residual, norm_w, 1e-6)

    return {
        "route_logits": graph_us_per_layer(lambda: triton_routing.route(logits, top_k, True), layers),
        "mm+route_logits": graph_us_per_layer(lambda: triton_routing.route(x @ gate.T, top_k, True), layers),
        "route_gate": graph_us_per_layer(lambda: triton_routing.route(None, top_k, True, gate=(x, gate)), layers),
        "block_logits": graph_us_per_layer(lambda: block(False), layers),
        "block_gate": graph_us_per_layer(lambda: block(True), layers),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=8)
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
