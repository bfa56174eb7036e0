"""Floors measured in the same run as a benchmark: device copy bandwidth and the bytes a decode step
must read, so that a latency figure can be reported as measured / floor on whatever GPU ran it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedllm import LLM


def in_process_model(llm: LLM) -> torch.nn.Module | None:
    """The model, where the engine core runs in this process (the offline LLM's)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    worker = getattr(getattr(core, "executor", None), "worker", None)
    return getattr(getattr(worker, "model_runner", None), "model", None)


def _median_ms(fn: Callable[[], object], warmup: int, reps: int) -> float:
    """Median time of `fn` on the current CUDA stream (ms), each call timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbps(device: torch.device | str = "cuda", gib: float = 2.0, reps: int = 20) -> float:
    """Device-to-device copy of `gib` GiB of bf16: bytes read + written per second (GB/s), the median of
    `reps` copies timed with CUDA events. Large enough that L2 holds none of it."""
    n = int(gib * (1 << 30)) // 2
    a = torch.randn(n, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    ms = _median_ms(partial(b.copy_, a), warmup=3, reps=reps)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n * 2 / (ms * 1e-3) / 1e9


def weight_read_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter but the input embedding table (a step
    reads one row of it); a tied LM head reads that table whole, so it counts under the head's name."""
    seen: set[int] = set()
    total = 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen or "embed" in name:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


def matmul_tflops(device: torch.device | str = "cuda", n: int = 8192, reps: int = 20) -> float:
    """bf16 n x n x n matmul rate (TFLOP/s), the median of `reps` timed with CUDA events."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    ms = _median_ms(partial(torch.matmul, a, b), warmup=5, reps=reps)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n**3 / (ms * 1e-3) / 1e12


def fp8_matmul_tflops(device: torch.device | str = "cuda", n: int = 8192, reps: int = 20) -> float:
    """FP8 (e4m3) n x n x n `torch._scaled_mm` rate with row-wise scales, bf16 out (TFLOP/s): the ceiling
    of the W8A8 FP8 linear layers."""
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
    sa = torch.ones(n, 1, device=device)
    sb = torch.ones(1, n, device=device)
    ms = _median_ms(
        partial(torch._scaled_mm, a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), warmup=5, reps=reps
    )
    del a, b
    torch.cuda.empty_cache()
    return 2 * n**3 / (ms * 1e-3) / 1e12


def quantized_linears(model: torch.nn.Module) -> tuple[int, int, bool]:
    """(logical parameters of the quantized linear layers, their bytes, whether they multiply in FP8):
    packed or 8-bit weights hold more parameters than their bytes / element size says."""
    from pagedllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    params = nbytes = 0
    fp8 = False
    for m in model.modules():
        if isinstance(m, LinearBase) and not isinstance(m.quant_method, UnquantizedLinearMethod):
            params += int(m.input_size) * int(m.output_size) // max(1, int(m.tp_size))
            nbytes += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
            w = getattr(m, "weight", None)
            fp8 = fp8 or (isinstance(w, torch.Tensor) and w.dtype == torch.float8_e4m3fn)
    return params, nbytes, fp8


def kv_element_size(model: torch.nn.Module, default: int) -> int:
    """Bytes per K/V element of the bound cache (1 for an FP8 cache)."""
    from pagedllm.attention.layer import Attention

    for m in model.modules():
        if isinstance(m, Attention) and m.kv_cache is not None:
            return int(m.kv_cache.element_size())
    return default


def moe_expert_params(model: torch.nn.Module) -> tuple[int, float]:
    """(routed-expert parameters of the model, the fraction top_k / E of them one token uses); (0, 1.0)
    for a dense model."""
    from pagedllm.model_executor.layers.fused_moe import FusedMoE

    total, active = 0, 1.0
    for m in model.modules():
        if isinstance(m, FusedMoE):
            total += m.w13_weight.numel() + m.w2_weight.numel()
            active = m.top_k / m.num_experts
    return total, active


@dataclass
class ThroughputFloor:
    """The least time a batch of requests can take on this GPU: the bytes it must move at copy bandwidth,
    or the FLOPs it must do at the matmul rate, whichever is larger (they can overlap)."""

    bytes: float
    flops: float
    bytes_s: float
    flops_s: float

    @property
    def seconds(self) -> float:
        return max(self.bytes_s, self.flops_s)


def throughput_floor(
    model: torch.nn.Module,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    requests: list[tuple[int, int, int]],
    max_num_batched_tokens: int,
    copy_gbps: float,
    tflops: float,
    fp8_tflops: float | None = None,
) -> ThroughputFloor:
    """Floor of an offline run of `requests` = (prompt len, output len, prompt tokens served from the
    prefix cache). FLOPs: 2 x body parameters per computed token, 2 x LM-head parameters per sampled token,
    4 x heads x head_dim x context per computed token and layer (QK^T and PV). Bytes: the weights once
    per step (at least max(longest output, computed tokens / token budget) steps), each token's K/V
    written once, each request's context read once by its prefill and once per later decode token.
    Quantized linear layers count their logical parameters; FP8 ones multiply at `fp8_tflops`.
    """
    head_w = getattr(getattr(model, "lm_head", None), "weight", None)
    el = head_w.element_size() if isinstance(head_w, torch.Tensor) else next(model.parameters()).element_size()
    w_bytes = weight_read_bytes(model)
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    head_params = head.numel() if isinstance(head, torch.Tensor) else 0
    q_params, q_bytes, q_fp8 = quantized_linears(model)
    body_params = (w_bytes - q_bytes) // el - head_params + q_params
    expert_params, active = moe_expert_params(model)
    kv_token = 2 * num_kv_heads * head_dim * kv_element_size(model, el) * num_layers  # K and V, all layers
    computed = sampled = ctx_sum = kv_read = 0
    for n_in, n_out, cached in requests:
        n = n_in + n_out - 1  # the last sampled token is never fed back
        computed += n - cached
        sampled += n_out
        ctx_sum += n * (n + 1) // 2 - cached * (cached + 1) // 2  # each computed token attends to its prefix
        kv_read += n_in + (n_in + 1 + n) * (n - n_in) // 2  # prefill once, then one context per decode token
    steps = max(max((o for _, o, _ in requests), default=0), -(-computed // max_num_batched_tokens))
    if expert_params:
        # MoE: a token multiplies only its top-k experts; a step reads the experts its tokens picked,
        # for uniform routing 1 - (1 - k/E)^(tokens per step) of them on average.
        body_params -= round(expert_params * (1 - active))
        touched = 1 - (1 - active) ** (computed / max(1, steps))
        w_bytes -= round(expert_params * el * (1 - touched))
    flops = 2 * body_params * computed + 2 * head_params * sampled + 4 * num_heads * head_dim * num_layers * ctx_sum
    fast = 2 * q_params * computed if (q_fp8 and fp8_tflops) else 0  # FLOPs at the FP8 rate
    flops_s = (flops - fast) / (tflops * 1e12) + (fast / (fp8_tflops * 1e12) if fast else 0.0)  # type: ignore[operator]
    nbytes = steps * w_bytes + kv_token * (computed + kv_read)
    return ThroughputFloor(nbytes, flops, nbytes / (copy_gbps * 1e9), flops_s)
