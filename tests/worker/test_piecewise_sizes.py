"""Piecewise CUDA graphs' CPU-side choices (worker/piecewise_graph.py): the padded token counts and which models
they apply to. The graphs themselves are tested on the GPU (tests/gpu/test_piecewise_graph_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedllm.worker.piecewise_graph import (
    graph_tokens_for,
    matmul_weights,
    mixed_graph_max_tokens,
    piecewise_sizes,
    plain_dense_model,
)


def test_sizes_pad_by_at_most_64_up_to_1024() -> None:
    sizes = piecewise_sizes(2048)
    assert sizes[0] == 64 and sizes[-1] == 2048 and sizes == sorted(set(sizes))
    small = [s for s in sizes if s <= 1024]
    assert small == list(range(64, 1025, 64))
    assert all(b - a == 256 for a, b in zip(sizes[len(small) - 1 :], sizes[len(small) :]))
    assert piecewise_sizes(100) == [64]  # capped by the step's token budget
    assert piecewise_sizes(32) == []


def test_sizes_above_4096_pad_by_at_most_512() -> None:
    sizes = piecewise_sizes(16384)
    assert len(sizes) == 52 and sizes[-1] == 16384 and sizes == sorted(set(sizes))
    assert piecewise_sizes(4096) == [s for s in sizes if s <= 4096]
    big = [s for s in sizes if s >= 4096]
    assert all(b - a == 512 for a, b in zip(big, big[1:]))
    assert all((b - a - 1) / (a + 1) < 0.125 for a, b in zip(big, big[1:]))  # under 12.5% padded rows


def _llama_shaped(hidden: int, inter: int, layers: int, vocab: int) -> torch.nn.Module:
    """A decoder's weight shapes on the meta device (no memory): embedding, per layer q/k/v/o and the MLP."""
    mods: list[torch.nn.Module] = [torch.nn.Embedding(vocab, hidden, device="meta")]
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden, bias=False, device="meta") for _ in range(4)]
        mods += [torch.nn.Linear(hidden, inter, bias=False, device="meta") for _ in range(2)]
        mods += [torch.nn.Linear(inter, hidden, bias=False, device="meta"), torch.nn.LayerNorm(hidden, device="meta")]
    return torch.nn.Sequential(*mods)


def test_graph_tokens_grow_as_the_model_shrinks() -> None:
    """Small models' big prefill steps are host-bound when launched eagerly, so they get graphs up to the step
    budget; an 8B model's stay at the 2,048-token floor (its GEMMs outlast the launches)."""
    smol = graph_tokens_for(_llama_shaped(576, 1536, 30, 49152), 30, 49152)
    eight_b = graph_tokens_for(_llama_shaped(4096, 14336, 32, 128256), 32, 128256)
    assert smol >= 16384
    assert eight_b == 2048
    # the vocabulary-sized matrices do not count: a bigger vocabulary alone changes nothing
    assert graph_tokens_for(_llama_shaped(576, 1536, 30, 100000), 30, 100000) == smol


def test_graph_tokens_count_logical_weights_of_packed_layers() -> None:
    """The engine's linear layers count by their logical sizes, so a quantized model (int4 packed eight to an
    int32) is not taken for a model eight times smaller."""
    from pagedllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    with torch.device("meta"):
        dense = torch.nn.Sequential(ColumnParallelLinear(4096, 28672, bias=False), RowParallelLinear(14336, 4096))
    assert matmul_weights(dense, 128256) == 4096 * 28672 + 14336 * 4096
    for lin in dense:
        lin.weight = torch.nn.Parameter(torch.empty(lin.weight.shape[0], lin.weight.shape[1] // 8, device="meta"))
    assert matmul_weights(dense, 128256) == 4096 * 28672 + 14336 * 4096


def test_moe_models_are_left_eager() -> None:
    class SparseMoeBlock(torch.nn.Module):
        pass

    dense = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    assert plain_dense_model(dense)
    assert not plain_dense_model(torch.nn.Sequential(torch.nn.Linear(4, 4), SparseMoeBlock()))


def _runner(model: torch.nn.Module, layers: int, vocab: int, budget: int) -> SimpleNamespace:
    """The fields of a `ModelRunner` that `mixed_graph_max_tokens` reads (a plain dense model on CUDA)."""
    return SimpleNamespace(
        model=model, max_num_tokens=budget, cuda_graphs=object(), lora=None, spec=None, mm=None,
        config=SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1)),
        model_config=SimpleNamespace(runner_type="generate", num_layers=layers, vocab_size=vocab),
    )  # fmt: skip


def test_graphed_step_size_by_model_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    smol = _runner(_llama_shaped(576, 1536, 30, 49152), 30, 49152, 16384)
    eight_b = _runner(_llama_shaped(4096, 14336, 32, 128256), 32, 128256, 16384)
    monkeypatch.delenv("PAGEDLLM_PIECEWISE_MAX_TOKENS", raising=False)
    assert mixed_graph_max_tokens(smol) == 16384  # the step budget caps the model's own figure
    assert mixed_graph_max_tokens(eight_b) == 2048
    smol.max_num_tokens = 8192
    assert mixed_graph_max_tokens(smol) == 8192
    monkeypatch.setenv("PAGEDLLM_PIECEWISE_MAX_TOKENS", "1024")  # a set value caps every model
    assert mixed_graph_max_tokens(smol) == 1024 and mixed_graph_max_tokens(eight_b) == 1024
    monkeypatch.setenv("PAGEDLLM_PIECEWISE_MAX_TOKENS", "0")
    assert mixed_graph_max_tokens(smol) == 0
