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

The copy-engine case (`pagedllm/distributed/ce_allreduce.py`, CUDA only; `--no-ce` skips it, `--ce-only` runs
only it) times, per shape, the engine's two ways of producing the norm after the layer from [rows, K] inputs:

- `ref`: `F.linear`, NCCL's all-reduce, `triton_ops.fused_add_rms_norm` (what a tp=2 prefill step does without it);
- `ce`: the path's `matmul` (the GEMM in `--chunks` row chunks, each copied to the peer by a copy engine under
  the next chunk's GEMM) and `add_norm` (the wait, the sum and the norm in one kernel);
- `down_proj_pieces`: the same with the rows in `--pieces` matmuls, as the engine's MLP in 4,096-token chunks calls
  down_proj (the pieces copied into one tensor, then one norm);

and whether the path's result equals NCCL + norm of the same partial sum bit for bit.

    PYTHONPATH=. python3 benchmarks/overlap_bench.py --world 2 --json out.json
    PYTHONPATH=. python3 benchmarks/overlap_bench.py --world 2 --ce-only --chunks 4   # the copy-engine case only
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


def _measure_ce(
    path: Any, k: int, rows: int, pieces: int, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    """`ref` against `ce` (module docstring) for [rows, k] @ [k, 4096] in `pieces` matmuls, and bit equality."""
    import torch.nn.functional as F
    from torch import nn

    from pagedllm.model_executor.layers import triton_ops
    from pagedllm.model_executor.layers.linear import UnquantizedLinearMethod

    dtype, n = torch.bfloat16, 4096
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    same = torch.Generator(device=device).manual_seed(0)  # residual and norm weight alike on every rank
    x = torch.randn(rows, k, generator=gen, device=device).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(dtype)
    residual = torch.randn(rows, n, generator=same, device=device).to(dtype)
    norm_w = (torch.rand(n, generator=same, device=device) + 0.5).to(dtype)
    layer = nn.Module()
    layer.quant_method = UnquantizedLinearMethod()  # type: ignore[assignment]
    layer.weight = nn.Parameter(w, requires_grad=False)
    step = -(-rows // pieces)

    def gathered(matmul: Any) -> torch.Tensor:
        if pieces == 1:
            out: torch.Tensor = matmul(x)
            return out
        out = torch.empty(rows, n, dtype=dtype, device=device)
        for s in range(0, rows, step):
            out[s : s + step] = matmul(x[s : s + step])
        return out

    def ref() -> tuple[torch.Tensor, torch.Tensor]:
        y = gathered(lambda xs: F.linear(xs, w))
        dist.all_reduce(y)
        return triton_ops.fused_add_rms_norm(y, residual, norm_w, 1e-5)

    def ce() -> Any:
        return path.add_norm(gathered(lambda xs: path.matmul(layer, xs)), residual, norm_w, 1e-5)

    def norm() -> Any:
        return triton_ops.fused_add_rms_norm(want_x, residual, norm_w, 1e-5)

    partial = gathered(lambda xs: path.matmul(layer, xs))
    got = path.add_norm(partial, residual, norm_w, 1e-5)
    want_x = partial.clone()
    dist.all_reduce(want_x)
    want = triton_ops.fused_add_rms_norm(want_x, residual, norm_w, 1e-5)
    torch.cuda.synchronize(device)
    equal = bool(torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]))
    return {
        "rows": rows,
        "k": k,
        "pieces": pieces,
        "ce_equals_nccl": equal,
        "ref_ms": _timed(ref, args.iters, device) * 1e3,
        "ce_ms": _timed(ce, args.iters, device) * 1e3,
        "norm_ms": _timed(norm, args.iters, device) * 1e3,
    }


def _ce_path(rank: int, world: int, args: argparse.Namespace, device: torch.device) -> Any:
    """The engine's copy-engine path for a [.., 4096] bf16 layer, `--rows` rows (None if unavailable)."""
    from pagedllm.distributed import ce_allreduce, fused_allreduce_norm

    os.environ["PAGEDLLM_TP_CE_CHUNKS"] = str(args.chunks)
    group = dist.new_group(list(range(world)))
    fused = fused_allreduce_norm.try_create(group, rank, world, device, torch.bfloat16, 4096, 2048)
    return ce_allreduce.try_create(fused, group, device, args.rows) if fused is not None else None


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    cuda = device.type == "cuda"  # (the CPU check runs small shapes)
    shapes = (("o_proj", 2048), ("down_proj", 7168))
    res: dict[str, Any] = {
        name: _measure(k if cuda else k // 64, args.rows if cuda else 256, 4096 if cuda else 64, args, device)
        for name, k in (shapes if not args.ce_only else ())
    }
    if cuda and world == 2 and not args.no_ce:
        path = _ce_path(rank, world, args, device)
        res["ce"] = {"unavailable": True} if path is None else {
            f"{name}{'_pieces' if p > 1 else ''}": _measure_ce(path, k, args.rows, p, args, device)
            for name, k in shapes for p in dict.fromkeys((1, args.pieces if name == "down_proj" else 1))
        }  # fmt: skip
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
    p.add_argument("--pieces", type=int, default=4, help="down_proj matmuls per partial sum (copy-engine case)")
    p.add_argument("--no-ce", action="store_true", help="skip the copy-engine case")
    p.add_argument("--ce-only", action="store_true", help="only the copy-engine case")
    p.add_argument("--json")
    args = p.parse_args()
    res = run_ranks(_worker, args.world, args, timeout_s=600)
    settings = {s: os.environ.get(s) for s in SETTINGS}
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{device} x{args.world}, {args.chunks} chunks, settings {settings}")
    ce = res.pop("ce", None)
    for name, r in res.items():
        print(
            f"{name} [{r['rows']}, {r['k']}] @ [{r['k']}, {r['n']}]: gemm {r['gemm_ms']:.3f} ms, all-reduce "
            f"{r['ar_ms']:.3f}, serial {r['serial_ms']:.3f}, overlapped {r['overlap_ms']:.3f} "
            f"(max of the two {max(r['gemm_ms'], r['ar_ms']):.3f}); equal to serial: {r['overlap_equals_serial']}"
            + (f"; overlapped, {args.sm_carveout} SMs left to NCCL {r['overlap_carveout_ms']:.3f}"
               if "overlap_carveout_ms" in r else "")
        )  # fmt: skip
    if ce is not None and ce.get("unavailable"):
        print("copy-engine chunked: unavailable (see the workers' warnings)")
    for name, r in (ce or {}).items():
        if name == "unavailable":
            continue
        print(
            f"{name} copy-engine chunked [{r['rows']}, {r['k']}] @ [{r['k']}, 4096], {args.chunks} chunks, "
            f"{r['pieces']} piece(s): F.linear + NCCL + norm {r['ref_ms']:.3f} ms, copy engines {r['ce_ms']:.3f} "
            f"({(1 - r['ce_ms'] / r['ref_ms']) * 100:+.1f} % saved; the norm alone {r['norm_ms']:.3f}); "
            f"equal to NCCL + norm: {r['ce_equals_nccl']}"
        )
    if ce is not None:
        res["ce"] = ce
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "world": args.world, "chunks": args.chunks, "settings": settings,
                       "result": res}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
