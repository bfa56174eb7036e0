"""`pagedllm bench throughput`: offline throughput (vLLM's benchmark_throughput shape).

Requests come from `--workload W1..W4` (exact request lists of benchmarks/workloads) or from random
token ids of `--input-len/--output-len` (or `--random-range-ratio` for uniform ranges). Every request
emits exactly its output length (EOS ignored). The prefix cache is emptied before the timed run.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from pagedllm.benchmarks import floors
from pagedllm.benchmarks.plot import add_plot_arg, plot_run, rate_from_token_times, spread_tokens
from pagedllm.engine.arg_utils import EngineArgs


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default=None, help="W1|W2|W3|W4: replay a published workload exactly.")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="Lengths uniform in [len*(1-r), len*(1+r)].")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--temperature", type=float, default=None, help="Default: the workload's, else 0.")
    p.add_argument("--warmup-requests", type=int, default=8)
    p.add_argument("--output-json", default=None)
    add_plot_arg(p)
    EngineArgs.add_cli_args(p)


def build_requests(args: argparse.Namespace) -> tuple[list[tuple[list[int], int]], float]:
    if args.workload:
        from pagedllm.benchmarks.workloads import get_workload

        reqs, model_dir, temp = get_workload(args.workload)
        if args.model is None:
            args.model = model_dir
        return reqs, temp
    rng = random.Random(0)
    r = args.random_range_ratio

    def draw(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - r)), int(n * (1 + r))))

    return [
        ([rng.randint(0, 10000) for _ in range(draw(args.input_len))], draw(args.output_len))
        for _ in range(args.num_prompts)
    ], 0.0


def main(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams, TokensPrompt

    reqs, temp = build_requests(args)
    if args.temperature is not None:
        temp = args.temperature
    ea = EngineArgs.from_cli_args(args)
    if ea.load_format == "dummy":
        ea.skip_tokenizer_init = True
    t0 = time.perf_counter()
    llm = LLM(**{k: getattr(ea, k) for k in EngineArgs.field_names()})
    startup = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in reqs]
    sps = [SamplingParams(temperature=temp, max_tokens=n, ignore_eos=True, detokenize=False) for _, n in reqs]
    if args.warmup_requests:
        k = min(args.warmup_requests, len(reqs))
        llm.generate(prompts[:k], [s.clone(max_tokens=8) for s in sps[:k]], use_tqdm=False)
    llm.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    elapsed = time.perf_counter() - t
    n_in = sum(len(p) for p, _ in reqs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    expected = sum(n for _, n in reqs)
    assert n_out == expected, f"emitted {n_out} tokens, expected {expected}"
    result = {
        "workload": args.workload,
        "elapsed_time": elapsed,
        "num_requests": len(reqs),
        "input_tokens": n_in,
        "output_tokens": n_out,
        "requests_per_second": len(reqs) / elapsed,
        "output_tokens_per_second": n_out / elapsed,
        "total_tokens_per_second": (n_in + n_out) / elapsed,
        "startup_seconds": startup,
    }
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # in-process engine: its scheduler's view
    if core is not None:
        result["kv_cache_tokens"] = (core.config.cache_config.num_blocks - 1) * core.config.cache_config.block_size
        result["num_preemptions"] = core.scheduler.num_preemptions
    floor = ""
    model = floors.in_process_model(llm)
    if core is not None and model is not None and next(model.parameters()).is_cuda:
        # The floor of this request list on this GPU, from bandwidth and matmul rate measured now.
        dev = next(model.parameters()).device
        gbps, tflops = floors.copy_bandwidth_gbps(dev), floors.matmul_tflops(dev)
        fp8_tflops = floors.fp8_matmul_tflops(dev) if floors.quantized_linears(model)[2] else None
        mc = core.config.model_config
        fl = floors.throughput_floor(
            model,
            mc.num_layers,
            int(mc.hf_config.num_attention_heads),
            mc.num_kv_heads,
            mc.head_dim,
            [(len(p), n, o.num_cached_tokens) for (p, n), o in zip(reqs, outs)],
            core.config.scheduler_config.max_num_batched_tokens,
            gbps,
            tflops,
            fp8_tflops,
        )
        result.update(
            copy_GBps=gbps,
            matmul_TFLOPs=tflops,
            fp8_matmul_TFLOPs=fp8_tflops,
            floor_s=fl.seconds,
            floor_bytes_s=fl.bytes_s,
            floor_flops_s=fl.flops_s,
            x_floor=elapsed / fl.seconds,
        )
        floor = (
            f"; {elapsed / fl.seconds:.2f}x the floor {fl.seconds:.3f} s = max(bytes {fl.bytes_s:.3f} s, "
            f"FLOPs {fl.flops_s:.3f} s) at copy {gbps:.0f} GB/s, matmul {tflops:.0f} TFLOP/s"
        )
    print(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['total_tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s ({elapsed:.2f} s; start-up {startup:.1f} s)"
        f"{floor}"
    )
    if getattr(args, "plot", None):
        result["series"] = throughput_series(outs)
        plot_run(result, args.plot, f"bench throughput: {len(reqs)} requests, {n_out} output tokens")
        print(f"Plot saved to {args.plot}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def throughput_series(outs: list) -> dict:
    """The --plot data from each request's metrics (arrival, first token, finish: one clock)."""
    ms = [o.metrics for o in outs if o.metrics is not None and o.metrics.finished_time is not None]
    if not ms:
        return {}
    t0 = min(m.arrival_time for m in ms)
    spans = [
        (m.first_token_time - t0, m.finished_time - t0, len(o.outputs[0].token_ids))
        for o, m in zip(outs, ms)
        if m.first_token_time is not None
    ]
    return {
        "rate": rate_from_token_times(spread_tokens(spans)),
        "rate_label": "output tokens/s (spread first token..finish)",
        "latency": {
            "TTFT": [m.first_token_time - m.arrival_time for m in ms if m.first_token_time is not None],
            "E2E": [m.finished_time - m.arrival_time for m in ms],
        },
    }
