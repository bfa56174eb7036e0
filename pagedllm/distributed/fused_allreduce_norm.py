"""Tensor parallelism: a row-parallel layer's all-reduce fused with the residual add and RMSNorm after it (CUDA).

In a Llama layer at tp > 1 the o_proj and down_proj outputs are partial sums that NCCL all-reduces, and the
next kernel adds the residual and normalizes. At batch 1 on two H100s (W3) NCCL's all-reduce costs ~6.6 us
in the decode graph and the add + RMSNorm kernel another launch, 64 times a step: together ~0.5 ms of the
3.8 ms step that tp=1 does not pay (benchmarks/NOTES.md, session 25). Here one kernel does all three:

1. each program copies its rows of this rank's partial sum into this rank's symmetric-memory buffer (one
   that every peer maps over NVLink, from `torch.distributed._symmetric_memory`),
2. signals each peer (a release store at system scope into the peer's flag for this program) and waits for
   the peers' flags (acquire),
3. sums the ranks' rows in rank order in float32, rounds to the activation dtype (as NCCL's sum is rounded),
   then adds the residual and normalizes exactly as `triton_ops.fused_add_rms_norm` does.

With two ranks the sum a + b rounds as NCCL's does, so the results are bit-identical to the unfused path;
with more ranks both paths are a fixed-order sum on every rank (the ranks agree; NCCL's order may differ).

Synchronization without a host: every program keeps an epoch counter in device memory, incremented on every
call (the grid is always `MAX_PROGRAMS` wide, so all counters stay equal and replaying a CUDA graph is fine);
a peer's flag holds the epoch it reached. The data buffer is double-buffered by the epoch's parity: a rank can
run ahead into call e + 1 (writing the other half) while a peer still reads call e's half, but not into
e + 2, whose handshake needs that peer's signal from call e + 1, sent only after its call e has finished.

Both ranks must make the same calls in the same order with the same shapes (true of SPMD tensor parallelism).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from pagedllm.model_executor.layers import triton_ops
from pagedllm.triton_utils import HAS_TRITON, pdl_args, row_warps
from pagedllm.utils import next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl

    from pagedllm.triton_utils import pdl_enter

logger = logging.getLogger(__name__)

MAX_PROGRAMS = 128
"""The kernel's grid: at most this many programs hold rows (one row each up to this batch size)."""

AllReduceNorm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], "tuple[torch.Tensor, torch.Tensor] | None"]
"""(partial x, residual, norm weight, eps) -> (norm(sum x + residual), sum x + residual), or None where the
fused kernel does not apply (the caller then all-reduces and normalizes as usual)."""


class PartialSender(Protocol):
    """What a row-parallel layer with deferred reduction calls for its matmul (`RowParallelLinear.partial_sender`)."""

    def matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """This rank's partial sum x @ W^T, already on its way to the peers; None where not taken (decided from
        shapes only, so that every rank agrees): the layer then computes it and the next norm reduces."""
        ...


class PartialPath(PartialSender, Protocol):
    """One way of sending partial sums early (batch-1 decode, large prefill steps); the norm after the
    layer then only adds what the peers sent. A path that took a matmul is handed every further one until the
    norm and must take it (rows appended: an MLP block in token chunks calls down_proj once per chunk)."""

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(sum of the ranks' partials + residual), that sum + residual) for the x the last `matmul` gave."""
        ...


if HAS_TRITON:

    @triton.jit
    def _add_norm_row(acc, res_ptr, out_ptr, res_out_ptr, w, row64, stride_r, n_cols, offs, mask, eps):
        """One row's tail, shared with the copy-engine path (`ce_allreduce.py`): `acc` is the float32 sum of the
        ranks' partials in rank order; rounded to the activation dtype (as NCCL's sum is), then the residual add
        and RMSNorm exactly as `triton_ops.fused_add_rms_norm` does. Outputs are contiguous [rows, n_cols]."""
        dt = res_out_ptr.dtype.element_ty
        x = acc.to(dt)  # the all-reduced value, rounded as NCCL's is
        r_in = tl.load(res_ptr + row64 * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r_in.to(tl.float32)).to(dt)
        tl.store(res_out_ptr + row64 * n_cols + offs, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / n_cols
        rstd = 1.0 / tl.sqrt(var + eps)
        normed = (xf * rstd).to(dt).to(tl.float32)
        tl.store(out_ptr + row64 * n_cols + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _all_reduce_add_norm_kernel(
        x_ptr,
        res_ptr,
        out_ptr,
        res_out_ptr,
        w_ptr,
        buf_ptrs,
        flag_ptrs,
        epoch_ptr,
        n_rows,
        n_active,
        n_cols,
        stride_x,
        stride_r,
        parity_stride,
        eps,
        RANK: tl.constexpr,
        WORLD: tl.constexpr,
        MAXP: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr = 0,
    ):
        pdl_enter(PDL)
        pid = tl.program_id(0)
        epoch = tl.load(epoch_ptr + pid) + 1
        tl.store(epoch_ptr + pid, epoch)
        if pid < n_active:
            dt = x_ptr.dtype.element_ty
            bufs = buf_ptrs.to(tl.pointer_type(tl.uint64))
            flags = flag_ptrs.to(tl.pointer_type(tl.uint64))
            base = (epoch % 2) * parity_stride
            offs = tl.arange(0, BLOCK)
            mask = offs < n_cols
            own = tl.load(bufs + RANK).to(tl.pointer_type(dt))
            for row in range(pid, n_rows, n_active):
                row64 = tl.cast(row, tl.int64)
                v = tl.load(x_ptr + row64 * stride_x + offs, mask=mask)
                tl.store(own + base + row64 * n_cols + offs, v, mask=mask)
            tl.debug_barrier()  # every thread's rows are written before the flag goes out
            for r in tl.static_range(WORLD):
                if r != RANK:
                    peer_flags = tl.load(flags + r).to(tl.pointer_type(tl.int64))
                    tl.atomic_xchg(peer_flags + RANK * MAXP + pid, epoch, sem="release", scope="sys")
            my_flags = tl.load(flags + RANK).to(tl.pointer_type(tl.int64))
            for r in tl.static_range(WORLD):
                if r != RANK:
                    seen = tl.atomic_add(my_flags + r * MAXP + pid, 0, sem="acquire", scope="sys")
                    while seen < epoch:
                        seen = tl.atomic_add(my_flags + r * MAXP + pid, 0, sem="acquire", scope="sys")
            tl.debug_barrier()
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            for row in range(pid, n_rows, n_active):
                row64 = tl.cast(row, tl.int64)
                acc = tl.zeros([BLOCK], dtype=tl.float32)
                for r in tl.static_range(WORLD):
                    if r == RANK:
                        v = tl.load(x_ptr + row64 * stride_x + offs, mask=mask, other=0.0)
                    else:
                        peer = tl.load(bufs + r).to(tl.pointer_type(dt))
                        v = tl.load(peer + base + row64 * n_cols + offs, mask=mask, other=0.0, cache_modifier=".cv")
                    acc += v.to(tl.float32)
                _add_norm_row(acc, res_ptr, out_ptr, res_out_ptr, w, row64, stride_r, n_cols, offs, mask, eps)


class FusedAllReduceNorm:
    """The fused all-reduce + residual add + RMSNorm of one tensor-parallel group, for [rows, hidden] inputs
    of one dtype with rows <= `max_rows`. Construction is collective (every rank of `group`)."""

    def __init__(
        self, group: Any, rank: int, world: int, device: torch.device, dtype: torch.dtype, hidden: int, max_rows: int
    ) -> None:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        self.rank, self.world, self.dtype, self.hidden, self.max_rows = rank, world, dtype, hidden, max_rows
        name: Any = group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed by older PyTorch releases
            enable(name)
        self.data = symm_mem.empty(2 * max_rows * hidden, dtype=dtype, device=device)
        self.data_handle = symm_mem.rendezvous(self.data, name)
        self.flags = symm_mem.empty(world * MAX_PROGRAMS, dtype=torch.int64, device=device)
        self.flags_handle = symm_mem.rendezvous(self.flags, name)
        self.flags.zero_()
        self.epoch = torch.zeros(MAX_PROGRAMS, dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # no peer signals before every rank's flags are zero
        self.block = next_pow2(hidden)
        self.num_warps = row_warps(self.block)
        self.paths: list[PartialPath] = []
        """Ways of sending partial sums from the matmul (tried in order); the rows of a path's matmul are
        reduced by that path at the next norm."""
        self._pending: PartialPath | None = None

    def matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """`PartialSender.matmul`: the first path that takes x. A path that took one takes every matmul until the
        norm: the pieces of one partial sum (an MLP block in token chunks calls down_proj per chunk)."""
        if self._pending is not None:
            out = self._pending.matmul(layer, x)
            assert out is not None, "a path took a partial sum's first piece but not the next"
            return out
        for path in self.paths:
            out = path.matmul(layer, x)
            if out is not None:
                self._pending = path
                return out
        return None

    def fits(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Decided from shapes and dtypes only, so that every rank takes the same path."""
        return (
            x.dtype == self.dtype
            and residual.dtype == self.dtype
            and x.dim() == residual.dim()
            and x.shape[-1] == self.hidden
            and 0 < x.numel() // self.hidden <= self.max_rows
        )

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        pending, self._pending = self._pending, None
        if pending is not None:  # the peers' partials were sent by the matmul
            return pending.add_norm(x, residual, weight, eps)
        if not self.fits(x, residual) or weight.dtype != self.dtype:
            return None
        x2 = x.reshape(-1, self.hidden)
        r2 = residual.reshape(-1, self.hidden)
        if x2.stride(-1) != 1 or r2.stride(-1) != 1:
            return None
        rows = x2.shape[0]
        out = torch.empty((rows, self.hidden), dtype=self.dtype, device=x.device)
        res_out = torch.empty_like(out)
        _all_reduce_add_norm_kernel[(MAX_PROGRAMS,)](
            x2,
            r2,
            out,
            res_out,
            weight,
            self.data_handle.buffer_ptrs_dev,
            self.flags_handle.buffer_ptrs_dev,
            self.epoch,
            rows,
            min(rows, MAX_PROGRAMS),
            self.hidden,
            x2.stride(0),
            r2.stride(0),
            self.max_rows * self.hidden,
            eps,
            RANK=self.rank,
            WORLD=self.world,
            MAXP=MAX_PROGRAMS,
            BLOCK=self.block,
            num_warps=self.num_warps,
            **pdl_args(x2, "pull"),
        )
        return out.view(residual.shape), res_out.view(residual.shape)


def default_max_rows(max_num_tokens: int) -> int:
    """Decode-sized batches, up to 2,048 rows. Above that NCCL's ring and the separate norm cost about the same
    as this kernel (2 x H100, [8192, 4096] bf16: 336 us against 314), and the buffer would take KV-cache memory.
    (With more than two ranks a one-shot read of every peer's rows moves (world - 1)x the bytes: only decode
    sizes would pay there; the engine uses the kernel at tp=2, the measured case.)"""
    from pagedllm import envs

    if envs.PAGEDLLM_TP_FUSED_MAX_ROWS is not None:
        return min(envs.PAGEDLLM_TP_FUSED_MAX_ROWS, max_num_tokens)
    return min(2048, max_num_tokens)


def try_create(
    group: Any, rank: int, world: int, device: torch.device, dtype: torch.dtype, hidden: int, max_rows: int
) -> FusedAllReduceNorm | None:
    """The fused kernel for this group, checked once against NCCL + the unfused norm; None where it cannot be
    used on every rank (the ranks agree, so all keep NCCL then)."""
    import torch.distributed as dist

    from pagedllm.distributed.agreement import all_ranks_true

    fused: FusedAllReduceNorm | None = None
    try:
        fused = FusedAllReduceNorm(group, rank, world, device, dtype, hidden, max_rows)
        gen = torch.Generator(device=device).manual_seed(1234)
        weight = torch.rand(hidden, generator=gen, device=device).to(dtype) + 0.5
        residual = torch.randn(3, hidden, generator=gen, device=device).to(dtype)
        x = (torch.randn(3, hidden, device=device) * (rank + 1)).to(dtype)
        want_x = x.clone()
        dist.all_reduce(want_x, group=group)
        want = triton_ops.fused_add_rms_norm(want_x, residual, weight, 1e-6)
        for _ in range(3):  # both halves of the buffer, then the first again
            got = fused(x, residual, weight, 1e-6)
            assert got is not None
            torch.cuda.synchronize(device)
            same = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            if not same and world == 2:  # more ranks: NCCL may add in another order
                raise RuntimeError("fused all-reduce + RMSNorm disagrees with NCCL + RMSNorm on the self-check")
    except Exception as e:  # no peer access, no symmetric memory, no Triton: NCCL as before
        logger.warning("tensor parallel: fused all-reduce + RMSNorm unavailable (%s); NCCL only", e)
        fused = None
    if not all_ranks_true(fused is not None, group, device) or fused is None:
        return None
    logger.info("tensor parallel: all-reduce fused with the residual add and RMSNorm up to %d rows", max_rows)
    return fused
