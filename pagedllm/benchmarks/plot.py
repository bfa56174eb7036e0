"""Plots of benchmark runs with matplotlib: `pagedllm bench throughput|latency|serve --plot out.png` and
`pagedllm bench compare a.json b.json --plot out.png`.

A run given `--plot` also stores a `series` block in its result (and its JSON), the raw data the figure
is drawn from, so `compare` can draw saved runs side by side:
- `rate`: [[t_seconds, output_tokens_per_s], ...] over the run (1-s bins of token arrival times for
  `serve` and `throughput`; one point per timed iteration for `latency`);
- `latency`: {name: [seconds, ...]}: the samples whose CDFs are drawn (TTFT, ITL, E2E, per-iteration).
For `throughput` (offline, no per-token timestamps) a request's tokens are spread evenly between its
first-token and finish times, which the rate panel's label says.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence
from typing import Any

RATE_BIN_S = 1.0


def add_plot_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plot", default=None, metavar="OUT.png", help="Draw tokens/s over time and latency CDFs.")


def rate_from_token_times(token_times: Sequence[float], bin_s: float = RATE_BIN_S) -> list[list[float]]:
    """Tokens/s in consecutive `bin_s` bins of the run (times in seconds from its start)."""
    if not token_times:
        return []
    n_bins = int(math.floor(max(token_times) / bin_s)) + 1
    counts = [0] * n_bins
    for t in token_times:
        counts[min(int(t // bin_s), n_bins - 1)] += 1
    return [[(i + 1) * bin_s, c / bin_s] for i, c in enumerate(counts)]


def spread_tokens(spans: Sequence[tuple[float, float, int]]) -> list[float]:
    """Token times for requests known only by (first token time, finish time, tokens): evenly spaced."""
    out: list[float] = []
    for first, last, n in spans:
        if n <= 1:
            out.extend([first] * n)
            continue
        step = (last - first) / (n - 1)
        out.extend(first + i * step for i in range(n))
    return out


def _draw_run(ax_rate: Any, ax_cdf: Any, result: dict[str, Any], title: str) -> None:
    series = result.get("series") or {}
    rate = series.get("rate") or []
    if rate:
        ts, vs = zip(*rate)
        ax_rate.step(ts, vs, where="pre", color="tab:blue")  # each value covers the span ending at its time
        ax_rate.set_ylim(bottom=0)
        mean = sum(vs) / len(vs)
        ax_rate.axhline(mean, color="tab:gray", ls="--", lw=0.8, label=f"mean {mean:.1f} tok/s")
        ax_rate.legend(loc="lower right", fontsize=8)
    ax_rate.set_title(title, fontsize=10)
    ax_rate.set_xlabel(series.get("rate_x", "time (s)"))
    ax_rate.set_ylabel(series.get("rate_label", "output tokens/s"))
    ax_rate.grid(alpha=0.3)
    for name, samples in (series.get("latency") or {}).items():
        if not samples:
            continue
        xs = sorted(1000.0 * s for s in samples)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        p50 = xs[len(xs) // 2]
        ax_cdf.step(xs, ys, where="post", label=f"{name} (p50 {p50:.1f} ms, n={len(xs)})")
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("latency (ms, log)")
    ax_cdf.set_ylabel("fraction of samples")
    ax_cdf.set_ylim(0, 1.02)
    ax_cdf.grid(alpha=0.3, which="both")
    if ax_cdf.get_legend_handles_labels()[0]:
        ax_cdf.legend(loc="lower right", fontsize=8)


def _figure(rows: int, cols: int) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.4 * rows), squeeze=False)
    return fig, axes


def _save(fig: Any, out: str) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def plot_run(result: dict[str, Any], out: str, title: str) -> None:
    """One run: tokens/s over time (left) and latency CDFs (right)."""
    fig, axes = _figure(1, 2)
    _draw_run(axes[0][0], axes[0][1], result, title)
    axes[0][1].set_title("latency CDF", fontsize=10)
    _save(fig, out)


def plot_compare(results: Sequence[dict[str, Any]], names: Sequence[str], out: str) -> None:
    """Runs side by side (one column each; rate and CDF axes shared across columns)."""
    fig, axes = _figure(2, len(results))
    for col, (result, name) in enumerate(zip(results, names)):
        _draw_run(axes[0][col], axes[1][col], result, name)
    for row in axes:
        top = max(ax.get_ylim()[1] for ax in row)
        lo = min(ax.get_xlim()[0] for ax in row)
        hi = max(ax.get_xlim()[1] for ax in row)
        for ax in row:
            ax.set_ylim(0, top)
            ax.set_xlim(lo, hi)
    _save(fig, out)


# ---- `pagedllm bench compare` ---------------------------------------------------------------------
def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", help="Result JSON files (--output-json / --save-result) to compare.")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="Draw the runs side by side (needs --plot runs).")


def main(args: argparse.Namespace) -> int:
    results = []
    for path in args.results:
        with open(path, encoding="utf-8") as f:
            results.append(json.load(f))
    keys = [k for k, v in results[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    keys = [k for k in keys if all(isinstance(r.get(k), (int, float)) for r in results[1:])]
    width = max([len(k) for k in keys] + [6])
    print(f"{'metric':<{width}}" + "".join(f"{os.path.basename(p)[-28:]:>30}" for p in args.results))
    for k in keys:
        print(f"{k:<{width}}" + "".join(f"{r[k]:>30.4g}" for r in results))
    if args.plot:
        missing = [p for p, r in zip(args.results, results) if not r.get("series")]
        if missing:
            print(f"note: no 'series' in {', '.join(missing)} (run with --plot to record it): only the others draw")
        plot_compare(results, [os.path.basename(p) for p in args.results], args.plot)
        print(f"Plot saved to {args.plot}")
    return 0
