"""Greedy ids of a few rows on CUDA: a split-row argmax (Triton).

torch's `max(dim=-1)` reduces each row in one thread block; at batch 1 over Llama-3's 128k vocabulary that
took 36 us of a 4.2 ms W3-FP8 decode step on an H100 (benchmarks/NOTES.md, session 20), one SM doing the
work of a memory-bound pass that takes a few microseconds spread over the GPU. Here each row is cut into
chunks, one program each; the last program of a row to finish (an atomic counter it resets, so launches and
CUDA graph replays need no zeroing) reduces the chunks' (max, first index) pairs. Ties go to the lowest
index and NaN beats every number, as torch's argmax.
"""

from __future__ import annotations

import torch

from pagedllm.triton_utils import HAS_TRITON, num_sms, split_counters
from pagedllm.utils import cdiv

if HAS_TRITON:
    import triton
    import triton.language as tl

MAX_ROWS = 64  # above this, one block per row already fills the GPU
_BLOCK = 1024
_MIN_CHUNK = 2048
_MAX_SPLIT = 256  # chunks per row at most (a 512k vocabulary at the minimum chunk)

if HAS_TRITON:
    _NO_INDEX = tl.constexpr(2147483647)

    # The split follows the row count: a runtime value, so one compiled kernel serves every batch size (as a
    # constexpr, each greedy batch size that warm-up did not meet compiled a variant while serving).
    @triton.jit(do_not_specialize=["chunk", "split"])
    def _argmax_kernel(x_ptr, val_ptr, idx_ptr, out_ptr, cnt_ptr, n_cols, stride_row, chunk, split,
                       MAX_SPLIT: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        s = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        start = s * chunk
        end = tl.minimum(start + chunk, n_cols)
        x_row = x_ptr + row.to(tl.int64) * stride_row
        best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        best_i = tl.full([BLOCK], _NO_INDEX, dtype=tl.int32)
        for c0 in range(start, end, BLOCK):
            cols = c0 + offs
            v = tl.load(x_row + cols, mask=cols < end, other=float("-inf")).to(tl.float32)
            v = tl.where(v != v, float("inf"), v)  # NaN wins
            better = (v > best) | ((v == best) & (best_i == _NO_INDEX) & (cols < end))
            best = tl.where(better, v, best)
            best_i = tl.where(better, cols, best_i)
        m = tl.max(best, axis=0)
        i = tl.min(tl.where(best == m, best_i, _NO_INDEX), axis=0)
        store_row_argmax(m, i, row, s, split, out_ptr, val_ptr, idx_ptr, cnt_ptr, MAX_SPLIT)

    @triton.jit
    def store_row_argmax(top, idx, row, s, split, out_ptr, val_ptr, idx_ptr, cnt_ptr, SPLIT_P: tl.constexpr):
        """A split row's chunk s reports its (maximum, first index of it); with one chunk that is the row's
        answer, else the row's last chunk to finish (an atomic counter it resets, so launches and graph replays
        need no zeroing) takes the largest, ties to the lowest index (chunks are in column order). Shared by the
        split-row kernels (this argmax, `triton_sample`'s Gumbel race). `split` <= SPLIT_P, a power of two."""
        if split == 1:
            tl.store(out_ptr + row, idx.to(tl.int64))
        else:
            tl.store(val_ptr + row * split + s, top)
            tl.store(idx_ptr + row * split + s, idx)
            tl.debug_barrier()  # the partials are written before the counter moves
            done = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel")
            if done == split - 1:
                so = tl.arange(0, SPLIT_P)
                ok = so < split
                vals = tl.load(val_ptr + row * split + so, mask=ok, other=float("-inf"), cache_modifier=".cg")
                idxs = tl.load(idx_ptr + row * split + so, mask=ok, other=_NO_INDEX, cache_modifier=".cg")
                top = tl.max(vals, axis=0)
                idx = tl.min(tl.where(vals == top, idxs, _NO_INDEX), axis=0)
                tl.store(out_ptr + row, idx.to(tl.int64))
                tl.atomic_xchg(cnt_ptr + row, 0)


def usable(logits: torch.Tensor) -> bool:
    """CUDA [rows <= MAX_ROWS, vocab] logits with unit column stride, and Triton present."""
    return (
        HAS_TRITON
        and logits.is_cuda
        and logits.dim() == 2
        and 0 < logits.shape[0] <= MAX_ROWS
        and logits.shape[1] > 0
        and logits.stride(-1) == 1
    )


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[rows] int64: each row's first maximum (the kernel's `usable` rows; torch's argmax otherwise)."""
    if not usable(logits):
        return logits.max(dim=-1).indices
    return split_argmax(logits, num_sms(logits.device))


def split_partials(
    logits: torch.Tensor, split: int, block: int, owner: str
) -> tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A split-row launch's layout over [rows, n] logits: (chunk, split, maxima, indices, counters). The chunk is
    a whole number of `block`-wide tiles, so the split may come out smaller than asked; the per-chunk float32
    maxima and int32 indices are allocated also at a split of 1 (one compiled variant); the row counters are
    `owner`'s (`store_row_argmax` leaves them at zero)."""
    rows, n = logits.shape
    chunk = cdiv(cdiv(n, split), block) * block
    split = cdiv(n, chunk)
    vals = torch.empty(rows * split, dtype=torch.float32, device=logits.device)
    idxs = torch.empty(rows * split, dtype=torch.int32, device=logits.device)
    return chunk, split, vals, idxs, split_counters(logits.device, rows, owner=owner)


def split_argmax(logits: torch.Tensor, sms: int) -> torch.Tensor:
    """The kernel on [rows, vocab] logits (unit column stride), rows x chunks programs for about 2 * `sms`."""
    rows, n = logits.shape
    split = max(1, min(triton.cdiv(n, _MIN_CHUNK), triton.cdiv(2 * sms, rows), _MAX_SPLIT))
    chunk, split, vals, idxs, cnt = split_partials(logits, split, _BLOCK, "argmax")
    assert split <= _MAX_SPLIT
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _argmax_kernel[(rows, split)](
        logits, vals, idxs, out, cnt, n, logits.stride(0), chunk, split,
        MAX_SPLIT=_MAX_SPLIT, BLOCK=_BLOCK, num_warps=4,
    )  # fmt: skip
    return out
