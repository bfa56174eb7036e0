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
    max_item_tokens: int | None = None
    """`disable_chunked_mm_input` (an image is never split across steps): the step token budget, which every
    image's placeholder run must fit (a longer one is rejected when the request is added); None: no limit."""

    @classmethod
    def from_args(
        cls,
        limit_mm_per_prompt: dict[str, Any] | None,
        mm_processor_kwargs: dict[str, Any] | None,
        allowed_local_media_path: str,
        allowed_media_domains: list[str] | None,
        max_item_tokens: int | None = None,
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
        kwargs = dict(mm_processor_kwargs or {})
        return cls(limits, kwargs, allowed_local_media_path or "", allowed_media_domains, max_item_tokens)

    def limit(self, modality: str) -> int:
        return self.limit_per_prompt.get(modality, DEFAULT_LIMIT_PER_PROMPT)


def requires_whole_mm_items(hf_config: Any) -> bool:
    """Whether the model's image tokens attend to each other, so an image must never be split across steps
    (its class's `requires_whole_mm_items`; False for text-only and unknown architectures)."""
    from pagedllm.model_executor.model_loader.loader import get_architectures
    from pagedllm.model_executor.models.registry import get_model_class

    try:
        cls = get_model_class(get_architectures(hf_config))
    except (ValueError, KeyError, ImportError):
        return False
    return bool(getattr(cls, "requires_whole_mm_items", False))
