"""Executor interface: how the engine core reaches its worker(s)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_utils import KVCacheConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


class StepResult(Protocol):
    def result(self) -> ModelRunnerOutput: ...


class _Done:
    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output

    def result(self) -> ModelRunnerOutput:
        return self.output


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def determine_num_blocks(self) -> int: ...

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> KVCacheConfig: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepResult:
        """Launch a step; `.result()` waits for it. Executors that cannot overlap run it now."""
        return _Done(self.execute_model(scheduler_output))

    @abstractmethod
    def collective_rpc(
        self, method: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Run a worker method (name, or callable taking the worker first) on every worker; their results."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook, a no-op in-process
        """Release workers (nothing to do in-process)."""

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        if config.parallel_config.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size: only 1 is supported for now")
        from pagedllm.executor.uniproc_executor import UniProcExecutor

        return UniProcExecutor
