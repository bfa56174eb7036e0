"""Executors: how the engine core reaches its worker(s) (`abstract.py` is the interface)."""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.executor.abstract import Executor


def get_executor_class(config: EngineConfig) -> type[Executor]:
    """The executor for `config`'s parallel layout."""
    if config.parallel_config.tensor_parallel_size != 1:
        raise ValueError("tensor_parallel_size: only 1 is supported for now")
    from pagedllm.executor.uniproc_executor import UniProcExecutor

    return UniProcExecutor
