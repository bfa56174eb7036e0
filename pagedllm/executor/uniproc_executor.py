"""Single worker in the engine core's own process."""

from __future__ import annotations

from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_utils import KVCacheConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.abstract import Executor, StepFuture
from pagedllm.sample.logits_processor import LogitsProcessor
from pagedllm.worker.controls import run_worker_method
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, logits_processors: list[LogitsProcessor] | None = None) -> None:
        super().__init__(config)
        self.worker = Worker(config, logits_processors)
        self.worker.load_model()

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> KVCacheConfig:
        return self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def collective_rpc(
        self, method: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        self.worker.complete_launch()  # a deferred sampling goes first: the method may change the batch
        return [run_worker_method(self.worker, method, args, kwargs)]

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepFuture:
        worker = self.worker
        step = worker.execute_model_async(scheduler_output, defer_grammar=True)
        return StepFuture(lambda: worker.finish_step(step), worker.complete_launch)
