"""`FusedMoE`: the routed experts of one MoE block (router logits in, expert mixture out)."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from pagedllm.model_executor.layers import batch_invariant, triton_ops
from pagedllm.model_executor.layers.fused_moe.routing import select_experts
from pagedllm.model_executor.layers.fused_moe.torch_moe import torch_moe
from pagedllm.model_executor.layers.linear import ReplicatedLinear, UnquantizedLinearMethod, divide, set_weight_attrs

# Checkpoint names of the per-expert projections: (gate, up, down) per model family.
EXPERT_NAMES_GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")
EXPERT_NAMES_MIXTRAL = ("w1", "w3", "w2")


_PER_EXPERT_RE = re.compile(r"^(?P<pre>.*\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")
_STACKED_RE = re.compile(r"^(?P<pre>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def match_expert_weight(name: str, names: tuple[str, str, str]) -> tuple[str, int | None, str] | None:
    """(parameter name, expert id, shard id) of a checkpoint tensor of the routed experts, else None.
    Takes per-expert tensors (`...experts.7.gate_proj.weight`, projection names `names` = (gate, up,
    down)) and transformers v5's stacked `...experts.gate_up_proj` / `...experts.down_proj`."""
    m = _PER_EXPERT_RE.match(name)
    if m is not None:
        shard = {names[0]: "w1", names[1]: "w3", names[2]: "w2"}.get(m["proj"])
        if shard is None:
            return None
        param = "w2_weight" if shard == "w2" else "w13_weight"
        return f"{m['pre']}.{param}", int(m["e"]), shard
    m = _STACKED_RE.match(name)
    if m is not None:
        if m["proj"] == "gate_up_proj":
            return f"{m['pre']}.w13_weight", None, "w13"
        return f"{m['pre']}.w2_weight", None, "w2"
    return None


class FusedMoE(nn.Module):
    """Routed experts with stacked weights `w13_weight [E, 2 * I/tp, H]` and `w2_weight [E, H, I/tp]`.

    `forward(hidden [T, H], router_logits [T, E])` routes each token to its `top_k` experts (softmax,
    top-k, optional renormalization) and returns the weighted sum of their SwiGLU MLPs, all-reduced
    across tensor-parallel ranks when `reduce_results`.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        reduce_results: bool = True,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"{prefix}: top_k={top_k} must be in 1..num_experts={num_experts}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.renormalize = renormalize
        self.reduce_results = reduce_results
        self.prefix = prefix
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.intermediate_size_per_partition = divide(intermediate_size, self.tp_size)
        dtype = params_dtype or torch.get_default_dtype()
        inter = self.intermediate_size_per_partition
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * inter, hidden_size, dtype=dtype), requires_grad=False
        )
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, inter, dtype=dtype), requires_grad=False)
        for p in (self.w13_weight, self.w2_weight):
            set_weight_attrs(p, {"weight_loader": self.weight_loader})

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str, expert_id: int | None = None
    ) -> None:
        """Copies this rank's slice of a FULL checkpoint tensor: shard "w1" (gate [I, H]), "w3" (up),
        "w2" (down [H, I]) of expert `expert_id`, or "w13" ([E, 2I, H]) / "w2" ([E, H, I]) of all experts
        when `expert_id` is None."""
        inter = self.intermediate_size_per_partition
        start = self.tp_rank * inter
        if expert_id is None:
            if shard_id == "w13":
                full = loaded_weight.shape[1] // 2
                for e in range(loaded_weight.shape[0]):
                    self.weight_loader(param, loaded_weight[e, :full], "w1", e)
                    self.weight_loader(param, loaded_weight[e, full:], "w3", e)
            else:
                for e in range(loaded_weight.shape[0]):
                    self.weight_loader(param, loaded_weight[e], shard_id, e)
            return
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"{self.prefix}: expert id {expert_id} out of range (num_experts={self.num_experts})")
        if shard_id in ("w1", "w3"):
            dst = param.data[expert_id].narrow(0, 0 if shard_id == "w1" else inter, inter)
            src = loaded_weight.narrow(0, start, inter)
        elif shard_id == "w2":
            dst = param.data[expert_id]
            src = loaded_weight.narrow(1, start, inter)
        else:
            raise ValueError(f"{self.prefix}: unknown expert shard id {shard_id!r}")
        if dst.shape != src.shape:
            raise ValueError(
                f"{self.prefix}: expert {expert_id} {shard_id} shape mismatch, parameter {tuple(dst.shape)} "
                f"vs checkpoint slice {tuple(src.shape)}"
            )
        dst.copy_(src)

    def forward(
        self,
        hidden_states: torch.Tensor,
        router: torch.Tensor | ReplicatedLinear,
        sum_experts: bool = True,
    ) -> torch.Tensor:
        """`router`: the router logits [T, E], or the router layer itself (on CUDA its GEMM then runs inside the
        routing's launches where it is a plain unquantized linear, `fusable_router`). [T, H]; with
        `sum_experts=False` the CUDA path without tensor parallelism returns each token's k weighted expert
        outputs unsummed, [T, k, H] (`RMSNorm` with a residual sums them in its pass)."""
        if triton_ops.use_triton_ops(hidden_states):
            from pagedllm.model_executor.layers.fused_moe.triton_moe import fused_moe

            gate_weight: torch.Tensor | None = None
            logits: torch.Tensor | None = None
            if not isinstance(router, ReplicatedLinear):
                logits = router
            elif fusable_router(router, hidden_states):
                gate_weight = router.weight
            else:
                logits = router(hidden_states)
            out = fused_moe(
                hidden_states,
                self.w13_weight,
                self.w2_weight,
                logits,
                self.top_k,
                self.renormalize,
                sum_experts=sum_experts or (self.reduce_results and self.tp_size > 1),
                gate_weight=gate_weight,
            )
        else:
            router_logits = router(hidden_states) if isinstance(router, ReplicatedLinear) else router
            topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
            out = torch_moe(hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out

    def warm_up_kernels(self, max_num_tokens: int) -> None:
        """Compiles the fused kernels for every tile configuration a batch of up to `max_num_tokens` tokens can
        pick (`worker/warmup.py` calls it at start-up). The dummy batches reach only decode-sized ones; a
        prefill-sized configuration compiled inside a running step stalled it ~0.8 s on a cold cache (W6 on
        an H200: five such compiles, benchmarks/NOTES.md, session 29)."""
        if triton_ops.use_triton_ops(self.w13_weight):
            from pagedllm.model_executor.layers.fused_moe.triton_moe import warm_up

            warm_up(self.w13_weight, self.w2_weight, self.top_k, self.renormalize, max_num_tokens)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"intermediate_per_partition={self.intermediate_size_per_partition}, renormalize={self.renormalize}"
        )


def fusable_router(gate: ReplicatedLinear, x: torch.Tensor) -> bool:
    """Whether the router's x @ W^T may run in the fused routing's own kernel: a plain unquantized linear without
    bias, hooks (LoRA) or batch-invariant mode, in x's dtype."""
    return (
        type(gate.quant_method) is UnquantizedLinearMethod
        and gate.bias is None
        and gate.weight.dtype == x.dtype
        and gate.weight.stride(-1) == 1
        and not gate._forward_hooks
        and not gate._forward_pre_hooks
        and getattr(gate, "row_gemv_lora", None) is None
        and not batch_invariant.enabled()
    )


def num_experts_of(config: Any) -> int:
    """The routed-expert count under any of its config names."""
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(config, name, None)
        if value:
            return int(value)
    return 0
