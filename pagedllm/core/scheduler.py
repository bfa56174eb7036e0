"""Continuous-batching scheduler: one token budget per step, chunked prefill, preemption by recompute.

Each step: running requests first (a decode token, or the next chunk of a prefill), then waiting ones
while budget, `max_num_seqs` and KV blocks allow. When a running request needs a block and none is
free, the lowest-ranked running request (FCFS: latest arrival; priority: highest priority value, then
latest arrival) is preempted: its blocks are freed and it is recomputed later.
`num_computed_tokens` advances when a step is scheduled; the worker's sampled tokens come back through
`update_from_output`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_utils import KVCacheGroup, make_block_hasher
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.request_queue import create_request_queue
from pagedllm.core.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedllm.core.stop import append_until_stop, check_stop
from pagedllm.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason, SchedulerStats
from pagedllm.multimodal.encoder_cache import EncoderCacheManager
from pagedllm.pooling_params import PooledData
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.scheduling import SpecDecodeScheduling

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


class Scheduler:
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

    # ---- results back --------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> EngineCoreOutputs:
        """The step's sampled tokens join their requests; stopped requests finish and free their blocks."""
        failed = {**self._grammar_errors, **result.failed} if self._grammar_errors else result.failed
        outputs: list[EngineCoreOutput] = self.fail_requests(failed) if failed else []
        outputs_append = outputs.append
        # Locals for the per-request loop (it runs for every running request, every step).
        get_request = self.requests.get
        running_status = RequestStatus.RUNNING
        logprobs = result.logprobs
        prompt_logprobs = result.prompt_logprobs
        max_model_len = self.max_model_len
        if result.pooler_output:
            self._finish_pooled(result.pooler_output, outputs)
        if self.spec is not None:
            self.spec.update(self.requests, sched, result)
        grammars = self.structured.states if self.structured is not None and self.structured.states else None
        if grammars is not None:
            self.structured.begin_update(sched, result)  # type: ignore[union-attr]
        taking = self.structured.taking() if grammars is not None else frozenset()  # type: ignore[union-attr]
        rejected: dict[str, str] = {}
        for idx, (rid, tokens) in enumerate(zip(result.req_ids, result.sampled_token_ids)):
            req = get_request(rid)
            if req is None or not tokens:
                continue  # finished/aborted meanwhile, or a partial prefill chunk
            pending = req.num_output_placeholders
            if pending:  # one step's tokens (one, or a verification's accepted proposals and one more)
                req.num_output_placeholders = pending - 1
            status = req.status
            if status != running_status and (status != RequestStatus.PREEMPTED or not self.async_scheduling):
                continue
            # (Async scheduling) a request preempted while its token was in flight keeps it (it was sampled,
            # and a seeded request must not sample it again), then waits to recompute as usual.
            if len(tokens) == 1:  # one sampled token (every decode): inline, no list building (NOTES H1/H10)
                new_tokens, tok = tokens, tokens[0]
                n = req.append_output_token(tok)
                stopped = (n >= req.stop_len or tok in req.stop_token_set) and check_stop(req, tok, max_model_len)
            else:
                new_tokens, stopped = append_until_stop(req, tokens, max_model_len)
            if grammars is not None and not stopped and (st := grammars.get(rid)) is not None:
                # Only a request whose grammar has news goes to `advance` (the first one of a step publishes the
                # worker's intake): terminated, a rejected token, or tokens not taken yet, unless the worker is
                # taking this one token and it is not a stop token (see `taking`).
                unseen = len(req.output_token_ids) - st.num_seen
                if (
                    st.terminated
                    or st.error
                    or (
                        unseen > 0
                        and not (
                            unseen == 1
                            and len(new_tokens) == 1
                            and id(st) in taking
                            and new_tokens[0] not in st.stop_ids
                        )
                    )
                ):
                    stopped = self.structured.advance(req, new_tokens, rejected)  # type: ignore[union-attr]
            finish_reason = None
            if stopped:
                finish_reason = req.status.finish_reason
                if status == running_status:
                    self.running.remove(req)
                else:
                    self.waiting.remove(req)
                self._free_request(req)
            lps = logprobs[idx] if logprobs is not None else None
            if lps is not None and len(lps) > len(new_tokens):
                lps = lps.slice(0, len(new_tokens))
            outputs_append(
                EngineCoreOutput(
                    rid,
                    new_tokens,
                    finish_reason,
                    req.stop_reason,
                    req.num_cached_tokens if req.num_cached_tokens > 0 else 0,
                    lps,
                    prompt_logprobs.get(rid) if prompt_logprobs else None,
                )
            )
        if rejected:
            outputs.extend(self.fail_requests(rejected))
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.make_stats(), timestamp=time.monotonic())

    def _finish_pooled(self, pooled: dict[str, PooledData], outputs: list[EngineCoreOutput]) -> None:
        """Pooling requests are prefill only: done (blocks freed at once) when their pooled result is in."""
        for rid, data in pooled.items():
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted meanwhile
            self.running.remove(req)
            req.status = RequestStatus.FINISHED_STOPPED
            self._free_request(req)
            outputs.append(EngineCoreOutput(rid, [], FinishReason.STOP, pooling_output=data))

    def make_stats(self) -> SchedulerStats:
        q, h = self.kv.prefix_cache_queries, self.kv.prefix_cache_hits
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=q - self._last_queries,
            prefix_cache_hits=h - self._last_hits,
            num_preemptions=self.num_preemptions,
            kv_blocks=self.kv.pool.snapshot_counts(),
            spec_decoding_stats=self.spec.take_stats() if self.spec is not None else None,
        )
        if self.config.max_loras:
            stats.waiting_lora_adapters = self._lora_counts(self.waiting)
            stats.running_lora_adapters = self._lora_counts(self.running)
        self._last_queries, self._last_hits = q, h
        return stats

    def _lora_counts(self, reqs: Iterable[Request]) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in reqs:
            if r.lora_id is not None:
                name = self.lora_names.get(r.lora_id, str(r.lora_id))
                counts[name] = counts.get(name, 0) + 1
        return counts

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()
