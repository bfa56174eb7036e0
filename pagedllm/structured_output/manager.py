"""The engine core's side of structured outputs: compile pool + cache, one matcher per request, the
step's bitmask.

Interface to the scheduler (all calls on the step loop's thread):
- `add_request(req)`: starts compiling the request's grammar in a thread (or reuses the cached one);
  the scheduler keeps the request WAITING_FOR_FSM (skipped, never holding others) until `ready(req)`.
- `prepare(so, requests)`: after scheduling, picks the structured requests that sample this step and
  sets `so.structured_output_request_ids` and `so.grammar_bitmask` (a `GrammarBitmask`, filled when the
  runner asks for it: after it has launched the forward, so the host fill overlaps the device's work).
- `advance(req, new_tokens, rejected)`: the matcher takes the request's new tokens; True (request
  FINISHED_STOPPED) once its grammar has terminated.
- `remove(request_id)`: the request finished.
- `chain(so, previous)` (engine core, async scheduling): step N+1's fill first takes step N's tokens.

With a reasoning parser, a request's grammar applies only once `parser.is_reasoning_end(output ids)`.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

from pagedllm import envs
from pagedllm.executor.abstract import StepFuture
from pagedllm.logger import init_logger
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.backend import GrammarKey, XgrammarBackend, grammar_key
from pagedllm.structured_output.config import StructuredOutputsConfig
from pagedllm.structured_output.matchers import GrammarBitmask, PinnedMaskRing, feed_batch
from pagedllm.structured_output.matchers import RequestGrammar as _RequestGrammar
from pagedllm.structured_output.overlap import StepJobs

if TYPE_CHECKING:
    import xgrammar as xgr

    from pagedllm.core.request import Request
    from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
    from pagedllm.reasoning import ReasoningParser

logger = init_logger(__name__)

CACHE_SIZE = 256
"""Compiled grammars kept (by key), least recently used dropped first."""


class GrammarRejectedError(ValueError):
    """A sampled token the request's grammar does not accept (the mask should make this impossible)."""


class StructuredOutputManager:
    def __init__(
        self,
        config: StructuredOutputsConfig,
        backend_factory: Callable[[], XgrammarBackend],
        vocab_size: int,
        reasoning_parser_factory: Callable[[], ReasoningParser] | None = None,
        max_workers: int = 2,
        pin_masks: bool = False,
        fill_threads: int | None = None,
    ) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self._backend_factory = backend_factory
        self._backend: XgrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._in_use = False
        self._reasoning_factory = reasoning_parser_factory
        self._reasoner: ReasoningParser | None = None
        self.pool = cf.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[GrammarKey, cf.Future[xgr.CompiledGrammar]] = OrderedDict()
        self.states: dict[str, _RequestGrammar] = {}
        """Structured requests (every one the scheduler holds) -> their grammar state."""
        self._active: dict[str, _RequestGrammar] = {}
        """The states whose grammar constrains the next token (matcher ready, reasoning over), terminated ones
        until `prepare` drops them: `prepare` scans these, not every state."""
        self._batch: xgr.BatchGrammarMatcher | None = None
        """xgrammar's batch fill (threads), made with the first bitmask: no xgrammar import before then."""
        self.pin_masks: bool | PinnedMaskRing = PinnedMaskRing() if pin_masks else False
        self.fill_threads = fill_threads
        self._jobs = StepJobs(self.states, fill_threads)
        """Async scheduling: the previous step's intake and this step's fill on a worker thread."""
        self.step_worker = True
        """Whether async steps use that worker (off: both run inline on the step loop, in `chain`)."""

    # ---- compile -------------------------------------------------------------------------------------
    def _get_backend(self, in_use: bool = True) -> XgrammarBackend:
        """`in_use` False (the warm-up): the GIL's switch interval stays as it is until a request needs a grammar."""
        with self._backend_lock:  # the tokenizer and xgrammar's vocabulary are read once, in a compile thread
            if self._backend is None:
                self._backend = self._backend_factory()
            if in_use and not self._in_use:
                self._in_use = True
                _shorten_gil_switch_interval()
            return self._backend

    def warm_up(self) -> cf.Future[None]:
        """In a compile thread: the backend (tokenizer, xgrammar's vocabulary), then JSON schemas built from the
        common field types, whose rules' token masks xgrammar's cache keeps: a new schema reusing them compiles
        in a few ms instead of a pass over the vocabulary per rule (`PAGEDLLM_STRUCTURED_WARMUP`)."""

        def run() -> None:
            t0 = time.perf_counter()
            backend = self._get_backend(in_use=False)
            for schema in WARMUP_SCHEMAS:
                backend.compile(StructuredOutputsParams(json=schema))
            backend.compile(StructuredOutputsParams(json_object=True))
            logger.info("Structured outputs warmed up in %.2f s", time.perf_counter() - t0)

        return self.pool.submit(run)

    def _compile(self, params: Any) -> xgr.CompiledGrammar:
        return self._get_backend().compile(params)

    def add_request(self, req: Request) -> None:
        params = req.sampling_params.structured_outputs
        assert params is not None
        key = grammar_key(params, self.config)
        fut = self._cache.get(key)
        if fut is None or (fut.done() and fut.exception() is not None):
            fut = self.pool.submit(self._compile, params)
            self._cache[key] = fut
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        ended = self._reasoning_factory is None or self.config.enable_in_reasoning
        self.states[req.request_id] = _RequestGrammar(fut, ended)

    def poll(self, req: Request) -> bool | str:
        """True when the request's grammar is compiled (its matcher then exists), False while compiling,
        or the compile error."""
        st = self.states[req.request_id]
        if st.matcher is not None:
            return True
        if not st.future.done():
            return False
        err = st.future.exception()
        if err is not None:
            return f"structured_outputs: the grammar failed to compile: {err}"
        st.matcher = XgrammarBackend.matcher(st.future.result())
        st.stop_ids = frozenset(st.matcher.stop_token_ids)
        if st.reasoning_ended:
            self._active[req.request_id] = st
        # A request resumed with outputs (none today: grammars compile before the first schedule) replays them.
        if req.output_token_ids:
            self.accept(req, req.output_token_ids)
        return True

    def ready(self, req: Request, errors: dict[str, str]) -> bool:
        """Scheduler hook for a WAITING_FOR_FSM request: True (and the request WAITING) once its grammar is
        compiled; a compile error goes to `errors` (the scheduler fails that request alone)."""
        from pagedllm.core.request import RequestStatus

        ready = self.poll(req)
        if ready is True:
            req.status = RequestStatus.WAITING
            return True
        if isinstance(ready, str):
            errors[req.request_id] = ready
        return False

    def wait_pending(self, timeout: float) -> None:
        """Nothing else to run: wait (briefly) for a compilation rather than spinning the step loop."""
        pending = [st.future for st in self.states.values() if st.matcher is None and not st.future.done()]
        if pending:
            cf.wait(pending, timeout=timeout, return_when=cf.FIRST_COMPLETED)

    # ---- one step ------------------------------------------------------------------------------------
    def prepare(self, so: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Rows for the scheduled structured requests that sample this step (not partial prefills)."""
        ids: dict[str, int] = {}
        matchers: list[xgr.GrammarMatcher] = []
        states: list[_RequestGrammar] = []
        scheduled = so.num_scheduled_tokens
        done: list[str] = []
        for rid, st in self._active.items():
            if st.terminated:
                done.append(rid)
                continue
            if rid not in scheduled:
                continue
            req = requests.get(rid)
            if req is None or req.num_computed_tokens < req.num_tokens:
                continue
            ids[rid] = len(matchers)
            matchers.append(st.matcher)  # type: ignore[arg-type]  # active states have one
            states.append(st)
        for rid in done:
            del self._active[rid]
        if matchers:
            so.structured_output_request_ids = ids
            if self._batch is None:
                import xgrammar as xgr

                self._batch = xgr.BatchGrammarMatcher(self.fill_threads or "auto")
            valid = self._backend.valid_vocab if self._backend is not None else None
            bitmask = GrammarBitmask(matchers, self.vocab_size, self._batch, valid, self.pin_masks, states)
            if self.step_worker:
                bitmask.on_sampled = functools.partial(self._jobs.sampled, ids, bitmask)
            so.grammar_bitmask = bitmask

    def accept(self, req: Request, new_tokens: Sequence[int]) -> bool:
        """Advance the request's matcher with its new tokens (already in `req.output_token_ids`; those after
        the reasoning, with a reasoning parser); True once the grammar has terminated. GrammarRejectedError
        for a token it rejects. Tokens `pre_accept` took already are skipped."""
        st = self.states.get(req.request_id)
        if st is None or st.matcher is None:
            return False
        n_out = len(req.output_token_ids)
        if st.num_seen < n_out and self._jobs.pending is not None:
            self._jobs.publish()  # its tokens are due: the worker's intake of them (no step was chained)
        if st.num_seen >= n_out:  # async scheduling: `pre_accept` took them all
            if st.error is not None:
                raise GrammarRejectedError(st.error)
            return st.terminated
        skip = st.num_seen - (n_out - len(new_tokens))
        fresh = new_tokens[skip:] if skip > 0 else new_tokens
        st.num_seen = max(st.num_seen, n_out)
        if st.error is not None:
            raise GrammarRejectedError(st.error)
        if st.terminated:
            return True
        if not fresh:
            return False
        if not st.reasoning_ended:
            if self._reasoning().is_reasoning_end(req.output_token_ids):
                st.reasoning_ended = True  # the tokens that ended the reasoning are not the grammar's
                self._active[req.request_id] = st
            return False
        self._jobs.quiesce()
        self._feed(st, fresh)
        if st.error is not None:
            raise GrammarRejectedError(st.error)
        return st.terminated

    @staticmethod
    def _feed(st: _RequestGrammar, tokens: Sequence[int]) -> None:
        matcher = st.matcher
        assert matcher is not None
        for tok in tokens:
            if not matcher.accept_token(tok):
                st.error = f"structured_outputs: token {tok} is not allowed by the grammar"
                return
            if matcher.is_terminated():
                st.terminated = True
                return

    # ---- async scheduling ----------------------------------------------------------------------------
    @property
    def sync_only(self) -> bool:
        """Whether structured requests need synchronous steps: with a reasoning parser, the step after the
        reasoning ends must already be constrained, which needs the previous token on the host."""
        return self._reasoning_factory is not None and not self.config.enable_in_reasoning

    def chain(self, so: SchedulerOutput, previous: StepFuture) -> StepFuture:
        """Async scheduling: step N+1 (`so`) was scheduled before step N's tokens are known, so its bitmask
        must wait for them. Its fill (run by the runner after launching N+1's forward) first waits for N's
        result and advances the matchers with N's tokens; the returned future hands the same result to the
        scheduler's update (which then skips the tokens already taken)."""
        bitmask = so.grammar_bitmask
        if not isinstance(bitmask, GrammarBitmask):
            return previous
        cache: list[ModelRunnerOutput] = []
        if self._jobs.chain(bitmask):  # N's tokens are being taken on the worker, and N+1's fill follows
            return previous

        def once() -> ModelRunnerOutput:
            if not cache:
                cache.append(previous.result())
            return cache[0]

        def take_tokens() -> None:
            if cache:  # the scheduler read N's result first (the runner deferred N+1's sampling): it fed them
                return
            self._jobs.quiesce()
            r = once()
            self.pre_accept(r.req_ids, r.sampled_token_ids, r.failed)

        bitmask.before_fill = take_tokens
        return StepFuture(once)

    def pre_accept(self, req_ids: Sequence[str], sampled: Sequence[Sequence[int]], failed: dict[str, str]) -> None:
        """A step's sampled tokens into their matchers, before the scheduler sees them (async scheduling).
        Requests with one new token (every decode) go to xgrammar in one call (`_feed_batch`)."""
        states = self.states
        batch_states: list[_RequestGrammar] = []
        batch_tokens: list[int] = []
        for rid, tokens in zip(req_ids, sampled):
            st = states.get(rid)
            if st is None or not tokens or st.matcher is None or (failed and rid in failed):
                continue
            if not st.reasoning_ended or st.terminated or st.error is not None:
                continue
            st.num_seen += len(tokens)
            if len(tokens) == 1:
                batch_states.append(st)
                batch_tokens.append(tokens[0])
            else:
                self._feed(st, tokens)
        if len(batch_states) > 1:
            feed_batch(batch_states, batch_tokens)
        elif batch_states:
            self._feed(batch_states[0], batch_tokens)

    def begin_update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Scheduler hook before a step's tokens join their requests (the grammar server's intake, `remote.py`)."""

    def taking(self) -> AbstractSet[int]:
        """(Scheduler, before a step's tokens join their requests) the states (by `id`) whose intake of that step's
        token runs on the worker and is not published yet. Such a state needs no `advance` for a token that is not
        one of its grammar's stop tokens: the mask allowed the token, and only a stop token terminates a matcher;
        the outcome is published at the next step's mask. (With the previous step's intake pending instead, every
        state has seen as many tokens as the scheduler's update adds, and none is skipped on this ground.)"""
        job = self._jobs.pending
        return job.state_ids if job is not None else frozenset()

    def advance(self, req: Request, new_tokens: Sequence[int], rejected: dict[str, str]) -> bool:
        """Scheduler hook after new tokens joined the request: True (the request FINISHED_STOPPED) once its
        grammar has terminated; a rejected token goes to `rejected` (the scheduler fails the request)."""
        try:
            if self.accept(req, new_tokens):
                from pagedllm.core.request import RequestStatus  # (here: the scheduler imports this module)

                req.status = RequestStatus.FINISHED_STOPPED
                return True
        except GrammarRejectedError as e:
            rejected[req.request_id] = str(e)
        return False

    def _reasoning(self) -> ReasoningParser:
        if self._reasoner is None:
            assert self._reasoning_factory is not None
            self._reasoner = self._reasoning_factory()
        return self._reasoner

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self._active.pop(request_id, None)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self._jobs.shutdown()


_FIELDS: dict[str, Any] = {
    "text": {"type": "string"},
    "count": {"type": "integer"},
    "score": {"type": "number"},
    "flag": {"type": "boolean"},
    "none": {"type": "null"},
    "names": {"type": "array", "items": {"type": "string"}},
    "values": {"type": "array", "items": {"type": "number"}},
    "ids": {"type": "array", "items": {"type": "integer"}},
    "item": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
    "extra": {"type": "object"},
}
WARMUP_SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": _FIELDS, "required": ["text"], "additionalProperties": False},
    {"type": "object", "properties": _FIELDS, "required": ["text"]},
]
"""The warm-up's schemas: every basic field type, in a closed and an open object (no bounds: a bounded field
is a rule of its own, whose masks a warm-up cannot guess)."""


def _shorten_gil_switch_interval() -> None:
    """From the first structured request on, the step loop shares the GIL with the grammar worker thread (and
    xgrammar's bindings). With Python's default 5 ms switch interval a thread waiting for the GIL can stall a
    whole decode step: on an H100 host, 64 JSON-schema requests took +12-17 % per step over plain decoding
    with 5 ms, +5 % with 200 us and +4 % with 100 us, the default (benchmarks/NOTES.md, session 19).
    PAGEDLLM_GIL_SWITCH_INTERVAL_US=0 keeps Python's setting."""
    us = envs.PAGEDLLM_GIL_SWITCH_INTERVAL_US
    if us > 0 and sys.getswitchinterval() > us / 1e6:
        sys.setswitchinterval(us / 1e6)
