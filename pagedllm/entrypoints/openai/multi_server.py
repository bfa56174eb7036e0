"""`pagedllm serve --api-server-count N`: N API-server processes in front of the engine core(s) (vLLM's flag).

Why: on a small model the GPU step is short and the API server's Python (HTTP, JSON, detokenization, one
`RequestOutput` per request per step) sets the pace (NOTES "Online serving"). N processes give that work N
cores; the engine core stays one process, so scheduling, the KV cache and prefix caching stay global.

Layout: this process starts the engine core (`core_proc.run_engine_core`, N input and N output addresses),
waits for READY, then starts N API servers (`server_main.run_server` with a `CoreConnection`): each binds its
own pair of ZMQ addresses and the same TCP port with SO_REUSEPORT, so the kernel spreads the connections over
them. Each request's outputs go back to the API server that sent it. With `--data-parallel-size D` it starts
D cores (each on its own GPUs) and every API server reaches all of them (`DPAsyncMPClient` over D
connections), spreading its own requests by its own in-flight counts. This process only supervises: when a
core dies the API servers notice (pidfd), fail their in-flight requests and exit, and this process exits
non-zero; when an API server dies, everything is stopped; SIGTERM / Ctrl-C stop the API servers, then the
cores.

Per API server (not merged yet): `/metrics` counts that process's requests (the engine's gauges are the same
in all); LoRA adapters loaded at run time through one API server are known by name to that one only.
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import signal
import sys
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

import zmq

from pagedllm.config import EngineConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_proc import run_engine_core
from pagedllm.engine.dp_client import core_config
from pagedllm.engine.mp_client import CoreConnection, core_addresses, wait_core_ready
from pagedllm.logger import init_logger
from pagedllm.utils import exit_when_parent_dies

logger = init_logger(__name__)

CORE_DEATH_GRACE_S = 5.0
"""After the core died: how long the API servers get to send their error events and exit on their own."""


def _run_api_server(args: argparse.Namespace, config: EngineConfig, connections: list[CoreConnection]) -> None:
    """Entry point of one spawned API-server process."""
    exit_when_parent_dies("APIServerParentWatch")
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    from pagedllm.entrypoints.openai.server_main import run_event_loop, run_server

    try:
        code = run_event_loop(run_server(args, connections, config=config))
    except KeyboardInterrupt:
        code = 0
    sys.exit(code)


def _stop(procs: list[BaseProcess], timeout_s: float) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout_s)
        if p.is_alive():
            p.kill()
            p.join(2)


def _supervise(cores: list[BaseProcess], servers: list[BaseProcess]) -> int:
    """Wait until a core or an API server exits; stop the rest; the exit code."""
    wait([*(c.sentinel for c in cores), *(s.sentinel for s in servers)])
    dead_cores = [c for c in cores if not c.is_alive()]
    if dead_cores:
        core = dead_cores[0]
        logger.error("The engine core process (pid %s) exited with code %s", core.pid, core.exitcode)
        wait([s.sentinel for s in servers], timeout=CORE_DEATH_GRACE_S)  # they fail their requests first
        _stop(servers, 5.0)
        _stop(cores, 10.0)
        return 1
    dead = [s for s in servers if not s.is_alive()]
    code = max((s.exitcode or 0) for s in dead)
    if code:
        logger.error("API server %s exited with code %s; stopping the others and the engine cores", dead[0].name, code)
    _stop(servers, 10.0)
    _stop(cores, 10.0)
    return 1 if code else 0


def serve_multi(args: argparse.Namespace) -> int:
    n = args.api_server_count
    if n < 1:
        raise ValueError(f"api_server_count: must be >= 1, got {n}")
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    config = EngineArgs.from_cli_args(args).create_engine_config()
    dp = config.parallel_config.data_parallel_size
    ctx = zmq.Context(io_threads=1)
    mp = multiprocessing.get_context("spawn")
    cores: list[BaseProcess] = []
    servers: list[BaseProcess] = []
    ipc_dirs: list[str] = []
    # connections[d][i]: how API server i reaches core d
    connections: list[list[CoreConnection]] = []
    try:
        started = []
        for d in range(dp):  # every core loads its model at the same time
            ipc_dir, inputs, outputs, handshake_addr = core_addresses(n)
            ipc_dirs.append(ipc_dir)
            handshake = ctx.socket(zmq.PULL)
            handshake.setsockopt(zmq.LINGER, 0)
            handshake.bind(handshake_addr)
            cfg = core_config(config, d) if dp > 1 else config
            name = f"EngineCore_{d}" if dp > 1 else "EngineCore"
            core = mp.Process(target=run_engine_core, args=(cfg, inputs, outputs, handshake_addr), name=name)
            core.start()
            cores.append(core)
            logger.info("Engine core process started (pid %d); waiting for it to load the model", core.pid)
            started.append((core, handshake, inputs, outputs))
        for core, handshake, inputs, outputs in started:
            info = wait_core_ready(handshake, core, 600.0)
            handshake.close(linger=0)
            pid = core.pid
            assert pid is not None
            connections.append([CoreConnection(i, inputs[i], outputs[i], pid, info) for i in range(n)])
        for i in range(n):
            conns = [connections[d][i] for d in range(dp)]
            servers.append(mp.Process(target=_run_api_server, args=(args, config, conns), name=f"APIServer_{i}"))
            servers[-1].start()
        logger.info("%d API servers started (pids %s)", n, ", ".join(str(s.pid) for s in servers))
        return _supervise(cores, servers)
    except KeyboardInterrupt:
        return 0
    finally:
        _stop(servers, 10.0)
        _stop(cores, 10.0)
        ctx.destroy(linger=0)
        for ipc_dir in ipc_dirs:
            shutil.rmtree(ipc_dir, ignore_errors=True)
