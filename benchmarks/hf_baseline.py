"""Same-call HF transformers baseline for W3 (Llama-3.1-8B shape, batch 1, 128 in / 256 out, greedy):
`generate` on random bf16 weights, time per output token as `pagedllm bench latency` defines it
((median wall of 256 tokens - median wall of 1 token) / 255), against the weight-read floor measured now.

    PYTHONPATH=. python3 benchmarks/hf_baseline.py [--model benchmarks/workloads/llama-3.1-8b] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pagedllm.benchmarks import floors


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="benchmarks/workloads/llama-3.1-8b")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "hf_baseline_W3.json"))
    args = p.parse_args()

    cfg = AutoConfig.from_pretrained(args.model)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    t0 = time.perf_counter()
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    load_s = time.perf_counter() - t0
    ids = torch.randint(0, 10000, (1, args.input_len), generator=torch.Generator().manual_seed(3)).to(args.device)
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        if args.device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        if args.device == "cuda":
            torch.cuda.synchronize()
        assert out.shape[1] == args.input_len + n
        return time.perf_counter() - t

    run(args.output_len)  # warm-up
    full = statistics.median(run(args.output_len) for _ in range(args.iters))
    one = statistics.median(run(1) for _ in range(args.iters))
    tpot_ms = (full - one) / max(args.output_len - 1, 1) * 1e3
    result = {
        "engine": "HF transformers generate",
        "model": args.model,
        "load_s": load_s,
        "median_request_s": full,
        "median_1token_s": one,
        "time_per_output_token_ms": tpot_ms,
    }
    line = f"HF transformers W3: time per output token {tpot_ms:.3f} ms (median request {full:.3f} s)"
    if args.device == "cuda":
        gbps = floors.copy_bandwidth_gbps(args.device)
        floor_ms = floors.weight_read_bytes(model) / (gbps * 1e9) * 1e3
        result.update(copy_GBps=gbps, weight_floor_ms=floor_ms, x_floor=tpot_ms / floor_ms)
        line += f"; {tpot_ms / floor_ms:.2f}x the weight-read floor {floor_ms:.3f} ms (copy {gbps:.0f} GB/s)"
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(line)


if __name__ == "__main__":
    main()
