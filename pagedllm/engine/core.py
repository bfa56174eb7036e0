"""The engine core: scheduler + executor. Takes EngineCoreRequests, returns EngineCoreOutputs per step.

Plain data in and out, so it runs the same in-process (LLM) or in its own process (AsyncLLM).
"""

from __future__ import annotations

import gc
import time

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.engine.batch_queue import BatchQueue
from pagedllm.engine.controls import EngineCoreControlsMixin
from pagedllm.engine.step_trace import StepTrace
from pagedllm.executor import get_executor_class
from pagedllm.executor.abstract import StepFuture
from pagedllm.logger import init_logger
from pagedllm.messages import EngineCoreOutputs, EngineCoreRequest
from pagedllm.sample.logits_processor import LogitsProcessor
from pagedllm.utils import cdiv

logger = init_logger(__name__)


class EngineCore(EngineCoreControlsMixin):
    def __init__(self, config: EngineConfig, logits_processors: list[LogitsProcessor] | None = None) -> None:
        t0 = time.perf_counter()
        self.config = config
        executor_cls = get_executor_class(config)
        self.executor = executor_cls(config, logits_processors)  # type: ignore[call-arg]
        try:
            self._init_after_executor(config, logits_processors, t0)
        except BaseException:
            self.executor.shutdown()  # (worker processes must not outlive a failed start)
            raise

    def _init_after_executor(
        self, config: EngineConfig, logits_processors: list[LogitsProcessor] | None, t0: float
    ) -> None:
        num_blocks = self.executor.determine_num_blocks()
        cc = config.cache_config
        max_len = config.model_config.max_model_len
        needed = cdiv(max_len, cc.block_size) + 1  # + the null block
        if num_blocks < needed:
            raise ValueError(
                f"The KV cache holds {num_blocks} blocks of {cc.block_size} tokens, fewer than the {needed} "
                f"needed for one sequence of max_model_len={max_len}. Give the KV cache more memory "
                "(kv_cache_memory_bytes / gpu_memory_utilization / num_gpu_blocks_override) or lower max_model_len."
            )
        kv_config = self.executor.initialize_kv_cache(num_blocks)
        cc.num_blocks = num_blocks
        self.scheduler = Scheduler(config.scheduler_config, kv_config.groups, num_blocks, cc.enable_prefix_caching)
        self.step_trace: StepTrace | None = None
        if envs.PAGEDLLM_STEP_TRACE:  # latency-tail analysis, see engine/step_trace.py
            pc = config.parallel_config  # data-parallel cores: one file each
            dp = f".dp{pc.data_parallel_rank}" if pc.data_parallel_size > 1 else ""
            self.step_trace = StepTrace(envs.PAGEDLLM_STEP_TRACE + dp)
            self.step_trace.install(self.scheduler, self.executor)
        # Engine-wide logits processors may read the previous tokens on the host: no scheduling ahead.
        self.async_scheduling = config.scheduler_config.async_scheduling and not logits_processors
        self.scheduler.async_scheduling = self.async_scheduling
        self._pending: tuple[SchedulerOutput, StepFuture] | None = None
        """Async scheduling: the launched step whose results are not read yet."""
        self.num_steps_ahead = 0
        """Steps launched before the previous step's results were read (async scheduling at work)."""
        self.batch_queue: BatchQueue | None = None
        """Pipeline parallelism: up to pp batches in flight (`engine/batch_queue.py`); None: one stage."""
        pp = config.parallel_config.pipeline_parallel_size
        if pp > 1:
            max_batches = envs.PAGEDLLM_MAX_CONCURRENT_BATCHES or pp
            self.batch_queue = BatchQueue(self.scheduler, self.executor, max_batches)
        self.lora = None
        if config.lora_config is not None:  # adapters are read off the step loop, see lora/staging.py
            from pagedllm.lora.staging import LoRAStaging

            self.lora = LoRAStaging(config, self.executor.collective_rpc)
        if config.model_config.runner_type != "pooling" and not config.model_config.skip_tokenizer_init:
            from pagedllm.structured_output.engine import make_structured_output_manager

            self.scheduler.structured = make_structured_output_manager(config)
            if envs.PAGEDLLM_STRUCTURED_WARMUP:
                self.scheduler.structured.warm_up()
        # The start-up objects (one Python object per KV block, the model's modules) live as long as the
        # engine: move them out of the cyclic GC's generations, which otherwise walks them all in every full
        # collection (measured: 3.65 -> 3.14 ms host time per step at 256 decodes, benchmarks/host_overhead.py).
        gc.collect()
        gc.freeze()
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%d layer group(s)); engine ready in %.2f s",
            num_blocks - 1,
            cc.block_size,
            (num_blocks - 1) * cc.block_size,
            len(kv_config.groups),
            time.perf_counter() - t0,
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        self.check_can_run()  # controls: not while asleep (level >= 1)
        if request.lora_request is not None:
            if self.lora is None:
                raise ValueError("lora_request: LoRA is not enabled (enable_lora=True)")
            if not self.lora.admit(request):
                return  # parked until its adapter is read
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if self.lora is not None:
            self.lora.drop(request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> EngineCoreOutputs:
        if self.lora is None or not self.lora.busy():
            return self._step()
        sched = self.scheduler
        idle = not sched.has_unfinished_requests() and self._pending is None
        in_use = {r.lora_id for r in sched.requests.values() if r.lora_id is not None}
        failed = self.lora.poll(sched.add_request, idle, in_use)
        out = self._step()
        if failed:
            out.outputs = [*out.outputs, *failed]
        return out

    def _step(self) -> EngineCoreOutputs:
        if self.scheduling_paused:  # controls: sleep(level=0)
            if self.batch_queue is not None and self.batch_queue.queue:
                return self.batch_queue.collect_oldest()
            return self.paused_step()
        if self.batch_queue is not None:
            return self.batch_queue.step()
        if self.async_scheduling:
            return self._step_async()
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats(), timestamp=time.monotonic())
        sched = self.scheduler.schedule()
        result = self.executor.execute_model(sched)
        return self.scheduler.update_from_output(sched, result)

    def _step_async(self) -> EngineCoreOutputs:
        """Async scheduling: while step N runs on the device, schedule and launch step N+1 (its decodes
        take N's tokens on the device), then read N's results. Host work thus overlaps device work; a
        request that stops at N has had one more step computed, whose token is dropped. Steps whose
        requests need their previous token on the host run synchronously."""
        sched_ = self.scheduler
        pending = self._pending
        if pending is None:
            if not sched_.has_unfinished_requests():
                return EngineCoreOutputs(scheduler_stats=sched_.make_stats(), timestamp=time.monotonic())
            so = sched_.schedule()
            if not sched_.can_schedule_ahead():
                return sched_.update_from_output(so, self.executor.execute_model(so))
            pending = (so, self.executor.execute_model_async(so))
        nxt = None
        if sched_.can_schedule_ahead() and sched_.has_unfinished_requests():
            so_next = sched_.schedule()
            if so_next.grammar_bitmask is not None and sched_.structured is not None:
                # Its grammar bitmask needs this step's tokens: the fill waits for them (after the launch).
                pending = (pending[0], sched_.structured.chain(so_next, pending[1]))
            nxt = (so_next, self.executor.execute_model_async(so_next))
            self.num_steps_ahead += 1
        so, handle = pending
        self._pending = nxt
        out = sched_.update_from_output(so, handle.result())
        if nxt is not None:  # its sampling, deferred while N+1's mask was filled: before the outputs go out
            nxt[1].complete_launch()
        return out

    def has_unfinished_requests(self) -> bool:
        parked = self.lora is not None and self.lora.has_parked()
        bq = self.batch_queue is not None and bool(self.batch_queue.queue)
        return self.scheduler.has_unfinished_requests() or self._pending is not None or parked or bq

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        if self.step_trace is not None:
            self.step_trace.flush()
        if self.lora is not None:
            self.lora.shutdown()
        if self.scheduler.structured is not None:
            self.scheduler.structured.shutdown()
        self.executor.shutdown()
