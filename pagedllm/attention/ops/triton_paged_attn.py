"""Triton kernels for paged attention: one attention kernel for mixed batches (the KV-cache write is in
`triton_kv_write.py`, re-exported here).

Cache layout (one layer): `k_cache`, `v_cache` are each `[num_blocks, block_size, num_kv_heads, head_size]`
(the two halves of the backend's `[2, num_blocks, block_size, num_kv_heads, head_size]` tensor).

`paged_attention` runs a whole batch in one launch: every request is a run of query tokens
(`query_start_loc`) whose last token sits at position `seq_len - 1`; a prefill chunk attends to its
cached prefix plus itself (causal), a decode is a run of length 1. One program owns one tile of query
rows for ONE kv head: rows are (query token, q head of that kv head's group) pairs, so each K/V tile is
read once for all q heads sharing it (GQA/MQA), which is what makes decode bandwidth-efficient.
Programs are numbered so that request r's tiles start at `query_start_loc[r] // BLOCK_Q + r`; a program
finds its request by binary search over `query_start_loc` -- no host-side per-request work. Decode
launches (every request one tile) use one program per request instead.

With `num_splits > 1` (flash-decoding) the key range of every query tile is cut into that many
segments, run by separate programs, each writing an unnormalised partial (acc, running max, sum);
a second kernel merges them. That path exists for batches with few (kv head, request) pairs and long
contexts, where one program per pair cannot fill the GPU.

Importing this module never calls Triton (the kernels compile on first launch) and works without
Triton installed (`HAS_TRITON` is then False and the launchers raise).
"""

from __future__ import annotations

import functools

import torch

from pagedllm.attention.ops.triton_kv_write import reshape_and_cache
from pagedllm.model_executor.layers import batch_invariant
from pagedllm.triton_utils import HAS_TRITON, require_triton
from pagedllm.utils import next_pow2

__all__ = ["HAS_TRITON", "choose_num_splits", "launch_config", "paged_attention", "reshape_and_cache"]

if HAS_TRITON:
    import triton
    import triton.language as tl

_LOG2E = 1.4426950408889634


if HAS_TRITON:

    @triton.jit
    def _find_request(qsl_ptr, pid, num_reqs, BLOCK_Q: tl.constexpr):
        """Largest r with query_start_loc[r] // BLOCK_Q + r <= pid (request r's first tile index)."""
        lo = 0
        hi = num_reqs
        while lo < hi:
            mid = (lo + hi) // 2
            start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
            if start <= pid:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    @triton.jit
    def _attn_tiles(
        m_i,
        l_i,
        acc,
        q,
        q_pos,
        q_lim,
        t_begin,
        t_end,
        kv_hi,
        window,
        qk_scale,
        softcap,
        bt_row,
        k_cache_ptr,
        v_cache_ptr,
        kvh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        HEAD_SIZE: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr,
        CAUSAL: tl.constexpr,
        USE_WINDOW: tl.constexpr,
        MASKED: tl.constexpr,
        DOT_PREC: tl.constexpr,
        SOFTCAP: tl.constexpr,
    ):
        """Online-softmax over key tiles [t_begin, t_end); MASKED=False skips all key masking. SOFTCAP:
        scores = softcap * tanh(scores / softcap), `softcap` given in the log2 domain (cap * log2 e).
        Causal: a row sees keys up to `q_lim` (its position, or with key limits the end of its image)."""
        offs_n = tl.arange(0, TILE_N)
        offs_d = tl.arange(0, HEAD_PAD)
        d_ok = offs_d < HEAD_SIZE
        for t in range(t_begin, t_end):
            k_pos = t * TILE_N + offs_n
            if MASKED:
                k_ok = k_pos < kv_hi
                blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
            else:
                blk = tl.load(bt_row + k_pos // BLOCK_SIZE).to(tl.int64)
            in_blk = k_pos % BLOCK_SIZE
            k_ptrs = k_cache_ptr + (blk * stride_kb + in_blk * stride_kt + kvh * stride_kh)[None, :] + offs_d[:, None]
            v_ptrs = v_cache_ptr + (blk * stride_vb + in_blk * stride_vt + kvh * stride_vh)[:, None] + offs_d[None, :]
            if MASKED:
                k = tl.load(k_ptrs, mask=k_ok[None, :] & d_ok[:, None], other=0.0)  # [HEAD_PAD, TILE_N]
            elif HEAD_PAD != HEAD_SIZE:
                k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            else:
                k = tl.load(k_ptrs)
            s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PREC) * qk_scale  # log2 domain
            if SOFTCAP:
                s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # cap * tanh(s / cap)
            if MASKED:
                ok = k_ok[None, :]
                if CAUSAL:
                    ok = ok & (k_pos[None, :] <= q_lim[:, None])
                if USE_WINDOW:
                    ok = ok & (k_pos[None, :] > q_pos[:, None] - window)
                s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if MASKED:
                # Rows with no visible key yet keep m = -inf; exponentiate against 0 so they stay NaN-free.
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:  # every key of an unmasked tile is visible to every row: m is finite after one tile
                m_use = m_new
            p = tl.math.exp2(s - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            m_i = m_new
            if MASKED:
                v = tl.load(v_ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)  # [TILE_N, HEAD_PAD]
            elif HEAD_PAD != HEAD_SIZE:
                v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
            else:
                v = tl.load(v_ptrs)
            v = v.to(q.dtype)
            acc = acc + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        return m_i, l_i, acc

    # num_reqs and stride_bt (an eager step's block-table width) change from step to step: without
    # do_not_specialize Triton compiles a variant per "divisible by 16" / "== 1" class of each, i.e.
    # recompiles mid-run (measured on the H200: 1-2 s stalls in W1/W2 on a fresh machine).
    @triton.jit(do_not_specialize=["num_reqs", "stride_bt"])
    def _paged_attn_kernel(
        out_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_table_ptr,
        seq_lens_ptr,
        qsl_ptr,
        part_out_ptr,
        part_m_ptr,
        part_l_ptr,
        qk_scale,
        softcap,
        num_reqs,
        num_heads,
        window,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        stride_bt,
        k_scale_ptr,
        v_scale_ptr,
        key_limit_ptr,
        GROUP: tl.constexpr,
        HEAD_SIZE: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        TILE_N: tl.constexpr,
        CAUSAL: tl.constexpr,
        USE_WINDOW: tl.constexpr,
        NUM_SEGMENTS: tl.constexpr,
        DOT_PREC: tl.constexpr,
        FILTER: tl.constexpr,
        DIRECT: tl.constexpr,
        SOFTCAP: tl.constexpr,
        KV_FP8: tl.constexpr,
        KEY_LIMIT: tl.constexpr,
    ):
        pid_q = tl.program_id(0)
        kvh = tl.program_id(1)
        seg = tl.program_id(2)

        if DIRECT:  # one program per request: every request this launch computes fits one tile
            req = pid_q
            q_start = tl.load(qsl_ptr + req)
            qb = 0
        else:
            req = _find_request(qsl_ptr, pid_q, num_reqs, BLOCK_Q)
            q_start = tl.load(qsl_ptr + req)
            qb = pid_q - (q_start // BLOCK_Q + req)
        q_len = tl.load(qsl_ptr + req + 1) - q_start
        if qb * BLOCK_Q >= q_len:  # grid is an upper bound; this tile holds no query
            return
        if FILTER == 1:  # this launch runs the decodes (q_len == 1) only
            if q_len != 1:
                return
        if FILTER == 2:  # this launch runs the multi-token chunks only
            if q_len == 1:
                return
        seq_len = tl.load(seq_lens_ptr + req)
        ctx = seq_len - q_len  # tokens cached before this step's chunk

        offs_m = tl.arange(0, BLOCK_M)
        tok = qb * BLOCK_Q + offs_m // GROUP  # query token within the request's chunk
        head = kvh * GROUP + offs_m % GROUP
        row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
        offs_d = tl.arange(0, HEAD_PAD)
        d_ok = offs_d < HEAD_SIZE
        tok_g = (q_start + tok).to(tl.int64)
        q = tl.load(
            q_ptr + tok_g[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        q_pos = ctx + tok
        if KEY_LIMIT:  # per token, the last key it may see (>= its position: an image's tokens see the image)
            q_lim = tl.load(key_limit_ptr + tok_g, mask=row_ok, other=0)
        else:
            q_lim = q_pos

        # Key range this query tile needs: [kv_lo, kv_hi).
        if CAUSAL:
            kv_hi = ctx + tl.minimum(q_len, (qb + 1) * BLOCK_Q)
            if KEY_LIMIT:
                kv_hi = tl.maximum(kv_hi, tl.max(tl.where(row_ok, q_lim + 1, 0), 0))
        else:
            kv_hi = seq_len
        kv_lo = 0
        if USE_WINDOW:
            kv_lo = tl.maximum(ctx + qb * BLOCK_Q - window + 1, 0)
        tile_lo = kv_lo // TILE_N
        tile_hi = (kv_hi + TILE_N - 1) // TILE_N
        if NUM_SEGMENTS > 1:
            per_seg = (tile_hi - tile_lo + NUM_SEGMENTS - 1) // NUM_SEGMENTS
            t0 = tile_lo + seg * per_seg
            t1 = tl.minimum(t0 + per_seg, tile_hi)
        else:
            t0 = tile_lo
            t1 = tile_hi

        if KV_FP8:  # cache = fp8(x / scale): the K scale joins the score scale, the V scale the output
            qk_scale = qk_scale * tl.load(k_scale_ptr)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
        bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
        # Tiles below t_mid are wholly visible to every row of this tile (all keys < kv_hi and, if causal,
        # <= the first row's position): they skip every mask. Only the diagonal / last tiles are masked.
        if USE_WINDOW:
            t_mid = t0
        elif CAUSAL:
            t_mid = tl.minimum(tl.maximum((ctx + qb * BLOCK_Q + 1) // TILE_N, t0), t1)
        else:
            t_mid = tl.minimum(tl.maximum(kv_hi // TILE_N, t0), t1)
        m_i, l_i, acc = _attn_tiles(
            m_i,
            l_i,
            acc,
            q,
            q_pos,
            q_lim,
            t0,
            t_mid,
            kv_hi,
            window,
            qk_scale,
            softcap,
            bt_row,
            k_cache_ptr,
            v_cache_ptr,
            kvh,
            stride_kb,
            stride_kt,
            stride_kh,
            stride_vb,
            stride_vt,
            stride_vh,
            HEAD_SIZE,
            HEAD_PAD,
            BLOCK_SIZE,
            TILE_N,
            CAUSAL,
            USE_WINDOW,
            False,
            DOT_PREC,
            SOFTCAP,
        )
        m_i, l_i, acc = _attn_tiles(
            m_i,
            l_i,
            acc,
            q,
            q_pos,
            q_lim,
            t_mid,
            t1,
            kv_hi,
            window,
            qk_scale,
            softcap,
            bt_row,
            k_cache_ptr,
            v_cache_ptr,
            kvh,
            stride_kb,
            stride_kt,
            stride_kh,
            stride_vb,
            stride_vt,
            stride_vh,
            HEAD_SIZE,
            HEAD_PAD,
            BLOCK_SIZE,
            TILE_N,
            CAUSAL,
            USE_WINDOW,
            True,
            DOT_PREC,
            SOFTCAP,
        )
        if KV_FP8:
            acc = acc * tl.load(v_scale_ptr)

        if NUM_SEGMENTS == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l == 0: empty row (padding) -> zeros
            tl.store(
                out_ptr + tok_g[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None] & d_ok[None, :],
            )
        else:
            part = (tok_g * num_heads + head) * NUM_SEGMENTS + seg
            tl.store(part_m_ptr + part, m_i, mask=row_ok)
            tl.store(part_l_ptr + part, l_i, mask=row_ok)
            tl.store(part_out_ptr + part[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=row_ok[:, None])

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


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(num_reqs: int, num_kv_heads: int, max_query_len: int, device: torch.device) -> int:
    """Segments per query tile for the split-KV path: >1 only for pure-decode batches under one wave.

    With 128-key tiles a decode program holds ~128 KB of shared memory, so one runs per SM: a batch of
    fewer (request, kv head) pairs than SMs leaves SMs idle (figures: benchmarks/NOTES.md, "Tuning
    figures behind code heuristics"). Depends on host-known batch shape only (never on context lengths), so
    a CUDA graph captured for a batch size stays a good choice whatever lengths are replayed through it.
    """
    if max_query_len != 1 or device.type != "cuda":
        return 1
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    ratio = (2 * sms) // max(1, num_reqs * num_kv_heads)
    if ratio < 2:
        return 1
    return min(16, 1 << (ratio.bit_length() - 1))  # largest power of two <= ratio


def launch_config(head_size: int, group: int, dtype: torch.dtype, max_query_len: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, TILE_N, num_warps, num_stages) for a batch; BLOCK_M counts (token, q head) rows."""
    head_pad = next_pow2(head_size)
    elem = 4 if dtype == torch.float32 else 2
    min_m = max(16, next_pow2(group))
    if max_query_len * group <= 16:  # decode-dominated: a single 16-row tile per request
        # Big key tiles keep many bytes in flight (NOTES, tuning figures); one K tile at most 32 KB so two
        # stages of K and V fit in shared memory.
        tile_n = max(16, min(128, 32768 // (head_pad * elem)))
        return min_m, tile_n, 4, 2
    if elem == 4 or head_pad > 128:  # bigger per-row footprint: smaller tiles
        return max(min_m, 64), 32, 8, 2
    # 128 rows x 32 keys; 8 warps for GQA group 2, 4 for group >= 4 (NOTES, tuning figures).
    return max(min_m, 128), 32, (4 if group >= 4 else 8), 3


def paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_size]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: torch.Tensor,
    output: torch.Tensor,  # [T, num_heads, head_size], written for the first num_actual_tokens rows
    block_table: torch.Tensor,  # [>= num_reqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [>= num_reqs] int32, context length including this step's tokens
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    *,
    num_actual_tokens: int,
    num_reqs: int,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    causal: bool = True,
    num_splits: int = 1,
    workspace: dict | None = None,
    block_m: int | None = None,
    tile_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    num_decodes: int | None = None,
    logits_soft_cap: float | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    key_limit: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every query token over its request's paged K/V (see the module docstring).

    `workspace` (any dict kept for the step) caches the split-KV scratch buffers across layers.
    `num_decodes` (requests with one query token, if known on the host) lets a mixed batch run as two
    launches with tiles suited to each part. block_m/tile_n/num_warps/num_stages override the
    heuristics (benchmarks, tests) and force a single launch. An FP8 cache (1-byte elements) is read back
    as cache * scale with the layer's `kv_scales` (float32 [1] tensors, attention/kv_quant.py).
    `key_limit` ([T] int32, causal only): the last key position each query token may see instead of its own
    (`CommonAttentionMetadata.key_limit`); None compiles and runs the plain causal kernel.
    """
    require_triton()
    if num_actual_tokens == 0 or num_reqs == 0:
        return output
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert query.stride(-1) == 1 and output.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and block_table.stride(-1) == 1
    group = num_heads // num_kv_heads
    head_pad = next_pow2(head_size)
    num_splits = max(1, next_pow2(num_splits))
    use_window = sliding_window is not None and sliding_window > 0
    dot_prec = "ieee" if query.dtype == torch.float32 else "tf32"
    overridden = any(x is not None for x in (block_m, tile_n, num_warps, num_stages))
    kv_fp8 = k_cache.element_size() == 1
    assert not kv_fp8 or kv_scales is not None, "an FP8 cache needs the layer's k/v scales"
    k_scale, v_scale = kv_scales if kv_fp8 else (seq_lens, seq_lens)  # type: ignore[misc]

    # Mixed batch with known decode count: decodes get the 16-row decode tiles, chunks the big prefill
    # tiles (one launch each; each skips the other's requests). Otherwise one launch for everything.
    if num_decodes is not None and 0 < num_decodes < num_reqs and max_query_len > 1 and not overridden:
        launches = [
            (launch_config(head_size, group, query.dtype, 1), 1),
            (launch_config(head_size, group, query.dtype, max_query_len), 2),
        ]
    else:
        cfg = launch_config(head_size, group, query.dtype, max_query_len)
        cfg = tuple(o or c for o, c in zip((block_m, tile_n, num_warps, num_stages), cfg))  # type: ignore[assignment]
        launches = [(cfg, 0)]

    if batch_invariant.enabled():
        # Batch-invariant mode: one tile shape for every step and no split-KV, so a query row meets its keys in
        # the same tiles, in the same order, alone or batched, decoded or inside a (chunked) prefill: key tiles
        # sit at absolute positions and a tile whose keys a row cannot see changes nothing of that row.
        launches = [(launch_config(head_size, group, query.dtype, 1), 0)]
        num_splits = 1

    if num_splits > 1:
        key = (num_actual_tokens, num_reqs, num_heads, num_kv_heads, num_splits, head_pad, query.device)
        bufs = workspace.get(key) if workspace is not None else None
        if bufs is None:
            n_part = num_actual_tokens * num_heads * num_splits
            bufs = (
                torch.empty(n_part * head_pad, dtype=torch.float32, device=query.device),
                torch.empty(n_part, dtype=torch.float32, device=query.device),
                torch.empty(n_part, dtype=torch.float32, device=query.device),
            )
            if workspace is not None:
                workspace[key] = bufs
        part_out, part_m, part_l = bufs
    else:
        part_out = part_m = part_l = output  # unused by the kernel

    for (bm, tn, nw, ns), filt in launches:
        assert bm >= group and bm >= 16 and tn >= 16
        block_q = bm // group
        # Launches with decode tiles run one program per request (req = program id); otherwise programs are
        # numbered by token tiles (found by binary search) and the grid is an upper bound whose surplus exits
        # at once, which for a mixed step's decode launch over a 16k-token batch meant ~2k empty programs per
        # kv head (~80 us per layer on the H200). Chunk launches never go direct, so they compile to one
        # variant whatever the chunk lengths (the start-up warm-up compiles it on short chunks).
        direct = filt == 1 or (max_query_len * group <= 16 and max_query_len <= block_q)
        num_q_tiles = num_reqs if direct else num_actual_tokens // block_q + num_reqs
        _paged_attn_kernel[(num_q_tiles, num_kv_heads, num_splits)](
            output,
            query,
            k_cache,
            v_cache,
            block_table,
            seq_lens,
            query_start_loc,
            part_out,
            part_m,
            part_l,
            scale * _LOG2E,
            (logits_soft_cap or 0.0) * _LOG2E,
            num_reqs,
            num_heads,
            sliding_window if use_window else 0,
            query.stride(0),
            query.stride(1),
            output.stride(0),
            output.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            block_table.stride(0),
            k_scale,
            v_scale,
            key_limit if key_limit is not None else seq_lens,  # (unread without KEY_LIMIT)
            GROUP=group,
            HEAD_SIZE=head_size,
            HEAD_PAD=head_pad,
            BLOCK_SIZE=k_cache.shape[1],
            BLOCK_M=bm,
            BLOCK_Q=block_q,
            TILE_N=tn,
            CAUSAL=causal,
            USE_WINDOW=use_window,
            NUM_SEGMENTS=num_splits,
            DOT_PREC=dot_prec,
            FILTER=filt,
            DIRECT=direct,
            SOFTCAP=bool(logits_soft_cap),
            KV_FP8=kv_fp8,
            KEY_LIMIT=key_limit is not None,
            num_warps=nw,
            num_stages=ns,
        )
    if num_splits > 1:
        _merge_segments_kernel[(num_actual_tokens, num_heads)](
            output,
            part_out,
            part_m,
            part_l,
            num_heads,
            output.stride(0),
            output.stride(1),
            HEAD_SIZE=head_size,
            HEAD_PAD=head_pad,
            NUM_SEGMENTS=num_splits,
            num_warps=4 if head_pad >= 128 else 2,
        )
    return output
