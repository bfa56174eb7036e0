"""benchmarks/overlap_bench.py on the CPU (gloo, small shapes): the script imports, parses its arguments and runs
its NCCL-overlap variants end to end, writing its JSON; the copy-engine case is CUDA-only and skipped there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_overlap_bench_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "ovb.json"
    cmd = [sys.executable, "benchmarks/overlap_bench.py", "--device", "cpu", "--world", "2", "--iters", "1"]
    cmd += ["--sm-carveout", "0", "--pieces", "2", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())["result"]
    assert set(res) == {"o_proj", "down_proj"}  # (no "ce": CUDA only)
    assert all(r["overlap_equals_serial"] for r in res.values())


def test_overlap_bench_help_lists_the_copy_engine_options() -> None:
    proc = subprocess.run([sys.executable, "benchmarks/overlap_bench.py", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.returncode == 0 and "--ce-only" in proc.stdout and "--pieces" in proc.stdout
