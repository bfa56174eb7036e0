"""Beam search over the offline engine (vLLM's algorithm and scoring).

Each step runs every live beam as a one-token request asking for 2 * beam_width logprobs (as HF
transformers, twice the width of candidates per step, so that beams ending in EOS cannot starve the
search); the best `beam_width` extensions over all beams of a prompt survive. Beams are plain token
sequences resubmitted each step: their shared prefixes (the prompt, and the common history of beams
forked from one another) are found in the prefix cache, so only the last partial block is recomputed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.logprobs import Logprob


@dataclass
class BeamSearchSequence:
    tokens: list[int]
    """Prompt tokens followed by the generated ones (as vLLM)."""
    logprobs: list[dict[int, Logprob]]
    """Per generated token, the candidates' logprobs at that step."""
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]
    """The best beams, best first."""


@dataclass
class BeamSearchInstance:
    prompt_tokens: list[int]
    beams: list[BeamSearchSequence] = field(default_factory=list)
    completed: list[BeamSearchSequence] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.beams:
            self.beams = [BeamSearchSequence(tokens=list(self.prompt_tokens), logprobs=[])]


def get_beam_search_score(
    tokens: list[int], cumulative_logprob: float, eos_token_id: int | None, length_penalty: float = 1.0
) -> float:
    """vLLM's score: cumulative logprob / seq_len ** length_penalty, where seq_len counts all the
    sequence's tokens (prompt included) except a final EOS."""
    seq_len = len(tokens)
    if eos_token_id is not None and tokens and tokens[-1] == eos_token_id:
        seq_len -= 1
    return cumulative_logprob / (seq_len**length_penalty)


def create_sort_beams_key_function(
    eos_token_id: int | None, length_penalty: float
) -> Callable[[BeamSearchSequence], float]:
    return lambda beam: get_beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id, length_penalty)
