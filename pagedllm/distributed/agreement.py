"""Agreement between the ranks of a process group on a per-rank condition (collective)."""

from __future__ import annotations

from typing import Any

import torch


def all_ranks_true(flag: bool, group: Any, device: torch.device) -> bool:
    """Whether `flag` holds on every rank of `group` (collective): a fast path set up per rank is used only
    where all ranks have it, since every rank must take the same path for every collective."""
    import torch.distributed as dist

    ok = torch.tensor([1 if flag else 0], device=device, dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return int(ok.item()) == 1
