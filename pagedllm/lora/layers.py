"""LoRA on the model's parallel linears, per token.

`wrap_model` attaches a `LoRALayer` to every q/k/v (fused `qkv_proj`), `o_proj`, gate/up (`gate_up_proj`)
and `down_proj` linear through a forward hook: the base layer computes as before (its parameters keep their
names, so checkpoints and weight updates are unaffected), then the hook adds the adapters' deltas in place.

Each layer holds `max_loras` slots: A [slots, n_slices * max_rank, in] and B [slots, out, n_slices * max_rank]
with the slices (q/k/v, gate/up) side by side in A and block-diagonal in B, so a fused layer is one shrink
(x @ A^T) and one expand (@ B^T) whatever its number of slices. `TokenLoRAState` carries the per-token slot
indices (-1: the base model) for the whole model: a persistent device buffer, read inside the forward (a
pre-hook derives the token grouping from it), so CUDA-graph replays see each step's indices as inputs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.model_executor.layers.fused_linear import MergedColumnParallelLinear, QKVParallelLinear
from pagedllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.model_executor.layers.triton_gemv import RowGemvLoRA

TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class TokenLoRAState:
    """Per-token adapter slots of the current forward, shared by every LoRA layer of the model."""

    def __init__(self, max_loras: int, max_num_tokens: int, device: torch.device, use_triton: bool) -> None:
        self.max_loras = max_loras
        self.device = device
        self.use_triton = use_triton
        self.host = np.full(max_num_tokens, -1, dtype=np.int32)
        if device.type == "cpu":  # the host array itself
            self.token_slots = torch.from_numpy(self.host)
        else:
            self.token_slots = torch.full((max_num_tokens,), -1, dtype=torch.int32, device=device)
        """The graph input: the slot of every token of the step (-1: no adapter)."""
        self._last_n = 0
        self.num_tokens = 0
        # Triton path (device tensors derived inside the forward): token indices grouped by slot.
        self.sorted_idx: torch.Tensor | None = None
        self.seg_start: torch.Tensor | None = None
        self.seg_len: torch.Tensor | None = None
        self.split_buffer: torch.Tensor | None = None
        """Triton path, few tokens: one zeroed float32 [layers, T, R] buffer for every layer's split-K shrink."""
        self.num_layers = 0
        self.max_r = 0
        # PyTorch path: (slot, token indices or None for all tokens) per adapter present.
        self.groups: list[tuple[int, torch.Tensor | None]] = []

    def set_token_slots(self, slots: np.ndarray) -> None:
        """The step's per-token slots. Entries past them stay -1 (the padded rows of a CUDA graph)."""
        n = len(slots)
        host = self.host
        host[:n] = slots
        last = self._last_n
        if last > n:
            host[n:last] = -1
        self._last_n = n
        if self.device.type != "cpu":
            m = max(n, last)
            self.token_slots[:m].copy_(torch.from_numpy(host[:m]), non_blocking=True)

    def prepare(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """Forward pre-hook of the model: groups the forward's tokens by slot (on the device for the Triton
        path, so a captured graph recomputes it from `token_slots` at every replay)."""
        n = int(args[0].shape[0])
        self.num_tokens = n
        if self.use_triton:
            nl = self.max_loras
            s = self.token_slots[:n].long()
            key = torch.where(s < 0, torch.full_like(s, nl), s)
            onehot = key[:, None] == torch.arange(nl + 1, device=s.device)[None, :]
            counts = onehot.sum(0)
            starts = torch.cumsum(counts, 0) - counts
            rank_in_seg = torch.cumsum(onehot.long(), 0).gather(1, key[:, None]).squeeze(1) - 1
            dest = starts.gather(0, key) + rank_in_seg
            sorted_idx = torch.empty(n, dtype=torch.int32, device=s.device)
            sorted_idx.scatter_(0, dest, torch.arange(n, dtype=torch.int32, device=s.device))
            self.sorted_idx, self.seg_start, self.seg_len = sorted_idx, starts.int(), counts.int()
            from pagedllm.lora.ops import SPLIT_K_MAX_TOKENS

            self.split_buffer = None
            if n <= SPLIT_K_MAX_TOKENS:
                self.split_buffer = torch.zeros(self.num_layers, n, self.max_r, dtype=torch.float32, device=s.device)
            return
        slots = self.host[:n]
        present = np.unique(slots[slots >= 0])
        if len(present) == 1 and bool((slots == present[0]).all()):
            self.groups = [(int(present[0]), None)]
        else:
            self.groups = [(int(s), torch.from_numpy(np.nonzero(slots == s)[0]).to(self.device)) for s in present]


class LoRALayer:
    """The adapter slots of one linear layer and the hook adding their deltas to its output."""

    def __init__(self, base: nn.Module, state: TokenLoRAState, max_loras: int, max_rank: int) -> None:
        self.state = state
        self.index = state.num_layers
        """This layer's part of the state's split-K buffer."""
        state.num_layers += 1
        self.max_rank = max_rank
        if isinstance(base, RowParallelLinear):
            self.slice_sizes = [base.output_size]
            in_size = base.input_size_per_partition
        else:
            assert isinstance(base, ColumnParallelLinear)
            self.slice_sizes = list(base.output_partition_sizes)
            in_size = base.input_size
        self.in_size = in_size
        self.out_size = sum(self.slice_sizes)
        r_all = len(self.slice_sizes) * max_rank
        dtype, dev = base.params_dtype, state.device
        self.lora_a = torch.zeros(max_loras, r_all, in_size, dtype=dtype, device=dev)
        self.lora_b = torch.zeros(max_loras, self.out_size, r_all, dtype=dtype, device=dev)
        state.max_r = max(state.max_r, r_all)
        self.fused: RowGemvLoRA | None = None
        """Batch-1 CUDA decode: the base layer's row GEMV computes the shrink too (one launch fewer)."""
        if state.use_triton and dev.type == "cuda":
            self.fused = RowGemvLoRA.create(self.lora_a, state.token_slots[:1], self.out_size)
            vars(base)["row_gemv_lora"] = self.fused  # read by UnquantizedLinearMethod.apply

    def check(self, name: str, weights: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """ValueError unless `weights` (slice -> (A, B)) fits this layer."""
        for sl, (a, b) in weights.items():
            out = self.out_size if sl < 0 else self.slice_sizes[sl]
            if (
                a.shape[0] > self.max_rank
                or tuple(a.shape) != (a.shape[0], self.in_size)
                or b.shape != (out, a.shape[0])
            ):
                raise ValueError(
                    f"adapter: {name}[{sl}] has A {tuple(a.shape)} / B {tuple(b.shape)}, the base layer needs "
                    f"A (r<={self.max_rank}, {self.in_size}) / B ({out}, r)"
                )

    def set_slot(self, slot: int, weights: dict[int, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Writes an adapter's matrices into `slot` (None: zeros, the layer unchanged by this adapter)."""
        a_dst, b_dst = self.lora_a[slot], self.lora_b[slot]
        a_dst.zero_()
        b_dst.zero_()
        for sl, (a, b) in (weights or {}).items():
            r = a.shape[0]
            col = max(sl, 0) * self.max_rank
            row = 0 if sl < 0 else sum(self.slice_sizes[:sl])
            a_dst[col : col + r].copy_(a, non_blocking=True)
            b_dst[row : row + b.shape[0], col : col + r].copy_(b, non_blocking=True)

    def hook(self, module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        x = args[0]
        st = self.state
        if st.use_triton:
            from pagedllm.lora.ops import lora_expand, lora_shrink_expand

            assert st.sorted_idx is not None and st.seg_start is not None and st.seg_len is not None
            f = self.fused
            if f is not None and f.done:  # the base's row GEMV wrote the shrink into f.out
                f.done = False
                lora_expand(f.out, self.lora_b, out, st.sorted_idx, st.seg_start, st.seg_len)
                return out
            sb = st.split_buffer[self.index] if st.split_buffer is not None else None
            lora_shrink_expand(x, self.lora_a, self.lora_b, out, st.sorted_idx, st.seg_start, st.seg_len, sb)
            return out
        for slot, idx in st.groups:
            if idx is None:
                out += (x @ self.lora_a[slot].T) @ self.lora_b[slot].T
            else:
                out.index_add_(0, idx, (x[idx] @ self.lora_a[slot].T) @ self.lora_b[slot].T)
        return out


def wrap_model(model: nn.Module, state: TokenLoRAState, max_loras: int, max_rank: int) -> dict[str, LoRALayer]:
    """Attaches a LoRALayer to every target linear of the model; the layers by module name."""
    layers: dict[str, LoRALayer] = {}
    for name, module in model.named_modules():
        if name.rpartition(".")[2] not in TARGETS:
            continue
        if not isinstance(
            module, (QKVParallelLinear, MergedColumnParallelLinear, ColumnParallelLinear, RowParallelLinear)
        ):
            continue
        layer = LoRALayer(module, state, max_loras, max_rank)
        module.register_forward_hook(layer.hook)
        layers[name] = layer
    if not layers:
        raise ValueError(f"enable_lora: {type(model).__name__} has no LoRA-targetable linear layers")
    model.register_forward_pre_hook(state.prepare)
    return layers
