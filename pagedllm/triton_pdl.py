"""Programmatic dependent launch (PDL, Hopper and later) for the Triton kernels of a decode step.

A decode step at batch 1 is ~330 short kernels back to back; each one's programs start only when the
previous kernel has finished, then wait a memory round trip for their first bytes. Launched with PDL
(`launch_pdl=True`), a kernel's programs may start while the previous kernel still runs: they prefetch what
no earlier kernel writes (a GEMV's weight rows, into L2), then block in `griddepcontrol.wait` until the
previous kernel has completed and its writes are visible. Each PDL kernel also lets its own successor start
early (`griddepcontrol.launch_dependents` at its start).

The contract every kernel launched with PDL keeps: every program calls `wait` (through `pdl_begin`) before
it reads anything an earlier kernel wrote or writes anything an earlier kernel reads, and before it exits.
Then each kernel completes after its predecessor, so a kernel that reads a tensor written two kernels back
is safe too. Kernels launched without PDL (cuBLAS, PyTorch ops) serialize as always.
"""

from __future__ import annotations

import functools

import torch

from pagedllm import envs
from pagedllm.triton_utils import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: CUDA compute capability >= 9.0, Triton present, and
    `PAGEDLLM_PDL` not 0."""
    if not HAS_TRITON or device.type != "cuda":
        return False
    return _pdl_on(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _pdl_on(index: int) -> bool:
    return bool(envs.PAGEDLLM_PDL) and torch.cuda.get_device_capability(index) >= (9, 0)


if HAS_TRITON:

    @triton.jit
    def pdl_begin(PDL: tl.constexpr):
        """Lets the next kernel start its programs, then waits for the previous kernel's completion."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def prefetch_l2(ptrs):
        """Asks L2 for the 128-byte lines at `ptrs` (a hint: nothing waits for it, nothing faults)."""
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
        )
