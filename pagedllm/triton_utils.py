"""Whether Triton is installed (CPU-only installs have none), for every module with Triton kernels: they
import `triton` only when `HAS_TRITON`, so importing them never fails and never compiles anything."""

from __future__ import annotations

import functools
from typing import Any

import torch

from pagedllm import envs

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs
    HAS_TRITON = False

HAS_GDC = False
if HAS_TRITON:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

        HAS_GDC = "launch_pdl" in CUDAOptions.__dataclass_fields__
    except ImportError:  # a Triton without grid dependency control: `pdl_args` gives {} and PDL stays False
        pass


def require_triton() -> None:
    """Raised by the kernel launchers when Triton is missing (callers check `HAS_TRITON` first)."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed: the Triton kernels are unavailable")


_COUNTERS: dict[tuple[str, torch.device], torch.Tensor] = {}


def split_counters(device: torch.device, n: int, owner: str = "gemv") -> torch.Tensor:
    """Zeroed int32 counters for a split kernel's hand-off to its last program (split-K GEMVs, the split-row
    argmax), one buffer per `owner` and device, shared by that owner's launches (each leaves them at zero;
    launches of one owner run on one stream). Allocated on the first, eager, call of a shape, before any
    graph capture."""
    cnt = _COUNTERS.get((owner, device))
    if cnt is None or cnt.numel() < n:
        cnt = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
        _COUNTERS[(owner, device)] = cnt
    return cnt


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the grid-size heuristics of the split kernels)."""
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _num_sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


# Programmatic dependent launch (PDL, sm_90+). A kernel launched with it may start while its predecessor in the
# stream still runs: it announces at once that its own successor may launch (`gdc_launch_dependents`) and then
# waits for its predecessor's completion and memory (`gdc_wait`) before it reads or writes anything another
# kernel of the step touches. Only constant data (weights) may be read before the wait: a kernel's pre-wait part
# can run alongside kernels several launches back. At batch 1 the decode step's small kernels (norms, RoPE,
# attention) leave DRAM idle; a GEMV launched early prefetches its first weights into L2 meanwhile.


def pdl_args(device: torch.device) -> dict[str, Any]:
    """Launch keywords for a kernel with a `PDL` constexpr: `{"PDL": mode, "launch_pdl": True}` on a CUDA device
    of compute capability 9 or newer with a Triton that has grid dependency control, mode 1 (the successor may
    launch once every program has started) or 2 (`PAGEDLLM_PDL=late`: once they exit); else `{}` (the kernel's
    default PDL=0, an ordinary launch; `PAGEDLLM_PDL=0`)."""
    if device.type != "cuda":
        return {}
    mode = _pdl_mode(device.index if device.index is not None else torch.cuda.current_device())
    return {"PDL": mode, "launch_pdl": True} if mode else {}


@functools.cache
def _pdl_mode(index: int) -> int:
    setting = envs.PAGEDLLM_PDL.lower()
    if not HAS_GDC or setting == "0" or torch.cuda.get_device_capability(index)[0] < 9:
        return 0
    return 2 if setting == "late" else 1


def pdl_prefetch_plan(rows: int, row_bytes: int, programs: int, device: torch.device) -> tuple[int, int]:
    """(rows to prefetch, rows per prefetching program) for a PDL GEMV over `rows` weight rows of `row_bytes`
    contiguous bytes each in a grid of `programs`: the first rows up to `PAGEDLLM_PDL_PREFETCH_MB`, spread over the
    programs of the grid's first wave (those resident while the predecessor runs; 8 per SM assumed). (0, 1): none
    (a row not a multiple of 16 bytes cannot be bulk-prefetched)."""
    budget = envs.PAGEDLLM_PDL_PREFETCH_MB << 20
    if budget <= 0 or row_bytes % 16 or rows == 0:
        return 0, 1
    pf_rows = min(rows, budget // row_bytes)
    if pf_rows == 0:
        return 0, 1
    wave = max(1, min(programs, num_sms(device) * 8))
    return pf_rows, -(-pf_rows // wave)


if HAS_TRITON:

    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        """A PDL kernel's start: its successor may launch (mode 1); then wait for the predecessor (no-op
        without PDL)."""
        pdl_trigger(PDL)
        pdl_wait(PDL)

    @triton.jit
    def pdl_trigger(PDL: tl.constexpr):
        """The first half of `pdl_enter` (a kernel that prefetches constant data before it waits). Mode 2 never
        triggers: a program's exit counts as its trigger."""
        if PDL == 1:
            gdc_launch_dependents()

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """The second half of `pdl_enter`."""
        if PDL:
            gdc_wait()

    @triton.jit
    def prefetch_l2(ptr, nbytes):
        """One bulk prefetch into L2 of `nbytes` (a multiple of 16) at `ptr` (16-byte aligned), issued by the
        program's first thread (`cp.async.bulk.prefetch`, sm_90+); nothing waits for it."""
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r",
            [ptr, nbytes.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
