"""Batch-level logits processors: each sees the whole [N, vocab] logits of a step at once.

Writing your own (the public interface, vLLM v1-like): subclass `LogitsProcessor` and pass instances
at engine construction, `LLM(..., logits_processors=[MyProc()])`.

- `apply(logits, metadata)` gets the float32 logits of the rows that sample this step and returns the
  processed logits (in-place edits are fine). Row i belongs to request `metadata.req_ids[i]`; its
  generated tokens so far are `metadata.output_token_ids[i]` and its prompt `metadata.prompt_token_ids[i]`.
  Work on all rows with tensor ops (gather your per-row values into a tensor, index the logits once).
- Per-request state: `add_request` is called once when the worker first sees a request (with its
  SamplingParams: per-request options go in `SamplingParams.extra_args`), `remove_request` when it
  finished or was aborted (also for ids never added: ignore those). Preemption keeps the state.
  The rows of a request change from step to step, so key state by request id, not by row.
- `is_argmax_invariant()`: return True only if the processor never changes which token has the largest
  logit (e.g. a min-p style filter). Such processors are skipped for greedy rows and run after
  temperature scaling; the others run before penalties and temperature, on every row.
- `validate_params(params)` (classmethod): raise ValueError for requests it cannot serve; called by the
  front end when a request is added.

Order inside the sampler: allowed_token_ids, bad_words, the non-argmax-invariant processors (built-ins
min_tokens and logit_bias first, then yours, in the order given), penalties, then greedy argmax;
for random rows temperature, min_p, your argmax-invariant processors, top-k/top-p, sampling.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.sample.metadata import SamplingMetadata, fill_at, upload

if TYPE_CHECKING:
    from pagedllm.sampling_params import SamplingParams


class LogitsProcessor:
    """Public interface for batch-level logits processors (see the module docstring)."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Raise ValueError if this processor cannot serve a request with `params`."""

    def add_request(
        self, req_id: str, params: SamplingParams, prompt_token_ids: list[int], output_token_ids: list[int]
    ) -> None:
        """A request enters the batch. `output_token_ids` is the live list of its generated tokens."""

    def remove_request(self, req_id: str) -> None:
        """A request left for good (finished or aborted)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Return the processed logits (may modify `logits` in place)."""
        raise NotImplementedError


class MinTokensLogitsProcessor(LogitsProcessor):
    """Masks EOS and stop token ids of rows that have not produced `min_tokens` tokens yet."""

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if not metadata.min_tokens:
            return logits
        rows: list[int] = []
        cols: list[int] = []
        for row, ids in metadata.min_tokens.items():
            rows.extend([row] * len(ids))
            cols.extend(ids)
        if rows:
            dev = logits.device
            fill_at(logits, upload(rows, np.int64, dev), upload(cols, np.int64, dev), -float("inf"))
        return logits


class LogitBiasLogitsProcessor(LogitsProcessor):
    """Adds each request's `logit_bias` to its logits (one scatter-add for the whole batch)."""

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if metadata.logit_bias is None:
            return logits
        rows, ids, vals = metadata.logit_bias
        return logits.index_put_((rows, ids), vals.to(logits.dtype), accumulate=True)


class MinPLogitsProcessor(LogitsProcessor):
    """Drops tokens whose probability is below min_p times the top token's probability."""

    def is_argmax_invariant(self) -> bool:
        return True

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if metadata.min_p is None:
            return logits
        return apply_min_p(logits, metadata.min_p)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """min_p <= p_max / p_token, in log space: logit >= max logit + log(min_p) (no softmax needed)."""
    top = logits.amax(dim=-1, keepdim=True)
    thresh = top + torch.log(min_p).unsqueeze(1)  # log(0) = -inf keeps everything for min_p = 0
    return logits.masked_fill(logits < thresh, -float("inf"))
