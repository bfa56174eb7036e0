"""The fields of `EngineArgs` (engine/arg_utils.py): each argument's type, default and help text, from which
`LLM(**kwargs)` and the CLI flags both come."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pagedllm.platforms import current_platform


def _help(text: str, group: str = "Model") -> dict[str, str]:
    return {"help": text, "group": group}


@dataclass
class EngineArgsFields:
    """The engine's arguments as data: every field with its default and help (its group names the CLI section);
    `EngineArgs` adds their checks, the resulting `EngineConfig` and the CLI."""

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
    schedule_conservativeness: float = field(
        default=1.0,
        metadata=_help(
            "How much KV space admission keeps back for the running requests' growth (SGLang's name): "
            "the rest of their prompts and room for up to 256 outputs each (fewer where max_tokens ends "
            "sooner), times this. It saves recomputing the prefills of requests preempted soon after "
            "admission when the cache is full. 0: admit while the prompt fits (vLLM).",
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

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if current_platform.is_cuda() else "cpu"
        return self.device
