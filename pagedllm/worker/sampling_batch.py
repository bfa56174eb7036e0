"""The sampling batch: `SamplingMetadata` for the rows of the persistent batch that sample this step.

The one builder of `SamplingMetadata`: the model runner calls `SamplingBatch.build` every step, and
`build_sampling_metadata` (tests, benchmarks, callers without a running engine) puts its requests in a
throwaway `InputBatch` and goes through the same code.

A row's sampling parameters are fixed while its request holds it, so the per-row Python data (params,
live token lists, generators, which optional features are in use) is derived once per set of rows and
batch version (`InputBatch.version`) and reused by the steps that follow (steady decoding; NOTES H3/H5:
-0.15 ms per 256-row step), including the parameters' device copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.sample import triton_sample
from pagedllm.sample.metadata import SamplingMetadata, fill_sparse_fields, upload
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import CachedRequestState, InputBatch


@dataclass
class RowLists:
    """Per-row Python data of a set of sampling rows, valid for one batch version."""

    version: int
    rows: np.ndarray
    params: list[SamplingParams] = field(default_factory=list)
    out_ids: list[list[int]] = field(default_factory=list)
    """The rows' live output-token lists (the requests' own lists: they grow as tokens are appended)."""
    prompt_ids: list[list[int]] = field(default_factory=list)
    req_ids: list[str] = field(default_factory=list)
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    """Row index -> generator, for seeded non-greedy rows."""
    min_tokens_rows: list[tuple[int, SamplingParams, list[int], list[int]]] = field(default_factory=list)
    """(row index, params, output ids, stop ids) of the rows with min_tokens and stop ids to mask."""
    any_sparse: bool = False
    """Some row uses logit bias, allowed tokens, bad words or logprobs (fill_sparse_fields has work)."""
    all_greedy: bool = False
    all_random: bool = False
    use_p: bool = False
    use_k: bool = False
    use_min_p: bool = False
    any_penalty: bool = False
    """Some row holds a penalty slot."""
    params_dev: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None = None
    """(temperature, top_p, top_k, min_p) of the rows on the device, uploaded by the first step that used
    this entry."""
    top_p_host: np.ndarray | None = None
    top_k_host: np.ndarray | None = None


def _uses_sparse(sp: SamplingParams) -> bool:
    return bool(
        sp.logit_bias
        or sp.allowed_token_ids is not None
        or sp.bad_words_token_ids
        or sp.logprobs is not None
        or sp.logprob_token_ids
    )


class SamplingBatch:
    """Builds the sampling metadata of a persistent batch's rows, reusing per-row data while it holds."""

    def __init__(self, batch: InputBatch, device: torch.device) -> None:
        self.batch = batch
        self.device = device
        self.last: RowLists | None = None
        """The per-row data of the last rows built (the model runner appends sampled tokens through it)."""

    def row_lists(self, rows: np.ndarray) -> RowLists:
        """Per-row data of `rows`, rebuilt only when the rows or the batch changed."""
        batch = self.batch
        rc = self.last
        if rc is not None and rc.version == batch.version and np.array_equal(rc.rows, rows):
            return rc
        rc = RowLists(batch.version, rows.copy())
        greedy = batch.temperature[rows] < 1e-5
        rc.all_greedy = bool(greedy.all())
        rc.all_random = not bool(greedy.any())
        rc.use_p = bool((batch.top_p[rows] < 1.0).any())
        rc.use_k = bool((batch.top_k[rows] > 0).any())
        rc.use_min_p = bool((batch.min_p[rows] > 0).any())
        rc.any_penalty = bool((batch.penalty_slot[rows] >= 0).any())
        for i, row in enumerate(rows.tolist()):
            st = batch.states[row]
            assert st is not None
            sp = st.sampling_params
            rc.params.append(sp)
            if st.generator is not None and not greedy[i]:
                rc.generators[i] = st.generator
            if sp.min_tokens and sp.all_stop_token_ids:
                rc.min_tokens_rows.append((i, sp, st.output_token_ids, list(sp.all_stop_token_ids)))
            rc.any_sparse = rc.any_sparse or _uses_sparse(sp)
            rc.out_ids.append(st.output_token_ids)
            rc.prompt_ids.append(st.prompt_token_ids)
            rc.req_ids.append(st.req_id)
        self.last = rc
        return rc

    def build(self, rows: np.ndarray, seq_lens: np.ndarray | None = None) -> SamplingMetadata:
        """The sampling parameters of `rows` (the rows that sample, in order); `seq_lens` (their lengths
        after this step) gives seeded rows' output-token index for the one-pass CUDA sampler's keys."""
        batch, dev = self.batch, self.device
        rc = self.row_lists(rows)
        min_tokens = {i: list(stops) for i, sp, out, stops in rc.min_tokens_rows if len(out) < sp.min_tokens}
        if rc.params_dev is None:
            rc.top_p_host = batch.top_p[rows] if rc.use_p else None
            rc.top_k_host = batch.top_k[rows] if rc.use_k else None
            rc.params_dev = (
                torch.from_numpy(batch.temperature[rows]).to(dev, non_blocking=True),
                torch.from_numpy(rc.top_p_host).to(dev, non_blocking=True) if rc.use_p else None,
                torch.from_numpy(rc.top_k_host).to(dev, non_blocking=True) if rc.use_k else None,
                torch.from_numpy(batch.min_p[rows]).to(dev, non_blocking=True) if rc.use_min_p else None,
            )
        temp_t, top_p_t, top_k_t, min_p_t = rc.params_dev
        md = SamplingMetadata(
            temperature=temp_t,
            top_p=top_p_t,
            top_k=top_k_t,
            top_p_host=rc.top_p_host,
            top_k_host=rc.top_k_host,
            min_p=min_p_t,
            all_greedy=rc.all_greedy,
            all_random=rc.all_random,
            generators=dict(rc.generators),
            min_tokens=min_tokens,
            output_token_ids=list(rc.out_ids),
            req_ids=list(rc.req_ids),
            prompt_token_ids=list(rc.prompt_ids),
        )
        if dev.type == "cuda" and seq_lens is not None and rc.generators and not md.all_greedy:
            # One-pass sampler keys when seeded rows sample: a seeded row's from (its seed, the index of the
            # output token it samples). Without them the sampler keys every row in the kernel (no upload).
            seeded = np.fromiter(rc.generators, dtype=np.int64, count=len(rc.generators))
            seeds = np.array([rc.params[i].seed for i in seeded.tolist()], dtype=np.int64)
            index = seq_lens[seeded] - np.array([len(rc.prompt_ids[i]) for i in seeded.tolist()], dtype=np.int64)
            md.noise_seeds = upload(triton_sample.noise_keys(len(rows), seeded, seeds, index), np.int64, dev)
        if rc.any_penalty:
            self._fill_penalties(md, rows)
        if rc.any_sparse:
            fill_sparse_fields(md, rc.params, dev)
        return md

    def _fill_penalties(self, md: SamplingMetadata, rows: np.ndarray) -> None:
        """Penalty state from the persistent per-request slots (gathered, not rebuilt)."""
        batch, dev = self.batch, self.device
        slots = batch.penalty_slot[rows]
        pen = np.nonzero(slots >= 0)[0]
        if not len(pen):
            return
        slot_t = torch.from_numpy(slots[pen]).to(dev, non_blocking=True)
        prow = rows[pen]
        md.penalty_rows = torch.from_numpy(pen).to(dev, non_blocking=True)
        md.presence_penalties = torch.from_numpy(batch.presence_penalty[prow]).to(dev, non_blocking=True)
        md.frequency_penalties = torch.from_numpy(batch.frequency_penalty[prow]).to(dev, non_blocking=True)
        md.repetition_penalties = torch.from_numpy(batch.repetition_penalty[prow]).to(dev, non_blocking=True)
        md.prompt_token_mask = batch.token_counts.prompt_mask[slot_t]
        md.output_token_counts = batch.token_counts.output_counts[slot_t]


def build_sampling_metadata(
    params: Sequence[SamplingParams],
    vocab_size: int,
    prompt_token_ids: Sequence[list[int]] | None = None,
    output_token_ids: Sequence[list[int]] | None = None,
    generators: dict[int, torch.Generator] | None = None,
    req_ids: Sequence[str] | None = None,
    device: torch.device | str = "cpu",
) -> SamplingMetadata:
    """SamplingMetadata straight from SamplingParams and token lists, through `SamplingBatch` over a
    throwaway `InputBatch` holding these requests (row i = params[i])."""
    n = len(params)
    dev = torch.device(device)
    prompts = [list(p) for p in prompt_token_ids] if prompt_token_ids is not None else [[] for _ in range(n)]
    outputs = list(output_token_ids) if output_token_ids is not None else [[] for _ in range(n)]
    ids = list(req_ids) if req_ids is not None else [str(i) for i in range(n)]
    gens = generators or {}
    max_len = max((len(p) + len(o) for p, o in zip(prompts, outputs)), default=0) + 1
    batch = InputBatch(max(n, 1), max_len, 1, 1, vocab_size, dev)
    for i, sp in enumerate(params):
        batch.add_request(CachedRequestState(ids[i], prompts[i], outputs[i], sp, gens.get(i), [[]], 0))
    return SamplingBatch(batch, dev).build(np.arange(n, dtype=np.int64))
