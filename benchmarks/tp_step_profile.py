"""Where a tensor-parallel decode step's time goes (issue 25): GPU-busy vs idle per rank, top kernels.

Runs W3's request shape (batch 1, 128 in) on the Llama-3.1-8B shape with dummy weights at --tp N, times a
plain generate (ms per output token), then profiles one more generate with the workers' torch profiler and
reads each rank's Chrome trace: the span of the profiled window, the time the GPU ran kernels (union of the
kernel intervals), the number of CUDA-graph launches (decode steps), the mean gap between consecutive
launches, and the kernels that took the most time. A step whose GPU is busy most of the wall is kernel-bound
(look at the kernel table: all-reduce vs GEMV vs the rest); one whose GPU idles is host-bound.

    python3 benchmarks/tp_step_profile.py --tp 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import defaultdict
from typing import Any


def _busy(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(path: str, top: int = 12) -> dict[str, Any]:
    """One rank's trace: window span, GPU-busy time, graph launches, top kernels (times in ms)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    launches = sorted(e["ts"] for e in events if e.get("name") == "cudaGraphLaunch" and "ts" in e)
    if not kernels:
        return {"trace": path, "kernels": 0}
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    by_name: dict[str, float] = defaultdict(float)
    for e in kernels:
        by_name[e["name"][:90]] += e["dur"]
    gaps = [b - a for a, b in zip(launches, launches[1:])]
    return {
        "trace": os.path.basename(path),
        "span_ms": (end - start) / 1e3,
        "gpu_busy_ms": _busy([(e["ts"], e["ts"] + e["dur"]) for e in kernels]) / 1e3,
        "graph_launches": len(launches),
        "median_launch_gap_ms": sorted(gaps)[len(gaps) // 2] / 1e3 if gaps else None,
        "top_kernels_ms": sorted(((n, t / 1e3) for n, t in by_name.items()), key=lambda x: -x[1])[:top],
    }


def dummy_llm(model: str, max_model_len: int, profile: bool = True, **kwargs: Any) -> Any:
    """An `LLM` of a config-only model with dummy weights, no tokenizer, and (with `profile`) the workers' torch
    profiler writing into a fresh temporary directory (`start_profile` / `stop_profile`)."""
    from pagedllm import LLM

    trace_dir = tempfile.mkdtemp(prefix="step_profile_")
    profiler = {"profiler": "torch", "torch_profiler_dir": trace_dir} if profile else None
    return LLM(
        model, load_format="dummy", max_model_len=max_model_len, skip_tokenizer_init=True, profiler_config=profiler,
        **kwargs,
    )  # fmt: skip


def finish(llm: Any, result: dict[str, Any], json_path: str | None) -> None:
    """Write `result` to `json_path` (if given) and shut the engine down (its workers hold the GPUs)."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    llm.llm_engine.engine_core.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="benchmarks/workloads/llama-3.1-8b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from pagedllm import SamplingParams, TokensPrompt

    llm = dummy_llm(args.model, args.max_model_len, tensor_parallel_size=args.tp)
    prompt = [TokensPrompt(prompt_token_ids=[(i * 7919) % 200 + 10 for i in range(args.input_len)])]
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    for _ in range(2):
        llm.generate(prompt, sp, use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate(prompt, one, use_tqdm=False)
    t1 = time.perf_counter()
    llm.generate(prompt, sp, use_tqdm=False)
    t2 = time.perf_counter()
    per_token = ((t2 - t1) - (t1 - t0)) / (args.output_len - 1) * 1e3
    llm.start_profile()
    llm.generate(prompt, sp, use_tqdm=False)
    paths = llm.stop_profile()
    result = {"tp": args.tp, "ms_per_token": per_token, "one_token_s": t1 - t0, "ranks": [summarize(p) for p in paths]}
    print(f"tp={args.tp}: {per_token:.3f} ms per token (unprofiled), 1-token request {t1 - t0:.4f} s")
    for r in result["ranks"]:
        if not r.get("kernels", 1):
            print(f"  {r['trace']}: no kernels")
            continue
        print(f"  {r['trace']}: span {r['span_ms']:.1f} ms, GPU busy {r['gpu_busy_ms']:.1f} ms "
              f"({r['gpu_busy_ms'] / r['span_ms']:.0%}), {r['graph_launches']} graph launches, "
              f"median gap {r['median_launch_gap_ms']} ms")  # fmt: skip
        for name, ms in r["top_kernels_ms"]:
            print(f"    {ms:9.2f} ms  {name}")
    finish(llm, result, args.json)


if __name__ == "__main__":
    main()
