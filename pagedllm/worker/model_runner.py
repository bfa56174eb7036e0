"""Runs one scheduled step: applies the scheduler's diffs to the persistent batch (`batch_update`), builds
the flattened inputs (`step_inputs`) and per-group attention metadata (`attn_inputs`), runs the model
(eagerly or by replaying a CUDA graph), gathers the logits it needs, samples (`sampling_batch` builds the
metadata) and hands the sampled ids back synchronously or in flight (`async_output`). The set-up (model
loading, KV-cache allocation, warm-up, graph capture) is `worker/runner_setup.py`'s `ModelRunnerSetupMixin`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pagedllm import envs
from pagedllm.attention.backends.abstract import AttentionMetadataBuilder
from pagedllm.attention.layer import Attention
from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_utils import KVCacheConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.forward_context import set_forward_context
from pagedllm.sample.logits_processor import LogitsProcessor
from pagedllm.sample.sampler import Sampler
from pagedllm.structured_output.apply import apply_grammar_bitmask
from pagedllm.worker.async_output import AsyncCopier, InFlightTokens, Patch, PendingStep, apply_patch
from pagedllm.worker.attn_inputs import build_commons, metadata_by_layer, tables_and_slots
from pagedllm.worker.batch_update import BatchUpdater
from pagedllm.worker.cuda_graph import CudaGraphRunner
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.mixed_graph import MixedGraphRunner
from pagedllm.worker.piecewise_graph import PiecewiseGraphRunner
from pagedllm.worker.prompt_logprobs import PromptLogprobs
from pagedllm.worker.runner_setup import ModelRunnerSetupMixin
from pagedllm.worker.sampling_batch import SamplingBatch
from pagedllm.worker.step_inputs import StepInputBuilder, StepInputs


class ModelRunner(ModelRunnerSetupMixin):
    def __init__(
        self, config: EngineConfig, device: torch.device, logits_processors: list[LogitsProcessor] | None = None
    ) -> None:
        self.config = config
        self.device = device
        self.model_config = config.model_config
        self.block_size = config.cache_config.block_size
        self.max_model_len = self.model_config.max_model_len
        self.max_num_reqs = config.scheduler_config.max_num_seqs
        self.max_num_tokens = config.scheduler_config.max_step_tokens
        self.dtype = self.model_config.dtype
        self.sampler = Sampler(logits_processors, getattr(self.model_config, "logprobs_mode", "raw_logprobs"))
        self.prompt_logprobs = PromptLogprobs(self.sampler.logprobs_mode)
        self.model: Any = None
        """The loaded model (an nn.Module providing `model_executor.models.interfaces.CausalLM`)."""
        self.attn_layers: dict[str, Attention] = {}
        self.kv_cache_config: KVCacheConfig | None = None
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.builders: list[AttentionMetadataBuilder] = []
        self.cuda_graphs: CudaGraphRunner | None = None
        self.verify_graphs: CudaGraphRunner | None = None
        """Speculative decoding: graphs of k + 1 query rows per request for the verification steps."""
        self.mixed_graphs: MixedGraphRunner | None = None
        """Prefill and mixed steps up to PAGEDLLM_PIECEWISE_MAX_TOKENS tokens, a graph each (worker/mixed_graph.py)."""
        self.piecewise: PiecewiseGraphRunner | None = None
        """The same steps where whole-step graphs are off or failed to capture (worker/piecewise_graph.py)."""
        self.copier = AsyncCopier()
        self._arange = np.arange(max(self.max_num_tokens, self.max_model_len) + 1, dtype=np.int64)
        self.in_flight = InFlightTokens(self._arange)
        self._deferred: tuple[PendingStep, Callable[[], None]] | None = None
        """A launched step whose sampling waits for `complete_launch` (structured outputs, see `_launch`)."""
        self.num_deferred_samplings = 0
        # Set by initialize_kv_cache (they need the KV-cache groups).
        self.input_batch: InputBatch | None = None
        self.updater: BatchUpdater | None = None
        self.inputs: StepInputBuilder | None = None
        self.sampling: SamplingBatch | None = None
        self.spec: Any = None
        """Speculative decoding (`spec_decode.runner.SpecDecodeRunner`) when configured; None: the plain path."""
        self.lora: Any = None
        """Multi-LoRA (`lora.manager.LoRAManager`) when the config enables it; None keeps the plain path."""
        self.pp: Any = None
        """This rank's pipeline stage (`distributed.pipeline.PipelineStage`) when pp > 1; None: one stage."""
        self.mm: Any = None
        """The encoder step (`multimodal.runner.MultiModalRunner`) for a vision-language model; else None."""

    @property
    def requests(self) -> dict:
        return self.updater.requests if self.updater is not None else {}

    # ---- one step ------------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        assert self.updater is not None
        finished, added = self.updater.apply(so)
        for rid in finished:
            self.prompt_logprobs.remove(rid)
            self.sampler.remove_request(rid)
        for st in added:
            self.sampler.add_request(st.req_id, st.sampling_params, st.prompt_token_ids, st.output_token_ids)
            self.prompt_logprobs.add(st)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.spec is not None:
            return self.spec.execute(self, so)
        return self.finish_step(self._launch(so, ahead=False))

    @torch.inference_mode()
    def execute_model_async(self, so: SchedulerOutput, defer_grammar: bool = False) -> PendingStep:
        """Launch the step and return without waiting for the device: the sampled ids come back through a
        non-blocking copy that `finish_step` waits for. Decodes whose last token is still in flight (sampled
        by the previous launched step) take it on the device from that step.

        `defer_grammar` (the in-process executor, whose engine calls `complete_launch`): a step with a grammar
        bitmask launches its forward only; its mask, sampler and copy wait for `complete_launch` (or the next
        launch, or its `finish_step`), so the mask's host fill (which needs the previous step's tokens) runs
        while the engine reads the previous step's results instead of holding up the step loop."""
        if self.spec is not None:  # speculation under async scheduling (n-gram): `spec_decode/async_ngram.py`
            return self.spec.launch(self, so)
        bm = so.grammar_bitmask
        defer = defer_grammar and bm is not None and getattr(bm, "defer_sampling", True) and envs.PAGEDLLM_GRAMMAR_DEFER
        return self._launch(so, ahead=True, defer=defer)

    @torch.inference_mode()
    def complete_launch(self) -> None:
        """Launch the sampling a step deferred (a no-op when none is)."""
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            deferred[1]()

    def _launch(self, so: SchedulerOutput, ahead: bool, defer: bool = False) -> PendingStep:
        self.complete_launch()  # before the batch's rows change below
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return PendingStep([], np.zeros(0, dtype=np.int64))
        batch, model, sampling = self.input_batch, self.model, self.sampling
        assert batch is not None and model is not None and sampling is not None and self.inputs is not None
        x = self.inputs.build(so)
        patch = self.in_flight.patch(
            x.req_ids, x.req_of_token, x.positions, batch.num_tokens[x.token_rows], self.device
        )
        mm_step = self.mm.prepare(so, x, self.requests) if self.mm is not None else None
        hidden = self._forward(x, patch, mm_step)
        if hidden is None:  # a pipeline stage before the last: it learns the sampled ids from the next steps
            return self.pp.follow_step(x, batch, self.in_flight)
        prompt_lp_done = self.prompt_logprobs.gather(
            model, batch, x.req_ids, x.rows, x.computed, x.seq_lens, x.cu, hidden
        )

        # Only requests whose known tokens are all computed after this step sample (not partial prefills; a
        # decode whose input token is still in flight samples too).
        sample_idx = np.nonzero(x.seq_lens >= batch.num_tokens[x.rows])[0]
        step = PendingStep(x.req_ids, sample_idx, prompt_logprobs_done=prompt_lp_done)
        logits = md = None
        if len(sample_idx):
            if len(sample_idx) == x.num_tokens:  # every token samples (all decodes): its hidden rows in order
                logits = model.compute_logits(hidden[: x.num_tokens])
            else:
                logits_idx = torch.from_numpy(x.cu[1:][sample_idx] - 1).to(self.device, non_blocking=True)
                logits = model.compute_logits(hidden[logits_idx])
            md = sampling.build(x.rows[sample_idx], x.seq_lens[sample_idx])
        # The per-request states' num_computed_tokens is refreshed from the scheduler's diff each step (and on
        # resume), so only the batch row needs it here: no per-request loop on the hot path.
        batch.num_computed_tokens[x.rows] = x.seq_lens
        if defer and md is not None:
            self._deferred = (step, lambda: self._sample(step, so, x, logits, md, ahead))
            self.num_deferred_samplings += 1
        else:
            self._sample(step, so, x, logits, md, ahead)
        return step

    def _sample(self, step: PendingStep, so: SchedulerOutput, x: StepInputs, logits: Any, md: Any, ahead: bool) -> None:
        """The launched step's sampling (with its grammar mask), the sampled ids' copy to the host, and what
        the next launched step takes from this one on the device."""
        batch, sampling, sample_idx = self.input_batch, self.sampling, step.sample_idx
        assert batch is not None and sampling is not None
        sampled_gpu = None
        if md is not None:
            if so.grammar_bitmask is not None:  # structured outputs: the host fill overlaps the forward
                apply_grammar_bitmask(logits, so, x.req_ids, sample_idx)
            out = self.sampler(logits, md)
            sampled_gpu = out.sampled_token_ids
            publish = getattr(so.grammar_bitmask, "publish_sampled", None)
            if publish is not None:  # the grammar server's mask: the sampled ids go back to it (`remote.py`)
                publish(sampled_gpu)
            if out.failed_rows:
                step.failed = {x.req_ids[sample_idx[r]]: msg for r, msg in out.failed_rows.items()}
            if ahead:
                step.sampled_host, step.logprobs, step.event = self.copier.copy(sampled_gpu, out.logprobs_tensors)
                on_sampled = getattr(so.grammar_bitmask, "on_sampled", None)
                if on_sampled is not None:  # structured outputs: the next step's intake starts on its worker
                    on_sampled(x.req_ids, sample_idx, step.sampled_host, step.event, step.failed)
            else:
                step.sampled_host, step.logprobs = sampled_gpu, out.logprobs_tensors
            step.logprob_rows = md.logprob_rows_host if md.logprob_rows is not None else None
            rc = sampling.last
            if rc is not None and rc.version == batch.version:  # the rows the metadata was just built for
                step.sample_rows, step.sample_outputs, step.batch_version = rc.rows, rc.out_ids, rc.version
                step.any_penalty = rc.any_penalty
        if ahead:  # what the next launched step needs if it runs before this one's result is read
            all_sample = len(sample_idx) == x.num_reqs
            self.in_flight.set(x.req_ids if all_sample else [x.req_ids[i] for i in sample_idx.tolist()], sampled_gpu)
        else:
            self.in_flight.clear()

    def _forward(self, x: StepInputs, patch: Patch | None, mm_step: Any = None) -> torch.Tensor | None:
        """The model over the step's tokens: a CUDA-graph replay for pure decodes that fit, else eagerly.
        `mm_step` (`multimodal.runner.MMStep`): image rows for the input embeddings (eager only) and M-RoPE
        positions (a graph can run when they are one row). None on a pipeline stage before the last (its
        activations went to the next stage)."""
        batch, model, kv = self.input_batch, self.model, self.kv_cache_config
        assert batch is not None and model is not None and kv is not None
        groups = kv.groups
        max_seq = int(x.seq_lens.max())
        tables, slots = tables_and_slots(
            batch.block_tables, [g.spec.block_size for g in groups], x.rows, x.req_of_token, x.positions, max_seq
        )
        if self.lora is not None:  # the step's per-token adapter slots (a graph input)
            self.lora.prepare_step(batch, x.token_rows)
        graphs = self.cuda_graphs
        pos_host = x.positions
        mm_pieces = None
        if mm_step is not None:
            mm_pieces = mm_step.pieces
            if mm_step.positions is not None:
                pos_host = mm_step.positions
        graph_ok = mm_pieces is None and pos_host.ndim == 1
        if graphs is not None and x.max_query_len == 1 and graph_ok and graphs.can_run(x.num_reqs):
            return graphs.run(x.input_ids, pos_host, x.seq_lens.astype(np.int32), slots, tables, patch)
        vg = self.verify_graphs
        if (
            vg is not None
            and patch is None
            and mm_step is None
            and x.max_query_len <= vg.q
            and vg.can_run_padded(x.cu, x.seq_lens)
        ):
            return vg.run_padded(x.input_ids, x.seq_lens, x.cu, slots, tables)
        mg = self.mixed_graphs
        if mg is not None and graph_ok and mg.can_run(x.num_tokens):
            return mg.run(x.input_ids, pos_host, x.cu, x.seq_lens, slots, tables, patch)
        dev = self.device
        key_limit = mm_step.key_limit if mm_step is not None else None
        commons = build_commons(x.cu, x.seq_lens, x.computed, tables, slots, x.max_query_len, dev, key_limit=key_limit)
        pw = self.piecewise
        if pw is not None and graph_ok and pw.can_run(x.num_tokens):
            return pw.run(x.input_ids, pos_host, patch, metadata_by_layer(self.builders, groups, commons))
        input_ids = torch.from_numpy(x.input_ids).to(dev, non_blocking=True)
        if patch is not None:
            apply_patch(input_ids, patch)
        positions = torch.from_numpy(pos_host).to(dev, non_blocking=True)
        with set_forward_context(metadata_by_layer(self.builders, groups, commons)):
            if self.pp is not None:
                return self.pp.forward(model, input_ids, positions)
            if mm_pieces is not None:
                return model(input_ids, positions, inputs_embeds=self.mm.embeds(input_ids, mm_pieces))
            return model(input_ids, positions)

    def finish_step(self, step: PendingStep) -> ModelRunnerOutput:
        """Host bookkeeping of a launched step once its sampled ids are on the host: the tokens join their
        requests' states and batch rows. Rows may have been reused by a step launched meanwhile: unless the
        batch is unchanged since the launch (then by row, NOTES H3/H11), it goes by request id."""
        if self.spec is not None:
            return self.spec.finish(self, step)
        if self._deferred is not None and self._deferred[0] is step:
            self.complete_launch()
        num_reqs = len(step.req_ids)
        sampled_lists: list[list[int]] = [[] for _ in range(num_reqs)]
        if step.sampled_host is None:
            return ModelRunnerOutput(
                step.req_ids, sampled_lists, None, step.prompt_logprobs_done or {}, step.failed or {}
            )
        batch = self.input_batch
        assert batch is not None
        sampled = step.sampled_ids()
        if step.sample_outputs is not None and step.batch_version == batch.version:
            # Nothing entered or left the batch since the launch: every sampled request is in its row.
            assert step.sample_rows is not None
            for out_ids, tok in zip(step.sample_outputs, sampled):
                out_ids.append(tok)
            rows, count = step.sample_rows, step.any_penalty
            host = step.sampled_host
            toks = host.numpy() if host.dtype == torch.int64 and host.device.type == "cpu" else np.asarray(sampled)
        else:
            requests, rows_of = self.requests, batch.req_id_to_row
            known_rows, known_toks = [], []
            for i, tok in zip(step.sample_idx.tolist(), sampled):
                st = requests.get(step.req_ids[i])
                if st is None:
                    continue  # finished or aborted while the step ran
                st.output_token_ids.append(tok)
                row = rows_of.get(st.req_id)
                if row is not None:
                    known_rows.append(row)
                    known_toks.append(tok)
            rows, toks, count = np.asarray(known_rows, np.int64), np.asarray(known_toks, np.int64), True
        if len(rows):
            batch.append_tokens(rows, toks)
            if count:
                batch.count_output_tokens(rows, toks)
        if len(sampled) == num_reqs:
            sampled_lists = [[tok] for tok in sampled]
        else:
            for i, tok in zip(step.sample_idx.tolist(), sampled):
                sampled_lists[i] = [tok]
        return ModelRunnerOutput(
            step.req_ids, sampled_lists, step.logprobs_lists(), step.prompt_logprobs_done or {}, step.failed or {}
        )
