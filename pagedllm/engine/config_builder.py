"""`EngineArgs` -> `EngineConfig`: the model's config read and every default resolved for the device
(`EngineArgs.create_engine_config`)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

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
from pagedllm.engine.arg_checks import check_tp_divides, json_arg
from pagedllm.multimodal.config import MultiModalConfig, requires_whole_mm_items
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.transformers_utils.config import default_model_path

if TYPE_CHECKING:
    from pagedllm.engine.arg_fields import EngineArgsFields

CPU_MAX_NUM_BATCHED_TOKENS = 256
"""CPU default of the per-step token budget: a chunk of this size of a long prompt takes about a second on
two cores, so no step holds the others (or an abort) for longer (4096 took 32 s for one 4,000-token prompt)."""

CPU_IDLE_MAX_NUM_BATCHED_TOKENS = 1024
"""CPU default of the token budget of a step in which no request is decoding (`idle_max_num_batched_tokens`):
no decode's inter-token latency is at stake there, and a long prompt in chunks of 1,024 instead of 256 saves
a tenth to a sixth of its prefill (fewer steps' per-layer overhead; benchmarks/NOTES.md, session 32). A request that
arrives meanwhile waits for the current chunk: up to ~2 s on two cores, against ~0.5 s."""


def build_engine_config(args: EngineArgsFields) -> EngineConfig:
    """The `EngineConfig` of validated arguments: the model's config read, defaults resolved for the device."""
    spec = SpeculativeConfig.from_args(args.speculative_config, args.spec_method, args.spec_model, args.spec_tokens)
    from pagedllm.structured_output.config import StructuredOutputsConfig

    so_config = StructuredOutputsConfig.from_value(args.structured_outputs_config, args.reasoning_parser)
    if spec is not None and args.async_scheduling and spec.method != "ngram":
        raise ValueError(f"async_scheduling: not supported with speculative_config method {spec.method!r} (only ngram)")
    device = args.resolved_device()
    on_gpu = device.startswith("cuda")
    model = args.model or default_model_path()
    hf_overrides = args.hf_overrides
    if isinstance(hf_overrides, str):
        hf_overrides = json.loads(hf_overrides)
    mc = build_model_config(
        model=model,
        tokenizer=args.tokenizer,
        tokenizer_mode=args.tokenizer_mode,
        skip_tokenizer_init=args.skip_tokenizer_init,
        dtype=args.dtype,
        seed=args.seed,
        max_model_len=args.max_model_len,
        revision=args.revision,
        hf_overrides=hf_overrides,
        generation_config=args.generation_config,
        max_logprobs=args.max_logprobs,
        logprobs_mode=args.logprobs_mode,
        device=device,
        load_format=args.load_format,
        quantization=args.quantization,
        gguf_dequantize=args.gguf_dequantize,
    )
    check_tp_divides(mc.hf_config, args.tensor_parallel_size)
    max_num_seqs = args.max_num_seqs or (1024 if on_gpu else 256)
    max_batched = args.max_num_batched_tokens or (16384 if on_gpu else CPU_MAX_NUM_BATCHED_TOKENS)
    engine_overrides: dict[str, Any] = {}
    if args.runner != "generate":
        from pagedllm.pooling.config import apply_pooling

        engine_overrides = apply_pooling(args, mc, max_batched)
        max_batched = engine_overrides.pop("max_num_batched_tokens", max_batched)
    whole_mm = args.disable_chunked_mm_input or requires_whole_mm_items(mc.hf_config)
    if not args.enable_chunked_prefill and max_batched < mc.max_model_len:
        # Without chunking a whole prompt must fit one step.
        max_batched = mc.max_model_len
    idle_batched = idle_budget(args, on_gpu or bool(engine_overrides), max_batched)
    return EngineConfig(
        model_config=mc,
        cache_config=CacheConfig(
            block_size=args.block_size,
            enable_prefix_caching=engine_overrides.get("enable_prefix_caching", args.enable_prefix_caching),
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            num_gpu_blocks_override=engine_overrides.get("num_gpu_blocks_override", args.num_gpu_blocks_override),
            cache_dtype=resolve_kv_cache_dtype_name(args.kv_cache_dtype, mc, device),
            calculate_kv_scales=args.calculate_kv_scales,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_batched,
            max_model_len=mc.max_model_len,
            enable_chunked_prefill=engine_overrides.get("enable_chunked_prefill", args.enable_chunked_prefill),
            policy=args.scheduling_policy,
            async_scheduling=(spec is None or (spec.method == "ngram" and args.tensor_parallel_size == 1))
            and args.pipeline_parallel_size == 1
            and engine_overrides.get(
                "async_scheduling", on_gpu if args.async_scheduling is None else args.async_scheduling
            ),
            num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
            spec_disable_by_batch_size=spec.disable_by_batch_size if spec is not None else None,
            max_loras=args.max_loras if args.enable_lora else 0,
            disable_chunked_mm_input=whole_mm,
            idle_max_num_batched_tokens=idle_batched,
            schedule_conservativeness=args.schedule_conservativeness,
        ),
        parallel_config=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            distributed_executor_backend=args.distributed_executor_backend,
            data_parallel_size=args.data_parallel_size,
        ),
        load_config=LoadConfig(load_format=args.load_format),
        device=device,
        enforce_eager=args.enforce_eager,
        speculative_config=spec,
        extra={
            "enable_sleep_mode": args.enable_sleep_mode,
            "weight_transfer_config": args.weight_transfer_config,
            "profiler_config": args.profiler_config,
            "batch_invariant": args.batch_invariant,
        },
        lora_config=LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras or args.max_loras)
        if args.enable_lora
        else None,
        structured_outputs_config=so_config,
        multimodal_config=MultiModalConfig.from_args(
            json_arg(args.limit_mm_per_prompt, "limit_mm_per_prompt"),
            json_arg(args.mm_processor_kwargs, "mm_processor_kwargs"),
            args.allowed_local_media_path,
            args.allowed_media_domains,
            max_item_tokens=max_batched if whole_mm else None,
        ),
    )


def idle_budget(args: EngineArgsFields, one_budget: bool, max_batched: int) -> int | None:
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
