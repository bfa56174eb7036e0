"""Whether Triton is installed (CPU-only installs have none), for every module with Triton kernels: they
import `triton` only when `HAS_TRITON`, so importing them never fails and never compiles anything."""

from __future__ import annotations

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # CPU-only installs
    HAS_TRITON = False


def require_triton() -> None:
    """Raised by the kernel launchers when Triton is missing (callers check `HAS_TRITON` first)."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed: the Triton kernels are unavailable")
