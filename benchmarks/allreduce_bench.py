"""All-reduce cost per decode step on this machine's GPUs (issue 25), and the one-GPU ceilings for the floors.

One process per GPU (NCCL). For each activation size [rows, hidden] in bf16 it captures `per_step`
all-reduces in one CUDA graph (a Llama-3.1-8B decode step makes 2 per layer x 32 layers = 64) and times the
replays: NCCL (`torch.distributed.all_reduce`) and the one-shot symmetric-memory path
(`pagedllm/distributed/symm_allreduce.py`), which is also checked against NCCL on random data; then NCCL
followed by the residual add + RMSNorm kernel against the fused all-reduce + add + RMSNorm
(`pagedllm/distributed/fused_allreduce_norm.py`, checked bit for bit against the former). Rank 0 also
measures the device-to-device copy bandwidth and the bf16 matmul rate of its GPU (the floors' denominators).

    python3 benchmarks/allreduce_bench.py --world 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from typing import Any

import torch
import torch.multiprocessing as mp

ROWS = (1, 8, 64, 256, 1024, 8192)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(worker: Any, world: int, args: argparse.Namespace, timeout_s: float) -> Any:
    """`worker(rank, world, port, args, queue)` in one spawned process per rank (rank 0 puts its result on the
    queue); returns that result once every process has exited."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, args, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    result = queue.get(timeout=timeout_s)
    for proc in procs:
        proc.join(60)
    return result


def _graph_time(fn: Any, per_step: int, iters: int) -> float:
    """Mean seconds of one call of `fn`, from CUDA-graph replays of `per_step` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(per_step):
            fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (iters * per_step)


def _eager_time(fn: Any, n: int) -> float:
    """Mean seconds of one eager call (host launch cost included), n calls back to back, then a sync."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def _two_shot(group: Any, dev: torch.device, numel: int) -> Any:
    """PyTorch's two-shot all-reduce (reduce-scatter then all-gather over symmetric memory, no multicast) for
    the large sizes: a callable doing it in place on x through a staging buffer, or None if unavailable."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(numel, device=dev, dtype=torch.bfloat16)
        symm_mem.rendezvous(buf, group.group_name)

        def run(x: torch.Tensor) -> torch.Tensor:
            staged = buf[: x.numel()]
            staged.copy_(x.view(-1))
            torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", group.group_name)
            x.view(-1).copy_(staged)
            return x

        return run
    except Exception as e:
        print(f"two-shot all-reduce unavailable: {type(e).__name__}: {e}", flush=True)
        return None


def _ceilings() -> dict[str, float]:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    copy = 2 * x.numel() * 10 / (time.perf_counter() - t0)
    del x, y
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    mm = 2 * 8192**3 * 10 / (time.perf_counter() - t0)
    return {"copy_GBps": copy / 1e9, "bf16_matmul_TFLOPs": mm / 1e12}


def _gemv_reduce(group: Any, rank: int, dev: torch.device, fused: Any, weight: torch.Tensor, args: Any) -> Any:
    """Batch 1 at tp=2, o_proj's and down_proj's per-rank GEMV shapes (Llama-3.1-8B) followed by their
    reduction: the add + norm alone (no communication: what tp=1 pays after its GEMV), the pull kernel, and the
    push path (`distributed/push_allreduce.py`); us per GEMV + reduction, `per_step` of them in a graph."""
    import torch.distributed as dist

    from pagedllm.distributed import push_allreduce
    from pagedllm.model_executor.layers import triton_gemv, triton_ops

    push = push_allreduce.try_create(group, rank, 2, dev, torch.bfloat16, args.hidden)
    out: dict[str, Any] = {"push": push is not None}
    res = torch.randn(1, args.hidden, dtype=torch.bfloat16, device=dev)
    for name, k in (("o_proj", 2048), ("down_proj", 7168)):
        w = torch.randn(args.hidden, k, dtype=torch.bfloat16, device=dev) / 64
        x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
        cases: dict[str, Any] = {
            "gemv": lambda w=w, x=x: triton_gemv.row_gemv(x, w),
            "gemv_norm": lambda w=w, x=x: triton_ops.fused_add_rms_norm(triton_gemv.row_gemv(x, w), res, weight, 1e-5),
            "gemv_pull": lambda w=w, x=x: fused(triton_gemv.row_gemv(x, w), res, weight, 1e-5),
        }
        if push is not None:
            cases["gemv_push"] = lambda w=w, x=x, p=push: p.add_norm(
                triton_gemv.row_gemv(x, w, push=(p.peer_addr, p.epoch)), res, weight, 1e-5
            )
        for case, fn in cases.items():
            out[f"{name}_{case}_us"] = _graph_time(fn, args.per_step, args.iters) * 1e6
            dist.barrier(group=group)  # (each case's graph time ends synchronized)
    return out


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, q: Any) -> None:
    import torch.distributed as dist

    from pagedllm.distributed import fused_allreduce_norm
    from pagedllm.distributed.symm_allreduce import try_create
    from pagedllm.model_executor.layers import triton_ops

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    dev = torch.device("cuda", rank)
    fast = try_create(group, dev, torch.bfloat16)
    two_shot = _two_shot(group, dev, max(ROWS) * args.hidden)
    fused = fused_allreduce_norm.try_create(group, rank, world, dev, torch.bfloat16, args.hidden, max(ROWS))
    weight = torch.rand(args.hidden, device=dev).to(torch.bfloat16) + 0.5
    rows_out: list[dict[str, Any]] = []
    for rows in ROWS:
        x = torch.randn(rows, args.hidden, dtype=torch.bfloat16, device=dev)
        row: dict[str, Any] = {"rows": rows, "bytes": x.numel() * 2}
        nccl_t = _graph_time(lambda x=x: dist.all_reduce(x, group=group), args.per_step, args.iters)
        row["nccl_us"] = nccl_t * 1e6
        row["nccl_eager_us"] = _eager_time(lambda x=x: dist.all_reduce(x, group=group), args.per_step) * 1e6
        if two_shot is not None:
            row["two_shot_us"] = _graph_time(lambda x=x: two_shot(x), args.per_step, args.iters) * 1e6
        if fast is not None and fast.eligible(x):
            ref = torch.randn(rows, args.hidden, dtype=torch.bfloat16, device=dev) * (rank + 1)
            want = ref.clone()
            dist.all_reduce(want, group=group)
            got = fast(ref.clone())
            row["symm_max_abs_diff"] = float((got.float() - want.float()).abs().max())
            row["symm_us"] = _graph_time(lambda x=x: fast(x), args.per_step, args.iters) * 1e6
        res = torch.randn_like(x)

        def nccl_norm(x: torch.Tensor = x, res: torch.Tensor = res) -> Any:
            dist.all_reduce(x, group=group)
            return triton_ops.fused_add_rms_norm(x, res, weight, 1e-5)

        row["nccl_norm_us"] = _graph_time(nccl_norm, args.per_step, args.iters) * 1e6
        if fused is not None:
            part = torch.randn_like(x) * (rank + 1)
            want = nccl_norm(part.clone())
            got = fused(part, res, weight, 1e-5)
            assert got is not None
            row["fused_equal"] = bool(torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]))
            row["fused_us"] = _graph_time(lambda x=x, res=res: fused(x, res, weight, 1e-5), args.per_step, args.iters)
            row["fused_us"] *= 1e6
        rows_out.append(row)
        dist.barrier(group=group)
    result: dict[str, Any] = {"world": world, "hidden": args.hidden, "per_step": args.per_step, "sizes": rows_out}
    if fused is not None and world == 2:
        result["gemv_reduce"] = _gemv_reduce(group, rank, dev, fused, weight, args)
    if rank == 0:
        result["gpu"] = torch.cuda.get_device_name(0)
        result.update(_ceilings())
        q.put(result)
    dist.barrier(group=group)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--per-step", type=int, default=64)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    result = run_ranks(_worker, args.world, args, timeout_s=300)
    print(f"{result['gpu']} x{args.world}: copy {result['copy_GBps']:.0f} GB/s, "
          f"bf16 matmul {result['bf16_matmul_TFLOPs']:.0f} TFLOP/s")  # fmt: skip
    for r in result["sizes"]:
        symm = f"{r['symm_us']:.1f} us (max diff {r['symm_max_abs_diff']:.3g})" if "symm_us" in r else "-"
        size = f"[{r['rows']:5d}, {args.hidden}] {r['bytes'] / 1024:8.0f} KiB"
        step_ms = r["nccl_us"] * args.per_step / 1000
        two = f"{r['two_shot_us']:.1f} us" if "two_shot_us" in r else "-"
        fz = f"{r['fused_us']:.1f} us (bit-equal: {r['fused_equal']})" if "fused_us" in r else "-"
        print(f"{size}: NCCL {r['nccl_us']:.1f} us (eager {r['nccl_eager_us']:.1f}), one-shot {symm}, two-shot {two}; "
              f"x{args.per_step} per step: NCCL {step_ms:.3f} ms; NCCL + add-norm {r['nccl_norm_us']:.1f} us, "
              f"fused {fz}")  # fmt: skip
    if "gemv_reduce" in result:
        g = result["gemv_reduce"]
        for name in ("o_proj", "down_proj"):
            print(f"batch 1, {name} GEMV + reduction (us): " + ", ".join(
                f"{c} {g[f'{name}_{c}_us']:.1f}" for c in ("gemv", "gemv_norm", "gemv_pull", "gemv_push")
                if f"{name}_{c}_us" in g))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
