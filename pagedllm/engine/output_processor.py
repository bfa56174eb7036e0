"""Front-end output processing: core outputs (new token ids) -> detokenized `RequestOutput`s.

Per step, the engine passes the core's `EngineCoreOutput`s to `OutputProcessor.process_outputs`, which
detokenizes incrementally, checks stop strings (a hit finishes the request here and the core must be
told to abort it: `reqs_to_abort`), folds parallel-sampling children into their parent, and either
returns the outputs (offline `LLM`) or puts them into each request's `RequestOutputCollector`
(`AsyncLLM`). All times are `time.monotonic()` values.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.output_collector import RequestOutputCollector
from pagedllm.engine.parallel_sampling import ParentRequest
from pagedllm.engine.request_state import ParentState, RequestState, TokenDecoder
from pagedllm.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from pagedllm.metrics.stats import FinishedRequestStats, IterationStats
from pagedllm.outputs import RequestOutput
from pagedllm.pooling.inputs import make_pooling_output

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    """Outputs of the requests without a queue (the offline LLM's)."""
    reqs_to_abort: list[str]
    """Core request ids that finished on a stop string here: the core must abort them."""
    iteration_stats: IterationStats | None = None


class OutputProcessor:
    """Turns core outputs into `RequestOutput`s; owns the front-end state of every live request."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, log_stats: bool = True) -> None:
        self.tokenizer = tokenizer
        self.log_stats = log_stats
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentState] = {}
        self._decoder = TokenDecoder(tokenizer) if tokenizer is not None else None

    def get_num_unfinished_requests(self) -> int:
        """Unfinished core requests (each parallel-sampling child counts)."""
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent_req: ParentRequest | None = None,
        request_index: int = 0,
        queue: RequestOutputCollector | None = None,
    ) -> None:
        """Register a core request. For `n > 1`, call once per child with the same `parent_req`
        (and the same `queue`, which then receives the parent's aggregated outputs)."""
        request_id = request.request_id
        if request_id in self.request_states:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        detokenizer = IncrementalDetokenizer.from_request(self.tokenizer, request)
        if parent_req is not None:
            pstate = self.parent_requests.get(parent_req.request_id)
            if pstate is None:
                pstate = ParentState(parent_req, prompt, request.prompt_token_ids, request.arrival_time, queue)
                self.parent_requests[parent_req.request_id] = pstate
            elif pstate.queue is None:
                pstate.queue = queue
            queue = None  # children report through the parent
        self.request_states[request_id] = RequestState(request, prompt, detokenizer, parent_req, request_index, queue)

    def abort_requests(self, request_ids: Iterable[str], stats: IterationStats | None = None) -> list[str]:
        """Forget the given requests (core or parent ids); return the core request ids to abort.

        A request read through a queue gets a last output with finish_reason "abort", so its reader
        ends; the offline LLM (no queue) gets nothing. With `stats`, the aborted requests are added to
        its `finished_requests` (finish_reason "abort"), so metrics count them.
        """
        to_abort: list[str] = []
        for rid in request_ids:
            pstate = self.parent_requests.get(rid)
            if pstate is not None:
                to_abort.extend(c for c in pstate.parent.child_ids() if c in self.request_states)
            elif rid in self.request_states:
                to_abort.append(rid)
        if to_abort:
            fake = [
                EngineCoreOutput(request_id=r, new_token_ids=[], finish_reason=FinishReason.ABORT) for r in to_abort
            ]
            self._process(fake, time.monotonic(), stats, [], [])
        return to_abort

    def process_outputs(
        self, outputs: list[EngineCoreOutput], engine_core_timestamp: float | None = None
    ) -> OutputProcessorOutput:
        """Process one step of core outputs.

        `engine_core_timestamp` (a `time.monotonic()` value from the core's step) times the metrics;
        when None or 0, now is used.
        """
        now = engine_core_timestamp or time.monotonic()
        stats = IterationStats(iteration_timestamp=now) if self.log_stats else None
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        self._process(outputs, now, stats, request_outputs, reqs_to_abort)
        return OutputProcessorOutput(request_outputs, reqs_to_abort, stats)

    def _process(
        self,
        outputs: list[EngineCoreOutput],
        now: float,
        stats: IterationStats | None,
        request_outputs: list[RequestOutput],
        reqs_to_abort: list[str],
    ) -> None:
        """Shared by `process_outputs` and `abort_requests`; outputs of requests without a queue go
        to `request_outputs`."""
        touched_parents: dict[str, ParentState] = {}
        get_state = self.request_states.get
        update_metrics = self._update_metrics
        for out in outputs:
            state = get_state(out.request_id)
            if state is None:
                continue  # aborted while the core was still working on it
            new_token_ids = out.new_token_ids
            update_metrics(state, new_token_ids, out.num_cached_tokens, now, stats)
            if out.pooling_output is not None:  # a pooling request's one result (pagedllm/pooling)
                del self.request_states[out.request_id]
                self._emit(state.queue, make_pooling_output(out, state.prompt_token_ids), request_outputs)  # type: ignore[arg-type]
                continue
            if state.quiet and out.finish_reason is None:
                # Fast path, the same effects as the general one below for such a request: the token ids
                # (the detokenizer's, which only collects them); no output until it finishes.
                state.detokenizer.token_ids.extend(new_token_ids)
                continue
            if out.new_logprobs is not None or out.new_prompt_logprobs is not None or state.logprobs is not None:
                decode = self._decoder if state.detokenizer_enabled else None
                state.update_logprobs(out.new_logprobs, out.new_prompt_logprobs, decode)

            finish_reason = out.finish_reason
            stop_reason = out.stop_reason
            stop_string = state.detokenizer.update(
                new_token_ids, finish_reason == FinishReason.STOP, finished=finish_reason is not None
            )
            if stop_string is not None:
                finish_reason, stop_reason = FinishReason.STOP, stop_string
                if not out.finished:
                    reqs_to_abort.append(out.request_id)
            finished = finish_reason is not None
            if finished:
                state.finish_reason = str(finish_reason)
                state.stop_reason = stop_reason
                state.metrics.finished_time = now
                del self.request_states[out.request_id]
                if stats is not None:
                    stats.finished_requests.append(self._finished_stats(state, now))

            completion = state.make_completion_output(new_token_ids, finished)
            if state.parent_req is not None:
                pstate = self.parent_requests.get(state.parent_req.request_id)
                if pstate is None:
                    continue
                self._update_parent_metrics(pstate, state, new_token_ids, now)
                if pstate.prompt_logprobs is None and state.prompt_logprobs is not None:
                    pstate.prompt_logprobs = state.prompt_logprobs
                if completion is not None:
                    pstate.parent.add_child_output(state.request_id, completion)
                touched_parents[pstate.parent.request_id] = pstate
            elif completion is not None:
                self._emit(state.queue, state.make_request_output(completion), request_outputs)

        for pid, pstate in touched_parents.items():
            taken = pstate.parent.take_outputs()
            if pstate.parent.finished:
                pstate.metrics.finished_time = now
                self.parent_requests.pop(pid, None)
            if taken is not None:
                comps, finished = taken
                self._emit(pstate.queue, pstate.make_request_output(comps, finished), request_outputs)

    @staticmethod
    def _emit(
        queue: RequestOutputCollector | None, output: RequestOutput, request_outputs: list[RequestOutput]
    ) -> None:
        if queue is not None:
            queue.put(output)
        else:
            request_outputs.append(output)

    @staticmethod
    def _update_metrics(
        state: RequestState,
        new_token_ids: list[int],
        num_cached_tokens: int,
        now: float,
        stats: IterationStats | None,
    ) -> None:
        if num_cached_tokens:
            state.num_cached_tokens = num_cached_tokens
        if not new_token_ids:
            return
        m = state.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            if stats is not None:
                stats.num_prompt_tokens += len(state.prompt_token_ids)
                stats.ttfts.append(now - m.arrival_time)
        elif stats is not None and m.last_token_time is not None:
            stats.itls.append(now - m.last_token_time)
        m.last_token_time = now
        m.num_generation_tokens += len(new_token_ids)
        if stats is not None:
            stats.num_generation_tokens += len(new_token_ids)

    @staticmethod
    def _update_parent_metrics(pstate: ParentState, state: RequestState, new_token_ids: list[int], now: float) -> None:
        pstate.num_cached_tokens = max(pstate.num_cached_tokens, state.num_cached_tokens)
        if not new_token_ids:
            return
        m = pstate.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        m.num_generation_tokens += len(new_token_ids)

    @staticmethod
    def _finished_stats(state: RequestState, now: float) -> FinishedRequestStats:
        m = state.metrics
        return FinishedRequestStats(
            request_id=state.request_id,
            finish_reason=state.finish_reason or "abort",
            e2e_latency=now - m.arrival_time,
            num_prompt_tokens=len(state.prompt_token_ids),
            num_generation_tokens=m.num_generation_tokens,
            num_cached_tokens=state.num_cached_tokens,
            ttft=None if m.first_token_time is None else m.first_token_time - m.arrival_time,
        )
