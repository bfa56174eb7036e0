"""One step's batched matcher work: the requests' grammar states, the token intake of a step's sampled tokens
(one xgrammar call for all single-token requests) and the step's allowed-token bitmask (one batch fill).

Every call here runs on the engine core's step loop: with async scheduling the loop is host-bound at decode
batch sizes, so what matters is the number of Python-level and FFI calls per step (each xgrammar call drops and
retakes the GIL), not only xgrammar's own work."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr


class RequestGrammar:
    __slots__ = ("future", "matcher", "stop_ids", "reasoning_ended", "terminated", "num_seen", "error")

    def __init__(self, future: cf.Future[xgr.CompiledGrammar], reasoning_ended: bool) -> None:
        self.future = future
        self.matcher: xgr.GrammarMatcher | None = None
        self.stop_ids: frozenset[int] = frozenset()
        """The matcher's stop tokens: it terminates only by accepting one (terminate_without_stop_token off)."""
        self.reasoning_ended = reasoning_ended
        self.terminated = False
        self.num_seen = 0
        """Output tokens already taken (async scheduling takes a step's tokens before the scheduler sees them)."""
        self.error: str | None = None


class PinnedMaskRing:
    """Pinned host buffers for the step masks of a CUDA engine, used in turn: no allocation from the caching host
    allocator (and its event bookkeeping) per step. Each buffer's upload records an event (`uploaded`); a buffer
    is filled again only once that upload has run (in steady decoding it has: a mask is filled after the previous
    step's sampled ids reached the host, so after every earlier upload)."""

    DEPTH = 4

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor] = []
        self._events: list[Any] = []
        self._next = 0

    def take(self, n: int, words: int) -> tuple[torch.Tensor, int]:
        """Rows [0, n) of the next buffer (n x words int32), and its slot."""
        import torch

        if not self._bufs or n > self._bufs[0].shape[0] or words != self._bufs[0].shape[1]:
            rows = max(n, self._bufs[0].shape[0] if self._bufs else 0)
            self._bufs = [torch.empty((rows, words), dtype=torch.int32, pin_memory=True) for _ in range(self.DEPTH)]
            self._events = [None] * self.DEPTH
        slot = self._next
        self._next = (slot + 1) % self.DEPTH
        event = self._events[slot]
        if event is not None:
            event.synchronize()
        return self._bufs[slot][:n], slot

    def uploaded(self, slot: int) -> None:
        """(The step loop) the buffer's upload was enqueued on the current stream."""
        import torch

        event = self._events[slot]
        if event is None:
            event = self._events[slot] = torch.cuda.Event()
        event.record()


class GrammarBitmask:
    """The allowed-token bitmask of one step's structured requests (row i: matchers[i]), filled on the
    host on first `narrow()` / `result()` (the runner asks after launching the forward) with xgrammar's batch
    fill, which spreads the rows over `fill_threads` threads.

    The fill covers only the tokenizer's ids (`valid_vocab`); the model's padded ids past them are never
    allowed in a constrained row, allowed in an unconstrained one (a grammar that terminated with the previous
    step's token: its request stops and this row's token is dropped)."""

    def __init__(
        self,
        matchers: list[xgr.GrammarMatcher],
        vocab_size: int,
        batch: xgr.BatchGrammarMatcher,
        valid_vocab: int | None = None,
        pin: bool | PinnedMaskRing = False,
        states: list[RequestGrammar] | None = None,
    ) -> None:
        self.matchers = matchers
        self.states = states
        """The matchers' request states (the manager's): whether a row's grammar has terminated is read from
        them, not asked of each matcher (an FFI call per row)."""
        self.vocab_size = vocab_size
        self.valid_vocab = valid_vocab or vocab_size
        """The matchers' vocabulary (`XgrammarBackend.valid_vocab`): model ids past it are never allowed."""
        self._batch = batch
        self._pin = pin
        """Fill into pinned memory (a CUDA runner uploads it without a staging copy): a buffer of the ring, or
        a fresh one (True)."""
        self._slot = -1
        """The ring's buffer this mask was filled into (-1: none)."""
        self.logit_rows: list[int | None] | None = None
        """Set by the CUDA apply: the mask row of each sampled row (None: unconstrained), for the intake."""
        self._narrow: tuple[torch.Tensor, list[int]] | None = None
        self._mask: np.ndarray | None = None
        self.before_fill: Callable[[], None] | None = None
        """Async scheduling: takes the previous step's tokens into the matchers first (see `chain`)."""
        self.future: cf.Future[tuple[torch.Tensor, list[int]]] | None = None
        """Async scheduling with the worker (`overlap.StepJobs`): the fill running there."""
        self.on_sampled: Callable[..., None] | None = None
        """Set by the manager: the runner reports this step's sampled ids here (`overlap.StepJobs.sampled`)."""

    def fill_after(self, job: Any, batch: xgr.BatchGrammarMatcher) -> tuple[torch.Tensor, list[int]]:
        """(Worker) the fill once the previous step's intake `job` has run: rows it terminated are unconstrained."""
        ended = {id(job.picked[i][0]) for i in job.terminated}
        return self._fill(ended, batch)

    def _fill(
        self, ended: set[int] | None = None, batch: xgr.BatchGrammarMatcher | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        batch = batch or self._batch
        import torch

        matchers = self.matchers
        n, words = len(matchers), -(-self.valid_vocab // 32)
        if isinstance(self._pin, PinnedMaskRing):
            mask, self._slot = self._pin.take(n, words)
        else:
            mask = torch.empty((n, words), dtype=torch.int32, pin_memory=self._pin)
        if self.states is not None:
            if ended:
                rows = [i for i, st in enumerate(self.states) if not st.terminated and id(st) not in ended]
            else:
                rows = [i for i, st in enumerate(self.states) if not st.terminated]
        else:
            rows = [i for i, m in enumerate(matchers) if not m.is_terminated()]
        if len(rows) < n:
            # Rows left unconstrained (terminated grammars): all tokens allowed, set through numpy rather than
            # `torch.full`, whose OpenMP-parallel fill would start a second OpenMP team from the worker thread. A
            # filled row needs nothing first: xgrammar writes every word of it (test_fill_overwrites_whole_rows);
            # the 0.4 MB memset of 64 rows was worker time under the GIL.
            if rows:
                free = np.ones(n, dtype=bool)
                free[rows] = False
                mask.numpy()[free] = -1
            else:
                mask.numpy().fill(-1)
        if len(rows) == n:
            batch.batch_fill_next_token_bitmask(matchers, mask)
        elif len(rows) == 1:
            matchers[rows[0]].fill_next_token_bitmask(mask, rows[0])
        elif rows:
            batch.batch_fill_next_token_bitmask([matchers[i] for i in rows], mask, rows)
        return mask, rows

    def uploaded(self) -> None:
        """(The CUDA apply) the mask's upload is enqueued: its ring buffer may be filled again once it has run."""
        if self._slot >= 0 and isinstance(self._pin, PinnedMaskRing):
            self._pin.uploaded(self._slot)

    def narrow(self) -> tuple[torch.Tensor, list[int]]:
        """(the mask over the tokenizer's ids, int32 [rows, ceil(valid_vocab / 32)]; the constrained rows)."""
        if self._narrow is None:
            if self.before_fill is not None:
                self.before_fill()
            self._narrow = self.future.result() if self.future is not None else self._fill()
        return self._narrow

    def result(self) -> np.ndarray:
        """The mask over the model's whole vocabulary (int32 [rows, ceil(vocab_size / 32)])."""
        if self._mask is None:
            mask, rows = self.narrow()
            narrow = mask.numpy()
            wide_w = -(-self.vocab_size // 32)
            if wide_w == narrow.shape[1]:
                self._mask = narrow
            else:
                full = np.full((narrow.shape[0], wide_w), -1, dtype=np.int32)
                full[:, : narrow.shape[1]] = narrow
                if rows:
                    tv = self.valid_vocab
                    full[rows, narrow.shape[1] :] = 0
                    if tv % 32:
                        full[rows, narrow.shape[1] - 1] &= np.int32((1 << (tv % 32)) - 1)
                self._mask = full
        return self._mask


def feed_batch(states: list[RequestGrammar], tokens: list[int]) -> None:
    """One token into each state's matcher in one xgrammar call, with `_feed`'s outcome per state."""
    record_outcome(states, tokens, *batch_outcome(states, tokens))


def record_outcome(states: list[RequestGrammar], tokens: list[int], rejected: list[int], terminated: list[int]) -> None:
    """`batch_outcome`'s result into the states, as `_feed` leaves them: a rejected token -> `st.error`; a stop
    token accepted -> `st.terminated` (the only way a matcher terminates)."""
    for i in rejected:
        states[i].error = f"structured_outputs: token {tokens[i]} is not allowed by the grammar"
    for i in terminated:
        states[i].terminated = True


def batch_outcome(states: list[RequestGrammar], tokens: list[int]) -> tuple[list[int], list[int]]:
    """One token into each state's matcher in one xgrammar call, the states left as they are: (positions whose
    token was rejected, positions whose matcher terminated)."""
    rejected = _batch_accept([st.matcher for st in states], tokens)  # type: ignore[misc]
    bad = set(rejected)
    terminated = [
        i
        for i, (st, tok) in enumerate(zip(states, tokens))
        if tok in st.stop_ids and i not in bad and st.matcher.is_terminated()  # type: ignore[union-attr]
    ]
    return rejected, terminated


def _batch_accept(matchers: list[xgr.GrammarMatcher], tokens: list[int]) -> list[int]:
    """Positions whose token its matcher rejected (usually none). xgrammar's `batch_accept_token` returns a
    C++ array that its wrapper reads element by element, one FFI call each (~1.3 us; as much as the accepts
    themselves): here one containment test answers "all accepted", and only otherwise are the elements read."""
    raw = _raw_batch_accept()
    if raw is None:  # another xgrammar layout: its public wrapper
        import xgrammar as xgr

        accepted = xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        return [i for i, ok in enumerate(accepted) if not ok]
    result = raw([m._handle for m in matchers], tokens, False)
    if 0 not in result and False not in result:  # 0.2.8 stores ints; both asked in case a version stores bools
        return []
    return [i for i in range(len(tokens)) if not result[i]]


_RAW_BATCH_ACCEPT: Any = False
"""xgrammar's binding under `BatchGrammarMatcher.batch_accept_token` (False: not looked up yet; None: absent)."""


def _raw_batch_accept() -> Callable[[list[Any], list[int], bool], Any] | None:
    global _RAW_BATCH_ACCEPT
    if _RAW_BATCH_ACCEPT is False:
        import xgrammar as xgr

        core = getattr(getattr(xgr, "base", None), "_core", None)
        _RAW_BATCH_ACCEPT = getattr(getattr(core, "BatchGrammarMatcher", None), "batch_accept_token", None)
    return _RAW_BATCH_ACCEPT
