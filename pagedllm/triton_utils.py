"""Whether Triton is installed (CPU-only installs have none), for every module with Triton kernels: they
import `triton` only when `HAS_TRITON`, so importing them never fails and never compiles anything."""

from __future__ import annotations

import functools

import torch

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # CPU-only installs
    HAS_TRITON = False


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
