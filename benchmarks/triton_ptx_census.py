"""Compiles the paged-attention decode kernel for a Hopper target on a machine without a GPU and counts what its
PTX does per program: global loads by width (`ld.global.*`, `cp.async` with their byte counts), conversions and MMA
instructions, for a bf16 cache and an FP8 cache (dots in bfloat16 and in float16).

    PYTHONPATH=. python3 benchmarks/triton_ptx_census.py [--tile-n 128] [--warps 4] [--stages 2] [--dump DIR]

Device time is scarce: this is the offline first look at a kernel change (session 34: the FP8 cache's V tile went
through 8-byte `cp.async` copies where the bf16 cache's used 16-byte ones, one reason an FP8 decode moved ~2.2 T
elements/s like the bf16 one instead of twice the bytes). Integer arguments are given Triton's divisible-by-16
specialization where the engine's launches get it (pointers, cache strides, head counts), as at run time. The Triton
here (3.9 on this box) may lay a kernel out differently from the device's (3.6): confirm on the GPU.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedllm.attention.ops import triton_paged_attn_kernels as kern

POINTERS = {
    "out_ptr": "*bf16",
    "q_ptr": "*bf16",
    "block_table_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "qsl_ptr": "*i32",
    "part_out_ptr": "*fp32",
    "part_m_ptr": "*fp32",
    "part_l_ptr": "*fp32",
    "k_scale_ptr": "*fp32",
    "v_scale_ptr": "*fp32",
    "key_limit_ptr": "*i32",
    "order_ptr": "*i32",
}


def compile_decode(cache: str, f16: bool, tile_n: int, warps: int, stages: int, capability: int) -> dict:
    """The decode launch of Llama-3.1-8B's attention (32 / 8 heads, head 128, block 16, longest first)."""
    fn = kern._paged_attn_kernel
    names = fn.arg_names
    constants = dict(
        GROUP=4, HEAD_SIZE=128, HEAD_PAD=128, BLOCK_SIZE=16, BLOCK_M=16, BLOCK_Q=4, TILE_N=tile_n, CAUSAL=True,
        USE_WINDOW=False, NUM_SEGMENTS=1, DOT_PREC="tf32", FILTER=1, DIRECT=True, SOFTCAP=False,
        KV_FP8=cache != "bf16", KEY_LIMIT=False, ORDERED=True, FP8_F16=f16,
    )  # fmt: skip
    ptrs = dict(POINTERS, k_cache_ptr=f"*{cache}", v_cache_ptr=f"*{cache}")
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(names):
        if name in constants:
            signature[name] = "constexpr"
            constexprs[(i,)] = constants[name]
            continue
        signature[name] = ptrs.get(name) or ("fp32" if name in ("qk_scale", "softcap") else "i32")
        if name in ptrs or (name.startswith("stride_") and name != "stride_bt") or name == "num_heads":
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(
        src, target=GPUTarget("cuda", capability, 32), options={"num_warps": warps, "num_stages": stages}
    ).asm


def census(ptx: str) -> dict[str, Counter]:
    loads = Counter(re.findall(r"ld\.global[\.\w]*", ptx))
    for kind, size in re.findall(r"(cp\.async\.c[ag])\.shared\.global \[[^]]*\], \[[^]]*\], (0x[0-9a-f]+)", ptx):
        loads[f"{kind} {int(size, 16)} B"] += 1
    return {
        "loads": loads,
        "cvt": Counter(re.findall(r"cvt\.[\w\.]+", ptx)),
        "mma": Counter(re.findall(r"wgmma\.[\w\.]+|mma\.sync[\w\.]*", ptx)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tile-n", type=int, default=128)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--capability", type=int, default=90)
    ap.add_argument("--dump", help="write each variant's PTX and TTGIR here")
    args = ap.parse_args()
    for cache, f16 in (("bf16", False), ("fp8e4nv", False), ("fp8e4nv", True)):
        asm = compile_decode(cache, f16, args.tile_n, args.warps, args.stages, args.capability)
        c = census(asm["ptx"])
        print(f"{cache} cache{' (float16 dots)' if f16 else ''}, TILE_N {args.tile_n}:")
        for what, counts in c.items():
            print(f"  {what:5}", ", ".join(f"{k} x{v}" for k, v in counts.most_common() if v >= 4))
        if args.dump:
            out = Path(args.dump)
            out.mkdir(parents=True, exist_ok=True)
            stem = f"paged_attn_{cache}{'_f16' if f16 else ''}"
            (out / f"{stem}.ptx").write_text(asm["ptx"])
            (out / f"{stem}.ttgir").write_text(asm["ttgir"])


if __name__ == "__main__":
    main()
