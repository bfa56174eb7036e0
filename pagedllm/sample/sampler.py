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
from pagedllm.sample import triton_sample
from pagedllm.sample.logits_processor import (
    LogitBiasLogitsProcessor,
    LogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
    apply_min_p,
)
from pagedllm.sample.metadata import SamplingMetadata, fill_at, upload
from pagedllm.sample.penalties import apply_penalties
from pagedllm.sampling_params import SamplingParams

_EPS = 1e-5

LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
LOGPROBS_MODES: tuple[str, ...] = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "apply_min_p",
    "apply_top_k_top_p",
    "gather_logprobs",
    "gather_logprobs_tensors",
    "random_sample",
]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    logprobs_tensors: LogprobsTensors | None = None
    """One position per row of `metadata.logprob_rows`, in that order (None when no row asked); still on
    the device: the model runner copies them to the host with the sampled ids, in one non-blocking step."""

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
        logits = self.apply_logits_processors(logits, md)
        sampled, processed = self.sample(logits, md, need_processed=want_lp and lp_src is None)
        if not want_lp:
            return SamplerOutput(sampled)
        if lp_src is None:
            sel = processed[md.logprob_rows]
            lp_src = sel.log_softmax(dim=-1) if self.logprobs_mode == "processed_logprobs" else sel
        assert md.logprob_rows is not None
        lp = gather_logprobs_tensors(lp_src, md.num_logprobs, sampled[md.logprob_rows], md.logprob_token_ids)
        return SamplerOutput(sampled, lp)

    def apply_logits_processors(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Everything that may change the argmax (the "processed logits" of a greedy row)."""
        if md.allowed_rows is not None and md.allowed_token_ids is not None:
            idx, ids = md.allowed_token_ids
            blocked = torch.ones(md.allowed_rows.shape[0], logits.shape[1], dtype=torch.bool, device=logits.device)
            fill_at(blocked, idx, ids, False)
            logits[md.allowed_rows] = logits[md.allowed_rows].masked_fill(blocked, -float("inf"))
        if md.bad_words_token_ids:
            apply_bad_words(logits, md.bad_words_token_ids, md.output_token_ids)
        for proc in self.non_argmax_invariant:
            logits = proc.apply(logits, md)
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

    def sample(
        self, logits: torch.Tensor, md: SamplingMetadata, need_processed: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sampled ids, processed logits: for random rows after temperature/min_p/top-k/top-p).

        On CUDA, random rows take `triton_sample.gumbel_sample` (one pass over the logits; seeded rows
        when the metadata carries per-row keys, as the model runner's does);
        when nothing else changes them and nobody reads the processed logits, not even the division by
        the temperature is materialized (the returned "processed" logits are then the unscaled ones)."""
        # max(dim).indices: the same first-maximum index as argmax, and 3-5x faster on the CPU.
        greedy = None if md.all_random else logits.max(dim=-1).indices
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
                logits = proc.apply(logits, md)
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


def apply_top_k_top_p(
    logits: torch.Tensor,
    k: torch.Tensor | None,
    p: torch.Tensor | None,
    k_host: np.ndarray | None = None,
    p_host: np.ndarray | None = None,
) -> torch.Tensor:
    """top-k (0 = off) then top-p over what is left (the smallest most-likely set whose mass reaches p).

    Only rows that use them pay: rows with top-p get their nucleus (their top-k applied first), rows with
    top-k alone a threshold from one topk (k = their largest), other rows are untouched. `k_host` /
    `p_host` are host copies of k / p (the metadata carries them): which rows use what, and the largest k,
    are then decided on the host, so a CUDA step never waits on the device here. On CUDA the nucleus
    comes from one sort of the rows (no data-dependent host decisions); on the CPU from growing topk
    candidates, which is cheaper there than sorting the vocabulary.
    """
    vocab = logits.shape[-1]
    n = logits.shape[0]
    dev = logits.device
    if k is not None and k_host is None:
        k_host = k.cpu().numpy()
    if p is not None and p_host is None:
        p_host = p.cpu().numpy()
    p_mask = (p_host < 1.0) if p_host is not None else np.zeros(n, dtype=bool)
    k_mask = ((k_host > 0) & ~p_mask) if k_host is not None else np.zeros(n, dtype=bool)

    def rows_of(mask: np.ndarray) -> torch.Tensor | None:  # None: every row
        return None if mask.all() else torch.from_numpy(np.nonzero(mask)[0]).to(dev, non_blocking=True)

    if k_mask.any():
        assert k is not None and k_host is not None
        rows = rows_of(k_mask)
        sub = logits if rows is None else logits[rows]
        kk = (k if rows is None else k[rows]).clamp(max=vocab)
        kmax = int(min(vocab, k_host[k_mask].max()))
        thresh = sub.topk(kmax, dim=-1).values.gather(1, (kk - 1).unsqueeze(1))
        sub = sub.masked_fill(sub < thresh, -float("inf"))
        if rows is None:
            logits = sub
        else:
            logits[rows] = sub
    if p_mask.any():
        assert p is not None
        if logits.is_cuda:
            # Rows whose top-k is small find their nucleus among their top k (one topk, no sort); the
            # others sort their row. Both without a host decision that reads the device.
            small = p_mask & (k_host > 0) & (k_host <= vocab // 8) if k_host is not None else np.zeros(n, bool)
            for mask, by_topk in ((small, True), (p_mask & ~small, False)):
                if not mask.any():
                    continue
                rows = rows_of(mask)
                sub = logits if rows is None else logits[rows]
                kk = None if k is None else (k if rows is None else k[rows])
                pp = p if rows is None else p[rows]
                if by_topk:
                    assert kk is not None and k_host is not None
                    sub = _top_k_top_p_by_topk(sub, kk, pp, int(k_host[mask].max()))
                else:
                    sub = _sorted_top_k_top_p(sub, kk, pp)
                if rows is None:
                    logits = sub
                else:
                    logits[rows] = sub
            return logits
        rows = rows_of(p_mask)
        sub = logits if rows is None else logits[rows]
        kk = None if k is None else (k if rows is None else k[rows])
        pp = p if rows is None else p[rows]
        kk_host = None if k_host is None else k_host[p_mask]
        sub = _top_p_by_candidates(sub, kk, pp, kk_host)
        if rows is None:
            logits = sub
        else:
            logits[rows] = sub
    return logits


def _top_k_top_p_by_topk(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor, kmax: int) -> torch.Tensor:
    """top-k then top-p for rows that all have 0 < k <= kmax: the nucleus of the renormalised top-k
    distribution lies among the top k, so one topk(kmax) decides it (the descending "mass before < p"
    rule, as `_top_p_by_candidates`)."""
    vals = logits.topk(kmax, dim=-1).values  # descending
    col = torch.arange(kmax, device=logits.device)
    vals = vals.masked_fill(col[None, :] >= k[:, None], -float("inf"))  # each row's own k
    probs = vals.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    keep = mass_before < p.unsqueeze(1)
    keep[:, 0] = True
    keep &= col[None, :] < k[:, None]
    thresh = vals.gather(1, keep.sum(dim=-1, keepdim=True) - 1)
    return logits.masked_fill(logits < thresh, -float("inf"))


_TOP_P_FIRST_CANDIDATES = 256


def _top_p_by_candidates(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor, k_host: np.ndarray | None = None
) -> torch.Tensor:
    """top-k then top-p without sorting the vocabulary: the nucleus is found among the top K candidates
    (one topk; K doubles while some row's nucleus may extend past them), normalised by the full
    logsumexp. A row is decided once the mass above its last candidate reaches p: every token outside
    is smaller, so it is out. Rows still undecided at K >= vocab / 8 take the full sort."""
    vocab = logits.shape[-1]
    if k is not None:
        # (rows without top-k must not make this a topk over the whole vocabulary)
        logits = apply_top_k_top_p(logits, k, None, k_host)
    lse = logits.logsumexp(dim=-1, keepdim=True)
    todo: torch.Tensor | None = None  # rows still undecided (None: all rows, no gather needed)
    cand = _TOP_P_FIRST_CANDIDATES
    while True:
        sub = logits if todo is None else logits[todo]
        pp = p if todo is None else p[todo]
        if cand >= vocab // 8:
            res = _sorted_top_k_top_p(sub, None, pp)
            if todo is None:
                return res
            logits[todo] = res
            return logits
        vals = sub.topk(cand, dim=-1).values  # descending
        probs = (vals - (lse if todo is None else lse[todo])).exp_()
        mass_before = probs.cumsum(dim=-1).sub_(probs)
        keep = mass_before < pp.unsqueeze(1)
        keep[:, 0] = True
        decided = ~keep[:, -1]
        thresh = vals.gather(1, keep.sum(dim=-1, keepdim=True) - 1)
        if bool(decided.all()):
            sub.masked_fill_(sub < thresh, -float("inf"))
            if todo is None:
                return sub
            logits[todo] = sub
            return logits
        if bool(decided.any()):
            idx = decided.nonzero().squeeze(1)
            d = sub[idx]
            d.masked_fill_(d < thresh[idx], -float("inf"))
            logits[idx if todo is None else todo[idx]] = d
        undecided = (~decided).nonzero().squeeze(1)
        todo = undecided if todo is None else todo[undecided]
        cand *= 4


def _sorted_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        k_eff = torch.where(k <= 0, torch.full_like(k, vocab), k).clamp(max=vocab)
        kth = sorted_logits.gather(1, (vocab - k_eff).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -float("inf"))
    probs = sorted_logits.softmax(dim=-1)
    cum = probs.cumsum(dim=-1)
    # Ascending order: drop the low tail whose cumulative mass is <= 1 - p; always keep the top token.
    drop = cum <= (1 - p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, -float("inf"))
    return torch.empty_like(logits).scatter_(1, idx, sorted_logits)


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


@dataclass
class LogprobsTensors:
    """What `gather_logprobs` computes, still as tensors (on the logits' device until copied): per row,
    the columns of `ids` / `lps` are the sampled token, the top k (k = `ks[row]`, columns 1..max_k) and
    the row's extra token ids (after max_k); `ranks0` is the sampled token's rank, `ex_ranks` the extras'.
    Built without any device synchronization; `to_lists` reads them on the host."""

    ids: torch.Tensor  # [R, 1 + max_k + max_e] int64
    lps: torch.Tensor  # [R, 1 + max_k + max_e] float32
    ranks0: torch.Tensor  # [R] int64
    ex_ranks: torch.Tensor | None  # [R, max_e] int64
    ks: list[int]
    num_extras: list[int]
    max_k: int

    def __len__(self) -> int:
        return len(self.ks)

    def copy_to_host(self) -> LogprobsTensors:
        """Pinned host copies, non-blocking on CUDA: readable once the step's event has completed."""
        if not self.ids.is_cuda:
            return self

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return h.copy_(t, non_blocking=True)

        return LogprobsTensors(
            host(self.ids),
            host(self.lps),
            host(self.ranks0),
            host(self.ex_ranks),  # type: ignore[arg-type]
            self.ks,
            self.num_extras,
            self.max_k,
        )

    def to_lists(self) -> LogprobsLists:
        all_ids = self.ids.tolist()
        all_lp = self.lps.tolist()
        ranks0 = self.ranks0.tolist()
        ex_ranks = self.ex_ranks.tolist() if self.ex_ranks is not None else None
        out = LogprobsLists()
        max_k = self.max_k
        top_ranks = list(range(1, max_k + 1))
        for i, (k, e) in enumerate(zip(self.ks, self.num_extras)):
            cols = [0, *range(1, 1 + k)]
            ranks = [ranks0[i], *top_ranks[:k]]
            if e:
                cols.extend(range(1 + max_k, 1 + max_k + e))
                assert ex_ranks is not None
                ranks.extend(ex_ranks[i][:e])
            ids_i, lp_i = all_ids[i], all_lp[i]
            out.token_ids.append([ids_i[c] for c in cols])
            out.logprobs.append([lp_i[c] for c in cols])
            out.ranks.append(ranks)
        return out


def gather_logprobs_tensors(
    logprobs: torch.Tensor,
    num_logprobs: list[int],
    token_ids: torch.Tensor,
    extra_token_ids: list[list[int]] | None = None,
) -> LogprobsTensors:
    """Per row of `logprobs` [R, V]: token_ids[r] first (with its rank), then the top num_logprobs[r]
    (-1 = all V) with ranks 1..k, then extra_token_ids[r]. One topk over all rows (k = the largest)."""
    r, vocab = logprobs.shape
    ks = [vocab if k == -1 else min(k, vocab) for k in num_logprobs]
    max_k = max(ks, default=0)
    tok = token_ids.view(-1, 1).to(torch.int64)
    tok_lp = logprobs.gather(1, tok)
    tok_rank = (logprobs >= tok_lp).sum(dim=-1)
    ids_cols = [tok]
    lp_cols = [tok_lp]
    if max_k > 0:
        top_lp, top_ids = logprobs.topk(max_k, dim=-1)
        ids_cols.append(top_ids)
        lp_cols.append(top_lp)
    extras = extra_token_ids or [[] for _ in range(r)]
    max_e = max((len(e) for e in extras), default=0)
    ex_rank = None
    if max_e:
        padded = np.array([e + [0] * (max_e - len(e)) for e in extras], dtype=np.int64)
        ex = torch.from_numpy(padded).to(logprobs.device, non_blocking=True)
        ex_lp = logprobs.gather(1, ex)
        ex_rank = torch.stack([(logprobs >= ex_lp[:, j : j + 1]).sum(dim=-1) for j in range(max_e)], dim=1)
        ids_cols.append(ex)
        lp_cols.append(ex_lp)
    return LogprobsTensors(
        torch.cat(ids_cols, dim=1), torch.cat(lp_cols, dim=1), tok_rank, ex_rank, ks, [len(e) for e in extras], max_k
    )


def gather_logprobs(
    logprobs: torch.Tensor,
    num_logprobs: list[int],
    token_ids: torch.Tensor,
    extra_token_ids: list[list[int]] | None = None,
) -> LogprobsLists:
    """`gather_logprobs_tensors`, read on the host at once (synchronizes with the device)."""
    return gather_logprobs_tensors(logprobs, num_logprobs, token_ids, extra_token_ids).to_lists()
