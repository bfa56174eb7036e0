"""The front end's state of one request while its outputs come in (`RequestState`: detokenizer, logprobs, metrics;
`ParentState`: a parallel-sampling parent's children), and what it builds: `CompletionOutput`s and `RequestOutput`s
(engine/output_processor.py drives them per step)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.output_collector import RequestOutputCollector
from pagedllm.engine.parallel_sampling import ParentRequest
from pagedllm.logprobs import Logprob, LogprobsLists, PromptLogprobs, SampleLogprobs
from pagedllm.messages import EngineCoreRequest
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


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
        self, new: LogprobsLists | None, new_prompt: LogprobsLists | None, decode: TokenDecoder | None
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


class ParentState:
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


class TokenDecoder:
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


def _make_dict(ids: list[int], lps: list[float], ranks: list[int], decode: TokenDecoder | None) -> dict[int, Logprob]:
    return {
        t: Logprob(logprob=lp, rank=r, decoded_token=decode(t) if decode is not None else None)
        for t, lp, r in zip(ids, lps, ranks)
    }
