"""N-gram speculation under async scheduling, the model runner's side: launch a verification step without
waiting for the device (its decode rows' inputs come from the device histories, `async_ngram`), and read its
emitted tokens when the engine collects it. `spec_decode.runner.SpecDecodeRunner` applies the scheduler's diffs
first and falls back to its synchronous step where a request needs one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.sample import triton_argmax
from pagedllm.sample.rejection_sampler import VerifyOutput, rejection_sample, target_logits
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode import async_ngram
from pagedllm.spec_decode.async_ngram import (
    DeviceHistory,
    SpecPending,
    decode_rows,
    pack,
    resolve_on_host,
)
from pagedllm.spec_decode.scheduling import can_speculate
from pagedllm.worker.async_output import AsyncCopier
from pagedllm.worker.attn_inputs import tables_and_slots
from pagedllm.worker.step_inputs import StepInputs

if TYPE_CHECKING:
    from pagedllm.spec_decode.fused_graph import FusedVerifyGraphs

ModelRunner = Any
"""`worker.model_runner.ModelRunner` (not imported: it imports this package)."""


def plain_greedy(sp: SamplingParams) -> bool:
    """Greedy, and nothing but the model decides the argmax (no logit bias or allowed tokens, and none of
    what `can_speculate` excludes)."""
    return sp.temperature < 1e-5 and not sp.logit_bias and sp.allowed_token_ids is None and can_speculate(sp)


class AsyncNgramSteps:
    def __init__(self, history: DeviceHistory) -> None:
        self.history = history
        self.k = history.k
        self._plain: dict[str, bool] = {}
        self.num_fast_steps = 0
        """Steps that took `_launch_fast` (tests and stats)."""
        self._fixup = async_ngram.fixup_graph_inputs
        if history.device.type == "cuda":
            from pagedllm.spec_decode import triton_ngram

            self._fixup = triton_ngram.fixup_graph_inputs
        self._copier = AsyncCopier()
        """The emitted tokens' copies to the host (pinned, each followed by a reused event)."""
        self.fused: FusedVerifyGraphs | None = None
        """CUDA: the plain greedy step as one graph per batch size (`capture_fused`)."""
        self._sizes: list[int] | None = None
        """The KV-cache groups' block sizes (fixed once the runner's cache exists; `_block_sizes`)."""

    def capture_fused(self, r: ModelRunner) -> None:
        """After the verification graphs' capture (CUDA), with `fused_graph.extra_words` in their header."""
        from pagedllm.spec_decode.fused_graph import FusedVerifyGraphs

        vg = r.verify_graphs
        assert vg is not None
        self.fused = FusedVerifyGraphs(vg, self.history, r.model, self._block_sizes(r), r.max_model_len)
        self.fused.capture()

    def begin(self, r: ModelRunner, so: SchedulerOutput) -> None:
        """After the batch took the scheduler's diffs: the requests that left give their history slots back,
        new and resumed ones upload their tokens."""
        hist, requests = self.history, r.requests
        for rid in (*so.finished_req_ids, *so.preempted_req_ids):
            self._plain.pop(rid, None)
            hist.drop(rid)
        for new in so.scheduled_new_reqs:
            hist.add(requests[new.req_id])
        c = so.scheduled_cached_reqs
        for rid, resumed in zip(c.req_ids, c.resumed_from_preemption):
            if resumed:
                hist.add(requests[rid])

    def _all_plain(self, r: ModelRunner, req_ids: list[str]) -> bool:
        plain, requests = self._plain, r.requests
        for rid in req_ids:
            ok = plain.get(rid)
            if ok is None:
                ok = plain[rid] = plain_greedy(requests[rid].sampling_params)
            if not ok:
                return False
        return True

    def launch(self, r: ModelRunner, so: SchedulerOutput) -> SpecPending:
        """Launch a verification step without waiting for the device: decode rows read their inputs from
        the device history, the emitted tokens are appended there and the next proposals found there, and
        the emitted tokens start their copy to the host (`finish` reads them)."""
        hist = self.history
        if so.total_num_scheduled_tokens == 0:
            return SpecPending([], np.zeros(0, dtype=np.int64))
        batch, model, dev, sampling = r.input_batch, r.model, r.device, r.sampling
        assert batch is not None and r.inputs is not None and model is not None and sampling is not None
        x = r.inputs.build(so)
        dec = decode_rows(x, so.scheduled_spec_decode_tokens, hist)
        if self._graph_ok(r, x, dec) and self._all_plain(r, x.req_ids):
            return self._launch_fast(r, x, dec)
        hidden = self._forward_async(r, x, dec)
        prompt_lp = r.prompt_logprobs.gather(model, batch, x.req_ids, x.rows, x.computed, x.seq_lens, x.cu, hidden)
        sample_idx = np.nonzero(x.seq_lens >= batch.num_tokens[x.rows])[0]
        batch.num_computed_tokens[x.rows] = x.seq_lens
        if not len(sample_idx):
            return SpecPending(x.req_ids, sample_idx, prompt_logprobs_done=prompt_lp)
        nd = np.zeros(len(sample_idx), dtype=np.int64)  # proposal rows per sampling request (0: a prefill's end)
        nd[np.searchsorted(sample_idx, dec.idx)] = dec.num_drafts
        n_rows = nd + 1
        starts = np.cumsum(n_rows) - n_rows  # each request's first row among the logits
        logit_rows = (
            np.repeat(x.cu[1:][sample_idx] - n_rows, n_rows) + np.arange(int(n_rows.sum())) - np.repeat(starts, n_rows)
        )
        slots = hist.slots([x.req_ids[i] for i in sample_idx.tolist()])
        r_, b_ = len(logit_rows), len(sample_idx)
        meta = torch.from_numpy(np.concatenate([logit_rows, slots, nd, starts])).to(dev, non_blocking=True)
        rows_t, slots_t = meta[:r_], meta[r_ : r_ + b_]
        nd_t, starts_t = meta[r_ + b_ : r_ + 2 * b_], meta[r_ + 2 * b_ :]
        logits = model.compute_logits(hidden[rows_t]).float()
        bound = int(x.seq_lens[sample_idx].max()) + 2 * self.k + 2
        tokens, counts, real = self._verify_device(
            r, x, logits, sample_idx, (slots, nd, starts), slots_t, nd_t, starts_t, bound
        )
        result, _, event = self._copier.copy(pack(tokens, counts, real), None)
        return SpecPending(x.req_ids, sample_idx, result, event, prompt_lp)

    def _launch_fast(self, r: ModelRunner, x: StepInputs, dec: Any) -> SpecPending:
        """Plain greedy decodes only (the common step): the whole step as one graph (`fused_graph`), or, past
        its sizes, the verification graph over the padded layout of q rows per request, the logits of every
        row, the verdict kernel reading request i's rows from i * q; one upload of the per-request arrays, no
        row gathers, no sampling metadata."""
        batch = r.input_batch
        assert batch is not None
        n = x.num_reqs
        sizes, width = self._tables_shape(r, x)
        tables = [t[x.rows, : -(-width // bs)] for t, bs in zip(batch.block_tables, sizes)]
        fused = self.fused
        if fused is not None and fused.can_run(n):
            packed = fused.launch(dec.slots, dec.num_drafts, tables)
        else:
            packed = self._launch_fixed(r, dec, tables, width)
        result, _, event = self._copier.copy(packed, None)
        batch.num_computed_tokens[x.rows] = x.seq_lens
        self.num_fast_steps += 1
        return SpecPending(x.req_ids, np.arange(n), result, event)

    def _launch_fixed(self, r: ModelRunner, dec: Any, tables: list[np.ndarray], width: int) -> torch.Tensor:
        """`_launch_fast` through the q-row verification graph, its logits, argmax and verdict launched apart:
        the packed result on the device."""
        hist, vg, model = self.history, r.verify_graphs, r.model
        assert vg is not None
        n, q = len(dec.slots), vg.q
        meta_h = np.concatenate([dec.slots, dec.num_drafts, np.arange(n) * q])
        meta = torch.from_numpy(meta_h).to(r.device, non_blocking=True)
        slots_t, nd_t, starts_t = meta[:n], meta[n : 2 * n], meta[2 * n :]
        hidden = vg.run_fixed(n, tables, self._fix(r, slots_t, nd_t))
        am = triton_argmax.argmax_rows(model.compute_logits(hidden))
        bound = width + 2 * self.k + 2
        tokens, counts, real = hist.advance(slots_t, nd_t, starts_t, (dec.slots, dec.num_drafts), bound, argmax=am)
        return pack(tokens, counts, real)

    def _graph_ok(self, r: ModelRunner, x: StepInputs, dec: Any) -> bool:
        """Whether the step (decodes only, within the verification graphs) replays them."""
        vg = r.verify_graphs
        return (
            vg is not None
            and len(dec.idx) == x.num_reqs
            and r.lora is None
            and r.mm is None
            and x.max_query_len <= vg.q
            and vg.can_run_padded(x.cu, x.seq_lens + self.k)
        )

    def _block_sizes(self, r: ModelRunner) -> list[int]:
        if self._sizes is None:
            assert r.kv_cache_config is not None
            self._sizes = [g.spec.block_size for g in r.kv_cache_config.groups]
        return self._sizes

    def _tables_shape(self, r: ModelRunner, x: StepInputs) -> tuple[list[int], int]:
        """(the KV groups' block sizes, the block-table width) a step of decodes needs."""
        width = min(int(x.seq_lens.max()) + self.k, r.max_model_len)  # the true positions: up to k further
        return self._block_sizes(r), width

    def _fix(self, r: ModelRunner, slots: torch.Tensor, nd: torch.Tensor) -> Any:
        """The fix-up a verification graph runs after its upload, for decodes whose histories sit in `slots`."""
        sizes, hist, fixup, mml = self._block_sizes(r), self.history, self._fixup, r.max_model_len

        def fix(g: Any) -> None:
            fixup(g, hist, slots, nd, sizes, mml)

        return fix

    def _replay_forward(self, r: ModelRunner, x: StepInputs, slots: torch.Tensor, nd: torch.Tensor) -> torch.Tensor:
        """The verification graph's forward, its inputs fixed up on the device from the histories."""
        vg, batch = r.verify_graphs, r.input_batch
        assert vg is not None and batch is not None
        sizes, width = self._tables_shape(r, x)
        tables, slot_map = tables_and_slots(batch.block_tables, sizes, x.rows, x.req_of_token, x.positions, width)
        return vg.run_padded(x.input_ids, x.seq_lens, x.cu, slot_map, tables, fixup=self._fix(r, slots, nd))

    def _forward_async(self, r: ModelRunner, x: StepInputs, dec: Any) -> torch.Tensor:
        """A step of decodes only replays the verification graph with its inputs fixed up on the device;
        any other step reads the decode rows' inputs back first (waiting for the step in flight)."""
        if self._graph_ok(r, x, dec):
            dev = r.device
            meta = torch.from_numpy(np.concatenate([dec.slots, dec.num_drafts])).to(dev, non_blocking=True)
            n = len(dec.slots)
            return self._replay_forward(r, x, meta[:n], meta[n:])
        resolve_on_host(x, dec, self.history)
        hidden = r._forward(x, None)
        assert hidden is not None
        return hidden

    def _verify_device(
        self, r: ModelRunner, x: StepInputs, logits: torch.Tensor, sample_idx: np.ndarray,
        host: tuple[np.ndarray, np.ndarray, np.ndarray], slots: torch.Tensor, nd: torch.Tensor, starts: torch.Tensor,
        bound: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """The verification without a host sync (greedy rows by their argmax, others by rejection sampling),
        then the histories' update (`DeviceHistory.advance`). `host`: (slots, num_drafts, starts) on the host."""
        hist, batch, sampling, sampler, dev = self.history, r.input_batch, r.sampling, r.sampler, r.device
        h_slots, h_nd, h_starts = host
        rows = x.rows[sample_idx]
        md = sampling.build(np.repeat(rows, h_nd + 1))
        if bool((batch.temperature[rows] < 1e-5).all()):
            am = triton_argmax.argmax_rows(sampler.apply_logits_processors(logits, md))
            return hist.advance(slots, nd, starts, (h_slots, h_nd), bound, argmax=am)
        greedy, processed = target_logits(sampler, logits, md)
        is_greedy = torch.from_numpy(batch.temperature[rows] < 1e-5).to(dev, non_blocking=True)
        gens = {b: md.generators[int(s)] for b, s in enumerate(h_starts.tolist()) if int(s) in md.generators}
        out = rejection_sample(greedy, processed, is_greedy, hist.draft_ids(h_slots, h_nd), h_nd, None, gens)
        return hist.advance(slots, nd, starts, (h_slots, h_nd), bound, verified=out)

    def finish(self, r: ModelRunner, step: SpecPending) -> ModelRunnerOutput:
        """A launched verification's emitted tokens (waiting for their copy) into the requests' states and rows."""
        sampled: list[list[int]] = [[] for _ in step.req_ids]
        if step.result is None:
            return ModelRunnerOutput(step.req_ids, sampled, None, step.prompt_logprobs_done or {})
        res = step.wait()
        k1 = res.shape[1] - 2
        toks, counts, real = res[:, :k1], res[:, k1], res[:, k1 + 1]
        batch, requests = r.input_batch, r.requests
        assert batch is not None
        rows_of = batch.req_id_to_row
        drafted: dict[str, int] = {}
        for j, i in enumerate(step.sample_idx.tolist()):
            rid = step.req_ids[i]
            st = requests.get(rid)
            if st is None:
                continue  # finished or aborted while the step ran
            t = toks[j, : int(counts[j])].tolist()
            st.output_token_ids.extend(t)
            row = rows_of.get(rid)
            if row is not None:
                n = int(batch.num_tokens[row])
                fit = t[: max(0, batch.max_model_len - n)]
                batch.token_ids[row, n : n + len(fit)] = fit
                batch.num_tokens[row] = n + len(t)
            sampled[i] = t
            drafted[rid] = int(real[j])
        return ModelRunnerOutput(step.req_ids, sampled, None, step.prompt_logprobs_done or {}, spec_num_drafted=drafted)

    def record_sync(self, r: ModelRunner, x: StepInputs, sample_idx: np.ndarray, sampled: list[list[int]]) -> None:
        """A synchronous step's emitted tokens into the device histories, and the requests' next proposals."""
        hist = self.history
        if not len(sample_idx):
            return
        idx = sample_idx.tolist()
        width = self.k + 1  # (a step emits at most k + 1 tokens per request)
        toks = np.full((len(idx), width), -1, dtype=np.int64)
        counts = np.zeros(len(idx), dtype=np.int64)
        for j, i in enumerate(idx):
            toks[j, : len(sampled[i])] = sampled[i]
            counts[j] = len(sampled[i])
        dev = r.device
        slots = hist.slots([x.req_ids[i] for i in idx])
        zeros = np.zeros(len(idx), dtype=np.int64)
        hist.advance(
            torch.from_numpy(slots).to(dev, non_blocking=True),
            torch.from_numpy(zeros).to(dev, non_blocking=True),
            None,
            (slots, zeros),
            int(x.seq_lens[sample_idx].max()) + 2 * self.k + 2,
            verified=VerifyOutput(
                torch.from_numpy(toks).to(dev, non_blocking=True),
                torch.from_numpy(counts).to(dev, non_blocking=True),
                torch.empty(0),
            ),
        )
