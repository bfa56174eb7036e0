"""Per-request pooling parameters (vLLM's `PoolingParams`) and the plain-data pooled result that crosses
the core/front-end boundary (`PooledData`)."""

from __future__ import annotations

from typing import Literal

import msgspec
import numpy as np
import torch

from pagedllm.sampling_params import RequestOutputKind

PoolingTask = Literal["embed", "classify", "score", "encode", "token_embed", "token_classify", "reward"]
POOLING_TASKS: tuple[str, ...] = ("embed", "classify", "score", "encode", "token_embed", "token_classify", "reward")


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True):  # type: ignore[call-arg]
    """As vLLM's: `truncate_prompt_tokens` (-1: the model's max length; k: keep the last k tokens),
    `dimensions` (Matryoshka truncation of embeddings), `normalize` (embeddings; None: the model's
    default), `use_activation` (softmax / sigmoid on classification and score logits; None: True),
    `task` (set by the `LLM` / server method that sends the request)."""

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    task: str | None = None

    # Front-end plumbing shared with SamplingParams: a pooling request is one output, given when finished.
    @property
    def n(self) -> int:
        return 1

    @property
    def output_kind(self) -> RequestOutputKind:
        return RequestOutputKind.FINAL_ONLY

    def clone(self, **changes: object) -> PoolingParams:
        return msgspec.structs.replace(self, **changes)

    def verify(self, task: str, supported_tasks: tuple[str, ...], hidden_size: int, matryoshka: bool) -> None:
        """ValueError naming the field for a task the model does not run or a bad `dimensions`."""
        if task not in POOLING_TASKS:
            raise ValueError(f"task: unknown pooling task {task!r}; expected one of {', '.join(POOLING_TASKS)}")
        if task not in supported_tasks:
            raise ValueError(
                f"task: this model does not support the pooling task {task!r} "
                f"(it supports: {', '.join(supported_tasks)})"
            )
        if self.dimensions is not None:
            if task not in ("embed", "token_embed"):
                raise ValueError(f"dimensions: only applies to embeddings, not to the task {task!r}")
            if not matryoshka:
                raise ValueError("dimensions: this model does not support Matryoshka representation (dimensions)")
            if not 1 <= self.dimensions <= hidden_size:
                raise ValueError(f"dimensions: must be in [1, {hidden_size}], got {self.dimensions}")
        t = self.truncate_prompt_tokens
        if t is not None and t != -1 and t < 1:
            raise ValueError(f"truncate_prompt_tokens: must be -1 or a positive integer, got {t}")


class PooledData(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    """A pooled tensor as bytes (float32, C order) + shape: cheap to encode across the process boundary."""

    data: bytes
    shape: list[int]

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> PooledData:
        arr = t.detach().to("cpu", torch.float32).contiguous().numpy()
        return cls(arr.tobytes(), list(arr.shape))

    def to_tensor(self) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(self.data, dtype=np.float32).reshape(self.shape).copy())
