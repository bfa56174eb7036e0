"""What every vision-language wrapper shares: the text side is a causal LM in `self.language_model`, to which
embedding, the forward (with the image rows merged into `inputs_embeds`) and the logits are delegated."""

from __future__ import annotations

from collections.abc import Iterable
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

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name as this module names it (the subclass maps its families' layouts)."""
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """`language_model.*` goes to the text model's own loader; the tower's and projector's tensors are
        copied by name; anything else (layers past the feature layer, a tower's unused pooling head) is skipped."""
        own = dict(self.named_parameters())
        loaded: set[str] = set()
        text: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            name = self.checkpoint_name(name)
            if name.startswith("language_model."):
                text.append((name[len("language_model.") :], tensor))
            elif name in own:
                with torch.no_grad():
                    own[name].copy_(tensor.to(own[name].dtype))
                loaded.add(name)
        loaded |= {"language_model." + n for n in self.language_model.load_weights(text)}
        return loaded
