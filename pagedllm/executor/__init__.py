"""Executors: how the engine core reaches its worker(s) (`abstract.py` is the interface)."""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.executor.abstract import Executor


def get_executor_class(config: EngineConfig) -> type[Executor]:
    """The executor for `config`'s parallel layout: in-process for one device unless 'mp' is asked for."""
    backend = config.parallel_config.backend
    if backend == "mp":
        from pagedllm.executor.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor
    if backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor

        return RayExecutor
    if backend != "uni":
        raise ValueError(f"distributed_executor_backend: unknown backend {backend!r}")
    from pagedllm.executor.uniproc_executor import UniProcExecutor

    return UniProcExecutor
