"""The plain data one image carries through the engine: a `MultiModalFeature` per image of a request
(its hash, where its placeholder tokens sit in the prompt, and its preprocessed tensors)."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import torch


class TensorData(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    """A CPU tensor as bytes (msgspec cannot carry torch tensors across the core-process boundary)."""

    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> TensorData:
        t = t.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            t = t.float()
        return cls(str(t.dtype).removeprefix("torch."), list(t.shape), t.numpy().tobytes())

    def to_tensor(self) -> torch.Tensor:
        arr = np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)
        return torch.from_numpy(arr.copy())


class MultiModalFeature(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    """One image of a request. Its placeholder tokens are prompt positions [offset, offset + length); the
    encoder's output for it has `length` rows, one per placeholder token."""

    modality: str
    identifier: str
    """Hash of the preprocessed tensors (hex): the encoder-cache key and the prefix-cache extra key."""
    offset: int
    length: int
    data: dict[str, TensorData]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.to_tensor() for k, v in self.data.items()}


def overlapping(features: list[Any], start: int, end: int) -> list[tuple[int, Any]]:
    """(index, feature) of the features whose placeholder range meets token positions [start, end)."""
    return [(i, f) for i, f in enumerate(features) if f.offset < end and f.offset + f.length > start]
