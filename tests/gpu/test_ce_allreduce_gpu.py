"""The copy-engine prefill path (`distributed/ce_allreduce.py`) on two GPUs: its `matmul` + `add_norm` against
`F.linear` + NCCL's all-reduce + `triton_ops.fused_add_rms_norm`, bf16, W2's o_proj shape per rank ([rows, 2048]
@ [4096, 2048]^T) for row counts above the fused kernel's 2,048 (odd ones, ones not divisible by the chunk
count, W2's 16,384), each several times in a row (both receive slots); a partial sum in four pieces through
`FusedAllReduceNorm` (an MLP in 4,096-token chunks); and a run of back-to-back calls with no host sync between
them while one rank lags (the flags and the two slots under pipelining).

Two checks per call: the reduction, bit-equal to NCCL + the norm of the same partial sum (must hold), and the
chunked GEMM bit-equal to the whole-batch `F.linear` (cuBLAS may pick another kernel for a chunk's row count:
reported as its own test, which the engine does not depend on)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.gpu.two_ranks import run_two_ranks

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

ROWS = (2049, 3001, 4097, 6151, 16384)
HIDDEN, K, CAPACITY, MAX_ROWS = 4096, 2048, 16384, 2048


def _worker(rank: int, port: int, q: Any) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    from pagedllm.distributed import ce_allreduce, fused_allreduce_norm
    from pagedllm.model_executor.layers import triton_ops
    from pagedllm.model_executor.layers.linear import UnquantizedLinearMethod

    dtype = torch.bfloat16
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    res: dict[str, list[str]] = {"reduce": [], "gemm": []}
    fused = fused_allreduce_norm.try_create(group, rank, 2, dev, dtype, HIDDEN, MAX_ROWS)
    path = ce_allreduce.try_create(fused, group, dev, CAPACITY) if fused is not None else None
    if path is None or fused is None:
        res["reduce"].append("unavailable")
    gen = torch.Generator(device=dev).manual_seed(11)  # the same residuals and norm weight on both ranks
    norm_w = (torch.rand(HIDDEN, generator=gen, device=dev) + 0.5).to(dtype)
    layer = nn.Module()
    layer.quant_method = UnquantizedLinearMethod()  # type: ignore[assignment]
    own = torch.Generator(device=dev).manual_seed(100 + rank)  # each rank's own activations and weight shard
    weight = (torch.randn(HIDDEN, K, generator=own, device=dev) / K**0.5).to(dtype)
    layer.weight = nn.Parameter(weight, requires_grad=False)

    def reference(partial: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = partial.clone()
        dist.all_reduce(y, group=group)
        return triton_ops.fused_add_rms_norm(y, residual, norm_w, 1e-5)

    def check(tag: str, got: Any, partial: torch.Tensor, x: torch.Tensor, residual: torch.Tensor) -> None:
        want = reference(partial, residual)
        if got is None or not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
            res["reduce"].append(tag)
        if not torch.equal(partial, F.linear(x, weight)):
            res["gemm"].append(tag)

    for rows in ROWS if path is not None else ():
        residual = torch.randn(rows, HIDDEN, generator=gen, device=dev).to(dtype)
        x = torch.randn(rows, K, generator=own, device=dev).to(dtype)
        for it in range(3):
            partial = path.matmul(layer, x) if path is not None else None
            if partial is None or path is None:
                res["reduce"].append(f"declined rows={rows}")
                continue
            got: Any = path.add_norm(partial, residual, norm_w, 1e-5)
            check(f"rows={rows} call={it}", got, partial, x, residual)
    if path is not None and fused is not None:  # four MLP-chunk pieces through the norm's router
        fused.paths.append(path)
        xs = [torch.randn(4096, K, generator=own, device=dev).to(dtype) for _ in range(4)]
        residual = torch.randn(4 * 4096, HIDDEN, generator=gen, device=dev).to(dtype)
        for it in range(2):
            pieces = [fused.matmul(layer, x) for x in xs]
            if any(p is None for p in pieces):
                res["reduce"].append("pieces declined")
                break
            partial = torch.cat([p for p in pieces if p is not None])
            got = fused(partial, residual, norm_w, 1e-5)
            check(f"4 pieces call={it}", got, partial, torch.cat(xs), residual)
        # Back to back, no host sync: rank 1 lags (a sleep kernel) every third call, so rank 0 runs ahead.
        calls = [(2049 + 997 * i) % 9000 + 2049 for i in range(24)]
        inputs = [torch.randn(r, K, generator=own, device=dev).to(dtype) for r in calls]
        residuals = [torch.randn(r, HIDDEN, generator=gen, device=dev).to(dtype) for r in calls]
        outs = []
        for i, (x, r) in enumerate(zip(inputs, residuals, strict=True)):
            if rank == 1 and i % 3 == 0:
                torch.cuda._sleep(2_000_000)
            partial = fused.matmul(layer, x)
            assert partial is not None
            outs.append((partial, fused(partial, r, norm_w, 1e-5)))
        for i, ((partial, got), x, r) in enumerate(zip(outs, inputs, residuals, strict=True)):
            check(f"back-to-back call={i} rows={calls[i]}", got, partial, x, r)
    torch.cuda.synchronize()
    q.put((rank, res))
    dist.barrier(group=group)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results() -> dict[int, dict[str, list[str]]]:
    return run_two_ranks(_worker)


def test_reduction_bit_equal_to_nccl_then_norm(results: dict[int, dict[str, list[str]]]) -> None:
    assert {r: v["reduce"] for r, v in results.items()} == {0: [], 1: []}


def test_chunked_gemm_bit_equal_to_whole_gemm(results: dict[int, dict[str, list[str]]]) -> None:
    assert {r: v["gemm"] for r, v in results.items()} == {0: [], 1: []}
