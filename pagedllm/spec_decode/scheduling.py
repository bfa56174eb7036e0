"""The scheduler's side of speculative decoding: a decoding request's proposals are scheduled with its
next token (as far as the token budget, max_model_len and its max_tokens allow), and after the step its
computed-token count goes back by the rejected proposals, so their KV slots are overwritten by the next
step. Proposals never enter a request's tokens, hence never a prefix-cache block hash."""

from __future__ import annotations

from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.messages import SpecDecodingStats
from pagedllm.sampling_params import SamplingParams


def can_speculate(sp: SamplingParams) -> bool:
    """Whether a request's sampling distribution at a position depends only on the tokens before it
    through the model (not on its own output counts on the host)."""
    return not (
        sp.presence_penalty
        or sp.frequency_penalty
        or sp.repetition_penalty != 1.0
        or sp.min_tokens
        or sp.bad_words_token_ids
    )


class SpecDecodeScheduling:
    def __init__(self, num_spec_tokens: int, disable_by_batch_size: int | None = None) -> None:
        self.k = num_spec_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.async_mode = False
        """Set by the scheduler under async scheduling (n-gram): every decode gets k placeholder proposals
        that the device fills (`spec_decode/async_ngram.py`), and a verification in flight counts as one
        token until its result says how many it emitted."""
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

    def add_placeholders(
        self,
        req: Request,
        computed: int,
        num_new: int,
        target: int,
        budget: int,
        max_model_len: int,
        out: dict,
        propose: bool,
    ) -> tuple[int, int]:
        """Async mode: (tokens to schedule, extra KV slots to reserve). A decode (one token to compute, its
        last known one) gets up to k placeholder proposals, recorded in `out` (an entry, maybe empty, marks every
        decode: its inputs come from the device). With a verification in flight its true position is up to k
        further on than `computed` says (up to its proposals): that many more slots are reserved, and the
        proposals stop that much earlier.
        `propose` False (a batch above disable_by_batch_size): no proposals."""
        if num_new != 1 or computed + 1 != target:  # (a prefill's last chunk is no decode unless one token)
            req.spec_in_flight = 0
            return num_new, 0
        reserve = req.spec_in_flight if req.num_output_placeholders else 0
        extra = self.k if propose and can_speculate(req.sampling_params) else 0
        extra = max(0, min(extra, budget - num_new, max_model_len - target - reserve, req.stop_len - target - 1))
        out[req.request_id] = [-1] * extra
        req.spec_in_flight = extra
        return num_new + extra, min(reserve, max(0, max_model_len - computed - num_new - extra))

    def update(self, requests: dict[str, Request], sched: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Count acceptance and correct the requests' computed tokens: synchronously, roll back the rejected
        proposals; in async mode the step counted one token per decode, so add the accepted ones (unless the
        request was preempted meanwhile: its count restarts from its prefix). Then keep the next proposals."""
        drafts = sched.scheduled_spec_decode_tokens
        if drafts:
            real = result.spec_num_drafted or {}
            async_mode = self.async_mode
            for rid, tokens in zip(result.req_ids, result.sampled_token_ids):
                d = drafts.get(rid)
                req = requests.get(rid)
                if d is None or not tokens or req is None:
                    continue
                n_acc = len(tokens) - 1
                if async_mode:
                    if req.status == RequestStatus.RUNNING:
                        req.num_computed_tokens += n_acc
                    n_draft = max(real.get(rid, len(d)), n_acc)  # (a placeholder the target happened to agree with)
                else:
                    req.num_computed_tokens -= len(d) - n_acc
                    n_draft = len(d)
                if n_draft:
                    self._count(n_draft, n_acc)
        props = result.spec_token_ids
        if props:
            for rid, p in props.items():
                req = requests.get(rid)
                if req is not None:
                    req.spec_token_ids = p

    def _count(self, n_draft: int, n_acc: int) -> None:
        for s in (self._stats, self.totals):
            s.num_drafts += 1
            s.num_draft_tokens += n_draft
            s.num_accepted_tokens += n_acc
        per_pos = self._stats.num_accepted_tokens_per_pos
        for j in range(n_acc):
            per_pos[j] += 1

    def take_stats(self) -> SpecDecodingStats | None:
        st = self._stats
        if not st.num_drafts:
            return None
        self._stats = self._fresh()
        return st
