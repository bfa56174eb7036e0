"""Engine-core controls (mixed into `EngineCore`): sleep levels, wake-up tags, collective RPC to the
workers, weight updates and profiling. All plain-data in and out, so the same calls work in-process
(`LLM`) and as utility calls to a core in its own process (`AsyncLLM`, the HTTP server).

Sleep levels (vLLM's): 0 pauses scheduling (requests are still accepted and wait); 1 offloads the weights
to host memory and discards the KV cache; 2 discards both. `wake_up(tags)` wakes "weights", "kv_cache"
and/or "scheduling" (all when None).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedllm.logger import init_logger
from pagedllm.messages import EngineCoreOutputs

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.core.scheduler_output import SchedulerOutput
    from pagedllm.executor.abstract import Executor, StepFuture

logger = init_logger(__name__)

WAKE_TAGS = ("weights", "kv_cache", "scheduling")


class EngineSleepingError(RuntimeError):
    """A request reached an engine whose weights or KV cache are asleep."""


class EngineCoreControlsMixin:
    """Needs `self.config`, `self.executor`, `self.scheduler` (and `self._pending` for async scheduling)."""

    config: EngineConfig
    executor: Executor
    scheduler: Scheduler
    _pending: tuple[SchedulerOutput, StepFuture] | None = None

    _asleep: frozenset[str] = frozenset()
    _sleep_level: int = -1

    # ---- sleep -------------------------------------------------------------------------------------------
    @property
    def scheduling_paused(self) -> bool:
        return "scheduling" in self._asleep

    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    def sleep(self, level: int = 1) -> None:
        if not self.config.extra.get("enable_sleep_mode"):
            raise ValueError("sleep: sleep mode is not enabled; start the engine with enable_sleep_mode=True")
        if level not in (0, 1, 2):
            raise ValueError(f"sleep: level must be 0, 1 or 2, got {level!r}")
        if level == 0:
            self._asleep = self._asleep | {"scheduling"}
            self._sleep_level = max(self._sleep_level, 0)
            return
        if self.has_unfinished_requests():  # type: ignore[attr-defined]
            raise ValueError(
                f"sleep: level {level} discards the KV cache, but {self.scheduler.get_num_unfinished_requests()} "
                "request(s) are unfinished; let them finish or abort them first (level 0 only pauses)"
            )
        if self._asleep & {"weights", "kv_cache"}:
            raise ValueError("sleep: already asleep; call wake_up first")
        t0 = time.perf_counter()
        self.collective_rpc("sleep", args=(level,))
        self.scheduler.reset_prefix_cache()
        self._asleep = self._asleep | {"weights", "kv_cache"}
        self._sleep_level = level
        logger.info("Engine asleep (level %d) in %.2f s", level, time.perf_counter() - t0)

    def wake_up(self, tags: list[str] | None = None) -> None:
        tags = list(WAKE_TAGS) if tags is None else list(tags)
        bad = [t for t in tags if t not in WAKE_TAGS]
        if bad:
            raise ValueError(f"wake_up: unknown tag(s) {bad}; expected any of {', '.join(WAKE_TAGS)}")
        t0 = time.perf_counter()
        device_tags = [t for t in tags if t in self._asleep and t != "scheduling"]
        if device_tags:
            self.collective_rpc("wake_up", args=(device_tags,))
        if "kv_cache" in device_tags:
            self.scheduler.reset_prefix_cache()
        self._asleep = self._asleep - set(tags)
        if not self._asleep:
            self._sleep_level = -1
        logger.info("Woke up %s in %.2f s", ", ".join(tags), time.perf_counter() - t0)

    def check_can_run(self) -> None:
        """Raised on requests while weights or KV cache are asleep (level >= 1)."""
        asleep = self._asleep & {"weights", "kv_cache"}
        if asleep:
            raise EngineSleepingError(
                f"The engine is sleeping (level {self._sleep_level}: {' and '.join(sorted(asleep))} released); "
                "call wake_up() before generating"
            )

    def paused_step(self) -> EngineCoreOutputs:
        """A step while scheduling is paused: only finishes a step already launched (async scheduling)."""
        pending = getattr(self, "_pending", None)
        if pending is not None:
            self._pending = None
            so, handle = pending
            return self.scheduler.update_from_output(so, handle.result())
        return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats(), timestamp=time.monotonic())

    # ---- workers -----------------------------------------------------------------------------------------
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """`method` (a worker method name, or a callable taking the worker first) run on every worker."""
        return self.executor.collective_rpc(method, tuple(args), kwargs or {})

    # ---- weight updates ------------------------------------------------------------------------------
    def init_weight_transfer_engine(self, request: dict[str, Any]) -> None:
        init_info = request.get("init_info", request) if isinstance(request, dict) else None
        if not isinstance(init_info, dict):
            raise ValueError("init_weight_transfer_engine: expected {'init_info': {...}}")
        self.collective_rpc("init_weight_transfer_engine", args=(init_info,))

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        self.collective_rpc("start_weight_update", args=(is_checkpoint_format,))

    def update_weights(self, request: dict[str, Any]) -> None:
        update_info = request.get("update_info") if isinstance(request, dict) else None
        if not isinstance(update_info, dict):
            raise ValueError("update_weights: expected {'update_info': {...}}")
        if self.has_unfinished_requests():  # type: ignore[attr-defined]
            raise ValueError("update_weights: requests are unfinished; let them finish or abort them first")
        self.collective_rpc("update_weights", args=(update_info,))
        self.scheduler.reset_prefix_cache()  # cached KV was computed with the old weights

    def finish_weight_update(self) -> None:
        self.collective_rpc("finish_weight_update")
        self.scheduler.reset_prefix_cache()

    # ---- profiling -----------------------------------------------------------------------------------
    def start_profile(self) -> None:
        self.collective_rpc("start_profile")

    def stop_profile(self) -> list[str]:
        """Returns the trace files written (one per worker)."""
        return self.collective_rpc("stop_profile")


class AsyncLLMControlsMixin:
    """The same controls on `AsyncLLM`, as utility calls to the core process (string method names only for
    collective_rpc: a callable cannot cross the process boundary)."""

    engine_core: Any
    _released: frozenset[str] = frozenset()
    """What the front end knows is asleep on the device (requests are refused meanwhile)."""

    async def sleep(self, level: int = 1) -> None:
        await self.engine_core.call_utility("sleep", level)
        if level >= 1:
            self._released = frozenset({"weights", "kv_cache"})

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.engine_core.call_utility("wake_up", tags)
        self._released = self._released - set(WAKE_TAGS if tags is None else tags)

    async def is_sleeping(self) -> bool:
        return bool(await self.engine_core.call_utility("is_sleeping"))

    def check_can_run(self) -> None:
        if self._released:
            raise EngineSleepingError(
                f"The engine is sleeping ({' and '.join(sorted(self._released))} released); call /wake_up first"
            )

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        if not isinstance(method, str):
            raise ValueError("collective_rpc: only worker method names can be sent to the engine-core process")
        return await self.engine_core.call_utility("collective_rpc", method, timeout, list(args), kwargs)

    async def init_weight_transfer_engine(self, request: dict[str, Any]) -> None:
        await self.engine_core.call_utility("init_weight_transfer_engine", request)

    async def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        await self.engine_core.call_utility("start_weight_update", is_checkpoint_format)

    async def update_weights(self, request: dict[str, Any]) -> None:
        await self.engine_core.call_utility("update_weights", request)

    async def finish_weight_update(self) -> None:
        await self.engine_core.call_utility("finish_weight_update")

    async def start_profile(self) -> None:
        await self.engine_core.call_utility("start_profile")

    async def stop_profile(self) -> list[str]:
        return await self.engine_core.call_utility("stop_profile")
