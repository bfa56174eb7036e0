"""The model runner's side: the step's grammar bitmask applied to the sampled rows' logits in one op."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.logger import init_logger
from pagedllm.structured_output.matchers import PinnedMaskRing
from pagedllm.triton_utils import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

logger = init_logger(__name__)


def apply_grammar_bitmask(
    logits: torch.Tensor, so: SchedulerOutput, req_ids: Sequence[str], sample_idx: np.ndarray
) -> None:
    """Mask (to -inf) the tokens the grammar forbids, in place. `logits` has one row per sampled request
    (`sample_idx`: their positions in `req_ids`). The mask (`structured_output.manager.GrammarBitmask`) is
    filled in the manager's fill thread while the runner launched the forward; this waits for it."""
    source = so.grammar_bitmask
    row_of_req = so.structured_output_request_ids
    if source is None or not row_of_req:
        return
    apply_to = getattr(source, "apply_to", None)
    if apply_to is not None:  # a mask that applies itself (the grammar server's, `remote.ServerMask`)
        apply_to(logits, req_ids, sample_idx)
        return
    if isinstance(source, np.ndarray):  # a full-vocabulary mask given as is
        mask, constrained, valid = torch.from_numpy(source), None, source.shape[1] * 32
    else:  # the tokenizer's ids only; the model's padded ids are disallowed in the constrained rows below
        mask, rows = source.narrow()
        constrained, valid = set(rows), source.valid_vocab
    get = row_of_req.get
    rows_of_logits = [get(req_ids[i]) for i in sample_idx.tolist()]
    logit_rows = [j for j, r in enumerate(rows_of_logits) if r is not None]
    if not logit_rows:
        return
    mask_rows = [r for r in rows_of_logits if r is not None]
    vocab = min(logits.shape[-1], valid)
    if logits.is_cuda:
        uploaded = _apply_cuda(logits, mask, vocab, logit_rows, mask_rows, constrained)
        if not isinstance(source, np.ndarray):
            source.logit_rows = rows_of_logits  # the intake of this step's tokens reuses the mapping
            if uploaded:
                source.uploaded()
        return
    apply_rows_cpu(logits, mask, logit_rows, mask_rows, vocab, constrained)


def apply_rows_cpu(
    logits: torch.Tensor,
    mask: torch.Tensor | np.ndarray,
    logit_rows: list[int],
    mask_rows: list[int],
    vocab: int,
    constrained: set[int] | None,
) -> None:
    """(CPU) mask row mask_rows[i] onto logits row logit_rows[i]; the model's padded ids past `vocab` are never
    allowed in a constrained row (`constrained`: the mask rows that are; None: all)."""
    if not logit_rows:
        return
    if isinstance(mask, np.ndarray):
        mask = torch.from_numpy(mask)
    n = logits.shape[0]
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


def upload_row_map(device: torch.device, logit_of_row: np.ndarray) -> torch.Tensor:
    """Mask row k -> its logits row (-1: none) on the device, for `launch_mask_kernel` (through a pinned ring:
    the upload does not wait for the stream)."""
    m = len(logit_of_row)
    host_map, slot = _ROW_MAPS.take(m, 1)
    host_map.numpy().reshape(-1)[:] = logit_of_row
    rows = _device_buffer(device, m, 1, "map").view(-1)
    rows.copy_(host_map.view(-1), non_blocking=True)
    _ROW_MAPS.uploaded(slot)
    return rows


def launch_mask_kernel(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor | None, valid: int) -> None:
    """The mask kernel over mask's rows (device int32, `valid` tokenizer ids): row k onto logits row rows[k]
    (or k when `rows` is None)."""
    vocab = logits.shape[-1]
    grid = (mask.shape[0], triton.cdiv(vocab, _BLOCK), 1)
    _launch(grid, logits, mask, rows if rows is not None else mask, valid, vocab)


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
        """Program (k, b): columns [b * BLOCK, (b + 1) * BLOCK) of the logits row of mask row k (rows_ptr[k], or k;
        none when rows_ptr[k] < 0): -inf where mask row k has a 0 bit, and at every column from `valid` (the
        tokenizer's ids) on."""
        k = tl.program_id(0)
        row = tl.load(rows_ptr + k).to(tl.int64) if HAS_ROWS else k.to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = (cols < vocab) & (row >= 0)
        words = tl.load(mask_ptr + k * mask_stride + cols // 32, mask=(cols < valid) & live, other=0)
        closed = ((words >> (cols % 32)) & 1) == 0
        tl.store(logits_ptr + tl.maximum(row, 0) * logits_stride + cols, float("-inf"), mask=closed & live)


def _apply_cuda(
    logits: torch.Tensor,
    mask: torch.Tensor,
    valid: int,
    logit_rows: list[int],
    mask_rows: list[int],
    constrained: set[int] | None,
) -> bool:
    """One launch for the whole mask, the model's padded ids included, over the constrained rows only (a row
    whose grammar terminated is left as is). Cheaper on the host than xgrammar's apply plus a separate fill of
    the padded ids: the step loop is host-bound with structured requests (NOTES, session 19). True when `mask`
    was uploaded (some row constrained)."""
    if constrained is not None and len(constrained) < len(mask_rows):
        kept = [(j, r) for j, r in zip(logit_rows, mask_rows) if r in constrained]
        logit_rows, mask_rows = [j for j, _ in kept], [r for _, r in kept]
    m = len(mask_rows)
    if not m:
        return False
    device = logits.device
    # From pinned memory (the fill writes it so on a CUDA engine): a pageable copy would first wait for the
    # stream, i.e. for the forward in flight. Into buffers kept per device (no allocation per step).
    if mask_rows == logit_rows and logit_rows[-1] == m - 1:  # rows 0..m-1 of both, in order
        rows = None
    else:  # mask row k -> its logits row (-1: none), read by the kernel: no gather of mask rows on the host
        m = mask.shape[0]
        logit_of_row = np.full(m, -1, dtype=np.int64)
        logit_of_row[mask_rows] = logit_rows
        rows = upload_row_map(device, logit_of_row)
    dev = _device_buffer(device, m, mask.shape[1], "mask")
    dev.copy_(mask[:m], non_blocking=True)
    launch_mask_kernel(logits, dev, rows, valid)
    return True


_BLOCK = 2048
_DEVICE_BUFFERS: dict[tuple[torch.device, str], torch.Tensor] = {}
_ROW_MAPS = PinnedMaskRing()
"""Pinned host buffers for the row maps (mask row -> logits row) of masks whose rows are not the logits'."""


def _device_buffer(device: torch.device, m: int, words: int, kind: str) -> torch.Tensor:
    """Rows [0, m) of the device's buffer of this kind (grown as needed; uploads are stream-ordered with their
    reads)."""
    buf = _DEVICE_BUFFERS.get((device, kind))
    if buf is None or buf.shape[0] < m or buf.shape[1] != words:
        buf = torch.empty((max(m, 64), words), dtype=torch.int32, device=device)
        _DEVICE_BUFFERS[(device, kind)] = buf
    return buf[:m]


_COMPILED: dict[tuple[Any, ...], Any] = {}
"""Triton's compiled mask kernel by everything its specialization depends on (`_launch`)."""


def _launch(
    grid: tuple[int, int, int], logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, valid: int, vocab: int
) -> None:
    """The mask kernel, launched through Triton's compiled kernel once it exists: `JITFunction.__call__` binds and
    specializes every argument on each launch, a cost the step loop pays every structured step. The cache key
    holds what the specialization reads (the integers' values, the pointers' 16-byte alignment, the dtypes), so
    a launch that would specialize differently compiles (and caches) anew."""
    has_rows = rows is not mask
    args = (logits, mask, rows, logits.stride(0), mask.stride(0), valid, vocab)
    key = (
        has_rows,
        logits.dtype,
        logits.device,
        logits.stride(0),
        mask.stride(0),
        valid,
        vocab,
        logits.data_ptr() % 16 == 0,
        mask.data_ptr() % 16 == 0,
        rows.data_ptr() % 16 == 0,
    )
    compiled = _COMPILED.get(key)
    if compiled is not None:
        try:
            compiled[grid](*args, has_rows, _BLOCK)
            return
        except Exception as e:  # another Triton's compiled-kernel API: the JIT launch from now on
            _COMPILED[key] = None
            logger.warning("grammar mask: Triton's compiled-kernel launch failed (%r); using the JIT launch", e)
    kernel = _grammar_mask_kernel[grid](*args, HAS_ROWS=has_rows, BLOCK=_BLOCK, num_warps=4)
    if key not in _COMPILED and hasattr(kernel, "__getitem__"):
        _COMPILED[key] = kernel


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
