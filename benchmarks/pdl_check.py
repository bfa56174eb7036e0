"""Programmatic dependent launch (triton_utils.pdl_args) changes no number: greedy tokens and their logprobs with
PAGEDLLM_PDL=1 must equal PAGEDLLM_PDL=0 bit for bit (a kernel that read its predecessor's output before waiting
would show as a difference; --a / --b compare any two settings, the same one twice: run to run). Each setting runs
in its own process (the flag is read once per process) on a dummy-weight checkpoint, CUDA graphs on: eight prompts
one at a time (batch 1: the row GEMVs, at tp=2 their push all-reduce, the early kernels) and twelve together.

    PYTHONPATH=. python3 benchmarks/pdl_check.py [--model benchmarks/workloads/llama-3.1-8b] [--tp 2] [--env K=V]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile


def child(args: argparse.Namespace) -> None:
    from pagedllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(
        model=args.model,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=1024,
        tensor_parallel_size=args.tp,
        quantization=args.quantization,
        gpu_memory_utilization=0.5,
    )
    rng = random.Random(7)
    lens = [rng.randint(8, 300) for _ in range(20)]
    prompts = [TokensPrompt(prompt_token_ids=[rng.randint(0, 10000) for _ in range(n)]) for n in lens]
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False, logprobs=2)
    outs = [o for p in prompts[:8] for o in llm.generate([p], sp, use_tqdm=False)]
    outs += llm.generate(prompts[8:], sp, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        lps = [sorted((int(t), float(lp.logprob)) for t, lp in step.items()) for step in c.logprobs]
        res.append({"tokens": list(c.token_ids), "logprobs": lps})
    with open(args.child, "w") as f:
        json.dump(res, f)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="benchmarks/workloads/llama-3.1-8b")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--quantization", default=None)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--env", action="append", default=[], help="K=V set for both runs")
    p.add_argument("--a", default="PAGEDLLM_PDL=1", help="K=V[,K=V] of the first run")
    p.add_argument("--b", default="PAGEDLLM_PDL=0", help="K=V[,K=V] of the second run (the same: run to run)")
    p.add_argument(
        "--reuse-b",
        default=None,
        help="a directory: run B's outputs are kept there and reused by later calls with the same arguments "
        "(a bisection compares many A settings against one reference; the reference run is then made once)",
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0
    runs = []
    for run, setting in enumerate((args.a, args.b)):
        key = [args.model, args.tp, args.quantization, args.tokens, sorted(args.env), setting]
        kept = None
        if run == 1 and args.reuse_b:
            os.makedirs(args.reuse_b, exist_ok=True)
            kept = os.path.join(args.reuse_b, hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16] + ".json")
            if os.path.exists(kept):
                with open(kept) as f:
                    runs.append(json.load(f))
                print(f"pdl_check: run B ({setting}) reused from {kept}")
                continue
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        env = dict(os.environ, **dict(kv.split("=", 1) for kv in [*args.env, *setting.split(",")]))
        cmd = [sys.executable, __file__, "--model", args.model, "--tp", str(args.tp), "--tokens", str(args.tokens)]
        cmd += ["--quantization", args.quantization] if args.quantization else []
        rc = subprocess.run(cmd + ["--child", path], env=env).returncode
        if rc:
            print(f"pdl_check: the {setting} run failed (rc {rc})")
            return 1
        with open(path) as f:
            runs.append(json.load(f))
        if kept is not None:
            shutil.copyfile(path, kept)
    on, off = runs
    diff = [i for i, (a, b) in enumerate(zip(on, off, strict=True)) if a != b]
    tag = f"{args.model} tp={args.tp} quantization={args.quantization} {' '.join(args.env)}"
    print(f"pdl_check {tag}: {len(on)} sequences x {args.tokens} tokens, {args.a} == {args.b}: {not diff}", end="")
    print(f" (differ: {diff}; first at token {_first(on[diff[0]], off[diff[0]])})" if diff else "")
    return 1 if diff else 0


def _first(a: dict, b: dict) -> int:
    for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"], strict=False)):
        if x != y or a["logprobs"][i] != b["logprobs"][i]:
            return i
    return min(len(a["tokens"]), len(b["tokens"]))


if __name__ == "__main__":
    sys.exit(main())
