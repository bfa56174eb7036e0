"""Beam search (vLLM's algorithm and scoring): `LLM.beam_search` drives the offline engine,
`beam_search_async` the async one (the server's `use_beam_search`).

Each step runs every live beam as a one-token request asking for 2 * beam_width logprobs (as HF
transformers, twice the width of candidates per step, so that beams ending in EOS cannot starve the
search); the best `beam_width` extensions over all beams of a prompt survive. Beams are plain token
sequences resubmitted each step: their shared prefixes (the prompt, and the common history of beams
forked from one another) are found in the prefix cache, so only the last partial block is recomputed.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedllm.inputs import TokensPrompt
from pagedllm.logprobs import Logprob
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


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
    try:
        return cumulative_logprob / (seq_len**length_penalty)
    except (OverflowError, ZeroDivisionError):
        # An absurd length_penalty (|penalty * ln(len)| past the float range, e.g. 2.7e16 from a fuzzer):
        # the same formula with the exponent clamped, instead of an exception (a 500).
        return cumulative_logprob * math.exp(-max(-700.0, min(700.0, length_penalty * math.log(max(seq_len, 1)))))


def beam_step_params(params: BeamSearchParams) -> SamplingParams:
    """One beam-search step: a single token with the top 2 x width logprobs of every beam's continuation."""
    return SamplingParams(
        logprobs=2 * params.beam_width,
        max_tokens=1,
        temperature=params.temperature,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def create_sort_beams_key_function(
    eos_token_id: int | None, length_penalty: float
) -> Callable[[BeamSearchSequence], float]:
    return lambda beam: get_beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id, length_penalty)


def expand_beam(
    inst: BeamSearchInstance,
    beam: BeamSearchSequence,
    cands: dict[int, Logprob],
    eos_token_id: int | None,
    ignore_eos: bool,
    new_beams: list[BeamSearchSequence],
) -> None:
    """Extend `beam` by every candidate of its step: EOS extensions complete (unless `ignore_eos`), the
    others go to `new_beams` (the same rule as `LLM.beam_search`)."""
    for tok, lp in cands.items():
        seq = BeamSearchSequence(
            tokens=beam.tokens + [tok], logprobs=beam.logprobs + [cands], cum_logprob=beam.cum_logprob + lp.logprob
        )
        if tok == eos_token_id and not ignore_eos:
            seq.finish_reason, seq.stop_reason = "stop", None
            inst.completed.append(seq)
        else:
            new_beams.append(seq)


class _StepEngine(Protocol):
    """What the async beam search needs of `AsyncLLM`."""

    def generate(
        self, prompt: Any, sampling_params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]: ...


async def beam_search_async(
    engine: _StepEngine,
    prompt_token_ids: list[int],
    params: BeamSearchParams,
    request_id: str,
    *,
    eos_token_id: int | None,
    max_model_len: int,
    tokenizer: Any = None,
    prompt_text: str | None = None,
    skip_special_tokens: bool = True,
) -> RequestOutput:
    """`LLM.beam_search` for one prompt over the async engine (`AsyncLLM.generate`), as vLLM's
    `EngineClient.beam_search`: the `beam_width` best beams, best first, as one finished RequestOutput.

    Each step sends every live beam as a one-token request for 2 * beam_width logprobs, all at once
    (the engine batches them; the shared prefix blocks come from the prefix cache). Cancelling the call
    (client disconnect) cancels the step requests, which aborts them in the engine. Unlike the offline
    method, `text` holds the generated text only (a final EOS not decoded), as vLLM's server.
    """
    width = params.beam_width
    sort_key = create_sort_beams_key_function(eos_token_id, params.length_penalty)
    step_params = beam_step_params(params)
    inst = BeamSearchInstance(list(prompt_token_ids))

    async def run_step(rid: str, beam: BeamSearchSequence) -> RequestOutput | None:
        final: RequestOutput | None = None
        async for out in engine.generate(TokensPrompt(prompt_token_ids=beam.tokens), step_params, rid):
            final = out
        return final

    for step in range(params.max_tokens):
        live = [beam for beam in inst.beams if len(beam.tokens) < max_model_len]
        if not live:
            break
        tasks = [asyncio.ensure_future(run_step(f"{request_id}-s{step}-b{k}", beam)) for k, beam in enumerate(live)]
        try:
            outs = await asyncio.gather(*tasks)
        finally:  # one failed step request (or our cancellation) cancels, and so aborts, its siblings
            for t in tasks:
                if not t.done():
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        new_beams: list[BeamSearchSequence] = []
        for beam, out in zip(live, outs):
            step_lps = out.outputs[0].logprobs if out is not None and out.outputs else None
            if step_lps:
                expand_beam(inst, beam, step_lps[0], eos_token_id, params.ignore_eos, new_beams)
        inst.beams = sorted(new_beams, key=sort_key, reverse=True)[:width]
    for beam in inst.beams:
        beam.finish_reason = beam.finish_reason or "length"
    best = sorted(inst.completed + inst.beams, key=sort_key, reverse=True)[:width]
    plen = len(prompt_token_ids)
    outputs = []
    for i, beam in enumerate(best):
        gen = beam.tokens[plen:]
        shown = gen[:-1] if gen and gen[-1] == eos_token_id and not params.ignore_eos else gen
        if tokenizer is not None:
            beam.text = tokenizer.decode(shown, skip_special_tokens=skip_special_tokens)
        outputs.append(
            CompletionOutput(
                index=i,
                text=beam.text or "",
                token_ids=gen,
                cumulative_logprob=beam.cum_logprob,
                logprobs=beam.logprobs,
                finish_reason=beam.finish_reason,
                stop_reason=beam.stop_reason,
            )
        )
    return RequestOutput(
        request_id=request_id,
        prompt=prompt_text,
        prompt_token_ids=list(prompt_token_ids),
        outputs=outputs,
        finished=True,
    )
