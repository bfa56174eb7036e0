"""The plain-data contract between the scheduler and the worker side (the only thing workers see)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from pagedllm.logprobs import LogprobsLists
from pagedllm.pooling_params import PooledData, PoolingParams
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class BitmaskSource(Protocol):
    """A step's grammar bitmask filled in the background (`structured_output.manager.GrammarBitmask`): the
    runner asks for it after launching the forward, so the host fill overlaps the device's work."""

    valid_vocab: int
    """The ids the mask covers (the tokenizer's); the model's ids past them are padding."""

    def result(self) -> np.ndarray:
        """int32 [rows, ceil(model vocab / 32)]."""
        ...

    logit_rows: list[int | None] | None
    """Set by the CUDA apply: each sampled row's mask row (None: no grammar), for the step's token intake."""

    def narrow(self) -> tuple[torch.Tensor, list[int]]:
        """(int32 [rows, ceil(valid_vocab / 32)], the rows whose grammar constrains this step)."""
        ...

    def uploaded(self) -> None:
        """The mask `narrow` gave was uploaded (its host buffer is free once the copy has run)."""
        ...


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    """Block ids per KV-cache group."""
    num_computed_tokens: int
    lora_id: int | None = None
    """Hook for multi-LoRA (issue: multi-LoRA serving): the adapter this request runs with; None today."""
    pooling_params: PoolingParams | None = None
    """A pooling request's parameters (its hidden states go to the pooler, not the sampler)."""
    mm_features: list[Any] | None = None
    """The prompt's images (`multimodal.inputs.MultiModalFeature`): the runner encodes them when scheduled."""


@dataclass
class CachedRequestData:
    """Requests the worker already knows (running, or resumed after preemption)."""

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    """Blocks appended this step (for a resumed request: its whole new block list)."""
    num_computed_tokens: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    """Pipeline parallelism only (empty otherwise): per request, its output tokens from position
    max(num_computed_tokens, prompt length) up to the step's end; the stages before the last, which do not
    sample, learn the sampled tokens from it (`core/pipeline_scheduling.py`)."""


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    """Tokens to compute per request this step (more than one for a running request is valid:
    speculative decoding schedules the draft tokens too)."""
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    """Hook for speculative decoding (issue: speculative decoding): per request, the proposed tokens this
    step verifies (counted in num_scheduled_tokens; set by the scheduler from the runner's proposals,
    `pagedllm/spec_decode/`)."""
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests that finished or were aborted since the last step: the worker drops their state."""
    preempted_req_ids: set[str] = field(default_factory=set)
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    """Structured outputs (`pagedllm/structured_output/`): request id -> its row in grammar_bitmask; only
    requests that sample this step (no partial prefills)."""
    grammar_bitmask: np.ndarray | BitmaskSource | None = None
    """The allowed-token bitmask (int32, ceil(vocab / 32) words per row) of those requests, or its source,
    filled on the host when the runner resolves it (after launching the forward). A worker in another
    process would get it resolved before sending."""
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    """Multimodal: request id -> indexes of its images to run through the encoder this step (before the
    forward); their outputs stay cached by image hash until named in free_encoder_hashes."""
    free_encoder_hashes: list[str] = field(default_factory=list)


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    """Per request, in req_ids order: the tokens sampled this step ([] for a partial prefill chunk)."""
    logprobs: list[LogprobsLists | None] | None = None
    """Per request, in req_ids order: logprobs of the sampled tokens (None: not requested / no row asked)."""
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    """Requests whose prompt logprobs were completed this step -> all of them (prompt positions 1..n-1)."""
    failed: dict[str, str] = field(default_factory=dict)
    """Requests that failed in the worker this step (e.g. a user logits processor raised) -> the error:
    they finish with `FinishReason.ERROR`; their sampled tokens are dropped; the others go on."""
    pooler_output: dict[str, PooledData] = field(default_factory=dict)
    """Pooling requests whose prompt was completed this step -> their pooled result."""
    spec_token_ids: dict[str, list[int]] | None = None
    """Speculative decoding: per request, the tokens proposed for the next step (None: speculation off)."""
    spec_num_drafted: dict[str, int] | None = None
    """Speculation with async scheduling: per request, how many of the step's proposal rows held a real
    proposal (the rest were placeholders the device had nothing for), for the acceptance metrics."""
