"""Per-step state visible to attention layers during a model forward (set by the model runner)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_attn_metadata: dict[str, Any] | None = None


@contextmanager
def set_forward_context(attn_metadata: dict[str, Any] | None) -> Iterator[None]:
    """attn_metadata maps an attention layer's name to its backend metadata for this step."""
    global _attn_metadata
    prev = _attn_metadata
    _attn_metadata = attn_metadata
    try:
        yield
    finally:
        _attn_metadata = prev


def get_attn_metadata(layer_name: str) -> Any:
    if _attn_metadata is None:
        raise RuntimeError("attention called outside set_forward_context")
    return _attn_metadata[layer_name]


_split_hook: Any = None
"""Piecewise CUDA-graph capture (worker/piecewise_graph.py): while set, every attention layer hands its q/k/v
to this callable instead of attending (`hook(layer, q, k, v, rotary) -> output`)."""


@contextmanager
def set_split_hook(hook: Any) -> Iterator[None]:
    global _split_hook
    prev = _split_hook
    _split_hook = hook
    try:
        yield
    finally:
        _split_hook = prev


def get_split_hook() -> Any:
    return _split_hook
