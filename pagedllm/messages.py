"""Plain-data messages between the engine front end and the engine core (msgspec-serializable, so the
core can move into its own process without touching them), and the wire tags that frame them on the
core process's ZMQ sockets. A top-level module: the core (`pagedllm/core`) and the front end both import
it, and it imports neither."""

from __future__ import annotations

import enum

import msgspec

from pagedllm.logprobs import LogprobsLists
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.pooling_params import PooledData, PoolingParams
from pagedllm.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    """This request failed in the engine (its `stop_reason` carries the message); the others go on."""

    def __str__(self) -> str:
        return ("stop", "length", "abort", "error")[self.value]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    lora_id: int | None = None
    pooling_params: PoolingParams | None = None
    """Set for a pooling request (prefill only, finishes after its last prompt chunk); its sampling_params
    are then a placeholder (max_tokens=1) the scheduler's bookkeeping reads."""
    lora_request: LoRARequest | None = None
    """The adapter (the core reads it off the step loop before scheduling the request); lora_id is its id."""
    mm_features: list[MultiModalFeature] | None = None
    """The prompt's images (`pagedllm/multimodal/`), ordered by their placeholder offset."""
    client_index: int = 0
    """Which front end (API-server process, `--api-server-count`) sent it: its outputs go back there."""


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    new_logprobs: LogprobsLists | None = None
    """Logprobs of `new_token_ids` (one position each), when the request asked for them."""
    new_prompt_logprobs: LogprobsLists | None = None
    """All prompt logprobs (positions 1..n-1), sent once with the request's first output."""
    pooling_output: PooledData | None = None
    """A pooling request's result (sent once, with its finish)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SpecDecodingStats(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    """Speculative decoding since the last stats (vLLM's counters): verified requests with proposals,
    proposed tokens, accepted ones, and accepted ones per proposal position."""

    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    """Tokens looked up in the prefix cache since the last stats (vLLM counts tokens)."""
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    kv_blocks: tuple[int, int, int] = (0, 0, 0)
    """(usable blocks, in use, free but still cached) from `BlockPool.snapshot_counts`: the dashboard's grid."""
    spec_decoding_stats: SpecDecodingStats | None = None
    """Speculative decoding's counts since the last stats (None: speculation off)."""
    waiting_lora_adapters: dict[str, int] = {}
    """LoRA adapter name -> waiting requests on it (as vLLM; only with LoRA enabled)."""
    running_lora_adapters: dict[str, int] = {}


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    finished_requests: list[str] = []
    engine_index: int = 0
    """Which engine core sent them (data parallelism; set by the front end's `DPAsyncMPClient`)."""


# Wire tags: the first frame of every message on the core process's sockets (`engine/core_proc.py`).
ADD = b"A"
"""front end -> core: an `EngineCoreRequest`."""
ABORT = b"X"
"""front end -> core: a list of request ids."""
UTILITY = b"U"
"""front end -> core: `(call_id, method, args)` or `(call_id, method, args, client_index)`, one of
`UTILITY_METHODS`."""
SHUTDOWN = b"S"
OUTPUTS = b"O"
"""core -> front end: `EngineCoreOutputs`."""
UTILITY_RESULT = b"R"
"""core -> front end: `(call_id, ok, result_or_error)`."""
READY = b"Y"
FAILED = b"F"
