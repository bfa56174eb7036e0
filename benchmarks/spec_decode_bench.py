"""Speculative decoding benchmark (issue 23, acceptance 3).

`--mode ngram`: SmolLM2 as target with n-gram speculation on an input-grounded workload (prompts that ask
to repeat or edit a passage or code given in the prompt, built below), batch 1 and batch 16: output tok/s
with and without speculation, acceptance rate, mean accepted length (1 + accepted tokens per draft).

`--mode draft8b`: a Llama-3.1-8B-shaped dummy target with a SmolLM2-shaped dummy draft (the target's
vocabulary): the time of one speculative step (draft proposals + verification) vs one plain decode step.

`--force-accept R` (dummy weights, whose proposals mean nothing): every request proposes k tokens and the
first m of them are accepted, m drawn per request and step so that each proposal is accepted with
probability R given the ones before (the verification still runs in full, only its verdict is replaced),
so step costs at a known acceptance rate are measured. Output tokens are then meaningless; the timing is not.

Prints one JSON line per configuration and a table last."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedllm import LLM, SamplingParams, TokensPrompt  # noqa: E402

PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, and wrote the "
    "weather in a leather logbook before the ships came round the northern cape. In winter the wind rattled "
    "the windows so hard that he stuffed old newspapers into the frames, and in summer the gulls nested on "
    "the railing and screamed at him whenever he stepped outside. Once a year a supply boat brought flour, "
    "coffee, lamp oil and a bundle of letters from his sister, who lived in the city and never understood "
    "why anyone would choose to spend a whole life looking at the sea.",
    "Photosynthesis converts light energy into chemical energy. Chlorophyll in the thylakoid membranes "
    "absorbs red and blue light, and the energy it captures splits water molecules, releasing oxygen as a "
    "by-product. The electrons freed from water travel along a transport chain that pumps protons across the "
    "membrane, and the resulting gradient drives the synthesis of ATP. In the Calvin cycle, which runs in the "
    "stroma, the enzyme RuBisCO fixes carbon dioxide onto a five-carbon sugar, and the products are reduced "
    "with ATP and NADPH into three-carbon sugars that the plant uses to build glucose, starch and cellulose.",
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion it "
    "approved the new library wing, postponed the vote on the bridge repairs until the engineers deliver "
    "their report, and asked the treasurer for a revised forecast by the end of March. Two members objected "
    "to the increase in parking fees, arguing that the town centre was already losing shops to the retail "
    "park on the ring road, and the chair agreed to put the question on the agenda of the next meeting, "
    "together with the proposal to extend the opening hours of the swimming pool.",
    "Rivers carve valleys over millions of years. A mountain stream is steep and fast, and it carries "
    "boulders and gravel that grind its bed deeper after every storm. Further down the slope the river "
    "widens and slows, it begins to meander across a flat plain, and the finer sand and silt it carries "
    "settle on the inside of each bend. Near the coast the current almost stops, and the remaining mud "
    "builds a delta of shifting channels and islands. Farmers, cities and forests depend on the fertile "
    "soil that these deposits leave behind, and on the water that the river brings from the mountains.",
]
CODES = [
    "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n\n\n"
    "def variance(xs):\n    m = mean(xs)\n    total = 0\n    for x in xs:\n        total += (x - m) ** 2\n"
    "    return total / len(xs)\n\n\ndef median(xs):\n    s = sorted(xs)\n    n = len(s)\n"
    "    if n % 2 == 1:\n        return s[n // 2]\n    return (s[n // 2 - 1] + s[n // 2]) / 2\n",
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\n"
    "def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n"
    "        if n % i == 0:\n            return False\n        i += 1\n    return True\n\n\n"
    "def primes_below(n):\n    return [p for p in range(n) if is_prime(p)]\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, x):\n        self.items.append(x)\n\n"
    "    def pop(self):\n        return self.items.pop()\n\n"
    "    def peek(self):\n        return self.items[-1]\n\n"
    "    def is_empty(self):\n        return len(self.items) == 0\n\n"
    "    def size(self):\n        return len(self.items)\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n"
    "        word = word.strip('.,;:!?').lower()\n"
    "        counts[word] = counts.get(word, 0) + 1\n"
    "    return counts\n\n\n"
    "def most_common(counts, n):\n    pairs = sorted(counts.items(), key=lambda kv: kv[1], reverse=True)\n"
    "    return pairs[:n]\n\n\n"
    "def report(text):\n    for word, c in most_common(count_words(text), 5):\n"
    "        print(word, c)\n",
]


def grounded_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """n chat prompts: repeat a passage, repeat a passage in upper case, add type hints / docstrings to code."""
    asks = []
    for p in PASSAGES:
        asks.append(f"Repeat the following passage exactly, word for word.\n\n{p}")
        asks.append(f"Rewrite this passage, replacing every 'the' with 'a':\n\n{p}")
    for c in CODES:
        asks.append(f"Add type hints to this Python code and return the whole code:\n\n{c}")
        asks.append(f"Add a docstring to every function in this code and return the whole code:\n\n{c}")
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": asks[i % len(asks)]}]
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        out.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return out


def synthetic_prompts(n: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(10, vocab - 10, size=64).tolist() for _ in range(n)]


def force_acceptance(rate: float, k: int) -> None:
    """Test hook for dummy weights: k proposals for every request (its last k tokens), and a verdict that
    accepts each proposal with probability `rate` given the previous ones (the real verification runs)."""
    import pagedllm.spec_decode.runner as runner_mod

    rng = np.random.default_rng(0)

    def wrap(real: Any, drafts_arg: int, num_draft_arg: int) -> Any:
        """`real` (the rejection sampler, or its all-greedy case `greedy_verify`) with its verdict replaced."""

        def forced(*args: Any, **kw: Any) -> Any:
            out = real(*args, **kw)
            num_draft = args[num_draft_arg]
            drafts = args[drafts_arg].tolist()
            acc = np.minimum((rng.random((len(num_draft), k)) < rate).cumprod(axis=1).sum(axis=1), num_draft)
            toks = out.token_ids.clone()
            starts = np.cumsum(num_draft) - num_draft
            for b, (m, s) in enumerate(zip(acc.tolist(), starts.tolist())):
                toks[b, :m] = torch.tensor(drafts[s : s + m], dtype=toks.dtype)
                toks[b, m] = out.token_ids[b, 0]
                toks[b, m + 1 :] = -1
            out.token_ids = toks
            out.num_emitted = torch.from_numpy(acc + 1).to(out.num_emitted.device)
            return out

        return forced

    runner_mod.rejection_sample = wrap(runner_mod.rejection_sample, 3, 4)
    runner_mod.greedy_verify = wrap(runner_mod.greedy_verify, 1, 2)

    class Always:
        def propose(self, req_ids, token_ids, rows, num_tokens, caps):  # noqa: ANN001, ANN201
            return [
                token_ids[r, max(0, int(num_tokens[r]) - c) : int(num_tokens[r])].tolist() for r, c in zip(rows, caps)
            ]

    runner_mod.NgramProposer = lambda *a, **kw: Always()  # type: ignore[assignment,misc]


def count_steps(llm: LLM) -> list[int]:
    core = llm.llm_engine.engine_core.engine_core
    n = [0]
    real = core.step

    def step() -> Any:
        n[0] += 1
        return real()

    core.step = step
    return n


def run(
    llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int, ignore_eos: bool, profile: str | None = None
) -> dict[str, Any]:
    """Every prompt, `batch` at a time (batch 1: one request after the other, as a single user would):
    output tokens over the wall time of all groups, steps, acceptance. `profile`: a cProfile table (host
    functions by own time) of a second, untimed pass written there."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, detokenize=False)
    reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    groups = [reqs[i : i + batch] for i in range(0, len(reqs), batch)]
    # Warm-up with the same batch: the first speculative steps of a shape pay one-off Triton compiles (the
    # first H200 run measured without it: ~2 s of stalls per configuration, whatever the batch).
    warm = SamplingParams(temperature=0.0, max_tokens=min(64, max_tokens), ignore_eos=ignore_eos, detokenize=False)
    llm.generate(groups[0], warm, use_tqdm=False)
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    spec = sched.spec
    before = (
        (spec.totals.num_drafts, spec.totals.num_draft_tokens, spec.totals.num_accepted_tokens) if spec else (0, 0, 0)
    )
    steps = count_steps(llm) if not hasattr(llm, "_steps") else llm._steps  # type: ignore[attr-defined]
    llm._steps = steps  # type: ignore[attr-defined]
    s0 = steps[0]
    t0 = time.perf_counter()
    outs = [o for g in groups for o in llm.generate(g, sp, use_tqdm=False)]
    dt = time.perf_counter() - t0
    n_steps = steps[0] - s0
    after = (
        (spec.totals.num_drafts, spec.totals.num_draft_tokens, spec.totals.num_accepted_tokens) if spec else (0, 0, 0)
    )
    if profile and os.environ.get("SPEC_TORCH_PROFILE") and torch.cuda.is_available():
        # CUDA API calls by host time (which one blocks the step loop), over the first group
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as tp:
            llm.generate(groups[0], sp, use_tqdm=False)
        with open(profile.replace(".txt", "_torch.txt"), "w") as f:
            f.write(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
            f.write(tp.key_averages().table(sort_by="self_cuda_time_total", row_limit=30))
    if profile:  # a second, profiled pass (the timed one above runs without the profiler's overhead)
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for g in groups:
            llm.generate(g, sp, use_tqdm=False)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(45)
        with open(profile, "w") as f:
            f.write(buf.getvalue())
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res: dict[str, Any] = {"batch": batch, "requests": len(reqs), "output_tokens": n_out, "seconds": dt}
    res["out_tok_s"] = n_out / dt
    res["steps"] = n_steps
    res["ms_per_step"] = 1000 * dt / max(res["steps"], 1)
    if spec:
        d, dtok, acc = (x - y for x, y in zip(after, before))
        res.update(acceptance_rate=acc / max(dtok, 1), mean_accepted_length=1 + acc / max(d, 1), drafts=d)
    res["token_ids"] = [list(o.outputs[0].token_ids) for o in outs]
    return res


def prof_path(prefix: str | None, spec: str, batch: int) -> str | None:
    return f"{prefix}_{spec}_{batch}.txt" if prefix else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ngram", "draft8b"], default="ngram")
    ap.add_argument("--model", default=None, help="target (default: the built-in SmolLM2 GGUF)")
    ap.add_argument("--dummy", action="store_true", help="dummy weights (load_format=dummy)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2, help="n-gram: prompt_lookup_min")
    ap.add_argument("--lookup-max", type=int, default=4, help="n-gram: prompt_lookup_max")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument(
        "--ignore-eos", action="store_true", help="generate max_tokens each (default: stop at EOS, as a user would)"
    )
    ap.add_argument("--force-accept", type=float, default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--spec",
        default="off,on",
        help="of off (plain), sync (plain, async scheduling off), on (speculation, async scheduling as the engine's "
        "default), on-sync (speculation, async scheduling off); each in this process",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--requests", type=int, default=16, help="prompts per configuration (all run at each batch)")
    ap.add_argument("--cprofile", default=None, help="write a cProfile table of each timed run to PREFIX_<spec>_<b>")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    rows = []
    if a.force_accept is not None:
        force_acceptance(a.force_accept, a.k)
    if a.mode == "ngram":
        from pagedllm.transformers_utils.config import default_model_path
        from pagedllm.transformers_utils.tokenizer import get_tokenizer

        model = a.model or default_model_path()
        common: dict[str, Any] = {"dtype": a.dtype, "max_model_len": 1024, "max_num_seqs": max(32, max(batches))}
        if a.dummy:
            common["load_format"] = "dummy"
        if torch.cuda.is_available():
            common["gpu_memory_utilization"] = 0.3
        if a.dummy:  # no tokenizer needed, and the forced proposals need no n-gram match
            common["skip_tokenizer_init"] = True
            prompts = synthetic_prompts(a.requests, 49152)
        else:
            prompts = grounded_prompts(get_tokenizer(model), a.requests)
        spec = {
            "method": "ngram",
            "num_speculative_tokens": a.k,
            "prompt_lookup_max": a.lookup_max,
            "prompt_lookup_min": a.lookup_min,
        }
        cfgs = [
            ("off", {}),
            ("sync", {"async_scheduling": False}),
            ("ngram", {"speculative_config": spec}),
            ("ngram-sync", {"speculative_config": spec, "async_scheduling": False}),
        ]
        names = ("off", "sync", "on", "on-sync")
        for name, kw in [c for c, on in zip(cfgs, names) if on in a.spec.split(",")]:
            llm = LLM(model, disable_log_stats=True, **common, **kw)
            for b in batches:
                r = run(llm, prompts, b, a.max_tokens, a.ignore_eos, prof_path(a.cprofile, name, b))
                r["spec"] = name
                rows.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "token_ids"}), flush=True)
            del llm
            import gc

            gc.collect()  # the step counter's closure holds the engine in a cycle
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
        for b in (
            batches if {"off", "on"} <= set(a.spec.split(",")) else []
        ):  # greedy outputs with and without, token for token
            off = next(r for r in rows if r["spec"] == "off" and r["batch"] == b)
            on = next(r for r in rows if r["spec"] == "ngram" and r["batch"] == b)
            same = sum(x == y for x, y in zip(off["token_ids"], on["token_ids"]))
            print(f"batch {b}: {same}/{len(on['token_ids'])} outputs identical with and without speculation")
    else:
        import transformers

        tmp = tempfile.mkdtemp()
        target = a.model or "benchmarks/workloads/llama-3.1-8b"
        vocab = transformers.AutoConfig.from_pretrained(target).vocab_size
        draft_cfg = transformers.LlamaConfig(
            hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, vocab_size=vocab, tie_word_embeddings=True, max_position_embeddings=8192,
            rope_theta=100000.0, torch_dtype="bfloat16",
        )  # fmt: skip
        draft_cfg.save_pretrained(tmp)
        common = {"dtype": "bfloat16", "load_format": "dummy", "skip_tokenizer_init": True, "max_model_len": 2048}
        common["max_num_seqs"] = max(32, max(batches))
        if torch.cuda.is_available():
            common["gpu_memory_utilization"] = 0.6
        prompts = synthetic_prompts(a.requests, vocab)
        spec = {"method": "draft_model", "model": tmp, "num_speculative_tokens": a.k}
        cfgs = [("off", {}), ("draft", {"speculative_config": spec})]
        for name, kw in [c for c, on in zip(cfgs, ("off", "on")) if on in a.spec]:
            llm = LLM(target, disable_log_stats=True, **common, **kw)
            for b in batches:
                r = run(llm, prompts, b, a.max_tokens, a.ignore_eos, prof_path(a.cprofile, name, b))
                r["spec"] = name
                rows.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "token_ids"}), flush=True)
            del llm
            import gc

            gc.collect()
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
    print(f"\n{'mode':8} {'spec':6} {'batch':>5} {'out tok/s':>10} {'ms/step':>8} {'accept':>7} {'mean len':>8}")
    for r in rows:
        print(
            f"{a.mode:8} {r['spec']:6} {r['batch']:5d} {r['out_tok_s']:10.1f} {r['ms_per_step']:8.2f} "
            f"{r.get('acceptance_rate', float('nan')):7.3f} {r.get('mean_accepted_length', float('nan')):8.2f}"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "token_ids"} for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
