"""The Qwen2-VL and Qwen2.5-VL vision transformers (HF parameter names): patches [N, C*T*P*P] from the
processor, 2D rotary positions over each image's patch grid, attention within each image (Qwen2.5-VL: within
windows except on `fullatt_block_indexes`), and a merger of every 2x2 patch block into one LM token."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model_executor.models.clip import vision_act


@functools.lru_cache(maxsize=64)
def _patch_hw(t: int, h: int, w: int, m: int) -> torch.Tensor:
    """(row, col) of each patch of a t x h x w grid, in the processor's order (2x2 merge blocks together)."""
    hp = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m).transpose(1, 2).flatten()
    wp = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m).transpose(1, 2).flatten()
    return torch.stack([hp, wp], dim=-1).repeat(t, 1)


@functools.lru_cache(maxsize=64)
def _window_order(t: int, gh: int, gw: int, win: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """One image's merge units in window order, and the windows' sizes in merge units."""
    idx = torch.arange(t * gh * gw).view(t, gh, gw)
    ph, pw = -gh % win, -gw % win
    padded = F.pad(idx, (0, pw, 0, ph), value=-1)
    nh, nw = (gh + ph) // win, (gw + pw) // win
    padded = padded.view(t, nh, win, nw, win).permute(0, 1, 3, 2, 4).reshape(t * nh * nw, win * win)
    lens = (padded >= 0).sum(-1)
    return padded[padded >= 0], tuple(int(n) for n in lens.tolist() if n > 0)


class VisionRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """Full attention within each segment [cu[i], cu[i+1]) of q/k/v [N, H, D]: one batched SDPA over the
    segments, padded to the longest (a key mask hides the padding); no mask when all have one length."""
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    n, h, d = q.shape
    longest = max(lens)
    if all(n_ == longest for n_ in lens):
        qs, ks, vs = (t.view(len(lens), longest, h, d).transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2).reshape(n, h, d)
    dev = q.device
    lens_t = torch.tensor(lens, device=dev)
    seg = torch.repeat_interleave(torch.arange(len(lens), device=dev), lens_t)
    pos = torch.arange(n, device=dev) - torch.tensor(cu[:-1], device=dev)[seg]
    padded = [torch.zeros(len(lens), longest, h, d, dtype=q.dtype, device=dev) for _ in range(3)]
    for buf, t in zip(padded, (q, k, v)):
        buf[seg, pos] = t
    mask = (torch.arange(longest, device=dev)[None, :] < lens_t[:, None])[:, None, None, :]
    qs, ks, vs = (b.transpose(1, 2) for b in padded)
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(1, 2)
    return out[seg, pos]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cu: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)
        qf, kf = q.float(), k.float()
        q = (qf * cos + rotate_half(qf) * sin).to(x.dtype)
        k = (kf * cos + rotate_half(kf) * sin).to(x.dtype)
        return self.proj(varlen_attention(q, k, v, cu).reshape(n, -1))


class GatedVisionMLP(nn.Module):
    def __init__(self, dim: int, inter: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter, bias=True)
        self.up_proj = nn.Linear(dim, inter, bias=True)
        self.down_proj = nn.Linear(inter, dim, bias=True)
        self.act = F.silu if act == "silu" else vision_act(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, inter: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, inter)
        self.fc2 = nn.Linear(inter, dim)
        self.act = vision_act(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: nn.Module, qwen25: bool) -> None:
        super().__init__()
        norm = (lambda: VisionRMSNorm(dim)) if qwen25 else (lambda: nn.LayerNorm(dim, eps=1e-6))
        self.norm1, self.norm2 = norm(), norm()
        self.attn = VisionAttention(dim, heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cu: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, out_dim: int, dim: int, merge: int, qwen25: bool) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.ln_q = VisionRMSNorm(dim) if qwen25 else nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class PatchEmbed(nn.Module):
    def __init__(self, in_channels: int, dim: int, kernel: tuple[int, int, int]) -> None:
        super().__init__()
        self.proj = nn.Conv3d(in_channels, dim, kernel_size=kernel, stride=kernel, bias=False)


class QwenVisionTransformer(nn.Module):
    """`visual.*`. `qwen25`: RMSNorm, gated MLP, window attention (Qwen2.5-VL); else Qwen2-VL's."""

    inv_freq: torch.Tensor

    def __init__(self, cfg: Any, qwen25: bool) -> None:
        super().__init__()
        self.qwen25 = qwen25
        dim = cfg.hidden_size if qwen25 else cfg.embed_dim
        out_dim = cfg.out_hidden_size if qwen25 else cfg.hidden_size
        self.heads, self.dim = cfg.num_heads, dim
        self.merge = cfg.spatial_merge_size
        self.patch = cfg.patch_size
        channels: Any = getattr(cfg, "in_channels", None) or getattr(cfg, "in_chans", 3)
        self.in_channels = int(channels)
        self.window_size = getattr(cfg, "window_size", 0)
        self.fullatt = set(getattr(cfg, "fullatt_block_indexes", None) or [])
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.patch_embed = PatchEmbed(self.in_channels, dim, kernel)

        def mlp() -> nn.Module:
            if qwen25:
                return GatedVisionMLP(dim, cfg.intermediate_size, cfg.hidden_act)
            return VisionMLP(dim, int(dim * cfg.mlp_ratio), cfg.hidden_act)

        self.blocks = nn.ModuleList(VisionBlock(dim, cfg.num_heads, mlp(), qwen25) for _ in range(cfg.depth))
        self.merger = PatchMerger(out_dim, dim, self.merge, qwen25)
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
        quarter = dim // cfg.num_heads // 2
        self.register_buffer(
            "inv_freq", 1.0 / theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter), persistent=False
        )

    def _rope(self, grids: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, 1, head_dim] of every patch (h and w positions laid out by 2x2 merge block)."""
        p = torch.cat([_patch_hw(t, h, w, self.merge) for t, h, w in grids]).to(device)
        freqs = (p[..., None].float() * self.inv_freq.to(device)).flatten(1)  # [N, head_dim / 2]: h, then w
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos()[:, None, :], emb.sin()[:, None, :]

    def _windows(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL: merge units reordered window by window, and the windows' patch boundaries."""
        unit = self.merge * self.merge
        win = self.window_size // self.merge // self.patch
        index, cu, base = [], [0], 0
        for t, h, w in grids:
            idx, lens = _window_order(t, h // self.merge, w // self.merge, win)
            index.append(idx + base)
            for n in lens:
                cu.append(cu[-1] + n * unit)
            base += t * (h // self.merge) * (w // self.merge)
        return torch.cat(index), cu

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        w = self.patch_embed.proj.weight
        x = F.linear(pixels.to(w.dtype), w.view(w.shape[0], -1))
        cos, sin = self._rope(grids, x.device)
        cu_full = [0]
        for t, h, w_ in grids:
            for _ in range(t):
                cu_full.append(cu_full[-1] + h * w_)
        order = None
        cu_win = cu_full
        if self.qwen25:
            order, cu_win = self._windows(grids)
            unit = self.merge * self.merge
            n = x.shape[0]
            order = order.to(x.device)
            x = x.view(n // unit, unit, -1)[order].view(n, -1)
            cos = cos.view(n // unit, unit, 1, -1)[order].view(n, 1, -1)
            sin = sin.view(n // unit, unit, 1, -1)[order].view(n, 1, -1)
        for i, blk in enumerate(self.blocks):
            x = blk(x, cu_full if (not self.qwen25 or i in self.fullatt) else cu_win, cos, sin)
        out = self.merger(x)
        if order is not None:
            out = out[torch.argsort(order)]
        return out
