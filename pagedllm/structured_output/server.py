"""The grammar work in a process of its own: compiles, one matcher per request, and the step masks.

Why: with async scheduling the grammar work on a thread shares the engine process's GIL with the step loop, and a
mask waited for on the step loop keeps the device queue from running ahead. On an H100 host, 64 JSON-schema
requests decoded 18 % slower a step than plain ones (median over processes), ~6 % when the worker did no xgrammar
work (`structured_overhead.py --fake-grammar`, benchmarks/NOTES.md session 26).

The server owns xgrammar: the compiler (a thread pool of its own), the compiled grammars by key and one matcher per
request. The client (the step loop's side, `remote.py`) talks to it over a pipe with small tuples; the data of a
step goes through one shared-memory segment (which a CUDA engine registers as pinned, mapped memory):
- `masks`: a ring of `depth` step masks (`rows` x `words` int32);
- `tokens`: a ring of `depth` rows of sampled ids (int64), mask k's in its row order in slot k % depth;
- `flags`: [TOKENS] the number of the last mask whose sampled ids were written (by the device's stream, or the
  CPU engine's loop), [MASKS] the number of the last mask filled (by the server).

One step is one message, sent when the step is scheduled: ("step", k, fill_rids, take). The server waits until
flags[TOKENS] reaches `take` (the previous mask whose ids it has not taken), feeds those ids to their matchers,
fills mask k's rows (an ended or unknown request's row allows everything) into slot k % depth, and sets
flags[MASKS] = k, which the device (or the loop) waits for before the mask's upload. The loop never waits for
the intake: a token the mask allowed is never rejected, and it ends a grammar exactly when it is one of the
grammar's stop tokens, so the loop knows a grammar's end without asking.

Other messages (client -> server): ("take", k) (mask k's ids now, before a feed) · ("warmup",) · ("compile", key,
params) · ("forget", key) (out of the client's cache) · ("open", rid, key, replay_tokens) · ("feed", rid, tokens) ·
("remove", rid) · ("close",). Answers: ("compiled", key, error | None) (from the compile pool, whenever done) ·
("fed", rid, error | None, ended) · ("failed", rids, error) (a step's ids did not come in time, a token was
rejected, a grammar was missing: the requests fail, the engine goes on).
"""

from __future__ import annotations

import concurrent.futures as cf
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.backend import GrammarKey, XgrammarBackend
from pagedllm.structured_output.host_flags import seq_reached

DIED = "structured_outputs: the grammar server process died"
TOKENS, MASKS = 0, 1
"""Indices of `flags`."""
_FLAG_WORDS = 16
"""int32 words of the flags' area (64 bytes: the rings start on a cache line of their own)."""


@dataclass(frozen=True)
class ServerSpec:
    """What the server process needs (picklable: it is spawned)."""

    make_backend: Callable[[], XgrammarBackend]
    """A module-level function (or a `functools.partial` of one): the backend, built in the server."""
    rows: int
    """Rows per mask (the most structured requests one step samples)."""
    words: int
    """int32 words per row: ceil(the backend's valid vocabulary / 32)."""
    depth: int = 4
    spin_s: float = 0.0
    """How long the server spins on a flag before it sleeps between looks (`wait_flag`). Spinning costs the step
    loop: a host-bound loop whose core (or its hyperthread sibling) the server's spin shares runs slower, and
    the fill has a forward's time (~1.5 ms) to land anyway; 50-100 us sleeps cost a few percent of a core."""
    cache_size: int = 256
    """Compiled grammars the server keeps (least recently used out)."""
    timeout_s: float = 30.0
    """A step's ids that do not come in this long fail its requests (the device or the loop went wrong)."""


class SharedRings:
    """The views of the shared segment (see the module docstring), in the server and in the client."""

    def __init__(self, spec: ServerSpec, buf: Any) -> None:
        d, r, w = spec.depth, spec.rows, spec.words
        self.flags = np.ndarray((_FLAG_WORDS,), dtype=np.int32, buffer=buf)
        off = _FLAG_WORDS * 4
        self.masks = np.ndarray((d, r, w), dtype=np.int32, buffer=buf, offset=off)
        off += d * r * w * 4
        self.tokens = np.ndarray((d, r), dtype=np.int64, buffer=buf, offset=off)
        """int64: the sampler's dtype (the device copies its ids without a cast)."""

    def release(self) -> None:
        """Drops the views (the segment closes only once none is left)."""
        del self.flags, self.masks, self.tokens

    @staticmethod
    def nbytes(spec: ServerSpec) -> int:
        return _FLAG_WORDS * 4 + spec.depth * spec.rows * (spec.words + 2) * 4


def wait_flag(flags: np.ndarray, index: int, wanted: int, spin_s: float, timeout_s: float) -> bool:
    """Until flags[index] reaches `wanted` (cyclically): spin `spin_s`, then sleep between looks. False on timeout."""
    if seq_reached(int(flags[index]), wanted):
        return True
    now = time.monotonic()
    spin_end, end = now + spin_s, now + timeout_s
    while not seq_reached(int(flags[index]), wanted):
        now = time.monotonic()
        if now > end:
            return False
        if now > spin_end:
            time.sleep(0.00005)
    return True


def _serve(conn: Connection, spec: ServerSpec, shm_name: str) -> None:
    import torch
    import xgrammar as xgr

    backend = spec.make_backend()
    shm = SharedMemory(name=shm_name)
    # The client owns the segment: this process's resource tracker must not unlink it when it exits.
    from multiprocessing import resource_tracker

    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    rings = SharedRings(spec, shm.buf)
    send_lock = threading.Lock()
    pool = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")
    compiled: dict[GrammarKey, Any] = {}
    matchers: dict[str, Any] = {}
    slot_rids: dict[int, list[str]] = {}
    """Mask number -> its rows' requests (until its sampled ids are taken)."""
    last_rids: list[str] = []
    batch = xgr.BatchGrammarMatcher(1)

    def send(msg: tuple[Any, ...]) -> None:
        with send_lock:
            conn.send(msg)

    def compile_one(key: GrammarKey, params: StructuredOutputsParams) -> None:
        try:
            compiled[key] = backend.compile(params)
            send(("compiled", key, None))
        except Exception as e:  # the client fails the requests waiting for it
            send(("compiled", key, f"{type(e).__name__}: {e}"))

    def warm_up() -> None:
        """The common JSON field types' rules into xgrammar's cache (`manager.WARMUP_SCHEMAS`)."""
        from pagedllm.structured_output.manager import WARMUP_SCHEMAS

        for schema in WARMUP_SCHEMAS:
            backend.compile(StructuredOutputsParams(json=schema))
        backend.compile(StructuredOutputsParams(json_object=True))

    def feed(m: Any, tokens: Sequence[int]) -> tuple[str | None, bool]:
        for tok in tokens:
            if not m.accept_token(tok):
                return f"structured_outputs: token {tok} is not allowed by the grammar", False
            if m.is_terminated():
                return None, True
        return None, False

    def take(k: int) -> None:
        """Mask k's sampled ids into its rows' matchers."""
        rids = slot_rids.pop(k, [])
        if not wait_flag(rings.flags, TOKENS, k, spec.spin_s, spec.timeout_s):
            live = [r for r in rids if r in matchers]
            send(("failed", live, f"structured_outputs: the sampled ids of step {k} did not reach the grammars"))
            for r in live:
                del matchers[r]
            return
        ids = rings.tokens[k % spec.depth, : len(rids)].tolist()
        # (A row the runner did not sample has id -1.)
        pairs = [(r, t) for r, t in zip(rids, ids) if t >= 0 and r in matchers and not matchers[r].is_terminated()]
        if not pairs:
            return
        ms = [matchers[r] for r, _ in pairs]
        ok = xgr.BatchGrammarMatcher.batch_accept_token(ms, [t for _, t in pairs])
        bad = [r for (r, _), good in zip(pairs, ok) if not good]
        if bad:
            send(("failed", bad, "structured_outputs: a sampled token was not allowed by the grammar"))
            for r in bad:
                del matchers[r]

    def fill(k: int, rids: list[str]) -> None:
        mask = torch.from_numpy(rings.masks[k % spec.depth])
        live = [i for i, r in enumerate(rids) if r in matchers and not matchers[r].is_terminated()]
        if len(live) < len(rids):  # rows not filled: every token allowed
            free = np.ones(len(rids), dtype=bool)
            free[live] = False
            rings.masks[k % spec.depth, : len(rids)][free] = -1
        if live:
            fm = [matchers[rids[i]] for i in live]
            batch.batch_fill_next_token_bitmask(fm, mask, live if len(live) < len(rids) else None)
        slot_rids[k] = rids
        rings.flags[MASKS] = k  # after the rows (x86 stores are seen in order; a Python call lies between)

    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # the engine went away without closing
                break
            op = msg[0]
            if op == "step":
                _, k, fill_rids, took = msg
                if took is not None:
                    take(took)
                if fill_rids is None:  # the rows of the mask before
                    fill_rids = last_rids
                fill(k, fill_rids)
                last_rids = fill_rids
            elif op == "take":
                take(msg[1])
            elif op == "warmup":
                pool.submit(warm_up)
            elif op == "compile":
                pool.submit(compile_one, msg[1], msg[2])
            elif op == "open":
                _, rid, key, replay = msg
                grammar = compiled.get(key)
                if grammar is None:  # not expected (the client forgets a key only after its opens)
                    send(("failed", [rid], "structured_outputs: the grammar was not compiled"))
                    continue
                matchers[rid] = xgr.GrammarMatcher(grammar)
                if replay:
                    feed(matchers[rid], replay)
            elif op == "forget":
                compiled.pop(msg[1], None)
            elif op == "feed":
                _, rid, tokens = msg
                m = matchers.get(rid)
                err, ended_ = feed(m, tokens) if m is not None else ("structured_outputs: no grammar", False)
                send(("fed", rid, err, ended_))
            elif op == "remove":
                matchers.pop(msg[1], None)
            elif op == "close":
                break
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        rings.release()
        shm.close()


class GrammarClient:
    """The engine's side of the grammar server: sends requests' grammars and step orders, reads the masks out of
    shared memory. Not thread-safe: the step loop alone calls it."""

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self._shm = SharedMemory(create=True, size=SharedRings.nbytes(spec))
        self.rings = SharedRings(spec, self._shm.buf)
        self.rings.flags[:] = 0
        # A plain subprocess, not multiprocessing's spawn: that re-imports the user's __main__ (a script without an
        # `if __name__ == "__main__"` guard would start its engine again); a socket pair carries the messages.
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.structured_output.server", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send((spec, self._shm.name))
        self.compiled: OrderedDict[GrammarKey, str | None] = OrderedDict()
        """Keys whose compile finished -> its error (None: compiled), least recently used first; past
        `spec.cache_size` the oldest are forgotten here and in the server."""
        self.compiling: set[GrammarKey] = set()
        """Keys sent to compile, not answered yet."""
        self.failed: dict[str, str] = {}
        """Requests the server failed (`failed` answers not yet handled) -> the error."""
        self._fed: dict[str, tuple[str | None, bool]] = {}
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
        while not wait_flag(self.rings.flags, MASKS, k, 0.0, min(0.05, max(0.0, end - time.monotonic()))):
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
        try:
            while self._conn.poll(timeout):
                self._take(self._conn.recv())
                timeout = 0.0
        except (EOFError, OSError):  # the server died: its requests fail (`dead`), the engine goes on
            self.dead = True

    def _send(self, msg: tuple[Any, ...]) -> None:
        if self.dead:
            return
        try:
            self._conn.send(msg)
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
        elif op == "failed":
            for rid in msg[1]:
                self.failed[rid] = msg[2]

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
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._conn.close()
        self.rings.release()
        self._shm.close()
        self._shm.unlink()


def make_backend(
    tokenizer: str,
    vocab_size: int,
    stop_token_ids: Sequence[int],
    config: Any,
    gguf_file: str | None = None,
    tokenizer_mode: str = "auto",
    revision: str | None = None,
) -> XgrammarBackend:
    """A backend for the tokenizer at `tokenizer` (a `ServerSpec.make_backend` through `functools.partial`)."""
    from pagedllm.transformers_utils.tokenizer import get_tokenizer

    tok = get_tokenizer(tokenizer, gguf_file=gguf_file, tokenizer_mode=tokenizer_mode, revision=revision)
    return XgrammarBackend(tok, vocab_size, stop_token_ids, config)


def main() -> None:
    """`python -m pagedllm.structured_output.server FD`: the server on the socket FD (`GrammarClient` starts it)."""
    conn = Connection(int(sys.argv[1]))
    spec, shm_name = conn.recv()
    _serve(conn, spec, shm_name)


if __name__ == "__main__":
    main()
