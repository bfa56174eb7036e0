"""Host time of the structured step's mask apply on a CUDA device, piece by piece (issue 16, acceptance 5): the
whole `apply_grammar_bitmask` for N in-order rows, the row mapping alone, the mask's upload alone and the kernel
launch alone, each timed on the host without a sync (the step loop's cost), medians of many calls.

    python benchmarks/structured_apply_micro.py [--rows 64] [--vocab 151936] [--valid 49152]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch


def host_us(fn: Callable[[], object], n: int = 400, busy: Callable[[], object] | None = None) -> float:
    """Median host microseconds per call (synchronizing every 50 calls so the queue never fills). `busy`: work
    enqueued (untimed) before each call, so that the call finds the device busy, as the step loop does."""
    out = []
    for i in range(n):
        if busy is not None:
            busy()
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
        if busy is not None or i % 50 == 49:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(out[n // 4 :]) * 1e6


def main() -> None:
    from pagedllm.core.scheduler_output import CachedRequestData, SchedulerOutput
    from pagedllm.structured_output import apply as ap

    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--valid", type=int, default=49152)
    p.add_argument("--graph-nodes", type=int, default=400)
    args = p.parse_args()
    m, words = args.rows, -(-args.valid // 32)
    logits = torch.randn(m, args.vocab, dtype=torch.bfloat16, device="cuda")
    host = torch.full((m, words), -1, dtype=torch.int32, pin_memory=True)
    rows = list(range(m))

    class Source:
        valid_vocab = args.valid
        logit_rows = None

        def narrow(self) -> tuple[torch.Tensor, list[int]]:
            return host, rows

        def uploaded(self) -> None:
            pass

    rids = [f"r{i}" for i in range(m)]
    ids = {r: i for i, r in enumerate(rids)}
    so = SchedulerOutput([], CachedRequestData(), {}, 0, structured_output_request_ids=ids, grammar_bitmask=Source())
    idx = np.arange(m)
    dev = torch.empty((m, words), dtype=torch.int32, device="cuda")
    get = ids.get
    res = {
        "apply_grammar_bitmask": host_us(lambda: ap.apply_grammar_bitmask(logits, so, rids, idx)),
        "row_mapping": host_us(lambda: [get(rids[i]) for i in idx.tolist()]),
        "upload_copy_": host_us(lambda: dev.copy_(host, non_blocking=True)),
        "upload_to": host_us(lambda: host.to("cuda", non_blocking=True)),
        "launch": host_us(lambda: ap._launch((m, -(-args.vocab // 2048), 1), logits, dev, dev, args.valid, args.vocab)),
        "jit_launch": host_us(
            lambda: ap._grammar_mask_kernel[(m, -(-args.vocab // 2048))](
                logits,
                dev,
                dev,
                logits.stride(0),
                dev.stride(0),
                args.valid,
                args.vocab,
                HAS_ROWS=False,
                BLOCK=2048,
                num_warps=4,
            )  # fmt: skip
        ),
        "empty_kernel_torch_add_": host_us(lambda: dev.add_(0)),
    }
    # The same with the device busy (~1 ms of matmuls in a CUDA graph enqueued first, as a forward is).
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            a @ a
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        for _ in range(8):
            b = a @ a
    del b
    # And with a graph of many small kernels (a decode forward's ~400 launches): its replay fills the launch queue.
    small = torch.zeros(4096, device="cuda")
    many = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        small.add_(1)
    torch.cuda.synchronize()
    with torch.cuda.graph(many):
        for _ in range(args.graph_nodes):
            small.add_(1)
    fns = [
        ("apply_grammar_bitmask", lambda: ap.apply_grammar_bitmask(logits, so, rids, idx)),
        ("upload_copy_", lambda: dev.copy_(host, non_blocking=True)),
        ("launch", lambda: ap._launch((m, -(-args.vocab // 2048), 1), logits, dev, dev, args.valid, args.vocab)),
        ("torch_add_", lambda: dev.add_(0)),
    ]
    for k, fn in fns:
        res["busy_" + k] = host_us(fn, 100, busy=graph.replay)
    for k, fn in fns:
        res["busy_many_" + k] = host_us(fn, 100, busy=many.replay)
    res["many_graph_replay"] = host_us(many.replay, 50)
    for k, v in res.items():
        print(f"{k}: {v:.1f} us")


if __name__ == "__main__":
    main()
