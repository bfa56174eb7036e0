"""The tp=2 batch-1 push path's kernels (`distributed/push_allreduce.py`) under the Triton interpreter
(`push_allreduce_check.py`, in a subprocess: the interpreter must be chosen before triton is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_push_and_receive_interpreted() -> None:
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    check = Path(__file__).with_name("push_allreduce_check.py")
    proc = subprocess.run([sys.executable, str(check)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == "ok"
