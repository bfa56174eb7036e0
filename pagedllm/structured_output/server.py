"""The grammar work in a process of its own: compiles, one matcher per request, and the step masks.

Why: with async scheduling the grammar work on a thread shares the engine process's GIL with the step loop, and a
mask waited for on the step loop keeps the device queue from running ahead. On an H100 host, 64 JSON-schema
requests decoded 18 % slower a step than plain ones (median over processes), ~6 % when the worker did no xgrammar
work (`structured_overhead.py --fake-grammar`, benchmarks/NOTES.md session 26).

The server owns xgrammar: the compiler (a thread pool of its own), the compiled grammars by key and one matcher per
request. The client (`client.py`; the step loop's side is `remote.py` and `link.py`) talks to it over a socket
with small tuples; the data of a step goes through one shared-memory segment (which a CUDA engine registers as
pinned, mapped memory):
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
("remove", rid) · ("stats",) · ("tune", (cpus, poll_us)) · ("close",). Answers: ("compiled", key, error | None)
(from the compile pool, whenever done) · ("fed", rid, error | None, ended) · ("stats", {part: seconds}) ·
("failed", rids, error) (a step's ids did not come in time, a token was rejected, a grammar was missing: the
requests fail, the engine goes on).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import select
import sys
import threading
import time
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
_BUSY_S = 0.05
"""A polling server (`ServerSpec.poll_s`) polls until this long after the last step order, then blocks again."""
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
    poll_s: float = 0.0
    """> 0: while steps come (the last order within `_BUSY_S`), the server looks for its next message every poll_s
    instead of blocking in `recv`. A reader blocked on the socket is woken by the step loop's write, and Linux
    places a task woken that way (a synchronous wake-up) on the writer's CPU: the server then competes with the
    loop for its core every step (on an H100 host with the loop pinned, +3.5-10 % a step against +2-3 % when
    polling, benchmarks/NOTES.md session 28). A polling server wakes from its own timer, on its own CPU.
    `server_poll_s` gives the default."""
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


def server_poll_s() -> float:
    """`ServerSpec.poll_s`'s default: PAGEDLLM_GRAMMAR_SERVER_POLL_US, else 50 us where the process may use at least
    4 CPUs (on fewer, a polling server takes CPU time from the step loop and the forward's threads: blocking is
    cheaper there)."""
    from pagedllm import envs

    us = envs.PAGEDLLM_GRAMMAR_SERVER_POLL_US
    if us is None:
        us = 50.0 if len(os.sched_getaffinity(0)) >= 4 else 0.0
    return us / 1e6


def wait_flag(flags: np.ndarray, index: int, wanted: int, timeout_s: float) -> bool:
    """Until flags[index] reaches `wanted` (cyclically), sleeping 50 us between looks. False on timeout. Not a spin:
    a spinning server can share the host-bound step loop's core (+34 % a step in one H200 process, NOTES session
    27), and the fill has a forward's time (~1.5 ms) to land anyway."""
    end = time.monotonic() + timeout_s
    while not seq_reached(int(flags[index]), wanted):
        if time.monotonic() > end:
            return False
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
    stats = dict.fromkeys(("steps", "idle", "wait_ids", "take", "fill"), 0.0)
    """Where the server's time goes, in seconds (the `stats` message answers it): blocked for a message, waiting
    for a step's sampled ids, taking them, filling masks."""

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
        t = time.perf_counter()
        reached = wait_flag(rings.flags, TOKENS, k, spec.timeout_s)
        stats["wait_ids"] += time.perf_counter() - t
        if not reached:
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

    clock = time.perf_counter
    all_cpus = os.sched_getaffinity(0)
    poll_s = spec.poll_s
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    last_step = float("-inf")
    try:
        while True:
            t0 = clock()
            if poll_s > 0:
                while not poller.poll(0) and clock() - last_step < _BUSY_S:
                    time.sleep(poll_s)
            try:
                msg = conn.recv()
            except EOFError:  # the engine went away without closing
                break
            t1 = clock()
            stats["idle"] += t1 - t0
            op = msg[0]
            if op == "step":
                _, k, fill_rids, took = msg
                waited = stats["wait_ids"]
                if took is not None:
                    take(took)
                if fill_rids is None:  # the rows of the mask before
                    fill_rids = last_rids
                t2 = clock()
                fill(k, fill_rids)
                stats["fill"] += clock() - t2
                stats["take"] += t2 - t1 - (stats["wait_ids"] - waited)
                stats["steps"] += 1
                last_rids = fill_rids
                last_step = clock()
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
            elif op == "stats":
                send(("stats", dict(stats)))
            elif op == "tune":  # placement and polling experiments (benchmarks/structured_overhead.py)
                cpus, poll_us = msg[1]
                os.sched_setaffinity(0, set(cpus) if cpus else all_cpus)
                poll_s = spec.poll_s if poll_us is None else poll_us / 1e6
            elif op == "close":
                break
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        rings.release()
        shm.close()


def make_backend(tokenizer_info_json: str, vocab_size: int, config: Any) -> XgrammarBackend:
    """A backend from xgrammar's serialized tokenizer info (`backend.tokenizer_info`), built by the engine, which
    has the tokenizer: the server loads none (a GGUF's tokenizer takes seconds to build). A `ServerSpec.make_backend`
    through `functools.partial`."""
    return XgrammarBackend.from_tokenizer_info(tokenizer_info_json, vocab_size, config)


def main() -> None:
    """`python -m pagedllm.structured_output.server FD`: the server on the socket FD (`client.ServerProcess` starts
    it). The heavy imports come first, before the spec: a server started with the engine has them done by the
    time its first structured request sends the spec. Ctrl-C's SIGINT (sent to the whole foreground process group)
    is the engine's to handle: the server ends when the engine closes it or goes away."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch  # noqa: F401
    import xgrammar  # noqa: F401

    conn = Connection(int(sys.argv[1]))
    try:
        spec, shm_name = conn.recv()
    except EOFError:  # the engine closed it unused (or went away)
        return
    _serve(conn, spec, shm_name)


if __name__ == "__main__":
    main()
