"""`LLM` methods for RL trainers and operators (vLLM's names): sleep / wake_up / is_sleeping, collective_rpc /
apply_model, weight updates, enqueue / wait_for_completion, get_metrics, start_profile / stop_profile.

They reach the engine core through its client's `call_utility` (in-process for `LLM`), the same calls the
HTTP server sends to a core in its own process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pagedllm.inputs import PromptType
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


class LLMControlsMixin:
    """Mixed into `LLM` (needs `llm_engine`, `generate`-style helpers `_add_requests` / `_run_engine`)."""

    llm_engine: Any
    _enqueued: dict[str, RequestOutput | None]

    def _core(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.llm_engine.engine_core.call_utility(method, *args, **kwargs)

    # ---- sleep -------------------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """0: pause scheduling (requests are accepted and wait); 1: weights to host memory, KV cache freed;
        2: weights and KV cache freed (reload them with update_weights after wake_up)."""
        self._core("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake "weights", "kv_cache" and/or "scheduling" (all when None)."""
        self._core("wake_up", tags)

    def is_sleeping(self) -> bool:
        return bool(self._core("is_sleeping"))

    def _check_can_run(self) -> None:
        core = self.llm_engine.engine_core.engine_core
        core.check_can_run()
        if core.scheduling_paused:
            raise RuntimeError(
                "Scheduling is paused (sleep(level=0)): generate() would wait forever; use enqueue() now and "
                "wait_for_completion() after wake_up(tags=['scheduling'])"
            )

    # ---- workers -------------------------------------------------------------------------------------------
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Run `method` on every worker: a worker method name, or a callable whose first argument is the
        worker. Returns each worker's result."""
        return self._core("collective_rpc", method, timeout, args, kwargs)

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """`func(model)` on every worker's model (the torch module); each worker's result."""
        return self.collective_rpc(lambda worker: func(worker.model_runner.model))

    # ---- weight updates ------------------------------------------------------------------------------------
    def init_weight_transfer_engine(self, request: dict[str, Any]) -> None:
        """{"init_info": {...}}: for nccl / gloo master_address, master_port, rank_offset, world_size."""
        self._core("init_weight_transfer_engine", request)

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        """is_checkpoint_format: names as in the HF checkpoint (through the weight loaders); False: the
        model's own parameter names and shapes (fused qkv_proj / gate_up_proj)."""
        self._core("start_weight_update", is_checkpoint_format)

    def update_weights(self, request: dict[str, Any]) -> None:
        """{"update_info": {...}}: names / dtype_names / shapes (nccl, gloo), or checkpoint_path (checkpoint).
        All or nothing: a bad name or shape raises ValueError and leaves the weights as they were."""
        self._core("update_weights", request)

    def finish_weight_update(self) -> None:
        self._core("finish_weight_update")

    # ---- enqueue -------------------------------------------------------------------------------------------
    def enqueue(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: list[int] | None = None,
        use_tqdm: bool = False,
    ) -> list[str]:
        """Queue requests without running the engine; returns their ids (wait_for_completion collects them)."""
        self.llm_engine.engine_core.engine_core.check_can_run()
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params = self._params_for(prompts, sampling_params)  # type: ignore[attr-defined]
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority: got {len(priority)} values for {len(prompts)} prompts")
        ids = self._add_requests(prompts, params, priority)  # type: ignore[attr-defined]
        if not hasattr(self, "_enqueued"):
            self._enqueued = {}
        self._enqueued.update(dict.fromkeys(ids))
        return ids

    def enqueue_chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        **chat_kwargs: Any,
    ) -> list[str]:
        """`chat()`'s conversations, queued like `enqueue`."""
        prompts = self._chat_prompts(messages, **chat_kwargs)  # type: ignore[attr-defined]
        return self.enqueue(prompts, sampling_params)

    def _stash_output(self, out: RequestOutput) -> None:
        if out.request_id in getattr(self, "_enqueued", {}):
            self._enqueued[out.request_id] = out

    def wait_for_completion(self, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run the engine until every enqueued request is finished; their outputs in enqueue order."""
        enqueued = getattr(self, "_enqueued", {})
        if self.llm_engine.engine_core.engine_core.scheduling_paused and self.llm_engine.has_unfinished_requests():
            raise RuntimeError("wait_for_completion: scheduling is paused (sleep(level=0)); call wake_up first")
        pending = [rid for rid, out in enqueued.items() if out is None]
        for out in self._run_engine(pending, use_tqdm):  # type: ignore[attr-defined]
            enqueued[out.request_id] = out
        results = [out for out in enqueued.values() if out is not None]
        self._enqueued = {}
        return results

    # ---- metrics and profiling ---------------------------------------------------------------------------------
    def get_metrics(self) -> list[Any]:
        """A snapshot of the Prometheus metrics (Counter / Gauge / Histogram objects, as vLLM's reader)."""
        from pagedllm.metrics.reader import get_metrics_snapshot

        prom = self.llm_engine.prometheus
        if prom is None:
            raise ValueError("get_metrics: stats are disabled (disable_log_stats=True)")
        return get_metrics_snapshot(prom.registry)

    def start_profile(self) -> None:
        """Start the torch profiler in every worker (profiler_config={"torch_profiler_dir": DIR})."""
        self._core("start_profile")

    def stop_profile(self) -> list[str]:
        """Stop it; returns the Chrome-trace JSON files written."""
        return self._core("stop_profile")
