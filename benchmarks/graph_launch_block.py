"""Does launching a CUDA graph exec that is still running block the host? (Async scheduling launches step
N+1's graph while step N's runs.) Host time of a launch right after a launch of the same exec, and of a second
exec captured from the same work, with a ~1 ms graph. Prints microseconds per launch."""

from __future__ import annotations

import time

import torch


def main() -> None:
    x = torch.randn(2048, 2048, device="cuda")
    ys = []

    def work() -> torch.Tensor:
        y = x
        for _ in range(12):
            y = y @ x
        return y

    graphs = []
    for _ in range(2):
        work()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            ys.append(work())
        graphs.append(g)
    a, b = graphs
    a.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    a.replay()
    torch.cuda.synchronize()
    gpu = time.perf_counter() - t0
    for name, seq in (("same exec", (a, a, a, a)), ("alternating execs", (a, b, a, b))):
        torch.cuda.synchronize()
        times = []
        for g in seq:
            t = time.perf_counter()
            g.replay()
            times.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        print(f"{name}: graph {gpu * 1e6:.0f} us on the device; launch host times (us):",
              " ".join(f"{1e6 * t:.0f}" for t in times))  # fmt: skip


if __name__ == "__main__":
    main()
