"""Phi-3 LongRoPE (the 128k variants' `rope_scaling`): against HF transformers in float32 on a tiny random
checkpoint. HF picks the short factors while a sequence is within `original_max_position_embeddings` and the
long ones past it; the engine picks once from max_model_len, as vLLM. So: an engine whose max_model_len is
within the original length equals HF on short sequences, and one allowed longer sequences equals HF on
sequences that start past the original length (where HF uses the long factors from the first forward on)."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams, TokensPrompt
from tests.hf_utils import compare_greedy, hf_greedy, hf_logprobs
from tests.model_executor.models.tiny_configs import DENSE_VARIANTS, tiny_config
from tests.utils_model import TINY_COMMON, VOCAB, make_tiny_hf_model

ORIG = 32


@pytest.fixture(scope="module")
def phi3_longrope(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, str]:
    d = str(tmp_path_factory.mktemp("phi3_longrope"))
    name, base = DENSE_VARIANTS["phi3"]
    half = (TINY_COMMON["hidden_size"] // TINY_COMMON["num_attention_heads"]) // 2
    g = torch.Generator().manual_seed(0)
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 1.0,
        "short_factor": (1.0 + torch.rand(half, generator=g)).tolist(),
        "long_factor": (2.0 + 6.0 * torch.rand(half, generator=g)).tolist(),
    }
    over = {**base, "rope_parameters": rope, "original_max_position_embeddings": ORIG, "max_position_embeddings": 256}
    cfg = tiny_config({"phi3_longrope": (name, over)}, "phi3_longrope")
    return make_tiny_hf_model("phi3", d, config=cfg), d


def _run(d: str, max_model_len: int, prompts: list[list[int]], n: int) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and the prompt tokens' logprobs (from the second on) per prompt."""
    llm = LLM(d, dtype="float32", skip_tokenizer_init=True, max_model_len=max_model_len, kv_cache_memory_bytes=8 << 20)
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False, prompt_logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    del llm
    res = []
    for p, o in zip(prompts, outs):
        plp = o.prompt_logprobs
        assert plp is not None
        res.append((list(o.outputs[0].token_ids), [plp[i][p[i]].logprob for i in range(1, len(p))]))
    return res


@pytest.mark.parametrize("long", [False, True], ids=["short_factors", "long_factors"])
def test_phi3_longrope_matches_hf(phi3_longrope: tuple[object, str], long: bool) -> None:
    hf, d = phi3_longrope
    rng = random.Random(7)
    if long:  # sequences past the original length from their first forward on
        lens, n, max_len = (40, 57, 33, 70), 24, 128
    else:  # sequences that stay within it
        lens, n, max_len = (3, 9, 17, 5), ORIG - 18, ORIG
    prompts = [[rng.randrange(VOCAB) for _ in range(k)] for k in lens]
    got = _run(d, max_len, prompts, n)
    for p, (toks, lps) in zip(prompts, got):
        compare_greedy(hf, p, toks, hf_greedy(hf, p, n), torch.float32)
        ref = hf_logprobs(hf, p)
        want = [float(ref[i - 1, p[i]]) for i in range(1, len(p))]
        assert max(abs(a - b) for a, b in zip(lps, want)) < 1e-4


def test_longrope_factors_differ(phi3_longrope: tuple[object, str]) -> None:
    """The two engines really use different rotations (the test above could not tell them apart otherwise)."""
    _, d = phi3_longrope
    p = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
    (_, short), (_, long) = _run(d, ORIG, p, 1)[0], _run(d, 128, p, 1)[0]
    assert max(abs(a - b) for a, b in zip(short, long)) > 1e-2
