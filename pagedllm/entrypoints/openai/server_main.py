"""Running `pagedllm serve`: the engine first (blocks until the model is loaded), then bind and serve: the
port opens only once the model is loaded, as vLLM. One process here; `multi_server.py` runs several of these
(`--api-server-count`) in front of the engine core(s)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import signal
import socket
from collections.abc import Coroutine
from typing import Any

import uvicorn
from fastapi import FastAPI

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.mp_client import CoreConnection, EngineDeadError
from pagedllm.entrypoints.chat_utils import load_chat_template
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.chat_parsing import check_parser_args
from pagedllm.entrypoints.openai.middleware import TimeoutH11Protocol
from pagedllm.entrypoints.openai.serving_models import parse_lora_module
from pagedllm.logger import init_logger
from pagedllm.metrics.prometheus import PrometheusStatLogger

logger = init_logger(__name__)


async def run_server(
    args: argparse.Namespace, core_connections: list[CoreConnection] | None = None, config: EngineConfig | None = None
) -> int:
    """Start the engine (blocks until the model is loaded), then serve. Returns the exit code: non-zero
    when the engine core died. With `core_connections` (one of `--api-server-count` API servers: a connection
    per data-parallel core) the engine cores are another process's, and the port is shared with the other API
    servers (SO_REUSEPORT: the kernel spreads the connections)."""
    engine_args = EngineArgs.from_cli_args(args)
    check_parser_args(getattr(args, "tool_call_parser", None), bool(getattr(args, "enable_auto_tool_choice", False)))
    if args.request_timeout is not None and not args.request_timeout > 0:
        raise ValueError(f"request_timeout: must be positive, got {args.request_timeout}")
    chat_template = load_chat_template(args.chat_template) if args.chat_template else None
    api_keys = [args.api_key] if args.api_key else []
    if not api_keys and envs.PAGEDLLM_API_KEY:
        api_keys = [envs.PAGEDLLM_API_KEY]
    if config is None:
        config = engine_args.create_engine_config()
    served = list(engine_args.served_model_name or []) or [engine_args.model or "SmolLM2-135M-Instruct"]
    prometheus = PrometheusStatLogger(served[0], config.model_config.max_model_len)
    if config.lora_config is not None:
        prometheus.enable_lora_info(config.lora_config.max_loras)
    stat_loggers: list[Any] = [prometheus]
    engine = AsyncLLM(
        config,
        log_stats=not engine_args.disable_log_stats,
        stat_loggers=stat_loggers,
        core_connections=core_connections,
    )
    if config.parallel_config.data_parallel_size > 1:
        prometheus.enable_data_parallel(engine.engine_core)
    app: FastAPI | None = None
    try:
        app = build_app(
            engine,
            served,
            api_keys=api_keys,
            chat_template=chat_template,
            max_body_bytes=args.max_request_body_bytes,
            prometheus=prometheus,
            log_requests=not args.disable_log_requests,
            web_ui=not getattr(args, "disable_web_ui", False),
            trust_request_chat_template=args.trust_request_chat_template,
            max_n=args.max_n,
            body_timeout_s=args.timeout_request_body,
            lora_modules=[parse_lora_module(m) for m in getattr(args, "lora_modules", None) or []],
            reasoning_parser=engine_args.reasoning_parser,
            tool_call_parser=getattr(args, "tool_call_parser", None),
            enable_auto_tool_choice=bool(getattr(args, "enable_auto_tool_choice", False)),
        )
        TimeoutH11Protocol.header_timeout_s = args.timeout_request_header
        engine.request_timeout_s = args.request_timeout
        uv_config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            timeout_graceful_shutdown=3,
            timeout_keep_alive=args.timeout_keep_alive,
            h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
            http=TimeoutH11Protocol,
            access_log=False,
        )
        server = uvicorn.Server(uv_config)
        engine.start()
        loop = asyncio.get_running_loop()

        def on_dead(error: EngineDeadError) -> None:
            logger.error("%s Shutting down the server.", error)
            # Give in-flight streams a moment to send their error event, then stop.
            loop.call_later(0.5, setattr, server, "should_exit", True)

        engine.dead_callbacks.append(on_dead)
        sockets = None
        if core_connections is not None:
            sockets = [socket.create_server((args.host, args.port), reuse_port=True, backlog=2048)]
        logger.info("Serving %s on http://%s:%d (OpenAI API under /v1)", ", ".join(served), args.host, args.port)
        # The start-up heap (tokenizer, app, routes, engine client) lives as long as the server: out of the cyclic
        # GC's generations, so the collections that streaming's allocations trigger walk only the requests' own
        # objects (as the engine core does; NOTES "Session 12", the API server's py-spy profile).
        gc.collect()
        gc.freeze()
        await server.serve(sockets=sockets)
        return 1 if engine.errored else 0
    finally:
        if app is not None and getattr(app.state, "template_sandbox", None) is not None:
            app.state.template_sandbox.close()
        engine.shutdown()


def run_event_loop(main: Coroutine[Any, Any, int]) -> int:
    """Runs an API server's coroutine on uvloop where it is installed (as vLLM does; `PAGEDLLM_UVLOOP=0`: asyncio's
    own loop). uvloop's socket transports are C: a streamed chunk's write, most of an API server's time per token
    under many streams, costs less (benchmarks/NOTES.md, session 35)."""
    if envs.PAGEDLLM_UVLOOP:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(main)
    return asyncio.run(main)


def serve_main(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # uvicorn replaces it while serving
    try:
        return run_event_loop(run_server(args))
    except KeyboardInterrupt:
        return 0
