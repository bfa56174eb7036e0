"""Scheduler-only replay of a workload at a given KV capacity (CPU, no model): steps, scheduled tokens,
preemptions, the mean batch and an estimated time from a step-cost model, with the admission reserve
(core/admission.py) at a given `schedule_conservativeness` (0: off, vLLM's admission).

Workloads: `w2` (../shared/workloads W2: 1,000 x 1,024 random prompt tokens, 128 outputs, EOS ignored);
`eos` (1,000 prompts of 100-1,000 tokens, max_tokens 2,000, each output token a stop token with probability
1 / --mean-out: ~300 tokens, as chat); `long` (300 such prompts, 2,000 outputs each, EOS ignored). The cost model
(ms): 0.0147 a prompt token + 4.6 a step + 0.0245 a decode, W2-FP8's steps on an H200 (NOTES, session 39): a
relative yardstick between settings, not a prediction of any GPU's time.

    python3 benchmarks/admission_replay.py --workload w2 --blocks 59394 --conservativeness 0 1
"""

from __future__ import annotations

import argparse
import random

import torch

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_utils import KVCacheGroup, KVCacheSpec
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.messages import EngineCoreRequest
from pagedllm.sampling_params import SamplingParams

STOP = 999_999


def replay(workload: str, blocks: int, conservativeness: float, mean_out: int) -> str:
    w2 = workload == "w2"
    cfg = SchedulerConfig(
        max_num_seqs=1024 if w2 else 256,
        max_num_batched_tokens=16384 if w2 else 8192,
        max_model_len=2048 if w2 else 4096,
        enable_chunked_prefill=True,
        policy="fcfs",
        schedule_conservativeness=conservativeness,
    )
    spec = KVCacheSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    s = Scheduler(cfg, [KVCacheGroup(["l0"], spec)], blocks, enable_prefix_caching=True)
    rng = random.Random(0)
    n = 1000 if workload != "long" else 300
    for i in range(n):
        prompt = [rng.randrange(100_000) for _ in range(1024 if w2 else rng.randint(100, 1000))]
        sp = SamplingParams(
            max_tokens=128 if w2 else 2000, ignore_eos=workload != "eos", stop_token_ids=[STOP], temperature=0
        )
        s.add_request(EngineCoreRequest(str(i), prompt, sp, float(i), 0))
    out_rng = random.Random(1)
    steps = tokens = batch = 0
    est_ms = 0.0
    while s.running or len(s.waiting):
        so = s.schedule()
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = s.requests[rid]
            if req.num_computed_tokens < req.num_tokens:
                sampled.append([])  # a prompt chunk before the last one
            elif workload == "eos" and out_rng.random() < 1 / mean_out:
                sampled.append([STOP])
            else:
                sampled.append([5])
        total = so.total_num_scheduled_tokens
        dec = sum(1 for v in so.num_scheduled_tokens.values() if v == 1)
        steps += 1
        tokens += total
        batch += len(ids)
        est_ms += 0.0147 * (total - dec) + 4.6 + 0.0245 * dec
        s.update_from_output(so, ModelRunnerOutput(ids, sampled))
    return (
        f"{workload} blocks={blocks} conservativeness={conservativeness:g}: steps {steps}, scheduled tokens "
        f"{tokens}, preemptions {s.num_preemptions}, mean batch {batch / steps:.0f}, est {est_ms / 1000:.2f} s"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", choices=["w2", "eos", "long"], default="w2")
    p.add_argument("--blocks", type=int, nargs="+", default=[59394])
    p.add_argument("--conservativeness", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--mean-out", type=int, default=300)
    args = p.parse_args()
    for b in args.blocks:
        for c in args.conservativeness:
            print(replay(args.workload, b, c, args.mean_out), flush=True)


if __name__ == "__main__":
    main()
