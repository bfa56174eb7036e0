"""Gemma 3 vision-language (`Gemma3ForConditionalGeneration`): a SigLIP tower, `Gemma3MultiModalProjector`
(average-pool the patch grid to `mm_tokens_per_image` tokens, (1 + w) RMSNorm, one matrix), and the Gemma 3
text decoder. Images come preprocessed by the HF `Gemma3Processor` (every image resized to the tower's
size; pan-and-scan crops are not supported); each `<start_of_image>` becomes `mm_tokens_per_image` image
tokens between begin/end-of-image tokens.

The tokens of one image attend to each other both ways (HF's `token_type_ids` mask: causal OR same image;
on the sliding-window layers also within the window), so `requires_whole_mm_items`: the scheduler never
splits an image across steps, and the model runner gives the attention a per-token key limit."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.models.gemma3 import Gemma3ForCausalLM, GemmaRMSNorm
from pagedllm.model_executor.models.llava import rename_checkpoint_tensor
from pagedllm.model_executor.models.siglip import SiglipVisionModel
from pagedllm.model_executor.models.vlm_base import VisionLanguageModel


class Gemma3MMSpec:
    """The front end's view (`multimodal.processing.MultiModalSpec`)."""

    @staticmethod
    def image_token_id(hf_config: Any) -> int:
        return int(getattr(hf_config, "image_token_id", None) or hf_config.image_token_index)

    @staticmethod
    def prompt_placeholder(processor: Any) -> str:
        return str(processor.boi_token)

    @staticmethod
    def split_items(processed: dict[str, torch.Tensor], num_images: int) -> list[dict[str, torch.Tensor]]:
        pixels = processed["pixel_values"]
        if pixels.shape[0] != num_images:  # pan-and-scan adds crops, each with its own placeholder run
            raise ValueError("do_pan_and_scan: image crops are not supported for Gemma 3 (leave it off)")
        return [{"pixel_values": pixels[i : i + 1]} for i in range(num_images)]

    @staticmethod
    def num_tokens(hf_config: Any, item: dict[str, torch.Tensor]) -> int:
        return int(hf_config.mm_tokens_per_image)


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        vc, tc = hf_config.vision_config, hf_config.text_config
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vc.hidden_size, tc.hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(vc.hidden_size, float(vc.layer_norm_eps))
        self.patches_per_side = int(vc.image_size // vc.patch_size)
        tokens_per_side = int(round(int(hf_config.mm_tokens_per_image) ** 0.5))
        if tokens_per_side**2 != int(hf_config.mm_tokens_per_image) or self.patches_per_side % tokens_per_side:
            raise ValueError(
                f"Gemma 3: mm_tokens_per_image {hf_config.mm_tokens_per_image} must be a square whose side divides "
                f"the {self.patches_per_side} patches per side"
            )
        self.kernel = self.patches_per_side // tokens_per_side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[images, patches, vision hidden] -> [images, mm_tokens_per_image, text hidden]."""
        b, _, c = x.shape
        grid = x.transpose(1, 2).reshape(b, c, self.patches_per_side, self.patches_per_side)
        pooled = nn.functional.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(x)


class Gemma3ForConditionalGeneration(VisionLanguageModel):
    mm_spec = Gemma3MMSpec
    requires_whole_mm_items = True
    """An image's tokens see each other (bidirectional): never split across chunks, key limits in attention."""

    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__()
        self.config = hf_config
        tc = hf_config.text_config
        if getattr(hf_config, "tie_word_embeddings", None) is not None:
            tc.tie_word_embeddings = hf_config.tie_word_embeddings
        self.vision_tower = SiglipVisionModel(hf_config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(hf_config)
        self.language_model = Gemma3ForCausalLM(tc, prefix="language_model")

    # ---- the model runner's interface ----------------------------------------------------------
    def embed_multimodal(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Per image, its `mm_tokens_per_image` rows [tokens, text hidden] (every image at the tower's size)."""
        pixels = torch.cat([it["pixel_values"] for it in items])
        out = self.multi_modal_projector(self.vision_tower(pixels))
        return list(out.to(self.language_model.lm_head.weight.dtype))

    def dummy_mm_items(self, num_tokens: int) -> list[dict[str, torch.Tensor]]:
        """Zero images filling `num_tokens` placeholder rows (at least one): the memory profile's input."""
        vc = self.config.vision_config
        n = max(1, num_tokens // int(self.config.mm_tokens_per_image))
        return [{"pixel_values": torch.zeros(1, vc.num_channels, vc.image_size, vc.image_size)} for _ in range(n)]

    def checkpoint_name(self, name: str) -> str:
        name = rename_checkpoint_tensor(name)
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
            name = "vision_tower.vision_model." + name[len("vision_tower.") :]  # (transformers 5.x saves)
        return name
