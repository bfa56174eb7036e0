"""Micro-benchmark of the batched sampler: time per step for a [batch, vocab] logits table (default
256 x 128,256, Llama 3's vocabulary) under several request mixes. Not a test.

    python benchmarks/sampler_bench.py [--batch 256] [--vocab 128256] [--iters 5] [--device cpu]

Times `Sampler.forward` only (logits cloned and metadata built outside the timed region; in the engine,
penalty counts come from persistent per-request slots, so building them is not per-step work). On CUDA
the metadata carries per-row noise keys as the model runner's does (one-pass sampling for seeded rows);
`PAGEDLLM_ONE_PASS_SAMPLING=0` times the unfused sampler.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.sample.sampler import Sampler
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampling_batch import build_sampling_metadata


def mixes(batch: int) -> dict[str, list[SamplingParams]]:
    def mixed(i: int) -> SamplingParams:
        k = i % 8
        if k == 0:
            return SamplingParams(temperature=0.0)
        if k == 1:
            return SamplingParams(temperature=0.8, seed=i)
        if k == 2:
            return SamplingParams(temperature=0.7, top_p=0.9)
        if k == 3:
            return SamplingParams(temperature=1.0, top_k=50)
        if k == 4:
            return SamplingParams(temperature=0.9, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.2)
        if k == 5:
            return SamplingParams(temperature=0.0, logprobs=5)
        if k == 6:
            return SamplingParams(temperature=1.0, presence_penalty=0.5, logit_bias={1: 1.0, 2: -1.0})
        return SamplingParams(temperature=0.6, top_k=40, top_p=0.95, logprobs=1)

    return {
        "greedy": [SamplingParams(temperature=0.0)] * batch,
        "temperature": [SamplingParams(temperature=0.8)] * batch,
        "top_k=50": [SamplingParams(temperature=0.8, top_k=50)] * batch,
        "top_p=0.9": [SamplingParams(temperature=0.8, top_p=0.9)] * batch,
        "top_k+top_p+min_p": [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02)] * batch,
        "penalties (all rows)": [
            SamplingParams(temperature=0.8, repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.3)
        ]
        * batch,
        "logprobs=5 (all rows)": [SamplingParams(temperature=0.8, logprobs=5)] * batch,
        "seeded (all rows)": [SamplingParams(temperature=0.8, seed=i) for i in range(batch)],
        "mixed (1/8 each kind)": [mixed(i) for i in range(batch)],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--flat",
        action="store_true",
        help="i.i.d. N(0, 3^2) logits (a very wide nucleus) instead of LM-like peaked ones",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = torch.randn(args.batch, args.vocab, generator=g) * (3.0 if args.flat else 1.5)
    if not args.flat:
        # LM-like: a few dozen plausible tokens per row carry most of the mass.
        hot = torch.randint(0, args.vocab, (args.batch, 40), generator=g)
        logits.scatter_add_(1, hot, 12.0 + 2.0 * torch.rand(args.batch, 40, generator=g))
    logits = logits.to(dev)
    prompts = [torch.randint(0, args.vocab, (200,), generator=g).tolist() for _ in range(args.batch)]
    outputs = [torch.randint(0, args.vocab, (100,), generator=g).tolist() for _ in range(args.batch)]
    sampler = Sampler()
    kind = "flat N(0, 9) logits" if args.flat else "LM-like peaked logits"
    print(
        f"batch {args.batch} x vocab {args.vocab}, {kind}, on {dev} ({torch.get_num_threads()} threads), "
        f"median of {args.iters} steps after 1 warm-up"
    )
    for name, params in mixes(args.batch).items():
        gens = {i: torch.Generator(device=dev).manual_seed(p.seed) for i, p in enumerate(params) if p.seed is not None}
        md = build_sampling_metadata(params, args.vocab, prompts, outputs, generators=gens, device=dev)
        if dev.type == "cuda" and not md.all_greedy:  # per-row Philox keys, as the model runner gives them
            import numpy as np

            from pagedllm.sample.triton_sample import noise_keys

            seeded = np.array([i for i, p in enumerate(params) if p.seed is not None], dtype=np.int64)
            seeds = np.array([params[i].seed for i in seeded.tolist()], dtype=np.int64)
            keys = noise_keys(len(params), seeded, seeds, np.zeros(len(seeded), dtype=np.int64))
            md.noise_seeds = torch.from_numpy(keys).to(dev)
        times = []
        for it in range(args.iters + 1):
            x = logits.clone()
            sync()
            t0 = time.perf_counter()
            sampler(x, md)
            sync()
            if it:
                times.append(time.perf_counter() - t0)
        print(f"  {name:24s} {1000 * statistics.median(times):8.1f} ms/step")


if __name__ == "__main__":
    main()
