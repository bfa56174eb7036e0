"""Where a W6 (Qwen3-30B-A3B shape, dummy bf16) step's GPU time goes: attention (the paged attention op,
RoPE and KV-cache write included), the q/k/v and o projections, the MoE block (router, routing, sort,
grouped GEMMs, SiLU, sum) and everything else (norms, embedding, LM head, sampler), as device time of the
kernels launched inside each module (torch.profiler ranges opened by forward hooks; a kernel counts
under the innermost range above the op that launched it). Eager mode (kernel
device times are those a CUDA graph replays; the graph removes the launch gaps). Profiles decode steps at
the full batch of 256 after every prompt is prefilled, and one prefill step.

    python3 benchmarks/moe_step_split.py --out $OUT/w6_split.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from pagedllm import LLM, SamplingParams, TokensPrompt
from pagedllm.attention.layer import Attention
from pagedllm.benchmarks import floors
from pagedllm.benchmarks.workloads import get_workload
from pagedllm.model_executor.models.llama import LlamaAttention
from pagedllm.model_executor.models.moe_common import SparseMoeBlock

RANGES = {SparseMoeBlock: "split::moe", Attention: "split::attn_core", LlamaAttention: "split::attn_block"}


def add_ranges(model: torch.nn.Module) -> None:
    def pre(name: str) -> Any:
        def hook(mod: torch.nn.Module, args: Any) -> None:
            mod._split_rf = record_function(name)  # type: ignore[attr-defined]
            mod._split_rf.__enter__()  # type: ignore[attr-defined]

        return hook

    def post(mod: torch.nn.Module, args: Any, out: Any) -> None:
        mod._split_rf.__exit__(None, None, None)  # type: ignore[attr-defined]

    for m in model.modules():
        for cls, name in RANGES.items():
            if isinstance(m, cls):
                m.register_forward_pre_hook(pre(name))
                m.register_forward_hook(post)


def split(prof: Any, steps: int) -> dict[str, float]:
    """ms of kernel time per step by category: each kernel goes to the innermost `split::` range above
    the CPU op that launched it (the MoE block, the attention op inside the attention block, the rest
    of the attention block), else to "other"."""
    cats = {"moe_ms": 0.0, "attention_ms": 0.0, "qkv_o_proj_ms": 0.0, "other_ms": 0.0}
    key = {"split::moe": "moe_ms", "split::attn_core": "attention_ms", "split::attn_block": "qkv_o_proj_ms"}
    for ev in prof.events():
        kernels = getattr(ev, "kernels", None) or []
        if not kernels:
            continue
        us = sum(k.duration for k in kernels)
        anc, cat = ev, "other_ms"
        while anc is not None:
            if anc.name in key:
                cat = key[anc.name]
                break
            anc = anc.cpu_parent
        cats[cat] += us / 1e3 / steps
    cats["total_ms"] = sum(cats.values())
    return cats


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
    model = floors.in_process_model(llm)
    assert model is not None
    add_ranges(model)
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
