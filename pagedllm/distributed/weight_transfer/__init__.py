"""In-place weight updates from a trainer (vLLM's `vllm.distributed.weight_transfer`).

`LLM(weight_transfer_config={"backend": ...})` picks the backend; see `base` for the protocol."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.distributed.weight_transfer.base import WeightTransferEngine
from pagedllm.distributed.weight_transfer.checkpoint import CheckpointWeightTransferEngine
from pagedllm.distributed.weight_transfer.collective import GlooWeightTransferEngine, NCCLWeightTransferEngine

BACKENDS: dict[str, type[WeightTransferEngine]] = {
    "checkpoint": CheckpointWeightTransferEngine,
    "gloo": GlooWeightTransferEngine,
    "nccl": NCCLWeightTransferEngine,
}


def check_weight_transfer_config(config: dict[str, Any] | None) -> None:
    if config is None:
        return
    if not isinstance(config, dict):
        raise ValueError(f"weight_transfer_config: expected a dict like {{'backend': 'gloo'}}, got {config!r}")
    backend = config.get("backend", "nccl")
    if backend == "ipc":
        raise ValueError("weight_transfer_config.backend: 'ipc' is not supported yet; use nccl, gloo or checkpoint")
    if backend not in BACKENDS:
        raise ValueError(f"weight_transfer_config.backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")


def create_weight_transfer_engine(
    config: dict[str, Any] | None, device: torch.device, rank: int = 0
) -> WeightTransferEngine:
    config = config or {"backend": "checkpoint"}
    check_weight_transfer_config(config)
    backend = config.get("backend", "nccl")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("weight_transfer_config.backend: 'nccl' needs a GPU engine; use 'gloo' on the CPU")
    return BACKENDS[backend](config, device, rank)


__all__ = [
    "BACKENDS",
    "CheckpointWeightTransferEngine",
    "GlooWeightTransferEngine",
    "NCCLWeightTransferEngine",
    "WeightTransferEngine",
    "check_weight_transfer_config",
    "create_weight_transfer_engine",
]
