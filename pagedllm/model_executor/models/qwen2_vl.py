"""Qwen2-VL and Qwen2.5-VL (`Qwen2VLForConditionalGeneration`, `Qwen2_5_VLForConditionalGeneration`): the
vision transformer of `qwen2_vl_vision.py` and a Qwen2 decoder with M-RoPE: each token has (t, h, w)
positions, text tokens all three equal, an image's tokens its grid coordinates offset by the text before it;
the rotary frequencies are split into `mrope_section` parts, each rotated by one of the three positions.
The model runner gets a request's positions from `get_mrope_positions` (prompt) and `delta` (after it)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagedllm.model_executor.models.llama_attention import LlamaAttention
from pagedllm.model_executor.models.qwen2 import Qwen2DecoderLayer, Qwen2ForCausalLM, Qwen2Model
from pagedllm.model_executor.models.qwen2_vl_vision import QwenVisionTransformer
from pagedllm.model_executor.models.vlm_base import VisionLanguageModel


def mrope_section(text_config: Any) -> list[int]:
    for src in (getattr(text_config, "rope_parameters", None), getattr(text_config, "rope_scaling", None)):
        if isinstance(src, dict) and src.get("mrope_section"):
            return [int(s) for s in src["mrope_section"]]
    raise ValueError("Qwen2-VL text config: no mrope_section in rope_parameters / rope_scaling")


class MRopeAttention(LlamaAttention):
    """Qwen2 attention whose RoPE takes positions [3, T] (M-RoPE) or [T] (text only: all three equal)."""

    _section_of_freq: torch.Tensor

    def __init__(self, config: Any, layer_idx: int, **kw: Any) -> None:
        super().__init__(config, layer_idx, **kw)
        sec = mrope_section(config)
        half = self.rotary_emb.rotary_dim // 2
        if sum(sec) != half:
            raise ValueError(f"mrope_section {sec} must sum to half the rotary dim ({half})")
        self.register_buffer(
            "_section_of_freq", torch.repeat_interleave(torch.arange(3), torch.tensor(sec)), persistent=False
        )

    def forward_qkv(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        if positions.dim() == 1:  # every token's three positions equal: plain RoPE (fused on CUDA)
            return super().forward_qkv(positions, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        rope = self.rotary_emb
        half = rope.rotary_dim // 2
        cs = rope.cos_sin_cache[positions]  # [3, T, rotary_dim]
        sel = self._section_of_freq.view(1, 1, -1).expand(1, cs.shape[1], half)
        cos = cs[..., :half].gather(0, sel)[0][:, None, :]
        sin = cs[..., half:].gather(0, sel)[0][:, None, :]
        q = rope._rotate(q, cos.to(q.dtype), sin.to(q.dtype))
        k = rope._rotate(k, cos.to(k.dtype), sin.to(k.dtype))
        return self.o_proj(self.attn(q, k, v.contiguous()))


class MRopeDecoderLayer(Qwen2DecoderLayer):
    attn_cls = MRopeAttention


class MRopeModel(Qwen2Model):
    decoder_layer_cls = MRopeDecoderLayer


class MRopeLM(Qwen2ForCausalLM):
    model_cls = MRopeModel


def _grid(item: dict[str, torch.Tensor]) -> tuple[int, int, int]:
    t, h, w = (int(v) for v in item["image_grid_thw"].reshape(-1)[:3].tolist())
    return t, h, w


class QwenVLMMSpec:
    @staticmethod
    def image_token_id(hf_config: Any) -> int:
        return int(hf_config.image_token_id)

    @staticmethod
    def prompt_placeholder(processor: Any) -> str:
        return f"<|vision_start|>{processor.image_token}<|vision_end|>"

    @staticmethod
    def split_items(processed: dict[str, torch.Tensor], num_images: int) -> list[dict[str, torch.Tensor]]:
        grids = processed["image_grid_thw"]
        sizes = grids.prod(-1).tolist()
        pixels = processed["pixel_values"].split(sizes)
        return [{"pixel_values": pixels[i], "image_grid_thw": grids[i : i + 1]} for i in range(num_images)]

    @staticmethod
    def num_tokens(hf_config: Any, item: dict[str, torch.Tensor]) -> int:
        t, h, w = _grid(item)
        return t * h * w // hf_config.vision_config.spatial_merge_size**2


_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("model.visual.", "visual."),
    ("visual.", "visual."),
    ("lm_head.", "language_model.lm_head."),
    ("model.", "language_model.model."),  # 4.x checkpoints: the text model at the top
)


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    mm_spec = QwenVLMMSpec
    uses_mrope = True
    qwen25 = False

    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__()
        self.config = hf_config
        self.merge = hf_config.vision_config.spatial_merge_size
        self.visual = QwenVisionTransformer(hf_config.vision_config, self.qwen25)
        self.language_model = MRopeLM(hf_config.text_config, prefix="language_model")

    def embed_multimodal(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        grids = [_grid(it) for it in items]
        out = self.visual(torch.cat([it["pixel_values"] for it in items]), grids)
        out = out.to(self.language_model.lm_head.weight.dtype)
        return list(out.split([t * h * w // self.merge**2 for t, h, w in grids]))

    def dummy_mm_items(self, num_tokens: int) -> list[dict[str, torch.Tensor]]:
        """Zero 448x448-sized images (32 x 32 patches, 256 tokens) filling `num_tokens` placeholder rows."""
        vc = self.config.vision_config
        side = 32 if num_tokens >= 256 else 2 * self.merge
        tokens = side * side // self.merge**2
        width = self.visual.in_channels * vc.temporal_patch_size * vc.patch_size**2
        grid = torch.tensor([[1, side, side]])
        item = {"pixel_values": torch.zeros(side * side, width), "image_grid_thw": grid}
        return [item] * max(1, num_tokens // tokens)

    def get_mrope_positions(self, prompt_len: int, features: list[Any]) -> tuple[np.ndarray, int]:
        """(positions [3, prompt_len], delta): text tokens count on from the previous token's largest
        position; an image's tokens get (start, start + row, start + col) by merged grid cell; tokens past
        the prompt have position index + delta on all three axes."""
        pos = np.zeros((3, prompt_len), dtype=np.int64)
        cur, i = 0, 0
        for f in features:
            n_text = f.offset - i
            pos[:, i : f.offset] = cur + np.arange(n_text)
            cur += n_text
            t, h, w = (int(v) for v in f.data["image_grid_thw"].to_tensor().reshape(-1)[:3].tolist())
            gh, gw = h // self.merge, w // self.merge
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
            pos[:, f.offset : f.offset + f.length] = cur + np.stack([tt.ravel(), hh.ravel(), ww.ravel()])
            cur += max(t, gh, gw)
            i = f.offset + f.length
        pos[:, i:] = cur + np.arange(prompt_len - i)
        cur += prompt_len - i
        return pos, cur - prompt_len

    def checkpoint_name(self, name: str) -> str:
        for old, new in _PREFIXES:
            if name.startswith(old):
                return new + name[len(old) :]
        return name


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):  # noqa: N801 (the HF name)
    qwen25 = True
