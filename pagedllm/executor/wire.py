"""Compact per-step messages between the engine core and its worker processes.

In steady decoding every step schedules the same requests, one token each, and every step's result is
one sampled token per request. The full `SchedulerOutput` / `ModelRunnerOutput` then repeat the same 256
request ids (and a dict of 256 ones) each way, each step: pickling and unpickling them was ~180 us a step
on this dev box at 256 decodes, on the engine's critical path when the device waits for the host. A
steady step goes as `SteadyStep` (the computed-token counts and new block ids only) and a steady result as
`SteadyOutput` (the flat token list); each side rebuilds the full object from the ids of the last message
it saw. Both ends see the messages in one order (one PUB socket to every worker; the output rank's results
to one PULL socket), so both hold the same "last ids". Anything else goes in full.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.scheduler_output import CachedRequestData, ModelRunnerOutput, SchedulerOutput


@dataclass(slots=True)
class SteadyStep:
    """A step scheduling exactly the last step's requests, one token each, with nothing else to say."""

    num_computed_tokens: list[int]
    new_block_ids: list


@dataclass(slots=True)
class SteadyOutput:
    """A result with one sampled token per request of the last result, and nothing else."""

    tokens: list[int]


class StepEncoder:
    """The engine core's side of the step messages (one per executor)."""

    def __init__(self) -> None:
        self._last_ids: list[str] | None = None

    def encode(self, so: SchedulerOutput) -> SchedulerOutput | SteadyStep:
        c = so.scheduled_cached_reqs
        ids = c.req_ids
        last, self._last_ids = self._last_ids, ids
        if (
            ids == last
            and so.total_num_scheduled_tokens == len(ids)
            and not so.scheduled_new_reqs
            and not so.finished_req_ids
            and not so.preempted_req_ids
            and not so.scheduled_spec_decode_tokens
            and so.grammar_bitmask is None
            and not so.structured_output_request_ids
            and not so.scheduled_encoder_inputs
            and not so.free_encoder_hashes
            and not c.new_token_ids
            and True not in c.resumed_from_preemption
        ):
            return SteadyStep(c.num_computed_tokens, c.new_block_ids)
        return so


class StepDecoder:
    """A worker's side: rebuilds a `SteadyStep` into the `SchedulerOutput` it stands for."""

    def __init__(self) -> None:
        self._last_ids: list[str] = []
        self._ones: dict[str, int] = {}

    def decode(self, payload: SchedulerOutput | SteadyStep) -> SchedulerOutput:
        if isinstance(payload, SchedulerOutput):
            ids = payload.scheduled_cached_reqs.req_ids
            if ids != self._last_ids:
                self._last_ids, self._ones = ids, {}
            return payload
        ids = self._last_ids
        if len(self._ones) != len(ids):
            self._ones = dict.fromkeys(ids, 1)
        n = len(ids)
        cached = CachedRequestData(ids, [False] * n, payload.new_block_ids, payload.num_computed_tokens)
        return SchedulerOutput([], cached, self._ones, n)


class OutputEncoder:
    """The output rank's side of the results."""

    def __init__(self) -> None:
        self._last_ids: list[str] | None = None

    def encode(self, out: ModelRunnerOutput) -> ModelRunnerOutput | SteadyOutput:
        ids = out.req_ids
        last, self._last_ids = self._last_ids, ids
        lists = out.sampled_token_ids
        if (
            ids == last
            and out.logprobs is None
            and not out.prompt_logprobs
            and not out.failed
            and not out.pooler_output
            and out.spec_token_ids is None
            and set(map(len, lists)) == {1}
        ):
            return SteadyOutput([t[0] for t in lists])
        return out


class OutputDecoder:
    """The engine core's side of the results (decoded in arrival order)."""

    def __init__(self) -> None:
        self._last_ids: list[str] = []

    def decode(self, payload: ModelRunnerOutput | SteadyOutput) -> ModelRunnerOutput:
        if isinstance(payload, ModelRunnerOutput):
            self._last_ids = payload.req_ids
            return payload
        return ModelRunnerOutput(self._last_ids, [[t] for t in payload.tokens])
