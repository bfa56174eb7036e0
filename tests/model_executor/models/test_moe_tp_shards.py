"""Tensor parallelism of the routed experts (issue 18): at TP=2 each rank holds the gate/up rows and the
down columns of its half of every expert's intermediate dim; the halves reassemble to the TP=1 weights,
and the two ranks' partial expert outputs sum to the TP=1 output (what the all-reduce adds up)."""

from __future__ import annotations

import torch

from pagedllm.distributed.parallel_state import set_tensor_parallel_state
from pagedllm.model_executor.layers.fused_moe import select_experts, torch_moe
from pagedllm.model_executor.model_loader import load_model
from tests.model_executor.models.tiny_configs import MOE_VARIANTS, tiny_config
from tests.utils_model import make_model_config, make_tiny_hf_model

TP = 2


def test_expert_shards_reassemble_and_partial_outputs_sum(tmp_path) -> None:  # noqa: ANN001
    torch.set_num_threads(2)
    hf = make_tiny_hf_model("qwen2_moe", tmp_path, config=tiny_config(MOE_VARIANTS, "qwen2_moe"))
    cfg = make_model_config(str(tmp_path), hf.config)
    full = load_model(cfg, "safetensors", torch.device("cpu"))
    ranks = []
    for rank in range(TP):
        with set_tensor_parallel_state(rank, TP):
            ranks.append(load_model(cfg, "safetensors", torch.device("cpu")))
    moe = full.model.layers[0].mlp.experts
    parts = [r.model.layers[0].mlp.experts for r in ranks]
    inter = moe.intermediate_size_per_partition
    assert all(p.intermediate_size_per_partition * TP == inter for p in parts)
    gate = torch.cat([p.w13_weight[:, : inter // TP] for p in parts], dim=1)
    up = torch.cat([p.w13_weight[:, inter // TP :] for p in parts], dim=1)
    torch.testing.assert_close(torch.cat([gate, up], dim=1), moe.w13_weight, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([p.w2_weight for p in parts], dim=2), moe.w2_weight, rtol=0, atol=0)

    x = torch.randn(11, hf.config.hidden_size)
    weights, ids = select_experts(full.model.layers[0].mlp.gate(x), moe.top_k, moe.renormalize)
    ref = torch_moe(x, moe.w13_weight, moe.w2_weight, weights, ids)
    partial = sum(torch_moe(x, p.w13_weight, p.w2_weight, weights, ids) for p in parts)
    torch.testing.assert_close(partial, ref, rtol=1e-5, atol=1e-5)
