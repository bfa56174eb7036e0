"""A low-latency tensor-parallel all-reduce through PyTorch's symmetric memory (CUDA only).

NCCL's all-reduce costs ~10-20 us even for a few kilobytes, and a Llama decode step makes two per layer: at
batch 1 on two H200s (W3) the 64 all-reduces of Llama-3.1-8B would be ~1 ms against a ~1.8 ms halved
weight-read floor. In a "one-shot" all-reduce each rank copies its input into a buffer that every peer can
read over NVLink (allocated once with `torch.distributed._symmetric_memory` and exchanged at start-up), then
after a barrier on signal pads reads all peers' buffers and sums: one small kernel, no NCCL round trip. It is
captured by the decode CUDA graphs like any kernel.

The LM head's logits gather (float32, [rows, vocab / tp] per rank) goes the same way when it fits: each rank
writes its part into zeros at its slot and the one-shot sum assembles the whole row (`gather_last_dim_by_sum`),
instead of an eager NCCL all-gather every step.

Used for contiguous inputs of the model dtype (or float32) up to `max_bytes` (decode-sized); larger ones
(prefill) go to NCCL, whose ring/tree algorithms use the links' bandwidth better. Anything that fails at
set-up leaves this off (the caller keeps NCCL). NVLink multicast is never used (`multimem_*` ops are not
called), so the machines' NCCL_NVLS_ENABLE=0 / TORCH_SYMM_MEM_DISABLE_MULTICAST=1 settings are respected.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 4 << 20
"""Inputs up to this size take the one-shot path: 256 decode rows x 4096 hidden x 2 bytes is 2 MiB."""


class SymmMemAllReduce:
    """Sum over the ranks of `group` for small tensors of one dtype, in place."""

    def __init__(
        self, group: Any, device: torch.device, dtypes: tuple[torch.dtype, ...], max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.max_bytes = max_bytes
        self.group_name: str = group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed by older PyTorch releases, harmless (or deprecated) in newer ones
            enable(self.group_name)
        # One buffer per dtype (the model's for the layers' all-reduces, float32 for the logits' gather),
        # each exchanged with the peers once here: allocation is collective, never done while serving.
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.handles: list[Any] = []
        for dtype in dict.fromkeys(dtypes):
            buf = symm_mem.empty(max_bytes // dtype.itemsize, device=device, dtype=dtype)
            self.handles.append(symm_mem.rendezvous(buf, self.group_name))
            self.buffers[dtype] = buf
        self._op = torch.ops.symm_mem.one_shot_all_reduce_out

    def fits(self, dtype: torch.dtype, nbytes: int) -> bool:
        return dtype in self.buffers and nbytes <= self.max_bytes

    def eligible(self, x: torch.Tensor) -> bool:
        return x.is_contiguous() and self.fits(x.dtype, x.numel() * x.element_size())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.view(-1)
        staged = self.buffers[x.dtype][: flat.numel()]
        staged.copy_(flat)
        self._op(staged, "sum", self.group_name, flat)
        return x


def gather_last_dim_by_sum(
    x: torch.Tensor, rank: int, world: int, all_reduce: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """The ranks' `x` concatenated along the last dim, through one all-reduce (sum): each rank writes its
    part into zeros at its slot, and x + 0 is exact. Lets the small decode-time gather of the LM head's logits
    take the one-shot all-reduce instead of an eager NCCL all-gather."""
    out = x.new_zeros(*x.shape[:-1], world, x.shape[-1])
    out[..., rank, :] = x
    return all_reduce(out).reshape(*x.shape[:-1], world * x.shape[-1])


def try_create(group: Any, device: torch.device, dtype: torch.dtype) -> SymmMemAllReduce | None:
    """The one-shot all-reduce for this TP group, checked once against NCCL; None where it cannot be used."""
    import torch.distributed as dist

    ar: SymmMemAllReduce | None = None
    try:
        ar = SymmMemAllReduce(group, device, (dtype, torch.float32))
        # Small integers: every partial sum is exact in bf16 whatever the order of the ranks' terms (NCCL's ring
        # and the one-shot kernel add in different orders, which rounds differently for larger values: with
        # arange(1, 4097) the check failed at 4 ranks on an H200 x4).
        x = ((torch.arange(4096, device=device) % 17 - 8) * (dist.get_rank(group) + 1)).to(dtype)
        want = x.clone()
        dist.all_reduce(want, group=group)
        got = ar(x.clone())
        torch.cuda.synchronize(device)
        if not torch.equal(got, want):
            raise RuntimeError("one-shot all-reduce disagrees with NCCL on the self-check")
    except Exception as e:  # an older PyTorch, no peer access, no symmetric-memory support: NCCL only
        logger.warning("tensor parallel: symmetric-memory all-reduce unavailable (%s); NCCL only", e)
        ar = None
    from pagedllm.distributed.agreement import all_ranks_true

    if not all_ranks_true(ar is not None, group, device) or ar is None:
        return None
    logger.info("tensor parallel: one-shot symmetric-memory all-reduce up to %d bytes", ar.max_bytes)
    return ar
