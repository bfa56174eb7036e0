"""The grammar work in a process of its own (issue 16's next step; not wired into the engine yet).

Why: with async scheduling the grammar worker thread (`overlap.StepJobs`) shares the engine process's GIL with the
step loop. On an H100 host, 64 JSON-schema requests decode 18 % slower a step than plain ones (median over
processes), but only ~6 % when the worker does no xgrammar work (`structured_overhead.py --fake-grammar`,
benchmarks/NOTES.md session 26): the rest is the worker's GIL holds and the loop's waits for it.

The server owns xgrammar: the compiler (a thread pool of its own), the compiled grammars by key and one matcher per
request. The client (the engine's side) talks to it over a pipe with small tuples and reads the step masks from
shared memory (a ring of `depth` buffers of `rows` x `words` int32, which a CUDA engine can register as pinned
memory). One step is one message: the previous step's sampled tokens of the constrained requests (their intake),
then the requests whose allowed-token rows to fill, in order, into a ring slot; the answer names the slot and the
requests whose token was rejected or whose grammar ended.

Messages (client -> server): ("compile", key, params) · ("open", rid, key, replay_tokens) · ("step", rids, tokens,
fill_rids, slot) · ("feed", rid, tokens) · ("remove", rid) · ("close",). Answers: ("compiled", key, error | None)
(from the compile pool, whenever done) · ("filled", slot, rejected_rids, ended_rids) · ("fed", rid, error | None,
ended).
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.backend import GrammarKey, XgrammarBackend


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


def _serve(conn: Connection, spec: ServerSpec, shm_name: str) -> None:
    import torch
    import xgrammar as xgr

    backend = spec.make_backend()
    shm = SharedMemory(name=shm_name)
    ring = torch.from_numpy(np.ndarray((spec.depth, spec.rows, spec.words), dtype=np.int32, buffer=shm.buf))
    send_lock = threading.Lock()
    pool = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")
    compiled: dict[GrammarKey, Any] = {}
    matchers: dict[str, Any] = {}
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

    def feed(m: Any, tokens: Sequence[int]) -> tuple[str | None, bool]:
        for tok in tokens:
            if not m.accept_token(tok):
                return f"structured_outputs: token {tok} is not allowed by the grammar", False
            if m.is_terminated():
                return None, True
        return None, False

    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # the engine went away without closing
                break
            op = msg[0]
            if op == "step":
                _, rids, tokens, fill_rids, slot = msg
                rejected: list[str] = []
                ended: list[str] = []
                if rids:
                    ms = [matchers[r] for r in rids]
                    ok = xgr.BatchGrammarMatcher.batch_accept_token(ms, list(tokens))
                    for r, m, good in zip(rids, ms, ok):
                        if not good:
                            rejected.append(r)
                        elif m.is_terminated():
                            ended.append(r)
                mask = ring[slot]
                live = [i for i, r in enumerate(fill_rids) if r not in ended and not matchers[r].is_terminated()]
                if len(live) < len(fill_rids):  # rows not filled: every token allowed
                    free = np.ones(len(fill_rids), dtype=bool)
                    free[live] = False
                    mask.numpy()[: len(fill_rids)][free] = -1
                if live:
                    fm = [matchers[fill_rids[i]] for i in live]
                    batch.batch_fill_next_token_bitmask(fm, mask, live if len(live) < len(fill_rids) else None)
                send(("filled", slot, rejected, ended))
            elif op == "intake":  # tokens the masks allowed: no answer (the client infers ends from stop tokens)
                _, rids, tokens = msg
                if rids:
                    xgr.BatchGrammarMatcher.batch_accept_token([matchers[r] for r in rids], list(tokens))
            elif op == "compile":
                pool.submit(compile_one, msg[1], msg[2])
            elif op == "open":
                _, rid, key, replay = msg
                matchers[rid] = xgr.GrammarMatcher(compiled[key])
                if replay:
                    feed(matchers[rid], replay)
            elif op == "feed":
                _, rid, tokens = msg
                err, ended_ = feed(matchers[rid], tokens)
                send(("fed", rid, err, ended_))
            elif op == "remove":
                matchers.pop(msg[1], None)
            elif op == "close":
                break
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        del ring
        shm.close()


class GrammarClient:
    """The engine's side of the grammar server: sends requests' grammars, tokens and fill orders, reads the masks
    out of shared memory. Not thread-safe: the step loop alone calls it."""

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        size = spec.depth * spec.rows * spec.words * 4
        self._shm = SharedMemory(create=True, size=size)
        self.masks = np.ndarray((spec.depth, spec.rows, spec.words), dtype=np.int32, buffer=self._shm.buf)
        """The ring of step masks (slot, row, word), written by the server."""
        self._conn, child = mp.get_context("spawn").Pipe()
        self._proc = mp.get_context("spawn").Process(
            target=_serve, args=(child, spec, self._shm.name), name="grammar-server", daemon=True
        )
        self._proc.start()
        child.close()
        self.compiled: dict[GrammarKey, str | None] = {}
        """Keys whose compile finished -> its error (None: compiled)."""
        self._filled: dict[int, tuple[list[str], list[str]]] = {}
        self._fed: dict[str, tuple[str | None, bool]] = {}

    # ---- asynchronous orders ---------------------------------------------------------------------------
    def compile(self, key: GrammarKey, params: StructuredOutputsParams) -> None:
        self._conn.send(("compile", key, params))

    def open(self, rid: str, key: GrammarKey, replay: Sequence[int] = ()) -> None:
        """A matcher for the request (its key compiled), fed the tokens it already has."""
        self._conn.send(("open", rid, key, list(replay)))

    def step(self, rids: Sequence[str], tokens: Sequence[int], fill_rids: Sequence[str], slot: int) -> None:
        """The requests' next tokens into their matchers (one each), then the allowed-token rows of `fill_rids`,
        in order, into ring slot `slot` (`filled` waits for it)."""
        if len(fill_rids) > self.spec.rows:
            raise ValueError(f"{len(fill_rids)} rows to fill, the ring holds {self.spec.rows}")
        self._conn.send(("step", list(rids), list(tokens), list(fill_rids), slot))

    def intake(self, rids: Sequence[str], tokens: Sequence[int]) -> None:
        """The requests' next tokens (one each, allowed by their masks) into their matchers; no answer."""
        self._conn.send(("intake", list(rids), list(tokens)))

    def remove(self, rid: str) -> None:
        self._conn.send(("remove", rid))

    # ---- answers ------------------------------------------------------------------------------------------
    def poll(self, timeout: float = 0.0) -> None:
        """Takes the server's answers that have arrived (waits up to `timeout` s for the first)."""
        while self._conn.poll(timeout):
            self._take(self._conn.recv())
            timeout = 0.0

    def _take(self, msg: tuple[Any, ...]) -> None:
        op = msg[0]
        if op == "compiled":
            self.compiled[msg[1]] = msg[2]
        elif op == "filled":
            self._filled[msg[1]] = (msg[2], msg[3])
        elif op == "fed":
            self._fed[msg[1]] = (msg[2], msg[3])

    def filled(self, slot: int) -> tuple[np.ndarray, list[str], list[str]]:
        """(Blocking) slot's mask once filled: (the ring buffer's rows, requests whose token was rejected,
        requests whose grammar ended with it)."""
        while slot not in self._filled:
            self._take(self._conn.recv())
        rejected, ended = self._filled.pop(slot)
        return self.masks[slot], rejected, ended

    def feed(self, rid: str, tokens: Sequence[int]) -> tuple[str | None, bool]:
        """(Blocking) tokens into one request's matcher: (the error of a rejected token, whether it ended)."""
        self._conn.send(("feed", rid, list(tokens)))
        while rid not in self._fed:
            self._take(self._conn.recv())
        return self._fed.pop(rid)

    def close(self) -> None:
        try:
            self._conn.send(("close",))
        except (BrokenPipeError, OSError):
            pass
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
        self._conn.close()
        del self.masks
        self._shm.close()
        self._shm.unlink()


def make_backend(
    tokenizer: str, vocab_size: int, stop_token_ids: Sequence[int], config: Any, gguf_file: str | None = None
) -> XgrammarBackend:
    """A backend for the tokenizer at `tokenizer` (a `ServerSpec.make_backend` through `functools.partial`)."""
    from pagedllm.transformers_utils.tokenizer import get_tokenizer

    tok = get_tokenizer(tokenizer, gguf_file=gguf_file) if gguf_file else get_tokenizer(tokenizer)
    return XgrammarBackend(tok, vocab_size, stop_token_ids, config)
