"""Async scheduling: step N's token intake and step N+1's bitmask fill on a worker thread.

With async scheduling the runner launches step N+1 before the engine reads step N's tokens, and N+1's bitmask
needs them. Inline, the step loop waits for N's result at N+1's mask, then advances the matchers and fills
(`StructuredOutputManager.chain`). Here the runner reports N's sampled ids (a host copy and its event) as soon
as N's sampler is launched (`GrammarBitmask.on_sampled`); a worker thread waits for the copy, advances the
matchers in one xgrammar call, and, once N+1 is scheduled, fills N+1's mask, while the step loop reads N-1's
results, schedules N+1 and launches its forward. Every xgrammar call releases the GIL (tvm-ffi), and the worker
holds it only for a few statements between them.

The outcome of N's intake (rejections, terminations, `num_seen`) is kept in the job and published to the request
states on the step loop only when N's tokens are due: at N+1's mask (`before_fill`) or, if no step was chained,
when the scheduler takes N's tokens (`accept`). The scheduler thus sees the same states, in the same order, as
with the inline intake."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedllm.structured_output.matchers import GrammarBitmask, RequestGrammar, batch_outcome, record_outcome

if TYPE_CHECKING:
    import torch


class _Intake:
    """One step's intake: (state, position in the step's sampled ids) pairs, run on the worker."""

    def __init__(self, picked: list[tuple[RequestGrammar, int]]) -> None:
        self.picked = picked
        self.state_ids = frozenset(id(st) for st, _ in picked)
        """The states it takes a token into (`StructuredOutputManager.taking`)."""
        self.future: cf.Future[None] | None = None
        self.rejected: list[int] = []
        self.terminated: list[int] = []
        self.tokens: list[int] = []

    def run(self, host: torch.Tensor, event: Any) -> None:
        if event is not None:
            event.synchronize()
        ids = host.tolist()
        self.tokens = [ids[j] for _, j in self.picked]
        self.rejected, self.terminated = batch_outcome([st for st, _ in self.picked], self.tokens)

    def publish(self) -> None:
        """(Step loop) the outcome into the request states, as `pre_accept` would have left them."""
        assert self.future is not None
        self.future.result()
        states = [st for st, _ in self.picked]
        for st in states:
            st.num_seen += 1
        record_outcome(states, self.tokens, self.rejected, self.terminated)


class StepJobs:
    """The worker thread and the one intake not yet published."""

    def __init__(self, states: dict[str, RequestGrammar], fill_threads: int | None = None) -> None:
        self._states = states
        self._fill_threads = fill_threads
        self._pool: cf.ThreadPoolExecutor | None = None
        self.pending: _Intake | None = None
        self._last: cf.Future[Any] | None = None
        """The last job given to the worker (jobs run in order)."""
        self._batch: Any = None
        """The worker's own xgrammar batch matcher (the step loop's may fill meanwhile)."""

    def sampled(
        self,
        rows: dict[str, int],
        bitmask: GrammarBitmask,
        req_ids: Sequence[str],
        sample_idx: np.ndarray,
        host: torch.Tensor,
        event: Any,
        failed: dict[str, str] | None,
    ) -> None:
        """Runner hook (step loop): step N's sampler is launched, its ids are coming to `host` (`event`).
        `rows`: N's constrained requests (`bitmask`: their mask). Starts their intake on the worker."""
        self.publish()  # an earlier step's, if no step took it (none in steady decoding)
        by_row, row_states = bitmask.logit_rows, bitmask.states
        candidates: Iterable[tuple[RequestGrammar | None, int]]
        if by_row is not None and row_states is not None and len(by_row) == len(sample_idx) and not failed:
            # The CUDA apply's mapping of the sampled rows to mask rows, whose states the mask holds (a request
            # removed since has its matcher fed all the same, unread).
            candidates = ((row_states[k], j) for j, k in enumerate(by_row) if k is not None)
        else:
            get, ids = self._states.get, [req_ids[i] for i in sample_idx.tolist()]
            candidates = ((get(r), j) for j, r in enumerate(ids) if r in rows and not (failed and r in failed))
        picked = [(st, j) for st, j in candidates if st is not None and not st.terminated and st.error is None]
        if not picked:
            return
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-step")
        job = _Intake(picked)
        job.future = self._last = self._pool.submit(job.run, host, event)
        self.pending = job

    def chain(self, bitmask: GrammarBitmask) -> bool:
        """Step N+1 was scheduled: its fill follows N's intake on the worker. False: no intake pending (the
        caller takes N's tokens inline)."""
        job = self.pending
        if job is None:
            return False
        assert self._pool is not None
        if self._batch is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher(self._fill_threads or "auto")
        bitmask.future = self._last = self._pool.submit(bitmask.fill_after, job, self._batch)
        bitmask.before_fill = self.publish
        return True

    def publish(self) -> None:
        job, self.pending = self.pending, None
        if job is not None:
            job.publish()

    def quiesce(self) -> None:
        """Before the step loop itself touches matchers: the worker's jobs have finished (they have in steady
        decoding; a fill whose mask no step asked for may still run)."""
        if self._last is not None and not self._last.done():
            cf.wait([self._last])

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
