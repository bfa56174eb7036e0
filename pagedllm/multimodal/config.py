"""Multimodal engine arguments as vLLM names them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_LIMIT_PER_PROMPT = 999
"""vLLM's default: no practical limit unless `limit_mm_per_prompt` sets one."""


@dataclass
class MultiModalConfig:
    limit_per_prompt: dict[str, int] = field(default_factory=dict)
    """Most items per prompt by modality ("image"); unset modalities get `DEFAULT_LIMIT_PER_PROMPT`."""
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)
    """Passed to the HF processor call (per-prompt `mm_processor_kwargs` override them)."""
    allowed_local_media_path: str = ""
    allowed_media_domains: list[str] | None = None

    @classmethod
    def from_args(
        cls,
        limit_mm_per_prompt: dict[str, Any] | None,
        mm_processor_kwargs: dict[str, Any] | None,
        allowed_local_media_path: str,
        allowed_media_domains: list[str] | None,
    ) -> MultiModalConfig:
        limits: dict[str, int] = {}
        for k, v in (limit_mm_per_prompt or {}).items():
            if k not in ("image",):
                raise ValueError(f"limit_mm_per_prompt: unsupported modality {k!r} (only 'image')")
            if isinstance(v, dict):  # vLLM's newer form {"image": {"count": N, ...}}
                v = v.get("count")
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"limit_mm_per_prompt.{k}: expected a non-negative integer, got {v!r}")
            limits[k] = v
        if mm_processor_kwargs is not None and not isinstance(mm_processor_kwargs, dict):
            raise ValueError(f"mm_processor_kwargs: expected a dict, got {type(mm_processor_kwargs).__name__}")
        return cls(limits, dict(mm_processor_kwargs or {}), allowed_local_media_path or "", allowed_media_domains)

    def limit(self, modality: str) -> int:
        return self.limit_per_prompt.get(modality, DEFAULT_LIMIT_PER_PROMPT)
