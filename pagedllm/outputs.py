"""What `LLM.generate` and `AsyncLLM.generate` return (vLLM's RequestOutput / CompletionOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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


# ---- pooling (vLLM's shapes) --------------------------------------------------------------------------
@dataclass
class PoolingOutput:
    """The pooled tensor of one request: [hidden] (embed), [num_labels] (classify / score) or
    [num_tokens, hidden] (token_embed / encode with ALL pooling)."""

    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @staticmethod
    def from_base(out: PoolingOutput) -> EmbeddingOutput:
        if out.data.ndim != 1:
            raise ValueError("embed: the pooled data is not a single vector")
        return EmbeddingOutput(out.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @staticmethod
    def from_base(out: PoolingOutput) -> ClassificationOutput:
        if out.data.ndim != 1:
            raise ValueError("classify: the pooled data is not a single vector")
        return ClassificationOutput(out.data.tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float

    @staticmethod
    def from_base(out: PoolingOutput) -> ScoringOutput:
        if out.data.numel() != 1:
            raise ValueError(f"score: expected one value per pair, got {out.data.numel()} (num_labels must be 1)")
        return ScoringOutput(float(out.data.reshape(-1)[0]))


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @staticmethod
    def from_base(req: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return EmbeddingRequestOutput(req.request_id, EmbeddingOutput.from_base(req.outputs), req.prompt_token_ids)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @staticmethod
    def from_base(req: PoolingRequestOutput) -> ClassificationRequestOutput:
        return ClassificationRequestOutput(
            req.request_id, ClassificationOutput.from_base(req.outputs), req.prompt_token_ids
        )


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @staticmethod
    def from_base(req: PoolingRequestOutput) -> ScoringRequestOutput:
        return ScoringRequestOutput(req.request_id, ScoringOutput.from_base(req.outputs), req.prompt_token_ids)
