"""Acceptance 3: a seeded request gives the same tokens alone, inside a batch of 32 mixed requests, and
with chunked prefill forced (every prompt prefilled in 16-token chunks)."""

from __future__ import annotations

from pagedllm import SamplingParams, TokensPrompt

TARGET = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)


def mixed_params(i: int) -> SamplingParams:
    """31 companions covering greedy, unseeded and seeded sampling, penalties, logprobs, filters."""
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=12),
        SamplingParams(temperature=0.7, seed=i, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.3, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=1.1, presence_penalty=0.8, min_p=0.05, max_tokens=18, ignore_eos=True),
        SamplingParams(temperature=0.8, logprobs=3, prompt_logprobs=1, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=5, logit_bias={28: 2.0}, min_tokens=4, max_tokens=14),
        SamplingParams(temperature=0.0, bad_words=["the", "The"], max_tokens=11, ignore_eos=True),
    ]
    return kinds[i % len(kinds)]


def run(llm, prompt_ids, target_prompt: list[int], batch: bool) -> list[int]:  # noqa: ANN001
    if not batch:
        out = llm.generate([TokensPrompt(prompt_token_ids=target_prompt)], TARGET, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)
    prompts = [TokensPrompt(prompt_token_ids=prompt_ids[i % len(prompt_ids)]) for i in range(31)]
    params = [mixed_params(i) for i in range(31)]
    # The target sits in the middle of the batch (its row differs from the alone run).
    prompts.insert(13, TokensPrompt(prompt_token_ids=target_prompt))
    params.insert(13, TARGET)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == 32
    return list(outs[13].outputs[0].token_ids)


def test_seed_reproducible_alone_batched_and_chunked(smollm2_llm, smollm2_llm_chunked, smollm2_prompt_ids) -> None:  # noqa: ANN001
    target_prompt = smollm2_prompt_ids[-1]  # the chat prompt: > 16 tokens, so it is chunked below
    assert len(target_prompt) > 32
    alone = run(smollm2_llm, smollm2_prompt_ids, target_prompt, batch=False)
    assert len(alone) == 16
    assert run(smollm2_llm, smollm2_prompt_ids, target_prompt, batch=False) == alone
    assert run(smollm2_llm, smollm2_prompt_ids, target_prompt, batch=True) == alone
    assert run(smollm2_llm_chunked, smollm2_prompt_ids, target_prompt, batch=False) == alone
    assert run(smollm2_llm_chunked, smollm2_prompt_ids, target_prompt, batch=True) == alone
    # A different seed gives a different sample (the seed is really used).
    other = (
        smollm2_llm.generate([TokensPrompt(prompt_token_ids=target_prompt)], TARGET.clone(seed=4321), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    assert list(other) != alone
