"""Tensor-parallel rank and size of this process (1 process, size 1, until tensor parallelism lands).

`set_tensor_parallel_state` lets a test build rank r of n in one process to check weight sharding.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_TP_RANK = 0
_TP_SIZE = 1


def get_tensor_model_parallel_rank() -> int:
    return _TP_RANK


def get_tensor_model_parallel_world_size() -> int:
    return _TP_SIZE


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


def tensor_model_parallel_all_reduce(x):  # noqa: ANN001, ANN201 - identity at size 1
    if _TP_SIZE != 1:
        raise NotImplementedError("tensor parallelism across processes is not implemented yet")
    return x


def tensor_model_parallel_all_gather(x, dim: int = -1):  # noqa: ANN001, ANN201
    if _TP_SIZE != 1:
        raise NotImplementedError("tensor parallelism across processes is not implemented yet")
    return x
