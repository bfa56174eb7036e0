"""Can a row-parallel layer's all-reduce hide behind its GEMM on this machine's GPUs? (issue 25, W2 at tp=2)

Session 33 split o_proj / down_proj of a 16,384-token prefill step into row chunks, each chunk's NCCL
all-reduce (`async_op=True`) meant to run while the next chunk's GEMM does; W2 at tp=2 did not gain
(benchmarks/NOTES.md). This measures, per tp=2 shape of Llama-3.1-8B ([rows, K] @ [K, 4096] bf16, o_proj K =
2,048 and down_proj K = 7,168), the mean time of:

- `gemm`: the GEMM alone;  `ar`: NCCL's all-reduce of its [rows, 4096] output alone;
- `serial`: GEMM then all-reduce (what the engine does);
- `overlap`: the GEMM in `--chunks` row chunks, each chunk's all-reduce started asynchronously after it;
- `overlap_carveout`: the same with cuBLAS told to leave `--sm-carveout` SMs free
  (`torch._C._set_sm_carveout_experimental`, as PyTorch's async tensor parallelism does), so that NCCL's kernels
  find SMs while a GEMM runs.

`overlap` near `max(gemm, ar)` means the hardware overlaps them; near `serial`, it does not (the GEMM's blocks
holding every SM would do that). Each setting of NCCL that changes it needs its own processes, so run the
script once per setting, e.g. `TORCH_NCCL_HIGH_PRIORITY=1` (NCCL's stream at high priority) or
`NCCL_MAX_NCHANNELS=4` (fewer SMs for NCCL). `--device cpu` runs it on gloo with small shapes (a check of the
script, no figures).

    PYTHONPATH=. python3 benchmarks/overlap_bench.py --world 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.allreduce_bench import run_ranks

SETTINGS = ("TORCH_NCCL_HIGH_PRIORITY", "NCCL_MAX_NCHANNELS", "NCCL_MIN_NCHANNELS", "CUDA_DEVICE_MAX_CONNECTIONS")


def _timed(fn: Any, iters: int, device: torch.device) -> float:
    """Mean seconds of `fn` over `iters` calls after 3 warm-up calls, ranks aligned by a barrier first."""
    for _ in range(3):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


def _measure(k: int, rows: int, n: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The four timings of one [rows, k] @ [k, n] layer (see the module docstring)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    x = torch.randn(rows, k, generator=gen, device=device).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(dtype)
    out_t = torch.empty(rows, n, dtype=dtype, device=device)
    step = -(-rows // args.chunks)

    def gemm() -> None:
        torch.mm(x, w.t(), out=out_t)

    def ar() -> None:
        dist.all_reduce(out_t)

    def serial() -> None:
        gemm()
        ar()

    def overlap() -> None:
        works = []
        for s in range(0, rows, step):
            torch.mm(x[s : s + step], w.t(), out=out_t[s : s + step])
            works.append(dist.all_reduce(out_t[s : s + step], async_op=True))
        for work in works:
            work.wait()

    def overlap_carveout() -> None:
        torch._C._set_sm_carveout_experimental(args.sm_carveout)
        try:
            overlap()
        finally:
            torch._C._set_sm_carveout_experimental(None)

    serial()
    want = out_t.clone()
    overlap()
    res: dict[str, Any] = {"rows": rows, "k": k, "n": n, "overlap_equals_serial": bool(torch.equal(out_t, want))}
    variants = [("gemm", gemm), ("ar", ar), ("serial", serial), ("overlap", overlap)]
    if device.type == "cuda" and args.sm_carveout:
        variants.append(("overlap_carveout", overlap_carveout))
    for label, fn in variants:
        res[label + "_ms"] = _timed(fn, args.iters, device) * 1e3
    return res


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    cuda = device.type == "cuda"  # (the CPU check runs small shapes)
    res = {
        name: _measure(k if cuda else k // 64, args.rows if cuda else 256, 4096 if cuda else 64, args, device)
        for name, k in (("o_proj", 2048), ("down_proj", 7168))
    }
    if rank == 0:
        queue.put(res)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--sm-carveout", type=int, default=16, help="SMs cuBLAS leaves free in overlap_carveout (0: skip)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--json")
    args = p.parse_args()
    res = run_ranks(_worker, args.world, args, timeout_s=600)
    settings = {s: os.environ.get(s) for s in SETTINGS}
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{device} x{args.world}, {args.chunks} chunks, settings {settings}")
    for name, r in res.items():
        print(
            f"{name} [{r['rows']}, {r['k']}] @ [{r['k']}, {r['n']}]: gemm {r['gemm_ms']:.3f} ms, all-reduce "
            f"{r['ar_ms']:.3f}, serial {r['serial_ms']:.3f}, overlapped {r['overlap_ms']:.3f} "
            f"(max of the two {max(r['gemm_ms'], r['ar_ms']):.3f}); equal to serial: {r['overlap_equals_serial']}"
            + (f"; overlapped, {args.sm_carveout} SMs left to NCCL {r['overlap_carveout_ms']:.3f}"
               if "overlap_carveout_ms" in r else "")
        )  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "world": args.world, "chunks": args.chunks, "settings": settings,
                       "result": res}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
