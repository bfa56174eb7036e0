"""Piecewise CUDA graphs' CPU-side choices (worker/piecewise_graph.py): the padded token counts and which models
they apply to. The graphs themselves are tested on the GPU (tests/gpu/test_piecewise_graph_gpu.py)."""

from __future__ import annotations

import torch

from pagedllm.worker.piecewise_graph import piecewise_sizes, plain_dense_model


def test_sizes_pad_by_at_most_64_up_to_1024() -> None:
    sizes = piecewise_sizes(2048)
    assert sizes[0] == 64 and sizes[-1] == 2048 and sizes == sorted(set(sizes))
    small = [s for s in sizes if s <= 1024]
    assert small == list(range(64, 1025, 64))
    assert all(b - a == 256 for a, b in zip(sizes[len(small) - 1 :], sizes[len(small) :]))
    assert piecewise_sizes(100) == [64]  # capped by the step's token budget
    assert piecewise_sizes(32) == []


def test_moe_models_are_left_eager() -> None:
    class SparseMoeBlock(torch.nn.Module):
        pass

    dense = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    assert plain_dense_model(dense)
    assert not plain_dense_model(torch.nn.Sequential(torch.nn.Linear(4, 4), SparseMoeBlock()))
