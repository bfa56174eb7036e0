"""LLaVA-1.5 (`LlavaForConditionalGeneration`): a CLIP vision tower, a two-layer projector, and a Llama
decoder. Images come preprocessed by the HF `LlavaProcessor` (every image resized to the tower's size);
each `<image>` placeholder is expanded to one token per patch (the CLS token dropped with the "default"
feature strategy), and the decoder reads the projected patch features at those positions."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.models.clip import CLIPVisionTower, vision_act
from pagedllm.model_executor.models.llama import LlamaForCausalLM
from pagedllm.model_executor.models.vlm_base import VisionLanguageModel

# HF checkpoint prefixes (transformers 4.x "legacy" and 5.x layouts) -> ours.
_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("language_model.model.", "language_model.model."),
    ("language_model.lm_head.", "language_model.lm_head."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
)


def rename_checkpoint_tensor(name: str) -> str:
    for old, new in _PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


class LlavaMMSpec:
    """The front end's view (`multimodal.processing.MultiModalSpec`)."""

    @staticmethod
    def image_token_id(hf_config: Any) -> int:
        return int(getattr(hf_config, "image_token_id", None) or hf_config.image_token_index)

    @staticmethod
    def prompt_placeholder(processor: Any) -> str:
        return str(processor.image_token)

    @staticmethod
    def split_items(processed: dict[str, torch.Tensor], num_images: int) -> list[dict[str, torch.Tensor]]:
        return [{"pixel_values": processed["pixel_values"][i : i + 1]} for i in range(num_images)]

    @staticmethod
    def num_tokens(hf_config: Any, item: dict[str, torch.Tensor]) -> int:
        vc = hf_config.vision_config
        n = (item["pixel_values"].shape[-1] // vc.patch_size) * (item["pixel_values"].shape[-2] // vc.patch_size)
        return n + (1 if hf_config.vision_feature_select_strategy == "full" else 0)


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, in_size: int, out_size: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_size, out_size, bias=bias)
        self.act = vision_act(act)
        self.linear_2 = nn.Linear(out_size, out_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(VisionLanguageModel):
    mm_spec = LlavaMMSpec

    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__()
        self.config = hf_config
        vc, tc = hf_config.vision_config, hf_config.text_config
        layers = hf_config.vision_feature_layer
        self.feature_layers = [layers] if isinstance(layers, int) else list(layers)
        n_total = vc.num_hidden_layers
        # hidden_states has n_total + 1 entries; only layers up to the deepest one read are built.
        depth = max(i if i >= 0 else n_total + 1 + i for i in self.feature_layers)
        self.feature_layers = [i if i >= 0 else n_total + 1 + i for i in self.feature_layers]
        self.full = hf_config.vision_feature_select_strategy == "full"
        self.vision_tower = CLIPVisionTower(vc, depth)
        self.multi_modal_projector = LlavaMultiModalProjector(
            vc.hidden_size * len(self.feature_layers),
            tc.hidden_size,
            hf_config.projector_hidden_act,
            bool(getattr(hf_config, "multimodal_projector_bias", True)),
        )
        self.language_model = LlamaForCausalLM(tc, prefix="language_model")

    # ---- the model runner's interface ----------------------------------------------------------
    def embed_multimodal(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Per image, its placeholder rows [tokens, text hidden] (every image has the tower's size: batched)."""
        pixels = torch.cat([it["pixel_values"] for it in items])
        states = self.vision_tower(pixels)
        feats = [states[i] if self.full else states[i][:, 1:] for i in self.feature_layers]
        out = self.multi_modal_projector(torch.cat(feats, dim=-1))
        return list(out.to(self.language_model.lm_head.weight.dtype))

    def dummy_mm_items(self, num_tokens: int) -> list[dict[str, torch.Tensor]]:
        """Zero images filling `num_tokens` placeholder rows (at least one): the memory profile's input."""
        vc = self.config.vision_config
        per_image = (vc.image_size // vc.patch_size) ** 2 + (1 if self.full else 0)
        n = max(1, num_tokens // per_image)
        return [{"pixel_values": torch.zeros(1, vc.num_channels, vc.image_size, vc.image_size)} for _ in range(n)]

    def checkpoint_name(self, name: str) -> str:
        return rename_checkpoint_tensor(name)
