"""What every vision-language wrapper shares: the text side is a causal LM in `self.language_model`, to which
embedding, the forward (with the image rows merged into `inputs_embeds`) and the logits are delegated."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class VisionLanguageModel(nn.Module):
    language_model: Any
    """The text model (a `LlamaForCausalLM` family member), set by the subclass."""

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.language_model(input_ids, positions, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)
