"""Floors measured in the same run as a benchmark: device copy bandwidth and the bytes a decode step
must read, so that a latency figure can be reported as measured / floor on whatever GPU ran it."""

from __future__ import annotations

import torch


def copy_bandwidth_gbps(device: torch.device | str = "cuda", gib: float = 2.0, reps: int = 20) -> float:
    """Device-to-device copy of `gib` GiB of bf16: bytes read + written per second (GB/s), the median of
    `reps` copies timed with CUDA events. Large enough that L2 holds none of it."""
    n = int(gib * (1 << 30)) // 2
    a = torch.randn(n, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del a, b
    torch.cuda.empty_cache()
    ms = sorted(times)[len(times) // 2]
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
