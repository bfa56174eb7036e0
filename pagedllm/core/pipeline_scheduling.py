"""Scheduling for pipeline parallelism with several batches in flight (vLLM v1's batch queue).

With pp stages, the engine core keeps up to pp batches launched at once, so stage s works on batch k
while stage s + 1 works on batch k - 1. A request in a launched batch is not scheduled again until that
batch's result is back (its next input token is not known yet): `schedule` hides those requests from the
scheduler for the call, so they are neither scheduled nor chosen as preemption victims, and the
`max_num_seqs` cap still counts them. Each batch holds at most ceil(max_num_seqs / max_batches) requests
(the running ones past that wait for the next batch, new ones are admitted up to it): otherwise the first
batch would take every request and the next would find none, so steady decoding would run one batch at a
time whatever the queue's size.

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

    def __init__(self, scheduler: Scheduler, max_batches: int) -> None:
        self.scheduler = scheduler
        max_seqs = scheduler.config.max_num_seqs
        self.per_batch = -(-max_seqs // max_batches)
        """The most requests in one batch."""
        self.limited = self.per_batch < max_seqs

    def schedule(self, busy: set[str]) -> SchedulerOutput:
        """One batch of the requests not in `busy` (the ids of the launched, unread batches), with the
        output tokens the earlier stages have not seen."""
        s = self.scheduler
        saved = s.running
        swap = bool(busy) or self.limited
        if swap:
            visible = [r for r in saved if r.request_id not in busy] if busy else saved
            visible = visible[: self.per_batch]
            shown = {r.request_id for r in visible}
            s.running = visible
            s.num_busy = max(s.config.max_num_seqs - self.per_batch, len(saved) - len(visible))
        try:
            so = s.schedule()
        finally:
            if swap:
                s.running = _merge(saved, s.running, shown)
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


def _merge(saved: list[Request], after: list[Request], shown: set[str]) -> list[Request]:
    """The running list after a schedule that saw only the requests in `shown`: the hidden ones back in
    their places, preempted ones gone, newly admitted ones at the end (the FCFS order preemption uses)."""
    kept = {id(r) for r in after}
    old = {id(r) for r in saved}
    merged = [r for r in saved if id(r) in kept or r.request_id not in shown]
    merged.extend(r for r in after if id(r) not in old)
    return merged
