"""Where a W6 (Qwen3-30B-A3B shape, dummy bf16) step's GPU time goes: the MoE block (routing, token
placement, grouped GEMMs, SiLU, sum over k), attention (paged attention, RoPE + KV-cache write), the dense
GEMMs (q/k/v, o, router, LM head) and the rest (norms, sampler), as kernel device time grouped by kernel
name. Eager mode (kernel device times are those a CUDA graph replays; the graph removes the launch gaps).
Profiles decode steps at the full batch of 256 after every prompt is prefilled, and one prefill step.

    python3 benchmarks/moe_step_split.py --out $OUT/w6_split.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from pagedllm import LLM, SamplingParams, TokensPrompt
from pagedllm.benchmarks.workloads import get_workload

# Kernel-name fragments per category, first match wins. "reduce_kernel" is the MoE's sum over the k
# experts (W6 has no other reduction kernel in a step but the sampler's, which is small).
CATEGORIES = (
    (
        "moe",
        (
            "_grouped_gemm",
            "_topk_softmax",
            "_count_experts",
            "_place_pairs",
            "_silu_and_mul",
            "reduce_kernel",
            "_moe_sum",
        ),
    ),
    ("attention", ("_paged_attn", "_rope", "cache")),
    ("dense_gemm", ("nvjet", "gemm", "cutlass", "xmma", "_gemv")),
)


def split(prof: Any, steps: int) -> dict[str, float]:
    """ms of kernel time per step by category."""
    cats = {name: 0.0 for name, _ in CATEGORIES} | {"other": 0.0}
    for ev in prof.key_averages():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        cat = next((name for name, frags in CATEGORIES if any(f in ev.key for f in frags)), "other")
        cats[cat] += ev.self_device_time_total / 1e3 / steps
    cats["total"] = sum(cats.values())
    return {f"{k}_ms": v for k, v in cats.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", default="W6")
    p.add_argument("--decode-steps", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    reqs, model_dir, temp = get_workload(a.workload)
    llm = LLM(
        model=model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=2048,
        enforce_eager=True,
        async_scheduling=False,
        enable_prefix_caching=False,
    )
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    for i, (prompt, _) in enumerate(reqs):
        sp = SamplingParams(temperature=temp, max_tokens=100, ignore_eos=True, detokenize=False)
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=prompt), sp)
    res: dict[str, Any] = {"gpu": torch.cuda.get_device_name()}
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    engine.step()  # warm-up (compiles)
    with profile(activities=acts) as prof:
        engine.step()
        torch.cuda.synchronize()
    res["prefill_step"] = split(prof, 1)
    res["tokens_computed_after_two_steps"] = int(sum(r.num_computed_tokens for r in core.scheduler.running))
    print("prefill step, kernels by device time:")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
    while core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running):
        engine.step()
    engine.step()
    with profile(activities=acts) as prof:
        for _ in range(a.decode_steps):
            engine.step()
        torch.cuda.synchronize()
    res["decode_batch"] = len(core.scheduler.running)
    res["decode_step"] = split(prof, a.decode_steps)
    print(json.dumps(res, indent=1))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=50))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
