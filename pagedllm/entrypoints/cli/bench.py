"""`pagedllm bench <kind>`: benchmarks. Each kind is a module with `add_cli_args(parser)` and
`main(args) -> int`; add one by appending to `BENCHMARKS`."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

BENCHMARKS: list[tuple[str, str, str]] = [
    # (subcommand, module, help)
    ("throughput", "pagedllm.benchmarks.throughput", "Offline throughput (random lengths or --workload W1..W4)."),
    ("latency", "pagedllm.benchmarks.latency", "Per-token decode latency of one batch."),
    ("serve", "pagedllm.benchmarks.serve", "Load-test an OpenAI-compatible server (TTFT/TPOT/ITL, throughput)."),
    ("compare", "pagedllm.benchmarks.plot", "Compare saved result JSONs (table; --plot draws them side by side)."),
]


def _run(args: argparse.Namespace) -> int:
    module = importlib.import_module(args._bench_module)
    return int(module.main(args) or 0)


def register(sub: Any, handlers: dict[str, Callable[[argparse.Namespace], int]]) -> None:
    p = sub.add_parser("bench", help="Benchmarks: " + ", ".join(name for name, _, _ in BENCHMARKS) + ".")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    for name, module_name, help_text in BENCHMARKS:
        bp = bench_sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module_name).add_cli_args(bp)
        bp.set_defaults(_bench_module=module_name)
    handlers["bench"] = _run
