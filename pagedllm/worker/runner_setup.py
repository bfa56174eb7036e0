"""The model runner's set-up, mixed into `ModelRunner`: the model's loading (and CPU weight packing), the KV
cache's specs, profile run and allocation (`alloc_zeroed`), the step's persistent batch and builders, the
warm-up forwards and the CUDA-graph captures. Apart from `worker/model_runner.py` so that the step's path
(`execute_model` and what it calls) reads on its own."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from pagedllm.attention.backends.abstract import AttentionBackend, AttentionMetadataBuilder
from pagedllm.attention.layer import Attention
from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.core.kv_cache_utils import KVCacheConfig, KVCacheSpec, group_layers_by_spec
from pagedllm.logger import init_logger
from pagedllm.utils import cdiv
from pagedllm.worker import warmup
from pagedllm.worker.batch_update import BatchUpdater
from pagedllm.worker.cuda_graph import CudaGraphRunner
from pagedllm.worker.cuda_rewrites import apply_cuda_rewrites
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.mixed_graph import MixedGraphRunner, capture_mixed_step_graphs
from pagedllm.worker.piecewise_graph import PiecewiseGraphRunner
from pagedllm.worker.sampling_batch import SamplingBatch
from pagedllm.worker.step_inputs import StepInputBuilder

logger = init_logger(__name__)


def alloc_zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeroed KV memory. On the CPU through numpy's calloc, so pages are only touched when written (a 4 GiB
    cache then costs nothing at start-up); unwritten slots must read as zeros, not garbage, because masked
    attention still multiplies them by zero probabilities."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    np_dtype = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[itemsize]
    return torch.from_numpy(np.zeros(shape, dtype=np_dtype)).view(dtype)


class ModelRunnerSetupMixin:
    """Needs the `ModelRunner` state below (set by `ModelRunner.__init__`); sets the model, its attention
    layers, KV caches, batch and graphs."""

    config: EngineConfig
    device: torch.device
    model_config: ModelConfig
    block_size: int
    max_model_len: int
    max_num_reqs: int
    max_num_tokens: int
    dtype: torch.dtype
    model: Any
    attn_layers: dict[str, Attention]
    kv_cache_config: KVCacheConfig | None
    kv_caches: dict[str, torch.Tensor]
    builders: list[AttentionMetadataBuilder]
    cuda_graphs: CudaGraphRunner | None
    verify_graphs: CudaGraphRunner | None
    mixed_graphs: MixedGraphRunner | None
    piecewise: PiecewiseGraphRunner | None
    _arange: np.ndarray
    input_batch: InputBatch | None
    updater: BatchUpdater | None
    inputs: StepInputBuilder | None
    sampling: SamplingBatch | None
    spec: Any
    lora: Any
    pp: Any
    mm: Any

    @property
    def backend(self) -> type[AttentionBackend]:
        return next(iter(self.attn_layers.values())).backend

    # ---- set-up --------------------------------------------------------------------------------
    def load_model(self) -> None:
        from pagedllm.model_executor.model_loader.loader import load_model

        t0 = time.perf_counter()
        self.model = load_model(self.model_config, self.config.load_config.load_format, self.device)
        self.model.eval()
        if self.device.type == "cpu":
            with torch.no_grad():
                n_packed = self.pack_cpu_weights()
            if n_packed:
                logger.info("Packed %d linear weights for oneDNN", n_packed)
        self.attn_layers = {m.layer_name: m for m in self.model.modules() if isinstance(m, Attention)}
        if self.config.parallel_config.pipeline_parallel_size > 1:
            from pagedllm.distributed.pipeline import PipelineStage

            if not getattr(self.model, "supports_pp", False):
                raise ValueError(
                    f"pipeline_parallel_size: {type(self.model).__name__} does not support pipeline parallelism"
                )
            self.pp = PipelineStage(self.model_config.hf_config.hidden_size, self.dtype, self.device)
        if getattr(self.model, "mm_spec", None) is not None:
            from pagedllm.multimodal.runner import MultiModalRunner

            self.mm = MultiModalRunner(self.model, self.device)
        if self.pp is not None and self.mm is not None:
            raise ValueError("pipeline_parallel_size: multimodal models do not support pipeline parallelism yet")
        if self.config.lora_config is not None:
            from pagedllm.lora.manager import LoRAManager

            self.lora = LoRAManager(
                self.model, self.config.lora_config, self.max_num_reqs, self.max_num_tokens, self.device
            )
        apply_cuda_rewrites(
            self.model, self.config, self.device, self.dtype, self.max_num_tokens, self.lora is not None
        )
        logger.info("Model loaded in %.2f s (%d attention layers)", time.perf_counter() - t0, len(self.attn_layers))
        if self.config.speculative_config is not None:
            from pagedllm.spec_decode.runner import SpecDecodeRunner

            self.spec = SpecDecodeRunner(self.config.speculative_config, self)

    def pack_cpu_weights(self) -> int:
        """CPU: prepack the linear weights for oneDNN (`model_loader/cpu_packing.py`); returns how many."""
        from pagedllm.model_executor.model_loader.cpu_packing import pack_cpu_weights

        return pack_cpu_weights(self.model)

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        from pagedllm.attention.kv_quant import resolve_kv_cache_dtype

        kv_dtype = resolve_kv_cache_dtype(self.config.cache_config.cache_dtype, self.dtype)
        return {
            name: KVCacheSpec(self.block_size, layer.num_kv_heads, layer.head_size, kv_dtype, layer.sliding_window)
            for name, layer in self.attn_layers.items()
            if layer.attn_type == "decoder"
        }

    def bytes_per_block(self) -> int:
        """KV bytes one block id costs across all layers (every layer's tensor has every block id)."""
        extra = self.spec.bytes_per_block() if self.spec is not None else 0
        return sum(s.page_size_bytes for s in self.get_kv_cache_specs().values()) + extra

    def profile_run(self) -> None:
        """One forward over max_num_batched_tokens dummy tokens spread over up to max_num_seqs requests, with
        every request's logits (no KV cache, no attention kernel), for the peak memory, as vLLM's profile run
        (and for a vision-language model, first its encoder over a step's worth of dummy images)."""
        assert self.model is not None
        if self.mm is not None:
            self.mm.profile(self.max_num_tokens)
        n = min(self.max_num_tokens, self.max_num_reqs * self.max_model_len)  # (so no request exceeds max_model_len)
        reqs = min(n, self.max_num_reqs)
        warmup.profile_forward(self.model, self.backend, list(self.attn_layers), n, reqs, self.block_size, self.device)

    def initialize_kv_cache(self, num_blocks: int) -> KVCacheConfig:
        specs = self.get_kv_cache_specs()
        groups = group_layers_by_spec(specs)
        self.kv_cache_config = KVCacheConfig(num_blocks, groups)
        for name, spec in specs.items():
            layer = self.attn_layers[name]
            shape = layer.backend.get_kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
            self.kv_caches[name] = layer.kv_cache = alloc_zeroed(shape, spec.dtype, self.device)
        self.builders = [
            self.backend.get_builder_cls()(g.spec.block_size, g.spec.sliding_window, self.device) for g in groups
        ]
        max_blocks = cdiv(self.max_model_len, self.block_size)
        batch = InputBatch(
            self.max_num_reqs, self.max_model_len, max_blocks, len(groups), self.model_config.vocab_size, self.device
        )
        self.input_batch = batch
        self.updater = BatchUpdater(batch, self.device)
        self.inputs = StepInputBuilder(batch, self._arange)
        self.sampling = SamplingBatch(batch, self.device)
        if self.spec is not None:
            self.spec.initialize_kv_cache(num_blocks, alloc_zeroed)
        return self.kv_cache_config

    def run_dummy_batches(self) -> torch.Tensor | None:
        """The warm-up forwards (any device; nothing written to the KV cache): the last batch's logits."""
        if not self.attn_layers or self.kv_cache_config is None or not self.kv_cache_config.groups:
            return None
        assert self.model is not None
        groups = self.kv_cache_config.groups
        return warmup.run_dummy_batches(
            self.model, groups, self.builders, self.max_num_reqs, self.max_num_tokens, self.max_model_len, self.device
        )

    def warm_up_kernels(self) -> None:
        """Compiles the attention and sampling launch variants at start-up (GPU only)."""
        if self.device.type == "cuda" and self.pp is None:  # (pipeline stages: compiled on first use)
            t0 = time.perf_counter()
            logits = self.run_dummy_batches()
            assert self.model is not None
            warmup.warm_up_kernels(logits, self.device, t0, self.model, self.max_num_tokens)

    def capture_cuda_graphs(self) -> None:
        """Pure-decode CUDA graphs: GPU only, not with enforce_eager, and only with a backend that supports them."""
        if self.device.type != "cuda" or self.config.enforce_eager or not self.attn_layers:
            return
        if self.pp is not None:  # a stage's graph would have to carry the intermediate tensors in and out
            logger.info("CUDA graphs off: pipeline parallelism runs eagerly for now")
            return
        if not self.backend.supports_cuda_graphs:
            logger.info("CUDA graphs off: attention backend %s cannot be captured", self.backend.name)
            return
        assert self.kv_cache_config is not None and self.model is not None
        max_blocks = cdiv(self.max_model_len, self.block_size)
        groups = self.kv_cache_config.groups
        self.cuda_graphs = CudaGraphRunner(
            self.model, groups, self.builders, self.max_num_reqs, max_blocks, self.max_model_len, self.device
        )
        self.cuda_graphs.capture()
        if self.spec is not None and self.lora is None:  # (LoRA's per-token slots follow the flat rows)
            from pagedllm.spec_decode.fused_graph import extra_words

            steps = self.spec.async_steps
            self.verify_graphs = CudaGraphRunner(
                self.model, groups, self.builders, self.max_num_reqs, max_blocks, self.max_model_len, self.device,
                query_len=self.spec.k + 1, pool=self.cuda_graphs.pool,
                extra=extra_words(self.max_num_reqs) if steps is not None else 0,
            )  # fmt: skip
            self.verify_graphs.capture()
            self.spec.capture_graphs(self)
        self.mixed_graphs, self.piecewise = capture_mixed_step_graphs(self)  # prefill and mixed steps, where they apply
