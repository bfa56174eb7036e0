"""Shared by the parallel-executor tests: tiny checkpoints, one engine run, and the comparison against tp=1."""

from __future__ import annotations

import random
from typing import Any

import pytest

from pagedllm import LLM, SamplingParams, TokensPrompt
from tests.utils_model import VOCAB

LOGPROB_TOL = 1e-4
"""The issue's bound on |logprob(tp=n) - logprob(tp=1)| for the same token at the same step."""
NEAR_TIE = 1e-3
"""A greedy divergence passes only where the reference's top-2 logprob gap is below this (float32)."""
MAX_TOKENS = 12


def tiny_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 9, 17, 30, 41, 6)]


def run_engine(model: str, prompts: list[list[int]], max_tokens: int = MAX_TOKENS, **kwargs: Any) -> list[Any]:
    """Greedy outputs (with the top-2 logprobs per step) of one engine, shut down afterwards."""
    args: dict[str, Any] = {
        "dtype": "float32",
        "skip_tokenizer_init": True,
        "max_model_len": 128,
        "kv_cache_memory_bytes": 8 << 20,
        "max_num_batched_tokens": 64,
        **kwargs,
    }
    llm = LLM(model, **{k: v for k, v in args.items() if v is not None})
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, logprobs=2)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        return [o.outputs[0] for o in outs]
    finally:
        llm.llm_engine.engine_core.shutdown()


def assert_same_outputs(ref: list[Any], got: list[Any]) -> None:
    """Greedy tokens equal up to the first divergence (allowed only at a near tie of the reference), and the
    logprobs of the shared steps within LOGPROB_TOL by token id."""
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        r_ids, g_ids = list(r.token_ids), list(g.token_ids)
        assert len(r_ids) == len(g_ids)
        for step, (rt, gt) in enumerate(zip(r_ids, g_ids)):
            r_lp, g_lp = r.logprobs[step], g.logprobs[step]
            if rt != gt:
                top = sorted((lp.logprob for lp in r_lp.values()), reverse=True)
                gap = top[0] - top[1]
                if gap >= NEAR_TIE:
                    pytest.fail(f"prompt {i}: diverges at step {step} ({rt} vs {gt}), reference top-2 gap {gap:.2e}")
                break
            for tok, lp in r_lp.items():
                if tok in g_lp:
                    diff = abs(lp.logprob - g_lp[tok].logprob)
                    assert diff < LOGPROB_TOL, f"prompt {i} step {step} token {tok}: logprob differs by {diff:.2e}"
            assert rt in g_lp
