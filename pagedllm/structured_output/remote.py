"""Structured outputs with the grammar work in the grammar server process (`server.py`): the scheduler's manager
(`engine.grammar_process_default` says where it is used; the link and the step masks are `link.py`).

The step loop's part: when the scheduler schedules a step with constrained requests (`prepare`), one message
orders its mask from the server (after the previous mask's sampled ids). The runner does not wait for the mask:
on a CUDA engine it enqueues a stream wait on the server's flag, the mask's upload and apply, the sampling, and
then the sampled ids' copy back into shared memory and the flag the server waits on (`host_flags.py`), all with
the forward, so the device queue runs ahead as in a plain step and the fill runs while the forward does. A CPU
engine waits for the flag on the host.

The loop never waits for the intake either: a token the mask allowed is never rejected, and it ends a grammar
exactly when it is one of the grammar's stop tokens, so the scheduler learns a grammar's end without asking
(`begin_update`). Tokens not taken that way (reasoning, a resumed request) go through a blocking feed."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

from pagedllm.logger import init_logger
from pagedllm.structured_output.backend import GrammarKey, grammar_key
from pagedllm.structured_output.config import StructuredOutputsConfig
from pagedllm.structured_output.link import ServerLink, ServerMask
from pagedllm.structured_output.manager import GrammarRejectedError, StructuredOutputManager
from pagedllm.structured_output.matchers import RequestGrammar
from pagedllm.structured_output.server import DIED

if TYPE_CHECKING:
    from pagedllm.core.request import Request
    from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
    from pagedllm.executor.abstract import StepFuture
    from pagedllm.reasoning import ReasoningParser

logger = init_logger(__name__)

_REMOTE = object()
"""`RequestGrammar.matcher` of a request whose matcher lives in the server."""


class ProcessGrammarManager(StructuredOutputManager):
    """The scheduler's structured-output manager with the grammar work in the server process. The server starts
    in a thread of its own at the first structured request (or the warm-up): the tokenizer load and the process
    start never hold up the step loop; requests wait (`poll`) until it is up and their grammar compiled."""

    def __init__(
        self,
        config: StructuredOutputsConfig,
        start: Callable[[], ServerLink],
        vocab_size: int,
        reasoning_parser_factory: Callable[[], ReasoningParser] | None = None,
        unused: Callable[[], None] | None = None,
    ) -> None:
        """`unused`: called at shutdown when the server was never started (a server process started with the
        engine and never given its spec is closed by it)."""
        super().__init__(config, _no_backend, vocab_size, reasoning_parser_factory)
        self._start = start
        self._unused = unused
        self._starting: cf.Future[ServerLink] | None = None
        self.link: ServerLink | None = None
        self._start_error: str | None = None
        self._to_compile: dict[GrammarKey, Any] = {}
        """Compiles asked for before the server was up."""
        self._warm = False
        self._grammars: dict[str, tuple[GrammarKey, Any]] = {}
        """Request id -> its grammar's key and parameters (a key the cache forgot compiles again from them)."""
        self._k = 0
        """The number of the last mask ordered."""
        self._untaken: int | None = None
        """The last mask whose sampled ids were published and not yet ordered taken."""
        self.step_worker = False

    # ---- the server's start --------------------------------------------------------------------------
    def _begin_start(self) -> None:
        if self._starting is None:
            self._starting = self.pool.submit(self._start)

    def _up(self) -> ServerLink | None:
        """The link once the server is up (sends what waited for it); None before (or when it failed)."""
        if self.link is not None or self._starting is None or not self._starting.done():
            return self.link
        try:
            link = self._starting.result()
        except Exception as e:  # the requests fail; the engine serves the others
            self._start_error = f"structured_outputs: the grammar server did not start: {type(e).__name__}: {e}"
            logger.error("%s", self._start_error)
            self._starting = cf.Future()  # never done: no second start
            return None
        link.attach()
        self.link = link
        if self._warm:
            link.client.warm_up()
        for key, params in self._to_compile.items():
            self._order_compile(link, key, params)
        self._to_compile.clear()
        return link

    def warm_up(self) -> Any:
        self._warm = True
        self._begin_start()
        return self._starting

    def published(self, k: int) -> None:
        self._untaken = k

    def fail_all(self, rids: Sequence[str], error: str) -> None:
        for rid in rids:
            st = self.states.get(rid)
            if st is not None and st.error is None:
                st.error = error

    # ---- compile -------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        params = req.sampling_params.structured_outputs
        assert params is not None
        key = grammar_key(params, self.config)
        self._begin_start()
        link = self._up()
        if link is None:
            self._to_compile[key] = params
        else:
            self._order_compile(link, key, params)
        self._grammars[req.request_id] = (key, params)
        ended = self._reasoning_factory is None or self.config.enable_in_reasoning
        self.states[req.request_id] = RequestGrammar(None, ended)  # type: ignore[arg-type]

    def poll(self, req: Request) -> bool | str:
        st = self.states[req.request_id]
        if st.matcher is not None:
            return True
        link = self._up()
        if self._start_error is not None:
            return self._start_error
        if link is None:
            return False
        if link.dead:
            return DIED
        client = link.client
        client.poll()
        key, params = self._grammars[req.request_id]
        done, err = client.lookup(key)
        if not done:
            if key not in client.compiling:  # forgotten (cache full) before this request opened it
                client.compile(key, params)
            return False
        if err is not None:
            return f"structured_outputs: the grammar failed to compile: {err}"
        client.open(req.request_id, key, req.output_token_ids)
        st.matcher = _REMOTE  # type: ignore[assignment]
        st.stop_ids = link.stop_ids
        st.num_seen = len(req.output_token_ids)
        if st.reasoning_ended:
            self._active[req.request_id] = st
        return True

    @staticmethod
    def _order_compile(link: ServerLink, key: GrammarKey, params: Any) -> None:
        """Compile unless compiled (a failed compile is tried again) or compiling."""
        client = link.client
        done, err = client.lookup(key)
        if (not done and key not in client.compiling) or (done and err is not None):
            client.compile(key, params)

    def wait_pending(self, timeout: float) -> None:
        """Nothing else to run: wait (briefly) for the server's start or a compile answer, if one is awaited."""
        link = self._up()
        if link is None:
            if self._starting is not None:
                cf.wait([self._starting], timeout=timeout)
            return
        compiled, grammars = link.client.compiled, self._grammars
        if any(st.matcher is None and grammars[rid][0] not in compiled for rid, st in self.states.items()):
            link.client.poll(timeout)

    # ---- one step ------------------------------------------------------------------------------------
    def prepare(self, so: SchedulerOutput, requests: dict[str, Request]) -> None:
        link = self.link
        if link is None or link.dead:  # (dead: its requests fail at the step's update; no mask to wait for)
            return
        ids: dict[str, int] = {}
        done: list[str] = []
        scheduled = so.num_scheduled_tokens
        for rid, st in self._active.items():
            if st.terminated or st.error is not None:
                done.append(rid)
                continue
            req = requests.get(rid)
            if rid not in scheduled or req is None or req.num_computed_tokens < req.num_tokens:
                continue
            ids[rid] = len(ids)
        for rid in done:
            del self._active[rid]
        if ids:
            self._k = link.last_k = k = (self._k + 1) & 0x7FFFFFFF or 1
            link.client.step(k, list(ids), self._untaken)
            self._untaken = None
            so.structured_output_request_ids = ids
            so.grammar_bitmask = ServerMask(link, k, ids, self.published, self.fail_all)  # type: ignore[assignment]

    def begin_update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """(Scheduler, before the step's tokens join their requests) the tokens sampled under the step's mask are
        the server's; a stop token the mask allowed ends its grammar: the state says so before the scheduler
        looks. Failures the server reported mark their requests."""
        link = self.link
        if link is None:
            return
        client = link.client
        client.poll()
        if link.dead:  # every structured request fails; the others go on
            self.fail_all(list(self.states), DIED)
        if client.failed:
            failed, client.failed = client.failed, {}
            for rid, err in failed.items():
                self.fail_all([rid], err)
        mask = sched.grammar_bitmask
        if not isinstance(mask, ServerMask) or not mask.published:
            return
        # The server takes every token sampled under the mask: they count as seen (so the scheduler's check
        # finds nothing unseen and calls no `advance`), and an allowed stop token ends its grammar.
        rows = mask.row_of_rid
        active = self._active
        bad = result.failed
        for rid, toks in zip(result.req_ids, result.sampled_token_ids):
            if rid in rows and len(toks) == 1 and (st := active.get(rid)) is not None and not (bad and rid in bad):
                st.num_seen += 1
                if toks[0] in st.stop_ids:
                    st.terminated = True

    def taking(self) -> AbstractSet[int]:
        return frozenset()

    def chain(self, so: SchedulerOutput, previous: StepFuture) -> StepFuture:
        return previous

    def accept(self, req: Request, new_tokens: Sequence[int]) -> bool:
        st = self.states.get(req.request_id)
        if st is None or st.matcher is None:
            return False
        if st.error is not None:
            raise GrammarRejectedError(st.error)
        n_out = len(req.output_token_ids)
        if st.num_seen >= n_out:  # taken by the server (which also set an allowed stop token's end)
            return st.terminated
        skip = st.num_seen - (n_out - len(new_tokens))
        fresh = list(new_tokens[skip:] if skip > 0 else new_tokens)
        st.num_seen = n_out
        if st.terminated:
            return True
        if not st.reasoning_ended:
            if self._reasoning().is_reasoning_end(req.output_token_ids):
                st.reasoning_ended = True
                self._active[req.request_id] = st
            return False
        assert self.link is not None
        client = self.link.client
        if self._untaken is not None:  # the ids the server has not taken come first
            client.take(self._untaken)
            self._untaken = None
        err, ended = client.feed(req.request_id, fresh)
        if err is not None:
            st.error = err
            raise GrammarRejectedError(err)
        st.terminated = ended
        return ended

    def remove(self, request_id: str) -> None:
        if self.link is not None and request_id in self.states and self.states[request_id].matcher is not None:
            self.link.client.remove(request_id)
        self._grammars.pop(request_id, None)
        super().remove(request_id)

    def shutdown(self) -> None:
        super().shutdown()
        if self.link is not None:
            self.link.close()
        elif self._starting is not None:  # up but not yet taken, or still starting: closed once started
            self._starting.add_done_callback(_close_started)
        elif self._unused is not None:
            self._unused()


def _close_started(started: cf.Future[ServerLink]) -> None:
    if started.exception() is None:
        started.result().close()


def _no_backend() -> Any:
    raise RuntimeError("the grammar server process compiles; this process has no backend")
