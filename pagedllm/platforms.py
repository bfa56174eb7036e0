"""Which device the engine runs on, and what that device can do."""

from __future__ import annotations

import functools

import torch


class Platform:
    @property
    def device_type(self) -> str:
        return "cuda" if self.is_cuda() else "cpu"

    @staticmethod
    def is_cuda() -> bool:
        return torch.cuda.is_available()

    @staticmethod
    @functools.cache
    def cpu_has_native_bf16() -> bool:
        """True when the CPU has AVX-512 BF16 or AMX (what oneDNN needs for fast bf16 matmuls)."""
        try:
            with open("/proc/cpuinfo") as f:
                flags = f.read()
        except OSError:
            return False
        return "avx512_bf16" in flags or "amx_bf16" in flags


current_platform = Platform()
