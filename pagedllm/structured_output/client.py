"""The engine's client of the grammar server (`server.py`): starts the server process, sends it grammars and step
orders, reads its answers, and (a CPU engine) waits for its masks and writes the sampled ids into the shared
segment itself."""

from __future__ import annotations

import os
import pickle
import select
import socket
import struct
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.backend import GrammarKey
from pagedllm.structured_output.server import DIED, MASKS, TOKENS, ServerSpec, SharedRings, wait_flag


class ServerProcess:
    """A started grammar server process that has not been given its spec yet: it imports torch and xgrammar at once
    (~2 s on this project's CPU box) and then waits, so an engine that starts one with itself does not make its
    first structured request wait for those imports (`engine.py`)."""

    def __init__(self) -> None:
        # A plain subprocess, not multiprocessing's spawn: that re-imports the user's __main__ (a script without an
        # `if __name__ == "__main__"` guard would start its engine again); a socket pair carries the messages.
        ours, theirs = socket.socketpair()
        # The child imports this very package, even where it is not installed (a checkout on sys.path).
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.structured_output.server", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
        )
        theirs.close()
        self.conn = Connection(ours.detach())

    def close(self) -> None:
        """Its socket closed (a server never given its spec then exits; a running one is told `close` first by
        `GrammarClient.close`), then the process waited for (killed after 5 s)."""
        self.conn.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class GrammarClient:
    """The engine's side of the grammar server: sends requests' grammars and step orders, reads the masks out of
    shared memory. Not thread-safe: the step loop alone calls it."""

    def __init__(self, spec: ServerSpec, process: ServerProcess | None = None) -> None:
        """`process`: a server process started earlier (`ServerProcess`); None starts one."""
        self.spec = spec
        self._shm = SharedMemory(create=True, size=SharedRings.nbytes(spec))
        self.rings = SharedRings(spec, self._shm.buf)
        self.rings.flags[:] = 0
        self._process = process or ServerProcess()
        self._proc, self._conn = self._process.proc, self._process.conn
        self._fd = self._conn.fileno()
        self._poller = select.poll()
        self._poller.register(self._fd, select.POLLIN)
        self._conn.send((spec, self._shm.name))
        self.compiled: OrderedDict[GrammarKey, str | None] = OrderedDict()
        """Keys whose compile finished -> its error (None: compiled), least recently used first; past
        `spec.cache_size` the oldest are forgotten here and in the server."""
        self.compiling: set[GrammarKey] = set()
        """Keys sent to compile, not answered yet."""
        self.failed: dict[str, str] = {}
        """Requests the server failed (`failed` answers not yet handled) -> the error."""
        self._fed: dict[str, tuple[str | None, bool]] = {}
        self.stats: dict[str, float] | None = None
        """The server's last `stats` answer (`request_stats`)."""
        self._last_rids: list[str] | None = None

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    dead = False
    """The server's pipe broke or its process ended: every structured request fails (`DIED`)."""

    # ---- asynchronous orders ---------------------------------------------------------------------------
    def compile(self, key: GrammarKey, params: StructuredOutputsParams) -> None:
        self.compiled.pop(key, None)
        self.compiling.add(key)
        self._send(("compile", key, params))

    def lookup(self, key: GrammarKey) -> tuple[bool, str | None]:
        """(Whether the key's compile finished, its error), marking the key used."""
        if key not in self.compiled:
            return False, None
        self.compiled.move_to_end(key)
        return True, self.compiled[key]

    def open(self, rid: str, key: GrammarKey, replay: Sequence[int] = ()) -> None:
        """A matcher for the request (its key compiled), fed the tokens it already has."""
        self._send(("open", rid, key, list(replay)))

    def step(self, k: int, fill_rids: Sequence[str], take: int | None) -> None:
        """Mask k: first mask `take`'s sampled ids (once `publish(take, ...)` wrote them) into their matchers, then
        the allowed-token rows of `fill_rids`, in order, into slot k % depth (`wait_mask` / the device's flag
        wait tells when)."""
        if len(fill_rids) > self.spec.rows:
            raise ValueError(f"{len(fill_rids)} rows to fill, the ring holds {self.spec.rows}")
        rows = None if fill_rids == self._last_rids else list(fill_rids)  # steady decoding: the same rows
        if rows is not None:
            self._last_rids = rows
        self._send(("step", k, rows, take))

    def warm_up(self) -> None:
        """The server compiles the common JSON field types' rules (a new schema then compiles in milliseconds)."""
        self._send(("warmup",))

    def take(self, k: int) -> None:
        """Mask k's sampled ids into their matchers now (before a `feed` that must follow them)."""
        self._send(("take", k))

    def remove(self, rid: str) -> None:
        self._send(("remove", rid))

    # ---- the shared rings, from the host (a CPU engine; a CUDA engine's stream does this itself) ---------------
    def mask(self, k: int) -> np.ndarray:
        """Slot k's mask rows (valid once `wait_mask(k)`)."""
        return self.rings.masks[k % self.spec.depth]

    def wait_mask(self, k: int, timeout: float | None = None) -> bool:
        """(Blocking) until mask k is filled: False after `timeout` (default `spec.timeout_s`) or when the server
        died."""
        end = time.monotonic() + (self.spec.timeout_s if timeout is None else timeout)
        while not wait_flag(self.rings.flags, MASKS, k, min(0.05, max(0.0, end - time.monotonic()))):
            if not self.alive:
                self.dead = True
                return False
            if time.monotonic() >= end:
                return False
        return True

    def publish(self, k: int, ids: Sequence[int] | np.ndarray) -> None:
        """Mask k's sampled ids, in its row order, for the server (and the flag that says they are there)."""
        self.rings.tokens[k % self.spec.depth, : len(ids)] = ids
        self.rings.flags[TOKENS] = k

    # ---- answers ------------------------------------------------------------------------------------------
    def poll(self, timeout: float = 0.0) -> None:
        """Takes the server's answers that have arrived (waits up to `timeout` s for the first)."""
        if self.dead:
            return
        # A poll object kept for the socket: `Connection.poll` builds a selector per call (~30 us a step).
        ms = int(timeout * 1000)
        try:
            while self._poller.poll(ms):
                self._take(self._conn.recv())
                ms = 0
        except (EOFError, OSError):  # the server died: its requests fail (`dead`), the engine goes on
            self.dead = True

    def _send(self, msg: tuple[Any, ...]) -> None:
        """`Connection.send`'s framing (a 4-byte big-endian length, then the pickle) in one write, with a plain
        pickle: ~3x cheaper than its ForkingPickler and two writes, on the step loop every structured step."""
        if self.dead:
            return
        data = pickle.dumps(msg, pickle.HIGHEST_PROTOCOL)
        try:
            os.write(self._fd, struct.pack("!i", len(data)) + data) if len(data) < 16384 else self._conn.send(msg)
        except OSError:
            self.dead = True

    def _take(self, msg: tuple[Any, ...]) -> None:
        op = msg[0]
        if op == "compiled":
            key = msg[1]
            self.compiling.discard(key)
            self.compiled[key] = msg[2]
            while len(self.compiled) > self.spec.cache_size:
                old, _ = self.compiled.popitem(last=False)
                self._send(("forget", old))
        elif op == "fed":
            self._fed[msg[1]] = (msg[2], msg[3])
        elif op == "stats":
            self.stats = msg[1]
        elif op == "failed":
            for rid in msg[1]:
                self.failed[rid] = msg[2]

    def tune(self, cpus: Sequence[int] | None, poll_us: float | None) -> None:
        """(Experiments) the server's CPUs (None: all it was started with) and its polling for messages while
        steps come (0: it blocks; None: `spec.poll_s`)."""
        self._send(("tune", (list(cpus) if cpus else None, poll_us)))

    def request_stats(self, timeout: float = 5.0) -> dict[str, float] | None:
        """(Blocking) where the server's time went so far (seconds by part, and its step count)."""
        self.stats = None
        self._send(("stats",))
        end = time.monotonic() + timeout
        while self.stats is None and not self.dead and time.monotonic() < end:
            self.poll(0.05)
        return self.stats

    def feed(self, rid: str, tokens: Sequence[int]) -> tuple[str | None, bool]:
        """(Blocking) tokens into one request's matcher: (the error of a rejected token, whether it ended)."""
        self._send(("feed", rid, list(tokens)))
        try:
            while rid not in self._fed and not self.dead:
                self._take(self._conn.recv())
        except (EOFError, OSError):
            self.dead = True
        if self.dead:
            return DIED, False
        return self._fed.pop(rid)

    def close(self) -> None:
        try:
            self._conn.send(("close",))
        except (BrokenPipeError, OSError):
            pass
        self._process.close()
        self.rings.release()
        self._shm.close()
        self._shm.unlink()
