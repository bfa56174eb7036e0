"""`pagedllm serve` / `pagedllm bench serve` argument handling (no server started)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from pagedllm.engine.arg_utils import EngineArgs  # noqa: E402
from pagedllm.entrypoints.cli import serve as serve_cli  # noqa: E402


def parser() -> argparse.ArgumentParser:
    return serve_cli.add_serve_args(argparse.ArgumentParser())


def test_every_engine_arg_is_a_flag() -> None:
    p = parser()
    dests = {a.dest for a in p._actions}
    assert EngineArgs.field_names() <= dests
    args = p.parse_args(["m", "--no-enable-prefix-caching", "--served-model-name", "a", "b", "--port", "9"])
    assert args.model == "m" and args.enable_prefix_caching is False and args.served_model_name == ["a", "b"]
    assert p.parse_args([]).model is None


def test_config_yaml_under_cli_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "max-model-len: 4096\nport: 9001\nserved_model_name: qwen\nenable-prefix-caching: false\nmodel: /models/x\n"
    )
    p = parser()
    argv = ["--config", str(cfg), "--port", "8000"]
    args = p.parse_args(argv)
    serve_cli.apply_config_file(p, args, argv)
    assert args.port == 8000  # the CLI wins, even when it gives the default value
    assert args.max_model_len == 4096 and args.served_model_name == ["qwen"]
    assert args.enable_prefix_caching is False and args.model == "/models/x"
    cfg.write_text("no-such-flag: 1\n")
    with pytest.raises(ValueError, match="no-such-flag"):
        serve_cli.apply_config_file(p, p.parse_args(["--config", str(cfg)]), ["--config", str(cfg)])


def test_help_lists_groups() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pagedllm", "serve", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0
    for group in ("Server options", "Model options", "Cache options", "Scheduler options"):
        assert group in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "pagedllm", "bench", "serve", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "--request-rate" in out.stdout and "--save-result" in out.stdout


def test_tool_and_reasoning_flags() -> None:
    args = parser().parse_args(
        ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    )
    assert args.enable_auto_tool_choice is True and args.tool_call_parser == "hermes"
    assert EngineArgs.from_cli_args(args).reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="reasoning_parser"):
        EngineArgs(reasoning_parser="nope")._validate()
    from pagedllm.entrypoints.openai.chat_parsing import check_parser_args

    check_parser_args("pythonic", True)
    with pytest.raises(ValueError, match="enable_auto_tool_choice"):
        check_parser_args(None, True)
    with pytest.raises(ValueError, match="tool_call_parser"):
        check_parser_args("nope", False)
