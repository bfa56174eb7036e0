"""The scheduler's request bookkeeping, mixed into `Scheduler`: requests in (`add_request`, and whether a
request's sampling makes the steps run synchronously: `needs_sync_step`) and out (finished, aborted or failed:
their KV blocks, encoder-cache entries and grammar freed), and the unfinished counts. Apart from
`core/scheduler.py` so that the step's scheduling reads on its own; the step's results come back through
`core/scheduler_update.py`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.request_queue import FCFSQueue, PriorityQueue
from pagedllm.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from pagedllm.multimodal.encoder_cache import EncoderCacheManager
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.structured_output.manager import StructuredOutputManager


def needs_sync_step(sp: SamplingParams) -> bool:
    """Whether sampling for this request reads its previous tokens on the host (so the next step cannot be
    scheduled before they are known): penalties, min_tokens, bad words, logprobs. (A grammar's bitmask follows
    the previous token too, but its fill waits for it off the critical path: `StructuredOutputManager.chain`.)"""
    return bool(
        sp.presence_penalty
        or sp.frequency_penalty
        or sp.repetition_penalty != 1.0
        or sp.min_tokens
        or sp.bad_words_token_ids
        or sp.logprobs is not None
        or sp.prompt_logprobs is not None
    )


class SchedulerRequestsMixin:
    """Needs the `Scheduler` state below (set by `Scheduler.__init__`)."""

    config: SchedulerConfig
    max_model_len: int
    kv: KVCacheManager
    block_hasher: Callable[[Request], list[bytes]] | None
    requests: dict[str, Request]
    waiting: FCFSQueue | PriorityQueue
    running: list[Request]
    finished_req_ids: set[str]
    _new_to_worker: set[str]
    async_scheduling: bool
    _sync_only: set[str]
    lora_names: dict[int, str]
    structured: StructuredOutputManager | None
    _grammar_errors: dict[str, str]
    encoder: EncoderCacheManager | None

    # ---- requests in and out -------------------------------------------------------------------
    def add_request(self, core_req: EngineCoreRequest) -> None:
        if core_req.request_id in self.requests:
            raise ValueError(f"request_id: {core_req.request_id!r} is already running")
        req = Request.from_engine_core_request(core_req, self.max_model_len, self.block_hasher)
        if core_req.lora_request is not None:
            self.lora_names[core_req.lora_request.lora_int_id] = core_req.lora_request.lora_name
        req.stop_len = min(req.stop_len, self.max_model_len)
        if req.mm_features and self.encoder is None:
            n = self.config.max_num_batched_tokens
            whole = self.config.disable_chunked_mm_input and self.config.enable_chunked_prefill
            self.encoder = EncoderCacheManager(budget=n, capacity=max(n, self.max_model_len), whole_items=whole)
        if req.sampling_params.structured_outputs is not None:
            if self.structured is None:
                raise ValueError("structured_outputs: not available in this engine")
            self.structured.add_request(req)  # compiles off the step loop
            req.status = RequestStatus.WAITING_FOR_FSM
        self.requests[req.request_id] = req
        self.waiting.add(req)
        self._new_to_worker.add(req.request_id)
        if self.async_scheduling and (
            needs_sync_step(req.sampling_params)
            or (
                self.structured is not None
                and req.status == RequestStatus.WAITING_FOR_FSM
                and self.structured.sync_only
            )
        ):
            self._sync_only.add(req.request_id)

    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled before the current one's tokens are known."""
        return self.async_scheduling and not self._sync_only

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Abort (or finish) requests wherever they are; unknown ids are ignored."""
        out = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free_request(req)
            out.append(req)
        return out

    def fail_requests(self, errors: dict[str, str]) -> list[EngineCoreOutput]:
        """Finish requests that failed (request id -> error message) with `FinishReason.ERROR`: only they
        end; their blocks are freed and the front end gets the message as the stop reason."""
        failed = self.finish_requests(errors, RequestStatus.FINISHED_ERROR)
        return [EngineCoreOutput(req.request_id, [], FinishReason.ERROR, errors[req.request_id]) for req in failed]

    def _free_request(self, req: Request) -> None:
        if req.mm_features and self.encoder is not None:
            self.encoder.release(req)
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        self.finished_req_ids.add(req.request_id)
        self._new_to_worker.discard(req.request_id)
        self._sync_only.discard(req.request_id)
        if self.structured is not None:
            self.structured.remove(req.request_id)
        self._grammar_errors.pop(req.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)
