"""Structured-output cost: decode step time with N JSON-schema requests vs N free ones, first-token latency
of a request with a new schema vs a plain one, and grammar compile time on its own. Dummy weights of any
model shape (a config directory); the tokenizer is the built-in SmolLM2's unless given.

    python benchmarks/structured_overhead.py [--model CONFIG_DIR] [--device cuda] [--num-reqs 64] [--json PATH]
    # CPU, small shape:
    python benchmarks/structured_overhead.py --model benchmarks/workloads/smollm2-135m

Decode steps are timed only while all N requests are decoding (prefill done, none finished): the schema's
strings have a minimum length so no grammar can end within the timed steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from typing import Any

import numpy as np


def decode_schema(min_len: int) -> dict[str, Any]:
    """A realistic object whose string fields keep every request decoding for the timed steps."""
    return {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 10**6},
            "title": {"type": "string", "minLength": min_len, "maxLength": min_len * 2},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
            "body": {"type": "string", "minLength": min_len},
        },
        "required": ["id", "title", "tags", "body"],
        "additionalProperties": False,
    }


def fresh_schema() -> dict[str, Any]:
    """A schema never seen before (no compile cache can hold it)."""
    key = "k" + uuid.uuid4().hex[:8]
    return {
        "type": "object",
        "properties": {
            key: {"type": "string", "maxLength": 32},
            "n": {"type": "integer", "minimum": 0, "maximum": 100},
            "items": {"type": "array", "items": {"type": "number"}, "maxItems": 4},
        },
        "required": [key, "n"],
    }


def time_decode(llm: Any, prompts: list[list[int]], sp: Any, steps: int) -> tuple[list[float], int]:
    """Per-step wall times (s) of `steps` decode steps with every request running; the smallest batch seen."""
    from pagedllm import TokensPrompt

    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    ids = [f"r{uuid.uuid4().hex[:6]}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, TokensPrompt(prompt_token_ids=p), sp)
    started: set[str] = set()
    while len(started) < len(ids):  # compile (structured), prefill, first tokens
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                started.add(out.request_id)
    for _ in range(3):
        engine.step()
    times, min_batch = [], len(ids)
    for _ in range(steps):
        min_batch = min(min_batch, len(sched.running))
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return times, min_batch


def first_token_latency(llm: Any, prompt: list[int], make_sp: Any, trials: int) -> float:
    from pagedllm import TokensPrompt

    out = []
    for _ in range(trials):
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], make_sp(), use_tqdm=False)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    from pagedllm.benchmarks.workloads import load_workloads_module

    mod = load_workloads_module()
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=mod.MODELS["qwen3-0.6b"], help="config directory (dummy weights)")
    ap.add_argument("--tokenizer", default=None, help="default: the built-in SmolLM2 GGUF's tokenizer")
    ap.add_argument("--hf-overrides", type=json.loads, default=None)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--num-reqs", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()

    from pagedllm import LLM, SamplingParams, StructuredOutputsParams
    from pagedllm.structured_output.backend import XgrammarBackend
    from pagedllm.structured_output.config import StructuredOutputsConfig
    from pagedllm.transformers_utils.config import default_model_path
    from pagedllm.transformers_utils.tokenizer import get_tokenizer

    args.tokenizer = args.tokenizer or default_model_path()
    on_gpu = args.device == "cuda"
    llm = LLM(
        args.model,
        tokenizer=args.tokenizer,
        load_format="dummy",
        device=args.device,
        dtype=args.dtype or ("bfloat16" if on_gpu else "float32"),
        hf_overrides=args.hf_overrides,
        max_model_len=2048,
        kv_cache_memory_bytes=(4 << 30) if on_gpu else (1 << 30),
        async_scheduling=args.async_scheduling,
    )
    vocab = llm.llm_engine.model_config.vocab_size
    res: dict[str, Any] = {"model": args.model, "device": args.device, "num_reqs": args.num_reqs, "vocab": vocab}

    # 1. Grammar compile time alone (a fresh backend: no cache), and the one-off vocabulary read.
    tok = get_tokenizer(args.tokenizer)
    t = time.perf_counter()
    backend = XgrammarBackend(tok, vocab, [tok.eos_token_id], StructuredOutputsConfig())
    res["tokenizer_info_ms"] = (time.perf_counter() - t) * 1e3
    compile_ms = []
    for _ in range(args.trials):
        so = StructuredOutputsParams(json=fresh_schema())
        t = time.perf_counter()
        backend.compile(so)
        compile_ms.append((time.perf_counter() - t) * 1e3)
    res["compile_ms_median"] = statistics.median(compile_ms)
    t = time.perf_counter()
    backend.compile(StructuredOutputsParams(json=decode_schema(256)))
    res["compile_decode_schema_ms"] = (time.perf_counter() - t) * 1e3

    # 1b. The per-step host fill (xgrammar batch fill) and the device apply alone, N rows inside a JSON string.
    import torch
    import xgrammar as xgr

    from pagedllm.core.scheduler_output import CachedRequestData, SchedulerOutput
    from pagedllm.structured_output.apply import apply_grammar_bitmask
    from pagedllm.structured_output.engine import FILL_THREADS
    from pagedllm.structured_output.manager import GrammarBitmask

    compiled = backend.compile(StructuredOutputsParams(json=decode_schema(256)))
    prefix = tok.encode('{"id": 12, "title": "hello world', add_special_tokens=False)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(args.num_reqs)]
    for m in matchers:
        for t_id in prefix:
            m.accept_token(t_id)
    batch = xgr.BatchGrammarMatcher(FILL_THREADS)
    fills, applies = [], []
    logits = torch.randn(args.num_reqs, vocab, device=args.device)
    rids = [f"r{i}" for i in range(args.num_reqs)]
    for _ in range(20):
        t = time.perf_counter()
        bm = GrammarBitmask(matchers, vocab, batch, backend.valid_vocab, pin=on_gpu)
        bm.narrow()
        fills.append(time.perf_counter() - t)
        ids = {r: i for i, r in enumerate(rids)}
        so_ = SchedulerOutput([], CachedRequestData(), {}, 0, structured_output_request_ids=ids, grammar_bitmask=bm)
        t = time.perf_counter()
        apply_grammar_bitmask(logits, so_, rids, np.arange(args.num_reqs))
        if on_gpu:
            torch.cuda.synchronize()
        applies.append(time.perf_counter() - t)
    res["fill_ms_median"] = statistics.median(fills) * 1e3
    for threads in (1, 2, 4, 8):  # xgrammar's batch-fill threads (PAGEDLLM_GRAMMAR_FILL_THREADS)
        sweep_batch = xgr.BatchGrammarMatcher(threads)
        ts = []
        for _ in range(20):
            t = time.perf_counter()
            GrammarBitmask(matchers, vocab, sweep_batch, backend.valid_vocab, pin=on_gpu).narrow()
            ts.append(time.perf_counter() - t)
        res[f"fill_ms_threads_{threads}"] = statistics.median(ts) * 1e3
    res["apply_ms_median"] = statistics.median(applies) * 1e3

    # 2. Decode step time: N free requests vs N constrained by one JSON schema (compiled once, shared).
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, min(vocab, 40000), args.prompt_len).tolist() for _ in range(args.num_reqs)]
    max_tokens = args.steps + 64
    plain = SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    so = StructuredOutputsParams(json=decode_schema(4 * max_tokens))
    constrained = plain.clone(structured_outputs=so)
    time_decode(llm, prompts[:8], plain, 5)  # warm-up
    for name, sp in (("plain", plain), ("structured", constrained), ("plain_again", plain)):
        times, min_batch = time_decode(llm, prompts, sp, args.steps)
        res[f"step_ms_{name}"] = statistics.median(times) * 1e3
        res[f"min_batch_{name}"] = min_batch
    base = (res["step_ms_plain"] + res["step_ms_plain_again"]) / 2
    res["structured_overhead_pct"] = (res["step_ms_structured"] / base - 1) * 100

    # 3. First-token latency on an idle engine: a plain request, a new schema (compiled on arrival), a cached one.
    p = prompts[0]
    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    cached = StructuredOutputsParams(json=fresh_schema())
    res["ttft_ms_plain"] = first_token_latency(llm, p, lambda: one, args.trials) * 1e3
    res["ttft_ms_new_schema"] = (
        first_token_latency(
            llm, p, lambda: one.clone(structured_outputs=StructuredOutputsParams(json=fresh_schema())), args.trials
        )
        * 1e3
    )
    res["ttft_ms_cached_schema"] = (
        first_token_latency(llm, p, lambda: one.clone(structured_outputs=cached), args.trials) * 1e3
    )
    for k, v in res.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
