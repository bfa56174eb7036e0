"""Split-KV (flash-decoding) merge: a query row's partial softmax results over its key segments, combined
into its output. `_merge_segments_kernel` runs as its own launch after `_paged_attn_kernel` (merging inside
that kernel, by the last segment program of each tile, measured no faster on an H200: benchmarks/NOTES.md,
session 36).

Only imported where Triton is installed; nothing here compiles at import time.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _merge_segments_kernel(
    out_ptr,
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    base = (t * num_heads + h) * NUM_SEGMENTS
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_PAD)
    m = tl.load(part_m_ptr + base + offs_s)
    l_s = tl.load(part_l_ptr + base + offs_s)
    m_max = tl.max(m, 0)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_use)  # empty segments: exp2(-inf) = 0
    l_tot = tl.sum(l_s * w, 0)
    acc = tl.load(part_out_ptr + (base + offs_s)[:, None] * HEAD_PAD + offs_d[None, :])
    out = tl.sum(acc * w[:, None], 0) / tl.where(l_tot == 0.0, 1.0, l_tot)
    dst = out_ptr + t * stride_ot + h * stride_oh + offs_d
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_SIZE)
