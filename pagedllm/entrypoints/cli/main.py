"""`pagedllm` command line: generate, chat (a REPL), serve, bench. `python -m pagedllm` is the same."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from pagedllm.engine.arg_utils import EngineArgs


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Sampling options")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=None, help="Default: the model's generation_config, else 1.0")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--sampling-seed", type=int, default=None, help="Per-request seed.")
    g.add_argument("--stop", action="append", default=None, help="Stop string (repeatable).")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_from_args(llm, args: argparse.Namespace):  # noqa: ANN001, ANN201
    base = llm.get_default_sampling_params()
    changes = {"max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos}
    for name, attr in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("min_p", "min_p"),
        ("sampling_seed", "seed"),
        ("stop", "stop"),
    ):
        if getattr(args, name) is not None:
            changes[attr] = getattr(args, name)
    from pagedllm.sampling_params import SamplingParams

    fields = {f: getattr(base, f) for f in base.__struct_fields__ if f not in ("all_stop_token_ids", "eos_token_id")}
    fields.update(changes)
    return SamplingParams(**fields)


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedllm import LLM

    llm = LLM(**vars_engine(args))
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("error: give --prompt TEXT (repeatable) or prompts on stdin", file=sys.stderr)
        return 2
    outs = llm.generate(prompts, sampling_from_args(llm, args), use_tqdm=False)
    for out in outs:
        if len(outs) > 1:
            print(f"=== {out.prompt!r}")
        print((out.prompt or "") + out.outputs[0].text if args.echo else out.outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pagedllm import LLM

    llm = LLM(**vars_engine(args))
    sp = sampling_from_args(llm, args)
    history: list[dict[str, str]] = []
    if args.system_prompt:
        history.append({"role": "system", "content": args.system_prompt})
    interactive = sys.stdin.isatty()
    if interactive:
        print("pagedllm chat — /reset clears the conversation, /exit or Ctrl-D quits.")
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            del history[1 if args.system_prompt else 0 :]
            continue
        history.append({"role": "user", "content": line})
        reply = llm.chat(history, sp, use_tqdm=False)[0].outputs[0].text
        history.append({"role": "assistant", "content": reply})
        print(reply, flush=True)
    return 0


def vars_engine(args: argparse.Namespace) -> dict:
    ea = EngineArgs.from_cli_args(args)
    names = EngineArgs.field_names()
    defaults = EngineArgs()
    # Only pass what differs from the defaults, so LLM() resolves the rest itself.
    return {k: getattr(ea, k) for k in names if getattr(ea, k) != getattr(defaults, k)}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Callable[[argparse.Namespace], int]]]:
    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm: LLM inference and serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {}

    p = sub.add_parser("generate", help="Generate completions for prompts (offline).")
    p.add_argument("--prompt", action="append", help="Prompt text (repeatable); else one prompt per stdin line.")
    p.add_argument("--echo", action="store_true", help="Print the prompt before the completion.")
    add_sampling_args(p)
    EngineArgs.add_cli_args(p)
    handlers["generate"] = cmd_generate

    p = sub.add_parser("chat", help="Chat with the model in a REPL (reads stdin when not a terminal).")
    p.add_argument("--system-prompt", default=None)
    add_sampling_args(p)
    EngineArgs.add_cli_args(p)
    handlers["chat"] = cmd_chat

    try:
        from pagedllm.entrypoints.cli import serve as serve_cli  # needs the serving extras

        serve_cli.register(sub, handlers)
    except ImportError:
        pass
    try:
        from pagedllm.entrypoints.cli import bench as bench_cli

        bench_cli.register(sub, handlers)
    except ImportError:
        pass
    return parser, handlers


def main(argv: list[str] | None = None) -> None:
    parser, handlers = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = handlers[args.command](args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        rc = 2
    sys.exit(rc)
