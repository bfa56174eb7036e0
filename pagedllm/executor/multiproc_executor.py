"""One worker process per device on this machine (vLLM's MultiprocExecutor).

The scheduler stays in the engine core's process; each step's `SchedulerOutput` is pickled once (in the
compact form of `wire.py` in steady decoding) and published to every worker on one ZMQ PUB socket
(`worker_proc.py` has the protocol). Only the output rank (the first rank of the last pipeline stage)
answers a step. A worker that dies is noticed within
`POLL_S` by whoever waits for a reply, and by a watcher thread otherwise; either way the error names the
rank, the remaining workers are killed, and later calls fail at once instead of hanging.
"""

from __future__ import annotations

import atexit
import dataclasses
import multiprocessing
import os
import pickle
import random
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import numpy as np
import zmq

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_utils import KVCacheConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.abstract import Executor, StepFuture
from pagedllm.executor.wire import OutputDecoder, SteadyOutput, StepEncoder
from pagedllm.executor.worker_proc import (
    ERROR,
    EXECUTE,
    EXECUTE_ASYNC,
    HELLO,
    READY,
    RESULT,
    RPC,
    SHUTDOWN,
    RpcFailure,
    run_worker,
)
from pagedllm.logger import init_logger
from pagedllm.sample.logits_processor import LogitsProcessor

logger = init_logger(__name__)

POLL_S = 0.1
"""How often a caller waiting for a reply checks that every worker is alive."""
START_TIMEOUT_S = 600.0
PEER_GRACE_S = 0.5
"""After a worker's error: how long to wait for a peer's death that would explain it."""


_exiting = False


def _mark_exiting() -> None:
    """Interpreter exit: multiprocessing then terminates the workers; that is no failure to report."""
    global _exiting
    _exiting = True


atexit.register(_mark_exiting)  # runs before multiprocessing's own exit hook (registered earlier)


class WorkerDiedError(RuntimeError):
    """A worker process exited or raised: the executor is unusable from then on."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, logits_processors: list[LogitsProcessor] | None = None) -> None:
        super().__init__(config)
        pc = config.parallel_config
        self.world_size = pc.world_size
        self.output_rank = self.world_size - pc.tensor_parallel_size
        self.failure: str | None = None
        self._failure_callbacks: list[Callable[[str], None]] = []
        self._results: dict[int, Any] = {}
        self._step_encoder = StepEncoder()
        self._output_decoder = OutputDecoder()
        self._next_call = 0
        self._closing = False
        self._lock = threading.Lock()
        self._dir = tempfile.mkdtemp(prefix="pagedllm-mp-")
        self.ctx = zmq.Context(io_threads=1)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        broadcast_addr, reply_addr = self._bind_sockets()
        lps = None
        if logits_processors:
            import cloudpickle

            lps = cloudpickle.dumps(logits_processors)
        seed = config.model_config.seed
        seed = seed if seed is not None else random.randrange(2**31)
        self.procs: list[Any] = []
        try:
            self._start_workers((broadcast_addr, reply_addr, self.output_rank, lps, seed))
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self._watcher = threading.Thread(target=self._watch, name="WorkerWatch", daemon=True)
        self._watcher.start()

    # ---- the worker processes (the Ray executor overrides these) -------------------------------
    def _bind_sockets(self) -> tuple[str, str]:
        """The broadcast and reply sockets' addresses as the workers connect to them."""
        broadcast_addr, reply_addr = f"ipc://{self._dir}/broadcast", f"ipc://{self._dir}/reply"
        self.pub.bind(broadcast_addr)
        self.pull.bind(reply_addr)
        return broadcast_addr, reply_addr

    def _start_workers(self, common: tuple[Any, ...]) -> None:
        """One spawned process per rank, running `run_worker`."""
        broadcast_addr, reply_addr, output_rank, lps, seed = common
        threads = max(1, (os.cpu_count() or 1) // self.world_size)
        dist_init = f"tcp://127.0.0.1:{_free_port()}"
        mp_ctx = multiprocessing.get_context("spawn")
        for rank in range(self.world_size):
            proc = mp_ctx.Process(
                target=run_worker,
                args=(self.config, rank, dist_init, broadcast_addr, reply_addr, output_rank, lps, seed, threads),
                name=f"PagedLLMWorker-{rank}",
                daemon=True,
            )
            proc.start()
            self.procs.append(proc)

    def _dead_worker(self) -> str | None:
        """A description of the first worker that is gone (rank, pid, exit code), or None."""
        for rank, proc in enumerate(self.procs):
            if proc.exitcode is not None:
                return f"worker rank {rank} (pid {proc.pid}) died (exit code {proc.exitcode})"
        return None

    def _wait_any_exit(self, timeout: float | None) -> None:
        """Block until some worker is gone (or `timeout` seconds). A sentinel fires when the process closes its
        files, which can be a moment before it can be reaped: join it, so `exitcode` is set on return."""
        ready = wait([p.sentinel for p in self.procs], timeout=timeout)
        for proc in self.procs:
            if proc.sentinel in ready:
                proc.join(5.0)

    def _stop_workers(self, graceful_s: float) -> None:
        """Wait up to `graceful_s` for the workers to exit (after SHUTDOWN), then kill what remains."""
        deadline = time.monotonic() + graceful_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.exitcode is None:
                proc.kill()
        for proc in self.procs:
            proc.join(5)

    # ---- start-up ------------------------------------------------------------------------------
    def _wait_ready(self) -> None:
        """Every worker built its model, then every worker's SUB socket receives the broadcast."""
        deadline = time.monotonic() + START_TIMEOUT_S
        ready: set[int] = set()
        while len(ready) < self.world_size:
            rank, kind, _, _ = self._recv_one(deadline, "start-up")
            if kind == READY:
                ready.add(rank)
        heard: set[int] = set()
        while len(heard) < self.world_size:
            self.pub.send(pickle.dumps((HELLO, -1, None)))
            t_end = time.monotonic() + 0.05
            while time.monotonic() < t_end:
                if self.pull.poll(10):
                    rank, kind, _, _ = pickle.loads(self.pull.recv())
                    if kind == HELLO:
                        heard.add(rank)
            self._check_alive("start-up")
            if time.monotonic() > deadline:
                raise WorkerDiedError("workers did not answer the start-up handshake")
        # Drain the duplicate HELLO answers still on their way.
        time.sleep(0.05)
        while self.pull.poll(0):
            self.pull.recv()
        logger.info("Multi-process executor: %d workers ready", self.world_size)

    # ---- liveness ------------------------------------------------------------------------------
    def _check_alive(self, during: str) -> None:
        if self.failure is not None:
            raise WorkerDiedError(self.failure)
        dead = self._dead_worker()
        if dead is not None:
            self._fail(f"{dead} during {during}")

    def _fail(self, message: str) -> None:
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = message
        if first:
            logger.error("%s; stopping the other workers", message)
            self._stop_workers(0.0)
            for cb in self._failure_callbacks:
                cb(message)
        raise WorkerDiedError(self.failure)

    def _watch(self) -> None:
        """Notice a dead worker while nobody waits for a reply (e.g. an idle server)."""
        try:
            self._wait_any_exit(None)
        except Exception:  # (Ray shut down under us)
            return
        if self._closing or _exiting or self.failure is not None:
            return
        try:
            self._check_alive("serving")
        except WorkerDiedError:
            pass

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        self._failure_callbacks.append(callback)

    # ---- messages ------------------------------------------------------------------------------
    def _broadcast(self, kind: str, payload: Any, data: bytes | None = None) -> int:
        if kind == EXECUTE or kind == EXECUTE_ASYNC:
            # A step skips the per-process exit-code poll (a waitpid each): a death is caught while its
            # result is awaited (`_recv_one`) or by the watcher thread, which records `failure`.
            if self.failure is not None:
                raise WorkerDiedError(self.failure)
        else:
            self._check_alive("a call")
        call_id = self._next_call
        self._next_call += 1
        self.pub.send(data if data is not None else pickle.dumps((kind, call_id, payload), protocol=5))
        return call_id

    def _recv_one(self, deadline: float | None, during: str) -> tuple[int, str, int, Any]:
        while not self.pull.poll(int(POLL_S * 1000)):
            self._check_alive(during)
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerDiedError(f"no answer from the workers during {during}")
        rank, kind, call_id, payload = pickle.loads(self.pull.recv())
        if kind == RESULT and isinstance(payload, (SteadyOutput, ModelRunnerOutput)):
            payload = self._output_decoder.decode(payload)  # (in arrival order: the worker encoded in it)
        elif kind == ERROR:
            # A collective fails on every rank when one peer dies: name the dead one, not the first to report.
            self._wait_any_exit(PEER_GRACE_S)
            dead = self._dead_worker()
            if dead is not None and not dead.startswith(f"worker rank {rank} "):
                self._fail(f"{dead} during {during}")
            self._fail(f"worker rank {rank} failed during {during}: {payload}")
        return rank, kind, call_id, payload

    def _collect(self, call_id: int, count: int, during: str) -> list[Any]:
        """The `count` answers to `call_id`, in rank order; answers to other calls are kept for their caller."""
        got: dict[int, Any] = self._results.pop(call_id, {})
        while len(got) < count:
            rank, kind, cid, payload = self._recv_one(None, during)
            if kind != RESULT:
                continue
            if cid == call_id:
                got[rank] = payload
            else:
                self._results.setdefault(cid, {})[rank] = payload
        return [got[r] for r in sorted(got)]

    # ---- the Executor interface ----------------------------------------------------------------
    def collective_rpc(
        self, method: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        if callable(method):
            import cloudpickle

            method = cloudpickle.dumps(method)
        call_id = self._broadcast(RPC, (method, args, kwargs or {}, None))
        results = self._collect(call_id, self.world_size, "collective_rpc")
        for rank, r in enumerate(results):
            if isinstance(r, RpcFailure):
                raise RuntimeError(f"collective_rpc failed on worker rank {rank}: {r}")
        return results

    def determine_num_blocks(self) -> int:
        """The KV cache is sized by the rank with the least memory to spare."""
        return int(min(self.collective_rpc("determine_num_blocks")))

    def initialize_kv_cache(self, num_blocks: int) -> KVCacheConfig:
        return self.collective_rpc("initialize_kv_cache", (num_blocks,))[self.output_rank]

    @staticmethod
    def _wire(so: SchedulerOutput) -> SchedulerOutput:
        """A grammar bitmask filled on demand is resolved here: workers in other processes need the array."""
        bm = so.grammar_bitmask
        if bm is not None and not isinstance(bm, np.ndarray):
            so = dataclasses.replace(so, grammar_bitmask=bm.result())
        return so

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        call_id = self._broadcast(EXECUTE, self._step_encoder.encode(self._wire(scheduler_output)))
        return self._collect(call_id, 1, "a step")[0]

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepFuture:
        call_id = self._broadcast(EXECUTE_ASYNC, self._step_encoder.encode(self._wire(scheduler_output)))
        return StepFuture(lambda: self._collect(call_id, 1, "a step")[0])

    # ---- shutdown ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        graceful = self.failure is None and self._dead_worker() is None
        if graceful:
            try:
                self.pub.send(pickle.dumps((SHUTDOWN, -1, None)))
            except zmq.ZMQError:
                pass
        self._stop_workers(5.0 if graceful else 0.0)
        self.pub.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()
        for name in ("broadcast", "reply"):
            try:
                os.unlink(os.path.join(self._dir, name))
            except OSError:
                pass
        try:
            os.rmdir(self._dir)
        except OSError:
            pass
