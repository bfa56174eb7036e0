"""The output mailbox of one streamed request (`AsyncLLM`): the output processor puts, the request's
coroutine takes; with DELTA outputs, deltas not yet taken are merged so a slow reader loses nothing."""

from __future__ import annotations

import asyncio

from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind


class RequestOutputCollector:
    """The output mailbox of one request, read by the coroutine that streams it (AsyncLLM.generate).

    The producer (`put`) never blocks. An output not read yet is replaced by the newer one (CUMULATIVE
    and FINAL_ONLY outputs carry everything), except in DELTA mode, where the two are merged (texts and
    token ids concatenated) so that a slow reader loses nothing. Single event loop, no threads.
    """

    def __init__(self, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self.output: RequestOutput | Exception | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | Exception) -> None:
        if self.output is None or isinstance(output, Exception) or isinstance(self.output, Exception):
            if not isinstance(self.output, Exception):  # an error already queued stays the answer
                self.output = output
        elif self.aggregate:
            _merge_delta(self.output, output)
        else:
            self.output = output
        self.ready.set()

    async def get(self) -> RequestOutput:
        """Wait for the next output; raises the exception if one was put."""
        while self.output is None:
            await self.ready.wait()
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        """The pending output, or None; raises the exception if one was put."""
        if self.output is None:
            return None
        return self._take()

    def _take(self) -> RequestOutput:
        output = self.output
        self.output = None
        self.ready.clear()
        if isinstance(output, Exception):
            raise output
        assert output is not None
        return output


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    """Fold the DELTA output `new` into the not-yet-read `into` (which owns its lists)."""
    by_index = {c.index: c for c in into.outputs}
    for comp in new.outputs:
        prev = by_index.get(comp.index)
        if prev is None:
            into.outputs.append(comp)
            by_index[comp.index] = comp
            continue
        prev.text += comp.text
        prev.token_ids = prev.token_ids + comp.token_ids
        if comp.logprobs is not None:
            prev.logprobs = (prev.logprobs or []) + comp.logprobs
        prev.cumulative_logprob = comp.cumulative_logprob
        prev.finish_reason = comp.finish_reason
        prev.stop_reason = comp.stop_reason
    into.outputs.sort(key=lambda c: c.index)
    into.finished = new.finished
    into.num_cached_tokens = new.num_cached_tokens
    into.metrics = new.metrics
