"""Acceptance 8: `pagedllm generate` and the `pagedllm chat` REPL run the default model from the CLI;
`python -m pagedllm` is the same CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedllm import LLM, SamplingParams


def run_cli(*args: str, stdin: str | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "pagedllm", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_generate_cli_matches_offline(smollm2_llm: LLM) -> None:
    out = run_cli(
        "generate",
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "12",
        "--temperature",
        "0",
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
    )
    ref = (
        smollm2_llm.generate(
            ["The capital of France is"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    assert out.rstrip("\n") == ref


@pytest.mark.slow  # CI time: run by hand (pytest -m slow)
def test_chat_repl(smollm2_llm: LLM) -> None:
    q = "What is the capital of France?"
    out = run_cli(
        "chat",
        "--temperature",
        "0",
        "--max-tokens",
        "20",
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        stdin=q + "\n/exit\n",
    )
    ref = (
        smollm2_llm.chat(
            [{"role": "user", "content": q}], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    assert out.strip() == ref.strip()


def test_cli_help_lists_engine_flags() -> None:
    out = run_cli("generate", "--help")
    for flag in (
        "--max-num-batched-tokens",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--kv-cache-memory-bytes",
        "--scheduling-policy",
        "--load-format",
    ):
        assert flag in out


def test_bad_engine_arg_is_a_clear_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pagedllm", "generate", "--prompt", "x", "--block-size", "7"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "block_size" in proc.stderr
