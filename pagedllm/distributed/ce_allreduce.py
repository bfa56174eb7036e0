"""Tensor parallelism at tp=2, prefill-sized steps: row-parallel partial sums sent by the copy engines (CUDA).

In a W2 prefill step (16,384 tokens, Llama-3.1-8B at tp=2) each o_proj / down_proj output is a [16384, 4096]
bf16 partial sum (128 MiB) that NCCL all-reduces in ~0.35 ms while no compute runs: 64 times a step, ~11 % of
it. Chunking the GEMM and starting NCCL per chunk did not overlap (benchmarks/NOTES.md, session 33, change 3):
NCCL's kernels need SMs that the GEMM's blocks hold. Copy engines need none. Here (a `PartialPath` of
`fused_allreduce_norm.FusedAllReduceNorm`, taking the rows above its fused kernel's `max_rows`):

1. `matmul` computes x @ W^T in up to C row chunks (`PAGEDLLM_TP_CE_CHUNKS`) on the compute stream; after each
   chunk a side stream copies it into the peer's symmetric-memory receive buffer (a `cudaMemcpyAsync` to the
   peer's memory over NVLink: a copy engine, no SM) and then writes this call's epoch into the peer's flag
   for that chunk (`cuStreamWriteValue32`, which fences the preceding writes first, as PyTorch's own async
   tensor parallelism signals after a copy). Chunk i's copy runs under chunk i + 1's GEMM.
2. `add_norm` (the norm after the layer) runs one kernel: each program walks its rows in chunk order, waits
   (a system-scope acquire) until the chunk's flag shows the epoch, then sums its own and the received row in
   rank order in float32, rounds to the dtype and adds the residual and normalizes with the fused kernel's
   code (`_add_norm_row`): bit-identical to NCCL's all-reduce + `triton_ops.fused_add_rms_norm`. Rows of the
   early chunks are normalized while the last chunk's copy is still in flight.

Epochs are a host counter: these steps are eager (`matmul` declines inside graph capture), and both ranks take
the same decisions from shapes and config only, so they count the same calls. Flags hold epochs modulo 2^30
and "arrived" means the flag is the epoch or one ahead (a peer is never further ahead, below); each norm also
rewrites one flag its call did not use (round robin), so that no flag falls 2^30 epochs behind.

Why two receive slots (by the epoch's parity) suffice: rank B writes call e + 2's rows into A's slot e % 2 only
after B's GEMM chunks of call e + 2, which follow (on B's stream) B's norm of call e + 1, which waited for A's
flags of call e + 1, which A's copies send after A's GEMM chunks of e + 1, which follow A's norm of call e:
A has read slot e % 2 before B may overwrite it. The same chain bounds a flag to at most one epoch ahead.

A partial sum may come in pieces: an MLP block run in token chunks (`LlamaMLP.chunk_tokens`) calls down_proj
once per chunk and hands the norm the outputs concatenated. The first piece decides (shapes only); every
further matmul until the norm is then taken too and its rows continue where the last piece's ended (chunks are
cut at multiples of one `step`; chunk c's flag is written once its last row is sent, the last partial chunk's
at the norm). A piece's copy then also runs under the next piece's gate/up GEMM and activation.

Lifetimes: each matmul output is `record_stream`-ed on the side stream, so its memory is not reused before the
copies have read it. No SM work is ever queued on the side stream (copies and stream memory writes only), so
the spinning norm kernel cannot starve what it waits for; and what it waits for is enqueued (host order) before
it, so even streams sharing one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1) do not deadlock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.fused_allreduce_norm import FusedAllReduceNorm
from pagedllm.model_executor.layers import triton_ops
from pagedllm.model_executor.layers.linear import UnquantizedLinearMethod, plain_weight
from pagedllm.triton_utils import HAS_TRITON, row_warps
from pagedllm.utils import next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl

    from pagedllm.distributed.fused_allreduce_norm import _add_norm_row

logger = logging.getLogger(__name__)

MAX_CHUNKS = 8
"""The most chunks a piece (a matmul's rows) is cut into."""
MIN_CHUNK_ROWS = 4096
"""Smaller chunks run the GEMM below its efficient size and each costs an event and two copies: W2's down_proj,
called in 4,096-row pieces (the MLP's token chunks), cut into 1,024-row chunks took 2.52 ms against NCCL's 2.00
(2 x H200, `overlap_bench.py`, benchmarks/NOTES.md, session 35); a piece is then one chunk, and the pieces
overlap each other's copies."""
ROW_ALIGN = 128
"""Chunk boundaries on multiples of a GEMM tile's rows."""
EPOCH_MOD = 1 << 30
"""Flags are 32-bit (`cuStreamWriteValue32`); epochs wrap here (even, so the slot parity keeps alternating)."""


def chunk_step(rows: int, chunks: int) -> int:
    """Rows per chunk for a first piece of `rows` rows: at most `chunks` (capped to MAX_CHUNKS) chunks of at
    least MIN_CHUNK_ROWS rows (the last may be shorter), on ROW_ALIGN boundaries. Later pieces of the same
    partial sum are cut at the same multiples."""
    n = max(1, min(chunks, MAX_CHUNKS, rows // MIN_CHUNK_ROWS))
    per_chunk = -(-rows // n)
    return max(MIN_CHUNK_ROWS, -(-per_chunk // ROW_ALIGN) * ROW_ALIGN)


def piece_bounds(start: int, rows: int, step: int) -> list[tuple[int, int]]:
    """The [a, b) (rows of the whole partial sum) of rows [start, start + rows), cut at multiples of `step`:
    chunk c = row // step is complete, and its flag written, once its last row is sent."""
    bounds, a, end = [], start, start + rows
    while a < end:
        b = min((a // step + 1) * step, end)
        bounds.append((a, b))
        a = b
    return bounds


@dataclass
class _Sending:
    """The partial sum being sent (one per norm): its epoch, chunk rows, rows sent and chunks flagged."""

    epoch: int
    step: int
    sent: int = 0
    flagged: int = 0


@dataclass(frozen=True)
class Admission:
    """Which matmuls the path takes: decided from shapes, dtypes and config only, so every rank agrees."""

    dtype: torch.dtype
    hidden: int
    min_rows: int
    """Rows above this (the fused kernel's `max_rows`; below, that kernel reduces)."""
    capacity: int
    """The receive buffer's rows per slot (the engine's max_num_tokens)."""
    chunks: int

    def layer_ok(self, layer: nn.Module, k: int) -> bool:
        """A plain dense weight [hidden, k] of the dtype, multiplied by `F.linear`: no quantization, packing,
        bias, LoRA, or batch-invariant GEMM (those layers compute their own way)."""
        weight = plain_weight(layer)
        return weight is not None and weight.dtype == self.dtype and tuple(weight.shape) == (self.hidden, k)

    def step_for(self, layer: nn.Module, x: torch.Tensor) -> int | None:
        """The chunk step where the path takes `layer(x)`, else None (device checks are the caller's)."""
        if x.dtype != self.dtype or x.dim() < 2 or x.shape[-1] == 0:
            return None
        rows = x.numel() // x.shape[-1]
        if not self.min_rows < rows <= self.capacity or not self.layer_ok(layer, x.shape[-1]):
            return None
        return chunk_step(rows, self.chunks)


if HAS_TRITON:

    @triton.jit(do_not_specialize=["epoch"])
    def _recv_add_norm_kernel(
        x_ptr,
        recv_ptr,
        res_ptr,
        out_ptr,
        res_out_ptr,
        w_ptr,
        flags_ptr,
        epoch,
        n_rows,
        n_cols,
        step,
        stride_x,
        stride_r,
        eps,
        RANK: tl.constexpr,
        MOD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < n_cols
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        cur = -1
        for row in range(pid, n_rows, tl.num_programs(0)):  # ascending rows: chunks in the order they arrive
            c = row // step
            if c != cur:
                seen = tl.atomic_add(flags_ptr + c, 0, sem="acquire", scope="sys")
                while (seen - epoch + MOD) % MOD > 1:  # not yet this epoch (or the next: the peer ran ahead)
                    seen = tl.atomic_add(flags_ptr + c, 0, sem="acquire", scope="sys")
                tl.debug_barrier()
                cur = c
            row64 = tl.cast(row, tl.int64)
            own = tl.load(x_ptr + row64 * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
            peer = tl.load(recv_ptr + row64 * n_cols + offs, mask=mask, other=0.0, cache_modifier=".cg")
            if RANK == 0:  # rank order, as the fused kernel sums (with two terms either order rounds the same)
                acc = own + peer.to(tl.float32)
            else:
                acc = peer.to(tl.float32) + own
            _add_norm_row(acc, res_ptr, out_ptr, res_out_ptr, w, row64, stride_r, n_cols, offs, mask, eps)


def recv_add_norm(
    x: torch.Tensor,
    recv: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    flags: torch.Tensor,
    epoch: int,
    step: int,
    rank: int,
    programs: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch of the norm kernel: x [rows, hidden] this rank's partial, recv [>= rows, hidden] the peer's
    (contiguous), flags the int32 per-chunk flags the peer writes. Returns (normed, new residual)."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    r2 = residual.reshape(-1, hidden)
    r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out)
    block = next_pow2(hidden)
    _recv_add_norm_kernel[(max(1, min(rows, programs)),)](
        x2,
        recv,
        r2,
        out,
        res_out,
        weight,
        flags,
        epoch,
        rows,
        hidden,
        step,
        x2.stride(0),
        r2.stride(0),
        eps,
        RANK=rank,
        MOD=EPOCH_MOD,
        BLOCK=block,
        num_warps=row_warps(block),
    )
    return out.view(residual.shape), res_out.view(residual.shape)


class CopyEnginePrefill:
    """The `PartialPath` for prefill-sized steps at tp=2 (module docstring). Construction is collective."""

    def __init__(self, fused: FusedAllReduceNorm, group: Any, device: torch.device, capacity: int, chunks: int) -> None:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        from pagedllm.triton_utils import num_sms

        if fused.world != 2:
            raise ValueError("the copy-engine path exchanges with one peer (tp=2)")
        self.rank, self.peer, self.device, self.hidden = fused.rank, 1 - fused.rank, device, fused.hidden
        self.admit = Admission(fused.dtype, fused.hidden, fused.max_rows, capacity, chunks)
        self.n_flags = -(-capacity // MIN_CHUNK_ROWS)
        name: Any = group.group_name
        symm_mem.enable_symm_mem_for_group(name)  # (idempotent; the fused kernel's buffers did it already)
        self.recv = symm_mem.empty(2 * capacity * self.hidden, dtype=fused.dtype, device=device)
        recv_handle = symm_mem.rendezvous(self.recv, name)
        self.flags = symm_mem.empty(self.n_flags, dtype=torch.int32, device=device)
        flags_handle = symm_mem.rendezvous(self.flags, name)
        self.flags.zero_()
        self.peer_recv = recv_handle.get_buffer(self.peer, (2, capacity, self.hidden), fused.dtype)
        self.peer_flags = flags_handle.get_buffer(self.peer, (self.n_flags,), torch.uint32)
        self._handles = (recv_handle, flags_handle)  # (kept alive with the views into the peer's memory)
        self._write_value32 = torch.ops.symm_mem.stream_write_value32_  # (flat uint32 tensor, index, value)
        self.side = torch.cuda.Stream(device)
        self.chunk_done = torch.cuda.Event()  # (a wait takes the record made before it: one event serves all)
        self.programs = 4 * num_sms(device)
        self.count = 0
        """Partial sums sent so far (the same on every rank): the epoch."""
        self._pending: _Sending | None = None
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # no peer writes a flag before every rank's flags are zero

    def matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """`PartialPath.matmul`: this rank's partial sum, each row chunk sent to the peer once computed. Once a
        matmul is taken, every further one until the norm is too: the pieces of one partial sum (an MLP block
        run in token chunks calls down_proj per chunk; the norm gets them concatenated, in order)."""
        if not x.is_cuda or torch.cuda.is_current_stream_capturing():
            return None
        k = x.shape[-1]
        send = self._pending
        if send is None:
            step = self.admit.step_for(layer, x)
            if step is None:
                return None
            self.count += 1
            send = self._pending = _Sending(self.count % EPOCH_MOD, step)
        elif x.dtype != self.admit.dtype or not self.admit.layer_ok(layer, k):
            raise RuntimeError("copy-engine path: a later piece of a partial sum does not fit the first")
        x2 = x.reshape(-1, k)
        rows = x2.shape[0]
        if send.sent + rows > self.admit.capacity:
            raise RuntimeError(f"copy-engine path: {send.sent + rows} rows exceed {self.admit.capacity}")
        dest = self.peer_recv[send.epoch % 2]
        weight_t = layer.weight.t()  # type: ignore[operator]
        out = torch.empty((rows, self.hidden), dtype=x.dtype, device=x.device)
        main = torch.cuda.current_stream(self.device)
        g0 = send.sent
        for a, b in piece_bounds(g0, rows, send.step):
            torch.mm(x2[a - g0 : b - g0], weight_t, out=out[a - g0 : b - g0])
            self.chunk_done.record(main)
            self.side.wait_event(self.chunk_done)
            with torch.cuda.stream(self.side):
                dest[a:b].copy_(out[a - g0 : b - g0])  # into the peer's memory: a copy engine
                send.sent = b
                for c in range(send.flagged, b // send.step):  # chunks now complete: fenced after the copy
                    self._write_value32(self.peer_flags, c, send.epoch)
                send.flagged = max(send.flagged, b // send.step)
        out.record_stream(self.side)  # (its memory is not reused before the copies have read it)
        return out.view(*x.shape[:-1], self.hidden)

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`PartialPath.add_norm` for the concatenation of what `matmul` returned since the last norm."""
        send = self._pending
        assert send is not None, "add_norm without a matmul"
        self._pending = None
        assert x.numel() == send.sent * self.hidden, "the norm's rows are not the rows sent"
        used = -(-send.sent // send.step)
        with torch.cuda.stream(self.side):
            for c in range(send.flagged, used):  # the last, partial chunk
                self._write_value32(self.peer_flags, c, send.epoch)
            if (spare := self.count % self.n_flags) >= used:  # every flag moves within n_flags calls (wrapping)
                self._write_value32(self.peer_flags, spare, send.epoch)
        return recv_add_norm(
            x, self.recv.view(2, -1, self.hidden)[send.epoch % 2], residual, weight, eps, self.flags, send.epoch,
            send.step, self.rank, self.programs,
        )  # fmt: skip

    def self_check(self, group: Any) -> None:
        """Raises unless the path's results equal NCCL's all-reduce + `fused_add_rms_norm` bit for bit: rows just
        above `min_rows`, rows not on a chunk boundary, and a partial sum sent in two pieces, each twice (both
        receive slots)."""
        import torch.distributed as dist

        a, dev, k = self.admit, self.device, 64
        gen = torch.Generator(device=dev).manual_seed(4321)
        layer = nn.Module()
        layer.quant_method = UnquantizedLinearMethod()  # type: ignore[assignment]
        layer.weight = nn.Parameter((torch.randn(a.hidden, k, device=dev) / k**0.5).to(a.dtype), requires_grad=False)
        norm_w = (torch.rand(a.hidden, generator=gen, device=dev) + 0.5).to(a.dtype)
        lo, mid = a.min_rows + 1, a.min_rows + 2 * MIN_CHUNK_ROWS + 77
        cases = [p for p in ((lo,), (mid,), (lo, 77)) if sum(p) <= a.capacity]
        # (raised after every call: a rank that stopped early leaves its peer spinning)
        wrong: list[tuple[int, ...]] = []
        for pieces in cases:
            residual = torch.randn(sum(pieces), a.hidden, generator=gen, device=dev).to(a.dtype)
            xs = [(torch.randn(r, k, device=dev) * (self.rank + 1)).to(a.dtype) for r in pieces]
            for _ in range(2):
                sent = [self.matmul(layer, x) for x in xs]
                if any(p is None for p in sent):
                    raise RuntimeError(f"the copy-engine path declined {pieces} rows")
                partial = torch.cat([p for p in sent if p is not None])
                want_x = partial.clone()
                dist.all_reduce(want_x, group=group)
                want = triton_ops.fused_add_rms_norm(want_x, residual, norm_w, 1e-6)
                got = self.add_norm(partial, residual, norm_w, 1e-6)
                torch.cuda.synchronize(dev)
                if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
                    wrong.append(pieces)
        if wrong:
            raise RuntimeError(f"copy-engine all-reduce + RMSNorm disagrees with NCCL for pieces {wrong}")


def try_create(fused: FusedAllReduceNorm, group: Any, device: torch.device, capacity: int) -> CopyEnginePrefill | None:
    """The path for this group where it applies (tp=2, steps above the fused kernel's rows, on) and passes its
    self-check on every rank; None otherwise (the ranks agree: all keep NCCL for those steps). Collective."""
    from pagedllm import envs
    from pagedllm.distributed.agreement import all_ranks_true

    if not envs.PAGEDLLM_TP_CE_PREFILL or fused.world != 2 or capacity <= fused.max_rows:
        return None  # (config only: the same on every rank)
    path: CopyEnginePrefill | None = None
    try:
        path = CopyEnginePrefill(fused, group, device, capacity, envs.PAGEDLLM_TP_CE_CHUNKS)
        path.self_check(group)
    except Exception as e:  # no symmetric memory, no stream write, a mismatch: NCCL for prefill steps
        logger.warning("tensor parallel: copy-engine prefill all-reduce unavailable (%s); NCCL for those steps", e)
        path = None
    if not all_ranks_true(path is not None, group, device) or path is None:
        return None
    logger.info(
        "tensor parallel: prefill partial sums (%d < rows <= %d) sent by the copy engines in up to %d chunks",
        fused.max_rows, capacity, min(path.admit.chunks, MAX_CHUNKS),
    )  # fmt: skip
    return path
