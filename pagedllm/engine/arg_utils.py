"""`EngineArgs`: the ONE definition of the engine's arguments. `LLM(**kwargs)` takes them, and the CLI
flags (`--kebab-case`, booleans also as `--no-...`) are generated from the same dataclass fields."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_type_hints

from pagedllm.config import (
    CacheConfig,
    EngineConfig,
    LoadConfig,
    LoRAConfig,
    ParallelConfig,
    SchedulerConfig,
    build_model_config,
    resolve_kv_cache_dtype_name,
)
from pagedllm.engine.arg_cli import add_dataclass_args
from pagedllm.multimodal.config import MultiModalConfig, requires_whole_mm_items
from pagedllm.platforms import current_platform
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.transformers_utils.config import default_model_path

CPU_MAX_NUM_BATCHED_TOKENS = 256
"""CPU default of the per-step token budget: a chunk of this size of a long prompt takes about a second on
two cores, so no step holds the others (or an abort) for longer (4096 took 32 s for one 4,000-token prompt)."""

CPU_IDLE_MAX_NUM_BATCHED_TOKENS = 1024
"""CPU default of the token budget of a step in which no request is decoding (`idle_max_num_batched_tokens`):
no decode's inter-token latency is at stake there, and a long prompt in chunks of 1,024 instead of 256 saves
a tenth to a sixth of its prefill (fewer steps' per-layer overhead; benchmarks/NOTES.md, session 32). A request that
arrives meanwhile waits for the current chunk: up to ~2 s on two cores, against ~0.5 s."""


def _help(text: str, group: str = "Model") -> dict[str, str]:
    return {"help": text, "group": group}


@dataclass
class EngineArgs:
    model: str | None = field(
        default=None,
        metadata=_help("Model directory, .gguf file or hub id. Default: the built-in SmolLM2-135M-Instruct."),
    )
    tokenizer: str | None = field(default=None, metadata=_help("Tokenizer path (default: the model's)."))
    tokenizer_mode: str = field(default="auto", metadata=_help("'auto', 'hf' or 'slow'."))
    skip_tokenizer_init: bool = field(
        default=False, metadata=_help("Do not load a tokenizer: prompts must be token ids and outputs carry no text.")
    )
    trust_remote_code: bool = field(default=False, metadata=_help("Not supported (must stay False)."))
    dtype: str = field(
        default="auto",
        metadata=_help(
            "auto | float32 | bfloat16 | float16. auto: the model's 16-bit dtype on GPU; on CPU bfloat16 "
            "where the CPU has native bf16 (AVX-512 BF16/AMX), else float32."
        ),
    )
    seed: int | None = field(default=0, metadata=_help("Global random seed."))
    max_model_len: int | None = field(
        default=None, metadata=_help("Maximum context length (prompt + output). Default: the model's.")
    )
    hf_overrides: dict[str, Any] | None = field(
        default=None, metadata=_help("JSON dict of HF config attributes to override.")
    )
    revision: str | None = field(default=None, metadata=_help("Hub revision."))
    generation_config: str = field(
        default="auto",
        metadata=_help(
            "'auto' (use the model's generation_config.json defaults), 'vllm' (ignore them) or a directory."
        ),
    )
    load_format: Literal["auto", "safetensors", "pt", "gguf", "dummy"] = field(
        default="auto", metadata=_help("Weight format; 'dummy' = random weights from the config (benchmarks).")
    )
    quantization: str | None = field(
        default=None,
        metadata=_help(
            "Quantization method of the weights (vLLM's names; default: the checkpoint's quantization_config): "
            "'fp8' (online: e4m3 weights with per-channel scales, per-token activations; or a vLLM fp8 "
            "checkpoint), 'compressed-tensors' (FP8/INT8 W8A8), 'awq', 'gptq' (int4), 'gguf' (GGUF blocks kept "
            "packed, the default for a .gguf model on the CPU: C kernels; on CUDA with "
            "PAGEDLLM_GGUF_CUDA_PACKED=1: Triton)."
        ),
    )
    gguf_dequantize: bool = field(
        default=False,
        metadata=_help("Dequantize a .gguf model's weights to dtype at load instead of keeping them packed."),
    )
    max_logprobs: int = field(
        default=20, metadata=_help("Largest logprobs / prompt_logprobs a request may ask for (-1: no limit).")
    )
    logprobs_mode: Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"] = field(
        default="raw_logprobs",
        metadata=_help(
            "What logprobs report: the model's raw logprobs/logits, or processed ones (after penalties, "
            "logits processors, temperature and top-k/top-p)."
        ),
    )
    runner: Literal["auto", "generate", "pooling"] = field(
        default="auto",
        metadata=_help("'generate', 'pooling' (embeddings, classification, scoring) or 'auto' (from the model)."),
    )
    convert: Literal["auto", "none", "embed", "classify"] = field(
        default="auto",
        metadata=_help("Run a decoder-only LM as a pooling model: 'embed' (last token) or 'classify'."),
    )
    pooler_config: dict[str, Any] | None = field(
        default=None,
        metadata=_help('Pooler overrides as JSON: {"pooling_type": "LAST|CLS|MEAN|ALL", "normalize": bool, ...}.'),
    )
    block_size: int = field(default=16, metadata=_help("Tokens per KV-cache block.", "Cache"))
    enable_prefix_caching: bool = field(default=True, metadata=_help("Reuse KV blocks of shared prefixes.", "Cache"))
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=_help("Fraction of GPU memory the engine may use (weights + activations + KV cache).", "Cache"),
    )
    kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata=_help("KV-cache size in bytes (overrides gpu_memory_utilization; CPU default 4 GiB).", "Cache"),
    )
    kv_cache_dtype: Literal["auto", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"] = field(
        default="auto",
        metadata=_help(
            "KV-cache storage: 'auto' (the model's dtype; bfloat16 for a packed GGUF on a CPU with native bf16), "
            "'bfloat16' (under a float32 model: half the bytes, CPU only), 'float32' (a float32 model's own) or "
            "FP8 ('fp8' = 'fp8_e4m3', 'fp8_e5m2'), with a K and a V scale per layer from the checkpoint (else 1.0, "
            "or see --calculate-kv-scales): twice the tokens.",
            "Cache",
        ),
    )
    calculate_kv_scales: bool = field(
        default=False,
        metadata=_help("FP8 KV cache: set each layer's k/v scales from the first batch (amax / FP8 max).", "Cache"),
    )
    num_gpu_blocks_override: int | None = field(
        default=None, metadata=_help("Force the number of KV-cache blocks (testing/preemption).", "Cache")
    )
    max_num_seqs: int | None = field(
        default=None, metadata=_help("Most requests in one step. Default: 1024 on GPU, 256 on CPU.", "Scheduler")
    )
    max_num_batched_tokens: int | None = field(
        default=None,
        metadata=_help(
            "Token budget per step. Default: 16384 on GPU, 256 on CPU (a chunk of a long prompt then takes "
            "about a second on two cores: other requests keep streaming, aborts land between chunks).",
            "Scheduler",
        ),
    )
    idle_max_num_batched_tokens: int | None = field(
        default=None,
        metadata=_help(
            "Token budget of a step in which no request is decoding (only prompts being prefilled): there is "
            "no inter-token latency to protect, so a long prompt goes in bigger chunks. Default: 1024 on CPU "
            "when max_num_batched_tokens is not given, else max_num_batched_tokens (no separate budget).",
            "Scheduler",
        ),
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata=_help("Split long prompts across steps to fit the token budget.", "Scheduler")
    )
    scheduling_policy: Literal["fcfs", "priority"] = field(
        default="fcfs",
        metadata=_help("'fcfs' or 'priority' (lower value first; preemption takes the lowest priority).", "Scheduler"),
    )
    async_scheduling: bool | None = field(
        default=None,
        metadata=_help(
            "Schedule and prepare the next step while the current one runs on the GPU (steps whose requests "
            "need the previous token on the host, e.g. penalties, run synchronously). Default: on for the GPU, "
            "off on the CPU (where nothing overlaps).",
            "Scheduler",
        ),
    )
    enforce_eager: bool = field(default=False, metadata=_help("Never use CUDA graphs.", "Device"))
    device: str = field(default="auto", metadata=_help("'auto', 'cpu' or 'cuda[:N]'.", "Device"))
    tensor_parallel_size: int = field(
        default=1, metadata=_help("Tensor-parallel workers (one process per device; gloo on the CPU).", "Parallel")
    )
    pipeline_parallel_size: int = field(
        default=1, metadata=_help("Pipeline stages (layer ranges, one worker process each per TP rank).", "Parallel")
    )
    data_parallel_size: int = field(
        default=1,
        metadata=_help(
            "Engine cores behind the API server (each its own process, scheduler and KV cache; requests go to "
            "the least loaded). `pagedllm serve` / AsyncLLM only.",
            "Parallel",
        ),
    )
    distributed_executor_backend: Literal["mp", "ray", "uni"] | None = field(
        default=None,
        metadata=_help(
            "'mp': one worker process per device; 'ray': workers as actors of a running Ray cluster (the "
            "'ray' extra); 'uni': the worker in the engine core's process (one device only). Default: 'uni' "
            "for one device, else 'mp'.",
            "Parallel",
        ),
    )
    served_model_name: list[str] | None = field(
        default=None, metadata=_help("Model name(s) the API answers to (default: the model argument).", "Frontend")
    )
    disable_log_stats: bool = field(default=False, metadata=_help("No periodic stats log line.", "Frontend"))
    enable_sleep_mode: bool = field(
        default=False,
        metadata=_help(
            "Allow sleep(level)/wake_up (and, with PAGEDLLM_SERVER_DEV_MODE=1, POST /sleep, /wake_up).", "Controls"
        ),
    )
    batch_invariant: bool = field(
        default=False,
        metadata=_help(
            "Batch-invariant mode (also PAGEDLLM_BATCH_INVARIANT=1): bitwise identical greedy/seeded outputs "
            "whatever the batch, prefix caching or chunking (fixed reduction orders; CPU only for now).",
            "Controls",
        ),
    )
    weight_transfer_config: dict[str, Any] | None = field(
        default=None,
        metadata=_help(
            'Weight updates from a trainer: {"backend": "nccl" | "gloo" | "checkpoint"} (default checkpoint).',
            "Controls",
        ),
    )
    profiler_config: dict[str, Any] | None = field(
        default=None,
        metadata=_help(
            'Profiling: {"profiler": "torch", "torch_profiler_dir": DIR} for start_profile / stop_profile.',
            "Controls",
        ),
    )

    speculative_config: dict[str, Any] | None = field(
        default=None,
        metadata=_help(
            'Speculative decoding, as vLLM: {"method": "ngram" | "draft_model" | "eagle" | "eagle3", '
            '"num_speculative_tokens": K, "model": PATH, "prompt_lookup_max": N, "prompt_lookup_min": N, '
            '"disable_by_batch_size": B}.',
            "Speculative decoding",
        ),
    )
    spec_method: str | None = field(
        default=None, metadata=_help("Alias of speculative_config.method.", "Speculative decoding")
    )
    spec_model: str | None = field(
        default=None, metadata=_help("Alias of speculative_config.model.", "Speculative decoding")
    )
    spec_tokens: int | None = field(
        default=None, metadata=_help("Alias of speculative_config.num_speculative_tokens.", "Speculative decoding")
    )
    reasoning_parser: str | None = field(
        default=None,
        metadata=_help(
            "Split <think>...</think> reasoning from the answer: deepseek_r1 | qwen3 (the server's "
            "reasoning_content; structured outputs apply after the reasoning).",
            "Structured outputs",
        ),
    )
    enable_lora: bool = field(
        default=False, metadata=_help("Serve LoRA adapters (LoRARequest / --lora-modules).", "LoRA")
    )
    max_loras: int = field(default=1, metadata=_help("Most distinct LoRA adapters in one step (device slots).", "LoRA"))
    max_lora_rank: int = field(default=16, metadata=_help("Largest LoRA rank served.", "LoRA"))
    max_cpu_loras: int | None = field(
        default=None, metadata=_help("LoRA adapters kept read on the host (default: max_loras).", "LoRA")
    )
    structured_outputs_config: dict[str, Any] | None = field(
        default=None,
        metadata=_help(
            'Structured outputs, as vLLM: {"backend": "auto" | "xgrammar", "disable_any_whitespace": bool, '
            '"disable_additional_properties": bool, "max_whitespace_count": N, "reasoning_parser": NAME, '
            '"enable_in_reasoning": bool}.',
            "Structured outputs",
        ),
    )

    limit_mm_per_prompt: dict[str, Any] | None = field(
        default=None,
        metadata=_help('Most images per prompt, e.g. {"image": 2} (default: no practical limit).', "Multimodal"),
    )
    mm_processor_kwargs: dict[str, Any] | None = field(
        default=None, metadata=_help("JSON dict passed to the model's HF processor call.", "Multimodal")
    )
    allowed_local_media_path: str = field(
        default="", metadata=_help("Directory whose files chat requests may name as file:// image URLs.", "Multimodal")
    )
    allowed_media_domains: list[str] | None = field(
        default=None, metadata=_help("Hosts http(s) image URLs may be fetched from (none: no fetching).", "Multimodal")
    )
    disable_chunked_mm_input: bool = field(
        default=False,
        metadata=_help(
            "With chunked prefill, never schedule part of an image: a chunk stops before it (always on for models "
            "whose image tokens attend to each other, e.g. Gemma 3).",
            "Multimodal",
        ),
    )

    # ---- validation and resolution -------------------------------------------------------------
    def _validate(self) -> None:
        if self.trust_remote_code:
            raise ValueError("trust_remote_code: only False is supported (pagedllm runs no model-repo code)")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"block_size: must be a power of two up to 256, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes: must be positive, got {self.kv_cache_memory_bytes}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(f"num_gpu_blocks_override: must be >= 2, got {self.num_gpu_blocks_override}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "idle_max_num_batched_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name}: must be positive, got {v}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs: must be -1 (no limit) or >= 0, got {self.max_logprobs}")
        modes = get_args(get_type_hints(EngineArgs)["logprobs_mode"])
        if self.logprobs_mode not in modes:
            raise ValueError(f"logprobs_mode: expected one of {', '.join(modes)}, got {self.logprobs_mode!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy: expected 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.load_format not in get_args(get_type_hints(EngineArgs)["load_format"]):
            raise ValueError(f"load_format: unknown value {self.load_format!r}")
        self._validate_parallel()
        if self.quantization not in (None, "gguf") and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError(
                f"quantization: {self.quantization!r} with tensor / pipeline parallelism is not supported yet"
            )
        kv_dtypes = get_args(get_type_hints(EngineArgs)["kv_cache_dtype"])
        if self.kv_cache_dtype not in kv_dtypes:
            raise ValueError(f"kv_cache_dtype: expected one of {', '.join(kv_dtypes)}, got {self.kv_cache_dtype!r}")
        if self.calculate_kv_scales and not self.kv_cache_dtype.startswith("fp8"):
            raise ValueError("calculate_kv_scales: needs an FP8 kv_cache_dtype ('fp8', 'fp8_e4m3' or 'fp8_e5m2')")
        if self.reasoning_parser is not None:
            from pagedllm.reasoning import get_reasoning_parser

            get_reasoning_parser(self.reasoning_parser)  # ValueError naming reasoning_parser
        self._validate_lora()
        self._validate_controls()

    def _validate_parallel(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        backends = get_args(get_args(get_type_hints(EngineArgs)["distributed_executor_backend"])[0])
        backend = self.distributed_executor_backend
        if backend is not None and backend not in backends:
            raise ValueError(f"distributed_executor_backend: expected one of {', '.join(backends)}, got {backend!r}")
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        if backend == "uni" and world != 1:
            raise ValueError(
                f"distributed_executor_backend: 'uni' runs one worker; tensor_parallel_size x "
                f"pipeline_parallel_size = {world} needs 'mp'"
            )
        if self.pipeline_parallel_size > 1 and self.async_scheduling:
            raise ValueError("async_scheduling: not supported with pipeline_parallel_size > 1 (leave it unset)")
        if world > 1:
            for name, on in (
                ("enable_lora", self.enable_lora),
                ("speculative_config", self.speculative_config or self.spec_method),
            ):
                if on:
                    raise ValueError(f"{name}: not supported with tensor or pipeline parallelism yet")

    def _validate_lora(self) -> None:
        if not self.enable_lora:
            return
        if self.max_loras < 1:
            raise ValueError(f"max_loras: must be >= 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank: must be in [1, 512], got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras: must be >= max_loras ({self.max_loras}), got {self.max_cpu_loras}")

    def _validate_controls(self) -> None:
        from pagedllm.distributed.weight_transfer import check_weight_transfer_config
        from pagedllm.model_executor.layers.batch_invariant import env_enabled as env_batch_invariant

        for name in ("weight_transfer_config", "profiler_config"):
            v = getattr(self, name)
            if isinstance(v, str):
                setattr(self, name, json.loads(v))
        check_weight_transfer_config(self.weight_transfer_config)
        if self.batch_invariant or env_batch_invariant():
            self.batch_invariant = True
            if self.resolved_device() not in ("cpu", "cuda"):
                raise ValueError(f"batch_invariant: supported on 'cpu' and 'cuda', not {self.resolved_device()!r}")
            if self.enable_lora and self.resolved_device() == "cuda":
                raise ValueError("batch_invariant: LoRA layers are not batch-invariant on the GPU (enable_lora)")
            if self.quantization not in (None, "gguf") and self.resolved_device() == "cuda":
                raise ValueError(
                    f"batch_invariant: quantized layers ({self.quantization}) are not batch-invariant on the GPU"
                )
        pc = self.profiler_config
        if pc is not None:
            if not isinstance(pc, dict):
                raise ValueError(f"profiler_config: expected a dict, got {pc!r}")
            if pc.get("profiler", "torch") != "torch":
                raise ValueError(f"profiler_config.profiler: only 'torch' is supported, got {pc.get('profiler')!r}")

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if current_platform.is_cuda() else "cpu"
        return self.device

    def create_engine_config(self) -> EngineConfig:
        self._validate()
        spec = SpeculativeConfig.from_args(self.speculative_config, self.spec_method, self.spec_model, self.spec_tokens)
        from pagedllm.structured_output.config import StructuredOutputsConfig

        so_config = StructuredOutputsConfig.from_value(self.structured_outputs_config, self.reasoning_parser)
        if spec is not None and self.async_scheduling and spec.method != "ngram":
            raise ValueError(
                f"async_scheduling: not supported with speculative_config method {spec.method!r} (only ngram)"
            )
        device = self.resolved_device()
        on_gpu = device.startswith("cuda")
        model = self.model or default_model_path()
        hf_overrides = self.hf_overrides
        if isinstance(hf_overrides, str):
            hf_overrides = json.loads(hf_overrides)
        mc = build_model_config(
            model=model,
            tokenizer=self.tokenizer,
            tokenizer_mode=self.tokenizer_mode,
            skip_tokenizer_init=self.skip_tokenizer_init,
            dtype=self.dtype,
            seed=self.seed,
            max_model_len=self.max_model_len,
            revision=self.revision,
            hf_overrides=hf_overrides,
            generation_config=self.generation_config,
            max_logprobs=self.max_logprobs,
            logprobs_mode=self.logprobs_mode,
            device=device,
            load_format=self.load_format,
            quantization=self.quantization,
            gguf_dequantize=self.gguf_dequantize,
        )
        _check_tp_divides(mc.hf_config, self.tensor_parallel_size)
        max_num_seqs = self.max_num_seqs or (1024 if on_gpu else 256)
        max_batched = self.max_num_batched_tokens or (16384 if on_gpu else CPU_MAX_NUM_BATCHED_TOKENS)
        engine_overrides: dict[str, Any] = {}
        if self.runner != "generate":
            from pagedllm.pooling.config import apply_pooling

            engine_overrides = apply_pooling(self, mc, max_batched)
            max_batched = engine_overrides.pop("max_num_batched_tokens", max_batched)
        whole_mm = self.disable_chunked_mm_input or requires_whole_mm_items(mc.hf_config)
        if not self.enable_chunked_prefill and max_batched < mc.max_model_len:
            # Without chunking a whole prompt must fit one step.
            max_batched = mc.max_model_len
        idle_batched = _idle_budget(self, on_gpu or bool(engine_overrides), max_batched)
        return EngineConfig(
            model_config=mc,
            cache_config=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=engine_overrides.get("enable_prefix_caching", self.enable_prefix_caching),
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                num_gpu_blocks_override=engine_overrides.get("num_gpu_blocks_override", self.num_gpu_blocks_override),
                cache_dtype=resolve_kv_cache_dtype_name(self.kv_cache_dtype, mc, device),
                calculate_kv_scales=self.calculate_kv_scales,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_batched,
                max_model_len=mc.max_model_len,
                enable_chunked_prefill=engine_overrides.get("enable_chunked_prefill", self.enable_chunked_prefill),
                policy=self.scheduling_policy,
                async_scheduling=(spec is None or (spec.method == "ngram" and self.tensor_parallel_size == 1))
                and self.pipeline_parallel_size == 1
                and engine_overrides.get(
                    "async_scheduling", on_gpu if self.async_scheduling is None else self.async_scheduling
                ),
                num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
                spec_disable_by_batch_size=spec.disable_by_batch_size if spec is not None else None,
                max_loras=self.max_loras if self.enable_lora else 0,
                disable_chunked_mm_input=whole_mm,
                idle_max_num_batched_tokens=idle_batched,
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                pipeline_parallel_size=self.pipeline_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,
                data_parallel_size=self.data_parallel_size,
            ),
            load_config=LoadConfig(load_format=self.load_format),
            device=device,
            enforce_eager=self.enforce_eager,
            speculative_config=spec,
            extra={
                "enable_sleep_mode": self.enable_sleep_mode,
                "weight_transfer_config": self.weight_transfer_config,
                "profiler_config": self.profiler_config,
                "batch_invariant": self.batch_invariant,
            },
            lora_config=LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras or self.max_loras)
            if self.enable_lora
            else None,
            structured_outputs_config=so_config,
            multimodal_config=MultiModalConfig.from_args(
                _json(self.limit_mm_per_prompt, "limit_mm_per_prompt"),
                _json(self.mm_processor_kwargs, "mm_processor_kwargs"),
                self.allowed_local_media_path,
                self.allowed_media_domains,
                max_item_tokens=max_batched if whole_mm else None,
            ),
        )

    # ---- CLI -----------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, positional_model: bool = False) -> argparse.ArgumentParser:
        """One `--kebab-case` flag per field, grouped by the field's group."""
        return add_dataclass_args(EngineArgs, parser, skip=("model",) if positional_model else ())

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}


def _idle_budget(args: EngineArgs, one_budget: bool, max_batched: int) -> int | None:
    """`SchedulerConfig.idle_max_num_batched_tokens`: the user's value (at least the step budget), else the CPU
    default where the step budget is the CPU default too; None (no separate budget) otherwise, so that an
    explicit max_num_batched_tokens, the GPU and pooling models (`one_budget`) and whole-prompt steps keep one
    budget."""
    if not args.enable_chunked_prefill:  # the step budget is max_model_len: whole prompts already
        return None
    if args.idle_max_num_batched_tokens is not None:
        if args.idle_max_num_batched_tokens < max_batched:
            raise ValueError(
                f"idle_max_num_batched_tokens: must be at least max_num_batched_tokens ({max_batched}), "
                f"got {args.idle_max_num_batched_tokens}"
            )
        return args.idle_max_num_batched_tokens
    if one_budget or args.max_num_batched_tokens is not None:
        return None
    return CPU_IDLE_MAX_NUM_BATCHED_TOKENS


def _check_tp_divides(hf_config: Any, tp: int) -> None:
    """The shapes tensor parallelism splits must divide by tp (KV heads may instead be replicated)."""
    if tp == 1:
        return
    heads = getattr(hf_config, "num_attention_heads", None)
    if heads is not None and heads % tp:
        raise ValueError(f"tensor_parallel_size: {tp} does not divide the model's {heads} attention heads")
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    if kv is not None and kv % tp and tp % kv:
        raise ValueError(f"tensor_parallel_size: {tp} and the model's {kv} KV heads: neither divides the other")
    inter = getattr(hf_config, "intermediate_size", None)
    if isinstance(inter, int) and inter % tp:
        raise ValueError(f"tensor_parallel_size: {tp} does not divide the model's intermediate_size {inter}")


def _json(value: Any, name: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise ValueError(f"{name}: not valid JSON ({value[:64]!r})") from None
    return value
