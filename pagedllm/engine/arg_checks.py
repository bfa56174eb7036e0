"""The checks of the engine's arguments (`EngineArgs._validate`): each failure a ValueError that names the
argument, raised before anything loads."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, get_args, get_type_hints

if TYPE_CHECKING:
    from pagedllm.engine.arg_fields import EngineArgsFields


def validate(args: EngineArgsFields) -> None:
    """Every argument's check: a ValueError naming the argument (`EngineArgs._validate`); fills JSON-string
    `weight_transfer_config` / `profiler_config` in as dicts and `batch_invariant` from the environment."""
    hints = get_type_hints(type(args))  # (the Literal fields' allowed values)
    if args.trust_remote_code:
        raise ValueError("trust_remote_code: only False is supported (pagedllm runs no model-repo code)")
    if args.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        raise ValueError(f"block_size: must be a power of two up to 256, got {args.block_size}")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.kv_cache_memory_bytes is not None and args.kv_cache_memory_bytes <= 0:
        raise ValueError(f"kv_cache_memory_bytes: must be positive, got {args.kv_cache_memory_bytes}")
    if args.num_gpu_blocks_override is not None and args.num_gpu_blocks_override < 2:
        raise ValueError(f"num_gpu_blocks_override: must be >= 2, got {args.num_gpu_blocks_override}")
    for name in ("max_num_seqs", "max_num_batched_tokens", "idle_max_num_batched_tokens"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"{name}: must be positive, got {v}")
    if not args.schedule_conservativeness >= 0:
        raise ValueError(f"schedule_conservativeness: must be >= 0, got {args.schedule_conservativeness}")
    if args.max_logprobs < -1:
        raise ValueError(f"max_logprobs: must be -1 (no limit) or >= 0, got {args.max_logprobs}")
    modes = get_args(hints["logprobs_mode"])
    if args.logprobs_mode not in modes:
        raise ValueError(f"logprobs_mode: expected one of {', '.join(modes)}, got {args.logprobs_mode!r}")
    if args.scheduling_policy not in ("fcfs", "priority"):
        raise ValueError(f"scheduling_policy: expected 'fcfs' or 'priority', got {args.scheduling_policy!r}")
    if args.load_format not in get_args(hints["load_format"]):
        raise ValueError(f"load_format: unknown value {args.load_format!r}")
    _validate_parallel(args, hints)
    if args.quantization not in (None, "gguf") and args.tensor_parallel_size * args.pipeline_parallel_size > 1:
        raise ValueError(f"quantization: {args.quantization!r} with tensor / pipeline parallelism is not supported yet")
    kv_dtypes = get_args(hints["kv_cache_dtype"])
    if args.kv_cache_dtype not in kv_dtypes:
        raise ValueError(f"kv_cache_dtype: expected one of {', '.join(kv_dtypes)}, got {args.kv_cache_dtype!r}")
    if args.calculate_kv_scales and not args.kv_cache_dtype.startswith("fp8"):
        raise ValueError("calculate_kv_scales: needs an FP8 kv_cache_dtype ('fp8', 'fp8_e4m3' or 'fp8_e5m2')")
    if args.reasoning_parser is not None:
        from pagedllm.reasoning import get_reasoning_parser

        get_reasoning_parser(args.reasoning_parser)  # ValueError naming reasoning_parser
    _validate_lora(args)
    _validate_controls(args)


def _validate_parallel(args: EngineArgsFields, hints: dict[str, Any]) -> None:
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name}: must be >= 1, got {getattr(args, name)}")
    backends = get_args(get_args(hints["distributed_executor_backend"])[0])
    backend = args.distributed_executor_backend
    if backend is not None and backend not in backends:
        raise ValueError(f"distributed_executor_backend: expected one of {', '.join(backends)}, got {backend!r}")
    world = args.tensor_parallel_size * args.pipeline_parallel_size
    if backend == "uni" and world != 1:
        raise ValueError(
            f"distributed_executor_backend: 'uni' runs one worker; tensor_parallel_size x "
            f"pipeline_parallel_size = {world} needs 'mp'"
        )
    if args.pipeline_parallel_size > 1 and args.async_scheduling:
        raise ValueError("async_scheduling: not supported with pipeline_parallel_size > 1 (leave it unset)")
    if world > 1:
        for name, on in (
            ("enable_lora", args.enable_lora),
            ("speculative_config", args.speculative_config or args.spec_method),
        ):
            if on:
                raise ValueError(f"{name}: not supported with tensor or pipeline parallelism yet")


def _validate_lora(args: EngineArgsFields) -> None:
    if not args.enable_lora:
        return
    if args.max_loras < 1:
        raise ValueError(f"max_loras: must be >= 1, got {args.max_loras}")
    if not 1 <= args.max_lora_rank <= 512:
        raise ValueError(f"max_lora_rank: must be in [1, 512], got {args.max_lora_rank}")
    if args.max_cpu_loras is not None and args.max_cpu_loras < args.max_loras:
        raise ValueError(f"max_cpu_loras: must be >= max_loras ({args.max_loras}), got {args.max_cpu_loras}")


def _validate_controls(args: EngineArgsFields) -> None:
    from pagedllm.distributed.weight_transfer import check_weight_transfer_config
    from pagedllm.model_executor.layers.batch_invariant import env_enabled as env_batch_invariant

    for name in ("weight_transfer_config", "profiler_config"):
        v = getattr(args, name)
        if isinstance(v, str):
            setattr(args, name, json.loads(v))
    check_weight_transfer_config(args.weight_transfer_config)
    if args.batch_invariant or env_batch_invariant():
        args.batch_invariant = True
        if args.resolved_device() not in ("cpu", "cuda"):
            raise ValueError(f"batch_invariant: supported on 'cpu' and 'cuda', not {args.resolved_device()!r}")
        if args.enable_lora and args.resolved_device() == "cuda":
            raise ValueError("batch_invariant: LoRA layers are not batch-invariant on the GPU (enable_lora)")
        if args.quantization not in (None, "gguf") and args.resolved_device() == "cuda":
            raise ValueError(
                f"batch_invariant: quantized layers ({args.quantization}) are not batch-invariant on the GPU"
            )
    pc = args.profiler_config
    if pc is not None:
        if not isinstance(pc, dict):
            raise ValueError(f"profiler_config: expected a dict, got {pc!r}")
        if pc.get("profiler", "torch") != "torch":
            raise ValueError(f"profiler_config.profiler: only 'torch' is supported, got {pc.get('profiler')!r}")


def check_tp_divides(hf_config: Any, tp: int) -> None:
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


def json_arg(value: Any, name: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise ValueError(f"{name}: not valid JSON ({value[:64]!r})") from None
    return value
