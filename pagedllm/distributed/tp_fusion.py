"""Tensor parallelism at tp=2: the model's row-parallel reductions deferred to the norms after them, and the
ways of reducing assembled (one module above the three so that none imports another's assembly):

- `fused_allreduce_norm`: the pull kernel (all-reduce + residual add + RMSNorm), decode-sized batches;
- `push_allreduce`: batch 1, the row GEMV pushes its partial sum into the peer's buffer;
- `ce_allreduce`: prefill steps, the copy engines send row chunks while the GEMM runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.distributed import ce_allreduce, push_allreduce
from pagedllm.distributed.fused_allreduce_norm import default_max_rows, try_create


def fuse_model(model: nn.Module, max_num_tokens: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Where the model supports it (`defer_tp_reductions`, the Llama family's dense layers) and the kernel
    works on every rank: its row-parallel outputs stay partial and the norms after them reduce. Collective."""
    from pagedllm.distributed import parallel_state as ps

    inner: Any = getattr(model, "model", model)
    defer = getattr(inner, "defer_tp_reductions", None)
    if defer is None or not inner.supports_deferred_tp_reductions():
        return False
    group, world = ps.get_tp_group(), ps.get_tensor_model_parallel_world_size()
    hidden = int(inner.config.hidden_size)
    rank, max_rows = ps.get_tensor_model_parallel_rank(), default_max_rows(max_num_tokens)
    fused = try_create(group, rank, world, device, dtype, hidden, max_rows)
    if fused is None:
        return False
    push = push_allreduce.try_create(group, rank, world, device, dtype, hidden)  # (collective; batch-1 decode)
    if push is not None:
        fused.paths.append(push)
    prefill = ce_allreduce.try_create(fused, group, device, max_num_tokens)  # (collective; None: NCCL above max_rows)
    if prefill is not None:
        fused.paths.append(prefill)
    defer(fused, fused)
    return True
