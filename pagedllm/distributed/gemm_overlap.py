"""Tensor parallelism, long prefill steps: a row-parallel layer's GEMM and its all-reduce overlapped (CUDA).

At tp=2 a 16,384-token prefill step all-reduces a [16384, 4096] bf16 partial sum twice per layer (o_proj and
down_proj), ~0.5 ms each on two H100s, while the GPU's SMs wait: about 15 % of the step (benchmarks/NOTES.md,
session 32). Here the layer's rows are computed in a few chunks, and each chunk's all-reduce (NCCL, on its own
stream, `async_op=True`) runs while the next chunk's GEMM does, so only the last chunk's all-reduce is exposed.

Each row is the same product either way (a chunk is a plain GEMM on fewer rows; the sum of the ranks' rows is
the same NCCL sum); only eager steps take this path (CUDA graphs replay decode and small mixed steps).
"""

from __future__ import annotations

import torch

from pagedllm import envs
from pagedllm.utils import cdiv

CHUNKS = 4
"""Chunks per layer: the exposed all-reduce is 1/CHUNKS of the whole; each chunk stays a large GEMM."""


def matmul_all_reduce(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor | None:
    """`all_reduce(x @ weight^T)` over the tensor-parallel group, chunk by chunk with each all-reduce overlapping
    the next chunk's GEMM; None where this does not apply (the caller computes and reduces as usual): no plain
    weight (`LinearMethodBase.plain_weight`), not CUDA, fewer rows than `PAGEDLLM_TP_OVERLAP_MIN_ROWS`, or a
    CUDA graph being captured. Every rank decides from the same shapes, so all take the same path."""
    import torch.distributed as dist

    from pagedllm.distributed import parallel_state as ps

    min_rows = envs.PAGEDLLM_TP_OVERLAP_MIN_ROWS
    if weight is None or min_rows <= 0 or not x.is_cuda or x.dim() != 2 or x.shape[0] < min_rows:
        return None
    if not x.is_contiguous() or torch.cuda.is_current_stream_capturing():
        return None
    rows = x.shape[0]
    step = cdiv(rows, CHUNKS)
    step = step if step <= 128 else cdiv(step, 128) * 128  # whole 128-row tiles per chunk
    out = torch.empty((rows, weight.shape[0]), dtype=x.dtype, device=x.device)
    group = ps.get_tp_group()
    works = []
    for s in range(0, rows, step):
        e = min(s + step, rows)
        torch.mm(x[s:e], weight.t(), out=out[s:e])
        works.append(dist.all_reduce(out[s:e], group=group, async_op=True))
    for w in works:
        w.wait()
    return out
