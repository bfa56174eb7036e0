"""Per-worker controls reached through `collective_rpc`: sleep / wake-up, weight updates, profiling.

`run_worker_method(worker, method, args, kwargs)` is what every executor calls for `collective_rpc`: a
callable gets the worker as first argument (vLLM's convention); a name is looked up on the worker, then on
its `WorkerControls` (created on first use).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

from pagedllm import envs
from pagedllm.logger import init_logger

logger = init_logger(__name__)


class WorkerControls:
    def __init__(self, worker: Any) -> None:
        from pagedllm.worker.sleep import WorkerSleeper

        self.worker = worker
        self.runner = worker.model_runner
        self.sleeper = WorkerSleeper(self.runner)
        self.transfer: Any = None
        self._meta_model: torch.nn.Module | None = None
        self._checkpoint_format = True
        self._profiler: Any = None

    # ---- sleep -----------------------------------------------------------------------------------------
    def sleep(self, level: int) -> int:
        return self.sleeper.sleep(level)

    def wake_up(self, tags: list[str]) -> None:
        self.sleeper.wake_up(tags)

    # ---- weight updates --------------------------------------------------------------------------------
    def _transfer_engine(self) -> Any:
        if self.transfer is None:
            from pagedllm.distributed.parallel_state import get_tensor_model_parallel_rank
            from pagedllm.distributed.weight_transfer import create_weight_transfer_engine

            cfg = self.worker.config.extra.get("weight_transfer_config")
            self.transfer = create_weight_transfer_engine(cfg, self.runner.device, get_tensor_model_parallel_rank())
        return self.transfer

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._transfer_engine().init_transfer_engine(init_info)

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        self._checkpoint_format = bool(is_checkpoint_format)

    def _meta(self) -> torch.nn.Module:
        if self._meta_model is None:
            from pagedllm.model_executor.model_loader.loader import build_model

            mc = self.runner.model_config
            self._meta_model = build_model(mc.hf_config, mc.dtype, "meta")
        return self._meta_model

    def update_weights(self, update_info: dict[str, Any]) -> int:
        """Receive one update through the configured backend and apply it atomically; returns the number of
        parameters written."""
        from pagedllm.distributed.weight_transfer.apply import apply_weight_update

        if self.sleeper.weights_level:
            raise ValueError("update_weights: the weights are asleep; call wake_up(tags=['weights']) first")
        t0 = time.perf_counter()
        weights = self._transfer_engine().receive_weights(update_info)
        t1 = time.perf_counter()
        n = apply_weight_update(self.runner.model, self._meta(), weights, self._checkpoint_format)
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        logger.info(
            "Weight update: %d tensors -> %d parameters (receive %.2f s, apply %.2f s)",
            len(weights),
            n,
            t1 - t0,
            time.perf_counter() - t1,
        )
        return n

    def finish_weight_update(self) -> None:
        self._checkpoint_format = True

    # ---- profiling -------------------------------------------------------------------------------------
    def _profiler_dir(self) -> str:
        cfg = self.worker.config.extra.get("profiler_config") or {}
        d = cfg.get("torch_profiler_dir") or envs.PAGEDLLM_TORCH_PROFILER_DIR
        if not d:
            raise ValueError(
                "start_profile: no trace directory; pass profiler_config={'profiler': 'torch', "
                "'torch_profiler_dir': DIR} (--profiler-config) or set PAGEDLLM_TORCH_PROFILER_DIR"
            )
        return str(d)

    def start_profile(self) -> None:
        if self._profiler is not None:
            raise ValueError("start_profile: a profile is already running; call stop_profile first")
        cfg = self.worker.config.extra.get("profiler_config") or {}
        d = self._profiler_dir()
        os.makedirs(d, exist_ok=True)
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.runner.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(
            activities=acts,
            record_shapes=bool(cfg.get("torch_profiler_record_shapes", False)),
            profile_memory=bool(cfg.get("torch_profiler_with_memory", False)),
            with_stack=bool(cfg.get("torch_profiler_with_stack", False)),
            with_flops=bool(cfg.get("torch_profiler_with_flops", False)),
        )
        prof.start()
        self._profiler = prof

    def stop_profile(self) -> str:
        """Stops the profile and writes its Chrome trace (JSON); returns the file's path."""
        if self._profiler is None:
            raise ValueError("stop_profile: no profile is running; call start_profile first")
        prof, self._profiler = self._profiler, None
        prof.stop()
        name = f"pagedllm-trace-pid{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**9}.json"
        path = os.path.join(self._profiler_dir(), name)
        prof.export_chrome_trace(path)
        logger.info("Profile written to %s", path)
        return path


def get_controls(worker: Any) -> WorkerControls:
    controls = getattr(worker, "_pagedllm_controls", None)
    if controls is None:
        controls = WorkerControls(worker)
        worker._pagedllm_controls = controls
    return controls


def run_worker_method(
    worker: Any, method: str | Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
) -> Any:
    kwargs = kwargs or {}
    if callable(method):
        return method(worker, *args, **kwargs)
    if not isinstance(method, str) or method.startswith("_"):
        raise ValueError(f"collective_rpc: method must be a public method name or a callable, got {method!r}")
    fn = getattr(worker, method, None)
    if fn is None:
        fn = getattr(get_controls(worker), method, None)
    if fn is None or not callable(fn):
        raise ValueError(f"collective_rpc: the worker has no method {method!r}")
    return fn(*args, **kwargs)
