"""Weight transfer engines (vLLM's `vllm.distributed.weight_transfer`): how new weights reach the workers.

Engine side (one instance per worker): `init_transfer_engine(init_info)` once, then per update
`receive_weights(update_info)` returns the HF-named tensors, which the worker applies atomically through the
model's own weight loaders (`apply.apply_weight_update`). Trainer side: the class methods `trainer_init` and
`trainer_send_weights`, run in the trainer's process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


def dtype_from_name(name: str) -> torch.dtype:
    """'bfloat16' / 'torch.bfloat16' -> torch.bfloat16 (ValueError naming the value otherwise)."""
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"update_info.dtype_names: unknown dtype {name!r}; expected one of {', '.join(_DTYPES)}")
    return _DTYPES[key]


def parse_update_list(update_info: dict[str, Any]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """update_info {"names", "dtype_names", "shapes"} -> [(name, dtype, shape)], checked for consistency."""
    for key in ("names", "dtype_names", "shapes"):
        if key not in update_info:
            raise ValueError(f"update_info: missing {key!r} (expected names, dtype_names and shapes)")
    names, dtypes, shapes = update_info["names"], update_info["dtype_names"], update_info["shapes"]
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(
            f"update_info: names ({len(names)}), dtype_names ({len(dtypes)}) and shapes ({len(shapes)}) "
            "must have the same length"
        )
    out = []
    for name, dt, shape in zip(names, dtypes, shapes):
        if not isinstance(name, str):
            raise ValueError(f"update_info.names: expected strings, got {name!r}")
        if any(not isinstance(s, int) or s < 0 for s in shape):
            raise ValueError(f"update_info.shapes: tensor {name!r} has an invalid shape {shape!r}")
        out.append((name, dtype_from_name(dt), tuple(shape)))
    return out


class WeightTransferEngine(ABC):
    """One worker's end of a weight-transfer channel."""

    backend: str = ""

    def __init__(self, config: dict[str, Any], device: torch.device, rank: int = 0) -> None:
        self.config = config
        self.device = device
        self.rank = rank
        """This worker's index among the engine's workers (added to `rank_offset` for collectives)."""

    def init_transfer_engine(self, init_info: dict[str, Any]) -> None:  # noqa: B027 - optional
        """Join the trainer (collective backends); nothing to do for the others."""

    @abstractmethod
    def receive_weights(self, update_info: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        """All tensors of one update, HF-named, before anything is applied."""

    def shutdown(self) -> None:  # noqa: B027 - optional
        """Leave the group / release resources."""

    @classmethod
    def trainer_init(cls, init_info: dict[str, Any]) -> Any:
        raise NotImplementedError(f"{cls.__name__}: the {cls.backend!r} backend has no trainer-side channel")

    @classmethod
    def trainer_send_weights(cls, iterator: Iterator[tuple[str, torch.Tensor]], trainer_args: Any) -> None:
        raise NotImplementedError(f"{cls.__name__}: the {cls.backend!r} backend has no trainer-side channel")
