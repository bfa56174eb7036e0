"""pagedllm serving the SmolLM2 Q4_1 GGUF packed vs llama.cpp (`llama-cpp-python`) on the same file, CPU,
both engines in the same run, alternating, each figure repeated (min / median reported).

    pip install llama-cpp-python   # benchmark only (builds llama.cpp from source); not a project dependency
    PYTHONPATH=. python benchmarks/gguf_vs_llamacpp.py --threads 2 --repeats 3 --json out.json

Figures: single-stream decode tok/s (same prompt, 128 greedy tokens, EOS ignored; decode = the 128 tokens
after the first, prefill excluded), our batch 16 / 64 throughput (128 tokens each) against llama.cpp's
parallel figure (its low-level batch API: one `llama_decode` per step for all sequences), and prefill
tok/s on 512- and 4,000-token prompts (and 8,000 for us, with the time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

TEXT = Path(__file__).parent.parent / "tests" / "model_executor" / "data" / "declaration_of_independence.txt"
PROMPT = "Write a short story about a robot who learns to paint."


def prompt_ids(tokenizer_ids: list[int], n: int) -> list[int]:
    """n tokens of the shipped text, repeated as needed."""
    reps = -(-n // len(tokenizer_ids))
    return (tokenizer_ids * reps)[:n]


class Ours:
    def __init__(self, path: str, threads: int, dtype: str, kv_cache_dtype: str = "auto") -> None:
        from pagedllm import LLM

        torch.set_num_threads(threads)
        self.llm = LLM(
            path,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            max_model_len=8192,
            kv_cache_memory_bytes=1 << 30,
            max_num_seqs=64,
        )
        self.tok = self.llm.get_tokenizer()

    def _gen(self, prompts: list[list[int]], n: int) -> float:
        from pagedllm import SamplingParams, TokensPrompt

        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        return time.perf_counter() - t

    def decode(self, ids: list[int], n: int) -> float:
        return n / (self._gen([ids], n + 1) - self._gen([ids], 1))

    def batch(self, ids: list[int], b: int, n: int) -> float:
        prompts = [ids + [i + 100] for i in range(b)]  # distinct prompts
        return b * n / self._gen(prompts, n)

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset_prefix_cache()  # each repeat prefills the whole prompt
        return len(ids) / self._gen([ids + [len(ids) % 1000 + 7]], 1)


class LlamaCpp:
    def __init__(self, path: str, threads: int, n_seq: int = 64) -> None:
        import llama_cpp

        self.lc = llama_cpp
        self.llm = llama_cpp.Llama(
            model_path=path,
            n_ctx=16384,
            n_batch=2048,
            n_ubatch=512,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
        # A second context for parallel decoding (the high-level object has one sequence).
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = 16384, 2048, 512
        params.n_threads = params.n_threads_batch = threads
        params.n_seq_max, params.kv_unified = n_seq, True
        self.par_ctx = llama_cpp.llama_init_from_model(self.llm.model, params)
        if not self.par_ctx:
            raise RuntimeError("llama.cpp: could not create the parallel context")

    def _eval_time(self, ids: list[int], n: int) -> float:
        self.llm.reset()
        t = time.perf_counter()
        count = 0
        for _ in self.llm.generate(ids, temp=0.0, top_k=1, reset=True):
            count += 1
            if count >= n:
                break
        return time.perf_counter() - t

    def decode(self, ids: list[int], n: int) -> float:
        return n / (self._eval_time(ids, n + 1) - self._eval_time(ids, 1))

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(ids)
        return len(ids) / (time.perf_counter() - t)

    def batch(self, ids: list[int], b: int, n: int) -> float:
        """b sequences decoded together: one llama_decode per step over all of them (greedy, numpy argmax)."""
        lc, ctx = self.lc, self.par_ctx
        mem = lc.llama_get_memory(ctx)
        lc.llama_memory_clear(mem, True)
        nv = self.llm.n_vocab()
        batch = lc.llama_batch_init(max(len(ids) + 1, b) * b, 0, b)
        t = time.perf_counter()
        try:
            # Prefill every sequence (distinct last token), logits only for each one's last position.
            batch.n_tokens = 0
            for s in range(b):
                seq = ids + [s + 100]
                for i, tok in enumerate(seq):
                    j = batch.n_tokens
                    batch.token[j], batch.pos[j], batch.n_seq_id[j] = tok, i, 1
                    batch.seq_id[j][0] = s
                    batch.logits[j] = i == len(seq) - 1
                    batch.n_tokens += 1
            pos = len(ids) + 1
            self._decode(batch)
            rows = list(range(b))
            for _ in range(n):
                logits = np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(len(rows), nv))
                nxt = logits.argmax(-1)
                batch.n_tokens = b
                for s in range(b):
                    batch.token[s], batch.pos[s], batch.n_seq_id[s] = int(nxt[s]), pos, 1
                    batch.seq_id[s][0] = s
                    batch.logits[s] = True
                pos += 1
                self._decode(batch)
        finally:
            lc.llama_batch_free(batch)
        return b * n / (time.perf_counter() - t)

    def _decode(self, batch: Any) -> None:
        rc = self.lc.llama_decode(self.par_ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")


def stats(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "runs": xs}


def main() -> None:
    from pagedllm.transformers_utils.config import default_model_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=default_model_path())
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--batches", type=int, nargs="*", default=[16, 64])
    ap.add_argument("--prefill", type=int, nargs="*", default=[512, 4000])
    ap.add_argument("--long", type=int, default=8000, help="our prefill time at this length (0: skip)")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    ours = Ours(args.model, args.threads, args.dtype, args.kv_cache_dtype)
    base = ours.tok.encode(TEXT.read_text())
    short = ours.tok.encode(PROMPT)
    engines: dict[str, Any] = {"pagedllm": ours}
    if not args.no_llamacpp:
        engines["llama.cpp"] = LlamaCpp(args.model, args.threads, max([1, *args.batches]))
    res: dict[str, dict[str, Any]] = {name: {} for name in engines}
    for eng in engines.values():  # warm-up
        eng.decode(short, 8)
    for r in range(args.repeats):
        jobs: list[tuple[str, Any]] = [("decode_1x128", lambda e: e.decode(short, 128))]
        jobs += [(f"batch_{b}x128", lambda e, b=b: e.batch(short, b, 128)) for b in args.batches]
        jobs += [(f"prefill_{n}", lambda e, n=n: e.prefill(prompt_ids(base, n))) for n in args.prefill]
        for key, job in jobs:  # each figure: both engines back to back
            for name, eng in engines.items():
                res[name].setdefault(key, []).append(job(eng))
                print(f"round {r}: {name} {key} {res[name][key][-1]:.1f}", flush=True)
    if args.long:
        t = time.perf_counter()
        ours.prefill(prompt_ids(base, args.long))
        res["pagedllm"][f"prefill_{args.long}_seconds"] = [time.perf_counter() - t]
    table = {name: {k: stats(v) for k, v in d.items()} for name, d in res.items()}
    for name, d in table.items():
        for k, s in d.items():
            print(f"{name:10s} {k:22s} min {s['min']:9.2f} median {s['median']:9.2f}")
    if "llama.cpp" in table:
        lc = table["llama.cpp"]
        best_parallel = max(lc[f"batch_{b}x128"]["median"] for b in args.batches) if args.batches else 0
        for k, s in table["pagedllm"].items():
            if k in lc:
                print(f"ratio {k:22s} {s['median'] / lc[k]['median']:.2f}x (medians)")
        for b in args.batches:
            ratio = table["pagedllm"][f"batch_{b}x128"]["median"] / best_parallel
            print(f"batch {b} vs llama.cpp best parallel: {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"threads": args.threads, "model": args.model, "results": table}, indent=1)
        )


if __name__ == "__main__":
    main()
