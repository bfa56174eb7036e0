"""The engine core in its own process (vLLM v1's EngineCoreProc).

Wire protocol (ZMQ, msgspec msgpack), all multipart messages `[type byte, payload]`:

- front end -> core (PUSH -> PULL, `input_addr`): `ADD` an `EngineCoreRequest`, `ABORT` a list of
  request ids, `UTILITY` `(call_id, method, args[, client_index])`, `SHUTDOWN`.
- core -> front end (PUSH -> PULL, `output_addr`): `OUTPUTS` one `EngineCoreOutputs` per step,
  `UTILITY_RESULT` `(call_id, ok, result_or_error)`, `FAILED` a message just before a fatal exit (e.g. a
  dead tensor-parallel worker, named by its rank).

Several front ends (`pagedllm serve --api-server-count N`): one input and one output address per front end.
The core's PULL socket connects to every input address (fair-queued); each request's outputs go back on the
output socket of the front end that sent it (`EngineCoreRequest.client_index`), the step's stats to all.
- core -> front end once at start (PUSH -> PULL, `handshake_addr`): `READY` a dict, or `FAILED` a message.

Why a thread reads the input socket: the step loop must block when there is nothing to do (these machines
have 2 cores; a spinning loop would take one from the tokenizer/HTTP process), yet never wait on the
socket while requests are running. The thread turns socket reads into a `queue.Queue`, so the loop does a
blocking `get()` when idle and `get_nowait()` between steps. Decoding happens in that thread too, so the
loop only sees ready-made requests; per step the loop does one `core.step()` and one msgpack encode.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any

import msgspec
import zmq

from pagedllm.config import EngineConfig
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
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
)
from pagedllm.utils import exit_when_parent_dies

logger = init_logger(__name__)

WORKER_FAILED = b"worker-failed"
"""Not a wire tag: the executor's failure callback queues it, so an idle loop wakes up and exits too."""


UTILITY_METHODS = frozenset({"reset_prefix_cache", "has_unfinished_requests", "ping"}) | frozenset(
    {  # engine controls (engine/controls.py)
        "sleep",
        "wake_up",
        "is_sleeping",
        "collective_rpc",
        "init_weight_transfer_engine",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
        "start_profile",
        "stop_profile",
    }
)
"""EngineCore methods the front end may call remotely (plus `ping`, answered by the loop itself)."""


class EngineCoreProc:
    """Runs an `EngineCore` behind ZMQ sockets; one instance per core process."""

    def __init__(
        self, config: EngineConfig, input_addr: str | list[str], output_addr: str | list[str], handshake_addr: str
    ) -> None:
        self.ctx = zmq.Context(io_threads=1)
        self.input_addrs = [input_addr] if isinstance(input_addr, str) else list(input_addr)
        output_addrs = [output_addr] if isinstance(output_addr, str) else list(output_addr)
        self.input_queue: queue.Queue[tuple[bytes, Any]] = queue.Queue()
        self.output_sockets: list[zmq.Socket] = []
        for addr in output_addrs:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(addr)
            self.output_sockets.append(sock)
        self.output_socket = self.output_sockets[0]
        self._client_of: dict[str, int] = {}
        """request id -> front end, with several front ends."""
        self.encoder = msgspec.msgpack.Encoder()

        handshake = self.ctx.socket(zmq.PUSH)
        handshake.setsockopt(zmq.LINGER, 5000)
        handshake.connect(handshake_addr)
        try:
            from pagedllm.engine.core import EngineCore

            self.core = EngineCore(config)
        except BaseException as e:
            msg = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            handshake.send_multipart([FAILED, self.encoder.encode(msg)])
            handshake.close()
            raise
        register = getattr(self.core.executor, "register_failure_callback", None)
        if register is not None:  # multi-process executor: a dead worker ends the core (and the server)
            register(lambda message: self.input_queue.put((WORKER_FAILED, message)))
        # Connect the input socket before READY, so the front end's first send finds a peer as soon as possible;
        # the socket is used only by the input thread from then on (handing it over at thread start is safe).
        input_socket = self.ctx.socket(zmq.PULL)
        input_socket.setsockopt(zmq.RCVHWM, 0)
        for addr in self.input_addrs:
            input_socket.connect(addr)
        self._input_thread = threading.Thread(
            target=self._read_inputs, args=(input_socket,), name="EngineCoreInput", daemon=True
        )
        self._input_thread.start()
        info = {
            "pid": os.getpid(),
            "num_blocks": config.cache_config.num_blocks,
            "max_model_len": config.model_config.max_model_len,
        }
        handshake.send_multipart([READY, self.encoder.encode(info)])
        handshake.close()

    # ---- input thread -----------------------------------------------------------------------------
    def _read_inputs(self, sock: zmq.Socket) -> None:
        """Socket -> decoded messages -> queue. Runs until SHUTDOWN (then the loop ends too)."""
        add_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        abort_decoder = msgspec.msgpack.Decoder(list[str])
        any_decoder = msgspec.msgpack.Decoder()
        while True:
            frames = sock.recv_multipart(copy=False)
            kind = frames[0].bytes
            payload = frames[1].buffer if len(frames) > 1 else b""
            try:
                if kind == ADD:
                    self.input_queue.put((ADD, add_decoder.decode(payload)))
                elif kind == ABORT:
                    self.input_queue.put((ABORT, abort_decoder.decode(payload)))
                elif kind == UTILITY:
                    self.input_queue.put((UTILITY, any_decoder.decode(payload)))
                elif kind == SHUTDOWN:
                    self.input_queue.put((SHUTDOWN, None))
                    return
                else:
                    logger.error("engine core: unknown message type %r dropped", kind)
            except msgspec.DecodeError as e:
                logger.error("engine core: undecodable %r message dropped: %s", kind, e)

    # ---- step loop ------------------------------------------------------------------------------------
    def run_busy_loop(self) -> None:
        core = self.core
        stats_dirty = False
        while True:
            idle = not core.has_unfinished_requests() or core.scheduling_paused  # paused: sleep(level=0)
            if idle and not stats_dirty:
                kind, payload = self.input_queue.get()  # idle: block, no spinning
                if self._handle(kind, payload):
                    return
                stats_dirty = True
            while True:
                try:
                    kind, payload = self.input_queue.get_nowait()
                except queue.Empty:
                    break
                if self._handle(kind, payload):
                    return
                stats_dirty = True
            # With nothing left to run this still returns fresh stats (e.g. after the last abort), so
            # the front end's gauges (running requests, KV usage) go back to idle values.
            outputs = core.step()
            self._send(outputs)
            stats_dirty = False

    def _handle(self, kind: bytes, payload: Any) -> bool:
        """Apply one input message; True on SHUTDOWN."""
        if kind == ADD:
            if len(self.output_sockets) > 1:
                self._client_of[payload.request_id] = payload.client_index
            try:
                self.core.add_request(payload)
            except Exception as e:  # a bad request must not kill the core: finish it as aborted
                logger.error("engine core: request %s rejected: %s", payload.request_id, e)
                self._send_abort_output(payload.request_id)
        elif kind == ABORT:
            self.core.abort_requests(payload)
            for rid in payload:
                self._client_of.pop(rid, None)
        elif kind == UTILITY:
            call_id, method, args = payload[:3]
            client = payload[3] if len(payload) > 3 else 0
            try:
                if method not in UTILITY_METHODS:
                    raise ValueError(f"unknown utility method {method!r}")
                result = "pong" if method == "ping" else getattr(self.core, method)(*args)
                encoded = self.encoder.encode((call_id, True, result))  # a result msgpack cannot carry: an error
            except Exception as e:
                encoded = self.encoder.encode((call_id, False, f"{type(e).__name__}: {e}"))
            self.output_sockets[client].send_multipart([UTILITY_RESULT, encoded])
        elif kind == SHUTDOWN:
            return True
        elif kind == WORKER_FAILED:
            raise RuntimeError(payload)
        return False

    def _send(self, outputs: EngineCoreOutputs) -> None:
        if len(self.output_sockets) == 1:
            self.output_socket.send_multipart([OUTPUTS, self.encoder.encode(outputs)], copy=False)
            return
        per_client: dict[int, list[EngineCoreOutput]] = {}
        client_of = self._client_of
        for out in outputs.outputs:
            rid = out.request_id
            client = client_of.pop(rid, 0) if out.finish_reason is not None else client_of.get(rid, 0)
            per_client.setdefault(client, []).append(out)
        for client, sock in enumerate(self.output_sockets):
            mine = per_client.get(client)
            if mine is None and outputs.scheduler_stats is None:
                continue
            part = EngineCoreOutputs(
                outputs=mine or [],
                scheduler_stats=outputs.scheduler_stats,  # every front end's gauges and counters
                timestamp=outputs.timestamp,
                engine_index=outputs.engine_index,
            )
            sock.send_multipart([OUTPUTS, self.encoder.encode(part)], copy=False)

    def _send_abort_output(self, request_id: str) -> None:
        from pagedllm.messages import FinishReason

        out = EngineCoreOutput(request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ABORT)
        self._send(EngineCoreOutputs(outputs=[out], timestamp=time.monotonic()))

    def report_fatal(self, message: str) -> None:
        """`FAILED` on the output socket; a moment for it to arrive before the exit is noticed."""
        try:
            for sock in self.output_sockets:
                sock.send_multipart([FAILED, self.encoder.encode(message)])
            time.sleep(0.3)
        except zmq.ZMQError:
            pass

    def shutdown(self) -> None:
        try:
            self.core.shutdown()
        finally:
            for sock in self.output_sockets:
                sock.close(linger=1000)


def run_engine_core(
    config: EngineConfig, input_addr: str | list[str], output_addr: str | list[str], handshake_addr: str
) -> None:
    """Entry point of the spawned core process."""
    # Ctrl-C reaches the whole process group; the front end shuts us down in order instead.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    exit_when_parent_dies("EngineCoreParentWatch")  # the front end may die without shutting us down (SIGKILL)
    proc: EngineCoreProc | None = None
    try:
        proc = EngineCoreProc(config, input_addr, output_addr, handshake_addr)
        proc.run_busy_loop()
    except SystemExit:
        raise
    except BaseException as e:
        logger.exception("engine core: fatal error, exiting")
        if proc is not None:  # the front end fails its requests with this message, not just an exit code
            proc.report_fatal(f"{type(e).__name__}: {e}")
        sys.exit(1)
    finally:
        if proc is not None:
            proc.shutdown()
