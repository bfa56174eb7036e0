"""Resolved engine configuration: what the engine runs with after `EngineArgs` defaults are applied.

`EngineArgs` (engine/arg_utils.py) is the one user-facing definition; it builds these objects.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from pagedllm import envs
from pagedllm.platforms import current_platform
from pagedllm.transformers_utils.config import (
    get_hf_config,
    get_max_model_len_from_config,
    get_sliding_window,
    load_generation_config,
    resolve_model_path,
)

_STR_DTYPE = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}

LoadFormat = Literal["auto", "safetensors", "pt", "gguf", "dummy"]


@dataclass
class ModelConfig:
    model: str
    tokenizer: str
    tokenizer_mode: str
    skip_tokenizer_init: bool
    dtype: torch.dtype
    seed: int | None
    max_model_len: int
    revision: str | None
    hf_config: Any
    gguf_file: str | None
    """Absolute path of the .gguf file when the model is one, else None."""
    model_dir: str
    """Local directory holding the weights (or the .gguf file)."""
    generation_config_mode: str
    generation_defaults: dict[str, Any]
    max_logprobs: int
    sliding_window: int | None
    quantization: str | None = None
    """'gguf' when a .gguf model's weights stay packed (the default; `gguf_dequantize=True` turns it off);
    'fp8' / 'compressed-tensors' / 'awq' / 'gptq' (model_executor/layers/quantization/), from the argument or
    the checkpoint's `quantization_config`."""
    logprobs_mode: str = "raw_logprobs"
    """What logprobs report: raw_logprobs | raw_logits (the model's) | processed_logprobs |
    processed_logits (after penalties, processors, temperature, top-k/top-p), as vLLM."""
    runner_type: str = "generate"
    """'generate' or 'pooling' (resolved by `pagedllm.pooling.config.resolve_pooling`)."""
    pooling: Any = None
    """A pooling model's `PoolingSetup` (tasks, pooler config, encoder-only); None for generation."""

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self.hf_config, "architectures", None) or ["LlamaForCausalLM"])

    @property
    def text_config(self) -> Any:
        """The language model's config (a vision-language model's `text_config`; else hf_config itself)."""
        return text_config_of(self.hf_config)

    @property
    def vocab_size(self) -> int:
        return int(self.text_config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        tc = self.text_config
        return int(getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads)

    @property
    def head_dim(self) -> int:
        tc = self.text_config
        return int(getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads)

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.generation_defaults.get("eos_token_id", getattr(self.hf_config, "eos_token_id", None))
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """Sampling defaults from generation_config.json, as vLLM applies them (only when "auto")."""
        if self.generation_config_mode == "vllm":
            return {}
        names = {
            "temperature": "temperature",
            "top_p": "top_p",
            "top_k": "top_k",
            "min_p": "min_p",
            "repetition_penalty": "repetition_penalty",
            "max_new_tokens": "max_tokens",
        }
        return {
            ours: self.generation_defaults[hf]
            for hf, ours in names.items()
            if self.generation_defaults.get(hf) is not None
        }


@dataclass
class CacheConfig:
    block_size: int
    enable_prefix_caching: bool
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None
    num_gpu_blocks_override: int | None
    cache_dtype: str = "auto"
    """'auto' (the model's dtype) or 'fp8' / 'fp8_e4m3' / 'fp8_e5m2' (attention/kv_quant.py)."""
    calculate_kv_scales: bool = False
    num_blocks: int = 0
    """Filled in by the engine once the worker has sized the KV cache."""


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    policy: Literal["fcfs", "priority"]
    async_scheduling: bool = False
    num_speculative_tokens: int = 0
    spec_disable_by_batch_size: int | None = None
    """speculative_config.disable_by_batch_size (the scheduler applies it under async scheduling)."""
    """Speculative decoding on (> 0): the scheduler schedules the runner's proposals with each decode."""
    """Schedule and prepare step N+1 while step N runs on the device (see EngineCore.step_async)."""
    max_loras: int = 0
    """Most distinct LoRA adapters in one step (0: LoRA off)."""
    disable_chunked_mm_input: bool = False
    """With chunked prefill: never schedule part of an image (vLLM's name); forced on for models whose image
    tokens attend to each other (`requires_whole_mm_items`, e.g. Gemma 3)."""
    idle_max_num_batched_tokens: int | None = None
    """Token budget of a step in which no running request is decoding (only prompts are being prefilled); None:
    max_num_batched_tokens. The small CPU budget is there for concurrent decodes' inter-token latency, which
    no such step has: a long prompt alone then goes in fewer, bigger chunks (see `Scheduler.step_budget`)."""
    schedule_conservativeness: float = 1.0
    """Scale of the KV room admission keeps for the running requests' next outputs (core/admission.py); 0: none."""

    @property
    def max_step_tokens(self) -> int:
        """The most tokens one step may hold (what the model runner sizes its buffers for)."""
        return max(self.max_num_batched_tokens, self.idle_max_num_batched_tokens or 0)


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    """'uni' (the worker in the engine core's process), 'mp' (one worker process per device) or 'ray';
    None: 'uni' for one device, else 'mp' (as vLLM)."""
    rank: int = 0
    data_parallel_size: int = 1
    """Engine cores behind one front end (AsyncLLM / the server), each with world_size workers."""
    data_parallel_rank: int = 0

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def backend(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"


@dataclass
class LoadConfig:
    load_format: LoadFormat = "auto"


@dataclass
class LoRAConfig:
    max_loras: int = 1
    """Adapter slots on the device: the most distinct adapters in one step."""
    max_lora_rank: int = 16
    max_cpu_loras: int = 1
    """Adapters kept read on the host (least recently used dropped first)."""


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    load_config: LoadConfig
    device: str
    enforce_eager: bool
    extra: dict[str, Any] = field(default_factory=dict)
    speculative_config: Any = None
    """A `spec_decode.SpeculativeConfig`, or None (speculation off)."""
    lora_config: LoRAConfig | None = None
    """Multi-LoRA serving (None: off, the model is not wrapped)."""
    structured_outputs_config: Any = None
    """A `structured_output.StructuredOutputsConfig` (None: the defaults)."""
    multimodal_config: Any = None
    """A `multimodal.config.MultiModalConfig` (limits, processor kwargs, allowed media sources)."""


def text_config_of(hf_config: Any) -> Any:
    sub = getattr(hf_config, "text_config", None)
    return sub if sub is not None else hf_config


def resolve_dtype(
    dtype: str | torch.dtype, hf_config: Any, device: str, quantization: str | None = None
) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device == "cpu":
            if quantization == "gguf":
                # Packed GGUF weights are dotted in integers whatever the activations' dtype, so bf16 saves
                # nothing there, and only float32 runs the one-call decode stack (csrc/decode_stack.c): on a
                # Zen 4, single-stream SmolLM2 Q4_1 decodes at 112-128 tok/s in float32 against 54-64 in bf16.
                return torch.float32
            # As vLLM's CPU backend: bf16 only where the CPU computes it natively.
            return torch.bfloat16 if current_platform.cpu_has_native_bf16() else torch.float32
        cfg = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(cfg, str):
            cfg = _STR_DTYPE.get(cfg)
        if cfg in (torch.float16, torch.bfloat16):
            return cfg
        return torch.bfloat16
    if dtype not in _STR_DTYPE:
        raise ValueError(f"dtype: unknown value {dtype!r}; expected one of auto, {', '.join(_STR_DTYPE)}")
    return _STR_DTYPE[dtype]


def resolve_kv_cache_dtype_name(kv_cache_dtype: str, mc: ModelConfig, device: str) -> str:
    """The cache dtype in force ('auto' made concrete where it is not the model's dtype); ValueError naming
    `kv_cache_dtype` for a 16/32-bit cache the device's kernels cannot read.

    'auto' under a packed GGUF on a CPU with native bfloat16 is 'bfloat16' (llama.cpp's default cache is 16-bit
    too): the float32 activations stay, the cache is half the bytes, and the prefill attention's products run
    in bfloat16 (`csrc/prefill_attn_dot.c`): SmolLM2 Q4_1's 8,000-token prefill 26 -> 18 s, decode as fast or
    faster, greedy outputs of the issue's 20 prompts unchanged. 'float32' keeps a float32 cache there."""
    if kv_cache_dtype == "auto":
        packed_gguf_cpu = device == "cpu" and mc.quantization == "gguf" and mc.dtype == torch.float32
        return "bfloat16" if packed_gguf_cpu and current_platform.cpu_has_native_bf16() else "auto"
    if kv_cache_dtype in ("bfloat16", "float32"):
        model = str(mc.dtype).removeprefix("torch.")
        if kv_cache_dtype == "float32" and mc.dtype != torch.float32:
            raise ValueError(f"kv_cache_dtype: 'float32' needs a float32 model (this one runs in {model})")
        if kv_cache_dtype == "bfloat16" and mc.dtype != torch.bfloat16 and device != "cpu":
            raise ValueError(
                f"kv_cache_dtype: 'bfloat16' under a {model} model runs on the CPU only "
                "(the GPU attention kernels take the model's dtype or FP8)"
            )
    return kv_cache_dtype


def build_model_config(
    *,
    model: str,
    tokenizer: str | None,
    tokenizer_mode: str,
    skip_tokenizer_init: bool,
    dtype: str,
    seed: int | None,
    max_model_len: int | None,
    revision: str | None,
    hf_overrides: dict[str, Any] | None,
    generation_config: str,
    max_logprobs: int,
    device: str,
    load_format: str,
    logprobs_mode: str = "raw_logprobs",
    quantization: str | None = None,
    gguf_dequantize: bool = False,
) -> ModelConfig:
    model_dir, gguf_file = resolve_model_path(model, revision)
    hf_config = get_hf_config(model_dir, gguf_file)
    for k, v in (hf_overrides or {}).items():
        setattr(hf_config, k, v)
    text_config = text_config_of(hf_config)
    quantization = resolve_quantization(quantization, gguf_dequantize, gguf_file, hf_config)
    derived = get_max_model_len_from_config(text_config)
    if max_model_len is None:
        max_model_len = derived
    elif max_model_len <= 0:
        raise ValueError(f"max_model_len: must be positive, got {max_model_len}")
    elif max_model_len > derived and not envs.PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN:
        raise ValueError(
            f"max_model_len: {max_model_len} exceeds the model's maximum length {derived} "
            "(max_position_embeddings); set PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to override."
        )
    if generation_config not in ("auto", "vllm") and not os.path.isdir(generation_config):
        raise ValueError(f"generation_config: expected 'auto', 'vllm' or a directory, got {generation_config!r}")
    gen_dir = model_dir if generation_config in ("auto", "vllm") else generation_config
    hf_config.pagedllm_max_model_len = int(max_model_len)  # longrope picks its factors from it (as vLLM)
    text_config.pagedllm_max_model_len = int(max_model_len)
    return ModelConfig(
        model=model,
        tokenizer=tokenizer or model,
        tokenizer_mode=tokenizer_mode,
        skip_tokenizer_init=skip_tokenizer_init,
        dtype=resolve_dtype(dtype, hf_config, device, quantization),
        seed=seed,
        max_model_len=int(max_model_len),
        revision=revision,
        hf_config=hf_config,
        gguf_file=gguf_file,
        model_dir=model_dir,
        generation_config_mode=generation_config,
        generation_defaults=load_generation_config(gen_dir, hf_config),
        max_logprobs=max_logprobs,
        sliding_window=get_sliding_window(text_config),
        logprobs_mode=logprobs_mode,
        quantization=quantization,
    )


def resolve_quantization(
    quantization: str | None, gguf_dequantize: bool, gguf_file: str | None, hf_config: Any = None
) -> str | None:
    """The quantization method in force: a .gguf model runs packed ('gguf') unless `gguf_dequantize`;
    otherwise the argument or the checkpoint's `quantization_config` (validated here, at start-up)."""
    from pagedllm.model_executor.layers.quantization.base import (
        QUANTIZATION_METHODS,
        canonical_method,
        get_quantization_config,
    )

    if quantization is not None:
        quantization = canonical_method(quantization)
        if quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization: unsupported method {quantization!r}; expected one of {', '.join(QUANTIZATION_METHODS)}"
            )
    if gguf_file is None:
        if quantization == "gguf":
            raise ValueError("quantization: 'gguf' needs a .gguf model file")
        if gguf_dequantize:
            raise ValueError("gguf_dequantize: applies to .gguf models only")
        qc = get_quantization_config(quantization, hf_config)
        return qc.name if qc is not None else None
    if quantization == "fp8":  # the GGUF weights dequantized, then quantized online
        return "fp8"
    if quantization not in (None, "gguf"):
        raise ValueError(f"quantization: {quantization!r} does not apply to a .gguf model (use 'gguf' or 'fp8')")
    if gguf_dequantize:
        if quantization == "gguf":
            raise ValueError("quantization='gguf' keeps GGUF weights packed; it contradicts gguf_dequantize=True")
        return None
    return "gguf"
