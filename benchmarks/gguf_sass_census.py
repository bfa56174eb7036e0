"""The GGUF decode GEMVs compiled for sm_90a on a machine without a GPU: each launch's main-loop SASS per
thread and step, instructions per weight, the instruction mix and the registers a thread (session 41: the
figures behind `gguf_triton_int8`'s design notes and benchmarks/NOTES.md).

    PYTHONPATH=. python3 benchmarks/gguf_sass_census.py [--types Q4_1 Q8_0 Q4_K] [--tiles 2x1024x2 64x256x4]
        [--float]

The main loop is the longest backward branch of the SASS (`cuobjdump -sass` from Triton's own copy). A step
covers BN x BK weights spread over the program's threads. The Triton here (3.9) may lay a kernel out
differently from the device's (3.6): the device's timings decide (`gguf_gpu.py --sweep`).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedllm.model_executor.layers.quantization import gguf_triton_int8 as int8
from pagedllm.model_executor.layers.quantization import gguf_triton_kernels as kern

TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
POINTERS = {
    "x_ptr": "*bf16", "xq_ptr": "*i32", "xd_ptr": "*fp32", "xs_ptr": "*fp32", "lo_ptr": "*i32", "hi_ptr": "*i32",
    "d_ptr": "*fp16", "dm_ptr": "*fp16", "sc_ptr": "*u8", "mn_ptr": "*u8", "part_ptr": "*fp32", "out_ptr": "*bf16",
    "cnt_ptr": "*i32",
}  # fmt: skip
ROPE_POINTERS = {"pos_ptr": "*i64", "cos_sin_ptr": "*fp32", "slot_ptr": "*i64", "kv_ptr": "*bf16"}  # (--rope)
Q4K_POINTERS = {"d_ptr": "*i32", "dm_ptr": "*i32", "sc_ptr": "*i16", "mn_ptr": "*i16"}  # its packed planes
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_gemv(
    qtype: int, bn: int, bk: int, warps: int, use_float: bool, opq: bool = False, rope: bool = False, pre: bool = False
) -> bytes:
    """The cubin of one GEMV launch (pointers and strides given Triton's divisible-by-16 specialization)."""
    if use_float:
        fn = kern._gguf_gemv_kernel
        consts = dict(QT=qtype, EPW=4 if qtype == 8 else 8, G=16 if qtype == 14 else 32, BN=bn, BK=bk, EVEN_K=True)
    else:
        fn = int8._gguf_gemv_q8a_kernel
        consts = dict(QT=qtype, BN=bn, BK=bk, EVEN_K=True, ASM=True, PRE=pre, OPQ=opq, HEAD=128 if rope else 0)
        consts["CACHE_BLOCK"] = 16
    consts["PDL"] = 0
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            constexprs[(i,)] = consts[name]
            continue
        signature[name] = POINTERS.get(name, "i32")
        if qtype == 12 and name in Q4K_POINTERS:
            signature[name] = Q4K_POINTERS[name]
        if name in ROPE_POINTERS:
            signature[name] = ROPE_POINTERS[name]
        if name in POINTERS or name.startswith("stride") or name in ("K", "K_SPLIT"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    opts = {"num_warps": warps, "num_stages": 1}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["cubin"]


def census(cubin: bytes) -> tuple[list[str], int]:
    """(the main loop's instructions, registers a thread)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    ops = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best = (0, -1)
    for addr, op in ops:
        target = re.search(r"BRA\s.*?0x([0-9a-f]+)", op)
        if target and int(target.group(1), 16) < addr and addr - int(target.group(1), 16) > best[1] - best[0]:
            best = (int(target.group(1), 16), addr)
    loop = [re.sub(r"^@!?U?P\w+\s+", "", op).split()[0] for addr, op in ops if best[0] <= addr <= best[1]]
    regs = re.search(r"REG:(\d+)", res)
    return loop, int(regs.group(1)) if regs else -1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="+", default=["Q4_1", "Q8_0", "Q4_K"], choices=list(TYPES))
    ap.add_argument("--tiles", nargs="+", default=["2x1024x2", "4x512x1", "16x512x2", "64x256x4", "128x256x4"],
                    help="BNxBKxWARPS")  # fmt: skip
    ap.add_argument("--float", action="store_true", help="the float GEMV instead of the int8 one")
    ap.add_argument("--opq", action="store_true", help="scale loads indexed through an opaque identity (OPQ)")
    ap.add_argument("--rope", action="store_true", help="the qkv launch's RoPE epilogue (attention/qkv_rope.py)")
    ap.add_argument("--pre", action="store_true", help="the first step read before the PDL wait (the CUDA default)")
    args = ap.parse_args()
    for name in args.types:
        for tile in args.tiles:
            bn, bk, warps = (int(v) for v in tile.split("x"))
            loop, regs = census(compile_gemv(TYPES[name], bn, bk, warps, args.float, args.opq, args.rope, args.pre))
            per_weight = len(loop) * warps * 32 / (bn * bk)
            mix = ", ".join(f"{k} {v}" for k, v in Counter(loop).most_common(8))
            print(f"{name} BN {bn:3d} BK {bk:4d} warps {warps}: {len(loop):4d} instructions a thread-step, "
                  f"{per_weight:.2f} a weight, {regs} registers | {mix}")  # fmt: skip


if __name__ == "__main__":
    main()
