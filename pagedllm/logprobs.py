"""Logprob data: the engine core's plain lists (`LogprobsLists`) and the front end's `Logprob` dicts.

Core -> front end, one entry per position: position i lists token ids `token_ids[i]`, their
`logprobs[i]` and `ranks[i]` (1 = most likely). The first id of a position is the sampled token
(generated positions) or the actual next prompt token (prompt positions); the top-k tokens follow
(ranks 1..k), then any `logprob_token_ids` the request asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


@dataclass
class Logprob:
    """One token's logprob at one position (vLLM's `Logprob`)."""

    logprob: float
    rank: int | None = None
    """1-based rank in the whole vocabulary (ties count as ranked above: rank = #{logprob >= this})."""
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
"""Per generated token: token id -> Logprob (the sampled token, the top-k, requested ids)."""
PromptLogprobs = list[dict[int, Logprob] | None]
"""Per prompt token: None for the first one (nothing predicts it), then a dict as for samples."""


class LogprobsLists(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    token_ids: list[list[int]] = msgspec.field(default_factory=list)
    logprobs: list[list[float]] = msgspec.field(default_factory=list)
    ranks: list[list[int]] = msgspec.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, other: LogprobsLists) -> None:
        self.token_ids.extend(other.token_ids)
        self.logprobs.extend(other.logprobs)
        self.ranks.extend(other.ranks)

    def slice(self, start: int, end: int) -> LogprobsLists:
        return LogprobsLists(self.token_ids[start:end], self.logprobs[start:end], self.ranks[start:end])
