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
from pagedllm.logprobs import Logprob, LogprobsLists, PromptLogprobs, SampleLogprobs
from pagedllm.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from pagedllm.metrics.stats import FinishedRequestStats, IterationStats
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.pooling.inputs import make_pooling_output
from pagedllm.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    """Outputs of the requests without a queue (the offline LLM's)."""
    reqs_to_abort: list[str]
    """Core request ids that finished on a stop string here: the core must abort them."""
    iteration_stats: IterationStats | None = None


class RequestState:
    """Front-end state of one core request."""

    def __init__(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        detokenizer: IncrementalDetokenizer,
        parent_req: ParentRequest | None,
        request_index: int,
        queue: RequestOutputCollector | None,
    ) -> None:
        self.request_id = request.request_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.output_kind = request.sampling_params.output_kind
        self.detokenizer = detokenizer
        self.parent_req = parent_req
        self.request_index = request_index
        self.queue = queue
        self.num_cached_tokens = 0
        self.metrics = RequestMetrics(arrival_time=request.arrival_time)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        sp = request.sampling_params
        self.detokenizer_enabled = sp.detokenize
        wants_lp = sp.logprobs is not None or bool(sp.logprob_token_ids)
        self.logprobs: SampleLogprobs | None = [] if wants_lp else None
        self.cumulative_logprob: float | None = 0.0 if wants_lp else None
        self.prompt_logprobs: PromptLogprobs | None = None
        self.prompt_logprobs_sent = False
        self._num_new_logprobs = 0
        self.quiet = (
            self.output_kind == RequestOutputKind.FINAL_ONLY
            and not detokenizer.decodes
            and not wants_lp
            and sp.prompt_logprobs is None
            and parent_req is None
        )
        """Nothing to produce until it finishes (FINAL_ONLY), no text, no logprobs, no parent: a step that
        does not finish it only adds its tokens and token timings (`OutputProcessor._process`'s fast path)."""

    def update_logprobs(
        self, new: LogprobsLists | None, new_prompt: LogprobsLists | None, decode: _TokenDecoder | None
    ) -> None:
        """Fold this step's logprob lists into vLLM's dicts (later duplicates win, as in vLLM: a sampled
        token that is also in the top-k gets its top-k rank)."""
        self._num_new_logprobs = 0
        if new is not None and self.logprobs is not None:
            for ids, lps, ranks in zip(new.token_ids, new.logprobs, new.ranks):
                self.logprobs.append(_make_dict(ids, lps, ranks, decode))
                assert self.cumulative_logprob is not None
                self.cumulative_logprob += lps[0]
            self._num_new_logprobs = len(new)
        if new_prompt is not None:
            plp: PromptLogprobs = [None]
            for ids, lps, ranks in zip(new_prompt.token_ids, new_prompt.logprobs, new_prompt.ranks):
                plp.append(_make_dict(ids, lps, ranks, decode))
            self.prompt_logprobs = plp

    def take_prompt_logprobs(self) -> PromptLogprobs | None:
        """What RequestOutput.prompt_logprobs carries now (in DELTA mode: only the first time)."""
        if self.prompt_logprobs is None:
            return None
        if self.output_kind == RequestOutputKind.DELTA:
            if self.prompt_logprobs_sent:
                return None
            self.prompt_logprobs_sent = True
        return self.prompt_logprobs

    def make_completion_output(self, new_token_ids: list[int], finished: bool) -> CompletionOutput | None:
        """This step's CompletionOutput per the output kind, or None when nothing is due."""
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = self.output_kind == RequestOutputKind.DELTA
        text = self.detokenizer.get_next_output_text(finished, delta)
        if delta:
            if not new_token_ids and not text and not finished:
                return None
            token_ids = list(new_token_ids)
        else:
            token_ids = list(self.detokenizer.token_ids)
        logprobs = None
        if self.logprobs is not None:
            logprobs = self.logprobs[len(self.logprobs) - self._num_new_logprobs :] if delta else list(self.logprobs)
        return CompletionOutput(
            index=self.request_index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )

    def make_request_output(self, completion: CompletionOutput) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=self.finish_reason is not None,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics.snapshot(),
            prompt_logprobs=self.take_prompt_logprobs(),
        )


class _ParentState:
    """Output-processor bookkeeping of a parent request (prompt, queue, aggregated metrics)."""

    def __init__(
        self,
        parent: ParentRequest,
        prompt: str | None,
        prompt_token_ids: list[int],
        arrival_time: float,
        queue: RequestOutputCollector | None,
    ) -> None:
        self.parent = parent
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.queue = queue
        self.num_cached_tokens = 0
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.prompt_logprobs: PromptLogprobs | None = None
        """From the first child that reported them (all children share the prompt)."""
        self.prompt_logprobs_sent = False

    def make_request_output(self, outputs: list[CompletionOutput], finished: bool) -> RequestOutput:
        prompt_logprobs = self.prompt_logprobs
        if self.parent.output_kind == RequestOutputKind.DELTA:
            prompt_logprobs = None if self.prompt_logprobs_sent else prompt_logprobs
            self.prompt_logprobs_sent = self.prompt_logprobs_sent or prompt_logprobs is not None
        return RequestOutput(
            request_id=self.parent.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics.snapshot(),
            prompt_logprobs=prompt_logprobs,
        )


class OutputProcessor:
    """Turns core outputs into `RequestOutput`s; owns the front-end state of every live request."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, log_stats: bool = True) -> None:
        self.tokenizer = tokenizer
        self.log_stats = log_stats
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, _ParentState] = {}
        self._decoder = _TokenDecoder(tokenizer) if tokenizer is not None else None

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
                pstate = _ParentState(parent_req, prompt, request.prompt_token_ids, request.arrival_time, queue)
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
        touched_parents: dict[str, _ParentState] = {}
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
    def _update_parent_metrics(pstate: _ParentState, state: RequestState, new_token_ids: list[int], now: float) -> None:
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


class _TokenDecoder:
    """Token id -> its text alone (Logprob.decoded_token), cached: the same ids recur across steps and
    requests, and logprobs=-1 asks for the whole vocabulary at every position."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)  # type: ignore[assignment]
            self.cache[token_id] = text  # type: ignore[assignment]
        return text  # type: ignore[return-value]


def _make_dict(ids: list[int], lps: list[float], ranks: list[int], decode: _TokenDecoder | None) -> dict[int, Logprob]:
    return {
        t: Logprob(logprob=lp, rank=r, decoded_token=decode(t) if decode is not None else None)
        for t, lp, r in zip(ids, lps, ranks)
    }
