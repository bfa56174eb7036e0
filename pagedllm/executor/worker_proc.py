"""A worker process of the multi-process executor: one per device, rank r of tp * pp.

Wire protocol (ZMQ, pickled tuples; see `multiproc_executor.py` for the driver's side):

- driver -> every worker, one PUB socket: `(kind, call_id, payload)` serialized once for all ranks (a
  step's `SchedulerOutput`, and the output rank's `ModelRunnerOutput`, in `wire.py`'s compact form when
  steady).
  `HELLO` (start-up handshake: PUB drops what is sent before a subscriber has joined), `EXECUTE`
  (a `SchedulerOutput`, run now), `EXECUTE_ASYNC` (launched; its result is read once the next message is
  launched or none is waiting; pipeline stages run it like `EXECUTE`), `RPC`
  `(method, args, kwargs, reply_rank)`, `SHUTDOWN`.
- every worker -> driver, PUSH to one PULL socket: `(rank, kind, call_id, payload)`: `READY`, `HELLO`,
  `RESULT` (a step's `ModelRunnerOutput` from the output rank only; an RPC's result from every rank, or
  from `reply_rank` alone), `ERROR` (a formatted traceback; the driver raises it naming the rank).

Sampling: every tensor-parallel rank samples (the LM head's logits are all-gathered, so every rank holds
the same logits, and all ranks start from the same seed so unseeded sampling draws the same numbers):
each rank's persistent batch then has the sampled tokens without a broadcast per step; only the output
rank sends them to the driver.
"""

from __future__ import annotations

import collections
import ctypes
import os
import pickle
import signal
import sys
import traceback
from typing import Any

import torch
import zmq

from pagedllm.config import EngineConfig
from pagedllm.executor.wire import OutputEncoder, StepDecoder
from pagedllm.logger import init_logger
from pagedllm.utils import exit_when_parent_dies

logger = init_logger(__name__)

HELLO, EXECUTE, EXECUTE_ASYNC, RPC, SHUTDOWN = "hello", "execute", "execute_async", "rpc", "shutdown"
READY, RESULT, ERROR = "ready", "result", "error"


class RpcFailure(str):
    """A collective RPC that raised on a worker: its message, returned in place of the result."""


def _die_with_parent() -> None:
    """A worker never outlives the engine core: PR_SET_PDEATHSIG on Linux, and a watcher thread."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    exit_when_parent_dies("WorkerParentWatch")


class WorkerProc:
    """Builds the worker (distributed groups, model, later the KV cache) and serves the driver's messages."""

    def __init__(
        self,
        config: EngineConfig,
        rank: int,
        dist_init_method: str,
        broadcast_addr: str,
        reply_addr: str,
        output_rank: int,
        logits_processors: Any,
    ) -> None:
        self.rank = rank
        self.output_rank = output_rank
        self.step_decoder = StepDecoder()
        self.output_encoder = OutputEncoder()
        self.ctx = zmq.Context(io_threads=1)
        self.reply = self.ctx.socket(zmq.PUSH)
        self.reply.setsockopt(zmq.SNDHWM, 0)
        self.reply.setsockopt(zmq.LINGER, 1000)
        self.reply.connect(reply_addr)
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(broadcast_addr)
        pc = config.parallel_config
        pc.rank = rank
        self.run_in_order = pc.pipeline_parallel_size > 1
        """Pipeline stages run each launched step to its end before the next: the overlap is across stages
        (the engine core's batch queue), and the last stage's result goes back as soon as it is ready."""
        on_gpu = config.device.startswith("cuda")
        self.uses_nccl = on_gpu and pc.tensor_parallel_size * pc.pipeline_parallel_size > 1
        if on_gpu:  # the engine core's first device (data parallelism offsets it) + rank; Ray shows one device
            base = torch.device(config.device).index or 0
            config.device = f"cuda:{(base + rank) % max(torch.cuda.device_count(), 1)}"
            torch.cuda.set_device(config.device)
        from pagedllm.distributed.parallel_state import init_distributed
        from pagedllm.worker.worker import Worker

        try:
            init_distributed(
                rank,
                pc.tensor_parallel_size,
                pc.pipeline_parallel_size,
                dist_init_method,
                "nccl" if on_gpu else "gloo",
                dtype=config.model_config.dtype,
            )
            self.worker = Worker(config, logits_processors)
            self.worker.load_model()
        except Exception as e:  # the driver raises this message (the process exits after it)
            self.send(ERROR, -1, f"{type(e).__name__}: {e}")
            self.reply.close(linger=2000)
            raise

    def send(self, kind: str, call_id: int, payload: Any) -> None:
        self.reply.send(pickle.dumps((self.rank, kind, call_id, payload), protocol=5))

    def run(self) -> None:
        from pagedllm.worker.controls import run_worker_method

        self.send(READY, -1, os.getpid())
        worker = self.worker
        pending: collections.deque[tuple[int, Any]] = collections.deque()
        while True:
            if pending and not self._message_waiting(pending[0][1]):
                self._finish(*pending.popleft())
                continue
            kind, call_id, payload = pickle.loads(self.sub.recv(copy=False).buffer)
            if kind == EXECUTE_ASYNC or kind == EXECUTE:  # (in message order: the driver encoded in it)
                payload = self.step_decoder.decode(payload)
            try:
                if kind == EXECUTE_ASYNC and not self.run_in_order:
                    pending.append((call_id, worker.execute_model_async(payload)))
                    continue
                while pending:  # anything else runs after the launched steps are read, in order
                    self._finish(*pending.popleft())
                if kind == EXECUTE or kind == EXECUTE_ASYNC:
                    out = worker.execute_model(payload)
                    if self.rank == self.output_rank:
                        self.send(RESULT, call_id, self.output_encoder.encode(out))
                elif kind == RPC:
                    method, args, kwargs, reply_rank = payload
                    try:
                        if isinstance(method, bytes):
                            import cloudpickle

                            method = cloudpickle.loads(method)
                        result = run_worker_method(worker, method, args, kwargs)
                    except Exception as e:  # the caller's error, not the worker's: the engine goes on
                        result = RpcFailure(f"{type(e).__name__}: {e}")
                    if reply_rank is None or reply_rank == self.rank:
                        self.send(RESULT, call_id, result)
                elif kind == HELLO:
                    self.send(HELLO, call_id, None)
                elif kind == SHUTDOWN:
                    return
            except Exception as e:
                self.send(ERROR, call_id, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")

    def _message_waiting(self, step: Any) -> bool:
        """Whether the next message has come: launch it before reading the oldest step's result (the host
        work overlaps the device's), unless that step is done. A CPU step is done when launched."""
        event = getattr(step, "event", None)
        if event is None:
            return bool(self.sub.poll(0))
        while not event.query():
            if self.sub.poll(0):
                return True
        return False

    def _finish(self, call_id: int, step: Any) -> None:
        try:
            out = self.worker.finish_step(step)
        except Exception as e:
            self.send(ERROR, call_id, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            return
        if self.rank == self.output_rank:
            self.send(RESULT, call_id, self.output_encoder.encode(out))

    def close(self) -> None:
        from pagedllm.distributed.parallel_state import destroy_distributed

        try:
            destroy_distributed()
        finally:
            self.sub.close(linger=0)
            self.reply.close()
            self.ctx.term()


def run_worker(
    config: EngineConfig,
    rank: int,
    dist_init_method: str,
    broadcast_addr: str,
    reply_addr: str,
    output_rank: int,
    logits_processors: bytes | None,
    seed: int,
    num_threads: int,
    standalone: bool = True,
) -> None:
    """Entry point of a spawned worker process (`standalone`), or of a Ray actor's `run` (Ray owns the
    process: no signal handlers, no parent watch)."""
    if standalone:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine core shuts us down in order
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        _die_with_parent()
    torch.set_num_threads(num_threads)
    torch.manual_seed(seed)  # every rank draws the same numbers (see the module docstring)
    lps = None
    if logits_processors is not None:
        import cloudpickle

        lps = cloudpickle.loads(logits_processors)
    proc: WorkerProc | None = None
    try:
        proc = WorkerProc(config, rank, dist_init_method, broadcast_addr, reply_addr, output_rank, lps)
        proc.run()
    except SystemExit:
        raise
    except BaseException:
        logger.exception("worker rank %d: fatal error, exiting", rank)
        sys.exit(1)
    finally:
        if proc is not None:
            proc.close()
    if standalone and proc is not None and proc.uses_nccl:
        # A clean shutdown: skip the interpreter's exit-time destructors, where ProcessGroupNCCL can wait on a
        # peer that is exiting too (see parallel_state._abort_nccl); the driver frees the GPU with the process.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
