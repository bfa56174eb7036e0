"""Host cost of the CUDA calls a decode step makes (what the host-time budget per step is spent on): each
call timed in a loop with the GPU idle, microseconds per call. Run on the GPU machine:

    python benchmarks/host_op_costs.py [--rows 256] [--vocab 151936]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch


def per_call_us(fn: Callable[[], object], n: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32)
    args = ap.parse_args()
    from pagedllm.sample import triton_sample

    dev = torch.device("cuda")
    n = args.rows
    logits = torch.randn(n, args.vocab, device=dev)
    temp = torch.full((n,), 0.6, device=dev)
    host = np.arange(n, dtype=np.int64)
    dst = torch.empty(n, dtype=torch.int64, device=dev)
    pinned = torch.empty(n, dtype=torch.int64, pin_memory=True)
    stream = torch.cuda.current_stream()
    g = torch.cuda.CUDAGraph()
    x = torch.zeros(n, device=dev)
    with torch.cuda.graph(g):
        x.add_(1)
    ev = torch.cuda.Event()
    triton_sample.gumbel_sample(logits, temp, None)
    cases: dict[str, Callable[[], object]] = {
        "torch.randint(...).item() (CPU)": lambda: torch.randint(0, 2**62, (1,)).item(),
        "torch.empty (cuda, int64)": lambda: torch.empty(n, dtype=torch.int64, device=dev),
        "torch.empty (pinned)": lambda: torch.empty(n, dtype=torch.int64, pin_memory=True),
        "from_numpy -> .to(cuda, non_blocking)": lambda: torch.from_numpy(host).to(dev, non_blocking=True),
        "copy_ pageable -> cuda (non_blocking)": lambda: dst.copy_(torch.from_numpy(host), non_blocking=True),
        "copy_ cuda -> pinned (non_blocking)": lambda: pinned.copy_(dst, non_blocking=True),
        "torch.cuda.Event() + record()": lambda: torch.cuda.Event().record(),
        "event.record(stream)": lambda: ev.record(stream),
        "torch.cuda.current_stream()": torch.cuda.current_stream,
        "CUDAGraph.replay (1 kernel)": g.replay,
        "x.add_(1) (one elementwise launch)": lambda: x.add_(1),
        "gumbel_sample (Triton launch + empty)": lambda: triton_sample.gumbel_sample(logits, temp, None, 12345),
        "logits.max(dim=-1).indices": lambda: logits.max(dim=-1).indices,
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, fn in cases.items():
        print(f"{name:42s} {per_call_us(fn):8.2f} us")


if __name__ == "__main__":
    main()
