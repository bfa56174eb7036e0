"""Tensor- and pipeline-parallel rank and size of this process, and the collectives the layers call.

One process (the in-process executor) is rank 0 of 1 and every collective is the identity. A worker of the
multi-process executor calls `init_distributed` once: a `torch.distributed` world of tp * pp processes
(NCCL on GPUs, gloo on the CPU), split into tensor-parallel groups (consecutive ranks) and pipeline groups
(ranks tp apart), as vLLM lays them out: global rank = pp_rank * tp + tp_rank.

`set_tensor_parallel_state` lets a test build rank r of n in one process to check weight sharding (no
collectives then).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

_TP_RANK = 0
_TP_SIZE = 1
_PP_RANK = 0
_PP_SIZE = 1
_TP_GROUP: Any = None
"""The torch.distributed group of this rank's tensor-parallel peers (None: one process, no collectives)."""
_PP_GROUP: Any = None
_FAST_ALL_REDUCE: Any = None
"""The one-shot symmetric-memory all-reduce for small tensors (`symm_allreduce`), or None: NCCL only."""


def get_tensor_model_parallel_rank() -> int:
    return _TP_RANK


def get_tensor_model_parallel_world_size() -> int:
    return _TP_SIZE


def get_pipeline_model_parallel_rank() -> int:
    return _PP_RANK


def get_pipeline_model_parallel_world_size() -> int:
    return _PP_SIZE


def get_pp_group() -> Any:
    return _PP_GROUP


def get_tp_group() -> Any:
    return _TP_GROUP


@contextmanager
def set_tensor_parallel_state(rank: int, world_size: int) -> Iterator[None]:
    global _TP_RANK, _TP_SIZE
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world size {world_size}")
    prev = (_TP_RANK, _TP_SIZE)
    _TP_RANK, _TP_SIZE = rank, world_size
    try:
        yield
    finally:
        _TP_RANK, _TP_SIZE = prev


def init_distributed(
    rank: int,
    tp_size: int,
    pp_size: int,
    init_method: str,
    backend: str,
    timeout_s: float = 600.0,
    dtype: torch.dtype | None = None,
) -> None:
    """Join the world of tp_size * pp_size workers and build this rank's TP and PP groups. With NCCL and
    `dtype` (the model's), small all-reduces of that dtype take the one-shot symmetric-memory path with
    PAGEDLLM_TP_ALLREDUCE=symm (the default fused all-reduce + RMSNorm is set up with the model:
    `tp_fusion.fuse_model`)."""
    import torch.distributed as dist

    from pagedllm import envs

    global _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE, _TP_GROUP, _PP_GROUP, _FAST_ALL_REDUCE
    world = tp_size * pp_size
    if world == 1:  # one worker in its own process: no collective ever runs
        return
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )
    # Every rank creates every group (torch.distributed's rule), keeping its own.
    for pp in range(pp_size):
        ranks = list(range(pp * tp_size, (pp + 1) * tp_size))
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            _TP_GROUP = group
    for tp in range(tp_size):
        ranks = list(range(tp, world, tp_size))
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            _PP_GROUP = group
    _TP_RANK, _TP_SIZE = rank % tp_size, tp_size
    _PP_RANK, _PP_SIZE = rank // tp_size, pp_size
    if backend == "nccl" and tp_size > 1 and dtype is not None and envs.PAGEDLLM_TP_ALLREDUCE == "symm":
        from pagedllm.distributed.symm_allreduce import try_create

        _FAST_ALL_REDUCE = try_create(_TP_GROUP, torch.device("cuda", torch.cuda.current_device()), dtype)


def destroy_distributed() -> None:
    import torch.distributed as dist

    global _TP_GROUP, _PP_GROUP, _FAST_ALL_REDUCE
    if dist.is_initialized():
        if dist.get_backend() == "nccl":
            _abort_nccl()
        else:
            dist.destroy_process_group()
    _TP_GROUP = _PP_GROUP = _FAST_ALL_REDUCE = None


def _abort_nccl(timeout_s: float = 10.0) -> None:
    """Tear NCCL down without waiting for the peers. `destroy_process_group` was seen to block forever in
    both workers after W2 at tp=2 had finished (H200 x2, collectives captured in CUDA graphs), keeping 130 GiB
    on each GPU; an abort does not synchronize with the peers, and runs in a daemon thread bounded by
    `timeout_s` so that shutdown goes on whatever it does."""
    import threading

    import torch.distributed.distributed_c10d as c10d

    abort = getattr(c10d, "_abort_process_group", None)
    if abort is None:
        return
    t = threading.Thread(target=abort, name="nccl-abort", daemon=True)
    t.start()
    t.join(timeout_s)


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over the tensor-parallel ranks (in place on `x`, which is returned)."""
    if _TP_SIZE == 1:
        return x
    if _TP_GROUP is None:
        raise RuntimeError("tensor parallelism needs init_distributed (the multi-process executor)")
    fast = _FAST_ALL_REDUCE
    if fast is not None and fast.eligible(x):
        return fast(x)
    import torch.distributed as dist

    dist.all_reduce(x, group=_TP_GROUP)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The tensor-parallel ranks' `x` concatenated along `dim`, in rank order."""
    if _TP_SIZE == 1:
        return x
    if _TP_GROUP is None:
        raise RuntimeError("tensor parallelism needs init_distributed (the multi-process executor)")
    fast = _FAST_ALL_REDUCE
    if fast is not None and dim in (-1, x.dim() - 1) and fast.fits(x.dtype, x.numel() * x.element_size() * _TP_SIZE):
        from pagedllm.distributed.symm_allreduce import gather_last_dim_by_sum

        return gather_last_dim_by_sum(x, _TP_RANK, _TP_SIZE, fast)
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)
