"""The grammar server process in the engine on the CPU (the same protocol as on CUDA, the flags waited for on the
host): see `grammar_process_case.py`."""

from __future__ import annotations

import pytest

pytest.importorskip("xgrammar")

from tests.structured_output.grammar_process_case import run_engine_case  # noqa: E402


def test_grammar_process_engine_cpu(monkeypatch: pytest.MonkeyPatch, smollm2_path: str) -> None:
    run_engine_case(monkeypatch, "cpu", smollm2_path)
