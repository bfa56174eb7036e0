"""The load-time layout of GGUF weights for the Triton kernels (`prepare`) and its torch references.

`prepare` turns a file's blocks ([rows, row_bytes] uint8, `gguf.GGUFWeight`) into a `GGUFTritonWeight`:
the quants as int32 words, each row's words contiguous (a program's tile of a row is one run, loaded with
16-byte loads), inside each group in the "pair" layout of the int8 GEMV (Q4_0 / Q4_1 / Q4_K / Q8_0) or
word-major (Q5_K / Q6_K; `gguf_triton_kernels` describes both), the high bits of Q5_K / Q6_K in their own
planes in the word-major order, and the scale fields in separate tensors with the K-quants' 6-bit scales
and mins decoded to bytes (Q4_K's packed two to a field: `GGUFTritonWeight`). The bytes are the file's but
for that decoding (Q4_K 148 per 256 weights instead of 144, Q5_K 180 instead of 176; the others equal).
`dequantize` (torch, any device) is the layout-independent reference of the same decoding, checked against
the `gguf` package's in the tests; `q8_activations` the reference of the int8 GEMV's activations. Torch only:
nothing here needs Triton (the launchers are in `gguf_triton`).
"""

from __future__ import annotations

import torch

from pagedllm.model_executor.layers.quantization.gguf_blocks import _BLOCK, GGUFTritonWeight, GGUFWeight
from pagedllm.model_executor.layers.quantization.gguf_triton_kernels import Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0

_ROW_CHUNK = 4096  # rows unpacked at a time by `prepare` (bounds its temporaries on the LM head)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [...] float16 (little-endian, as the file stores them)."""
    return b.contiguous().view(torch.float16).squeeze(-1)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins [..., 12] -> (sc, mn) [..., 8] uint8 (ggml's
    get_scale_min_k4)."""
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], dim=-1)
    mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)
    return sc, mn


def _unpack(qtype: int, raw: torch.Tensor, cols: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A file's blocks [rows, row_bytes] uint8 -> (u [rows, cols] uint8 quants in element order, Q8_0's as
    stored (two's complement), the others unsigned; the scale fields, per row)."""
    qk, nb = _BLOCK[qtype]
    rows = raw.shape[0]
    b = raw.reshape(rows, cols // qk, nb)
    f: dict[str, torch.Tensor] = {}
    if qtype in (Q4_0, Q4_1):
        f["d"] = _f16(b[..., 0:2])
        if qtype == Q4_1:
            f["dm"] = _f16(b[..., 2:4])
        qs = b[..., nb - 16 :]
        u = torch.cat([qs & 0xF, qs >> 4], dim=-1)  # byte i: element i (low), i + 16 (high)
    elif qtype == Q8_0:
        f["d"] = _f16(b[..., 0:2])
        u = b[..., 2:]
    elif qtype in (Q4_K, Q5_K):
        f["d"], f["dm"] = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        f["sc"], f["mn"] = _k_scales(b[..., 4:16])
        qs = b[..., nb - 128 :].reshape(rows, -1, 4, 1, 32)  # 4 chunks of 64: low nibbles, then high
        u = torch.cat([qs & 0xF, qs >> 4], dim=3)
        if qtype == Q5_K:
            qh = b[..., 16:48].reshape(rows, -1, 1, 1, 32)
            shift = torch.arange(8, device=raw.device, dtype=torch.uint8).view(1, 1, 4, 2, 1)
            u = u | (((qh >> shift) & 1) << 4)
    elif qtype == Q6_K:
        ql = b[..., 0:128].reshape(rows, -1, 2, 1, 64)
        ql = torch.cat([ql & 0xF, ql >> 4], dim=3).reshape(rows, -1, 2, 4, 32)
        qh = b[..., 128:192].reshape(rows, -1, 2, 1, 32)
        shift = torch.arange(0, 8, 2, device=raw.device, dtype=torch.uint8).view(1, 1, 1, 4, 1)
        u = ql | (((qh >> shift) & 3) << 4)
        f["sc"] = b[..., 192:208].contiguous().view(torch.int8)
        f["d"] = _f16(b[..., 208:210])
    else:
        raise ValueError(f"gguf: no Triton kernel for ggml type {qtype}")
    f = {k: v.reshape(rows, -1) for k, v in f.items()}
    return u.reshape(rows, cols), f


def dequantize(w: GGUFWeight) -> torch.Tensor:
    """The file's blocks as float32 [rows, cols], on their device (torch ops; the reference the GPU tests
    and the benchmark check the kernels with)."""
    u, f = _unpack(w.qtype, w.data, w.cols)
    rows, cols = w.rows, w.cols
    if w.qtype == Q8_0:
        return (u.view(torch.int8).float().view(rows, -1, 32) * f["d"].float()[..., None]).view(rows, cols)
    if w.qtype == Q6_K:
        s = f["sc"].float() * f["d"].float().repeat_interleave(16, dim=1)  # per group of 16
        return ((u.float().view(rows, -1, 16) - 32) * s[..., None]).view(rows, cols)
    q = u.float().view(rows, -1, 32)
    if w.qtype in (Q4_0, Q4_1):
        d = f["d"].float()[..., None]
        return (d * (q - 8) if w.qtype == Q4_0 else d * q + f["dm"].float()[..., None]).view(rows, cols)
    d = f["d"].float().repeat_interleave(8, dim=1)
    dmin = f["dm"].float().repeat_interleave(8, dim=1)
    s, m = d * f["sc"].float(), dmin * f["mn"].float()
    return (q * s[..., None] - m[..., None]).view(rows, cols)


def q8_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] (K % 32 == 0) as the int8-activation GEMV sees it, float32: per group of 32, d = amax / 127,
    q = roundf(x * (127 / amax)) (half away from zero), value d * q. The reference of the kernel tests."""
    xf = x.float().view(x.shape[0], -1, 32)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    c127 = torch.full_like(amax, 127.0)  # tensor / tensor: torch turns a scalar division into a reciprocal
    inv = torch.where(amax > 0, c127 / amax.clamp_min(1e-30), torch.zeros_like(amax))
    y = xf * inv
    t = y.trunc()
    f = y - t
    q = t + (f >= 0.5).float() - (f <= -0.5).float()
    return (q * (amax / c127)).view(x.shape)


def _pack_bits(u: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, cols] small ints -> int32 [rows, cols * bits / 32]: element 32/bits * w + j of a row is
    `bits` bits at bit j * bits of word w."""
    per = 32 // bits
    rows, cols = u.shape
    v = u.to(torch.int64).view(rows, cols // per, per)
    shifts = torch.arange(per, device=u.device, dtype=torch.int64) * bits
    packed = (v << shifts).sum(dim=-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def group_size(qtype: int) -> int:
    """Elements sharing one (scale, min): 16 for Q6_K, 32 for the others."""
    return 16 if qtype == Q6_K else 32


def quants_per_word(qtype: int) -> int:
    return 4 if qtype == Q8_0 else 8


Q8A_TYPES = (Q4_0, Q4_1, Q4_K, Q8_0)
"""Types in the pair layout, multiplied by the int8-activation GEMV (`gguf_triton_int8`) for 16-bit
activations."""


def _pair_layout(qtype: int, u: torch.Tensor) -> torch.Tensor:
    """[rows, cols] quants in element order -> int32 words [rows, cols / EPW] of the pair layout: Q8_0's bytes
    as they are; 4-bit: byte i of each group of 32 is element i | element 16 + i << 4."""
    rows, cols = u.shape
    if qtype == Q8_0:
        return u.contiguous().view(torch.int32)
    g = u.view(rows, cols // 32, 2, 16)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(rows, cols // 2).contiguous().view(torch.int32)


def _word_major(qtype: int, u: torch.Tensor) -> torch.Tensor:
    """[rows, cols] quants in element order -> the word-major order of the kernels: inside each group of G,
    position w * EPW + j (quant j of word w) holds element WPG * j + w (WPG = G / EPW words a group)."""
    g, epw = group_size(qtype), quants_per_word(qtype)
    rows, cols = u.shape
    return u.view(rows, cols // g, epw, g // epw).transpose(-1, -2).reshape(rows, cols)


def prepare(w: GGUFWeight, device: torch.device | str | None = None) -> GGUFTritonWeight:
    """The Triton kernels' layout of `w` (see `GGUFTritonWeight`) on `device` (default: w's). Run once at
    load; the raw bytes are not kept."""
    device = torch.device(device) if device is not None else w.data.device
    planes: dict[str, list[torch.Tensor]] = {}
    for r0 in range(0, w.rows, _ROW_CHUNK):
        raw = w.data[r0 : r0 + _ROW_CHUNK].to(device)
        u, f = _unpack(w.qtype, raw, w.cols)
        if w.qtype in Q8A_TYPES:
            f["lo"] = _pair_layout(w.qtype, u)
        else:
            u = _word_major(w.qtype, u)
            f["lo"] = _pack_bits(u & 0xF, 4)
            if w.qtype == Q5_K:
                f["hi"] = _pack_bits(u >> 4, 1)
            elif w.qtype == Q6_K:
                f["hi"] = _pack_bits(u >> 4, 2)
        for k, v in f.items():
            planes.setdefault(k, []).append(v.contiguous())
    t = {k: torch.cat(v) if len(v) > 1 else v[0] for k, v in planes.items()}
    if w.qtype == Q4_K:  # two planes, one load each a group: d | dmin << 16 as int32, sc | mn << 8 as int16
        t["d"] = torch.stack([t["d"], t.pop("dm")], dim=-1).view(torch.int32).squeeze(-1)
        t["sc"] = torch.stack([t["sc"], t.pop("mn")], dim=-1).view(torch.int16).squeeze(-1)
    return GGUFTritonWeight(
        w.qtype, t["lo"], w.rows, w.cols, hi=t.get("hi"), d=t["d"], dm=t.get("dm"), sc=t.get("sc"), mn=t.get("mn")
    )
