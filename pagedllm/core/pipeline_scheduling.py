"""Scheduling for pipeline parallelism with several batches in flight (vLLM v1's batch queue).

With pp stages, the engine core keeps up to pp batches launched at once, so stage s works on batch k
while stage s + 1 works on batch k - 1. A request in a launched batch is not scheduled again until that
batch's result is back (its next input token is not known yet): `schedule` hides those requests from the
scheduler for the call, so they are neither scheduled nor chosen as preemption victims, and the
`max_num_seqs` cap still counts them.

The stages before the last never sample, so the tokens sampled by the last stage reach them through the
`SchedulerOutput` (`CachedRequestData.new_token_ids`), not through a collective that would make every
stage wait for the last one each step.
"""

from __future__ import annotations

from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import SchedulerOutput


class PipelineScheduling:
    """The scheduler's side of the batch queue: `schedule(busy)` skips the requests in launched batches."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def schedule(self, busy: set[str]) -> SchedulerOutput:
        """One batch of the requests not in `busy` (the ids of the launched, unread batches), with the
        output tokens the earlier stages have not seen."""
        s = self.scheduler
        saved = s.running
        if busy:
            s.running = [r for r in saved if r.request_id not in busy]
            s.num_busy = len(saved) - len(s.running)
        try:
            so = s.schedule()
        finally:
            if busy:
                s.running = _merge(saved, s.running, busy)
                s.num_busy = 0
        self._add_new_token_ids(so)
        return so

    def _add_new_token_ids(self, so: SchedulerOutput) -> None:
        """Per cached request: its output tokens from the first scheduled position on (prompt tokens are
        known to every stage), so each stage appends those it has not seen (`BatchUpdater`)."""
        c = so.scheduled_cached_reqs
        if not c.req_ids:
            return
        requests, num_sched = self.scheduler.requests, so.num_scheduled_tokens
        new_ids: list[list[int]] = []
        for rid, computed in zip(c.req_ids, c.num_computed_tokens):
            req = requests[rid]
            start = max(computed, req.num_prompt_tokens)
            new_ids.append(req.all_token_ids[start : computed + num_sched[rid]])
        c.new_token_ids = new_ids


def _merge(saved: list[Request], after: list[Request], busy: set[str]) -> list[Request]:
    """The running list after a schedule that saw only the requests not in `busy`: the busy ones back in
    their places, preempted ones gone, newly admitted ones at the end (the FCFS order preemption uses)."""
    kept = {id(r) for r in after}
    old = {id(r) for r in saved}
    merged = [r for r in saved if id(r) in kept or r.request_id in busy]
    merged.extend(r for r in after if id(r) not in old)
    return merged
