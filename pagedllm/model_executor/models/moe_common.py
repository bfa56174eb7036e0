"""Pieces shared by the mixture-of-experts decoders (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE): the sparse
MoE block (router + routed experts + optional gated shared expert), which the decoder layers put in place
of the dense MLP through `LlamaDecoderLayer.make_mlp`, and checkpoint loading of per-expert tensors into
the stacked expert weights."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm import envs
from pagedllm.distributed.parallel_state import (
    get_pipeline_model_parallel_world_size,
    get_tensor_model_parallel_world_size,
)
from pagedllm.model_executor.layers.fused_moe import FusedMoE
from pagedllm.model_executor.layers.fused_moe.layer import (
    EXPERT_NAMES_GATE_UP_DOWN,
    match_expert_weight,
    num_experts_of,
)
from pagedllm.model_executor.layers.linear import ReplicatedLinear
from pagedllm.model_executor.models.llama import LlamaForCausalLM, LlamaMLP


class SparseMoeBlock(nn.Module):
    """`gate` (router, replicated) -> `experts` (FusedMoE); plus, where `shared_intermediate_size` is
    set, a dense `shared_expert` scaled by `sigmoid(shared_expert_gate(x))` (Qwen2-MoE). On CUDA the output
    may be [T, k, H], the experts' outputs unsummed (`defer_sum`), which only a decoder layer's residual add +
    RMSNorm reads."""

    def __init__(
        self,
        config: Any,
        intermediate_size: int,
        renormalize: bool,
        shared_intermediate_size: int = 0,
        prefix: str = "",
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_experts = num_experts_of(config)
        self.gate = ReplicatedLinear(hidden, num_experts, bias=False, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(
            num_experts,
            int(config.num_experts_per_tok),
            hidden,
            intermediate_size,
            renormalize=renormalize,
            prefix=f"{prefix}.experts",
        )
        self.shared_expert: LlamaMLP | None = None
        if shared_intermediate_size:
            self.shared_expert = LlamaMLP(hidden, shared_intermediate_size, prefix=f"{prefix}.shared_expert")
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, bias=False, prefix=f"{prefix}.shared_expert_gate")
        # The sum over the k experts left to the next layer's residual add + RMSNorm (one launch less per layer)
        # where nothing else reads the block's output first: no shared expert to add, no all-reduce, and no
        # pipeline stage boundary after a layer.
        self.defer_sum = (
            envs.PAGEDLLM_MOE_DEFER_SUM
            and self.shared_expert is None
            and get_tensor_model_parallel_world_size() == 1
            and get_pipeline_model_parallel_world_size() == 1
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate, sum_experts=not self.defer_sum)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """HF's rule for Qwen2/Qwen3-MoE: MoE unless listed in `mlp_only_layers` or off the
    `decoder_sparse_step` grid."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    only_mlp = getattr(config, "mlp_only_layers", None) or []
    return layer_idx not in only_mlp and num_experts_of(config) > 0 and (layer_idx + 1) % step == 0


class QwenSparseMlpMixin:
    """Qwen2-MoE / Qwen3-MoE decoder layers: a `SparseMoeBlock` on the sparse layers (with Qwen2-MoE's gated
    shared expert when the config has one), the dense MLP of the base layer elsewhere."""

    def make_mlp(self, config: Any, layer_idx: int, prefix: str) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return super().make_mlp(config, layer_idx, prefix)  # type: ignore[misc]
        return SparseMoeBlock(
            config,
            int(config.moe_intermediate_size),
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            shared_intermediate_size=int(getattr(config, "shared_expert_intermediate_size", 0) or 0),
            prefix=prefix,
        )


class MoeForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM whose loader also fills the stacked expert weights from per-expert tensors.

    `expert_names`: the checkpoint's (gate, up, down) projection names; `checkpoint_renames`: substring
    rewrites applied to every checkpoint name first (Mixtral's `block_sparse_moe.` -> `mlp.`)."""

    expert_names: tuple[str, str, str] = EXPERT_NAMES_GATE_UP_DOWN
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        num_experts = num_experts_of(self.config)
        seen: dict[str, set[tuple[int, str]]] = {}
        expert_loaded: set[str] = set()

        def dense() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                for old, new in self.checkpoint_renames:
                    name = name.replace(old, new)
                match = match_expert_weight(name, self.expert_names)
                if match is None or match[0] not in params:
                    yield name, tensor
                    continue
                pname, expert_id, shard_id = match
                param = params[pname]
                param.weight_loader(param, tensor, shard_id, expert_id)  # type: ignore[attr-defined]
                done = seen.setdefault(pname, set())
                if expert_id is None:
                    shards = ("w1", "w3") if shard_id == "w13" else (shard_id,)
                    done.update((e, s) for e in range(num_experts) for s in shards)
                else:
                    done.add((expert_id, shard_id))
                if len(done) == num_experts * (2 if pname.endswith("w13_weight") else 1):
                    expert_loaded.add(pname)

        return super().load_weights(dense()) | expert_loaded
