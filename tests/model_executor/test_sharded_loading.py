"""Sharded loading: with several ranks the safetensors tensors are views of a private memory map (no copy of
the whole tensor), so a rank narrowing a weight to its shard reads only those pages."""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file

from pagedllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator


def test_mapped_tensors_equal_read_ones_and_are_views(tmp_path) -> None:  # noqa: ANN001
    tensors = {
        "w": torch.randn(64, 32),
        "ids": torch.arange(10, dtype=torch.int64),
        "bf": torch.randn(3, 5).bfloat16(),
        "h": torch.randn(7).half(),
    }
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path)
    read = dict(safetensors_weights_iterator([path]))
    mapped = dict(safetensors_weights_iterator([path], mapped=True))
    assert read.keys() == mapped.keys() == tensors.keys()
    size = os.path.getsize(path)
    for name, t in mapped.items():
        assert t.dtype == tensors[name].dtype and torch.equal(t, read[name])
        assert t.untyped_storage().nbytes() == size  # a view of the file's mapping, not a copy
    shard = mapped["w"].narrow(0, 32, 32).clone()  # what a rank's weight loader does
    assert torch.equal(shard, tensors["w"][32:])
    mapped["w"].zero_()  # a private mapping: the file is unchanged
    assert torch.equal(dict(safetensors_weights_iterator([path]))["w"], tensors["w"])
