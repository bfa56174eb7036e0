"""The engine core's step with several batches in flight, for pipeline parallelism (vLLM v1's
`step_with_batch_queue`).

Each step launches batches (the executor's non-blocking `execute_model_async`) while fewer than
`max_batches` are unread and some request is not in a launched batch, then reads the oldest one. With
pp stages and pp batches in flight, every stage has a batch to work on: stage s runs batch k while stage
s + 1 runs batch k - 1. `PAGEDLLM_MAX_CONCURRENT_BATCHES=1` runs one batch at a time (the A/B switch of
`benchmarks/pp_overlap.py`).
"""

from __future__ import annotations

import collections
import time

from pagedllm.core.pipeline_scheduling import PipelineScheduling
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.executor.abstract import Executor, StepFuture
from pagedllm.messages import EngineCoreOutputs


class BatchQueue:
    def __init__(self, scheduler: Scheduler, executor: Executor, max_batches: int) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.max_batches = max(1, max_batches)
        self.pipe = PipelineScheduling(scheduler, self.max_batches)
        self.queue: collections.deque[tuple[SchedulerOutput, StepFuture]] = collections.deque()
        self.max_in_flight = 0
        """The most batches launched and unread at once so far (> 1: the stages overlapped)."""
        self.num_overlapped_launches = 0
        """Batches launched while an earlier one was still unread."""

    def busy(self) -> set[str]:
        """The requests in launched, unread batches."""
        ids: set[str] = set()
        for so, _ in self.queue:
            ids.update(so.num_scheduled_tokens)
        return ids

    def step(self) -> EngineCoreOutputs:
        sched, queue = self.scheduler, self.queue
        while len(queue) < self.max_batches and sched.has_unfinished_requests():
            busy = self.busy()
            if not len(sched.waiting) and all(r.request_id in busy for r in sched.running):
                break  # every request is in a launched batch: nothing to schedule
            so = self.pipe.schedule(busy)
            if not so.total_num_scheduled_tokens and not so.preempted_req_ids:
                sched.finished_req_ids |= so.finished_req_ids  # for the next batch the workers see
                break
            if queue:
                self.num_overlapped_launches += 1
            queue.append((so, self.executor.execute_model_async(so)))
            self.max_in_flight = max(self.max_in_flight, len(queue))
        if not queue:
            return EngineCoreOutputs(scheduler_stats=sched.make_stats(), timestamp=time.monotonic())
        return self.collect_oldest()

    def collect_oldest(self) -> EngineCoreOutputs:
        so, future = self.queue.popleft()
        return self.scheduler.update_from_output(so, future.result())
