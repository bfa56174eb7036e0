"""The model runner's speculative step: the scheduled proposals go into the batch after each request's
known tokens, one forward scores them all, the rejection sampler keeps a prefix of each request's
proposals plus one token, and the proposer proposes the next step's tokens from the tokens now known.

The synchronous step lives here: the next proposals need this step's tokens on the host. With async
scheduling (n-gram only) steps are launched by `async_steps` instead, except those a request needs
synchronously (logprobs, penalties, ...), which come here with their proposals read back from the device.
Requests whose sampling reads their own previous tokens (penalties, min_tokens, bad words) or that an
engine-wide logits processor may touch get no proposals: their distribution at a proposal's position would
depend on the proposals before it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

import numpy as np
import torch

from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.logprobs import LogprobsLists
from pagedllm.sample import triton_argmax
from pagedllm.sample.logprobs_gather import gather_logprobs_tensors
from pagedllm.sample.rejection_sampler import greedy_verify, rejection_sample, target_logits
from pagedllm.spec_decode.async_ngram import DeviceHistory, SpecPending, resolve_drafts
from pagedllm.spec_decode.async_steps import AsyncNgramSteps
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.spec_decode.scheduling import can_speculate
from pagedllm.worker.step_inputs import StepInputs

ModelRunner = Any
"""`worker.model_runner.ModelRunner` (not imported: it imports this module)."""


class Proposer(Protocol):
    def propose(
        self, req_ids: list[str], token_ids: np.ndarray, rows: list[int], num_tokens: np.ndarray, caps: list[int]
    ) -> list[list[int]]:
        """Per request (rows of the persistent batch, their first num_tokens[row] tokens known): at most
        caps[i] proposed tokens."""


class SpecDecodeRunner:
    def __init__(self, config: SpeculativeConfig, runner: ModelRunner) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer: Proposer
        if config.method == "ngram":
            assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, self.k)
        elif config.method == "draft_model":
            from pagedllm.spec_decode.draft_model import DraftModelProposer

            self.proposer = DraftModelProposer(config, runner)
        else:
            from pagedllm.spec_decode.eagle import EagleProposer

            self.proposer = EagleProposer(config, runner)
        self._eligible: dict[str, bool] = {}
        self.async_steps: AsyncNgramSteps | None = None
        """Async scheduling (n-gram only): the launch and read of a step, with each request's tokens and next
        proposals on the device (`async_steps.history`)."""
        # (Engine-wide logits processors turn async scheduling off in the engine core: then the host proposes.)
        if runner.config.scheduler_config.async_scheduling and not runner.sampler.custom_processors:
            assert config.method == "ngram" and config.prompt_lookup_min is not None
            assert config.prompt_lookup_max is not None
            self.async_steps = AsyncNgramSteps(
                DeviceHistory(
                    runner.max_num_reqs, runner.max_model_len, self.k, config.prompt_lookup_min,
                    config.prompt_lookup_max, runner.device,
                )
            )  # fmt: skip

    def bytes_per_block(self) -> int:
        """KV bytes the proposer adds per target block (a draft model's cache grows with the target's)."""
        f = getattr(self.proposer, "bytes_per_block", None)
        return f() if f is not None else 0

    def capture_graphs(self, r: ModelRunner) -> None:
        """After the target's verification graphs (CUDA): the async steps' fused graphs, the proposer's own."""
        if self.async_steps is not None and r.mm is None:
            self.async_steps.capture_fused(r)
        capture = getattr(self.proposer, "capture_graphs", None)
        if capture is not None:
            assert r.verify_graphs is not None
            capture(r.verify_graphs.pool)

    def release_graphs(self) -> None:
        """(Sleep) drop the graphs `capture_graphs` made: they point at storages about to be released."""
        if self.async_steps is not None:
            self.async_steps.fused = None
        release = getattr(self.proposer, "release_graphs", None)
        if release is not None:
            release()

    def initialize_kv_cache(self, num_blocks: int, alloc: Any) -> None:
        """`alloc(shape, dtype, device)`: the runner's zeroed KV allocation (`runner_setup.alloc_zeroed`)."""
        init = getattr(self.proposer, "initialize_kv_cache", None)
        if init is not None:
            init(num_blocks, alloc)

    # ---- one step ------------------------------------------------------------------------------
    def _begin(self, r: ModelRunner, so: SchedulerOutput) -> None:
        """The scheduler's diffs into the batch, and the requests that left or (re-)entered it into the
        proposer's state."""
        r._update_states(so)
        drop = getattr(self.proposer, "drop", None)
        for rid in (*so.finished_req_ids, *so.preempted_req_ids):
            self._eligible.pop(rid, None)
            if drop is not None:
                drop(rid)
        if self.async_steps is not None:
            self.async_steps.begin(r, so)

    def execute(self, r: ModelRunner, so: SchedulerOutput) -> ModelRunnerOutput:
        """A synchronous step (with async scheduling: a step some request needs the previous tokens of on
        the host for; its placeholder proposals are read back from the device first)."""
        self._begin(r, so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], [])
        drafted = None
        if self.async_steps is not None:
            spec_resolved, drafted = resolve_drafts(so.scheduled_spec_decode_tokens, self.async_steps.history)
            so = replace(so, scheduled_spec_decode_tokens=spec_resolved)
        batch, model = r.input_batch, r.model
        assert batch is not None and r.inputs is not None and model is not None
        spec = so.scheduled_spec_decode_tokens
        rows_of = batch.req_id_to_row
        for rid, toks in spec.items():  # proposals after the known tokens (never counted in num_tokens)
            row = rows_of[rid]
            n = int(batch.num_tokens[row])
            batch.token_ids[row, n : n + len(toks)] = toks
        x = r.inputs.build(so)
        hidden = r._forward(x, None)
        observe = getattr(self.proposer, "observe", None)
        if observe is not None:
            observe(x, hidden)
        prompt_lp = r.prompt_logprobs.gather(model, batch, x.req_ids, x.rows, x.computed, x.seq_lens, x.cu, hidden)
        sample_idx = np.nonzero(x.seq_lens >= batch.num_tokens[x.rows])[0]
        batch.num_computed_tokens[x.rows] = x.seq_lens
        sampled: list[list[int]] = [[] for _ in x.req_ids]
        logprobs: list[LogprobsLists | None] | None = None
        if len(sample_idx):
            tokens, lps = self._verify(r, x, hidden, sample_idx, spec)
            requests = r.requests
            for j, i in enumerate(sample_idx.tolist()):
                toks = tokens[j]
                requests[x.req_ids[i]].output_token_ids.extend(toks)
                row = int(x.rows[i])
                n = int(batch.num_tokens[row])
                fit = toks[: max(0, batch.max_model_len - n)]
                batch.token_ids[row, n : n + len(fit)] = fit
                batch.num_tokens[row] = n + len(toks)
                if batch.penalty_slot[row] >= 0:
                    for t in toks:
                        batch.count_output_tokens(np.array([row]), np.array([t]))
                sampled[i] = toks
            if lps is not None:
                logprobs = [None] * len(x.req_ids)
                for j, i in enumerate(sample_idx.tolist()):
                    logprobs[i] = lps[j]
        if self.async_steps is not None:  # the emitted tokens into the device's histories, then their proposals
            self.async_steps.record_sync(r, x, sample_idx, sampled)
            return ModelRunnerOutput(
                x.req_ids, sampled, logprobs, prompt_lp or {}, spec_token_ids=None, spec_num_drafted=drafted
            )
        proposals = self._propose(r, x, sample_idx)
        return ModelRunnerOutput(x.req_ids, sampled, logprobs, prompt_lp or {}, spec_token_ids=proposals)

    def launch(self, r: ModelRunner, so: SchedulerOutput) -> SpecPending:
        """Async scheduling: the scheduler's diffs applied, then the step launched (`async_steps`)."""
        assert self.async_steps is not None, "execute_model_async with speculation needs async scheduling (n-gram)"
        self._begin(r, so)
        return self.async_steps.launch(r, so)

    def finish(self, r: ModelRunner, step: SpecPending) -> ModelRunnerOutput:
        assert self.async_steps is not None
        return self.async_steps.finish(r, step)

    def _verify(
        self, r: ModelRunner, x: StepInputs, hidden: torch.Tensor, sample_idx: np.ndarray, spec: dict[str, list[int]]
    ) -> tuple[list[list[int]], list[LogprobsLists | None] | None]:
        """Per sampling request (sample_idx order): the emitted tokens and their logprobs."""
        batch, sampling, sampler, model, dev = r.input_batch, r.sampling, r.sampler, r.model, r.device
        assert batch is not None and sampling is not None
        ids = [spec.get(x.req_ids[i], []) for i in sample_idx.tolist()]
        ks = np.fromiter((len(t) for t in ids), dtype=np.int64, count=len(ids))
        n_rows = ks + 1
        starts = np.cumsum(n_rows) - n_rows
        total = int(n_rows.sum())
        offs = np.arange(total) - np.repeat(starts, n_rows)
        logit_rows = np.repeat(x.cu[1:][sample_idx] - n_rows, n_rows) + offs
        logits = model.compute_logits(hidden[torch.from_numpy(logit_rows).to(dev)]).float()
        rows = x.rows[sample_idx]
        if not ks.any():  # nothing proposed (e.g. right after prefill): the plain sampler
            md = sampling.build(rows, x.seq_lens[sample_idx])
            out = sampler(logits, md)
            toks = [[t] for t in out.sampled_token_ids.tolist()]
            lp_out = out.logprobs
            if lp_out is None:
                return toks, None
            per: list[LogprobsLists | None] = [None] * len(toks)
            for pos, j in enumerate(md.logprob_rows_host):
                per[j] = lp_out.slice(pos, pos + 1)
            return toks, per
        md = sampling.build(np.repeat(rows, n_rows))
        flat_t = torch.tensor([t for toks in ids for t in toks], dtype=torch.int64, device=dev)
        mode = sampler.logprobs_mode
        lp_src = processed = None
        if md.logprob_rows is None and bool((batch.temperature[rows] < 1e-5).all()):
            # All greedy, no logprobs: a proposal is kept iff it is its row's argmax (rejection sampling's
            # special case), one argmax of the processed rows decides the step.
            out = greedy_verify(triton_argmax.argmax_rows(sampler.apply_logits_processors(logits, md)), flat_t, ks)
        else:
            if md.logprob_rows is not None and mode.startswith("raw"):
                sel = logits[md.logprob_rows]
                lp_src = sel.log_softmax(dim=-1) if mode == "raw_logprobs" else sel
            greedy, processed = target_logits(sampler, logits, md)
            is_greedy = torch.from_numpy(batch.temperature[rows] < 1e-5).to(dev)
            gens = {b: md.generators[int(s)] for b, s in enumerate(starts.tolist()) if int(s) in md.generators}
            out = rejection_sample(greedy, processed, is_greedy, flat_t, ks, None, gens)
        res = torch.cat([out.num_emitted.unsqueeze(1), out.token_ids], dim=1).tolist()  # one copy to the host
        counts = [row[0] for row in res]
        tokens = [row[1 : 1 + row[0]] for row in res]
        if md.logprob_rows is None:
            return tokens, None
        assert processed is not None
        if lp_src is None:
            sel = processed[md.logprob_rows]
            lp_src = sel.log_softmax(dim=-1) if mode == "processed_logprobs" else sel
        req_t = torch.from_numpy(np.repeat(np.arange(len(ks)), n_rows)).to(dev)
        flat_tok = out.token_ids[req_t, torch.from_numpy(offs).to(dev)].clamp(min=0)
        lists = gather_logprobs_tensors(
            lp_src, md.num_logprobs, flat_tok[md.logprob_rows], md.logprob_token_ids
        ).to_lists()
        per = [None] * len(tokens)
        pos_of = {int(t): p for p, t in enumerate(md.logprob_rows_host)}
        for b, c in enumerate(counts):
            p0 = pos_of.get(int(starts[b]))
            if p0 is not None:
                per[b] = lists.slice(p0, p0 + c)
        return tokens, per

    def _propose(self, r: ModelRunner, x: StepInputs, sample_idx: np.ndarray) -> dict[str, list[int]] | None:
        """The next step's proposals of the requests that just sampled (none above disable_by_batch_size)."""
        limit = self.config.disable_by_batch_size
        if not len(sample_idx) or (limit is not None and x.num_reqs > limit):
            return None
        batch = r.input_batch
        assert batch is not None
        eligible, requests = self._eligible, r.requests
        custom = bool(r.sampler.custom_processors)
        rids, rows, caps = [], [], []
        for i in sample_idx.tolist():
            rid = x.req_ids[i]
            ok = eligible.get(rid)
            if ok is None:
                ok = eligible[rid] = not custom and can_speculate(requests[rid].sampling_params)
            row = int(x.rows[i])
            cap = min(self.k, batch.max_model_len - int(batch.num_tokens[row]))
            if ok and cap > 0:
                rids.append(rid)
                rows.append(row)
                caps.append(cap)
        if not rids:
            return None
        props = self.proposer.propose(rids, batch.token_ids, rows, batch.num_tokens, caps)
        return {rid: p for rid, p in zip(rids, props) if p}
