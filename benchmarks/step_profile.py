"""Where a workload's time goes, step by step (GPU; runs on the CPU too, slowly).

Replays a workload (or its first `--num-prompts` requests) through `LLM`'s engine with synchronous
scheduling, timing every step with a device synchronize, and groups the steps by kind: pure decode,
pure prefill, mixed. Optionally profiles a few steps with torch.profiler and prints the top kernels.
Writes JSON under --out-dir. Example:

    python3 benchmarks/step_profile.py --workload W2 --num-prompts 300 --profile-steps 3
    python3 benchmarks/step_profile.py --workload W2 --quantization fp8 --profile-steps 2   # W2-FP8
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", default="W2")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--profile-steps", type=int, default=0, help="torch.profiler over N prefill and N mixed steps")
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--quantization", default=None, help="e.g. fp8 (W2-FP8)")
    p.add_argument("--kv-cache-dtype", default="auto", help="e.g. fp8 (W2-KV8)")
    p.add_argument("--row-limit", type=int, default=18, help="kernels listed per profiled step")
    p.add_argument("--out-dir", default=os.environ.get("OUT", "/tmp"))
    args = p.parse_args()

    import torch

    from pagedllm import LLM, SamplingParams, TokensPrompt
    from pagedllm.benchmarks.workloads import get_workload

    reqs, model_dir, temp = get_workload(args.workload)
    if args.num_prompts:
        reqs = reqs[: args.num_prompts]
    llm = LLM(
        model=model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        max_num_seqs=1024,
        max_num_batched_tokens=16384,
        async_scheduling=False,
        enable_prefix_caching=args.enable_prefix_caching,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    cuda = torch.cuda.is_available()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    steps: list[dict[str, Any]] = []
    orig_exec = core.executor.execute_model

    def timed_exec(so: Any) -> Any:
        sync()
        t = time.perf_counter()
        out = orig_exec(so)
        sync()
        n_dec = sum(1 for n in so.num_scheduled_tokens.values() if n == 1)
        steps.append(
            {
                "tokens": so.total_num_scheduled_tokens,
                "reqs": len(so.num_scheduled_tokens),
                "decodes": n_dec,
                "exec_s": time.perf_counter() - t,
            }
        )
        return out

    core.executor.execute_model = timed_exec  # type: ignore[method-assign]
    for i, (prompt, n) in enumerate(reqs):
        engine.add_request(
            str(i),
            TokensPrompt(prompt_token_ids=prompt),
            SamplingParams(temperature=temp, max_tokens=n, ignore_eos=True, detokenize=False),
        )
    prof_done = {"prefill": 0, "mixed": 0}
    tables: dict[str, str] = {}
    t0 = time.perf_counter()
    n_steps = 0
    while engine.has_unfinished_requests():
        # Profile the next step if it is likely a kind still wanted (judged from the waiting queue).
        want = None
        if args.profile_steps and n_steps >= 2:
            sch = core.scheduler
            kind = "mixed" if sch.running and sch.waiting else ("prefill" if sch.waiting else None)
            if kind and prof_done[kind] < args.profile_steps:
                want = kind
        if want:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as prof:
                engine.step()
                sync()
            prof_done[want] += 1
            key = "cuda_time_total" if cuda else "cpu_time_total"
            tables[f"{want}{prof_done[want]} ({steps[-1]['tokens']} tok, {steps[-1]['decodes']} dec)"] = (
                prof.key_averages().table(sort_by=key, row_limit=args.row_limit, max_name_column_width=60)
            )
        else:
            engine.step()
        n_steps += 1
    wall = time.perf_counter() - t0
    groups: dict[str, dict[str, float]] = defaultdict(lambda: {"steps": 0, "tokens": 0, "exec_s": 0.0})
    for s in steps:
        kind = "decode" if s["decodes"] == s["reqs"] else ("prefill" if s["decodes"] == 0 else "mixed")
        g = groups[kind]
        g["steps"] += 1
        g["tokens"] += s["tokens"]
        g["exec_s"] += s["exec_s"]
    stats = engine.last_scheduler_stats
    result = {
        "workload": args.workload,
        "num_requests": len(reqs),
        "wall_s": wall,
        "steps": len(steps),
        "exec_s": sum(s["exec_s"] for s in steps),
        "groups": dict(groups),
        "num_preemptions": stats.num_preemptions if stats else None,
        "kv_tokens": core.config.cache_config.num_blocks * core.config.cache_config.block_size,
        "max_running": max(s["reqs"] for s in steps),
        "step_list": steps,
    }
    for name, tab in tables.items():
        print(f"==== {name}\n{tab}")
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"step_profile_{args.workload}.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"{args.workload}: {len(reqs)} requests, wall {wall:.2f} s, exec {result['exec_s']:.2f} s, "
        f"{len(steps)} steps, preemptions {result['num_preemptions']}, KV tokens {result['kv_tokens']}, "
        f"max running {result['max_running']}"
    )
    for k, g in groups.items():
        print(
            f"  {k:8s} steps {g['steps']:5d} tokens {g['tokens']:9d} exec {g['exec_s']:7.2f} s "
            f"({1e3 * g['exec_s'] / max(g['steps'], 1):.1f} ms/step)"
        )


if __name__ == "__main__":
    main()
