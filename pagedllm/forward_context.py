"""Per-step state visible to attention layers during a model forward (set by the model runner)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

_attn_metadata: dict[str, Any] | None = None

_split_hook: Any = None
"""Piecewise CUDA-graph capture (worker/piecewise_graph.py): while set, every attention layer hands its q/k/v
to this callable instead of attending (`hook(layer, q, k, v, rotary) -> output`)."""


@contextmanager
def _setting(name: str, value: Any) -> Iterator[None]:
    """This module's global `name` set to `value` for the block, then restored (blocks nest)."""
    state = globals()
    prev = state[name]
    state[name] = value
    try:
        yield
    finally:
        state[name] = prev


def set_forward_context(attn_metadata: dict[str, Any] | None) -> AbstractContextManager[None]:
    """attn_metadata maps an attention layer's name to its backend metadata for this step."""
    return _setting("_attn_metadata", attn_metadata)


def get_attn_metadata(layer_name: str) -> Any:
    if _attn_metadata is None:
        raise RuntimeError("attention called outside set_forward_context")
    return _attn_metadata[layer_name]


def set_split_hook(hook: Any) -> AbstractContextManager[None]:
    return _setting("_split_hook", hook)


def get_split_hook() -> Any:
    return _split_hook
