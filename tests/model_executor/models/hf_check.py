"""Issue 18's acceptance check, shared by the model tests: greedy tokens equal HF transformers' (float32,
CPU, by the numerical-comparison policy) for a batch of prompts of mixed lengths, once with a large token
budget and once with chunked prefill forced, and prompt logprobs within 1e-4 of HF's teacher-forced ones."""

from __future__ import annotations

import random

import torch

from pagedllm import LLM, SamplingParams, TokensPrompt
from tests.hf_utils import compare_greedy, hf_greedy, hf_logprobs
from tests.utils_model import VOCAB

MAX_TOKENS = 32
LOGPROB_TOL = 1e-4


def mixed_prompts(seed: int = 18) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 9, 17, 30, 41, 12, 25, 6)]


def check_against_hf(hf, model_dir: str, prompts: list[list[int]], expect_sliding_group: bool = False) -> None:  # noqa: ANN001
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    ref_lps = [hf_logprobs(hf, p) for p in prompts]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False, prompt_logprobs=0)
    reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    for chunk in (256, 16):  # 16: every prompt above 16 tokens is prefilled in chunks
        llm = LLM(
            model_dir,
            dtype="float32",
            skip_tokenizer_init=True,
            max_model_len=128,
            kv_cache_memory_bytes=8 << 20,
            max_num_batched_tokens=chunk,
            enable_prefix_caching=False,
        )
        outs = llm.generate(reqs, sp, use_tqdm=False)
        for p, o, r, ref_lp in zip(prompts, outs, refs, ref_lps):
            compare_greedy(hf, p, list(o.outputs[0].token_ids), r, torch.float32)
            plp = o.prompt_logprobs
            assert plp is not None and plp[0] is None and len(plp) == len(p)
            for i in range(1, len(p)):
                got, want = plp[i][p[i]].logprob, float(ref_lp[i - 1, p[i]])
                assert abs(got - want) < LOGPROB_TOL, (chunk, i, got, want)
        groups = llm.llm_engine.engine_core.engine_core.scheduler.kv.groups
        assert any(g.spec.sliding_window for g in groups) == expect_sliding_group
        del llm
