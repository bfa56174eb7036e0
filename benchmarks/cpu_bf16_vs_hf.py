"""How close the CPU path in bfloat16 stays to HF transformers in bfloat16 (CPU): SmolLM2 on the test suite's 20
prompts x 48 greedy tokens, judged by the numerical-comparison policy (a divergence passes only where HF's
teacher-forced top-2 gap is below 0.1), with HF bf16 against HF float32 as the yardstick of bf16 noise, and
ours with the C kernels switched off. A report, not a test (bf16 greedy paths part at 1-2 ulp logit gaps).

    python benchmarks/cpu_bf16_vs_hf.py [--tokens 48]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _count(hf, prompts, ours, refs, dtype) -> str:  # noqa: ANN001
    from tests.hf_utils import judge_all

    res = judge_all(hf, prompts, ours, refs, dtype)
    ident = sum(r.startswith("identical") for r in res)
    return f"{ident} / {len(prompts)} identical, {sum(r.startswith('FAIL') for r in res)} failing"


def _ours(path: str, prompts: list[list[int]], n: int, kernels: bool) -> list[list[int]]:
    """Our bf16 greedy tokens, in a child process (the C kernels' switch is read at import)."""
    code = (
        "import json, sys; from pagedllm import LLM, SamplingParams, TokensPrompt; "
        "p = json.load(sys.stdin); llm = LLM(sys.argv[1], dtype='bfloat16', max_model_len=1024, "
        "kv_cache_memory_bytes=256 << 20); sp = SamplingParams(temperature=0, max_tokens=int(sys.argv[2]), "
        "ignore_eos=True, detokenize=False); outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in p], "
        "sp, use_tqdm=False); print(json.dumps([list(o.outputs[0].token_ids) for o in outs]))"
    )
    import json

    env = dict(os.environ, PAGEDLLM_CPU_KERNELS="1" if kernels else "0")
    out = subprocess.run(
        [sys.executable, "-c", code, path, str(n)],
        input=json.dumps(prompts),
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from pagedllm.transformers_utils.config import default_model_path
    from tests.conftest import smollm2_prompts
    from tests.hf_utils import hf_from_gguf, hf_greedy

    torch.set_num_threads(2)
    path = default_model_path()
    d, f = os.path.dirname(path), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    prompts = smollm2_prompts(tok)
    hf16 = hf_from_gguf(path, torch.bfloat16)
    hf32 = hf_from_gguf(path, torch.float32)
    refs16 = [hf_greedy(hf16, p, args.tokens) for p in prompts]
    refs32 = [hf_greedy(hf32, p, args.tokens) for p in prompts]
    rows = {
        "ours bf16 (C kernels) vs HF bf16": _count(
            hf16, prompts, _ours(path, prompts, args.tokens, True), refs16, torch.bfloat16
        ),
        "ours bf16 (PyTorch ops) vs HF bf16": _count(
            hf16, prompts, _ours(path, prompts, args.tokens, False), refs16, torch.bfloat16
        ),
        "HF bf16 vs HF float32 (judged by HF bf16)": _count(hf16, prompts, refs32, refs16, torch.bfloat16),
    }
    print(f"==== CPU, SmolLM2 bf16, {len(prompts)} prompts x {args.tokens} tokens ====")
    for k, v in rows.items():
        print(f"{k:44s} {v}")


if __name__ == "__main__":
    main()
