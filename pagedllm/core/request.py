"""The engine core's view of one request: tokens, progress, status and prefix-cache block hashes."""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable
from typing import Any

from pagedllm.messages import EngineCoreRequest, FinishReason
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_FSM = 1
    """Structured outputs: waiting (in the waiting queue, skipped) until the request's grammar is compiled."""
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    # Slots: the scheduler reads a dozen fields of every running request each step.
    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "arrival_time",
        "max_tokens",
        "priority",
        "cache_salt",
        "lora_id",
        "pooling_params",
        "status",
        "output_token_ids",
        "all_token_ids",
        "num_computed_tokens",
        "num_output_placeholders",
        "num_cached_tokens",
        "num_preemptions",
        "stop_reason",
        "block_hashes",
        "_block_hasher",
        "_hash_block_size",
        "next_hash_len",
        "stop_len",
        "stop_token_set",
        "kv_fast_limit",
        "spec_token_ids",
        "spec_in_flight",
        "mm_features",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float,
        max_tokens: int,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_id: int | None = None,
        block_hasher: Callable[[Request], list[bytes]] | None = None,
        mm_features: list[Any] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.max_tokens = max_tokens
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_id = lora_id
        self.mm_features: list[Any] = mm_features or []
        """The prompt's images (`multimodal.inputs.MultiModalFeature`); their hashes enter the block hashes."""
        self.pooling_params: PoolingParams | None = None
        """Set for a pooling request: it finishes when its prompt is computed (no sampled token)."""
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        """Async scheduling: tokens sampled by steps still in flight (scheduled on, not yet known)."""
        self.num_cached_tokens = -1
        """Prefix-cache hit tokens at first scheduling (-1 until then)."""
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.block_hashes: list[bytes] = []
        self._block_hasher = block_hasher
        # Tokens per hashed block: the hasher only has work once all_token_ids reaches the next block end.
        self._hash_block_size: int = getattr(block_hasher, "block_size", 1)
        if block_hasher is not None:
            self.block_hashes.extend(block_hasher(self))
        self.next_hash_len = (len(self.block_hashes) + 1) * self._hash_block_size if block_hasher else sys.maxsize
        """len(all_token_ids) at which the next block hash is due (never, without a hasher)."""
        self.stop_len = len(prompt_token_ids) + max_tokens
        """len(all_token_ids) at which the request stops on length: max_tokens outputs (the scheduler
        lowers it to max_model_len when that comes first)."""
        sp = sampling_params
        stops = set(sp.stop_token_ids or ())
        if not sp.ignore_eos and sp.eos_token_id is not None:
            stops.add(sp.eos_token_id)
        self.stop_token_set: frozenset[int] = frozenset(stops)
        """Every token that can stop the request (EOS unless ignored, stop_token_ids), min_tokens aside:
        a sampled token outside it below `stop_len` cannot stop the request, so no full check is due."""
        self.kv_fast_limit = 0
        """Set by KVCacheManager: while num_computed_tokens + new tokens <= this, allocating slots adds no
        block and registers no hash (0: always ask the manager)."""
        self.spec_token_ids: list[int] = []
        self.spec_in_flight = 0
        """Speculation with async scheduling: the proposal rows of its last scheduled verification (how much
        further on its true position may be while that step's result is unread)."""
        """Speculative decoding: the tokens the runner proposed for this request's next step (never part
        of all_token_ids, hence never of a block hash)."""

    @classmethod
    def from_engine_core_request(
        cls,
        req: EngineCoreRequest,
        max_model_len: int,
        block_hasher: Callable[[Request], list[bytes]] | None,
    ) -> Request:
        prompt_len = len(req.prompt_token_ids)
        max_tokens = max_model_len - prompt_len
        if req.sampling_params.max_tokens is not None:
            max_tokens = min(max_tokens, req.sampling_params.max_tokens)
        request = cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            req.arrival_time,
            max_tokens,
            req.priority,
            req.cache_salt,
            req.lora_id,
            block_hasher,
            req.mm_features,
        )
        request.pooling_params = req.pooling_params
        return request

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token: int) -> int:
        """One sampled token (the decode step's case): appended, full blocks hashed; the new length."""
        self.output_token_ids.append(token)
        all_ids = self.all_token_ids
        all_ids.append(token)
        n = len(all_ids)
        if n >= self.next_hash_len:
            self.extend_block_hashes()
        return n

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if len(self.all_token_ids) >= self.next_hash_len:
            self.extend_block_hashes()

    def extend_block_hashes(self) -> None:
        """Hash the blocks that became full (callers check `next_hash_len` first)."""
        assert self._block_hasher is not None
        self.block_hashes.extend(self._block_hasher(self))
        self.next_hash_len = (len(self.block_hashes) + 1) * self._hash_block_size

    def is_finished(self) -> bool:
        return self.status.finished

    def get_finished_reason(self) -> FinishReason | None:
        return self.status.finish_reason
