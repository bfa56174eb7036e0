"""The scheduler's side of speculative decoding: a decoding request's proposals are scheduled with its
next token (as far as the token budget, max_model_len and its max_tokens allow), and after the step its
computed-token count goes back by the rejected proposals, so their KV slots are overwritten by the next
step. Proposals never enter a request's tokens, hence never a prefix-cache block hash."""

from __future__ import annotations

from pagedllm.core.request import Request
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.messages import SpecDecodingStats


class SpecDecodeScheduling:
    def __init__(self, num_spec_tokens: int) -> None:
        self.k = num_spec_tokens
        self._stats = self._fresh()
        self.totals = self._fresh()
        """Since start-up (benchmarks and tests read it; the metrics take `take_stats`' deltas)."""

    def _fresh(self) -> SpecDecodingStats:
        return SpecDecodingStats(num_spec_tokens=self.k, num_accepted_tokens_per_pos=[0] * self.k)

    @staticmethod
    def add_drafts(
        req: Request, computed: int, num_new: int, target: int, budget: int, max_model_len: int, out: dict
    ) -> int:
        """num_new plus the request's proposals this step takes (recorded in `out`); the proposals are
        consumed either way (a partial step does not verify them)."""
        drafts = req.spec_token_ids
        req.spec_token_ids = []
        if computed + num_new != target:
            return num_new
        extra = min(len(drafts), budget - num_new, max_model_len - target, req.stop_len - target - 1)
        if extra <= 0:
            return num_new
        out[req.request_id] = drafts[:extra]
        return num_new + extra

    def update(self, requests: dict[str, Request], sched: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Roll back the rejected proposals, count acceptance, and keep the next step's proposals."""
        drafts = sched.scheduled_spec_decode_tokens
        if drafts:
            st = self._stats
            tot = self.totals
            per_pos = st.num_accepted_tokens_per_pos
            for rid, tokens in zip(result.req_ids, result.sampled_token_ids):
                d = drafts.get(rid)
                req = requests.get(rid)
                if d is None or not tokens or req is None:
                    continue
                n_acc = len(tokens) - 1
                req.num_computed_tokens -= len(d) - n_acc
                st.num_drafts += 1
                st.num_draft_tokens += len(d)
                st.num_accepted_tokens += n_acc
                for j in range(n_acc):
                    per_pos[j] += 1
                tot.num_drafts += 1
                tot.num_draft_tokens += len(d)
                tot.num_accepted_tokens += n_acc
        props = result.spec_token_ids
        if props:
            for rid, p in props.items():
                req = requests.get(rid)
                if req is not None:
                    req.spec_token_ids = p

    def take_stats(self) -> SpecDecodingStats | None:
        st = self._stats
        if not st.num_drafts:
            return None
        self._stats = self._fresh()
        return st
