"""Cost of batch-invariant mode on the CPU (SmolLM2-135M bf16, 2 threads): a W1-like batch (64 prompts of
64-256 tokens, 64 output tokens each) and a W3-like single request (128 in / 64 out), default vs
`batch_invariant=True`, interleaved A/B/A/B so machine load hits both alike.

    PYTHONPATH=. python3 benchmarks/batch_invariant_cost.py [--rounds 2] [--out F]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pagedllm import LLM, SamplingParams
from pagedllm.inputs import TokensPrompt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rng = random.Random(0)
    w1 = [
        TokensPrompt(prompt_token_ids=[rng.randrange(3, 49000) for _ in range(rng.randrange(64, 256))])
        for _ in range(a.batch)
    ]
    w3 = [TokensPrompt(prompt_token_ids=[rng.randrange(3, 49000) for _ in range(128)])]
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, detokenize=False)
    kw = dict(dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=512 << 20, enable_prefix_caching=False)
    engines = {"default": LLM(**kw), "batch_invariant": LLM(batch_invariant=True, **kw)}
    times: dict[str, dict[str, list[float]]] = {m: {"W1": [], "W3": []} for m in engines}
    from pagedllm.model_executor.layers import batch_invariant

    for _ in range(a.rounds):
        for mode, llm in engines.items():
            batch_invariant.set_enabled(mode == "batch_invariant")  # process-wide flag: follow the engine
            for wl, prompts in (("W1", w1), ("W3", w3)):
                t0 = time.perf_counter()
                llm.generate(prompts, sp, use_tqdm=False)
                times[mode][wl].append(time.perf_counter() - t0)
    res = {m: {wl: statistics.median(v) for wl, v in d.items()} for m, d in times.items()}
    res["ratio"] = {wl: res["batch_invariant"][wl] / res["default"][wl] for wl in ("W1", "W3")}
    res["raw"] = times
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
