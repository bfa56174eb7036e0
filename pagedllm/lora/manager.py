"""The model runner's side of multi-LoRA: the model's LoRA layers, the adapters registered on the host (the
engine core hands them over already read, see `lora/staging.py`), and the `max_loras` device slots they are
swapped into, least recently used first, as the requests in the persistent batch need them."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.config import LoRAConfig
from pagedllm.logger import init_logger
from pagedllm.lora.layers import TokenLoRAState, wrap_model
from pagedllm.lora.peft import LoRAAdapter
from pagedllm.triton_utils import HAS_TRITON

logger = init_logger(__name__)


class LoRAManager:
    def __init__(
        self, model: nn.Module, config: LoRAConfig, max_num_reqs: int, max_num_tokens: int, device: torch.device
    ) -> None:
        self.config = config
        use_triton = device.type == "cuda" and HAS_TRITON
        self.state = TokenLoRAState(config.max_loras, max(max_num_tokens, max_num_reqs), device, use_triton)
        self.layers = wrap_model(model, self.state, config.max_loras, config.max_lora_rank)
        self.adapters: dict[int, LoRAAdapter] = {}
        self.slot_of: OrderedDict[int, int] = OrderedDict()
        """Adapter id -> its device slot, least recently used first."""
        self.free_slots = list(range(config.max_loras - 1, -1, -1))
        self.row_slot = np.full(max_num_reqs, -1, dtype=np.int32)
        self._version = -1

    # ---- adapters (from the engine core) -------------------------------------------------------
    def add_adapter(self, lora_id: int, adapter: LoRAAdapter) -> None:
        """Registers an adapter read on the host; ValueError if it does not fit the model's layers."""
        for name, weights in adapter.weights.items():
            layer = self.layers.get(name)
            if layer is None:
                raise ValueError(f"adapter: the base model has no LoRA-targetable module {name!r}")
            layer.check(name, weights)
        self.adapters[lora_id] = adapter
        slot = self.slot_of.get(lora_id)
        if slot is not None:  # re-registered under the same id: refresh its slot
            self._write_slot(slot, adapter)

    def remove_adapter(self, lora_id: int) -> None:
        self.adapters.pop(lora_id, None)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self.free_slots.append(slot)
            self._version = -1

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        for name, layer in self.layers.items():
            layer.set_slot(slot, adapter.weights.get(name))

    def _activate(self, lora_id: int, in_use: set[int]) -> int:
        slot = self.slot_of.get(lora_id)
        if slot is not None:
            self.slot_of.move_to_end(lora_id)
            return slot
        if lora_id not in self.adapters:
            raise RuntimeError(f"LoRA adapter id {lora_id} was never registered with the model runner")
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next((i for i in self.slot_of if i not in in_use), None)
            if victim is None:
                raise RuntimeError(f"more than max_loras={self.config.max_loras} adapters in one batch")
            slot = self.slot_of.pop(victim)
        self._write_slot(slot, self.adapters[lora_id])
        self.slot_of[lora_id] = slot
        return slot

    # ---- one step ------------------------------------------------------------------------------
    def prepare_step(self, batch: Any, token_rows: np.ndarray) -> None:
        """Sets the step's per-token slots (the rows' adapters, swapped into slots when the batch changed)."""
        if batch.version != self._version:
            states = batch.states
            in_use = {st.lora_id for st in states if st is not None and st.lora_id is not None}
            row_slot = self.row_slot
            row_slot.fill(-1)
            for row, st in enumerate(states):
                if st is not None and st.lora_id is not None:
                    row_slot[row] = self._activate(st.lora_id, in_use)
            self._version = batch.version
        self.state.set_token_slots(self.row_slot[token_rows])
