"""The front end's client for an engine core running in its own process (vLLM v1's AsyncMPClient).

The core process is started with `spawn` (a fresh interpreter: no forked torch/tokenizer threads) and
talks over ZMQ IPC sockets (see `core_proc` for the protocol). Requests and aborts are sent with
non-blocking sends on a sync PUSH socket from the event-loop thread, so `abort` can run from
synchronous code such as a generator's cleanup; outputs are read by an asyncio task through a
`zmq.asyncio` PULL socket.

Death detection: the process sentinel (a pipe fd that becomes readable when the process exits) is
watched with `loop.add_reader`, so a crash or SIGKILL of the core is noticed at once, without polling.
The client then marks itself dead and calls `on_dead`, which fails every in-flight request.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import itertools
import multiprocessing
import os
import tempfile
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pagedllm.config import EngineConfig
from pagedllm.engine.core_proc import run_engine_core
from pagedllm.logger import init_logger
from pagedllm.messages import (
    ABORT,
    ADD,
    FAILED,
    OUTPUTS,
    READY,
    SHUTDOWN,
    UTILITY,
    UTILITY_RESULT,
    EngineCoreOutputs,
    EngineCoreRequest,
)

logger = init_logger(__name__)

INPUT_SEND_TIMEOUT_MS = 30_000
"""How long a send to the core may wait for its input socket (only before it has connected: the queue is
unbounded). Longer means the core is gone or wedged."""


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can complete."""

    def __init__(self, message: str = "The engine core process died; the server must be restarted.") -> None:
        super().__init__(message)


class EngineStartError(RuntimeError):
    """The engine-core process failed to start (its error message is included)."""


class _Resources:
    """What must be released even if the client is never shut down explicitly (atexit/finalizer)."""

    def __init__(self) -> None:
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.sync_ctx: zmq.Context | None = None
        self.async_ctx: zmq.asyncio.Context | None = None
        self.ipc_dir: str | None = None

    def __call__(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.is_alive():
            proc.terminate()
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(2)
        for ctx in (self.async_ctx, self.sync_ctx):
            if ctx is not None:
                ctx.destroy(linger=0)
        self.async_ctx = self.sync_ctx = None
        if self.ipc_dir is not None:
            for name in os.listdir(self.ipc_dir):
                try:
                    os.unlink(os.path.join(self.ipc_dir, name))
                except OSError:
                    pass
            try:
                os.rmdir(self.ipc_dir)
            except OSError:
                pass
            self.ipc_dir = None


@dataclasses.dataclass(frozen=True)
class CoreConnection:
    """How a front end reaches an engine core that another process started (`pagedllm serve
    --api-server-count N`, `entrypoints/openai/multi_server.py`): this front end's index among the N, the
    addresses it binds (the core connects to them), the core's pid (watched for its death) and READY info."""

    client_index: int
    input_addr: str
    output_addr: str
    core_pid: int
    ready_info: dict[str, Any]


def core_addresses(n: int) -> tuple[str, list[str], list[str], str]:
    """A fresh IPC directory and, for n front ends, their input and output addresses plus the handshake's."""
    ipc_dir = tempfile.mkdtemp(prefix="pagedllm-")
    base = f"ipc://{ipc_dir}/{uuid.uuid4().hex[:8]}"
    return ipc_dir, [f"{base}-in{i}" for i in range(n)], [f"{base}-out{i}" for i in range(n)], base + "-hs"


def wait_core_ready(
    handshake: zmq.Socket, proc: multiprocessing.process.BaseProcess, timeout_s: float
) -> dict[str, Any]:
    """The core's READY info from the handshake socket; EngineStartError if it fails, exits or times out."""
    deadline = time.monotonic() + timeout_s
    poller = zmq.Poller()
    poller.register(handshake, zmq.POLLIN)
    while time.monotonic() < deadline:
        if poller.poll(200):
            kind, payload = handshake.recv_multipart()
            if kind == READY:
                return msgspec.msgpack.decode(payload)
            if kind == FAILED:
                raise EngineStartError(f"The engine core failed to start: {msgspec.msgpack.decode(payload)}")
        if not proc.is_alive():
            raise EngineStartError(
                f"The engine core process exited with code {proc.exitcode} while starting (see its log above)."
            )
    raise EngineStartError(f"The engine core did not become ready within {timeout_s:.0f} s")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class AsyncMPClient:
    """Starts the core process, waits until it is ready, then sends requests and yields its outputs. With
    `connect`, it starts nothing: it binds the given addresses of a core another process started."""

    def __init__(
        self, config: EngineConfig, startup_timeout_s: float = 600.0, connect: CoreConnection | None = None
    ) -> None:
        self.config = config
        self.resources = _Resources()
        self._finalizer = weakref.finalize(self, self.resources)
        atexit.register(self._finalizer)
        self.client_index = connect.client_index if connect is not None else 0
        if connect is None:
            self.resources.ipc_dir, inputs, outputs, handshake_addr = core_addresses(1)
            input_addr, output_addr = inputs[0], outputs[0]
        else:
            input_addr, output_addr = connect.input_addr, connect.output_addr

        self.sync_ctx = self.resources.sync_ctx = zmq.Context(io_threads=1)
        self.input_socket = self.sync_ctx.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)  # unbounded queue: once connected, a send never blocks
        # Until the core's PULL socket has finished connecting (the READY message travels on another socket and
        # may overtake it), a send has no peer to queue for and would fail with EAGAIN under NOBLOCK. Sends
        # therefore block, bounded by this timeout, instead.
        self.input_socket.setsockopt(zmq.SNDTIMEO, INPUT_SEND_TIMEOUT_MS)
        self.input_socket.setsockopt(zmq.LINGER, 0)
        self.input_socket.bind(input_addr)
        self.async_ctx = self.resources.async_ctx = zmq.asyncio.Context(io_threads=1)
        self.output_socket = self.async_ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.output_socket.setsockopt(zmq.LINGER, 0)
        self.output_socket.bind(output_addr)
        self.proc: multiprocessing.process.BaseProcess | None = None
        self._pidfd: int | None = None
        if connect is not None:
            self.ready_info: dict[str, Any] = connect.ready_info
            self.core_pid: int = connect.core_pid
        else:
            handshake = self.sync_ctx.socket(zmq.PULL)
            handshake.setsockopt(zmq.LINGER, 0)
            handshake.bind(handshake_addr)
            mp_ctx = multiprocessing.get_context("spawn")
            self.proc = proc = mp_ctx.Process(
                target=run_engine_core,
                args=(config, input_addr, output_addr, handshake_addr),
                name="EngineCore",
                daemon=False,  # joined explicitly by shutdown(); a daemon could not start TP workers later
            )
            proc.start()
            self.resources.proc = proc
            logger.info("Engine core process started (pid %d); waiting for it to load the model", proc.pid)
            try:
                self.ready_info = wait_core_ready(handshake, proc, startup_timeout_s)
            except BaseException:
                self.resources()
                raise
            finally:
                handshake.close(linger=0)
            self.core_pid = proc.pid  # type: ignore[assignment]

        self.encoder = msgspec.msgpack.Encoder()
        self.outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.any_decoder = msgspec.msgpack.Decoder()
        self.dead = False
        self.dead_error: EngineDeadError | None = None
        self.on_dead: Callable[[EngineDeadError], None] | None = None
        self._call_ids = itertools.count()
        self._pending_calls: dict[int, asyncio.Future[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # ---- life cycle in the event loop -----------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watch the core process from `loop` (call once, from the loop's thread)."""
        if self._loop is not None:
            return
        self._loop = loop
        sentinel = self._sentinel()
        try:
            loop.add_reader(sentinel, self._on_process_exit)
        except NotImplementedError:  # pragma: no cover - loops without add_reader: poll from a thread
            import threading
            from multiprocessing.connection import wait

            def watch() -> None:
                wait([sentinel])
                loop.call_soon_threadsafe(self._on_process_exit)

            threading.Thread(target=watch, name="EngineCoreWatch", daemon=True).start()
        if not self.is_alive():
            self._on_process_exit()

    def _sentinel(self) -> int:
        """An fd that becomes readable when the core process exits: its multiprocessing sentinel when this
        client started it, else a pidfd (Linux), which watches a process that is not our child."""
        if self.proc is not None:
            return self.proc.sentinel
        if self._pidfd is None:
            self._pidfd = os.pidfd_open(self.core_pid)
        return self._pidfd

    def _on_process_exit(self) -> None:
        if self._loop is not None:
            try:
                self._loop.remove_reader(self._sentinel())
            except Exception:
                pass
        if self._closed or self.dead:
            return
        code: int | str | None = "unknown: not our child"
        if self.proc is not None:
            self.proc.join(1.0)  # reap it, so the exit code is known
            code = self.proc.exitcode
        logger.error("The engine core process (pid %s) died (exit code %s)", self.core_pid, code)
        self.mark_dead(EngineDeadError(f"The engine core process died unexpectedly (exit code {code})."))

    def mark_dead(self, error: EngineDeadError) -> None:
        if self.dead:
            return
        self.dead = True
        self.dead_error = error
        for fut in self._pending_calls.values():
            if not fut.done():
                fut.set_exception(error)
        self._pending_calls.clear()
        if self.on_dead is not None:
            self.on_dead(error)

    def _check_alive(self) -> None:
        if self.dead:
            raise self.dead_error or EngineDeadError()

    # ---- requests -------------------------------------------------------------------------------------
    def _send(self, kind: bytes, payload: bytes) -> None:
        try:
            self.input_socket.send_multipart([kind, payload], copy=False)
        except zmq.Again as e:
            error = EngineDeadError(
                f"The engine core did not take a message within {INPUT_SEND_TIMEOUT_MS / 1000:.0f} s"
            )
            self.mark_dead(error)
            raise error from e

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        if self.client_index:
            request.client_index = self.client_index
        self._send(ADD, self.encoder.encode(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.dead and not self._closed:
            self._send(ABORT, self.encoder.encode(request_ids))

    async def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs. Utility-call replies arriving meanwhile resolve their futures."""
        while True:
            self._check_alive()
            kind, payload = await self.output_socket.recv_multipart(copy=False)
            kind_b = kind.bytes
            if kind_b == OUTPUTS:
                return self.outputs_decoder.decode(payload.buffer)
            if kind_b == FAILED:
                message = self.any_decoder.decode(payload.buffer)
                self.mark_dead(EngineDeadError(f"The engine core failed: {message}"))
                self._check_alive()
            if kind_b == UTILITY_RESULT:
                call_id, ok, result = self.any_decoder.decode(payload.buffer)
                fut = self._pending_calls.pop(call_id, None)
                if fut is not None and not fut.done():
                    if ok:
                        fut.set_result(result)
                    else:
                        fut.set_exception(RuntimeError(result))

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Run `EngineCore.<method>(*args)` in the core process (answered between steps)."""
        self._check_alive()
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending_calls[call_id] = fut
        try:
            call = (
                (call_id, method, list(args), self.client_index) if self.client_index else (call_id, method, list(args))
            )
            self._send(UTILITY, self.encoder.encode(call))
        except BaseException:
            self._pending_calls.pop(call_id, None)
            raise
        return await fut

    def is_alive(self) -> bool:
        if self.dead:
            return False
        return self.proc.is_alive() if self.proc is not None else _pid_alive(self.core_pid)

    def shutdown(self) -> None:
        """Ask the core to stop, then terminate it if it does not (idempotent). A client that did not start
        the core only closes its sockets: the process that started the core stops it."""
        if self._closed:
            return
        self._closed = True
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.remove_reader(self._sentinel())
            except Exception:
                pass
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        if self.proc is not None and self.proc.is_alive():
            try:
                self.input_socket.send_multipart([SHUTDOWN, b""], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.proc.join(3)
        self.resources()
