"""Tensor parallelism at tp=2, batch-1 decode: the row GEMV pushes its partial sum to the peer as it writes it.

The fused all-reduce + add + RMSNorm (`fused_allreduce_norm.py`) pulls: after o_proj / down_proj finish, one
kernel copies this rank's row into its symmetric buffer, raises a flag in the peer (a system-scope release
store, which waits for the copy to land), waits for the peer's flag, then reads the peer's row over NVLink:
two NVLink round trips on the critical path, ~6.6 us a call on two H100s against ~2.5 us for tp=1's add +
norm, 64 times a W3 step (benchmarks/NOTES.md, session 32).

Here the row GEMV (`triton_gemv.row_gemv(push=...)`) also stores each output element's bits into the peer's
receive buffer, a posted NVLink write, as each program ends; the norm kernel after it (one program) polls its
own, local receive buffer until no element holds the sentinel 0xFFFF (a bf16 / fp16 NaN that the GEMV never
sends), sums the two partials in rank order in float32, rounds to the activation dtype (bit-identical to
NCCL's sum of two), adds the residual, normalizes as `triton_ops.fused_add_rms_norm` does, and writes the
sentinel back. No flags and no fence: each element is its own "arrived" bit ("Lamport" buffers, as
TensorRT-LLM's low-latency all-reduce).

The receive buffer has two halves, picked by the parity of an epoch counter in device memory that the GEMV
reads and the norm increments (so CUDA-graph replays stay in step). Two suffice: the peer writes half h of
our buffer again only in call e + 2, which it reaches after our call e + 1's push, which our GEMV sends only
after our norm of call e (which reset half h) has finished: stream order on our side, causality on the peer's.
Both ranks must make the same calls in the same order (SPMD tensor parallelism).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers import triton_ops
from pagedllm.triton_utils import HAS_TRITON, pdl_args, row_warps
from pagedllm.utils import next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl

    from pagedllm.distributed.fused_allreduce_norm import _add_norm_row
    from pagedllm.triton_utils import pdl_enter

logger = logging.getLogger(__name__)

SENTINEL = -1
"""The int16 view of 0xFFFF: a NaN in bf16 and fp16, never sent (the GEMV sends a NaN as 0x7FFF)."""


if HAS_TRITON:

    @triton.jit
    def _recv_add_norm_kernel(
        x_ptr, res_ptr, out_ptr, res_out_ptr, w_ptr, recv_ptr, epoch_ptr, n_cols, eps, RANK: tl.constexpr,
        BLOCK: tl.constexpr, PDL: tl.constexpr = 0,
    ):  # fmt: skip
        pdl_enter(PDL)
        epoch = tl.load(epoch_ptr)
        offs = tl.arange(0, BLOCK)
        mask = offs < n_cols
        dt = x_ptr.dtype.element_ty
        slot = recv_ptr + (epoch % 2) * n_cols + offs
        own = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        bits = tl.load(slot, mask=mask, other=0, volatile=True)
        while tl.max(tl.where(bits == -1, 1, 0), axis=0) > 0:
            bits = tl.load(slot, mask=mask, other=0, volatile=True)
        peer = bits.to(dt, bitcast=True).to(tl.float32)
        acc = own + peer if RANK == 0 else peer + own  # (rank order, as the other kernels sum)
        _add_norm_row(acc, res_ptr, out_ptr, res_out_ptr, w, 0, 0, n_cols, offs, mask, eps)
        tl.store(slot, tl.full([BLOCK], -1, tl.int16), mask=mask)
        tl.store(epoch_ptr, epoch + 1)


class PushDecode:
    """The batch-1 push path of one tp=2 group (a `fused_allreduce_norm.PartialPath`). Construction is
    collective."""

    def __init__(self, group: Any, rank: int, device: torch.device, dtype: torch.dtype, hidden: int) -> None:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        self.rank, self.dtype, self.hidden = rank, dtype, hidden
        name: Any = group.group_name
        self.recv = symm_mem.empty(2 * hidden, dtype=torch.int16, device=device)
        handle = symm_mem.rendezvous(self.recv, name)
        self.peer_addr = int(handle.buffer_ptrs[1 - rank])
        self.recv.fill_(SENTINEL)
        self.epoch = torch.zeros(1, dtype=torch.int64, device=device)
        self.block = next_pow2(hidden)
        self.num_warps = row_warps(self.block)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # no peer pushes before every rank's buffer holds the sentinel

    def matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """One row through the plain 16-bit row GEMV (no LoRA, no quantization), pushed; else None."""
        from pagedllm.model_executor.layers import triton_gemv
        from pagedllm.model_executor.layers.linear import plain_row_gemv_weight

        weight = plain_row_gemv_weight(layer, x)
        if weight is None or x.dtype != self.dtype or weight.shape[0] != self.hidden:
            return None
        return triton_gemv.row_gemv(x, weight, push=(self.peer_addr, self.epoch))

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + the peer's pushed row + residual), x + peer + residual) for the row `matmul` returned."""
        x2, r2 = x.reshape(1, self.hidden), residual.reshape(1, self.hidden).contiguous()
        out = torch.empty((1, self.hidden), dtype=x.dtype, device=x.device)
        res_out = torch.empty_like(out)
        _recv_add_norm_kernel[(1,)](
            x2, r2, out, res_out, weight, self.recv, self.epoch, self.hidden, eps, RANK=self.rank,
            BLOCK=self.block, num_warps=self.num_warps, **pdl_args(x2, "recv"),
        )  # fmt: skip
        return out.view(residual.shape), res_out.view(residual.shape)


def try_create(
    group: Any, rank: int, world: int, device: torch.device, dtype: torch.dtype, hidden: int
) -> PushDecode | None:
    """The push path at tp=2 with 16-bit activations, checked once against NCCL + the unfused norm on a
    random GEMV (both halves of the buffer, then the first again); None where unavailable or `PAGEDLLM_TP_PUSH=0`
    (the ranks agree)."""
    import torch.distributed as dist

    from pagedllm import envs
    from pagedllm.distributed.agreement import all_ranks_true
    from pagedllm.model_executor.layers import triton_gemv

    if world != 2 or dtype not in (torch.bfloat16, torch.float16) or not envs.PAGEDLLM_TP_PUSH:
        return None
    push: PushDecode | None = None
    try:
        push = PushDecode(group, rank, device, dtype, hidden)
        gen = torch.Generator(device=device).manual_seed(4321 + rank)
        k = 256
        w = (torch.randn(hidden, k, generator=gen, device=device) / 16).to(dtype)
        norm_w = (torch.rand(hidden, generator=gen, device=device) + 0.5).to(dtype)
        for i in range(3):
            x = torch.randn(1, k, generator=gen, device=device).to(dtype)
            residual = torch.randn(1, hidden, generator=gen, device=device).to(dtype)
            partial = triton_gemv.row_gemv(x, w, push=(push.peer_addr, push.epoch))
            got = push.add_norm(partial, residual, norm_w, 1e-6)
            want_x = partial.clone()
            dist.all_reduce(want_x, group=group)
            want = triton_ops.fused_add_rms_norm(want_x, residual, norm_w, 1e-6)
            torch.cuda.synchronize(device)
            if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
                raise RuntimeError(f"pushed all-reduce + RMSNorm disagrees with NCCL + RMSNorm (call {i})")
    except Exception as e:  # no peer mapping, no symmetric memory, no Triton: the pull kernel as before
        logger.warning("tensor parallel: batch-1 push all-reduce unavailable (%s)", e)
        push = None
    if not all_ranks_true(push is not None, group, device) or push is None:
        return None
    logger.info("tensor parallel: batch-1 row GEMVs push their partial sums to the peer")
    return push
