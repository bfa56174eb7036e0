"""A worker owns one device: sets it up, holds the model runner, sizes and allocates the KV cache."""

from __future__ import annotations

import gc

import torch

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_utils import KVCacheConfig, KVCacheSpec
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.logger import init_logger
from pagedllm.model_executor.layers import batch_invariant
from pagedllm.sample.logits_processor import LogitsProcessor
from pagedllm.worker import compile_log
from pagedllm.worker.async_output import PendingStep
from pagedllm.worker.model_runner import ModelRunner

logger = init_logger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30
"""KV cache on the CPU when `kv_cache_memory_bytes` is not given (vLLM's CPU default is 4 GiB too)."""


class Worker:
    def __init__(self, config: EngineConfig, logits_processors: list[LogitsProcessor] | None = None) -> None:
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type == "cpu":
            threads = envs.PAGEDLLM_CPU_THREADS
            if threads:
                torch.set_num_threads(threads)
        else:
            torch.cuda.set_device(self.device)
            compile_log.install()
            self._non_torch_at_start = self._check_free_memory()
        if config.model_config.seed is not None:
            torch.manual_seed(config.model_config.seed)
        batch_invariant.set_enabled(bool(config.extra.get("batch_invariant")))
        runner_cls = ModelRunner
        if config.model_config.runner_type == "pooling":  # pooling models: hidden states to the pooler
            if config.parallel_config.pipeline_parallel_size > 1:
                raise ValueError("pipeline_parallel_size: pooling models run as one pipeline stage")
            from pagedllm.pooling.runner import PoolingModelRunner

            runner_cls = PoolingModelRunner
        self.model_runner = runner_cls(config, self.device, logits_processors)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return self.model_runner.get_kv_cache_specs()

    def determine_num_blocks(self) -> int:
        cc = self.config.cache_config
        per_block = self.model_runner.bytes_per_block()
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        elif self.device.type == "cpu":
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        else:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.model_runner.profile_run()
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            peak = torch.cuda.max_memory_allocated()
            non_torch_increase = max(0, total - free - torch.cuda.memory_reserved() - self._non_torch_at_start)
            budget = int(total * cc.gpu_memory_utilization) - peak - non_torch_increase
            logger.info(
                "Profiling: peak torch memory %.2f GiB, non-torch memory +%.2f GiB since start, KV budget %.2f GiB",
                peak / 2**30,
                non_torch_increase / 2**30,
                budget / 2**30,
            )
            torch.cuda.empty_cache()
        return max(int(budget // per_block), 0)

    def _check_free_memory(self) -> int:
        """At start-up, as vLLM: the engine may use `gpu_memory_utilization` of the device's whole memory, and the
        memory outside PyTorch's allocator that exists now (this process's CUDA context) is not charged to the KV
        cache later, only what is added after (NCCL, cuBLAS and Triton workspaces). Returns that non-PyTorch memory.
        Where less than that share is free now (vLLM refuses to start there), every byte outside PyTorch stays
        charged, as before: returns 0, with a warning."""
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        cc = self.config.cache_config
        if free < cc.gpu_memory_utilization * total:
            if cc.kv_cache_memory_bytes is None and cc.num_gpu_blocks_override is None:
                logger.warning(
                    "gpu_memory_utilization %.2f asks for %.2f GiB but only %.2f GiB of device memory is free "
                    "(other processes or engines); the KV cache gets what is left after them",
                    cc.gpu_memory_utilization,
                    cc.gpu_memory_utilization * total / 2**30,
                    free / 2**30,
                )
            return 0
        return total - free - torch.cuda.memory_reserved()

    def initialize_kv_cache(self, num_blocks: int) -> KVCacheConfig:
        kv_config = self.model_runner.initialize_kv_cache(num_blocks)
        self.model_runner.warm_up_kernels()
        self.model_runner.capture_cuda_graphs()
        if self.config.cache_config.calculate_kv_scales:  # after the warm-up: the first real batch sets them
            from pagedllm.attention.kv_scales import arm_scale_calculation

            arm_scale_calculation(self.model_runner.model)
        compile_log.set_phase("serving")
        return kv_config

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput, defer_grammar: bool = False) -> PendingStep:
        return self.model_runner.execute_model_async(scheduler_output, defer_grammar)

    def complete_launch(self) -> None:
        self.model_runner.complete_launch()

    def finish_step(self, step: PendingStep) -> ModelRunnerOutput:
        return self.model_runner.finish_step(step)
