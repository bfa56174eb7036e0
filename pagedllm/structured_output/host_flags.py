"""Sequence flags in host memory that a CUDA stream waits on and writes (the driver's stream memory operations),
so that a step's grammar mask can be waited for on the device instead of on the step loop.

Why: with async scheduling a structured step's sampling needs a mask filled on the host from the previous step's
sampled ids. Waiting for it on the step loop keeps the device queue from running ahead (the step turns into a
host round trip). With `cuStreamWaitValue32` the loop enqueues the forward, the wait, the mask's upload, its apply
and the sampling at once, as for a plain step; the grammar server (another process) fills the mask while the
forward runs and then sets the flag. The sampled ids go back the same way: a copy into shared host memory, then
`cuStreamWriteValue32` of the step's number, which the server polls.

The driver API is called through ctypes (libcuda ships with every CUDA driver; torch does not expose these)."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

_WAIT_GEQ = 0x0
"""CU_STREAM_WAIT_VALUE_GEQ: wait until (int32)(*addr - value) >= 0, a cyclic comparison (wraps safely)."""
_WRITE_DEFAULT = 0x0
_HOSTREGISTER_PORTABLE_DEVICEMAP = 0x01 | 0x02


class CudaDriverError(RuntimeError):
    pass


@functools.cache
def _libcuda() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    for name in ("cuStreamWaitValue32_v2", "cuStreamWriteValue32_v2"):
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise CudaDriverError(f"{what} failed with CUDA driver error {rc}")


class RegisteredHostMemory:
    """Host memory (e.g. a shared-memory segment's buffer) registered with the driver as pinned and mapped into
    the device's address space: copies from and to it are true asynchronous DMA (run when the stream reaches them,
    reading what is there then), and the stream can wait on and write its 32-bit words."""

    def __init__(self, address: int, nbytes: int) -> None:
        import torch

        torch.cuda.init()
        lib = _libcuda()
        self.address, self.nbytes = address, nbytes
        _check(lib.cuMemHostRegister_v2(address, nbytes, _HOSTREGISTER_PORTABLE_DEVICEMAP), "cuMemHostRegister")
        dptr = ctypes.c_uint64()
        _check(lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), address, 0), "cuMemHostGetDevicePointer")
        self.device_address = dptr.value
        self._device_index = torch.cuda.current_device()
        self._registered = True

    def device_pointer(self, host_address: int) -> int:
        return self.device_address + (host_address - self.address)

    def wait_geq(self, host_address: int, value: int, stream: Any = None) -> None:
        """The current (or given) stream waits until the int32 at `host_address` is >= value (cyclically)."""
        _check(
            _libcuda().cuStreamWaitValue32_v2(
                _stream_handle(stream, self._device_index),
                self.device_pointer(host_address),
                value & 0xFFFFFFFF,
                _WAIT_GEQ,
            ),
            "cuStreamWaitValue32",
        )

    def write(self, host_address: int, value: int, stream: Any = None) -> None:
        """The current (or given) stream writes `value` to the int32 at `host_address` once the work enqueued
        before it has run."""
        _check(
            _libcuda().cuStreamWriteValue32_v2(
                _stream_handle(stream, self._device_index),
                self.device_pointer(host_address),
                value & 0xFFFFFFFF,
                _WRITE_DEFAULT,
            ),
            "cuStreamWriteValue32",
        )

    def unregister(self) -> None:
        if self._registered:
            self._registered = False
            _libcuda().cuMemHostUnregister(self.address)


def _stream_handle(stream: Any, device_index: int) -> int:
    """The given stream's handle, or the device's current stream's: through the raw getter Triton's launcher uses
    (~1 us; `torch.cuda.current_stream()` builds a Stream object, ~8 us on a GPU host, twice a structured step)."""
    import torch

    if stream is not None:
        return int(stream.cuda_stream)
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(device_index))
    return int(torch.cuda.current_stream(device_index).cuda_stream)


def seq_reached(current: int, wanted: int) -> bool:
    """The cyclic comparison of the stream wait, on the host: (int32)(current - wanted) >= 0."""
    d = (current - wanted) & 0xFFFFFFFF
    return d < 0x80000000
