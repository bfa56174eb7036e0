"""What `LLM.generate` and `AsyncLLM.generate` return (vLLM's RequestOutput / CompletionOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.logprobs import PromptLogprobs, SampleLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    """Sum of the sampled tokens' logprobs (None unless the request asked for logprobs)."""
    logprobs: SampleLogprobs | None = None
    """Per generated token: token id -> Logprob(logprob, rank, decoded_token)."""
    finish_reason: str | None = None
    """"stop" (EOS, stop token or stop string), "length", or "abort"; None while running."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the output; None for EOS or length."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0

    def snapshot(self) -> RequestMetrics:
        """A copy (each RequestOutput carries the metrics as of its step); several times cheaper than
        copy.copy, which matters once per request per step."""
        m = object.__new__(RequestMetrics)
        m.__dict__.update(self.__dict__)
        return m


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: PromptLogprobs | None = None
    """Per prompt token (None for the first): token id -> Logprob, when the request asked for them."""
    extra: dict = field(default_factory=dict)
