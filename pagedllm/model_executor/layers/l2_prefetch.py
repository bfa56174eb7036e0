"""Weights asked into L2 ahead of the decode GEMV that reads them.

A batch-1 decode step alternates weight-streaming GEMVs with small latency-bound kernels; during the attention
(RoPE + cache write before it, ~9 us a layer of an 8B model on an H200, a few hundred KB of K/V) the memory bus
is nearly idle. `link_attention_prefetch` gives each layer's attention a table of byte ranges that its decode
launches ask L2 for (`triton_utils.l2_prefetch`, one `cp.async.bulk.prefetch.L2` a 4 KB chunk, issued before
the kernel's PDL wait): "o" that layer's o_proj weights, "qkv" the next layer's q/k/v weights. The GEMVs load
their weights with an evict-first policy, so lines asked for at normal priority outlive the streams between
(an H200's L2 is 60 MB; a 4-bit 8B layer's o + qkv ~26 MB). The other small kernels of a layer idle the bus
too (a norm ~2.5 us, the SiLU-mul ~1.5 us): with "norm" / "silu" each norm / SiLU-mul that feeds a linear
directly (the layer's `twin_pairs()`) asks for the first `prefix_bytes` of that linear's weights (of each
of its tensors in proportion: the GEMV's first programs read the first rows). `PAGEDLLM_ATTN_L2_PREFETCH`
names the targets, `PAGEDLLM_L2_PREFETCH_MB` the prefix (empty: off; an experiment until measured,
benchmarks/NOTES.md sessions 42-43).

The table holds raw addresses: it is made after the weights reach their final place (after loading, or after a
benchmark swaps them) and made again whenever they move.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm import envs
from pagedllm.model_executor.layers.quantization.act_twin import Q8_MAX_ROWS

TARGETS = ("o", "qkv", "norm", "silu")
_PRODUCER_TARGET = {"RMSNorm": "norm", "SiluAndMul": "silu"}  # producers of twin_pairs() that may prefetch


def table_for(kernel_owner: Any, x: torch.Tensor) -> torch.Tensor | None:
    """The owner's table if its input `x` is a decode batch whose GEMVs stream weights (the int8 GEMV's rows)."""
    table = getattr(kernel_owner, "l2_prefetch", None)
    return table if table is not None and x.numel() <= x.shape[-1] * Q8_MAX_ROWS else None


def weight_tensors(linear: nn.Module) -> list[torch.Tensor]:
    """The tensors a linear's decode GEMV streams: a GGUF method's packed parts (quants and scales), else its
    weight."""
    parts = getattr(getattr(linear, "quant_method", None), "parts", None)
    if parts:
        return [t for p in parts for t in p.tensors if t.numel()]
    w = getattr(linear, "weight", None)
    return [w] if isinstance(w, torch.Tensor) and w.numel() else []


def prefetch_table(tensors: list[torch.Tensor], prefix_bytes: int | None = None) -> torch.Tensor | None:
    """int64 [N, 2] (address, bytes) of `tensors` on their device (contiguous ones; None when there is none);
    with `prefix_bytes`, about that many bytes in all: the same leading fraction of each tensor (16-byte
    multiples, the bulk prefetch's granule)."""
    tensors = [t for t in tensors if t.is_contiguous()]
    sizes = [t.numel() * t.element_size() for t in tensors]
    if prefix_bytes is not None and sum(sizes) > prefix_bytes:
        frac = prefix_bytes / sum(sizes)
        sizes = [int(n * frac) // 16 * 16 for n in sizes]
    rows = [[t.data_ptr(), n] for t, n in zip(tensors, sizes, strict=True) if n > 0]
    if not rows:
        return None
    return torch.tensor(rows, dtype=torch.int64, device=tensors[0].device)


def parse_targets(setting: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in setting.split(",") if s.strip())
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise ValueError(f"PAGEDLLM_ATTN_L2_PREFETCH: unknown target(s) {unknown}; known: {', '.join(TARGETS)}")
    return names


def link_from_env(model: nn.Module) -> int:
    """`link_prefetch` with the targets and prefix of `PAGEDLLM_ATTN_L2_PREFETCH` / `PAGEDLLM_L2_PREFETCH_MB`."""
    targets = parse_targets(envs.PAGEDLLM_ATTN_L2_PREFETCH)
    return link_prefetch(model, targets, int(envs.PAGEDLLM_L2_PREFETCH_MB * (1 << 20)))


def link_prefetch(model: nn.Module, targets: tuple[str, ...], prefix_bytes: int = 8 << 20) -> int:
    """The attention backends', norms' and SiLU-muls' tables of `targets` (see the module docstring); no
    targets clears them. Returns how many kernels were given a table."""
    return link_attention_prefetch(model, targets) + link_producer_prefetch(model, targets, prefix_bytes)


def link_producer_prefetch(model: nn.Module, targets: tuple[str, ...], prefix_bytes: int) -> int:
    """Each norm / SiLU-mul of a decoder layer's `twin_pairs()` whose target ("norm" / "silu") is named gets the
    table of its linear's first `prefix_bytes`; the others get none. Returns the producers given a table."""
    n = 0
    for m in model.modules():
        pairs = getattr(m, "twin_pairs", None)
        for producer, linear in pairs() if pairs is not None else ():
            target = _PRODUCER_TARGET.get(type(producer).__name__)
            if target is None:
                continue
            producer.l2_prefetch = prefetch_table(weight_tensors(linear), prefix_bytes) if target in targets else None
            n += producer.l2_prefetch is not None
    return n


def link_attention_prefetch(model: nn.Module, targets: tuple[str, ...]) -> int:
    """Each decoder layer's attention backend gets the table of its `targets` ("o", "qkv"); none clears them.
    Layers are those with a `self_attn` holding `attn`, `qkv_proj` and `o_proj`, in module order; backends
    without an `l2_prefetch` attribute are skipped. Returns the layers given a table."""
    layers: list[Any] = [
        m.self_attn
        for m in model.modules()
        if all(hasattr(getattr(m, "self_attn", None), a) for a in ("attn", "qkv_proj", "o_proj"))
    ]
    n = 0
    for i, sa in enumerate(layers):
        impl = sa.attn.impl
        if not hasattr(impl, "l2_prefetch"):
            continue
        tensors: list[torch.Tensor] = []
        if "o" in targets:
            tensors += weight_tensors(sa.o_proj)
        if "qkv" in targets and i + 1 < len(layers):
            tensors += weight_tensors(layers[i + 1].qkv_proj)
        impl.l2_prefetch = prefetch_table(tensors)
        n += impl.l2_prefetch is not None
    return n
