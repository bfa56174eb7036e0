"""C kernels for the CPU path, built on first use and loaded with ctypes.

`paged_attn.c` (decode attention over the paged KV cache, cache writes), `prefill_attn.c` (blocked causal
prefill attention over the paged cache), `layers.c` (fused residual + RMSNorm, rotary embedding) and
`activation.c` (SiLU-and-mul), `gguf_mm.c` and `gguf_tile.c` (matmuls with packed GGUF weights),
`decode_stack.c` (a Llama decode step's layers, calling the others), `kv_fp8.c` (FP8 KV-cache tables and
quantizing writes). Each file is compiled with the system C compiler (about a second each) into one shared
library in a cache directory keyed by the sources, the compiler and the CPU: no torch headers, no build step
at install time. Where there is no compiler, or `PAGEDLLM_CPU_KERNELS=0`, `load()` returns None and every
caller keeps its pure-PyTorch path (the reference the kernels are tested against).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from pagedllm import envs
from pagedllm.logger import init_logger

logger = init_logger(__name__)

_DIR = Path(__file__).parent
# Per-file flags. paged_attn.c wants -ffast-math (vectorised expf, reassociated dot products); layers.c
# must not contract a*b - c*d into FMAs, so that the rotary embedding rounds exactly like PyTorch's.
_SOURCES = {
    "paged_attn.c": ["-ffast-math"],
    "prefill_attn.c": ["-ffast-math"],
    "prefill_attn_dot.c": ["-ffast-math"],
    "layers.c": ["-fno-math-errno", "-ffp-contract=off"],
    "activation.c": ["-ffast-math"],
    "gguf_act.c": ["-fno-math-errno"],
    "gguf_mm.c": ["-fno-math-errno"],
    "gguf_tile.c": ["-fno-math-errno", "-ffp-contract=off"],
    "decode_stack.c": [],
    "kv_fp8.c": ["-fno-math-errno", "-ffp-contract=off"],  # rounds as torch: no fast-math
}
_COMMON = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-std=gnu11"]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    root = envs.PAGEDLLM_CACHE_DIR
    return Path(root) / "cpu_kernels"


def _cpu_flags() -> bytes:
    """The library is built with -march=native: key it by the CPU's flags as well as the sources."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith((b"flags", b"Features"))), b"")
    except OSError:
        return b""


def _run(cmd: list[str]) -> str | None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return None if proc.returncode == 0 else f"{' '.join(cmd)}\n{proc.stderr[-2000:]}"


def _build() -> ctypes.CDLL | None:
    cc = envs.CC or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        logger.info("CPU kernels: no C compiler found; using the PyTorch paths")
        return None
    h = hashlib.sha256(cc.encode() + _cpu_flags() + repr((_SOURCES, _COMMON)).encode())
    for name in [*_SOURCES, "bf16.h", "fp8.h", "gguf_common.h"]:
        h.update((_DIR / name).read_bytes())
    out_dir = _cache_dir()
    lib_path = out_dir / f"pagedllm_cpu_{h.hexdigest()[:16]}.so"
    if not lib_path.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # concurrent builders each use their own
            objs = []
            for name, flags in _SOURCES.items():
                obj = os.path.join(tmp, name + ".o")
                err = _run([cc, *_COMMON, *flags, "-c", str(_DIR / name), "-o", obj])
                if err:
                    logger.warning("CPU kernels failed to build; using the PyTorch paths:\n%s", err)
                    return None
                objs.append(obj)
            so = os.path.join(tmp, "lib.so")
            err = _run([cc, "-shared", "-fopenmp", "-o", so, *objs, "-lm"])
            if err:
                logger.warning("CPU kernels failed to link; using the PyTorch paths:\n%s", err)
                return None
            os.replace(so, lib_path)  # atomic
    return ctypes.CDLL(str(lib_path))


def load() -> ctypes.CDLL | None:
    """The kernels' library (built on the first call), or None where it cannot be had."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            if envs.PAGEDLLM_CPU_KERNELS:
                try:
                    _lib = _build()
                except Exception as e:  # a broken toolchain must not stop the engine
                    logger.warning("CPU kernels unavailable (%s); using the PyTorch paths", e)
                    _lib = None
            _tried = True
    return _lib


def declare(lib: ctypes.CDLL, name: str, restype: object, argtypes: Sequence[object]) -> None:
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)
