"""Continuous-batching scheduler: one token budget per step, chunked prefill, preemption by recompute.

Each step: running requests first (a decode token, or the next chunk of a prefill), then waiting ones
while budget, `max_num_seqs` and KV blocks allow, leaving free the blocks the running requests will need
soon (`core/admission.py`). When a running request needs a block and none is
free, the lowest-ranked running request (FCFS: latest arrival; priority: highest priority value, then
latest arrival) is preempted: its blocks are freed and it is recomputed later.
`num_computed_tokens` advances when a step is scheduled; the worker's sampled tokens come back through
`update_from_output`.

Requests come in and leave through `core/scheduler_requests.py` (`SchedulerRequestsMixin`), the step's
results come back through `core/scheduler_update.py` (`SchedulerUpdateMixin`); this module schedules the step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.config import SchedulerConfig
from pagedllm.core.admission import AdmissionReserve
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_utils import KVCacheGroup, make_block_hasher
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.request_queue import create_request_queue
from pagedllm.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.core.scheduler_requests import SchedulerRequestsMixin
from pagedllm.core.scheduler_update import SchedulerUpdateMixin
from pagedllm.multimodal.encoder_cache import EncoderCacheManager
from pagedllm.spec_decode.scheduling import SpecDecodeScheduling
from pagedllm.utils import cdiv

if TYPE_CHECKING:
    from pagedllm.structured_output.manager import StructuredOutputManager


class Scheduler(SchedulerRequestsMixin, SchedulerUpdateMixin):
    def __init__(
        self,
        config: SchedulerConfig,
        kv_groups: list[KVCacheGroup],
        num_blocks: int,
        enable_prefix_caching: bool,
    ) -> None:
        self.config = config
        self.max_model_len = config.max_model_len
        self.kv = KVCacheManager(kv_groups, num_blocks, config.max_model_len, enable_prefix_caching)
        self.block_size = self.kv.block_size
        self.block_hasher = make_block_hasher(self.block_size) if enable_prefix_caching else None
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(config.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self._new_to_worker: set[str] = set()
        """Requests the worker has never seen (or dropped): sent as NewRequestData."""
        self.num_preemptions = 0
        self.admission = AdmissionReserve(config.schedule_conservativeness, self.block_size)
        """The blocks admission leaves free for the running requests' growth (core/admission.py)."""
        self.num_busy = 0
        """Pipeline parallelism: running requests hidden from this schedule call (in a launched batch,
        `core/pipeline_scheduling.py`); they still count against max_num_seqs."""
        self.async_scheduling = config.async_scheduling
        self._sync_only: set[str] = set()
        """Requests whose sampling needs the previous token on the host (penalties, logprobs, ...): while
        any is known, steps run synchronously."""
        self._last_queries = 0
        self._last_hits = 0
        self.spec = (
            SpecDecodeScheduling(config.num_speculative_tokens, config.spec_disable_by_batch_size)
            if config.num_speculative_tokens
            else None
        )
        """Speculative decoding's bookkeeping (None: off; the plain path never looks further)."""
        self.lora_names: dict[int, str] = {}
        """LoRA id -> adapter name, for the stats (`pagedllm:lora_requests_info`)."""
        self.structured: StructuredOutputManager | None = None
        """Structured outputs (set by the engine core): grammars, matchers and the step's bitmask."""
        self._grammar_errors: dict[str, str] = {}
        """Requests whose grammar failed to compile -> the error (they fail at the next update)."""
        self.encoder: EncoderCacheManager | None = None
        """Multimodal: the worker's encoder cache as the scheduler tracks it (made at the first request with
        images; None keeps the plain path)."""

    # ---- one step ------------------------------------------------------------------------------
    def step_budget(self) -> int:
        """This step's token budget: max_num_batched_tokens, or `idle_max_num_batched_tokens` where it is set and
        no running request is decoding (every running request still has prompt tokens to compute, or none
        runs). The small budget bounds a decoding request's inter-token latency; without one, bigger chunks
        only make a long prompt's prefill cheaper. Under the packed GGUF model (the CPU default) it changes no
        token or logprob: its kernels give each row the same bits whatever chunk the row runs in (test
        `test_idle_budget_changes_no_logprob`; NOTES session 32)."""
        budget = self.config.max_num_batched_tokens
        idle = self.config.idle_max_num_batched_tokens
        if idle is None or idle <= budget:
            return budget
        for req in self.running:
            if req.num_computed_tokens >= req.num_prompt_tokens:
                return budget
        return idle

    def schedule(self) -> SchedulerOutput:
        budget = self.step_budget()
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted: set[str] = set()
        no_new_blocks = self.kv.no_new_blocks

        # 1. Running requests, in order. This loop runs for every running request every step: locals, no
        # property calls, and the KV manager is only asked when the request's tokens may need a block
        # (`kv_fast_limit`, NOTES H1: -0.25 ms per 256-decode step); block lists only for those requests.
        running = self.running
        max_model_len = self.max_model_len
        async_scheduling = self.async_scheduling
        allocate_slots = self.kv.allocate_slots
        sched_ids = cached.req_ids
        sched_ids_append = sched_ids.append
        computed_append = cached.num_computed_tokens.append
        block_updates: list[tuple[int, tuple[list[int], ...]]] = []
        spec = self.spec
        spec_tokens: dict[str, list[int]] = {}
        spec_async = spec is not None and async_scheduling
        if spec_async:
            assert spec is not None
            spec.async_mode = True
            limit = spec.disable_by_batch_size
            spec_propose = limit is None or len(running) <= limit
        reserve = 0
        enc = self.encoder
        enc_inputs: dict[str, list[int]] = {}
        if enc is not None:
            enc.begin_step()
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            pending = req.num_output_placeholders
            target = len(req.all_token_ids) + pending
            # With a token in flight, target >= stop_len means its last token is already in flight (stop_len
            # is min(prompt + max_tokens, max_model_len)); an in-flight verification may have emitted up to its
            # proposals more (`spec_in_flight`, 0 without speculation): the request waits for that result.
            if pending and target + req.spec_in_flight >= req.stop_len:
                i += 1
                continue
            computed = req.num_computed_tokens
            num_new = target - computed  # clipped by the budget and max_model_len (no min(): per request)
            if num_new > budget:
                num_new = budget
            if num_new > max_model_len - computed:
                num_new = max_model_len - computed
            if num_new <= 0:
                i += 1
                continue
            if spec_async:
                num_new, reserve = spec.add_placeholders(  # type: ignore[union-attr]
                    req, computed, num_new, target, budget, max_model_len, spec_tokens, spec_propose
                )
            elif spec is not None and req.spec_token_ids:
                num_new = spec.add_drafts(req, computed, num_new, target, budget, max_model_len, spec_tokens)
            to_encode = None
            if enc is not None and req.mm_features and computed < req.num_prompt_tokens:
                num_new, to_encode = enc.plan(req, computed, num_new)
                if num_new <= 0:
                    i += 1
                    continue
            if computed + num_new + reserve > req.kv_fast_limit:
                while True:
                    blocks = allocate_slots(req, num_new + reserve)
                    if blocks is not None:
                        break
                    victim = self._pick_victim(i)
                    self._preempt(victim)
                    preempted.add(victim.request_id)
                    if victim is req:
                        break
                if blocks is None:
                    if spec_tokens:
                        spec_tokens.pop(req.request_id, None)
                    continue  # req itself was preempted; self.running shrank, i stays
                if blocks is not no_new_blocks:  # the common decode: nothing to convert
                    ids = blocks.get_block_ids()
                    if any(ids):
                        block_updates.append((len(sched_ids), ids))
            # Victims only come from the not-yet-scheduled tail, so this request stays scheduled: record it for
            # the worker now ("cached": the worker already holds its state).
            rid = req.request_id
            if to_encode is not None:
                self._commit_encoder(req, computed, num_new, to_encode, enc_inputs)
            num_scheduled[rid] = num_new
            sched_ids_append(rid)
            computed_append(computed)
            computed += num_new
            if spec_async and rid in spec_tokens:  # a verification counts one token until its result is read
                computed -= len(spec_tokens[rid])
            req.num_computed_tokens = computed
            if async_scheduling and computed >= target:
                req.num_output_placeholders = pending + 1  # this step samples a token nobody has seen yet
            budget -= num_new
            i += 1
        n_running = len(sched_ids)
        cached.resumed_from_preemption = [False] * n_running
        new_block_ids: list[tuple[list[int], ...] | None] = [None] * n_running
        for pos, ids in block_updates:
            new_block_ids[pos] = ids
        cached.new_block_ids = new_block_ids

        # 2. Waiting requests (not in a step that had to preempt).
        if not preempted:
            # LoRA: at most max_loras distinct adapters per step; requests on another one wait (skipped).
            max_loras = self.config.max_loras
            loras = {r.lora_id for r in self.running if r.lora_id is not None} if max_loras else set()
            skipped: list[Request] = []
            max_seqs = self.config.max_num_seqs - self.num_busy
            free_blocks = self.kv.pool.num_free_blocks
            # (No reserve needed where even max_seqs requests of max_model_len tokens fit in the free blocks.)
            admission = (
                self.admission
                if self.admission.enabled
                and len(self.waiting)
                and free_blocks < self.config.max_num_seqs * cdiv(self.max_model_len, self.block_size)
                else None
            )
            reserve = admission.blocks(self.running) if admission is not None else 0
            while len(self.waiting) and budget > 0 and len(self.running) < max_seqs:
                req = self.waiting.peek()
                if req.status == RequestStatus.WAITING_FOR_FSM and not self.structured.ready(  # type: ignore[union-attr]
                    req, self._grammar_errors
                ):
                    skipped.append(self.waiting.pop())  # never holds the requests behind it
                    continue
                if max_loras and req.lora_id is not None and req.lora_id not in loras:
                    if len(loras) >= max_loras:
                        skipped.append(self.waiting.pop())
                        continue
                    loras.add(req.lora_id)
                # Prompt logprobs need logits at every prompt position: no prefix-cache hits for them.
                use_cache = req.sampling_params.prompt_logprobs is None or req.num_output_tokens > 0
                hit_blocks, num_hit = self.kv.get_computed_blocks(req, use_cache=use_cache)
                num_new = req.num_tokens - num_hit
                if not self.config.enable_chunked_prefill and num_new > budget:
                    break
                num_new = min(num_new, budget)
                to_encode = None
                if enc is not None and req.mm_features:
                    planned, to_encode = enc.plan(req, num_hit, num_new)
                    if planned <= 0 or (planned < num_new and not self.config.enable_chunked_prefill):
                        break
                    num_new = planned
                if admission is not None:
                    bs = self.block_size
                    if free_blocks - (cdiv(num_hit + num_new, bs) - num_hit // bs) < reserve:
                        break  # the running requests' growth needs the room: admitting would end in a preemption
                blocks = self.kv.allocate_slots(req, num_new, num_hit, hit_blocks)
                if blocks is None:
                    break
                self.waiting.pop()
                self.kv.record_lookup(req, num_hit)
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit
                resumed = req.status == RequestStatus.PREEMPTED
                req.status = RequestStatus.RUNNING
                req.num_computed_tokens = num_hit
                self.running.append(req)
                if to_encode is not None:
                    self._commit_encoder(req, num_hit, num_new, to_encode, enc_inputs)
                num_scheduled[req.request_id] = num_new
                budget -= num_new
                if req.request_id in self._new_to_worker:
                    self._new_to_worker.discard(req.request_id)
                    new_reqs.append(
                        NewRequestData(
                            req.request_id,
                            req.prompt_token_ids,
                            list(req.output_token_ids),
                            req.sampling_params,
                            self.kv.get_block_ids(req.request_id),
                            num_hit,
                            req.lora_id,
                            req.pooling_params,
                            req.mm_features or None,
                        )
                    )
                else:
                    assert resumed
                    cached.req_ids.append(req.request_id)
                    cached.resumed_from_preemption.append(True)
                    cached.new_block_ids.append(self.kv.get_block_ids(req.request_id))
                    cached.num_computed_tokens.append(num_hit)
                req.num_computed_tokens += num_new
                if self.async_scheduling and req.num_computed_tokens >= req.num_tokens:
                    req.num_output_placeholders += 1
                if admission is not None:  # the admitted request's own growth joins the reserve
                    free_blocks = self.kv.pool.num_free_blocks
                    reserve += admission.blocks((req,))
            for req in reversed(skipped):
                self.waiting.prepend(req)

        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            scheduled_spec_decode_tokens=spec_tokens,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted,
        )
        if enc is not None:
            out.scheduled_encoder_inputs = enc_inputs
            out.free_encoder_hashes = enc.take_freed()
        self.finished_req_ids = set()
        if self.structured is not None and self.structured.states:
            self.structured.prepare(out, self.requests)
            if not num_scheduled and not self._grammar_errors:
                self.structured.wait_pending(0.05)  # only grammars to wait for: no busy step loop
        return out

    def _commit_encoder(
        self, req: Request, computed: int, num_new: int, to_encode: list[int], enc_inputs: dict[str, list[int]]
    ) -> None:
        assert self.encoder is not None
        self.encoder.commit(req, computed, num_new, to_encode)
        if to_encode:
            enc_inputs[req.request_id] = to_encode

    def _pick_victim(self, current: int) -> Request:
        """Only requests not yet scheduled this step (index >= current) are candidates, so a victim
        never leaves behind prefix-cache blocks registered for KV that was not computed."""
        if self.config.policy == "priority":
            return max(self.running[current:], key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, req: Request) -> None:
        if req.mm_features and self.encoder is not None:
            self.encoder.release(req)
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(req)

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()
