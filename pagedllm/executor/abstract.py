"""Executor interface: how the engine core reaches its worker(s)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_utils import KVCacheConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


class StepFuture:
    """A launched step's result: `result()` waits for it (once). `complete_launch()`: launch what the step
    left for later (its sampling, when a grammar mask's fill was still running; a no-op otherwise)."""

    def __init__(self, wait: Callable[[], ModelRunnerOutput], complete: Callable[[], None] | None = None) -> None:
        self._wait = wait
        self._complete = complete

    def result(self) -> ModelRunnerOutput:
        return self._wait()

    def complete_launch(self) -> None:
        if self._complete is not None:
            self._complete()


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

    @abstractmethod
    def collective_rpc(
        self, method: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Run a worker method (name, or callable taking the worker first) on every worker; their results."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook, a no-op in-process
        """Release workers (nothing to do in-process)."""
