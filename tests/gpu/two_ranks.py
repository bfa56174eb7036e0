"""Helpers of the two-GPU tests: two spawned ranks that report through a queue, and a CUDA graph captured after a
warm-up on a side stream (as the engine captures its decode graphs)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.multiprocessing as mp

T = TypeVar("T")


def run_two_ranks(target: Callable[..., None], *args: Any, timeout: float = 300) -> dict[int, Any]:
    """Runs `target(rank, port, *args, queue)` in two spawned processes (a free TCP port for the process group);
    each puts one (rank, result) on the queue. A rank that never reports (a wait on its peer that never ends)
    fails the caller after `timeout` seconds and is killed."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port, *args, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return dict(q.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def capture_graph(warm_up: Callable[[], Any], calls: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """`warm_up()` on a side stream, then a graph of `calls()`: the graph and what `calls` returned (the output
    tensors that each replay rewrites)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        warm_up()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = calls()
    return g, outs
