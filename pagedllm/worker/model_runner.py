"""Runs one scheduled step: applies the scheduler's diffs to the persistent batch, builds the flattened
inputs and per-group attention metadata, runs the model, gathers the logits it needs and samples."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedllm.attention.backends.abstract import AttentionBackend, CommonAttentionMetadata
from pagedllm.attention.layer import Attention
from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import cdiv
from pagedllm.core.kv_cache_utils import KVCacheConfig, KVCacheSpec, group_layers_by_spec
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.forward_context import set_forward_context
from pagedllm.logger import init_logger
from pagedllm.logprobs import LogprobsLists
from pagedllm.sample import triton_sample
from pagedllm.sample.logits_processor import LogitsProcessor
from pagedllm.sample.metadata import SamplingMetadata, fill_sparse_fields, upload
from pagedllm.sample.sampler import LogprobsTensors, Sampler, gather_logprobs
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.cuda_graph import CudaGraphRunner, Patch
from pagedllm.worker.input_batch import CachedRequestState, InputBatch

logger = init_logger(__name__)


def alloc_zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeroed KV memory. On the CPU through numpy's calloc, so pages are only touched when written
    (a 4 GiB cache then costs nothing at start-up); unwritten slots must read as zeros, not garbage,
    because masked attention still multiplies them by zero probabilities."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    np_dtype = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[itemsize]
    return torch.from_numpy(np.zeros(shape, dtype=np_dtype)).view(dtype)


@dataclass
class PendingStep:
    """A launched step; `result()` waits for its sampled ids and does the host bookkeeping."""

    runner: ModelRunner
    req_ids: list[str]
    sample_idx: np.ndarray
    num_reqs: int
    sampled_host: torch.Tensor | None
    event: Any
    logprobs: LogprobsTensors | None
    """The sampled rows' logprobs, host copies in flight with sampled_host (read after the event)."""
    sampling_metadata: SamplingMetadata | None
    prompt_logprobs_done: dict[str, LogprobsLists]
    sample_rows: np.ndarray | None = None
    """Batch rows of the sampled requests (in sample_idx order), valid while the batch's version is
    `batch_version`."""
    sample_outputs: list[list[int]] | None = None
    """The sampled requests' live output-token lists, in sample_idx order."""
    batch_version: int = -1
    any_penalty: bool = True
    """Some row of `sample_rows` holds a penalty slot (False: `_finish`'s by-row path counts nothing)."""

    def result(self) -> ModelRunnerOutput:
        return self.runner._finish(self)


@dataclass
class _RowOrder:
    """A step's scheduled requests in batch-row order (ModelRunner._request_order's cache)."""

    version: int
    keys: list[str]
    """num_scheduled_tokens' keys in the scheduler's order."""
    req_ids: list[str]
    rows: np.ndarray
    perm: np.ndarray | None
    """req_ids[i] == keys[perm[i]] (None: the identity)."""


@dataclass
class _RowLists:
    """Per-row Python data of the sampled rows (ModelRunner._row_lists' cache), valid for one batch
    version: the sampling params, the live token lists and the generators of seeded non-greedy rows."""

    version: int
    rows: np.ndarray
    params: list[SamplingParams] = field(default_factory=list)
    out_ids: list[list[int]] = field(default_factory=list)
    prompt_ids: list[list[int]] = field(default_factory=list)
    req_ids: list[str] = field(default_factory=list)
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    min_tokens_rows: list[tuple[int, SamplingParams, list[int], list[int]]] = field(default_factory=list)
    """(row index, params, output ids, stop ids) of the rows with min_tokens and stop ids to mask."""
    any_sparse: bool = False
    """Some row uses logit bias, allowed tokens, bad words or logprobs (fill_sparse_fields has work)."""
    all_greedy: bool = False
    all_random: bool = False
    use_p: bool = False
    """Some row has top_p < 1."""
    use_k: bool = False
    """Some row has top_k > 0."""
    use_min_p: bool = False
    any_penalty: bool = False
    """Some row holds a penalty slot."""
    params_dev: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None = None
    """(temperature, top_p, top_k, min_p) of the rows on the device, uploaded by the first step that used
    this entry: a row's parameters are fixed while its request holds it (no upload per step)."""
    top_p_host: np.ndarray | None = None
    top_k_host: np.ndarray | None = None


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        logits_processors: list[LogitsProcessor] | None = None,
    ) -> None:
        self.config = config
        self.device = device
        self.model_config = config.model_config
        self.block_size = config.cache_config.block_size
        self.max_model_len = self.model_config.max_model_len
        self.max_num_reqs = config.scheduler_config.max_num_seqs
        self.max_num_tokens = config.scheduler_config.max_num_batched_tokens
        self.dtype = self.model_config.dtype
        self.sampler = Sampler(logits_processors, getattr(self.model_config, "logprobs_mode", "raw_logprobs"))
        self.prompt_logprobs: dict[str, LogprobsLists] = {}
        """Requests whose prompt logprobs are not complete yet -> what the chunks so far gave."""
        self.requests: dict[str, CachedRequestState] = {}
        self.model: torch.nn.Module | None = None
        self.attn_layers: dict[str, Attention] = {}
        self.kv_cache_config: KVCacheConfig | None = None
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.builders: list[Any] = []
        self.input_batch: InputBatch | None = None
        self.cuda_graphs: CudaGraphRunner | None = None
        self._events: list[torch.cuda.Event] | None = None
        self._event_turn = 0
        self._stream: torch.cuda.Stream | None = None
        self._in_flight: tuple[torch.Tensor | None, dict[str, int]] | None = None
        """The last step launched ahead: its sampled ids (on the device) and request id -> index."""
        self._in_flight_ids: list[str] = []
        """The request ids of `_in_flight`'s sampled rows, in order (index_of's keys). Never mutated: a new
        step's ids replace the list; `_in_flight`'s dict is reused while they are unchanged."""
        self._arange = np.arange(max(self.max_num_tokens, self.max_model_len) + 1, dtype=np.int64)
        self._order_cache: _RowOrder | None = None
        """The last step's request order (by batch row), reused while the batch and the scheduled ids
        are unchanged (steady decoding)."""
        self._rows_cache: _RowLists | None = None
        """Per-row lists of the last sampled rows, for `_sampling_metadata` and `_finish`."""
        self._states_rows: tuple[int, list[str], np.ndarray] | None = None
        """(batch version, scheduled cached request ids, their rows) of the last `_update_states`: the row
        lookups are reused while both are unchanged."""

    # ---- set-up --------------------------------------------------------------------------------
    def load_model(self) -> None:
        from pagedllm.model_executor.model_loader.loader import load_model

        t0 = time.perf_counter()
        self.model = load_model(self.model_config, self.config.load_config.load_format, self.device)
        self.model.eval()
        if self.device.type == "cpu":
            from pagedllm.model_executor.layers.cpu_gemm import pack_cpu_weights

            with torch.no_grad():
                n_packed = pack_cpu_weights(self.model)
            if n_packed:
                logger.info("Packed %d linear weights for oneDNN", n_packed)
        self.attn_layers = {m.layer_name: m for m in self.model.modules() if isinstance(m, Attention)}
        logger.info("Model loaded in %.2f s (%d attention layers)", time.perf_counter() - t0, len(self.attn_layers))

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return {
            name: KVCacheSpec(self.block_size, layer.num_kv_heads, layer.head_size, self.dtype, layer.sliding_window)
            for name, layer in self.attn_layers.items()
            if layer.attn_type == "decoder"
        }

    def bytes_per_block(self) -> int:
        """KV bytes one block id costs across all layers (every layer's tensor has every block id)."""
        return sum(s.page_size_bytes for s in self.get_kv_cache_specs().values())

    def initialize_kv_cache(self, num_blocks: int) -> KVCacheConfig:
        specs = self.get_kv_cache_specs()
        groups = group_layers_by_spec(specs)
        self.kv_cache_config = KVCacheConfig(num_blocks, groups)
        for name, spec in specs.items():
            layer = self.attn_layers[name]
            shape = layer.backend.get_kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
            kv = alloc_zeroed(shape, spec.dtype, self.device)
            self.kv_caches[name] = kv
            layer.kv_cache = kv
        backend: type[AttentionBackend] = next(iter(self.attn_layers.values())).backend
        self.builders = [
            backend.get_builder_cls()(g.spec.block_size, g.spec.sliding_window, self.device) for g in groups
        ]
        max_blocks = cdiv(self.max_model_len, self.block_size)
        self.input_batch = InputBatch(
            self.max_num_reqs, self.max_model_len, max_blocks, len(groups), self.model_config.vocab_size, self.device
        )
        return self.kv_cache_config

    def _metadata_by_layer(self, commons: list[CommonAttentionMetadata]) -> dict[str, Any]:
        """Each KV-cache group's backend metadata (built from its `commons` entry), keyed by layer name."""
        assert self.kv_cache_config is not None
        out: dict[str, Any] = {}
        for builder, group, common in zip(self.builders, self.kv_cache_config.groups, commons, strict=True):
            out.update(dict.fromkeys(group.layer_names, builder.build(common)))
        return out

    @torch.inference_mode()
    def warm_up_kernels(self) -> None:
        """Runs the attention launch variants a workload can meet (pure prefill; decodes mixed with fresh and
        cached-prefix chunks; eager decodes) once on dummy inputs, so that Triton compiles them at start-up
        rather than inside a running step (before this, W2 on the H200 stalled ~5 s on mid-run compiles).
        Slots are -1 (nothing written to the cache) and block tables point at the null block. GPU only."""
        if self.device.type != "cuda":
            return
        t0 = time.perf_counter()
        logits = self.run_dummy_batches()
        if logits is not None and triton_sample.usable(logits := logits.float()):  # the one-pass sampler too
            n = logits.shape[0]
            keys = torch.zeros(n, dtype=torch.int64, device=self.device)
            triton_sample.gumbel_sample(logits, torch.ones(n, device=self.device), keys)  # seeded rows present
            triton_sample.gumbel_sample(logits, torch.ones(n, device=self.device), None)  # keys made in the kernel
        torch.cuda.synchronize()
        logger.info("Kernel warm-up (attention variants, sampling) in %.2f s", time.perf_counter() - t0)

    @torch.inference_mode()
    def run_dummy_batches(self) -> torch.Tensor | None:
        """The warm-up's forwards (any device): writes nothing to the KV cache. Returns the last batch's
        logits (None if nothing ran)."""
        if not self.attn_layers or self.kv_cache_config is None or not self.kv_cache_config.groups:
            return None
        assert self.model is not None
        logits = None
        c = max(2, min(64, (self.max_model_len - 16) // 2))
        # Chunks of 64 get the chunk tiles; a 2-token chunk next to a decode gets decode tiles (what a step
        # whose budget leaves a prompt's last few tokens runs); decode batches of 1..64 requests compile the
        # split-KV variants that eager decoding (no CUDA graphs) picks by batch size.
        shapes = [([c], [0]), ([1, c], [16, 0]), ([1, c, c], [16, 0, 16]), ([1, 2], [16, 0])]
        shapes += [([1] * k, [16] * k) for k in (1, 2, 4, 8, 16, 32, 64) if k <= self.max_num_reqs]
        dev = self.device
        for q_lens, ctx in shapes:
            n = sum(q_lens)
            seq = [a + b for a, b in zip(q_lens, ctx)]
            if n > self.max_num_tokens or max(seq) > self.max_model_len:
                continue
            qsl = torch.tensor(np.cumsum([0] + q_lens), dtype=torch.int32)
            pos = torch.cat([torch.arange(a, a + q) for q, a in zip(q_lens, ctx)]).to(dev)
            seq_cpu = torch.tensor(seq, dtype=torch.int32)
            commons = [
                CommonAttentionMetadata(
                    query_start_loc=qsl.to(dev),
                    query_start_loc_cpu=qsl,
                    seq_lens=seq_cpu.to(dev),
                    seq_lens_cpu=seq_cpu,
                    num_computed_tokens_cpu=torch.tensor(ctx, dtype=torch.int32),
                    block_table=torch.zeros(
                        len(q_lens), cdiv(max(seq), group.spec.block_size), dtype=torch.int32, device=dev
                    ),
                    slot_mapping=torch.full((n,), -1, dtype=torch.long, device=dev),
                    num_reqs=len(q_lens),
                    num_actual_tokens=n,
                    max_query_len=max(q_lens),
                    max_seq_len=max(seq),
                )
                for group in self.kv_cache_config.groups
            ]
            with set_forward_context(self._metadata_by_layer(commons)):
                hidden = self.model(torch.zeros(n, dtype=torch.long, device=dev), pos)
            logits = self.model.compute_logits(hidden[qsl[1:].to(dev).long() - 1])
        return logits

    def capture_cuda_graphs(self) -> None:
        """Pure-decode CUDA graphs: GPU only, not with enforce_eager, and only with a backend whose
        metadata lives in fixed device buffers (Triton)."""
        if self.device.type != "cuda" or self.config.enforce_eager or not self.attn_layers:
            return
        backend = next(iter(self.attn_layers.values())).backend
        if backend.name != "triton":
            logger.info("CUDA graphs off: attention backend %s cannot be captured", backend.name)
            return
        assert self.kv_cache_config is not None and self.model is not None
        self.cuda_graphs = CudaGraphRunner(
            self.model,
            self.kv_cache_config.groups,
            self.builders,
            self.max_num_reqs,
            cdiv(self.max_model_len, self.block_size),
            self.max_model_len,
            self.device,
        )
        self.cuda_graphs.capture()

    # ---- one step ------------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        assert batch is not None
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            batch.remove_request(rid)
            self.prompt_logprobs.pop(rid, None)
            self.sampler.remove_request(rid)
        for rid in so.preempted_req_ids:
            batch.remove_request(rid)  # state kept (with its generator) for when it resumes
        for new in so.scheduled_new_reqs:
            sp = new.sampling_params
            gen = None
            if sp.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(sp.seed)
            st = CachedRequestState(
                new.req_id,
                list(new.prompt_token_ids),
                list(new.output_token_ids),
                sp,
                gen,
                [list(ids) for ids in new.block_ids],
                new.num_computed_tokens,
                new.lora_id,
            )
            self.requests[new.req_id] = st
            batch.add_request(st)
            self.sampler.add_request(new.req_id, sp, st.prompt_token_ids, st.output_token_ids)
            if sp.prompt_logprobs is not None and not st.output_token_ids:
                self.prompt_logprobs[new.req_id] = LogprobsLists()
        c = so.scheduled_cached_reqs
        if not c.req_ids:
            return
        rows_of = batch.req_id_to_row
        req_ids, num_computed, resumed_flags = c.req_ids, c.num_computed_tokens, c.resumed_from_preemption
        if any(resumed_flags):
            for rid, resumed, new_ids, n in zip(req_ids, resumed_flags, c.new_block_ids, num_computed):
                if resumed:
                    st = self.requests[rid]
                    st.num_computed_tokens = n
                    assert new_ids is not None
                    st.block_ids = [list(ids) for ids in new_ids]
                    batch.add_request(st)
            keep = [j for j, resumed in enumerate(resumed_flags) if not resumed]
            req_ids = [req_ids[j] for j in keep]
            num_computed = [num_computed[j] for j in keep]
        # The requests that keep their rows: their progress in one write; block ids only for those that
        # got new blocks (a decode gets one every block_size steps).
        if req_ids:
            sc = self._states_rows
            if sc is not None and sc[0] == batch.version and sc[1] == req_ids:
                rows = sc[2]  # the same requests in the same rows as last step (steady decoding)
            else:
                rows = np.fromiter(map(rows_of.__getitem__, req_ids), dtype=np.int64, count=len(req_ids))
                self._states_rows = (batch.version, list(req_ids), rows)
            batch.num_computed_tokens[rows] = num_computed
        new_block_ids = c.new_block_ids
        if new_block_ids.count(None) == len(new_block_ids):
            return  # no request got blocks (decodes inside their blocks): no per-request scan
        grown = [j for j, ids in enumerate(new_block_ids) if ids is not None and not resumed_flags[j]]
        if grown:
            all_new: list[tuple[list[int], ...]] = []
            for j in grown:
                new_ids = c.new_block_ids[j]
                assert new_ids is not None
                for g, ids in enumerate(self.requests[c.req_ids[j]].block_ids):
                    ids.extend(new_ids[g])
                all_new.append(new_ids)
            batch.append_block_ids_rows([rows_of[c.req_ids[j]] for j in grown], all_new)

    def _request_order(self, so: SchedulerOutput) -> tuple[list[str], np.ndarray, np.ndarray]:
        """The scheduled requests sorted by batch row, their rows and scheduled token counts. Steady
        decoding schedules the same requests in the same order step after step: the sort and the row
        lookups are then reused from the last step (checked by the batch version and the id list)."""
        batch = self.input_batch
        assert batch is not None
        nst = so.num_scheduled_tokens
        keys = list(nst)
        n = len(keys)
        oc = self._order_cache
        if oc is not None and oc.version == batch.version and oc.keys == keys:
            n_sched = np.fromiter(nst.values(), dtype=np.int64, count=n)
            if oc.perm is not None:
                n_sched = n_sched[oc.perm]
            return list(oc.req_ids), oc.rows.copy(), n_sched
        rows_of = batch.req_id_to_row
        req_ids = sorted(nst, key=rows_of.__getitem__)
        rows = np.fromiter((rows_of[r] for r in req_ids), dtype=np.int64, count=n)
        n_sched = np.fromiter((nst[r] for r in req_ids), dtype=np.int64, count=n)
        pos = {r: i for i, r in enumerate(keys)}
        perm = np.fromiter((pos[r] for r in req_ids), dtype=np.int64, count=n)
        identity = bool(np.array_equal(perm, self._arange[:n]))
        self._order_cache = _RowOrder(batch.version, keys, list(req_ids), rows.copy(), None if identity else perm)
        return req_ids, rows, n_sched

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self._finish(self._launch(so, ahead=False))

    @torch.inference_mode()
    def execute_model_async(self, so: SchedulerOutput) -> PendingStep:
        """Launch the step and return without waiting for the device: the sampled ids come back through a
        non-blocking copy, and `PendingStep.result()` waits for them. Decodes whose last token is still
        in flight (sampled by the previous launched step) take it on the device from that step."""
        return self._launch(so, ahead=True)

    def _launch(self, so: SchedulerOutput, ahead: bool) -> PendingStep:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return PendingStep(self, [], np.zeros(0, dtype=np.int64), 0, None, None, None, None, {})
        batch = self.input_batch
        assert batch is not None and self.model is not None and self.kv_cache_config is not None
        req_ids, rows, n_sched = self._request_order(so)
        num_reqs = len(req_ids)
        total = int(n_sched.sum())
        computed = batch.num_computed_tokens[rows]
        if total == num_reqs:  # pure decode (every request computes one token): the same arrays, no repeats
            cu = self._arange[: num_reqs + 1].copy()
            req_of_token = self._arange[:num_reqs].copy()
            positions = computed.copy()
            token_rows = rows
        else:
            cu = np.zeros(num_reqs + 1, dtype=np.int64)
            np.cumsum(n_sched, out=cu[1:])
            # Position of every token: computed + offset within its request's chunk.
            req_of_token = np.repeat(np.arange(num_reqs), n_sched)
            offsets = self._arange[:total] - np.repeat(cu[:-1], n_sched)
            positions = np.repeat(computed, n_sched) + offsets
            token_rows = rows[req_of_token]
        input_ids = batch.token_ids[token_rows, positions]
        seq_lens = computed + n_sched
        patch = self._in_flight_patch(req_ids, req_of_token, token_rows, positions)

        dev = self.device
        max_query_len = int(n_sched.max())
        graphs = self.cuda_graphs
        if graphs is not None and max_query_len == 1 and graphs.can_run(num_reqs):
            slots_g, bts = [], []
            max_seq = int(seq_lens.max())
            for g, group in enumerate(self.kv_cache_config.groups):
                bs = group.spec.block_size
                # Only the columns in use (a position p < seq_len has its block p // bs < max_blocks): the
                # whole width is max_model_len / bs columns, which with a long context is megabytes a step.
                bt = batch.block_tables[g][rows, : cdiv(max_seq, bs)]
                slots_g.append(bt[req_of_token, positions // bs].astype(np.int64) * bs + positions % bs)
                bts.append(bt)
            hidden = graphs.run(input_ids, positions, seq_lens.astype(np.int32), slots_g, bts, patch)
        else:
            hidden = self._run_eager(
                batch,
                rows,
                computed,
                seq_lens,
                cu,
                n_sched,
                req_of_token,
                positions,
                input_ids,
                total,
                max_query_len,
                patch,
            )

        prompt_lp_done = self._gather_prompt_logprobs(req_ids, rows, computed, seq_lens, cu, hidden)

        # Only requests whose known tokens are all computed after this step sample (not partial prefills;
        # a decode whose input token is still in flight samples too).
        sample_mask = seq_lens >= batch.num_tokens[rows]
        sample_idx = np.nonzero(sample_mask)[0]
        sampled_gpu = sampled_host = event = None
        logprobs = None
        md_s = None
        if len(sample_idx):
            if len(sample_idx) == total:  # every token samples (all decodes): its hidden rows in order
                logits = self.model.compute_logits(hidden[:total])
            else:
                logits_idx = torch.from_numpy(cu[1:][sample_idx] - 1).to(dev, non_blocking=True)
                logits = self.model.compute_logits(hidden[logits_idx])
            md_s = self._sampling_metadata(rows[sample_idx], seq_lens[sample_idx])
            out = self.sampler(logits, md_s)
            sampled_gpu = out.sampled_token_ids
            logprobs = out.logprobs_tensors
            if ahead and sampled_gpu.device.type == "cuda":
                sampled_host = torch.empty(sampled_gpu.shape, dtype=sampled_gpu.dtype, pin_memory=True)
                sampled_host.copy_(sampled_gpu, non_blocking=True)
                if logprobs is not None:
                    logprobs = logprobs.copy_to_host()
                event = self._next_event()
                event.record(self._stream)
            else:
                sampled_host = sampled_gpu
        # The per-request states' num_computed_tokens is refreshed from the scheduler's diff each step
        # (and on resume), so only the batch row needs it here: no per-request loop on the hot path.
        batch.num_computed_tokens[rows] = seq_lens
        if ahead:
            # What the next launched step needs if it runs before this one's result is read.
            sample_ids = req_ids if len(sample_idx) == num_reqs else [req_ids[i] for i in sample_idx.tolist()]
            prev = self._in_flight
            if prev is not None and self._in_flight_ids == sample_ids:
                index_of = prev[1]  # the same ids in the same order as the last launched step (steady decoding)
            else:
                index_of = {rid: j for j, rid in enumerate(sample_ids)}
                self._in_flight_ids = list(sample_ids)
            self._in_flight = (sampled_gpu, index_of)
        else:
            self._in_flight = None
        step = PendingStep(self, req_ids, sample_idx, num_reqs, sampled_host, event, logprobs, md_s, prompt_lp_done)
        rc = self._rows_cache
        if md_s is not None and rc is not None and rc.version == batch.version:
            # The rows the metadata was just built for: _finish may append by row while nothing moved.
            step.sample_rows, step.sample_outputs, step.batch_version = rc.rows, rc.out_ids, rc.version
            step.any_penalty = rc.any_penalty
        return step

    def _next_event(self) -> torch.cuda.Event:
        """One of two events, alternately, for the steps' sampled-id copies (creating an event and looking up
        the current stream took ~13 us a step on the H200 host). At most two launched steps are unread
        (async scheduling), and re-recording one only moves its wait later in the same stream: reuse is
        safe even then."""
        if self._events is None:
            self._events = [torch.cuda.Event(), torch.cuda.Event()]
            self._stream = torch.cuda.current_stream(self.device)
        self._event_turn ^= 1
        return self._events[self._event_turn]

    def _in_flight_patch(
        self, req_ids: list[str], req_of_token: np.ndarray, token_rows: np.ndarray, positions: np.ndarray
    ) -> Patch | None:
        """(token indices, the in-flight sampled ids for them) for input tokens not known on the host yet;
        the indices are a slice when they are all the step's tokens."""
        batch = self.input_batch
        assert batch is not None
        unknown = np.nonzero(positions >= batch.num_tokens[token_rows])[0]
        if not len(unknown):
            return None
        assert self._in_flight is not None, "a step needs tokens that no launched step samples"
        sampled_gpu, index_of = self._in_flight
        n = len(unknown)
        if (
            n == len(positions) == len(req_ids)
            and self._in_flight_ids == req_ids
            and np.array_equal(req_of_token, self._arange[:n])
        ):
            # Every request computes one token, its own last sample, in the order the last step sampled
            # them: src below would be 0..n-1 (index_of[req_ids[k]] == k).
            return slice(0, n), sampled_gpu[:n]
        src = np.fromiter(
            (index_of[req_ids[r]] for r in req_of_token[unknown].tolist()), dtype=np.int64, count=len(unknown)
        )
        if n == len(positions) and src[-1] == n - 1 and np.array_equal(src, self._arange[:n]):
            # Steady decoding (every input token is the last step's sample, same order): one device copy
            # instead of two index uploads, a gather and a scatter.
            return slice(0, n), sampled_gpu[:n]
        dev = self.device
        src_t = torch.from_numpy(src).to(dev, non_blocking=True)
        return torch.from_numpy(unknown).to(dev, non_blocking=True), sampled_gpu[src_t]

    def _finish(self, step: PendingStep) -> ModelRunnerOutput:
        """Host bookkeeping of a launched step once its sampled ids are on the host. Goes by request id:
        rows may have been reused by a step launched meanwhile."""
        num_reqs = step.num_reqs
        logprobs_lists: list[LogprobsLists | None] | None = None
        batch = self.input_batch
        if (
            step.sampled_host is not None
            and step.sample_outputs is not None
            and batch is not None
            and step.batch_version == batch.version
        ):
            # No request entered or left the batch since the launch: every sampled request is still
            # in its row and in self.requests, so the tokens go in by row without per-request lookups.
            if step.event is not None:
                step.event.synchronize()
            sampled = step.sampled_host.tolist()
            if len(sampled) == num_reqs:
                sampled_lists = [[tok] for tok in sampled]
            else:
                sampled_lists = [[] for _ in range(num_reqs)]
                for i, tok in zip(step.sample_idx.tolist(), sampled):
                    sampled_lists[i] = [tok]
            for out_ids, tok in zip(step.sample_outputs, sampled):
                out_ids.append(tok)
            assert step.sample_rows is not None
            host = step.sampled_host
            # The sampled ids as an array: a view of the host tensor (read right away) when it is int64.
            toks_np = (
                host.numpy()
                if host.dtype == torch.int64 and host.device.type == "cpu"
                else np.asarray(sampled, dtype=np.int64)
            )
            batch.append_tokens(step.sample_rows, toks_np)
            if step.any_penalty:  # rc.any_penalty for these rows; their slots cannot change within a version
                batch.count_output_tokens(step.sample_rows, toks_np)
            logprobs_lists = self._logprobs_lists(step)
            return ModelRunnerOutput(step.req_ids, sampled_lists, logprobs_lists, step.prompt_logprobs_done)
        sampled_lists = [[] for _ in range(num_reqs)]
        if step.sampled_host is not None:
            if step.event is not None:
                step.event.synchronize()
            sampled = step.sampled_host.tolist()
            assert batch is not None
            rows_of = batch.req_id_to_row
            known_rows, known_toks = [], []
            for i, tok in zip(step.sample_idx.tolist(), sampled):
                rid = step.req_ids[i]
                sampled_lists[i] = [tok]
                st = self.requests.get(rid)
                if st is None:
                    continue  # finished or aborted while the step ran
                st.output_token_ids.append(tok)
                row = rows_of.get(rid)
                if row is not None:
                    known_rows.append(row)
                    known_toks.append(tok)
            if known_rows:
                rows_np = np.asarray(known_rows, dtype=np.int64)
                toks_np = np.asarray(known_toks, dtype=np.int64)
                batch.append_tokens(rows_np, toks_np)
                batch.count_output_tokens(rows_np, toks_np)
            logprobs_lists = self._logprobs_lists(step)
        return ModelRunnerOutput(step.req_ids, sampled_lists, logprobs_lists, step.prompt_logprobs_done)

    @staticmethod
    def _logprobs_lists(step: PendingStep) -> list[LogprobsLists | None] | None:
        """Per request of the step: the logprobs of its sampled token (None: none asked)."""
        md_s = step.sampling_metadata
        if step.logprobs is None or md_s is None or md_s.logprob_rows is None:
            return None
        lists = step.logprobs.to_lists()
        logprobs_lists: list[LogprobsLists | None] = [None] * step.num_reqs
        for pos, j in enumerate(md_s.logprob_rows_host):
            logprobs_lists[int(step.sample_idx[j])] = lists.slice(pos, pos + 1)
        return logprobs_lists

    def _run_eager(
        self,
        batch: InputBatch,
        rows: np.ndarray,
        computed: np.ndarray,
        seq_lens: np.ndarray,
        cu: np.ndarray,
        n_sched: np.ndarray,
        req_of_token: np.ndarray,
        positions: np.ndarray,
        input_ids: np.ndarray,
        total: int,
        max_query_len: int,
        patch: Patch | None = None,
    ) -> torch.Tensor:
        assert self.model is not None and self.kv_cache_config is not None
        num_reqs = len(rows)
        dev = self.device
        input_ids_t = torch.from_numpy(input_ids).to(dev, non_blocking=True)
        if patch is not None:
            input_ids_t[patch[0]] = patch[1]
        positions_t = torch.from_numpy(positions).to(dev, non_blocking=True)
        qsl_cpu = torch.from_numpy(cu.astype(np.int32))
        seq_cpu = torch.from_numpy(seq_lens.astype(np.int32))
        # Uploaded once for all groups (the same values in every group's metadata).
        qsl_dev = qsl_cpu.to(dev, non_blocking=True)
        seq_dev = seq_cpu.to(dev, non_blocking=True)
        commons = []
        for g, group in enumerate(self.kv_cache_config.groups):
            bs = group.spec.block_size
            max_blocks = cdiv(int(seq_lens.max()), bs)
            # Only the columns in use are gathered (a contiguous copy): every position p < seq_len has its
            # block p // bs < max_blocks.
            bt = batch.block_tables[g][rows, :max_blocks]
            slots = bt[req_of_token, positions // bs].astype(np.int64) * bs + positions % bs
            commons.append(
                CommonAttentionMetadata(
                    query_start_loc=qsl_dev,
                    query_start_loc_cpu=qsl_cpu,
                    seq_lens=seq_dev,
                    seq_lens_cpu=seq_cpu,
                    num_computed_tokens_cpu=torch.from_numpy(computed.astype(np.int32)),
                    block_table=torch.from_numpy(bt).to(dev, non_blocking=True),
                    slot_mapping=torch.from_numpy(slots).to(dev, non_blocking=True),
                    num_reqs=num_reqs,
                    num_actual_tokens=total,
                    max_query_len=max_query_len,
                    max_seq_len=int(seq_lens.max()),
                )
            )
        with set_forward_context(self._metadata_by_layer(commons)):
            return self.model(input_ids_t, positions_t)

    def _gather_prompt_logprobs(
        self,
        req_ids: list[str],
        rows: np.ndarray,
        computed: np.ndarray,
        seq_lens: np.ndarray,
        cu: np.ndarray,
        hidden: torch.Tensor,
    ) -> dict[str, LogprobsLists]:
        """Logprobs of the prompt tokens this step's chunks predict (position p predicts token p + 1;
        the last prompt position predicts the first output token, which the sampler handles). Returns
        the requests whose prompt logprobs became complete this step."""
        done: dict[str, LogprobsLists] = {}
        if not self.prompt_logprobs:
            return done
        batch = self.input_batch
        assert batch is not None and self.model is not None
        for i, rid in enumerate(req_ids):
            acc = self.prompt_logprobs.get(rid)
            if acc is None:
                continue
            st = self.requests[rid]
            n_prompt = len(st.prompt_token_ids)
            start, end = int(computed[i]), min(int(seq_lens[i]), n_prompt - 1)
            if start == 0:
                acc = self.prompt_logprobs[rid] = LogprobsLists()  # (re)started from scratch
            sp = st.sampling_params
            k = sp.prompt_logprobs if sp.prompt_logprobs is not None else 0
            extra = list(sp.logprob_token_ids or ())
            chunk = 512  # bounds the [positions, vocab] logits held at once
            for a in range(start, end, chunk):
                b = min(end, a + chunk)
                h_idx = torch.arange(int(cu[i]) + a - start, int(cu[i]) + b - start, device=hidden.device)
                logits = self.model.compute_logits(hidden[h_idx]).float()
                lp = logits if self.sampler.logprobs_mode == "raw_logits" else logits.log_softmax(dim=-1)
                targets = torch.from_numpy(batch.token_ids[int(rows[i]), a + 1 : b + 1].copy()).to(lp.device)
                acc.extend(gather_logprobs(lp, [k] * (b - a), targets, [extra] * (b - a)))
            if int(seq_lens[i]) >= n_prompt:
                done[rid] = self.prompt_logprobs.pop(rid)
        return done

    def _sampling_metadata(self, rows: np.ndarray, seq_lens: np.ndarray | None = None) -> SamplingMetadata:
        """The sampling parameters of `rows` (the rows that sample, in order); `seq_lens` (their lengths
        after this step) gives seeded rows' output-token index for the one-pass CUDA sampler's keys."""
        batch = self.input_batch
        assert batch is not None
        dev = self.device
        rc = self._row_lists(rows)
        params = rc.params
        prompt_ids = rc.prompt_ids
        generators = dict(rc.generators)
        min_tokens: dict[int, list[int]] = {}
        for i, sp, out, stops in rc.min_tokens_rows:
            if len(out) < sp.min_tokens:
                min_tokens[i] = list(stops)
        if rc.params_dev is None:
            # Which parameters are in use was decided once for these rows (rc); only those are gathered.
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
            generators=generators,
            min_tokens=min_tokens,
            output_token_ids=list(rc.out_ids),
            req_ids=list(rc.req_ids),
            prompt_token_ids=list(prompt_ids),
        )
        if dev.type == "cuda" and seq_lens is not None and generators and not md.all_greedy:
            # One-pass sampler keys when seeded rows sample: a seeded row's from (its seed, the index of the
            # output token it samples). Without them the sampler keys every row in the kernel (no upload).
            seeded = np.fromiter(generators, dtype=np.int64, count=len(generators))
            seeds = np.array([params[i].seed for i in seeded.tolist()], dtype=np.int64)
            index = seq_lens[seeded] - np.array([len(prompt_ids[i]) for i in seeded.tolist()], dtype=np.int64)
            md.noise_seeds = upload(triton_sample.noise_keys(len(rows), seeded, seeds, index), np.int64, dev)
        slots = batch.penalty_slot[rows] if rc.any_penalty else None
        pen = np.nonzero(slots >= 0)[0] if slots is not None else ()
        if len(pen):
            assert slots is not None
            # Penalty state comes from the persistent per-request slots (gathered, not rebuilt).
            slot_t = torch.from_numpy(slots[pen]).to(dev, non_blocking=True)
            prow = rows[pen]
            md.penalty_rows = torch.from_numpy(pen).to(dev, non_blocking=True)
            md.presence_penalties = torch.from_numpy(batch.presence_penalty[prow]).to(dev, non_blocking=True)
            md.frequency_penalties = torch.from_numpy(batch.frequency_penalty[prow]).to(dev, non_blocking=True)
            md.repetition_penalties = torch.from_numpy(batch.repetition_penalty[prow]).to(dev, non_blocking=True)
            md.prompt_token_mask = batch.token_counts.prompt_mask[slot_t]
            md.output_token_counts = batch.token_counts.output_counts[slot_t]
        if rc.any_sparse:
            fill_sparse_fields(md, params, dev)
        return md

    def _row_lists(self, rows: np.ndarray) -> _RowLists:
        """Per-row data of `rows` for the sampling metadata, rebuilt only when the rows or the batch changed
        (a row's parameters are fixed while its request holds it)."""
        batch = self.input_batch
        assert batch is not None
        rc = self._rows_cache
        if rc is not None and rc.version == batch.version and np.array_equal(rc.rows, rows):
            return rc
        rc = _RowLists(batch.version, rows.copy())
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
            if sp.min_tokens:
                stops = list(sp.all_stop_token_ids or ())
                if stops:
                    rc.min_tokens_rows.append((i, sp, st.output_token_ids, stops))
            if (
                sp.logit_bias
                or sp.allowed_token_ids is not None
                or sp.bad_words_token_ids
                or sp.logprobs is not None
                or sp.logprob_token_ids
            ):
                rc.any_sparse = True
            rc.out_ids.append(st.output_token_ids)
            rc.prompt_ids.append(st.prompt_token_ids)
            rc.req_ids.append(st.req_id)
        self._rows_cache = rc
        return rc

    @torch.inference_mode()
    def profile_run(self) -> None:
        """One forward over max_num_batched_tokens dummy tokens (no KV cache writes), for peak memory."""
        assert self.model is not None
        n = min(self.max_num_tokens, self.max_model_len)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)
        common = CommonAttentionMetadata(
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            query_start_loc_cpu=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            seq_lens_cpu=torch.tensor([n], dtype=torch.int32),
            num_computed_tokens_cpu=torch.tensor([0], dtype=torch.int32),
            block_table=torch.zeros(1, 1, dtype=torch.int32, device=self.device),
            slot_mapping=torch.zeros(n, dtype=torch.long, device=self.device),
            num_reqs=1,
            num_actual_tokens=n,
            max_query_len=n,
            max_seq_len=n,
            causal=False,
        )
        from pagedllm.attention.backends.abstract import AttentionType

        saved = {}
        for name, layer in self.attn_layers.items():
            saved[name] = layer.impl.attn_type
            layer.impl.attn_type = AttentionType.ENCODER_ONLY
        try:
            backend = next(iter(self.attn_layers.values())).backend
            md = backend.get_builder_cls()(self.block_size, None, self.device).build(common)
            with set_forward_context({name: md for name in self.attn_layers}):
                hidden = self.model(ids, pos)
                self.model.compute_logits(hidden[-min(n, self.max_num_reqs) :])
        finally:
            for name, layer in self.attn_layers.items():
                layer.impl.attn_type = saved[name]
