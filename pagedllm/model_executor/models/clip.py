"""CLIP's vision transformer (the LLaVA-1.5 tower), with HF's parameter names: patch embedding + class
token + learned positions, pre-LayerNorm, pre-norm encoder layers. Images arrive batched at one fixed size,
so attention is plain full attention (torch SDPA) over each image's patches; no KV cache."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def vision_act(name: str) -> Any:
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"vision tower: unsupported activation {name!r}")


class VisionAttention(nn.Module):
    """Multi-head self-attention with q/k/v/out projections named as HF's CLIP/SigLIP."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (
            p(x).view(b, n, self.heads, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, inter)
        self.fc2 = nn.Linear(inter, hidden)
        self.act = vision_act(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        eps = float(getattr(cfg, "layer_norm_eps", 1e-5))
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=eps)
        self.self_attn = VisionAttention(cfg.hidden_size, cfg.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=eps)
        self.mlp = VisionMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: Any, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every hidden state: the input, then each layer's output (HF's `hidden_states`)."""
        states = [x]
        for layer in self.layers:
            x = layer(x)
            states.append(x)
        return states


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(cfg.hidden_size))
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size, bias=False
        )
        n_pos = (cfg.image_size // cfg.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(n_pos, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1)
        return x + self.position_embedding.weight[: x.shape[1]]


class CLIPVisionTower(nn.Module):
    """`vision_tower.*` of a LLaVA checkpoint (HF `CLIPVisionModel` minus its unused head). Only the layers
    up to the deepest one the projector reads are built (the others' weights are skipped when loading)."""

    def __init__(self, cfg: Any, num_layers: int) -> None:
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=float(getattr(cfg, "layer_norm_eps", 1e-5)))
        self.encoder = VisionEncoder(cfg, num_layers)

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        return self.encoder(self.pre_layrnorm(self.embeddings(pixel_values)))
