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
    (`sample_idx`: their positions in `req_ids`). The mask (`structured_output.manager.GrammarBitmask`) is
    filled in the manager's fill thread while the runner launched the forward; this waits for it."""
    import xgrammar as xgr  # here: the engine does not import xgrammar until a request needs it

    source = so.grammar_bitmask
    if source is None or not so.structured_output_request_ids:
        return
    if isinstance(source, np.ndarray):  # a full-vocabulary mask given as is
        mask, constrained, valid = torch.from_numpy(source), None, source.shape[1] * 32
    else:  # the tokenizer's ids only; the model's padded ids are disallowed in the constrained rows below
        mask, rows = source.narrow()
        constrained, valid = set(rows), source.valid_vocab
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
    n = logits.shape[0]
    if mask_rows != logit_rows or mask.shape[0] != n:
        full = torch.full((n, mask.shape[1]), -1, dtype=torch.int32)  # all bits set: rows without a grammar
        full[logit_rows] = mask[mask_rows]
        mask = full.pin_memory() if logits.is_cuda else full
    # From pinned memory (the fill allocates it so on a CUDA engine): a pageable copy would first wait for the
    # stream, i.e. for the forward in flight.
    mask = mask.to(logits.device, non_blocking=True)
    vocab = min(logits.shape[-1], valid)
    indices = None if len(logit_rows) == n else logit_rows
    xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab, indices=indices)
    if logits.shape[-1] > vocab:  # padded vocabulary ids beyond the tokenizer's: never grammatical
        pad_rows = [j for j, r in zip(logit_rows, mask_rows) if constrained is None or r in constrained]
        if len(pad_rows) == n:
            logits[:, vocab:] = float("-inf")
        elif pad_rows:
            logits[pad_rows, vocab:] = float("-inf")
