"""The Triton kernels behind `triton_paged_attn.paged_attention` (see that module for the cache layout and
the launch): `_paged_attn_kernel`, one program per (query tile, kv head, key segment), its online softmax
over key tiles in `_attn_tiles`; with split-KV segments the last of a tile's programs to finish merges their
partials (`_merge_tile`), in the same launch.

Only imported where Triton is installed; nothing here compiles at import time.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedllm.attention.ops.triton_rope_cache import rope_rows
from pagedllm.model_executor.layers.quantization.gguf_triton_int8 import quant_groups_q8
from pagedllm.triton_utils import pdl_enter, pdl_trigger, pdl_wait


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
    t_begin,
    t_end,
    q_lim,
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
    blk_next,
    BT_AHEAD: tl.constexpr,
):
    """Online-softmax over key tiles [t_begin, t_end); MASKED=False skips all key masking. SOFTCAP:
    scores = softcap * tanh(scores / softcap), `softcap` given in the log2 domain (cap * log2 e).
    Causal: a row sees keys up to `q_lim` (its position, or with key limits the end of its image).
    BT_AHEAD: `blk_next` holds tile t_begin's cache blocks (`_tile_blocks`), each tile reads the next one's during
    its own; returned with the sums (the next call's first; without BT_AHEAD, returned as given)."""
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_SIZE
    for t in range(t_begin, t_end):
        k_pos = t * TILE_N + offs_n
        if MASKED:
            k_ok = k_pos < kv_hi
        if BT_AHEAD:
            blk = blk_next
            blk_next = _tile_blocks(bt_row, t + 1, kv_hi, BLOCK_SIZE, TILE_N)
        elif MASKED:
            blk = _tile_blocks(bt_row, t, kv_hi, BLOCK_SIZE, TILE_N)
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
    return m_i, l_i, acc, blk_next


@triton.jit
def _tile_blocks(bt_row, t, kv_hi, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """The cache block of each key of tile t (0 past kv_hi), from the request's block-table row."""
    k_pos = t * TILE_N + tl.arange(0, TILE_N)
    return tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_pos < kv_hi, other=0).to(tl.int64)


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
    order_ptr,
    count_ptr,
    tq_ptr,
    td_ptr,
    ts_ptr,
    stride_tq,
    stride_td,
    pos_ptr,
    cos_sin_ptr,
    stride_cs,
    knew_ptr,
    vnew_ptr,
    stride_knt,
    stride_vnt,
    slot_ptr,
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
    ORDERED: tl.constexpr,
    FP8_F16: tl.constexpr = False,
    MERGE_HEADS: tl.constexpr = 1,
    SEG_CHUNK: tl.constexpr = 1,  # segments the merge takes at a time (NUM_SEGMENTS: all at once)
    TWIN: tl.constexpr = False,
    ROPE: tl.constexpr = False,
    EARLY: tl.constexpr = False,
    LATE_TRIGGER: tl.constexpr = False,
    PDL: tl.constexpr = 0,
):
    # EARLY (PDL decode launches; `paged_attention`'s `early`): the request's lengths, the key range and the segment's
    # share of it are read before the PDL wait (the step's inputs, uploaded before its first kernel: no kernel
    # of the step writes them), and segments past the keys leave without waiting. Program (0, 0, 0) always
    # waits (segment 0 holds keys), so the launch still completes after its predecessor. LATE_TRIGGER (EARLY
    # only): an early kernel's successor may launch once this program has read its key tiles, not at its start
    # (the successor's own early reads then do not compete with them).
    if EARLY:
        if not LATE_TRIGGER:
            pdl_trigger(PDL)
    else:
        pdl_enter(PDL)
    if ORDERED:  # DIRECT only: program i runs (order[i // kv heads], i % kv heads), longest requests first
        pair = tl.program_id(0)
        num_kvh = num_heads // GROUP
        pid_q = tl.load(order_ptr + pair // num_kvh).to(tl.int32)
        kvh = pair % num_kvh
    else:
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
        # The segments that hold keys (at least one: an empty range still merges into zeros). The others leave
        # now, and the tile's arrivals and merge count only these: at W3's contexts (<= 3 key tiles) 3 of 16
        # segments, while long contexts still split 16 ways.
        n_seg = tl.maximum((tile_hi - tile_lo + per_seg - 1) // tl.maximum(per_seg, 1), 1)
        if seg >= n_seg:
            return
        t0 = tile_lo + seg * per_seg
        t1 = tl.minimum(t0 + per_seg, tile_hi)
    else:
        t0 = tile_lo
        t1 = tile_hi
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    blk_pre = seq_len  # (EARLY: the first tile's cache blocks)
    if EARLY:
        blk_pre = _tile_blocks(bt_row, t0, kv_hi, BLOCK_SIZE, TILE_N)
        pdl_wait(PDL)
    if ROPE:  # q as loaded from the qkv output, rotated here (`rope_rows`; HEAD_PAD == HEAD_SIZE, all rotary)
        pos = tl.load(pos_ptr + tok_g, mask=row_ok, other=0).to(tl.int64)
        q_rows = q_ptr + tok_g[:, None] * stride_qt + head[:, None] * stride_qh
        q = rope_rows(q_rows, offs_d, row_ok[:, None], cos_sin_ptr, pos, stride_cs, HEAD_SIZE // 2)
    else:
        q = tl.load(
            q_ptr + tok_g[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
    if ROPE:  # decode launches: the new token's rotated k and its v into the cache, before any tile is read
        _write_new_kv(knew_ptr, vnew_ptr, stride_knt, stride_vnt, slot_ptr, pos_ptr, cos_sin_ptr, stride_cs,
                      k_cache_ptr, v_cache_ptr, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                      q_start, q_len, ctx, t0, t1, kvh, offs_d, HEAD_SIZE, BLOCK_SIZE, TILE_N)  # fmt: skip

    if KV_FP8:  # cache = fp8(x / scale): the K scale joins the score scale, the V scale the output
        qk_scale = qk_scale * tl.load(k_scale_ptr)
        if FP8_F16:
            # Both dots in float16: FP8 -> float16 is one conversion per two elements on Hopper, FP8 -> bfloat16
            # goes through float32 (W2's decode batch, H200, attn_fp8_sweep.py: 1,166 -> 952 us a layer, 0.45x ->
            # 0.55x the copy bandwidth; still slower per byte than the bf16 cache, benchmarks/NOTES.md).
            # Q takes the score scale first (log2 domain), so its magnitudes stay far from float16's range.
            q = (q.to(tl.float32) * qk_scale).to(tl.float16)
            qk_scale = 1.0
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    # Tiles below t_mid are wholly visible to every row of this tile (all keys < kv_hi and, if causal,
    # <= the first row's position): they skip every mask. Only the diagonal / last tiles are masked.
    if USE_WINDOW:
        t_mid = t0
    elif CAUSAL:
        t_mid = tl.minimum(tl.maximum((ctx + qb * BLOCK_Q + 1) // TILE_N, t0), t1)
    else:
        t_mid = tl.minimum(tl.maximum(kv_hi // TILE_N, t0), t1)
    common = (q_lim, kv_hi, window, qk_scale, softcap, bt_row, k_cache_ptr, v_cache_ptr, kvh, stride_kb, stride_kt,
              stride_kh, stride_vb, stride_vt, stride_vh)  # fmt: skip
    # EARLY: the block ids a tile ahead, the first read before the wait
    m_i, l_i, acc, blk_pre = _attn_tiles(m_i, l_i, acc, q, q_pos, t0, t_mid, *common, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE,
                                         TILE_N, CAUSAL, USE_WINDOW, False, DOT_PREC, SOFTCAP, blk_pre,
                                         EARLY)  # fmt: skip
    m_i, l_i, acc, blk_pre = _attn_tiles(m_i, l_i, acc, q, q_pos, t_mid, t1, *common, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE,
                                         TILE_N, CAUSAL, USE_WINDOW, True, DOT_PREC, SOFTCAP, blk_pre,
                                         EARLY)  # fmt: skip
    if LATE_TRIGGER:
        pdl_trigger(PDL)
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
        # The tile's last program to get here merges (a launch less than a separate merge kernel: W3 bf16
        # 4.20 -> 4.14 ms on the H200, benchmarks/NOTES.md session 42): every thread's stores come before the
        # count's release, the merging program's loads after its acquire, from L2 (.cg). The count goes back to
        # 0 for the next layer's launch.
        tl.debug_barrier()
        count = count_ptr + pid_q * (num_heads // GROUP) + kvh
        if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == n_seg - 1:
            tl.store(count, 0)
            t_end = tl.minimum(q_len, (qb + 1) * BLOCK_Q)
            _merge_tile(out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, tq_ptr, td_ptr, ts_ptr, q_start, qb * BLOCK_Q,
                        t_end, kvh, num_heads, n_seg, stride_ot, stride_oh, stride_tq, stride_td, GROUP, HEAD_SIZE,
                        HEAD_PAD, NUM_SEGMENTS, MERGE_HEADS, TWIN, SEG_CHUNK)  # fmt: skip


@triton.jit
def _write_new_kv(knew_ptr, vnew_ptr, stride_knt, stride_vnt, slot_ptr, pos_ptr, cos_sin_ptr, stride_cs, k_cache_ptr,
                  v_cache_ptr, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, q_start, q_len, ctx,
                  t0, t1, kvh, offs_d, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  TILE_N: tl.constexpr):  # fmt: skip
    """A decode request's new token (position ctx in its cache) for kv head `kvh`: its k rotated (`rope_rows`)
    and its v written to the token's cache slot (-1: padding, nothing) by the one program whose key tiles
    [t0, t1) hold that position, which then reads it back with its tiles (a CTA barrier between: no other
    program reads that key). What `rotary_embedding_`'s cache write does, without its launch."""
    t_new = ctx // TILE_N
    if (q_len == 1) & (t0 <= t_new) & (t_new < t1):
        tok = q_start.to(tl.int64)
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        if slot >= 0:
            pos = tl.load(pos_ptr + tok + tl.zeros([1], dtype=tl.int64)).to(tl.int64)
            k_row = knew_ptr + (tok * stride_knt + kvh * HEAD_SIZE + tl.zeros([1, 1], dtype=tl.int64))
            d_ok = (offs_d < HEAD_SIZE)[None, :]
            k = rope_rows(k_row, offs_d, d_ok, cos_sin_ptr, pos, stride_cs, HEAD_SIZE // 2)
            blk = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
            k_dst = k_cache_ptr + blk * stride_kb + off * stride_kt + kvh * stride_kh + offs_d[None, :]
            tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=d_ok)
            v = tl.load(vnew_ptr + tok * stride_vnt + kvh * HEAD_SIZE + offs_d, mask=offs_d < HEAD_SIZE)
            v_dst = v_cache_ptr + blk * stride_vb + off * stride_vt + kvh * stride_vh + offs_d
            tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=offs_d < HEAD_SIZE)
        tl.debug_barrier()  # the stores before this program's tile loads


@triton.jit
def _merge_tile(
    out_ptr,
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,
    tq_ptr,
    td_ptr,
    ts_ptr,
    q_start,
    t_begin,
    t_end,
    kvh,
    num_heads,
    n_seg,
    stride_ot,
    stride_oh,
    stride_tq,
    stride_td,
    GROUP: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    MERGE_HEADS: tl.constexpr,
    TWIN: tl.constexpr,
    SEG_CHUNK: tl.constexpr,
):
    """The split-KV segments' partials (the first `n_seg` of NUM_SEGMENTS: the others held no key) of tokens
    [t_begin, t_end) of a request (from `q_start`) for the GROUP query heads of kv head `kvh`, merged into the
    output, MERGE_HEADS heads and SEG_CHUNK segments at a time (a [heads, segments, head] tile, its loads all in
    flight at once; chunks of segments merged online, a chunk as many as NUM_SEGMENTS: one pass, the tile in
    registers whatever n_seg). TWIN: the rows' q8_1 quantization too (`quant_groups_q8`, o_proj's int8 GEMV
    input; HEAD_PAD == HEAD_SIZE), of the 16-bit rows as stored."""
    offs_h = tl.arange(0, MERGE_HEADS)
    offs_c = tl.arange(0, SEG_CHUNK)
    offs_d = tl.arange(0, HEAD_PAD)
    for t in range(t_begin, t_end):
        tok = (q_start + t).to(tl.int64)
        for h0 in range(0, GROUP, MERGE_HEADS):
            h_ok = h0 + offs_h < GROUP
            head = kvh * GROUP + h0 + offs_h
            m_run = tl.full([MERGE_HEADS], float("-inf"), dtype=tl.float32)
            l_tot = tl.zeros([MERGE_HEADS], dtype=tl.float32)
            acc_run = tl.zeros([MERGE_HEADS, HEAD_PAD], dtype=tl.float32)
            for s0 in range(0, n_seg, SEG_CHUNK):
                offs_s = s0 + offs_c
                part = (tok * num_heads + head)[:, None] * NUM_SEGMENTS + offs_s[None, :]  # [heads, segments]
                ok = h_ok[:, None] & (offs_s < n_seg)[None, :]
                m = tl.load(part_m_ptr + part, mask=ok, other=float("-inf"), cache_modifier=".cg")
                l_s = tl.load(part_l_ptr + part, mask=ok, other=0.0, cache_modifier=".cg")
                acc = tl.load(
                    part_out_ptr + part[:, :, None] * HEAD_PAD + offs_d[None, None, :],
                    mask=ok[:, :, None],
                    other=0.0,
                    cache_modifier=".cg",
                )
                m_new = tl.maximum(m_run, tl.max(m, 1))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.math.exp2(m_run - m_use)  # the chunks before (none: exp2(-inf) = 0, the sums exact)
                w = tl.math.exp2(m - m_use[:, None])  # empty segments: exp2(-inf) = 0
                l_tot = l_tot * alpha + tl.sum(l_s * w, 1)
                acc_run = acc_run * alpha[:, None] + tl.sum(acc * w[:, :, None], 1)
                m_run = m_new
            o = acc_run / tl.where(l_tot == 0.0, 1.0, l_tot)[:, None]
            o = o.to(out_ptr.dtype.element_ty)
            dst = out_ptr + tok * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
            tl.store(dst, o, mask=h_ok[:, None] & (offs_d < HEAD_SIZE)[None, :])
            if TWIN:
                col0 = (kvh * GROUP + h0) * HEAD_SIZE
                quant_groups_q8(
                    tl.reshape(o.to(tl.float32), [MERGE_HEADS * HEAD_PAD]),
                    tq_ptr + tok * stride_tq,
                    td_ptr + tok * stride_td,
                    ts_ptr + tok * stride_td,
                    col0,
                    (kvh + 1) * GROUP * HEAD_SIZE,
                    MERGE_HEADS * HEAD_PAD,
                )


@triton.jit(do_not_specialize=["n"])
def _longest_first_kernel(seq_lens_ptr, order_ptr, n, BLOCK: tl.constexpr):
    """order[rank(i)] = i, rank(i) = #{j: len_j > len_i} + #{j < i: len_j == len_i}: request indices by
    descending length, ties in index order (a stable sort by counting; n is a batch, a few hundred at most)."""
    offs_i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    i_ok = offs_i < n
    len_i = tl.load(seq_lens_ptr + offs_i, mask=i_ok, other=0)
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    for j0 in range(0, n, BLOCK):
        offs_j = j0 + tl.arange(0, BLOCK)
        len_j = tl.load(seq_lens_ptr + offs_j, mask=offs_j < n, other=-1)
        before = (len_j[None, :] > len_i[:, None]) | (
            (len_j[None, :] == len_i[:, None]) & (offs_j[None, :] < offs_i[:, None])
        )
        rank += tl.sum(before.to(tl.int32), axis=1)
    tl.store(order_ptr + rank, offs_i, mask=i_ok)
