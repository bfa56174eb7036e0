"""Acceptance 2: greedy outputs of every supported architecture (tiny random-weight models saved as
safetensors and loaded by path) equal HF transformers', by the numerical-comparison policy. Prompts are
longer than the sliding windows of the sliding-window variants."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams, TokensPrompt
from tests.hf_utils import compare_greedy, hf_greedy
from tests.utils_model import TINY_VARIANTS, VOCAB, make_tiny_hf_model


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 9, 17, 30, 41, 12, 25, 6)]


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_tiny_model_greedy_matches_hf(variant: str, prompts: list[list[int]], tmp_path) -> None:  # noqa: ANN001
    torch.set_num_threads(2)
    hf = make_tiny_hf_model(variant, tmp_path)
    refs = [hf_greedy(hf, p, 24) for p in prompts]
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=128,
        kv_cache_memory_bytes=8 << 20,
        max_num_batched_tokens=64,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    for p, o, r in zip(prompts, outs, refs):
        compare_greedy(hf, p, list(o.outputs[0].token_ids), r, torch.float32)
    groups = llm.llm_engine.engine_core.engine_core.scheduler.kv.groups
    if "sliding" in variant:
        assert any(g.spec.sliding_window for g in groups)
