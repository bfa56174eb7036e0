"""The `checkpoint` backend: the trainer writes safetensors files, the engine reads them (any process,
any machine with the same file system). update_info: {"checkpoint_path": DIR}."""

from __future__ import annotations

import os
from typing import Any

import torch

from pagedllm.distributed.weight_transfer.base import WeightTransferEngine
from pagedllm.model_executor.model_loader.weight_utils import get_safetensors_files, safetensors_weights_iterator


class CheckpointWeightTransferEngine(WeightTransferEngine):
    backend = "checkpoint"

    def receive_weights(self, update_info: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        path = update_info.get("checkpoint_path")
        if not isinstance(path, str) or not path:
            raise ValueError("update_info.checkpoint_path: expected the directory of a safetensors checkpoint")
        if not os.path.isdir(path):
            raise ValueError(f"update_info.checkpoint_path: {path!r} is not a directory")
        files = get_safetensors_files(path)
        if not files:
            raise ValueError(f"update_info.checkpoint_path: no *.safetensors files in {path!r}")
        return list(safetensors_weights_iterator(files))

    @classmethod
    def trainer_send_weights(cls, iterator: Any, trainer_args: Any) -> None:
        """Writes the tensors as one safetensors file in `trainer_args["checkpoint_path"]`."""
        from safetensors.torch import save_file

        path = trainer_args["checkpoint_path"]
        os.makedirs(path, exist_ok=True)
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in iterator}
        save_file(tensors, os.path.join(path, "model.safetensors"))
