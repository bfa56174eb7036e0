"""The model runner's side: the step's grammar bitmask applied to the sampled rows' logits in one op."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.triton_utils import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl


def apply_grammar_bitmask(
    logits: torch.Tensor, so: SchedulerOutput, req_ids: Sequence[str], sample_idx: np.ndarray
) -> None:
    """Mask (to -inf) the tokens the grammar forbids, in place. `logits` has one row per sampled request
    (`sample_idx`: their positions in `req_ids`). The mask (`structured_output.manager.GrammarBitmask`) is
    filled in the manager's fill thread while the runner launched the forward; this waits for it."""
    source = so.grammar_bitmask
    if source is None or not so.structured_output_request_ids:
        return
    if isinstance(source, np.ndarray):  # a full-vocabulary mask given as is
        mask, constrained, valid = torch.from_numpy(source), None, source.shape[1] * 32
    else:  # the tokenizer's ids only; the model's padded ids are disallowed in the constrained rows below
        mask, rows = source.narrow()
        constrained, valid = set(rows), source.valid_vocab
    row_of_req = so.structured_output_request_ids
    get = row_of_req.get
    rows_of_logits = [get(req_ids[i]) for i in sample_idx.tolist()]
    logit_rows = [j for j, r in enumerate(rows_of_logits) if r is not None]
    if not logit_rows:
        return
    mask_rows = [r for r in rows_of_logits if r is not None]
    n = logits.shape[0]
    vocab = min(logits.shape[-1], valid)
    if logits.is_cuda:
        _apply_cuda(logits, mask, vocab, logit_rows, mask_rows, constrained)
        return
    if mask_rows != logit_rows or mask.shape[0] != n:
        full = torch.full((n, mask.shape[1]), -1, dtype=torch.int32)  # all bits set: rows without a grammar
        full[logit_rows] = mask[mask_rows]
        mask = full
    _apply_cpu(logits, mask, vocab)
    if logits.shape[-1] > vocab:  # padded vocabulary ids beyond the tokenizer's: never grammatical
        pad_rows = [j for j, r in zip(logit_rows, mask_rows) if constrained is None or r in constrained]
        if len(pad_rows) == n:
            logits[:, vocab:] = float("-inf")
        elif pad_rows:
            logits[pad_rows, vocab:] = float("-inf")


if HAS_TRITON:

    @triton.jit
    def _grammar_mask_kernel(
        logits_ptr,
        mask_ptr,
        rows_ptr,
        logits_stride,
        mask_stride,
        valid,
        vocab,
        HAS_ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Program (k, b): columns [b * BLOCK, (b + 1) * BLOCK) of the logits row of mask row k (rows_ptr[k], or k):
        -inf where mask row k has a 0 bit, and at every column from `valid` (the tokenizer's ids) on."""
        k = tl.program_id(0)
        row = tl.load(rows_ptr + k).to(tl.int64) if HAS_ROWS else k.to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        words = tl.load(mask_ptr + k * mask_stride + cols // 32, mask=cols < valid, other=0)
        closed = ((words >> (cols % 32)) & 1) == 0
        tl.store(logits_ptr + row * logits_stride + cols, float("-inf"), mask=closed & (cols < vocab))


def _apply_cuda(
    logits: torch.Tensor,
    mask: torch.Tensor,
    valid: int,
    logit_rows: list[int],
    mask_rows: list[int],
    constrained: set[int] | None,
) -> None:
    """One launch for the whole mask, the model's padded ids included, over the constrained rows only (a row
    whose grammar terminated is left as is). Cheaper on the host than xgrammar's apply plus a separate fill of
    the padded ids: the step loop is host-bound with structured requests (NOTES, session 19)."""
    if constrained is not None and len(constrained) < len(mask_rows):
        kept = [(j, r) for j, r in zip(logit_rows, mask_rows) if r in constrained]
        logit_rows, mask_rows = [j for j, _ in kept], [r for _, r in kept]
    m = len(mask_rows)
    if not m:
        return
    in_order = mask_rows == logit_rows and logit_rows[-1] == m - 1  # rows 0..m-1 of both, in order
    rows = None
    if not in_order:  # (numpy: no OpenMP-parallel torch op on the host)
        picked = torch.empty((m, mask.shape[1]), dtype=torch.int32, pin_memory=True)
        picked.numpy()[:] = mask.numpy()[mask_rows]
        mask = picked
        rows_host = torch.empty(m, dtype=torch.int32, pin_memory=True)
        rows_host.numpy()[:] = logit_rows
        rows = rows_host.to(logits.device, non_blocking=True)
    # From pinned memory (the fill allocates it so on a CUDA engine): a pageable copy would first wait for the
    # stream, i.e. for the forward in flight.
    mask = mask.to(logits.device, non_blocking=True)
    vocab = logits.shape[-1]
    _grammar_mask_kernel[(m, triton.cdiv(vocab, _BLOCK))](
        logits,
        mask,
        rows if rows is not None else mask,
        logits.stride(0),
        mask.stride(0),
        valid,
        vocab,
        HAS_ROWS=rows is not None,
        BLOCK=_BLOCK,
        num_warps=4,
    )


_BLOCK = 2048


def _apply_cpu(logits: torch.Tensor, mask: torch.Tensor, vocab: int) -> None:
    """`logits[:, :vocab]` to -inf where `mask` (one row per logits row) has a 0 bit.

    xgrammar's CPU kernel costs ~5 ns per masked id (64 rows x 49k ids with ~170 allowed each: 15 ms), so a
    mostly-closed mask goes through one unpack and one `torch.where` (~1.6 ms for those 3M ids, whatever the
    mask); a mostly-open one (inside a JSON string: ~99 % allowed, 0.4 ms) through xgrammar's kernel, but only
    over whole 32-id words: in xgrammar 0.2.8, a row whose last, partial word allows all its ids gets -inf
    written one id past `vocab`, i.e. into the next row's id 0 (tests/structured_output/test_intake.py)."""
    import xgrammar as xgr

    n = logits.shape[0]
    words = -(-vocab // 32)
    bits = mask[:, :words].numpy()
    closed = n * vocab - int(np.bitwise_count(bits.view(np.uint32)).sum())  # give or take the last word's tail
    whole = vocab // 32 * 32
    if closed * 8 < n * vocab and whole:  # fewer than 1/8 masked: the kernel's cost is proportional to them
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=whole)
        start = whole
        bits = bits[:, whole // 32 :]
    else:
        start = 0
    if start < vocab:
        allowed = np.unpackbits(
            np.ascontiguousarray(bits).view(np.uint8), axis=1, count=vocab - start, bitorder="little"
        )
        part = logits[:, start:vocab]
        torch.where(torch.from_numpy(allowed.view(np.bool_)), part, _NEG_INF.to(logits.dtype), out=part)


_NEG_INF = torch.tensor(float("-inf"))
