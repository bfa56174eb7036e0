"""Data parallelism: N engine cores (each its own process, scheduler, KV cache and workers) behind one
front end, as vLLM's `--data-parallel-size N` on one node.

`DPAsyncMPClient` has `AsyncMPClient`'s interface, so `AsyncLLM` (and the API server) are unchanged: a new
request goes to the core with the fewest requests in flight (ties: the one that got a request least
recently), aborts go to the core that owns the request, utility calls go to every core, and the cores'
outputs are merged into one stream. One dead core makes the whole client dead (every in-flight request
fails, `/health` turns 503 and the server exits), as a single core's death does.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.mp_client import AsyncMPClient, CoreConnection, EngineDeadError
from pagedllm.logger import init_logger
from pagedllm.messages import EngineCoreOutputs, EngineCoreRequest

logger = init_logger(__name__)


def core_config(config: EngineConfig, index: int) -> EngineConfig:
    """Core `index`'s config: its own devices on a GPU (each core holds tp * pp of them)."""
    cfg = copy.copy(config)
    cfg.parallel_config = copy.copy(config.parallel_config)
    cfg.parallel_config.data_parallel_rank = index
    if config.device.startswith("cuda"):
        cfg.device = f"cuda:{index * config.parallel_config.world_size}"
    return cfg


class DPAsyncMPClient:
    def __init__(self, config: EngineConfig, connect: list[CoreConnection] | None = None) -> None:
        """`connect`: one connection per core, to cores another process started (one of several API
        servers, `entrypoints/openai/multi_server.py`); None: start the cores here."""
        n = config.parallel_config.data_parallel_size
        assert connect is None or len(connect) == n
        self.config = config
        self.clients: list[AsyncMPClient] = []
        try:
            for i in range(n):
                conn = connect[i] if connect is not None else None
                self.clients.append(AsyncMPClient(core_config(config, i), connect=conn))
        except BaseException:
            for c in self.clients:
                c.shutdown()
            raise
        for i, c in enumerate(self.clients):
            c.on_dead = self._make_on_dead(i)
        self.ready_info = self.clients[0].ready_info
        self.core_pid = self.clients[0].core_pid
        self.dead = False
        self.dead_error: EngineDeadError | None = None
        self.on_dead: Callable[[EngineDeadError], None] | None = None
        self.on_route: Callable[[int], None] | None = None
        """Called with the core index of every routed request (the per-core counter in /metrics)."""
        self.owner: dict[str, int] = {}
        """Request id -> the index of the core that runs it (while in flight)."""
        self.in_flight = [0] * n
        self._last_pick = [0] * n
        self._picks = 0
        self._queue: asyncio.Queue[EngineCoreOutputs | None] | None = None
        self._readers: list[asyncio.Task[None]] = []

    # ---- life cycle -------------------------------------------------------------------------------
    @property
    def proc(self) -> Any:
        """The first core process that is no longer alive, else the first one (for liveness checks)."""
        return next((c.proc for c in self.clients if not c.is_alive()), self.clients[0].proc)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._queue is not None:
            return
        self._queue = asyncio.Queue()
        for i, c in enumerate(self.clients):
            c.start(loop)
            self._readers.append(loop.create_task(self._read(i, c), name=f"DPAsyncMPClient.read[{i}]"))

    async def _read(self, index: int, client: AsyncMPClient) -> None:
        assert self._queue is not None
        try:
            while True:
                outputs = await client.get_output()
                outputs.engine_index = index
                self._queue.put_nowait(outputs)
        except EngineDeadError:
            self._queue.put_nowait(None)  # wakes the reader, which then raises the dead error

    def _make_on_dead(self, index: int) -> Callable[[EngineDeadError], None]:
        def on_dead(error: EngineDeadError) -> None:
            self.mark_dead(EngineDeadError(f"Engine core {index} of {len(self.clients)}: {error}"))

        return on_dead

    def mark_dead(self, error: EngineDeadError) -> None:
        if self.dead:
            return
        self.dead = True
        self.dead_error = error
        logger.error("%s", error)
        if self._queue is not None:
            self._queue.put_nowait(None)
        if self.on_dead is not None:
            self.on_dead(error)

    def is_alive(self) -> bool:
        return not self.dead and all(c.is_alive() for c in self.clients)

    def _on_process_exit(self) -> None:
        """Check every core now (the server's /health does not wait for the sentinel callbacks)."""
        for c in self.clients:
            if not c.is_alive():
                c._on_process_exit()

    def shutdown(self) -> None:
        for task in self._readers:
            task.cancel()
        for c in self.clients:
            c.shutdown()

    # ---- requests ---------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.dead:
            raise self.dead_error or EngineDeadError()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        index = min(range(len(self.clients)), key=lambda i: (self.in_flight[i], self._last_pick[i]))
        self._picks += 1
        self._last_pick[index] = self._picks
        self.clients[index].add_request(request)
        self.owner[request.request_id] = index
        self.in_flight[index] += 1
        if self.on_route is not None:
            self.on_route(index)

    def _release(self, request_id: str) -> int | None:
        index = self.owner.pop(request_id, None)
        if index is not None:
            self.in_flight[index] -= 1
        return index

    def abort_requests(self, request_ids: list[str]) -> None:
        if not request_ids or self.dead:
            return
        by_core: dict[int, list[str]] = {}
        for rid in request_ids:
            index = self._release(rid)
            if index is not None:
                by_core.setdefault(index, []).append(rid)
        for index, ids in by_core.items():
            self.clients[index].abort_requests(ids)

    async def get_output(self) -> EngineCoreOutputs:
        assert self._queue is not None, "start() first"
        outputs = await self._queue.get()
        self._check_alive()
        assert outputs is not None
        for out in outputs.outputs:
            if out.finish_reason is not None:
                self._release(out.request_id)
        for rid in outputs.finished_requests:
            self._release(rid)
        return outputs

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Run the utility on every core. Lists (collective_rpc) are concatenated in core order; booleans
        combine with `any` for has_unfinished_requests, else `all`; other results are the first core's."""
        self._check_alive()
        results = await asyncio.gather(*(c.call_utility(method, *args) for c in self.clients))
        if all(isinstance(r, list) for r in results):
            return [x for r in results for x in r]
        if all(isinstance(r, bool) for r in results):
            return any(results) if method == "has_unfinished_requests" else all(results)
        return results[0]
