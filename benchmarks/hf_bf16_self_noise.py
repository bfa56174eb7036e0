"""How often HF transformers in bf16 fails the numerical-comparison policy against *itself* on the GPU: SmolLM2 on
the test suite's 20 prompts x 48 greedy tokens, the reference being HF bf16 with its defaults (sdpa attention,
PyTorch's default SDPA backend and cuBLAS settings), and each variant changing one thing that a bf16 engine
cannot control: the SDPA backend (flash vs memory-efficient vs math), cuBLAS's reduced-precision bf16 reductions,
the eager attention implementation, float32 weights. Ours (the GPU path in bf16) is judged the same way, in the
same run, for comparison. A report for issue 3's item 2, not a test.

    python benchmarks/hf_bf16_self_noise.py GGUF [--tokens 48] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


@contextlib.contextmanager
def _sdpa_backend(name: str) -> Iterator[None]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, name)]):
        yield


@contextlib.contextmanager
def _no_reduced_precision_reduction() -> Iterator[None]:
    m = torch.backends.cuda.matmul
    saved = m.allow_bf16_reduced_precision_reduction
    m.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        m.allow_bf16_reduced_precision_reduction = saved


def _verdicts(
    ref_model: torch.nn.Module, prompts: list[list[int]], outs: list[list[int]], refs: list[list[int]]
) -> dict[str, object]:
    from tests.hf_utils import judge_all

    res = judge_all(ref_model, prompts, outs, refs, torch.bfloat16)
    failing = [f"prompt {i}: {r[len('FAIL ') :]}" for i, r in enumerate(res) if r.startswith("FAIL")]
    identical = sum(r.startswith("identical") for r in res)
    return {
        "identical": identical,
        "near_tie": len(res) - identical - len(failing),
        "failing": len(failing),
        "failures": failing,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    from pagedllm.transformers_utils.tokenizer import get_tokenizer
    from tests.conftest import smollm2_prompts
    from tests.hf_utils import hf_from_gguf, hf_greedy

    prompts = smollm2_prompts(get_tokenizer(args.gguf))
    n = args.tokens
    ref_model = hf_from_gguf(args.gguf, torch.bfloat16, "cuda")
    refs = [hf_greedy(ref_model, p, n) for p in prompts]

    def hf_run(
        model: torch.nn.Module, ctx: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    ) -> list[list[int]]:
        with ctx():
            return [hf_greedy(model, p, n) for p in prompts]

    variants: dict[str, list[list[int]]] = {"HF bf16 sdpa, default again (repeatability)": hf_run(ref_model)}
    for backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        try:
            variants[f"HF bf16 sdpa, SDPA backend {backend}"] = hf_run(ref_model, lambda b=backend: _sdpa_backend(b))
        except RuntimeError as e:  # a backend that does not take these shapes (GQA, masks) here
            print(f"SDPA backend {backend}: not usable here ({str(e).splitlines()[0]})")
    variants["HF bf16 sdpa, cuBLAS reduced-precision bf16 reductions off"] = hf_run(
        ref_model, _no_reduced_precision_reduction
    )
    eager = hf_from_gguf(args.gguf, torch.bfloat16, "cuda", attn_implementation="eager")
    variants["HF bf16 eager attention"] = hf_run(eager)
    del eager
    f32 = hf_from_gguf(args.gguf, torch.float32, "cuda")
    variants["HF float32 (sdpa)"] = hf_run(f32)
    del f32
    torch.cuda.empty_cache()

    from pagedllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(args.gguf, dtype="bfloat16", max_model_len=2048, gpu_memory_utilization=0.3)
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    variants["pagedllm bf16 GPU path"] = [list(o.outputs[0].token_ids) for o in outs]

    report = {name: _verdicts(ref_model, prompts, outs_, refs) for name, outs_ in variants.items()}
    report["_device"] = torch.cuda.get_device_name()
    report["_versions"] = {"torch": torch.__version__, "transformers": __import__("transformers").__version__}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(
        f"\n==== against HF bf16 sdpa (defaults), {len(prompts)} prompts x {n} tokens, policy threshold 0.1 "
        f"({report['_device']}) ===="
    )
    print(f"{'variant':<62} identical  near-tie  failing")
    for name, r in report.items():
        if not name.startswith("_"):
            print(f"{name:<62} {r['identical']:>9} {r['near_tie']:>9} {r['failing']:>8}")


if __name__ == "__main__":
    main()
