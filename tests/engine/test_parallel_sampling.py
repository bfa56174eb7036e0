"""Acceptance 4: n=8 on a 1,000-token prompt computes the prompt's KV once (prefix-cache counters: the 7
siblings hit every full block of the first one's prompt) and the 8 outputs differ."""

from __future__ import annotations

import pytest
import torch

from pagedllm import SamplingParams, TokensPrompt


@pytest.mark.slow  # CI time: run by hand (pytest -m slow)
def test_n8_shares_prompt_kv(smollm2_llm) -> None:  # noqa: ANN001
    # Random ids: a high-entropy continuation (a repeated text would be copied the same way 8 times).
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (1000,), generator=g).tolist()
    llm = smollm2_llm
    llm.reset_prefix_cache()
    kv = llm.llm_engine.engine_core.engine_core.scheduler.kv
    block = kv.block_size
    q0, h0 = kv.prefix_cache_queries, kv.prefix_cache_hits
    sp = SamplingParams(n=8, temperature=1.0, seed=42, max_tokens=12, ignore_eos=True)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
    queries, hits = kv.prefix_cache_queries - q0, kv.prefix_cache_hits - h0
    full_blocks = (len(prompt) - 1) // block * block  # a hit leaves >= 1 token to compute
    assert queries == 8 * len(prompt)
    assert hits == 7 * full_blocks, (hits, full_blocks)
    # So the prompt was computed once plus 7 partial tails: 1000 + 7 * 8 tokens instead of 8000.
    assert queries - hits == len(prompt) + 7 * (len(prompt) - full_blocks)
    assert len(out.outputs) == 8
    assert len({tuple(c.token_ids) for c in out.outputs}) == 8
