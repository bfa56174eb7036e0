"""Applies the scheduler's diffs to the model runner's per-request states and the persistent batch:
finished and preempted requests leave their rows, new and resumed ones take rows, running ones get their
progress and new block ids (vLLM v1's persistent batch, updated by diffs instead of rebuilt)."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.core.scheduler_output import CachedRequestData, SchedulerOutput
from pagedllm.worker.input_batch import CachedRequestState, InputBatch


class BatchUpdater:
    """Owns the per-request states (`requests`) and keeps `batch` in step with the scheduler."""

    def __init__(self, batch: InputBatch, device: torch.device) -> None:
        self.batch = batch
        self.device = device
        self.requests: dict[str, CachedRequestState] = {}
        self._rows_memo: tuple[int, list[str], np.ndarray] | None = None
        """(batch version, scheduled cached request ids, their rows) of the last update: the row lookups are
        reused while both are unchanged (steady decoding; NOTES H11: -0.015 ms per 256-row step)."""

    def apply(self, so: SchedulerOutput) -> tuple[list[str], list[CachedRequestState]]:
        """Applies `so`: (the ids that finished, the states of the requests new to the worker)."""
        batch = self.batch
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            batch.remove_request(rid)
        for rid in so.preempted_req_ids:
            batch.remove_request(rid)  # state kept (with its generator) for when it resumes
        added = []
        for new in so.scheduled_new_reqs:
            sp = new.sampling_params
            gen = None
            if sp.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(sp.seed)
            st = CachedRequestState(
                new.req_id,
                list(new.prompt_token_ids),
                list(new.output_token_ids),
                sp,
                gen,
                [list(ids) for ids in new.block_ids],
                new.num_computed_tokens,
                new.lora_id,
                mm_features=new.mm_features,
            )
            self.requests[new.req_id] = st
            batch.add_request(st)
            added.append(st)
        self._update_cached(so)
        return list(so.finished_req_ids), added

    def _learn_tokens(self, c: CachedRequestData) -> None:
        """Append the output tokens of `c.new_token_ids` this worker has not seen to the requests' states
        and (for those keeping their rows) batch rows. The last stage, which sampled them, has them all."""
        batch, rows_of = self.batch, self.batch.req_id_to_row
        for rid, computed, resumed, toks in zip(
            c.req_ids, c.num_computed_tokens, c.resumed_from_preemption, c.new_token_ids
        ):
            st = self.requests[rid]
            known = st.num_tokens
            start = max(computed, len(st.prompt_token_ids))
            if start + len(toks) <= known:
                continue
            if start > known:
                raise RuntimeError(f"request {rid}: tokens from position {start} sent, {known} known on this stage")
            extra = toks[known - start :]
            st.output_token_ids.extend(extra)
            if not resumed:  # (a resumed request's row is rebuilt from its state)
                row = rows_of[rid]
                batch.token_ids[row, known : known + len(extra)] = extra
                batch.num_tokens[row] = known + len(extra)

    def _update_cached(self, so: SchedulerOutput) -> None:
        c = so.scheduled_cached_reqs
        if not c.req_ids:
            return
        batch = self.batch
        rows_of = batch.req_id_to_row
        req_ids, num_computed, resumed_flags = c.req_ids, c.num_computed_tokens, c.resumed_from_preemption
        if c.new_token_ids:  # pipeline parallelism: a stage before the last learns the sampled tokens
            self._learn_tokens(c)
        if any(resumed_flags):
            for rid, resumed, new_ids, n in zip(req_ids, resumed_flags, c.new_block_ids, num_computed):
                if resumed:
                    st = self.requests[rid]
                    st.num_computed_tokens = n
                    assert new_ids is not None
                    st.block_ids = [list(ids) for ids in new_ids]
                    batch.add_request(st)
            keep = [j for j, resumed in enumerate(resumed_flags) if not resumed]
            req_ids = [req_ids[j] for j in keep]
            num_computed = [num_computed[j] for j in keep]
        # The requests that keep their rows: their progress in one write; block ids only for those that got
        # new blocks (a decode gets one every block_size steps).
        if req_ids:
            memo = self._rows_memo
            if memo is not None and memo[0] == batch.version and memo[1] == req_ids:
                rows = memo[2]
            else:
                rows = np.fromiter(map(rows_of.__getitem__, req_ids), dtype=np.int64, count=len(req_ids))
                self._rows_memo = (batch.version, list(req_ids), rows)
            batch.num_computed_tokens[rows] = num_computed
        new_block_ids = c.new_block_ids
        if new_block_ids.count(None) == len(new_block_ids):
            return  # no request got blocks (decodes inside their blocks): no per-request scan
        grown = [j for j, ids in enumerate(new_block_ids) if ids is not None and not resumed_flags[j]]
        if grown:
            all_new: list[tuple[list[int], ...]] = []
            for j in grown:
                new_ids = new_block_ids[j]
                assert new_ids is not None
                for g, ids in enumerate(self.requests[c.req_ids[j]].block_ids):
                    ids.extend(new_ids[g])
                all_new.append(new_ids)
            batch.append_block_ids_rows([rows_of[c.req_ids[j]] for j in grown], all_new)
