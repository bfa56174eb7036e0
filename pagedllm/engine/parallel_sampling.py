"""Parallel sampling (`n > 1`): one parent request fanned out into n independent child requests.

The core never sees the parent: the front end submits n children (`n=1` each) that share the prompt
(so prefix caching computes it once), and the output processor folds their outputs back into one
`RequestOutput` for the parent id.
"""

from __future__ import annotations

import msgspec

from pagedllm.messages import EngineCoreRequest
from pagedllm.outputs import CompletionOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


def child_request_id(index: int, parent_request_id: str) -> str:
    return f"{index}_{parent_request_id}"


class ParentRequest:
    """State of one `n > 1` request on the front end."""

    def __init__(self, request_id: str, sampling_params: SamplingParams) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.n = sampling_params.n
        self.output_kind = sampling_params.output_kind
        self.child_requests: dict[str, int] = {}
        """Unfinished child request id -> index."""
        self._latest: list[CompletionOutput | None] = [None] * self.n
        """Latest (cumulative) output per child index, for CUMULATIVE and FINAL_ONLY."""
        self._pending_delta: dict[int, CompletionOutput] = {}
        """DELTA: outputs of children that changed since the last `take_outputs`."""
        self._changed = False
        self._returned_final = False

    def get_child_info(self, index: int) -> tuple[str, SamplingParams]:
        """(child request id, child sampling params) of child `index`; registers the child."""
        if not 0 <= index < self.n:
            raise IndexError(f"child index {index} out of range for n={self.n}")
        child_id = child_request_id(index, self.request_id)
        changes: dict[str, object] = {"n": 1}
        if self.sampling_params.seed is not None:
            changes["seed"] = self.sampling_params.seed + index
        self.child_requests[child_id] = index
        return child_id, self.sampling_params.clone(**changes)

    def make_child_requests(self, req: EngineCoreRequest) -> list[EngineCoreRequest]:
        """The n core requests of `req` (the processed parent request), in index order."""
        children = []
        for idx in range(self.n):
            child_id, child_params = self.get_child_info(idx)
            children.append(msgspec.structs.replace(req, request_id=child_id, sampling_params=child_params))
        return children

    def child_ids(self) -> list[str]:
        """All child ids (finished or not)."""
        return [child_request_id(i, self.request_id) for i in range(self.n)]

    @property
    def finished(self) -> bool:
        return not self.child_requests

    def add_child_output(self, child_id: str, output: CompletionOutput) -> None:
        """Record the output of one child for this step (its `index` is the child index)."""
        if output.finished():
            if child_id not in self.child_requests:
                return  # already finished and reported
            del self.child_requests[child_id]
        self._changed = True
        if self.output_kind == RequestOutputKind.DELTA:
            prev = self._pending_delta.get(output.index)
            if prev is None:
                self._pending_delta[output.index] = output
            else:  # two updates of one child in one step (should not happen, but lose nothing)
                prev.text += output.text
                prev.token_ids = prev.token_ids + output.token_ids
                if output.logprobs is not None:
                    prev.logprobs = (prev.logprobs or []) + output.logprobs
                prev.cumulative_logprob = output.cumulative_logprob
                prev.finish_reason, prev.stop_reason = output.finish_reason, output.stop_reason
        else:
            self._latest[output.index] = output

    def take_outputs(self) -> tuple[list[CompletionOutput], bool] | None:
        """The parent's outputs for this step and whether it is finished, or None when nothing is due.

        CUMULATIVE: every child's latest output (children not started yet as empty placeholders), sorted
        by index, each step something changed. DELTA: only the children that changed, sorted by index.
        FINAL_ONLY: all n outputs once, when the last child finishes.
        """
        if not self._changed or self._returned_final:
            return None
        self._changed = False
        finished = self.finished
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if self.output_kind == RequestOutputKind.DELTA:
            outputs = [self._pending_delta[i] for i in sorted(self._pending_delta)]
            self._pending_delta = {}
        else:
            outputs = [
                out if out is not None else CompletionOutput(index=i, text="", token_ids=[])
                for i, out in enumerate(self._latest)
            ]
        if finished:
            self._returned_final = True
        return outputs, finished
