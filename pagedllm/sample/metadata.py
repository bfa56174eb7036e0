"""Per-step sampling parameters of the rows that sample, as tensors (built by `worker/sampling_batch.py`).

Row i of every per-row field is row i of the logits handed to the sampler. Optional features are
sparse in rows: `*_rows` index tensors name the rows that use the feature, so a batch where only a
few requests use penalties or logprobs pays for those rows only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [N] float32; 0 = greedy
    top_p: torch.Tensor | None  # [N] float32, None when no row uses it
    top_k: torch.Tensor | None  # [N] int64 (0 = off), None when no row uses it
    min_p: torch.Tensor | None  # [N] float32, None when no row uses it
    all_greedy: bool
    all_random: bool
    top_k_host: np.ndarray | None = None
    """Host copy of top_k (row selection and the largest k are decided on the host: no device sync)."""
    top_p_host: np.ndarray | None = None
    """Host copy of top_p."""
    noise_seeds: torch.Tensor | None = None
    """[N] int64 Philox keys for the one-pass CUDA sampler (`triton_sample.row_seeds`): seeded rows keyed
    by (seed, output index) instead of their generators. None: the sampler keys unseeded rows itself and
    seeded rows use `generators`."""
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    """Row index -> the request's own generator (requests with a seed)."""
    min_tokens: dict[int, list[int]] = field(default_factory=dict)
    """Row index -> stop token ids to mask because the row has not reached min_tokens yet."""
    output_token_ids: list[list[int]] = field(default_factory=list)
    """Per row, the tokens generated so far (the live list: it grows as the request generates)."""
    req_ids: list[str] = field(default_factory=list)
    """Per row, the request id (custom logits processors key their per-request state by it)."""
    prompt_token_ids: list[list[int]] = field(default_factory=list)
    """Per row, the prompt token ids (may be empty when the builder did not fill it)."""

    # ---- penalties: rows `penalty_rows` only -------------------------------------------------
    penalty_rows: torch.Tensor | None = None  # [P] int64 indices into the N rows
    presence_penalties: torch.Tensor | None = None  # [P] float32
    frequency_penalties: torch.Tensor | None = None  # [P] float32
    repetition_penalties: torch.Tensor | None = None  # [P] float32
    prompt_token_mask: torch.Tensor | None = None  # [P, V] bool: the token occurs in the prompt
    output_token_counts: torch.Tensor | None = None  # [P, V] int32: occurrences in the output

    # ---- logit bias / allowed tokens / bad words ----------------------------------------------
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """(rows, token ids, biases), flat over all (row, token) pairs."""
    allowed_rows: torch.Tensor | None = None  # [A] int64
    allowed_token_ids: tuple[torch.Tensor, torch.Tensor] | None = None
    """(index into allowed_rows, token id) pairs: the only tokens those rows may produce."""
    bad_words_token_ids: dict[int, list[list[int]]] = field(default_factory=dict)
    """Row index -> tokenized bad words (blocked at their last token when the output ends with the rest)."""

    # ---- logprobs: rows `logprob_rows` only ---------------------------------------------------
    logprob_rows: torch.Tensor | None = None  # [L] int64
    logprob_rows_host: list[int] = field(default_factory=list)
    """logprob_rows on the host (the model runner maps results back without reading the device)."""
    num_logprobs: list[int] = field(default_factory=list)
    """Per logprob row: top-k to report (-1 = the whole vocabulary)."""
    logprob_token_ids: list[list[int]] = field(default_factory=list)
    """Per logprob row: extra token ids to report."""

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])

    def row_view(self, i: int) -> SamplingMetadata:
        """Row `i` alone, for a custom logits processor re-run on one row (`Sampler` isolates a failing
        request that way): the per-row fields a processor reads; the sparse built-in features left out."""

        def one(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[i : i + 1]

        def host(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[i : i + 1]

        def pick(seq: list) -> list:  # type: ignore[type-arg]
            return seq[i : i + 1] if len(seq) > i else []

        return SamplingMetadata(
            temperature=self.temperature[i : i + 1],
            top_p=one(self.top_p),
            top_k=one(self.top_k),
            min_p=one(self.min_p),
            all_greedy=bool(self.temperature[i] < 1e-5),
            all_random=bool(self.temperature[i] >= 1e-5),
            top_k_host=host(self.top_k_host),
            top_p_host=host(self.top_p_host),
            output_token_ids=pick(self.output_token_ids),
            req_ids=pick(self.req_ids),
            prompt_token_ids=pick(self.prompt_token_ids),
        )


def upload(values: Sequence[int] | Sequence[float] | np.ndarray, dtype: type, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor without synchronizing the device (a plain `torch.tensor(...,
    device="cuda")` copies blocking, i.e. waits for the work already queued on the stream)."""
    return torch.from_numpy(np.asarray(values, dtype=dtype)).to(device, non_blocking=True)


def fill_at(t: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, value: float | bool) -> None:
    """`t[rows, cols] = value` without a host-to-device copy: a plain indexed setitem copies the Python
    scalar from pageable memory, which synchronizes a CUDA stream."""
    t.index_put_((rows, cols), torch.full((), value, dtype=t.dtype, device=t.device))


def fill_sparse_fields(md: SamplingMetadata, params: Sequence[SamplingParams], device: torch.device) -> None:
    """Logit bias, allowed token ids, bad words and logprob requests of `params` (row order) into `md`."""
    lb_rows: list[int] = []
    lb_ids: list[int] = []
    lb_vals: list[float] = []
    al_rows: list[int] = []
    al_idx: list[int] = []
    al_ids: list[int] = []
    lp_rows: list[int] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            lb_rows.extend([i] * len(p.logit_bias))
            lb_ids.extend(p.logit_bias.keys())
            lb_vals.extend(p.logit_bias.values())
        if p.allowed_token_ids is not None:
            al_idx.extend([len(al_rows)] * len(p.allowed_token_ids))
            al_ids.extend(p.allowed_token_ids)
            al_rows.append(i)
        if p.bad_words_token_ids:
            md.bad_words_token_ids[i] = p.bad_words_token_ids
        if p.logprobs is not None or p.logprob_token_ids:
            lp_rows.append(i)
            md.num_logprobs.append(p.logprobs if p.logprobs is not None else 0)
            md.logprob_token_ids.append(list(p.logprob_token_ids or ()))
    if lb_rows:
        md.logit_bias = (
            upload(lb_rows, np.int64, device),
            upload(lb_ids, np.int64, device),
            upload(lb_vals, np.float32, device),
        )
    if al_rows:
        md.allowed_rows = upload(al_rows, np.int64, device)
        md.allowed_token_ids = (upload(al_idx, np.int64, device), upload(al_ids, np.int64, device))
    if lp_rows:
        md.logprob_rows = upload(lp_rows, np.int64, device)
        md.logprob_rows_host = lp_rows
