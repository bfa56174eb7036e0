"""Executor interface: how the engine core reaches its worker(s)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_utils import KVCacheConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


class StepFuture:
    """A launched step's result: `result()` waits for it (once)."""

    def __init__(self, wait: Callable[[], ModelRunnerOutput]) -> None:
        self._wait = wait

    def result(self) -> ModelRunnerOutput:
        return self._wait()


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def determine_num_blocks(self) -> int: ...

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> KVCacheConfig: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepFuture:
        """Launch a step; `.result()` waits for it. Executors that cannot overlap run it now."""
        output = self.execute_model(scheduler_output)
        return StepFuture(lambda: output)

    def shutdown(self) -> None:  # noqa: B027 - optional hook, a no-op in-process
        """Release workers (nothing to do in-process)."""
