"""The scheduler's side of a step's results, mixed into `Scheduler`: the sampled tokens join their requests
(stop checks, speculative decoding's accepted tokens, grammars advanced), finished and pooled requests free
their blocks, and the step's `SchedulerStats`. Apart from `core/scheduler.py` so that the step's scheduling
reads on its own; requests come in and leave through `core/scheduler_requests.py`."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.request_queue import FCFSQueue, PriorityQueue
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.stop import append_until_stop, check_stop
from pagedllm.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats
from pagedllm.pooling_params import PooledData
from pagedllm.spec_decode.scheduling import SpecDecodeScheduling

if TYPE_CHECKING:
    from pagedllm.structured_output.manager import StructuredOutputManager


class SchedulerUpdateMixin:
    """Needs the `Scheduler` state below (set by `Scheduler.__init__`) and `SchedulerRequestsMixin`'s
    `fail_requests` and `_free_request`."""

    config: SchedulerConfig
    max_model_len: int
    kv: KVCacheManager
    requests: dict[str, Request]
    waiting: FCFSQueue | PriorityQueue
    running: list[Request]
    async_scheduling: bool
    num_preemptions: int
    _last_queries: int
    _last_hits: int
    spec: SpecDecodeScheduling | None
    lora_names: dict[int, str]
    structured: StructuredOutputManager | None
    _grammar_errors: dict[str, str]
    fail_requests: Callable[[dict[str, str]], list[EngineCoreOutput]]
    _free_request: Callable[[Request], None]

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
