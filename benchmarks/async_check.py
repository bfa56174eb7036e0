"""Async scheduling on the device: the same outputs as synchronous scheduling (greedy and seeded sampling,
dummy Qwen3-0.6B weights, CUDA graphs on), and the steps really launched ahead.

    python benchmarks/async_check.py [--model benchmarks/workloads/qwen3-0.6b]
"""

from __future__ import annotations

import argparse
import gc
import json
import random

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="benchmarks/workloads/qwen3-0.6b")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from pagedllm import LLM, SamplingParams, TokensPrompt

    rng = random.Random(0)
    prompts = [
        TokensPrompt(prompt_token_ids=[rng.randrange(100, 30000) for _ in range(rng.randint(20, 300))])
        for _ in range(args.num_prompts)
    ]
    sps = [
        SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, detokenize=False),
        SamplingParams(temperature=0.7, seed=11, max_tokens=48, ignore_eos=True, detokenize=False),
    ]
    results = {}
    for mode in (False, True):
        llm = LLM(
            args.model,
            load_format="dummy",
            skip_tokenizer_init=True,
            max_model_len=1024,
            async_scheduling=mode,
            gpu_memory_utilization=0.5,
        )
        outs = []
        for sp in sps:
            outs.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)])
        results[mode] = (outs, llm.llm_engine.engine_core.engine_core.num_steps_ahead)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    same = [a == b for a, b in zip(results[False][0], results[True][0])]
    report = {"identical_greedy": same[0], "identical_seeded": same[1], "steps_ahead": results[True][1]}
    print("async vs sync:", json.dumps(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
