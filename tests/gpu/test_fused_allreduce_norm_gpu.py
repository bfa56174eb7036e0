"""The fused tensor-parallel all-reduce + residual add + RMSNorm (`distributed/fused_allreduce_norm.py`) on two
GPUs: bit-identical to NCCL's all-reduce followed by `triton_ops.fused_add_rms_norm`, in bf16 and float32,
for batches of 1 row to more rows than the kernel has programs, eagerly and replayed in a CUDA graph with new
inputs (the device-side epochs and the double buffer across many calls)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.gpu.two_ranks import capture_graph, run_two_ranks

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

ROWS = (1, 2, 7, 127, 128, 129, 300, 1000)
HIDDEN = 4096


def _replays(g: Any, xs: list, rs: list, rank: int, gen: Any, n: int, got: Any, reference: Any) -> list[str]:
    """Replays graph `g` n times with fresh inputs written into `xs` / `rs`; after each, call i's outputs
    (`got(i)` = (the partial sum it reduced, its (normed, residual) result)) against `reference(partial, rs[i])`:
    the failures."""
    failures = []
    for it in range(n):
        for x, r in zip(xs, rs, strict=True):
            x.copy_(torch.randn(x.shape, device=x.device) * (rank + 1 + it))
            r.copy_(torch.randn(r.shape, generator=gen, device=r.device))
        g.replay()
        for i in range(len(xs)):
            partial, out = got(i)
            want = reference(partial, rs[i])
            if out is None or not (torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])):
                failures.append(f"graph replay {it} call {i}")
    return failures


def _worker(rank: int, port: int, dtype_name: str, q: Any) -> None:
    import torch.distributed as dist

    from pagedllm.distributed import fused_allreduce_norm
    from pagedllm.model_executor.layers import triton_ops

    dtype = getattr(torch, dtype_name)
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    fused = fused_allreduce_norm.try_create(group, rank, 2, dev, dtype, HIDDEN, max(ROWS))
    failures: list[str] = [] if fused is not None else ["unavailable"]
    gen = torch.Generator(device=dev).manual_seed(7)  # the same weight and residuals on both ranks
    weight = (torch.rand(HIDDEN, generator=gen, device=dev) + 0.5).to(dtype)

    def reference(x: torch.Tensor, res: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x.clone()
        dist.all_reduce(y, group=group)
        return triton_ops.fused_add_rms_norm(y, res, weight, 1e-5)

    for rows in ROWS if fused is not None else ():
        res = torch.randn(rows, HIDDEN, generator=gen, device=dev).to(dtype)
        x = (torch.randn(rows, HIDDEN, device=dev) * (rank + 1)).to(dtype)
        for _ in range(3):
            got = fused(x, res, weight, 1e-5)
            want = reference(x, res)
            if got is None or not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
                failures.append(f"eager rows={rows}")
    if fused is not None:  # a graph of 5 calls over 3 sizes, replayed with fresh inputs
        xs = [torch.zeros(r, HIDDEN, device=dev, dtype=dtype) for r in (1, 129, 1, 300, 2)]
        rs = [torch.zeros_like(x) for x in xs]
        g, outs = capture_graph(
            lambda: fused(xs[0], rs[0], weight, 1e-5),
            lambda: [fused(x, r, weight, 1e-5) for x, r in zip(xs, rs, strict=True)],
        )
        failures += _replays(g, xs, rs, rank, gen, 4, lambda i: (xs[i], outs[i]), reference)
    torch.cuda.synchronize()
    q.put((rank, failures))
    dist.barrier(group=group)
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_fused_matches_nccl_then_norm(dtype_name: str) -> None:
    assert run_two_ranks(_worker, dtype_name) == {0: [], 1: []}


def _push_worker(rank: int, port: int, q: Any) -> None:
    """The batch-1 push path (`distributed/push_allreduce.py`) through `FusedAllReduceNorm.matmul` and the norm
    call after it, interleaved with the pull kernel's batches, eagerly and in a replayed CUDA graph."""
    import torch.distributed as dist
    from torch import nn

    from pagedllm.distributed import fused_allreduce_norm, push_allreduce
    from pagedllm.model_executor.layers import triton_ops
    from pagedllm.model_executor.layers.linear import UnquantizedLinearMethod

    dtype = torch.bfloat16
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    fused = fused_allreduce_norm.try_create(group, rank, 2, dev, dtype, HIDDEN, 64)
    push = push_allreduce.try_create(group, rank, 2, dev, dtype, HIDDEN)
    failures: list[str] = [] if fused is not None and push is not None else ["unavailable"]
    if fused is not None and push is not None:
        fused.paths.append(push)
        gen = torch.Generator(device=dev).manual_seed(7)
        weight = (torch.rand(HIDDEN, generator=gen, device=dev) + 0.5).to(dtype)
        layer: Any = nn.Module()
        layer.quant_method = UnquantizedLinearMethod()
        layer.bias = None
        layer.weight = nn.Parameter((torch.randn(HIDDEN, 1024, device=dev) / 32).to(dtype), requires_grad=False)

        def step(x: torch.Tensor, res: torch.Tensor) -> Any:
            partial = fused.matmul(layer, x)
            taken = partial is not None
            if partial is None:
                partial = torch.nn.functional.linear(x, layer.weight)
            return taken, partial, fused(partial, res, weight, 1e-5)

        def reference(partial: torch.Tensor, res: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = partial.clone()
            dist.all_reduce(y, group=group)
            return triton_ops.fused_add_rms_norm(y, res, weight, 1e-5)

        for i, rows in enumerate([1, 1, 3, 1, 64, 1, 1, 1, 2]):
            x = (torch.randn(rows, 1024, device=dev) * (rank + 1)).to(dtype)
            res = torch.randn(rows, HIDDEN, generator=gen, device=dev).to(dtype)
            taken, partial, got = step(x, res)
            want = reference(partial, res)
            if taken != (rows == 1) or not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
                failures.append(f"eager call {i} rows={rows} taken={taken}")
        xs = [torch.zeros(r, 1024, device=dev, dtype=dtype) for r in (1, 1, 5, 1)]
        rs = [torch.zeros(x.shape[0], HIDDEN, device=dev, dtype=dtype) for x in xs]
        g, outs = capture_graph(lambda: step(xs[0], rs[0]), lambda: [step(x, r) for x, r in zip(xs, rs, strict=True)])
        failures += _replays(g, xs, rs, rank, gen, 5, lambda i: (outs[i][1], outs[i][2]), reference)
    torch.cuda.synchronize()
    q.put((rank, failures))
    dist.barrier(group=group)
    dist.destroy_process_group()


def test_push_path_matches_nccl_then_norm() -> None:
    assert run_two_ranks(_push_worker) == {0: [], 1: []}
