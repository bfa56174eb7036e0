"""The one batched, device-agnostic sampler.

One pass over the [N, vocab] logits of the rows that sample, all rows together with tensor ops and
per-request parameters as tensors (features used by few rows are applied to those rows only):

1. logprobs of the raw logits, for rows requesting them (logprobs_mode raw_logprobs / raw_logits);
2. allowed_token_ids, bad_words, the non-argmax-invariant logits processors (min_tokens, logit_bias,
   custom ones), presence/frequency/repetition penalties;
3. greedy rows: argmax. Random rows: temperature, min_p and argmax-invariant processors, top-k/top-p,
   then the exponential race (argmax of probs / Exp(1) noise), which lets rows with their own seeded
   generator draw their noise separately while everything else stays batched;
4. logprobs gathered once for all requesting rows: one topk, the sampled token's logprob by gather and
   its rank by a comparison count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

from pagedllm.logprobs import LogprobsLists
from pagedllm.sample import triton_argmax, triton_sample
from pagedllm.sample.logits_processor import (
    LogitBiasLogitsProcessor,
    LogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from pagedllm.sample.logprobs_gather import LogprobsTensors, gather_logprobs_tensors
from pagedllm.sample.metadata import SamplingMetadata, fill_at, upload
from pagedllm.sample.penalties import apply_penalties
from pagedllm.sample.top_k_top_p import apply_top_k_top_p
from pagedllm.sampling_params import SamplingParams

_EPS = 1e-5

LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
LOGPROBS_MODES: tuple[str, ...] = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")

__all__ = ["Sampler", "SamplerOutput", "random_sample"]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    logprobs_tensors: LogprobsTensors | None = None
    """One position per row of `metadata.logprob_rows`, in that order (None when no row asked); still on
    the device: the model runner copies them to the host with the sampled ids, in one non-blocking step."""
    failed_rows: dict[int, str] | None = None
    """Rows whose request failed in a custom logits processor -> the error (their sampled ids are junk)."""

    @property
    def logprobs(self) -> LogprobsLists | None:
        """The logprobs as host lists (reads the tensors: a device sync on CUDA)."""
        return self.logprobs_tensors.to_lists() if self.logprobs_tensors is not None else None


class Sampler(nn.Module):
    def __init__(
        self, logits_processors: list[LogitsProcessor] | None = None, logprobs_mode: str = "raw_logprobs"
    ) -> None:
        super().__init__()
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode: expected one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        builtin: list[LogitsProcessor] = [MinTokensLogitsProcessor(), LogitBiasLogitsProcessor(), MinPLogitsProcessor()]
        self.custom_processors: list[LogitsProcessor] = list(logits_processors or [])
        all_procs = [*builtin, *self.custom_processors]
        self.logits_processors = all_procs
        self.non_argmax_invariant = [p for p in all_procs if not p.is_argmax_invariant()]
        self.argmax_invariant = [p for p in all_procs if p.is_argmax_invariant()]
        # Whether min_p is the only argmax-invariant processor (custom ones may change any row).
        self._only_builtin_argmax_invariant = all(isinstance(p, MinPLogitsProcessor) for p in self.argmax_invariant)

    # ---- per-request hooks of custom processors ------------------------------------------------
    def validate_params(self, params: SamplingParams) -> None:
        for p in self.custom_processors:
            p.validate_params(params)

    def add_request(
        self, req_id: str, params: SamplingParams, prompt_token_ids: list[int], output_token_ids: list[int]
    ) -> None:
        for p in self.custom_processors:
            p.add_request(req_id, params, prompt_token_ids, output_token_ids)

    def remove_request(self, req_id: str) -> None:
        for p in self.custom_processors:
            p.remove_request(req_id)

    # ---- the pass ------------------------------------------------------------------------------
    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        lp_src: torch.Tensor | None = None
        want_lp = md.logprob_rows is not None
        if want_lp and self.logprobs_mode.startswith("raw"):
            sel = logits[md.logprob_rows]  # a copy: later in-place edits do not reach it
            lp_src = sel.log_softmax(dim=-1) if self.logprobs_mode == "raw_logprobs" else sel
        failed: dict[int, str] = {}
        logits = self.apply_logits_processors(logits, md, failed)
        sampled, processed = self.sample(logits, md, need_processed=want_lp and lp_src is None, failed=failed)
        if not want_lp:
            return SamplerOutput(sampled, failed_rows=failed or None)
        if lp_src is None:
            sel = processed[md.logprob_rows]
            lp_src = sel.log_softmax(dim=-1) if self.logprobs_mode == "processed_logprobs" else sel
        assert md.logprob_rows is not None
        lp = gather_logprobs_tensors(lp_src, md.num_logprobs, sampled[md.logprob_rows], md.logprob_token_ids)
        return SamplerOutput(sampled, lp, failed or None)

    def apply_logits_processors(
        self, logits: torch.Tensor, md: SamplingMetadata, failed: dict[int, str] | None = None
    ) -> torch.Tensor:
        """Everything that may change the argmax (the "processed logits" of a greedy row). Rows whose
        request makes a custom processor raise go into `failed` (row -> message) instead of the error
        ending the step."""
        if md.allowed_rows is not None and md.allowed_token_ids is not None:
            idx, ids = md.allowed_token_ids
            blocked = torch.ones(md.allowed_rows.shape[0], logits.shape[1], dtype=torch.bool, device=logits.device)
            fill_at(blocked, idx, ids, False)
            logits[md.allowed_rows] = logits[md.allowed_rows].masked_fill(blocked, -float("inf"))
        if md.bad_words_token_ids:
            apply_bad_words(logits, md.bad_words_token_ids, md.output_token_ids)
        for proc in self.non_argmax_invariant:
            logits = self._apply_one(proc, logits, md, failed)
        if md.penalty_rows is not None:
            assert md.prompt_token_mask is not None and md.output_token_counts is not None
            assert md.presence_penalties is not None and md.frequency_penalties is not None
            assert md.repetition_penalties is not None
            rows = md.penalty_rows
            logits[rows] = apply_penalties(
                logits[rows],
                md.prompt_token_mask,
                md.output_token_counts,
                md.presence_penalties,
                md.frequency_penalties,
                md.repetition_penalties,
            )
        return logits

    def _apply_one(
        self, proc: LogitsProcessor, logits: torch.Tensor, md: SamplingMetadata, failed: dict[int, str] | None
    ) -> torch.Tensor:
        """`proc.apply`; a custom processor that raises is re-run row by row on the logits as they were,
        so that only the rows (requests) it fails on are dropped."""
        if proc not in self.custom_processors:
            return proc.apply(logits, md)
        before = logits.clone()
        try:
            return proc.apply(logits, md)
        except Exception as e:  # noqa: BLE001 - user code: isolate the failing request(s)
            if failed is None:
                raise
            batch_error = f"{type(e).__name__}: {e}"
        for i in range(md.num_rows):
            if i in failed:
                continue
            try:
                before[i : i + 1] = proc.apply(before[i : i + 1].clone(), md.row_view(i))
            except Exception as e:  # noqa: BLE001
                failed[i] = f"logits processor {type(proc).__name__} failed: {type(e).__name__}: {e}"
        if not failed:  # it fails on the batch but on no single row: fail them all rather than guess
            failed.update(
                {i: f"logits processor {type(proc).__name__} failed: {batch_error}" for i in range(md.num_rows)}
            )
        return before

    def sample(
        self,
        logits: torch.Tensor,
        md: SamplingMetadata,
        need_processed: bool = True,
        failed: dict[int, str] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sampled ids, processed logits: for random rows after temperature/min_p/top-k/top-p).

        On CUDA, random rows take `triton_sample.gumbel_sample` (one pass over the logits; seeded rows
        when the metadata carries per-row keys, as the model runner's does);
        when nothing else changes them and nobody reads the processed logits, not even the division by
        the temperature is materialized (the returned "processed" logits are then the unscaled ones)."""
        # max(dim).indices: the same first-maximum index as argmax, and 3-5x faster on the CPU; a few CUDA
        # rows take the split-row kernel.
        greedy = None if md.all_random else triton_argmax.argmax_rows(logits)
        if md.all_greedy:
            assert greedy is not None
            return greedy, logits
        temp = md.temperature
        if not md.all_random:
            temp = torch.where(temp < _EPS, torch.ones_like(temp), temp)
        # Seeded rows join the one pass only with their per-row keys (md.noise_seeds), else keep their generators.
        one_pass = triton_sample.usable(logits) and (md.noise_seeds is not None or not md.generators)
        plain = md.top_k is None and md.top_p is None and md.min_p is None and self._only_builtin_argmax_invariant
        # Unseeded rows' keys come from one fresh base key, made into per-row keys in the kernel (no upload).
        keys = md.noise_seeds
        sampled = None
        if one_pass and plain and not need_processed:
            sampled = triton_sample.gumbel_sample(logits, temp, keys)
        if sampled is None:
            logits = logits / temp.unsqueeze(1)
            for proc in self.argmax_invariant:
                logits = self._apply_one(proc, logits, md, failed)
            if md.top_k is not None or md.top_p is not None:
                logits = apply_top_k_top_p(logits, md.top_k, md.top_p, md.top_k_host, md.top_p_host)
            if one_pass:
                sampled = triton_sample.gumbel_sample(logits, torch.ones_like(temp), keys)
            if sampled is None:
                sampled = random_sample(logits.softmax(dim=-1), md.generators)
        if greedy is None:
            return sampled, logits
        return torch.where(md.temperature < _EPS, greedy, sampled), logits


def apply_bad_words(
    logits: torch.Tensor, bad_words: dict[int, list[list[int]]], output_token_ids: list[list[int]]
) -> None:
    """Block each bad word's last token where the row's output ends with the word's other tokens (vLLM:
    only generated tokens count, a one-token word is always blocked). One indexed write for the batch."""
    rows: list[int] = []
    cols: list[int] = []
    for row, words in bad_words.items():
        past = output_token_ids[row] if row < len(output_token_ids) else []
        for word in words:
            k = len(word) - 1
            if k > len(past):
                continue
            if k == 0 or past[-k:] == word[:-1]:
                rows.append(row)
                cols.append(word[-1])
    if rows:
        dev = logits.device
        fill_at(logits, upload(rows, np.int64, dev), upload(cols, np.int64, dev), -float("inf"))


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """argmax(probs / q), q ~ Exp(1) i.i.d., picks token i with probability probs[i]. A seeded row draws
    its own noise from its generator (vocab draws per step), whatever else is in the batch.

    q = -log(U), U ~ Uniform[tiny, 1): on the CPU `Tensor.exponential_` is ~30x slower than `rand` + `log`.

    Two ops fewer than the literal formula, the same result: `uniform_(tiny, 1)` is bit-for-bit
    `uniform_().clamp_(min=tiny)` (the same draws; x * (1 - tiny) + tiny rounds back to x for every
    x > 0 on the 2^-24 grid, and 0 becomes tiny), and argmax(probs / -log U) is argmin(probs / log U)
    (IEEE division is sign-symmetric, so each value is exactly negated; both take the first index).
    """
    tiny = torch.finfo(probs.dtype).tiny
    u = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        u.uniform_(tiny, 1.0)
    for row, gen in generators.items():
        u[row].uniform_(tiny, 1.0, generator=gen)
    return probs.div_(u.log_()).min(dim=-1).indices
