"""Column-parallel linear layers that fuse several projections of one input into one matmul: gate/up
(`MergedColumnParallelLinear`) and q/k/v (`QKVParallelLinear`, split by heads, KV heads replicated when fewer than
the ranks). Their weight loaders map each HF sub-projection (`shard_id`), or a checkpoint's already fused tensor,
onto its slice of this rank's weight. Apart from `layers/linear.py` (the base layers and linear methods) because
that shard bookkeeping is their own."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from pagedllm.attention.qkv_rope import QKVRope

from pagedllm.distributed.parallel_state import get_tensor_model_parallel_world_size
from pagedllm.model_executor.layers.linear import ColumnParallelLinear, LinearMethodBase, _copy_checked, divide


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (e.g. gate_up_proj).

    Each rank's weight is [shard of output 0; shard of output 1; ...]. `shard_id` is the index of the
    sub-projection the loaded (full) weight belongs to; None means a checkpoint that already fuses them.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = True,
        gather_output: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_method: LinearMethodBase | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(
            input_size,
            sum(output_sizes),
            bias,
            gather_output,
            params_dtype,
            quant_method,
            prefix,
            output_sizes=list(output_sizes),
        )

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:
            _copy_checked(param.data, loaded_weight, self.prefix)
            return
        if shard_id is None:
            # Already fused in the checkpoint: split into the sub-projections and load each.
            start = 0
            pack = getattr(param, "output_pack_factor", 1)
            for i, size in enumerate(self.output_sizes):
                size //= pack
                self.weight_loader(param, loaded_weight.narrow(output_dim, start, size), i)
                start += size
            return
        shard_id = int(shard_id)
        pack = getattr(param, "output_pack_factor", 1)  # int4 values packed along the output dim
        part = self.output_partition_sizes[shard_id] // pack
        offset = sum(self.output_partition_sizes[:shard_id]) // pack
        src = loaded_weight.narrow(output_dim, self.tp_rank * part, part)
        _copy_checked(param.data.narrow(output_dim, offset, part), src, f"{self.prefix}[{shard_id}]")


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split by heads.

    Each rank holds num_heads/tp query heads and num_kv_heads/tp KV heads. When there are fewer KV heads
    than ranks, every KV head is replicated on tp/num_kv_heads consecutive ranks (1 KV head per rank).
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        quant_method: LinearMethodBase | None = None,
        prefix: str = "",
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= self.total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, self.total_num_kv_heads)
        else:
            self.num_kv_heads = divide(self.total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        q_size = self.total_num_heads * head_size
        kv_size = self.total_num_kv_heads * head_size
        # output_size counts replicated KV heads, so that it divides evenly by tp_size.
        output_size = (self.num_heads + 2 * self.num_kv_heads) * tp_size * head_size
        super().__init__(
            hidden_size,
            output_size,
            bias,
            False,
            params_dtype,
            quant_method,
            prefix,
            output_sizes=[q_size, kv_size, kv_size],
        )

    def forward_rope(self, x: torch.Tensor, rope: QKVRope) -> torch.Tensor | None:
        """The projection with RoPE applied and the new K / V written to the paged cache by its own kernel
        (`QKVRope`), or None where its weight's kernel cannot (then `forward`, and RoPE as usual). Never with a
        bias or forward hooks (LoRA adds its deltas by hooks, to the output before RoPE)."""
        fn = getattr(self.quant_method, "apply_rope", None)
        if fn is None or self.bias is not None or self._forward_hooks or self._forward_pre_hooks:
            return None
        return fn(self, x, rope)

    def _partition_sizes(self) -> list[int]:
        return [
            self.num_heads * self.head_size,
            self.num_kv_heads * self.head_size,
            self.num_kv_heads * self.head_size,
        ]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:
            _copy_checked(param.data, loaded_weight, self.prefix)
            return
        hd = self.head_size
        if shard_id is None:
            # Checkpoint with a fused qkv weight: split it and load each part.
            pack = getattr(param, "output_pack_factor", 1)
            sizes = {"q": self.total_num_heads * hd // pack, "k": self.total_num_kv_heads * hd // pack}
            sizes["v"] = sizes["k"]
            start = 0
            for sid in ("q", "k", "v"):
                self.weight_loader(param, loaded_weight.narrow(output_dim, start, sizes[sid]), sid)
                start += sizes[sid]
            return
        pack = getattr(param, "output_pack_factor", 1)  # int4 values packed along the output dim
        q_part = self.num_heads * hd // pack
        kv_part = self.num_kv_heads * hd // pack
        if shard_id == "q":
            offset, size, src_start = 0, q_part, self.tp_rank * q_part
        elif shard_id in ("k", "v"):
            offset = q_part if shard_id == "k" else q_part + kv_part
            size = kv_part
            src_start = (self.tp_rank // self.num_kv_head_replicas) * kv_part
        else:
            raise ValueError(f"{self.prefix}: unknown qkv shard id {shard_id!r}")
        src = loaded_weight.narrow(output_dim, src_start, size)
        _copy_checked(param.data.narrow(output_dim, offset, size), src, f"{self.prefix}[{shard_id}]")
