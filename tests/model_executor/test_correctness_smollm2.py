"""Acceptance 1 and 3: greedy outputs on the real SmolLM2-135M-Instruct equal HF transformers' (by the
numerical-comparison policy), in one batched call and under every scheduler configuration."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams, TokensPrompt
from tests.hf_utils import compare_greedy

GREEDY48 = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def run(llm: LLM, prompt_ids: list[list[int]], sp: SamplingParams = GREEDY48) -> list[list[int]]:
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def check_all(hf_model, prompt_ids, ours, refs) -> list[str]:  # noqa: ANN001
    return [
        compare_greedy(hf_model, p, o, r[: len(o)], torch.float32).describe() for p, o, r in zip(prompt_ids, ours, refs)
    ]


def test_greedy_matches_hf_batched(smollm2_llm, smollm2_hf_model, smollm2_prompt_ids, smollm2_hf_greedy) -> None:  # noqa: ANN001
    lens = sorted(len(p) for p in smollm2_prompt_ids)
    assert len(smollm2_prompt_ids) >= 20 and lens[0] < 8 and lens[-1] > 25  # mixed lengths
    ours = run(smollm2_llm, smollm2_prompt_ids)
    results = check_all(smollm2_hf_model, smollm2_prompt_ids, ours, smollm2_hf_greedy)
    identical = sum(r.startswith("identical") for r in results)
    print(f"{identical}/{len(results)} identical; {results}")


SUBSET = slice(0, 10)
SP24 = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("default", {}),
        pytest.param("chunked_every_prompt", {"max_num_batched_tokens": 3}, marks=pytest.mark.slow),  # CI time
        pytest.param(
            "preemption",
            {"num_gpu_blocks_override": 12, "max_model_len": 128, "schedule_conservativeness": 0.0},  # admit all
            marks=pytest.mark.slow,
        ),
        pytest.param("no_prefix_cache", {"enable_prefix_caching": False}, marks=pytest.mark.slow),  # CI time
    ],
)
def test_batch_invariance(name, kwargs, smollm2_path, smollm2_hf_model, smollm2_prompt_ids, smollm2_hf_greedy) -> None:  # noqa: ANN001
    prompts = smollm2_prompt_ids[SUBSET]
    refs = smollm2_hf_greedy[SUBSET]
    args = {
        "dtype": "float32",
        "max_model_len": 512,
        "kv_cache_memory_bytes": 64 << 20,
        "gguf_dequantize": True,
        **kwargs,
    }
    llm = LLM(smollm2_path, **args)
    together = run(llm, prompts, SP24)
    check_all(smollm2_hf_model, prompts, together, refs)
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    if name == "preemption":
        assert sched.num_preemptions > 0
    if name == "chunked_every_prompt":
        assert min(len(p) for p in prompts) > 3
    if name == "default":
        # Alone: one prompt per generate call.
        alone = [run(llm, [p], SP24)[0] for p in prompts[:4]]
        check_all(smollm2_hf_model, prompts[:4], alone, refs[:4])
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks - 1


def test_prefix_cache_hits(smollm2_llm) -> None:  # noqa: ANN001
    llm = smollm2_llm
    shared = "You are a helpful assistant. Answer briefly and precisely. " * 4
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    first = llm.generate([shared + "What is the capital of Italy?"], sp, use_tqdm=False)[0]
    again = llm.generate([shared + "What is the capital of Spain?"], sp, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.num_cached_tokens % 16 == 0
    assert first.num_cached_tokens == 0 or first.num_cached_tokens < again.num_cached_tokens
    # Two requests with a shared prefix submitted together share blocks.
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    engine = llm.llm_engine
    long_prefix = "Shared context: " + "alpha beta gamma delta " * 12
    engine.add_request("sa", long_prefix + "one", sp)
    engine.add_request("sb", long_prefix + "two", sp)
    engine.step()
    a = sched.kv.get_block_ids("sa")[0]
    b = sched.kv.get_block_ids("sb")[0]
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    assert common >= 3, (a, b)
    while engine.has_unfinished_requests():
        engine.step()
