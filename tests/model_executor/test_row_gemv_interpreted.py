"""The batch-1 row GEMV's fused variants (the tp=2 push all-reduce, the gate/up GLU) under the Triton interpreter
(`row_gemv_interp_check.py`, in a subprocess: the interpreter must be chosen before triton is imported)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_interpreted

pytest.importorskip("triton")


def test_push_and_glu_interpreted() -> None:
    assert run_interpreted(Path(__file__).with_name("row_gemv_interp_check.py")) == "ok"
