"""Batch invariance on the CPU: N prompts' greedy tokens + logprobs, each alone vs all together vs with their
prefixes in the prefix cache vs with chunked prefill forced; counts how many are bitwise identical to
"alone", with and without batch-invariant mode, and the time of each run.

    PYTHONPATH=. python3 benchmarks/batch_invariance.py [--model PATH] [--n 64] [--tokens 24] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from pagedllm import LLM, SamplingParams
from pagedllm.inputs import TokensPrompt


def prompts_for(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of 8..120 tokens; every fourth shares a 40-token prefix with the previous one."""
    rng = random.Random(seed)
    out: list[list[int]] = []
    for i in range(n):
        if i % 4 == 3:
            out.append(out[-1][:40] + [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 30))])
        else:
            out.append([rng.randrange(3, vocab) for _ in range(rng.randrange(8, 120))])
    return out


def key(o: Any) -> tuple[list[int], list[dict[int, float]]]:
    c = o.outputs[0]
    return list(c.token_ids), [{t: lp.logprob for t, lp in s.items()} for s in c.logprobs]


def run_modes(model: str | None, prompts: list[list[int]], tokens: int, dtype: str, bi: bool, **kw: Any) -> dict:
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False, logprobs=1)
    tp = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    base = dict(dtype=dtype, max_model_len=512, kv_cache_memory_bytes=256 << 20, batch_invariant=bi, **kw)
    llm = LLM(model, **base)
    res: dict[str, Any] = {}
    t0 = time.perf_counter()
    alone = []
    for p in tp:
        llm.reset_prefix_cache()
        alone.append(key(llm.generate([p], sp, use_tqdm=False)[0]))
    res["alone_s"] = time.perf_counter() - t0
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    together = [key(o) for o in llm.generate(tp, sp, use_tqdm=False)]
    res["together_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    cached = [key(o) for o in llm.generate(tp, sp, use_tqdm=False)]  # prompts now in the prefix cache
    res["cached_s"] = time.perf_counter() - t0
    del llm
    chunked_llm = LLM(model, **{**base, "max_num_batched_tokens": 24, "max_num_seqs": 8})
    t0 = time.perf_counter()
    chunked = [key(o) for o in chunked_llm.generate(tp, sp, use_tqdm=False)]
    res["chunked_s"] = time.perf_counter() - t0
    for name, outs in (("together", together), ("cached", cached), ("chunked", chunked)):
        res[f"{name}_tokens_identical"] = sum(a[0] == b[0] for a, b in zip(alone, outs))
        res[f"{name}_bitwise_identical"] = sum(a == b for a, b in zip(alone, outs))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--modes", default="default,batch_invariant")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    probe = LLM(a.model, dtype=a.dtype, max_model_len=512, kv_cache_memory_bytes=16 << 20)
    vocab = probe.llm_engine.model_config.vocab_size
    del probe
    prompts = prompts_for(a.n, vocab)
    report = {"n": a.n, "tokens": a.tokens, "dtype": a.dtype}
    for mode in a.modes.split(","):
        report[mode] = run_modes(a.model, prompts, a.tokens, a.dtype, mode == "batch_invariant")
        print(mode, json.dumps(report[mode]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
