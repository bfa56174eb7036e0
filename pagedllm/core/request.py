"""The engine core's view of one request: tokens, progress, status and prefix-cache block hashes."""

from __future__ import annotations

import enum
from collections.abc import Callable

from pagedllm.engine import EngineCoreRequest, FinishReason
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

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
}


class Request:
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
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.max_tokens = max_tokens
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_id = lora_id
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
        return cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            req.arrival_time,
            max_tokens,
            req.priority,
            req.cache_salt,
            req.lora_id,
            block_hasher,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if (self._block_hasher is not None
                and len(self.all_token_ids) >= (len(self.block_hashes) + 1) * self._hash_block_size):
            self.block_hashes.extend(self._block_hasher(self))

    def is_finished(self) -> bool:
        return self.status.finished

    def get_finished_reason(self) -> FinishReason | None:
        return self.status.finish_reason
