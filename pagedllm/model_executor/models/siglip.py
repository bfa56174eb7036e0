"""SigLIP's vision transformer (Gemma 3's tower), with HF's parameter names (`vision_model.*`): patch
embedding with bias and learned positions (no class token), CLIP's pre-norm encoder layers (shared with
`clip.py`), a final LayerNorm. The pooling head is not built (Gemma 3 reads the last hidden state)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.models.clip import VisionEncoder


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Embedding((cfg.image_size // cfg.patch_size) ** 2, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return x + self.position_embedding.weight[: x.shape[1]]


class SiglipVisionTransformer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(cfg)
        self.encoder = VisionEncoder(cfg, cfg.num_hidden_layers)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=float(getattr(cfg, "layer_norm_eps", 1e-6)))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, patches, hidden]: HF's `last_hidden_state` (no intermediate states kept)."""
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class SiglipVisionModel(nn.Module):
    """`vision_tower.*` of a Gemma 3 checkpoint (HF `SiglipVisionModel`; `vision_model.head.*` is skipped)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.vision_model = SiglipVisionTransformer(cfg)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.vision_model(pixel_values)
