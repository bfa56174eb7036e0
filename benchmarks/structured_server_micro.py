"""Host cost of each call the grammar server mode's structured step makes on the step loop (CUDA), one at a time
over many repetitions: the flag wait's enqueue (`cuStreamWaitValue32` through ctypes), the mask's upload from the
registered shared segment, the mask kernel's launch, the sampled ids' copy back and the flag write, and the row
bookkeeping. Issue 16, acceptance 5: which of them to fold.

    python benchmarks/structured_server_micro.py [--rows 64] [--vocab 151936] [--valid 49152]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import torch


def per_call_us(fn: Callable[[], object], n: int = 2000, sync_every: int = 100) -> float:
    """Median over 5 rounds of the mean host time per call (us); the stream is drained every `sync_every` calls
    (outside the timing) so the launch queue never fills."""
    rounds = []
    for _ in range(5):
        spent = 0.0
        for i in range(n):
            if i % sync_every == 0:
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            spent += time.perf_counter() - t
        rounds.append(spent / n * 1e6)
    return statistics.median(rounds)


def main() -> None:
    from pagedllm.structured_output.apply import launch_mask_kernel
    from pagedllm.structured_output.host_flags import RegisteredHostMemory, _libcuda, _stream_handle

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--valid", type=int, default=49152)
    args = ap.parse_args()
    m, words = args.rows, -(-args.valid // 32)
    dev = torch.device("cuda")
    torch.zeros(1, device=dev)  # the context current on this thread (the driver's registration needs one)
    shm = SharedMemory(create=True, size=64 + m * words * 4 + m * 8)
    try:
        flags = np.ndarray((16,), dtype=np.int32, buffer=shm.buf)
        flags[:] = 1 << 20  # every wait already satisfied
        masks = np.ndarray((m, words), dtype=np.int32, buffer=shm.buf, offset=64)
        masks[:] = -1
        tokens = np.ndarray((m,), dtype=np.int64, buffer=shm.buf, offset=64 + m * words * 4)
        mem = RegisteredHostMemory(flags.ctypes.data, shm.size)
        mask_host, ids_host = torch.from_numpy(masks), torch.from_numpy(tokens)
        mask_dev = torch.empty((m, words), dtype=torch.int32, device=dev)
        logits = torch.randn(m, args.vocab, device=dev)
        sampled = torch.zeros(m, dtype=torch.int64, device=dev)
        flag = flags.ctypes.data
        lib = _libcuda()
        dptr = mem.device_pointer(flag)
        rids = [f"req-{i}" for i in range(m)]
        req_ids, idx = list(rids), np.arange(m)
        res = {
            "current_stream": per_call_us(torch.cuda.current_stream),
            "stream_handle": per_call_us(lambda: _stream_handle(None, 0)),
            "wait_geq": per_call_us(lambda: mem.wait_geq(flag, 5)),
            "wait_raw_ctypes": per_call_us(lambda: lib.cuStreamWaitValue32_v2(_stream_handle(None, 0), dptr, 5, 0)),
            "mask_upload": per_call_us(lambda: mask_dev.copy_(mask_host, non_blocking=True)),
            "mask_kernel": per_call_us(lambda: launch_mask_kernel(logits, mask_dev, None, args.valid)),
            "ids_copy_back": per_call_us(lambda: ids_host.copy_(sampled, non_blocking=True)),
            "flag_write": per_call_us(lambda: mem.write(flag + 0, 7)),
            "rows_compare": per_call_us(
                lambda: list(rids) == rids and list(req_ids) == req_ids and np.array_equal(idx, np.arange(m))
            ),
            "empty_launch_ref": per_call_us(lambda: sampled.add_(0)),
        }
        torch.cuda.synchronize()
        for k, v in res.items():
            print(f"{k}_us: {v:.2f}")
        mem.unregister()
    finally:
        shm.close()
        shm.unlink()


if __name__ == "__main__":
    main()
