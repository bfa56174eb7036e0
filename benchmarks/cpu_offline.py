"""Offline CPU throughput: pagedllm `LLM.generate` vs HF transformers' batched left-padded greedy `generate`
on SmolLM2-135M-Instruct, both in the same run (2 threads), plus the matmul ceiling measured here.

    python benchmarks/cpu_offline.py --dtype float32 bfloat16 --json out.json

Workloads: (a) 64 prompts x 128 tokens (ignore_eos); (b) 64 prompts, output lengths uniform in 16..256
(ignore_eos; only requested tokens count; HF's static batch runs to the longest); (c) single stream,
1 prompt x 128 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

TOPICS = ["a dragon", "the ocean", "a robot", "Paris", "quantum physics", "a lost key", "the moon", "a chef"]


def make_prompts(n: int) -> list[str]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        words = " ".join(rng.choice(["very", "quite", "rather", "truly"]) for _ in range(rng.randrange(0, 12)))
        out.append(f"Write a {words} short story about {TOPICS[i % len(TOPICS)]}, number {i}:")
    return out


def matmul_ceiling(dtype: torch.dtype, m: int, k: int, n: int, iters: int = 20) -> float:
    """Measured GFLOP/s of an [m,k]x[k,n] matmul."""
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(k, n).to(dtype)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    return 2 * m * k * n * iters / (time.perf_counter() - t) / 1e9


def bench_hf(model, tok, prompts: list[str], max_new: int) -> tuple[float, int]:  # noqa: ANN001
    from transformers import GenerationConfig

    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    gc = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**enc, generation_config=gc)
        dt = time.perf_counter() - t
    finally:
        model.generation_config.eos_token_id = saved
    return dt, int((out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0])


def bench_ours(llm, prompts: list[str], lens: list[int]) -> tuple[float, int]:  # noqa: ANN001
    from pagedllm import SamplingParams

    sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
    llm.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    dt = time.perf_counter() - t
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("PAGEDLLM_CPU_THREADS", "2")))
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM
    from pagedllm.transformers_utils.config import default_model_path

    path = default_model_path()
    prompts = make_prompts(args.num_prompts)
    rng = random.Random(1)
    var_lens = [rng.randint(16, 256) for _ in prompts]
    results: dict[str, dict] = {}
    for dname in args.dtype:
        dtype = getattr(torch, dname)
        res: dict[str, float] = {}
        # Ceiling: the decode step's dominant matmul shapes (batch 64) and a big square one.
        res["matmul_gflops_64x576x1536"] = matmul_ceiling(dtype, 64, 576, 1536, 200)
        res["matmul_gflops_1024cubed"] = matmul_ceiling(dtype, 1024, 1024, 1024, 10)
        llm = LLM(path, dtype=dname, max_model_len=1024, kv_cache_memory_bytes=1 << 30)
        model = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.model
        # Packed linears (cpu_gemm) released their plain weights: count them by their packed shapes.
        n_params = sum(p.numel() for p in model.parameters()) + sum(
            m.packed_out_features * m.packed_in_features
            for m in model.modules()
            if hasattr(m, "packed_weight") and m.weight.numel() == 0
        )
        emb = llm.llm_engine.model_config.vocab_size * llm.llm_engine.model_config.hf_config.hidden_size
        # FLOPs per decoded token: 2 x (non-embedding params + the lm_head, tied to the embedding).
        flops_tok = 2 * (n_params - emb + emb)
        ceiling_tps = res["matmul_gflops_64x576x1536"] * 1e9 / flops_tok
        res["ceiling_tok_s"] = ceiling_tps
        llm.generate(prompts[:4], None, use_tqdm=False)  # warm-up
        dt, n = bench_ours(llm, prompts, [128] * len(prompts))
        res["ours_a_tok_s"] = n / dt
        dt, n = bench_ours(llm, prompts, var_lens)
        res["ours_b_tok_s"] = n / dt
        dt, n = bench_ours(llm, prompts[:1], [128])
        res["ours_single_tok_s"] = n / dt
        del llm
        if not args.skip_hf:
            from pagedllm.transformers_utils.tokenizer import get_tokenizer

            tok = get_tokenizer(path)
            hf = AutoModelForCausalLM.from_pretrained(
                os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype
            ).eval()
            bench_hf(hf, tok, prompts[:4], 4)
            dt, n = bench_hf(hf, tok, prompts, 128)
            res["hf_a_tok_s"] = n / dt
            dt, _ = bench_hf(hf, tok, prompts, max(var_lens))
            res["hf_b_tok_s"] = sum(var_lens) / dt  # only requested tokens count
            dt, n = bench_hf(hf, tok, prompts[:1], 128)
            res["hf_single_tok_s"] = n / dt
            del hf
        results[dname] = res
    print(f"{'dtype':9} {'workload':22} {'pagedllm':>9} {'HF':>9} {'ratio':>6} {'of ceiling':>10}")
    for dname, r in results.items():
        for key, label in (("a", "64 x 128"), ("b", "64 x U(16,256)"), ("single", "single stream x 128")):
            ours = r[f"ours_{key}_tok_s"]
            hf = r.get(f"hf_{key}_tok_s")
            ratio = f"{ours / hf:6.2f}" if hf else "     -"
            print(f"{dname:9} {label:22} {ours:9.1f} {hf or 0:9.1f} {ratio} {ours / r['ceiling_tok_s']:10.1%}")
        print(
            f"{dname:9} matmul ceiling {r['matmul_gflops_64x576x1536']:.1f} GFLOP/s (64x576x1536), "
            f"{r['matmul_gflops_1024cubed']:.1f} (1024^3) -> {r['ceiling_tok_s']:.0f} tok/s"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
