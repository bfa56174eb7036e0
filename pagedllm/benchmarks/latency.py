"""`pagedllm bench latency`: per-token decode latency of one batch.

Time per output token = (median wall of an output-len request batch - median wall of a 1-token batch)
/ (output_len - 1), as W3 defines it; also percentiles of the full-request wall time.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pagedllm.benchmarks import floors
from pagedllm.benchmarks.plot import add_plot_arg, plot_run
from pagedllm.engine.arg_utils import EngineArgs


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--num-iters-warmup", type=int, default=3)
    p.add_argument("--output-json", default=None)
    add_plot_arg(p)
    EngineArgs.add_cli_args(p)


def main(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams, TokensPrompt

    ea = EngineArgs.from_cli_args(args)
    if ea.load_format == "dummy":
        ea.skip_tokenizer_init = True
    llm = LLM(**{k: getattr(ea, k) for k in EngineArgs.field_names()})
    rng = random.Random(3)
    prompts = [
        TokensPrompt(prompt_token_ids=[rng.randint(0, 10000) for _ in range(args.input_len)])
        for _ in range(args.batch_size)
    ]

    def run(n: int) -> float:
        llm.reset_prefix_cache()
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t

    for _ in range(args.num_iters_warmup):
        run(args.output_len)
    full_in_order = [run(args.output_len) for _ in range(args.num_iters)]
    full = sorted(full_in_order)
    one = sorted(run(1) for _ in range(args.num_iters))
    tpot = (statistics.median(full) - statistics.median(one)) / max(args.output_len - 1, 1)
    result = {
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "median_request_s": statistics.median(full),
        "median_1token_s": statistics.median(one),
        "p90_request_s": full[int(0.9 * (len(full) - 1))],
        "time_per_output_token_ms": tpot * 1e3,
    }
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # in-process engine: its KV capacity
    if core is not None:
        result["kv_cache_tokens"] = (core.config.cache_config.num_blocks - 1) * core.config.cache_config.block_size
    floor = ""
    model = floors.in_process_model(llm)
    if model is not None and next(model.parameters()).is_cuda:
        # The weight-read floor of one decode step, measured in this run (W3 reports time / floor).
        gbps = floors.copy_bandwidth_gbps(next(model.parameters()).device)
        floor_ms = floors.weight_read_bytes(model) / (gbps * 1e9) * 1e3
        result.update(copy_GBps=gbps, weight_floor_ms=floor_ms, x_floor=tpot * 1e3 / floor_ms)
        floor = f"; {result['x_floor']:.3f}x the weight-read floor {floor_ms:.3f} ms (copy {gbps:.0f} GB/s)"
    print(
        f"Time per output token: {tpot * 1e3:.3f} ms (median request {result['median_request_s']:.3f} s, "
        f"1-token {result['median_1token_s']:.4f} s){floor}"
    )
    if getattr(args, "plot", None):
        tokens = args.batch_size * args.output_len
        ends = [sum(full_in_order[: i + 1]) for i in range(len(full_in_order))]
        result["series"] = {
            "rate": [[t, tokens / lat] for t, lat in zip(ends, full_in_order)],
            "rate_label": "output tokens/s per timed batch",
            "rate_x": "time in timed batches (s)",
            "latency": {f"{args.output_len}-token batch": full, "1-token batch": one},
        }
        plot_run(
            result, args.plot, f"bench latency: batch {args.batch_size}, in {args.input_len}, out {args.output_len}"
        )
        print(f"Plot saved to {args.plot}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
