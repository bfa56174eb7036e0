"""Multi-LoRA cost on the GPU (issue 21, acceptance 3): one engine per run (dummy bf16 weights of the
Llama-3.1-8B shape), `--mode none` (enable_lora off: the plain path) or `--mode lora` (enable_lora,
max_loras=4, max_lora_rank=16, four random rank-16 adapters on q/k/v/o/gate/up/down written in PEFT's format).

- W3: the batch-1 request (128 in, 256 out), three timed runs after a warm-up; ms per output token. With
  `--mode lora` the request runs on adapter 1.
- W2-shaped: `--w2-requests` requests of 1,024 prompt and 128 output tokens (W2's own prompts; the full W2
  is 1,000); output tok/s. With `--mode lora` request i runs on adapter i % 4.

Prints one JSON line per measurement and writes them all to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any


def write_adapters(hf_config: object, root: str, n: int, rank: int) -> list[str]:
    """n random PEFT adapters (bf16, every q/k/v/o/gate/up/down projection of every layer)."""
    import torch
    from safetensors.torch import save_file

    from pagedllm.lora.peft import expected_shapes

    shapes = expected_shapes(hf_config)
    mods = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    paths = []
    for i in range(n):
        g = torch.Generator().manual_seed(100 + i)
        tensors = {}
        for layer in range(int(hf_config.num_hidden_layers)):  # type: ignore[attr-defined]
            for mod in mods:
                part = "self_attn" if mod in mods[:4] else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{mod}"
                out, inp = shapes[mod]
                tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, inp, generator=g) / inp**0.5).bfloat16()
                tensors[f"{key}.lora_B.weight"] = (torch.randn(out, rank, generator=g) * 0.01).bfloat16()
        path = os.path.join(root, f"adapter{i}")
        os.makedirs(path)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": mods, "bias": "none"}
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(cfg, f)
        paths.append(path)
    return paths


def profile_kernels(llm: object, tp: list, sp: object, lora: object, steps: int = 32) -> list[dict]:
    """GPU kernels of `steps` decode steps (torch.profiler; kernels inside CUDA graphs are listed one by one),
    grouped by name: calls per step and microseconds per step, largest first."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(tp, sp, use_tqdm=False, lora_request=lora)  # type: ignore[attr-defined]
    agg: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.device_time > 0:
            a = agg[e.name[:90]]
            a[0] += 1
            a[1] += e.device_time
    rows: list[dict[str, Any]] = [
        {"kernel": k, "calls_per_step": round(n / steps, 1), "us_per_step": round(t / steps, 1)}
        for k, (n, t) in agg.items()
    ]
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    print(f"kernel time per step: {total:.0f} us over {sum(r['calls_per_step'] for r in rows):.0f} kernels", flush=True)
    for r in rows[:30]:
        print(f"  {r['us_per_step']:8.1f} us  {r['calls_per_step']:6.1f}x  {r['kernel']}", flush=True)
    return rows[:60]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["none", "lora"], required=True)
    p.add_argument("--w2-requests", type=int, default=1000)
    p.add_argument("--skip-w2", action="store_true")
    p.add_argument("--out", default="lora_bench.json")
    p.add_argument("--hf-overrides", default=None, help="JSON: a smaller model of the same shape family (smoke runs)")
    p.add_argument("--w3-tokens", type=int, default=None, help="fewer W3 output tokens (smoke runs)")
    p.add_argument("--profile", action="store_true", help="after W3: a torch.profiler kernel table of 32 decode steps")
    args = p.parse_args()

    from pagedllm import LLM, LoRARequest, SamplingParams, TokensPrompt
    from pagedllm.benchmarks.workloads import get_workload

    w3, model_dir, _ = get_workload("W3")
    lora = args.mode == "lora"
    t0 = time.perf_counter()
    llm = LLM(
        model_dir,
        load_format="dummy",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=2048,
        enable_lora=lora,
        max_loras=4,
        max_lora_rank=16,
        hf_overrides=json.loads(args.hf_overrides) if args.hf_overrides else None,
    )
    startup = time.perf_counter() - t0
    results: list[dict] = []

    def emit(rec: dict) -> None:
        rec.update(mode=args.mode, startup_s=round(startup, 1))
        print(json.dumps(rec), flush=True)
        results.append(rec)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    loras: list = [None] * 4
    if lora:
        root = tempfile.mkdtemp()
        hf_config = llm.llm_engine.model_config.hf_config
        loras = [
            LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(write_adapters(hf_config, root, 4, 16))
        ]

    # W3: batch 1, 128 in, 256 out.
    ((prompt, n_out),) = w3
    n_out = args.w3_tokens or n_out
    sp = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True, detokenize=False)
    tp = [TokensPrompt(prompt_token_ids=prompt)]
    llm.generate(tp, sp.clone(max_tokens=16), use_tqdm=False, lora_request=loras[0])  # warm-up (+ adapter load)
    times = []
    for _ in range(3):
        llm.reset_prefix_cache()
        t = time.perf_counter()
        out = llm.generate(tp, sp, use_tqdm=False, lora_request=loras[0])
        times.append(time.perf_counter() - t)
        assert len(out[0].outputs[0].token_ids) == n_out
    emit({"workload": "W3", "ms_per_token": [round(1000 * x / n_out, 3) for x in times],
          "ms_per_token_median": round(1000 * statistics.median(times) / n_out, 3)})  # fmt: skip

    if args.profile:
        emit({"workload": "W3-profile", "kernels": profile_kernels(llm, tp, sp.clone(max_tokens=33), loras[0])})
    if args.skip_w2:
        return
    w2, _, _ = get_workload("W2")
    w2 = [(q, args.w3_tokens or m) for q, m in w2[: args.w2_requests]]
    prompts = [TokensPrompt(prompt_token_ids=q) for q, _ in w2]
    sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for _, n in w2]
    per_req = [loras[i % 4] for i in range(len(w2))]
    k = min(32, len(w2))  # warm-up: every adapter read and swapped in, prefill/decode shapes compiled
    llm.generate(prompts[:k], [s.clone(max_tokens=8) for s in sps[:k]], use_tqdm=False, lora_request=per_req[:k])
    llm.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate(prompts, sps, use_tqdm=False, lora_request=per_req)
    elapsed = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n == sum(m for _, m in w2)
    emit({"workload": f"W2x{len(w2)}", "elapsed_s": round(elapsed, 2), "output_tok_s": round(n / elapsed, 1),
          "total_tok_s": round((n + sum(len(q) for q, _ in w2)) / elapsed, 1)})  # fmt: skip


if __name__ == "__main__":
    main()
