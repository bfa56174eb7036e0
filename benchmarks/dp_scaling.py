"""How one engine core's time scales with its share of a served workload (issue 25, item 4: S2 at dp=2).

At `--data-parallel-size 2` each core gets half of S2's 400 requests. Without HTTP, ZMQ or the client in between,
this runs S2's request shape (512 random prompt tokens, 128 output tokens, greedy, EOS ignored) offline through
one engine for each `--num-prompts` value (default 400 and 200: one core's load at dp=1 and at dp=2) and prints
the wall time of each and their ratio: the scaling the engine core itself allows, a bound on what the served
dp=2 run can show. With `--profile`, one more run per value under the torch profiler, summarized per CUDA-graph
launch (a decode step is one graph): median device span, kernel-busy time and kernel count of the decode steps,
the device time of the eager (prefill) work, and the decode steps' top kernels.

    python3 benchmarks/dp_scaling.py [--num-prompts 400 200] [--profile] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_step_profile import _busy, dummy_llm, finish  # type: ignore[import-not-found]  # noqa: E402


def graph_steps(path: str, top: int = 10) -> dict[str, Any]:
    """Kernels of one profiled run grouped by the host call that launched them (their correlation id): the
    CUDA-graph launches carrying a whole step's layers (decode steps, or replays of piecewise prefill graphs)
    apart from the eagerly launched kernels."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    graph_corr = {
        e["args"]["correlation"]
        for e in events
        if e.get("name") == "cudaGraphLaunch" and "correlation" in e.get("args", {})
    }
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    per_graph: dict[int, list[dict[str, Any]]] = defaultdict(list)
    eager: list[dict[str, Any]] = []
    for k in kernels:
        c = k.get("args", {}).get("correlation")
        (per_graph[c] if c in graph_corr else eager).append(k)
    # A decode step's graph holds every layer (its kernel count the most common one); much smaller graphs are
    # piecewise prefill segments, and a whole-step graph far longer than the typical one is a prefill (its span
    # > 3x the median).
    sizes = [len(v) for v in per_graph.values()]
    big = statistics.mode(sizes) if sizes else 0  # (the decode steps' count: a prefill graph may hold more)
    steps = [v for v in per_graph.values() if len(v) >= big // 2]
    if steps:
        span_of = [max(k["ts"] + k["dur"] for k in v) - min(k["ts"] for k in v) for v in steps]
        typical = statistics.median(span_of)
        steps = [v for v, sp in zip(steps, span_of, strict=True) if sp <= 3 * typical]
    spans, busies = [], []
    by_name: dict[str, float] = defaultdict(float)
    # A kernel's share of the step's critical path: its end minus the previous kernel's (by end time). With
    # PDL a kernel starts early and waits, so its duration overstates it; the gap before a late start (the
    # launch) counts to the kernel that waited for it.
    crit: dict[str, float] = defaultdict(float)
    # The same shares per launch shape (kernel and grid): a layer's GEMVs apart (qkv, o_proj, gate/up, down)
    crit_launch: dict[str, float] = defaultdict(float)
    for v in steps:
        ivs = [(k["ts"], k["ts"] + k["dur"]) for k in v]
        spans.append((max(b for _, b in ivs) - min(a for a, _ in ivs)) / 1e3)
        busies.append(_busy(ivs) / 1e3)
        for k in v:
            by_name[k["name"][:80]] += k["dur"] / 1e3 / len(steps)
        prev = None
        shapes = [f"{k['name'][:40]} grid {k.get('args', {}).get('grid')}" for k in v]
        count = Counter(shapes)
        layers = sum(n for key, n in count.items() if "attn" in key) or 1
        seen: Counter[str] = Counter()
        for shape, k in sorted(zip(shapes, v, strict=True), key=lambda sk: sk[1]["ts"] + sk[1]["dur"]):
            end = k["ts"] + k["dur"]
            share = (end - (k["ts"] if prev is None else prev)) / 1e3 / len(steps)
            crit[k["name"][:80]] += share
            # A shape launched several times a layer (a layer's two norms; o_proj and down where their grids
            # are equal): its launches apart by their place in the layer
            period = max(1, round(count[shape] / layers))
            crit_launch[shape if period == 1 else f"{shape} #{seen[shape] % period}"] += share
            seen[shape] += 1
            prev = end
    gaps, between = _gaps(steps, eager + [e for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset")])
    return {
        "decode_graphs": len(steps),
        "decode_gap_ms_median": statistics.median(gaps) if gaps else None,
        "decode_gap_work_ms_per_gap": between,
        "kernels_per_decode_graph": big,
        "decode_span_ms_median": statistics.median(spans) if spans else None,
        "decode_busy_ms_median": statistics.median(busies) if busies else None,
        "decode_total_span_ms": sum(spans),
        "other_graph_kernels_ms": sum(k["dur"] for v in per_graph.values() if len(v) < big // 2 for k in v) / 1e3,
        "eager_kernels_ms": sum(k["dur"] for k in eager) / 1e3,
        "eager_kernels": len(eager),
        "decode_top_kernels_ms_per_step": sorted(by_name.items(), key=lambda x: -x[1])[:top],
        "decode_critical_ms_per_step": sorted(crit.items(), key=lambda x: -x[1])[:top],
        "decode_critical_ms_per_launch_shape": sorted(crit_launch.items(), key=lambda x: -x[1])[: 2 * top],
    }


def _gaps(steps: list[list[dict[str, Any]]], others: list[dict[str, Any]]) -> tuple[list[float], list[Any]]:
    """The device time between consecutive decode steps' graphs (ms, next start minus previous end) and the
    eager kernels / copies that ran there, by name, ms per gap (the rest of a gap is idle: the host's)."""
    bounds = sorted((min(k["ts"] for k in v), max(k["ts"] + k["dur"] for k in v)) for v in steps)
    gaps = [(b0 - a1) / 1e3 for (_, a1), (b0, _) in zip(bounds, bounds[1:])]
    work: dict[str, float] = defaultdict(float)
    for e in others:
        if "dur" not in e:
            continue
        t = e["ts"]
        if any(a1 <= t < b0 for (_, a1), (b0, _) in zip(bounds, bounds[1:])):
            work[e["name"][:80]] += e["dur"] / 1e3 / max(1, len(gaps))
    return gaps, sorted(work.items(), key=lambda x: -x[1])[:8]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="benchmarks/workloads/serve-s2")
    ap.add_argument("--num-prompts", type=int, nargs="+", default=[400, 200])
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per value (the minimum is reported)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from pagedllm import SamplingParams, TokensPrompt

    llm = dummy_llm(args.model, args.max_model_len, args.profile, dtype=args.dtype)
    vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
    rng = random.Random(0)

    def prompts(n: int) -> list[TokensPrompt]:
        return [TokensPrompt(prompt_token_ids=[rng.randrange(vocab) for _ in range(args.input_len)]) for _ in range(n)]

    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    llm.generate(prompts(64), sp, use_tqdm=False)  # warm-up, as the serving benchmark's 64 requests
    env = {k: v for k, v in os.environ.items() if k.startswith("PAGEDLLM_")}
    result: dict[str, Any] = {"model": args.model, "env": env, "runs": {}}
    for n in args.num_prompts:
        walls = []
        for _ in range(args.repeats):
            batch = prompts(n)  # fresh tokens: no prefix-cache hits
            t0 = time.perf_counter()
            llm.generate(batch, sp, use_tqdm=False)
            walls.append(time.perf_counter() - t0)
        run: dict[str, Any] = {"walls_s": walls, "output_tok_s": n * args.output_len / min(walls)}
        if args.profile:
            llm.start_profile()
            llm.generate(prompts(n), sp, use_tqdm=False)
            run["profile"] = graph_steps(llm.stop_profile()[0])
        result["runs"][n] = run
        print(f"{n} prompts: wall {min(walls):.3f} s (runs {', '.join(f'{w:.3f}' for w in walls)}), "
              f"{run['output_tok_s']:,.0f} output tok/s")  # fmt: skip
        if "profile" in run and run["profile"]["decode_graphs"]:
            p = run["profile"]
            print(f"  decode graphs {p['decode_graphs']} x {p['kernels_per_decode_graph']} kernels: span "
                  f"{p['decode_span_ms_median']:.3f} ms, busy {p['decode_busy_ms_median']:.3f} ms (median); all "
                  f"decode graphs {p['decode_total_span_ms']:.1f} ms; eager kernels {p['eager_kernels']} "
                  f"{p['eager_kernels_ms']:.1f} ms; other graphs {p['other_graph_kernels_ms']:.1f} ms")  # fmt: skip
            for name, ms in p["decode_top_kernels_ms_per_step"]:
                print(f"    {ms * 1e3:8.1f} us/step  {name}")
    ns = args.num_prompts
    if len(ns) >= 2:
        a, b = result["runs"][ns[0]], result["runs"][ns[1]]
        ratio = min(a["walls_s"]) / min(b["walls_s"]) * ns[1] / ns[0] * 2
        result["dp2_bound"] = ratio
        print(f"wall({ns[0]}) / wall({ns[1]}) scaled to two cores: {ratio:.3f}x")
    finish(llm, result, args.json)


if __name__ == "__main__":
    main()
