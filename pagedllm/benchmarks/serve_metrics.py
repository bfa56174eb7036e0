"""The report of `pagedllm bench serve` (benchmarks/serve.py): each request's result, the summary of a run
(throughputs; TTFT / TPOT / ITL / E2E means and percentiles, as vLLM's benchmark_serving names them), its table,
and the --plot series."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from pagedllm.benchmarks.plot import rate_from_token_times


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    start: float = 0.0
    """time.perf_counter() when the request was sent (for the --plot token-rate series)."""
    sent_at: float = 0.0
    """time.time() when the request was sent (--save-detailed: lines up with the engine's PAGEDLLM_STEP_TRACE)."""


def _pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    f = int(k)
    c = min(f + 1, len(s) - 1)
    return s[f] + (s[c] - s[f]) * (k - f)


def summarize(results: list[RequestResult], duration: float, args: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    pcts = [float(x) for x in args.percentiles.split(",") if x.strip()]
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    e2es = [r.latency for r in ok]
    total_out = sum(r.output_tokens for r in ok)
    total_in = sum(r.prompt_len for r in ok)
    out: dict[str, Any] = {
        "base_url": args.base_url,
        "dataset": args.dataset,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": total_out / duration if duration else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration else 0.0,
    }
    wanted = percentile_metrics(args)
    for name, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2es)):
        out[f"mean_{name}_ms"] = 1000 * sum(vals) / len(vals) if vals else 0.0
        if name in wanted:
            out[f"median_{name}_ms"] = 1000 * _pct(vals, 50)  # vLLM's result JSON has it always
            for p in pcts:
                out[f"p{p:g}_{name}_ms"] = 1000 * _pct(vals, p)
    errors = [r.error for r in results if not r.ok]
    if errors:
        out["errors"] = errors[:10]
    return out


def percentile_metrics(args: argparse.Namespace) -> list[str]:
    names = [m.strip() for m in getattr(args, "percentile_metrics", "ttft,tpot,itl,e2el").split(",") if m.strip()]
    bad = [m for m in names if m not in ("ttft", "tpot", "itl", "e2el")]
    if bad:
        raise ValueError(f"percentile_metrics: unknown metric(s) {bad}; expected ttft, tpot, itl, e2el")
    return names


def print_table(s: dict[str, Any], pcts: list[str]) -> None:
    w = 50
    print("=" * w + "\n" + " Serving Benchmark Result ".center(w, "=") + "\n" + "=" * w)
    rows = [
        ("Successful requests:", s["completed"]),
        ("Failed requests:", s["failed"]),
        ("Benchmark duration (s):", f"{s['duration_s']:.2f}"),
        ("Total input tokens:", s["total_input_tokens"]),
        ("Total generated tokens:", s["total_output_tokens"]),
        ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}"),
    ]
    for k, v in rows:
        print(f"{k:<36}{v:>14}")
    for name, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        if f"median_{name}_ms" not in s:
            continue
        print(f" {title} ".center(w, "-"))
        print(f"{'Mean ' + name.upper() + ' (ms):':<36}{s[f'mean_{name}_ms']:>14.2f}")
        for p in pcts:
            print(f"{f'P{p} {name.upper()} (ms):':<36}{s[f'p{p}_{name}_ms']:>14.2f}")
    print("=" * w)


def serve_series(results: list[RequestResult], run_start: float) -> dict[str, Any]:
    """The --plot data: token arrival times binned to tokens/s, and the TTFT / ITL / E2E samples."""
    ok = [r for r in results if r.ok]
    times = []
    for r in ok:
        t = r.start - run_start + r.ttft
        times.append(t)
        for gap in r.itl:
            t += gap
            times.append(t)
    return {
        "rate": rate_from_token_times(times),
        "rate_label": "output tokens/s (streamed chunks)",
        "latency": {
            "TTFT": [r.ttft for r in ok],
            "ITL": [x for r in ok for x in r.itl],
            "E2E": [r.latency for r in ok],
        },
    }
