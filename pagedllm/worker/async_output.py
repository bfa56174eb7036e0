"""The asynchronous output of a step: its sampled ids copied to the host without waiting for the device,
and the tokens still in flight that the next launched step takes on the device.

With async scheduling the engine core launches step N+1 before reading step N's sampled ids. N's ids then
come back through a non-blocking copy that `AsyncCopier` issues and an event it records; `PendingStep`
holds everything the host bookkeeping needs once they are there (`ModelRunner.finish_step`), with no
reference back into the runner. `InFlightTokens` remembers N's ids on the device, so N+1's decodes, whose
input token is one of them, read it there (`patch`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.logprobs import LogprobsLists
from pagedllm.sample.logprobs_gather import LogprobsTensors

Patch = tuple[torch.Tensor | slice, torch.Tensor]
"""(token indices, sampled ids on the device): input ids the host does not know yet."""


def apply_patch(input_ids: torch.Tensor, patch: Patch) -> None:
    """Write the in-flight ids of `patch` into `input_ids` on the device (a contiguous run by one copy)."""
    rows, ids = patch
    if isinstance(rows, slice):
        input_ids[rows].copy_(ids)
    else:
        input_ids[rows] = ids


class AsyncCopier:
    """Device-to-host copies of sampled ids, each followed by an event on the copy's stream. Two events
    are used alternately (creating an event and looking up the current stream took ~13 us a step on the
    H200 host, recording a kept one ~2 us): at most two launched steps are unread, and re-recording an
    event only moves its wait later on the same stream, so the reuse is safe."""

    def __init__(self) -> None:
        self._events: list[torch.cuda.Event] | None = None
        self._stream: torch.cuda.Stream | None = None
        self._turn = 0

    def copy(
        self, sampled: torch.Tensor, logprobs: LogprobsTensors | None
    ) -> tuple[torch.Tensor, LogprobsTensors | None, torch.cuda.Event | None]:
        """(host ids, host logprobs, event to wait on before reading them); CPU tensors pass through."""
        if sampled.device.type != "cuda":
            return sampled, logprobs, None
        if self._events is None:
            self._events = [torch.cuda.Event(), torch.cuda.Event()]
            self._stream = torch.cuda.current_stream(sampled.device)
        host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
        host.copy_(sampled, non_blocking=True)
        if logprobs is not None:
            logprobs = logprobs.copy_to_host()
        self._turn ^= 1
        event = self._events[self._turn]
        event.record(self._stream)
        return host, logprobs, event


@dataclass
class PendingStep:
    """A launched step: `ModelRunner.finish_step` waits for its sampled ids and does the bookkeeping."""

    req_ids: list[str]
    """The scheduled requests in batch-row order."""
    sample_idx: np.ndarray
    """Indices into req_ids of the requests that sample this step."""
    sampled_host: torch.Tensor | None = None
    event: torch.cuda.Event | None = None
    logprobs: LogprobsTensors | None = None
    """The sampled rows' logprobs, host copies in flight with sampled_host (read after the event)."""
    logprob_rows: list[int] | None = None
    """Positions (in sample_idx order) of the rows whose logprobs were computed."""
    prompt_logprobs_done: dict[str, LogprobsLists] | None = None
    sample_rows: np.ndarray | None = None
    """Batch rows of the sampled requests (in sample_idx order), valid while the batch's version is
    `batch_version` (then tokens are appended by row, without per-request lookups)."""
    sample_outputs: list[list[int]] | None = None
    """The sampled requests' live output-token lists, in sample_idx order (with sample_rows)."""
    batch_version: int = -1
    any_penalty: bool = True
    """Some row of `sample_rows` holds a penalty slot."""
    failed: dict[str, str] | None = None
    """Requests that failed this step (a custom logits processor raised) -> the error."""

    def sampled_ids(self) -> list[int]:
        """The sampled ids (in sample_idx order), waiting for their copy if it is still in flight."""
        if self.event is not None:
            self.event.synchronize()
        assert self.sampled_host is not None
        return self.sampled_host.tolist()

    def logprobs_lists(self) -> list[LogprobsLists | None] | None:
        """Per scheduled request: the logprobs of its sampled token (None: none asked)."""
        if self.logprobs is None or self.logprob_rows is None:
            return None
        lists = self.logprobs.to_lists()
        out: list[LogprobsLists | None] = [None] * len(self.req_ids)
        for pos, j in enumerate(self.logprob_rows):
            out[int(self.sample_idx[j])] = lists.slice(pos, pos + 1)
        return out


class InFlightTokens:
    """The last launched step's sampled ids on the device, by request id, for the next launched step."""

    def __init__(self, arange: np.ndarray) -> None:
        self._arange = arange
        self._sampled: torch.Tensor | None = None
        self._index_of: dict[str, int] = {}
        self._ids: list[str] = []
        """The request ids of the sampled rows, in order (index_of's keys). Never mutated: a new step's ids
        replace the list, and index_of is reused while they are unchanged (steady decoding)."""

    def clear(self) -> None:
        self._sampled = None

    def set(self, sample_ids: list[str], sampled: torch.Tensor | None) -> None:
        if self._sampled is None or self._ids != sample_ids:
            self._index_of = {rid: j for j, rid in enumerate(sample_ids)}
            self._ids = list(sample_ids)
        self._sampled = sampled

    def patch(
        self,
        req_ids: list[str],
        req_of_token: np.ndarray,
        positions: np.ndarray,
        known: np.ndarray,
        device: torch.device,
    ) -> Patch | None:
        """(token indices, in-flight ids for them) for the input tokens not known on the host (position >=
        the row's known token count `known`); the indices are a slice when they are all the step's tokens."""
        unknown = np.nonzero(positions >= known)[0]
        n = len(unknown)
        if not n:
            return None
        sampled = self._sampled
        assert sampled is not None, "a step needs tokens that no launched step samples"
        if (
            n == len(positions) == len(req_ids)
            and self._ids == req_ids
            and np.array_equal(req_of_token, self._arange[:n])
        ):
            # Every request computes one token, its own last sample, in the order the last step sampled them.
            return slice(0, n), sampled[:n]
        index_of = self._index_of
        src = np.fromiter((index_of[req_ids[r]] for r in req_of_token[unknown].tolist()), dtype=np.int64, count=n)
        if n == len(positions) and np.array_equal(src, self._arange[:n]):
            return slice(0, n), sampled[:n]  # steady decoding in another id order: one copy, no gather
        src_t = torch.from_numpy(src).to(device, non_blocking=True)
        return torch.from_numpy(unknown).to(device, non_blocking=True), sampled[src_t]
