"""`gloo` (CPU tensors) and `nccl` (GPU tensors) backends: the trainer (rank 0) broadcasts each tensor to a
process group it shares with every engine worker (ranks rank_offset + worker index).

The group is a standalone torch.distributed process group on its own TCPStore (vLLM's
StatelessProcessGroup idea): it does not touch the default process group of either side, so a trainer
already inside torch.distributed can still join. init_info: master_address, master_port, rank_offset,
world_size (the trainer's process is rank 0 and hosts the store).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pagedllm.distributed.weight_transfer.base import WeightTransferEngine, parse_update_list

DEFAULT_TIMEOUT_S = 600.0


def _check_init_info(init_info: dict[str, Any]) -> tuple[str, int, int, int]:
    missing = [k for k in ("master_address", "master_port", "world_size") if k not in init_info]
    if missing:
        raise ValueError(f"init_info: missing {', '.join(missing)} (needs master_address, master_port, world_size)")
    world = int(init_info["world_size"])
    if world < 2:
        raise ValueError(f"init_info.world_size: must be >= 2 (trainer + engine workers), got {world}")
    return str(init_info["master_address"]), int(init_info["master_port"]), int(init_info.get("rank_offset", 1)), world


class TransferGroup:
    """A process group plus the TCPStore it was built on (kept alive with it: rank 0 hosts the store)."""

    def __init__(self, group: Any, store: Any, rank: int, world_size: int) -> None:
        self.group, self.store, self.rank, self.world_size = group, store, rank, world_size

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.group.broadcast([tensor], opts).wait()


def make_group(backend: str, address: str, port: int, rank: int, world: int, timeout_s: float) -> TransferGroup:
    """A process group of `world` ranks on its own TCPStore (rank 0 hosts the store)."""
    if not 0 <= rank < world:
        raise ValueError(f"init_info: rank {rank} is outside world_size {world}")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world, is_master=rank == 0, timeout=timeout)
    prefix = dist.PrefixStore("pagedllm-weight-transfer", store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefix, rank, world, timeout)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(prefix, rank, world, opts)  # type: ignore[assignment]
    return TransferGroup(group, store, rank, world)


class _CollectiveEngine(WeightTransferEngine):
    transfer_device = "cpu"

    def __init__(self, config: dict[str, Any], device: torch.device, rank: int = 0) -> None:
        super().__init__(config, device, rank)
        self.group: TransferGroup | None = None

    def init_transfer_engine(self, init_info: dict[str, Any]) -> None:
        address, port, offset, world = _check_init_info(init_info)
        timeout = float(init_info.get("timeout_s", DEFAULT_TIMEOUT_S))
        self.group = make_group(self.backend, address, port, offset + self.rank, world, timeout)

    def _device(self) -> torch.device:
        return torch.device("cpu") if self.transfer_device == "cpu" else self.device

    def receive_weights(self, update_info: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        if self.group is None:
            raise ValueError(f"{self.backend}: call init_weight_transfer_engine first (no group joined)")
        out = []
        dev = self._device()
        # Every tensor is received before any is checked: the trainer's broadcasts must all complete even
        # when the update is then rejected (else the trainer would hang).
        for name, dtype, shape in parse_update_list(update_info):
            buf = torch.empty(shape, dtype=dtype, device=dev)
            self.group.broadcast(buf, 0)
            out.append((name, buf))
        return out

    def shutdown(self) -> None:
        self.group = None

    @classmethod
    def trainer_init(cls, init_info: dict[str, Any]) -> TransferGroup:
        """Run in the trainer's process: hosts the store, joins as rank 0; returns the group."""
        address, port, _, world = _check_init_info(init_info)
        return make_group(cls.backend, address, port, 0, world, float(init_info.get("timeout_s", DEFAULT_TIMEOUT_S)))

    @classmethod
    def trainer_send_weights(cls, iterator: Iterator[tuple[str, torch.Tensor]], trainer_args: Any) -> None:
        """Broadcast each tensor, in the order of the update_info the engine got. trainer_args: the group
        from `trainer_init`, or {"group": group}."""
        group = trainer_args["group"] if isinstance(trainer_args, dict) else trainer_args
        for _, tensor in iterator:
            t = tensor.detach().contiguous()
            if cls.transfer_device == "cpu":
                t = t.cpu()
            group.broadcast(t, 0)


class GlooWeightTransferEngine(_CollectiveEngine):
    """CPU tensors over gloo (TCP); the engine copies them to its device when applying."""

    backend = "gloo"
    transfer_device = "cpu"


class NCCLWeightTransferEngine(_CollectiveEngine):
    """GPU tensors over NCCL, received directly on the worker's GPU (trainer and engine on different GPUs)."""

    backend = "nccl"
    transfer_device = "cuda"
