"""Acceptance 5: beam search (width 4, ignore_eos, fixed length) returns HF transformers' num_beams=4
beams on the real SmolLM2 for 5 prompts; the length-penalty score has its own unit test."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm import BeamSearchParams
from pagedllm.beam_search import BeamSearchSequence, create_sort_beams_key_function, get_beam_search_score
from pagedllm.inputs import TokensPrompt

MAX_TOKENS = 6


def test_length_penalty_formula() -> None:
    # cumulative logprob / seq_len ** length_penalty; seq_len = prompt + output, a final EOS not counted.
    assert get_beam_search_score([5, 6, 7, 8], -2.0, eos_token_id=2, length_penalty=1.0) == pytest.approx(-0.5)
    assert get_beam_search_score([5, 6, 7, 2], -2.0, eos_token_id=2, length_penalty=1.0) == pytest.approx(-2 / 3)
    assert get_beam_search_score([5, 6, 7, 8], -2.0, eos_token_id=2, length_penalty=2.0) == pytest.approx(-2 / 16)
    assert get_beam_search_score([5, 6, 7, 8], -2.0, eos_token_id=2, length_penalty=0.0) == pytest.approx(-2.0)
    assert get_beam_search_score([5, 6, 7, 8], -3.0, eos_token_id=None, length_penalty=0.5) == pytest.approx(-1.5)
    # A higher length penalty favours the longer of two beams with the same per-token logprob.
    key = create_sort_beams_key_function(2, 2.0)
    short = BeamSearchSequence(tokens=[1, 1], logprobs=[], cum_logprob=-1.0)
    long = BeamSearchSequence(tokens=[1, 1, 1, 1], logprobs=[], cum_logprob=-2.0)
    assert key(long) > key(short)


def hf_beams(model, prompt: list[int], width: int, max_new: int) -> list[list[int]]:  # noqa: ANN001
    from transformers import GenerationConfig

    ids = torch.tensor([prompt])
    gc = GenerationConfig(
        num_beams=width,
        num_return_sequences=width,
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=None,
        length_penalty=1.0,
        early_stopping=False,
    )
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    finally:
        model.generation_config.eos_token_id = saved
    return [row[len(prompt) :].tolist() for row in out]


def test_beam_search_matches_hf(smollm2_llm, smollm2_hf_model, smollm2_prompt_ids) -> None:  # noqa: ANN001
    prompts = [smollm2_prompt_ids[i] for i in (0, 1, 4, 8, 12)]
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, ignore_eos=True)
    kv = smollm2_llm.llm_engine.engine_core.engine_core.scheduler.kv
    h0 = kv.prefix_cache_hits
    outs = smollm2_llm.beam_search([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    assert kv.prefix_cache_hits > h0  # beams reuse the cached prefix blocks
    for p, out in zip(prompts, outs):
        ours = [seq.tokens[len(p) :] for seq in out.sequences]
        assert len(ours) == 4 and all(len(s) == MAX_TOKENS for s in ours)
        assert all(seq.tokens[: len(p)] == p for seq in out.sequences)
        scores = [seq.cum_logprob for seq in out.sequences]
        assert scores == sorted(scores, reverse=True)
        assert ours == hf_beams(smollm2_hf_model, p, 4, MAX_TOKENS)


@pytest.mark.parametrize("penalty", [2.7e16, -2.7e16, 1e308, -1e308])
def test_absurd_length_penalty_scores_without_overflow(penalty: float) -> None:
    """A fuzzer's length_penalty (2.7e16 gave a 500: OverflowError) still yields a finite, ordered score."""
    s = get_beam_search_score([1, 2, 3], -2.0, None, penalty)
    assert math.isfinite(s) and s <= 0.0
    assert get_beam_search_score([1, 2, 3], -2.0, None, 1.0) == -2.0 / 3
