"""The model runner's side: the step's grammar bitmask applied to the sampled rows' logits in one op."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagedllm.core.scheduler_output import SchedulerOutput


def apply_grammar_bitmask(
    logits: torch.Tensor, so: SchedulerOutput, req_ids: Sequence[str], sample_idx: np.ndarray
) -> None:
    """Mask (to -inf) the tokens the grammar forbids, in place. `logits` has one row per sampled request
    (`sample_idx`: their positions in `req_ids`). Resolving `so.grammar_bitmask` runs the host fill, which
    the caller does after launching the forward, so on a GPU it overlaps the device's work."""
    import xgrammar as xgr  # here: the engine does not import xgrammar until a request needs it

    source = so.grammar_bitmask
    if source is None or not so.structured_output_request_ids:
        return
    mask = source if isinstance(source, np.ndarray) else source.result()
    row_of_req = so.structured_output_request_ids
    logit_rows: list[int] = []
    mask_rows: list[int] = []
    for j, i in enumerate(sample_idx.tolist()):
        r = row_of_req.get(req_ids[i])
        if r is not None:
            logit_rows.append(j)
            mask_rows.append(r)
    if not logit_rows:
        return
    n, words = logits.shape[0], mask.shape[1]
    if logit_rows == list(range(n)) and mask_rows == logit_rows:
        aligned = torch.from_numpy(mask)
    else:
        full = np.full((n, words), -1, dtype=np.int32)  # all bits set: rows without a grammar stay as they are
        full[logit_rows] = mask[mask_rows]
        aligned = torch.from_numpy(full)
    if logits.is_cuda:
        # From pinned memory (PyTorch's caching host allocator: reused blocks, freed after the copy's event):
        # a copy from pageable memory would first wait for the stream, i.e. for the forward in flight.
        aligned = aligned.pin_memory()
    aligned = aligned.to(logits.device, non_blocking=True)
    vocab = min(logits.shape[-1], words * 32)
    xgr.apply_token_bitmask_inplace(
        logits, aligned, vocab_size=vocab, indices=None if len(logit_rows) == n else logit_rows
    )
    if logits.shape[-1] > vocab:  # padded vocabulary ids beyond the tokenizer's: never grammatical
        logits[logit_rows, vocab:] = float("-inf")
