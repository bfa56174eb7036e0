"""Pipeline-parallel throughput on the CPU with the batch queue on (pp batches in flight) and off
(`PAGEDLLM_MAX_CONCURRENT_BATCHES=1`: one batch at a time), alternating off / on.

    PYTHONPATH=. python benchmarks/pp_overlap.py [--pp 2] [--layers 8] [--hidden 512] [--requests 64]

A random float32 Llama (built here from a transformers config; nothing is downloaded), greedy, EOS
ignored. Prints output tok/s per run and the on/off ratio of the medians. On a GPU add `--device cuda`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def build_model(path: str, layers: int, hidden: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 128, 1),
        max_position_embeddings=1024,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)


def run(path: str, args: argparse.Namespace, max_batches: int) -> float:
    from pagedllm import LLM, SamplingParams, TokensPrompt

    os.environ["PAGEDLLM_MAX_CONCURRENT_BATCHES"] = str(max_batches)
    llm = LLM(
        path,
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=512,
        pipeline_parallel_size=args.pp,
        max_num_seqs=args.requests,
        kv_cache_memory_bytes=256 << 20,
        device=args.device,
    )
    try:
        prompts = [
            TokensPrompt(prompt_token_ids=[(7 * i + j) % 4000 + 1 for j in range(args.input_len)])
            for i in range(args.requests)
        ]
        sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
        llm.generate(prompts[:2], sp, use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        core = llm.llm_engine.engine_core.engine_core
        bq = core.batch_queue
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        print(
            f"max_concurrent_batches={max_batches}: {n / dt:8.1f} output tok/s ({dt:.2f} s), "
            f"max in flight {bq.max_in_flight}, overlapped launches {bq.num_overlapped_launches}",
            flush=True,
        )
        return n / dt
    finally:
        llm.llm_engine.engine_core.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as path:
        build_model(path, args.layers, args.hidden)
        res: dict[int, list[float]] = {1: [], args.pp: []}
        for _ in range(args.runs):
            for mb in (1, args.pp):
                res[mb].append(run(path, args, mb))
    off, on = statistics.median(res[1]), statistics.median(res[args.pp])
    print(f"median: off {off:.1f} tok/s, on {on:.1f} tok/s, on/off {on / off:.3f}")


if __name__ == "__main__":
    main()
