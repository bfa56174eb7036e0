"""`pagedllm serve [MODEL]`: the OpenAI-compatible server.

Every engine argument comes from `EngineArgs.add_cli_args` (the one definition); `--config FILE.yaml`
supplies any flag as a YAML key (`max-model-len: 4096` or `max_model_len: 4096`), and flags given on
the command line override the file.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from pagedllm.engine.arg_utils import EngineArgs

# Fail at import (main.py then leaves `serve` out) when the serving extras are missing.
import fastapi  # noqa: F401, E402  # isort: skip
import uvicorn  # noqa: F401, E402  # isort: skip
import zmq  # noqa: F401, E402  # isort: skip


def add_serve_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="Model directory, .gguf file or hub id (default: the built-in SmolLM2-135M-Instruct).",
    )
    g = p.add_argument_group("Server options")
    g.add_argument("--host", default="127.0.0.1", help="Address to bind (default 127.0.0.1; 0.0.0.0 for all).")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="Require 'Authorization: Bearer KEY' (also from PAGEDLLM_API_KEY).")
    g.add_argument("--chat-template", default=None, help="Chat template file or Jinja text (default: the model's).")
    g.add_argument(
        "--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"]
    )
    g.add_argument("--disable-log-requests", action="store_true", help="Do not log each request.")
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="MODULE",
        help="LoRA adapters served as model names (with --enable-lora): name=path or "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'.',
    )
    g.add_argument(
        "--disable-web-ui", action="store_true", help="Do not serve the chat page (/) and the dashboard (/dashboard)."
    )
    g.add_argument(
        "--max-request-body-bytes", type=int, default=8 << 20, help="Larger request bodies get 413 (default 8 MiB)."
    )
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="Accept chat templates sent in requests (rendered in a sandbox process with time and size limits); "
        "without it such requests get a 400, as vLLM.",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='Allow tool_choice "auto" (the default when a request has tools): the --tool-call-parser reads '
        "tool calls from the model's text.",
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="How the model writes tool calls: hermes (Qwen2.5/Qwen3, Hermes), llama3_json, mistral, pythonic.",
    )
    g.add_argument("--max-n", type=int, default=16, help="Largest n (and best_of) a request may ask for.")
    g.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="Abort a generation request not finished this many seconds after it arrived: 408 (streams: an "
        "error event), its KV blocks freed. Default: no limit.",
    )
    g.add_argument(
        "--timeout-keep-alive", type=int, default=5, help="Close idle keep-alive connections after this many seconds."
    )
    g.add_argument(
        "--timeout-request-header",
        type=float,
        default=10.0,
        help="Close a connection whose request line and headers are not complete within this many seconds.",
    )
    g.add_argument(
        "--timeout-request-body",
        type=float,
        default=30.0,
        help="408 when a request body stops arriving for this many seconds.",
    )
    g.add_argument(
        "--h11-max-incomplete-event-size",
        type=int,
        default=16 * 1024,
        help="Largest request line plus headers accepted, in bytes (h11's limit; uvicorn's default 16 KiB).",
    )
    g.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="API-server processes sharing the port and one engine core (default 1): more HTTP, tokenization "
        "and detokenization capacity when the server path, not the model, sets the pace.",
    )
    g.add_argument("--config", default=None, help="YAML file of flags (keys as the flag names); CLI flags win.")
    EngineArgs.add_cli_args(p, positional_model=True)
    return p


def _explicit_dests(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """Destinations given on the command line (parsed again with every default suppressed)."""
    saved = {a.dest: a.default for a in parser._actions}
    try:
        for a in parser._actions:
            a.default = argparse.SUPPRESS
        ns, _ = parser.parse_known_args(argv)
    finally:
        for a in parser._actions:
            a.default = saved[a.dest]
    return set(vars(ns))


def apply_config_file(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None) -> None:
    """Merge the YAML `--config` into `args` under the flags given on the command line."""
    import yaml

    with open(args.config, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {args.config}: expected a mapping of flag names to values")
    dests = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    explicit = _explicit_dests(parser, argv) if argv is not None else set()
    for key, value in data.items():
        dest = str(key).lstrip("-").replace("-", "_")
        action = dests.get(dest)
        if action is None:
            raise ValueError(f"--config {args.config}: unknown option {key!r}")
        if dest in explicit:
            continue
        if argv is None and getattr(args, dest) != action.default:
            continue  # no argv to check against: a non-default value must have come from the CLI
        if action.nargs in ("+", "*") and not isinstance(value, list):
            value = [value]
        if action.type is not None and not isinstance(value, (list, dict, bool)) and value is not None:
            value = action.type(value)  # type: ignore[operator]
        setattr(args, dest, value)


def _serve_argv() -> list[str] | None:
    """The arguments after `serve` on this process's command line, if it was invoked that way."""
    argv = sys.argv[1:]
    return argv[argv.index("serve") + 1 :] if "serve" in argv else None


def cmd_serve(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args._serve_parser
    del args._serve_parser
    if args.config:
        apply_config_file(parser, args, _serve_argv())
    # A server's first structured request should not pay for reading the vocabulary into xgrammar and the common
    # JSON rules' token masks: the engine core warms them in a compile thread at start (inherited by its process).
    os.environ.setdefault("PAGEDLLM_STRUCTURED_WARMUP", "1")
    if args.api_server_count != 1:
        from pagedllm.entrypoints.openai.multi_server import serve_multi

        return serve_multi(args)
    from pagedllm.entrypoints.openai.server_main import serve_main

    return serve_main(args)


def register(sub: Any, handlers: dict[str, Callable[[argparse.Namespace], int]]) -> None:
    p = sub.add_parser(
        "serve",
        help="Start the OpenAI-compatible API server.",
        description="Serve a model over an OpenAI-compatible HTTP API.",
    )
    add_serve_args(p)
    p.set_defaults(_serve_parser=p)
    handlers["serve"] = cmd_serve
