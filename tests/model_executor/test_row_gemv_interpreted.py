"""The batch-1 row GEMV's fused variants (the tp=2 push all-reduce, the gate/up GLU) under the Triton interpreter
(`row_gemv_interp_check.py`, in a subprocess: the interpreter must be chosen before triton is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_push_and_glu_interpreted() -> None:
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    check = Path(__file__).with_name("row_gemv_interp_check.py")
    proc = subprocess.run([sys.executable, str(check)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == "ok"
