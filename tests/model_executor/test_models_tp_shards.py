"""Tensor-parallel weight sharding: the shards of ranks 0 and 1 of TP=2 reassemble to the TP=1 weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedllm.distributed.parallel_state import set_tensor_parallel_state
from pagedllm.model_executor.model_loader import load_model
from tests.utils_model import VOCAB, make_model_config, make_tiny_hf_model

torch.set_num_threads(2)

TP = 2


def _split_qkv(t: torch.Tensor, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = layer.num_heads * layer.head_size
    kv = layer.num_kv_heads * layer.head_size
    return t[:q], t[q : q + kv], t[q + kv : q + 2 * kv]


def _reassemble(name: str, shards: list[torch.Tensor], modules: list[nn.Module]) -> torch.Tensor:
    """Full tensor from the per-rank parameters `shards` (modules: the owning module on each rank)."""
    leaf = name.rsplit(".", 1)[-1]
    mod = modules[0]
    if ".qkv_proj." in name:
        parts = [_split_qkv(s, m) for s, m in zip(shards, modules)]
        q = torch.cat([p[0] for p in parts])
        replicas = mod.num_kv_head_replicas
        for r in range(TP):  # replicated KV heads must be identical copies
            torch.testing.assert_close(parts[r][1], parts[r - r % replicas][1], rtol=0, atol=0)
            torch.testing.assert_close(parts[r][2], parts[r - r % replicas][2], rtol=0, atol=0)
        k = torch.cat([parts[r][1] for r in range(0, TP, replicas)])
        v = torch.cat([parts[r][2] for r in range(0, TP, replicas)])
        return torch.cat([q, k, v])
    if ".gate_up_proj." in name:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    if (".o_proj." in name or ".down_proj." in name) and leaf == "weight":
        return torch.cat(shards, dim=1)
    if "embed_tokens" in name or "lm_head" in name:
        return torch.cat(shards, dim=0)[:VOCAB]
    # Replicated: norms and row-parallel biases.
    for s in shards[1:]:
        torch.testing.assert_close(s, shards[0], rtol=0, atol=0)
    return shards[0]


@pytest.mark.parametrize(
    "variant",
    ["llama", "llama3_tied", "llama_linear_rope_bias", "mistral_sliding", "qwen2", "qwen3", "qwen3_mqa"],
)
def test_tp2_shards_reassemble(variant: str, tmp_path) -> None:  # noqa: ANN001
    hf = make_tiny_hf_model(variant, tmp_path)
    cfg = make_model_config(str(tmp_path), hf.config)
    full = load_model(cfg, "safetensors", torch.device("cpu"))
    ranks = []
    for rank in range(TP):
        with set_tensor_parallel_state(rank, TP):
            ranks.append(load_model(cfg, "safetensors", torch.device("cpu")))

    full_params = dict(full.named_parameters())
    rank_params = [dict(m.named_parameters()) for m in ranks]
    rank_modules = [dict(m.named_modules()) for m in ranks]
    assert all(set(p) == set(full_params) for p in rank_params)
    sharded = 0
    for name, ref in full_params.items():
        shards = [p[name] for p in rank_params]
        owner = name.rsplit(".", 1)[0]
        got = _reassemble(name, shards, [mods[owner] for mods in rank_modules])
        assert got.shape == ref[: got.shape[0]].shape, name
        torch.testing.assert_close(got, ref[: got.shape[0]], rtol=0, atol=0, msg=name)
        sharded += shards[0].numel() < ref.numel()
    assert sharded > 0

    # The TP=1 model holds exactly the HF weights (fused q/k/v and gate/up in order).
    hf_sd = hf.state_dict()
    for name, p in full_params.items():
        if ".qkv_proj." in name:
            leaf = name.rsplit(".", 1)[-1]
            pre = name.split(".qkv_proj.")[0]
            ref = torch.cat([hf_sd[f"{pre}.{x}_proj.{leaf}"] for x in "qkv"])
        elif ".gate_up_proj." in name:
            leaf = name.rsplit(".", 1)[-1]
            pre = name.split(".gate_up_proj.")[0]
            ref = torch.cat([hf_sd[f"{pre}.gate_proj.{leaf}"], hf_sd[f"{pre}.up_proj.{leaf}"]])
        else:
            ref = hf_sd[name]
        torch.testing.assert_close(p[: ref.shape[0]], ref, rtol=0, atol=0, msg=name)
    if hf.config.tie_word_embeddings:
        assert full.lm_head.weight is full.model.embed_tokens.weight
        assert ranks[1].lm_head.weight is ranks[1].model.embed_tokens.weight


def test_kv_head_replication_layout() -> None:
    """1 KV head, TP=2: each rank holds its half of the query heads and a full copy of the KV head."""
    from pagedllm.model_executor.layers.fused_linear import QKVParallelLinear

    hd, heads, kv_heads, hidden = 4, 4, 1, 8
    w = torch.randn((heads + 2 * kv_heads) * hd, hidden)
    q, k, v = w.split([heads * hd, kv_heads * hd, kv_heads * hd])
    for rank in range(TP):
        with set_tensor_parallel_state(rank, TP):
            layer = QKVParallelLinear(hidden, hd, heads, kv_heads, bias=False)
        assert (layer.num_heads, layer.num_kv_heads, layer.num_kv_head_replicas) == (2, 1, 2)
        for sid, part in zip("qkv", (q, k, v)):
            layer.weight.weight_loader(layer.weight, part, sid)
        expect = torch.cat([q[rank * 2 * hd : (rank + 1) * 2 * hd], k, v])
        assert torch.equal(layer.weight, expect)
