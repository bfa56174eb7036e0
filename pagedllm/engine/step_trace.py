"""A per-step trace of the engine core, for finding what a slow request waited behind (latency tails).

With `PAGEDLLM_STEP_TRACE=<file>`, the core appends one JSON line per event (wall-clock `time.time()`, so it lines
up with a client's send times on the same machine):
- `{"ev": "add", "t", "id"}`: a request reached the scheduler;
- `{"ev": "sched", "t", "step", "tokens", "prefill_tokens", "decodes", "new": [ids], "waiting", "running"}`: a
  step was scheduled (`new`: requests scheduled for the first time; `prefill_tokens`: tokens of rows with more
  than one scheduled token);
- `{"ev": "done", "t", "step", "first": [ids], "cpu"}`: the step's results were read (`first`: requests whose first
  output token came in this step; `cpu`: the process's CPU seconds, all threads, since the step was scheduled);
- `{"ev": "gc", "t", "gen", "ms"}`: a cyclic-GC collection of the core process (its generation and duration);
- with a one-process CUDA executor, `done` also has `launch_ms` (host time of the call that launched the step)
  and `gpu_ms` (CUDA events before and after that call: the device time from the step's first enqueued work to
  its last, idle gaps included when the host launched slower than the device ran), `launch_cpu_ms` (the step
  loop thread's CPU time in that call: the rest of `launch_ms` it was blocked, e.g. in the driver) and `alloc`
  (the CUDA caching allocator's cudaMalloc calls, cudaFree calls and retries so far).

The scheduler's methods are wrapped at start-up, so the core's code has no tracing branches; nothing is wrapped
without the variable. Lines are buffered and written every `FLUSH_EVERY` events, when the scheduler runs empty,
and at shutdown.
"""

from __future__ import annotations

import gc
import json
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
    from pagedllm.executor.abstract import Executor

FLUSH_EVERY = 512


class StepTrace:
    def __init__(self, path: str) -> None:
        self.path = path
        self.lines: list[str] = []
        self.step = 0
        self._step_of: dict[int, int] = {}
        """id(SchedulerOutput) -> its step number (async scheduling reads results one step later)."""
        self._started: set[str] = set()
        self._cpu_at: dict[int, float] = {}
        self._gc_t0 = 0.0
        self._launch: dict[int, tuple[float, float, Any, Any]] = {}
        """step -> (host ms of its launch call, the thread's CPU ms in it, CUDA events before / after it)."""
        open(path, "w").close()

    def _emit(self, **ev: Any) -> None:
        self.lines.append(json.dumps(ev))
        if len(self.lines) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if self.lines:
            with open(self.path, "a") as f:
                f.write("\n".join(self.lines) + "\n")
            self.lines.clear()

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            ms = (time.perf_counter() - self._gc_t0) * 1e3
            self.lines.append(json.dumps({"ev": "gc", "t": time.time(), "gen": info["generation"], "ms": ms}))

    def _wrap_executor(self, executor: Executor) -> None:
        import torch

        if not torch.cuda.is_available() or type(executor).__name__ != "UniProcExecutor":
            return
        run, run_async = executor.execute_model, executor.execute_model_async

        def timed(fn: Any) -> Any:
            def call(so: SchedulerOutput) -> Any:
                before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t, c = time.perf_counter(), time.thread_time()
                before.record()
                out = fn(so)
                after.record()
                wall, cpu = (time.perf_counter() - t) * 1e3, (time.thread_time() - c) * 1e3
                self._launch[self._step_of.get(id(so), -1)] = (wall, cpu, before, after)
                return out

            return call

        executor.execute_model = timed(run)  # type: ignore[method-assign]
        executor.execute_model_async = timed(run_async)  # type: ignore[method-assign]

    def install(self, scheduler: Scheduler, executor: Executor | None = None) -> None:
        """Wrap `scheduler`'s add_request, schedule and update_from_output (and a one-process CUDA `executor`'s
        launches) with the trace; log GC pauses."""
        gc.callbacks.append(self._on_gc)
        if executor is not None:
            self._wrap_executor(executor)
        add, schedule, update = scheduler.add_request, scheduler.schedule, scheduler.update_from_output

        def add_request(request: Any) -> None:
            self._emit(ev="add", t=time.time(), id=request.request_id)
            add(request)

        def traced_schedule() -> SchedulerOutput:
            so = schedule()
            self.step += 1
            self._step_of[id(so)] = self.step
            self._cpu_at[self.step] = time.process_time()
            n = so.num_scheduled_tokens
            prefill = sum(v for v in n.values() if v > 1)
            self._emit(
                ev="sched",
                t=time.time(),
                step=self.step,
                tokens=so.total_num_scheduled_tokens,
                prefill_tokens=prefill,
                decodes=sum(1 for v in n.values() if v == 1),
                new=[r.req_id for r in so.scheduled_new_reqs],
                waiting=len(scheduler.waiting),
                running=len(scheduler.running),
            )
            return so

        def traced_update(so: SchedulerOutput, result: ModelRunnerOutput) -> Any:
            first = [r for r, toks in zip(result.req_ids, result.sampled_token_ids) if toks and r not in self._started]
            self._started.update(first)
            out = update(so, result)
            step = self._step_of.pop(id(so), -1)
            cpu = time.process_time() - self._cpu_at.pop(step, time.process_time())
            extra: dict[str, Any] = {}
            launch = self._launch.pop(step, None)
            if launch is not None:
                import torch

                launch[3].synchronize()  # done already: the step's results were read
                st = torch.cuda.memory_stats()
                extra = dict(
                    launch_ms=round(launch[0], 3), launch_cpu_ms=round(launch[1], 3),
                    gpu_ms=round(launch[2].elapsed_time(launch[3]), 3),
                    alloc=[st.get("num_device_alloc", 0), st.get("num_device_free", 0), st.get("num_alloc_retries", 0)],
                )  # fmt: skip
            self._emit(ev="done", t=time.time(), step=step, first=first, cpu=round(cpu, 6), **extra)
            if not scheduler.has_unfinished_requests():
                self.flush()  # idle: a benchmark run has ended
            return out

        scheduler.add_request = add_request  # type: ignore[method-assign,assignment]
        scheduler.schedule = traced_schedule  # type: ignore[method-assign]
        scheduler.update_from_output = traced_update  # type: ignore[method-assign,assignment]
