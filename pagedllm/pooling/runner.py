"""The model runner of pooling models. Requests are prefill only: the step that computes a request's last
prompt token hands its hidden states to the pooler instead of the sampler, and the scheduler finishes it.

Decoder-only models (`convert="embed"/"classify"`) run the generative runner's paged forward (KV cache,
chunked prefill; the earlier chunks' hidden states are kept when the pooling needs them). Encoder-only
models run a dedicated encoder forward (`model_executor/models/bert.py`): the whole sequence in one step
(no chunking), bidirectional attention within each sequence, no KV cache at all; the scheduler's blocks
for them only account for the step's tokens and are freed when the request finishes."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagedllm.core.kv_cache_utils import KVCacheConfig, KVCacheSpec, group_layers_by_spec
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.model_executor.models.bert import EncoderBatch
from pagedllm.pooling.pooler import Pooler
from pagedllm.pooling_params import PoolingParams
from pagedllm.worker.model_runner import ModelRunner

_ENCODER_GROUP = "encoder"


class PoolingModelRunner(ModelRunner):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pooler: Pooler | None = None
        self.pool_params: dict[str, PoolingParams] = {}
        self.prompts: dict[str, list[int]] = {}
        """Encoder-only: the prompt of each request known to the runner."""
        self.partial: dict[str, list[torch.Tensor]] = {}
        """Decoder-only, chunked prefill: the hidden states of a request's earlier chunks (MEAN / ALL)."""

    @property
    def encoder_only(self) -> bool:
        return bool(getattr(self.model, "is_encoder_only", False))

    def load_model(self) -> None:
        super().load_model()
        setup = self.model_config.pooling
        self.pooler = Pooler(self.model, setup.pooler_config)

    def pack_cpu_weights(self) -> int:
        """A float32 encoder may get bf16 GEMMs first (`pooling/cpu_mixed.py`); the rest packs as usual."""
        from pagedllm.pooling import cpu_mixed

        setup = self.model_config.pooling
        n = cpu_mixed.pack_bf16_gemms(self.model) if setup is not None and setup.bf16_gemms else 0
        return n + super().pack_cpu_weights()

    # ---- set-up: an encoder has no KV cache ----------------------------------------------------------
    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        if self.encoder_only:  # one token-accounting group (no memory behind it)
            return {_ENCODER_GROUP: KVCacheSpec(self.block_size, 1, 1, self.dtype)}
        return super().get_kv_cache_specs()

    def initialize_kv_cache(self, num_blocks: int) -> KVCacheConfig:
        if self.encoder_only:
            self.kv_cache_config = KVCacheConfig(num_blocks, group_layers_by_spec(self.get_kv_cache_specs()))
            return self.kv_cache_config
        return super().initialize_kv_cache(num_blocks)

    def profile_run(self) -> None:
        if not self.encoder_only:
            super().profile_run()

    def run_dummy_batches(self) -> torch.Tensor | None:
        return None if self.encoder_only else super().run_dummy_batches()

    def capture_cuda_graphs(self) -> None:
        """Pooling steps are prefills: no decode graphs to capture."""

    # ---- one step ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for nr in so.scheduled_new_reqs:
            self.pool_params[nr.req_id] = nr.pooling_params or PoolingParams(task="embed")
            if self.encoder_only:
                self.prompts[nr.req_id] = nr.prompt_token_ids
        for rid in so.finished_req_ids:
            self.pool_params.pop(rid, None)
            self.prompts.pop(rid, None)
            self.partial.pop(rid, None)
        if self.encoder_only:
            return self._execute_encoder(so)
        return self._execute_decoder(so)

    def _execute_encoder(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if not so.num_scheduled_tokens:
            return ModelRunnerOutput([], [])
        # By length, so that each attention chunk pads little (results go back by request id).
        req_ids = sorted(so.num_scheduled_tokens, key=lambda r: len(self.prompts[r]))
        prompts = [self.prompts[r] for r in req_ids]
        lens = [len(p) for p in prompts]
        dev = self.device
        ids = torch.from_numpy(np.fromiter((t for p in prompts for t in p), np.int64, sum(lens))).to(dev)
        positions = torch.from_numpy(np.concatenate([self._arange[:n] for n in lens])).to(dev)
        eb = EncoderBatch.build(lens, dev)
        hidden = self.model(ids, positions, eb)
        cu = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        return self._pooled(req_ids, hidden, cu, req_ids)

    def _execute_decoder(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], [])
        batch, inputs = self.input_batch, self.inputs
        assert batch is not None and inputs is not None
        x = inputs.build(so)
        hidden = self._forward(x, None)
        assert hidden is not None  # (no pipeline stages for pooling models)
        batch.num_computed_tokens[x.rows] = x.seq_lens
        done = x.seq_lens >= batch.num_tokens[x.rows]
        setup = self.model_config.pooling
        keep_all = setup.pooler_config.pooling_type in ("MEAN", "ALL") or any(
            (self.pool_params[r].task or "") in ("encode", "token_embed", "token_classify") for r in x.req_ids
        )
        parts: list[torch.Tensor] = []
        lens: list[int] = []
        finished: list[str] = []
        for i, rid in enumerate(x.req_ids):
            h = hidden[int(x.cu[i]) : int(x.cu[i + 1])]
            if not done[i]:
                if keep_all:
                    self.partial.setdefault(rid, []).append(h.clone())
                continue
            earlier = self.partial.pop(rid, [])
            h = torch.cat([*earlier, h]) if earlier else h
            parts.append(h)
            lens.append(h.shape[0])
            finished.append(rid)
        if not finished:
            return ModelRunnerOutput(list(x.req_ids), [[] for _ in x.req_ids])
        cu = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        return self._pooled(list(x.req_ids), torch.cat(parts), cu, finished)

    def _pooled(
        self, req_ids: list[str], hidden: torch.Tensor, cu: np.ndarray, finished: list[str]
    ) -> ModelRunnerOutput:
        assert self.pooler is not None
        results = self.pooler.pool(hidden, cu, [self.pool_params[r] for r in finished])
        return ModelRunnerOutput(req_ids, [[] for _ in req_ids], pooler_output=dict(zip(finished, results)))
