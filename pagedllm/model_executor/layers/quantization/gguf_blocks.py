"""GGUF block formats and the packed-weight containers shared by the CPU kernels (`gguf`) and the GPU's
Triton kernels (`gguf_triton`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# ggml type ids (gguf.GGMLQuantizationType) the kernels take: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K.
PACKED_TYPES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
_BLOCK = {2: (32, 18), 3: (32, 20), 8: (32, 34), 12: (256, 144), 13: (256, 176), 14: (256, 210)}
TILED = 0x100
"""Flag on `GGUFWeight.qtype`: `data` is in the CPU kernels' tiled layout (`csrc/gguf_tile.c`), not the file's."""
MAX_PARTS = 4
"""Weights one `gguf_mm_parts` call or one decode-stack linear stacks by output rows (`csrc/gguf_common.h`)."""


def row_bytes(qtype: int, cols: int) -> int:
    qk, nbytes = _BLOCK[qtype]
    if cols % qk:
        raise ValueError(f"{PACKED_TYPES[qtype]} rows must have a multiple of {qk} elements, got {cols}")
    return cols // qk * nbytes


@dataclass
class GGUFWeight:
    """One packed weight: `data` is [rows, row_bytes(qtype, cols)] uint8, the GGUF file's blocks, or (`qtype`
    with the `TILED` flag) the same bits re-laid for the CPU's AVX-512 VNNI kernel (`gguf.tile`)."""

    qtype: int
    data: torch.Tensor
    rows: int
    cols: int

    @property
    def type_name(self) -> str:
        return PACKED_TYPES[self.qtype & ~TILED]

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the weight holds (what a GEMV reads)."""
        return [self.data]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


@dataclass
class GGUFTritonWeight(GGUFWeight):
    """A packed weight re-laid for the Triton kernels (`gguf_triton.prepare`, run once at load on the GPU):
    `data` is the low quant bits as int32 words, each group's words (G = 32 elements, 16 for Q6_K) in turn;
    inside a group the int8 GEMV's pair layout for Q4_0 / Q4_1 / Q4_K / Q8_0 (4-bit: byte i holds elements i
    and 16 + i; Q8_0: the bytes in order: `gguf_triton_layout._pair_layout`), word-major for Q5_K / Q6_K (nibble j
    of word w is element 4j + w of its group, 2j + w for Q6_K: `gguf_triton_layout._word_major`), `hi` the Q5_K
    (1 bit) / Q6_K (2 bits) high bits in the word-major order, `d`
    and `dm` the float16 scales and Q4_1 mins / K-quant dmins, `sc` and `mn` the K-quants' decoded 6-bit
    (Q6_K: int8) sub-block scales and mins; Q4_K packs them in two planes, one load each a group: `d` holds
    d | dmin << 16 (their float16 bits) as int32 per 256 elements, `sc` sc | mn << 8 as int16 per 32 (`dm`
    and `mn` None). Same information and about the same bytes as the file's blocks."""

    hi: torch.Tensor | None = None
    d: torch.Tensor | None = None
    dm: torch.Tensor | None = None
    sc: torch.Tensor | None = None
    mn: torch.Tensor | None = None

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.data, self.hi, self.d, self.dm, self.sc, self.mn) if t is not None]
