"""Diagnostics: log every Triton kernel compiled in this process (`PAGEDLLM_LOG_TRITON_COMPILES=FILE`).

A Triton kernel compiles once per specialization key (dtypes, constexprs, and integer arguments that are
1 or divisible by 16), also when the binary is in the on-disk cache. A compile that happens after the
engine's start-up is a stall inside a timed run; this log names the kernel and the key that caused it.
"""

from __future__ import annotations

import time
from typing import Any

from pagedllm import envs

_T0 = time.perf_counter()
_phase = "start-up"


def set_phase(phase: str) -> None:
    """Label later compiles (e.g. "serving" once warm-up and graph capture are done)."""
    global _phase
    _phase = phase


def install() -> None:
    """Install the Triton compile hook when `PAGEDLLM_LOG_TRITON_COMPILES` names a file."""
    path = envs.PAGEDLLM_LOG_TRITON_COMPILES
    if not path:
        return
    try:
        from triton import knobs
    except ImportError:
        return

    def hook(*, key: Any, repr: str, fn: Any, compile: Any, is_manual_warmup: bool, already_compiled: bool) -> bool:
        with open(path, "a") as f:
            # The key on the same line: the argument types and constexprs that tell two variants apart.
            f.write(f"{time.perf_counter() - _T0:9.3f}s {_phase}: {' '.join(repr.split())[:400]} key={key}\n")
        return False  # go on compiling

    knobs.runtime.jit_cache_hook = hook
