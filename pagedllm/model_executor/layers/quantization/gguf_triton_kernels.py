"""Triton kernels for GGUF weights in the layout of `gguf_triton.prepare` (see `gguf.GGUFTritonWeight`).

Every type is read as value = s * u + m with u an unsigned integer quant and (s, m) constant over a group:
    Q4_0  u = q (0..15)         s = d                  m = -8 d                     group 32
    Q4_1  u = q                 s = d                  m = min                      group 32
    Q8_0  u = q + 128 (0..255)  s = d                  m = -128 d                   group 32
    Q4_K  u = q                 s = d * sc[j]          m = -dmin * mn[j]            group 32 (d, dmin per 256)
    Q5_K  u = q (0..31)         as Q4_K                                             group 32
    Q6_K  u = q (0..63)         s = d * sc[j] (int8)   m = -32 s                    group 16 (d per 256)
so the decode GEMV computes, per packed int32 word (8 nibbles, or 4 bytes for Q8_0, all in one group),
s * sum_j x_j u_j + m * sum_j x_j: one FMA per weight. A quant becomes a float by the exponent trick
(`u | 0x4B000000` is the float 2^23 + u, exact), as `int4_ops` does: Hopper's int-to-float conversion runs
at 1/8 of the FMA rate and would bound the kernel below the memory floor.
"""

from __future__ import annotations

from pagedllm.triton_utils import HAS_TRITON

# ggml type ids (the kernels' QT).
Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 8, 12, 13, 14

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _u2f(bits):
        """int32 0 <= bits < 2^23 -> float32, exactly, without an int-to-float conversion."""
        return (bits | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def _group_sm(d_ptr, dm_ptr, sc_ptr, mn_ptr, r, e, stride_d, stride_sc, mask, QT: tl.constexpr):
        """(s, m) of the groups holding elements `e` of rows `r` (int64; broadcastable): value = s * u + m."""
        if QT == 14:  # Q6_K
            big = tl.load(d_ptr + r * stride_d + e // 256, mask=mask, other=0.0).to(tl.float32)
            s = big * tl.load(sc_ptr + r * stride_sc + e // 16, mask=mask, other=0).to(tl.float32)
            m = -32.0 * s
        elif QT == 12 or QT == 13:  # Q4_K, Q5_K
            off = r * stride_d + e // 256
            big = tl.load(d_ptr + off, mask=mask, other=0.0).to(tl.float32)
            dmin = tl.load(dm_ptr + off, mask=mask, other=0.0).to(tl.float32)
            g = r * stride_sc + e // 32
            s = big * tl.load(sc_ptr + g, mask=mask, other=0).to(tl.float32)
            m = -dmin * tl.load(mn_ptr + g, mask=mask, other=0).to(tl.float32)
        else:  # Q4_0, Q4_1, Q8_0
            g = r * stride_d + e // 32
            s = tl.load(d_ptr + g, mask=mask, other=0.0).to(tl.float32)
            if QT == 3:
                m = tl.load(dm_ptr + g, mask=mask, other=0.0).to(tl.float32)
            elif QT == 8:
                m = -128.0 * s
            else:
                m = -8.0 * s
        return s, m

    @triton.jit
    def _gguf_gemv_kernel(x_ptr, lo_ptr, hi_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr, part_ptr, out_ptr, cnt_ptr,
                          M, N, K, stride_xm, stride_om, stride_lo, stride_hi, stride_d, stride_sc, K_SPLIT, SPLIT,
                          QT: tl.constexpr, EPW: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
        """out[m, n-block] = x[m] @ dequant(W[n-block, k-slice]).T, split-K over programs.

        A program streams a [BN, BK / EPW] tile of int32 words per step (each row's words contiguous), takes
        the EPW quants of every word in turn (`static_range`) into a [BN, words] float32 tile t of
        sum_j x_j u_j, and applies the groups' (s, m) once per word. Split-K partials are summed in
        split order by the last program of the column block (an atomic counter it resets for the next
        launch or CUDA-graph replay), as `int4_ops._int4_gemv_kernel` does."""
        W: tl.constexpr = BK // EPW
        m_row = tl.program_id(0)
        pid_n = tl.program_id(1)
        split = tl.program_id(2)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < N
        r = offs_n.to(tl.int64)[:, None]
        offs_w = tl.arange(0, W)
        k_begin = split * K_SPLIT
        k_end = tl.minimum(k_begin + K_SPLIT, K)
        x_row = x_ptr + m_row * stride_xm
        acc = tl.zeros([BN, W], dtype=tl.float32)
        for k0 in range(k_begin, k_end, BK):
            e0 = k0 + offs_w * EPW  # first element of each word
            w_ok = e0 < k_end
            mask = n_ok[:, None] & w_ok[None, :]
            words = tl.load(lo_ptr + r * stride_lo + (e0 // EPW)[None, :], mask=mask, other=0,
                            eviction_policy="evict_first")  # fmt: skip
            s, mt = _group_sm(d_ptr, dm_ptr, sc_ptr, mn_ptr, r, e0[None, :], stride_d, stride_sc, mask, QT)
            if QT == 13:  # Q5_K: the word's 8 high bits, from the [K / 32] plane of 32-bit words
                hb = tl.load(hi_ptr + r * stride_hi + (e0 // 32)[None, :], mask=mask, other=0)
                hb = hb >> (e0 % 32)[None, :]
            elif QT == 14:  # Q6_K: the word's 8 2-bit pairs, from the [K / 16] plane
                hb = tl.load(hi_ptr + r * stride_hi + (e0 // 16)[None, :], mask=mask, other=0)
                hb = hb >> (2 * (e0 % 16))[None, :]
            elif QT == 8:
                words = words ^ -2139062144  # 0x80808080: every byte becomes u = q + 128
            t = tl.zeros([BN, W], dtype=tl.float32)
            xs = tl.zeros([W], dtype=tl.float32)
            for j in tl.static_range(EPW):
                if QT == 8:
                    u = (words >> (8 * j)) & 0xFF
                else:
                    u = (words >> (4 * j)) & 0xF
                    if QT == 13:
                        u = u | (((hb >> j) & 1) << 4)
                    elif QT == 14:
                        u = u | (((hb >> (2 * j)) & 3) << 4)
                xj = tl.load(x_row + e0 + j, mask=w_ok, other=0.0).to(tl.float32)
                t += _u2f(u) * xj[None, :]
                xs += xj
            acc += t * s + mt * xs[None, :]
        res = tl.sum(acc, axis=1)
        if SPLIT == 1:
            tl.store(out_ptr + m_row * stride_om + offs_n, res.to(out_ptr.dtype.element_ty), mask=n_ok)
        else:
            tl.store(part_ptr + (split * M + m_row) * N + offs_n, res, mask=n_ok)
            tl.debug_barrier()  # every thread's partial is written before the counter moves
            done = tl.atomic_add(cnt_ptr + pid_n * M + m_row, 1, sem="acq_rel")
            tl.debug_barrier()
            if done == SPLIT - 1:
                tot = tl.zeros([BN], dtype=tl.float32)
                for i in range(0, SPLIT):
                    tot += tl.load(part_ptr + (i * M + m_row) * N + offs_n, mask=n_ok, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + m_row * stride_om + offs_n, tot.to(out_ptr.dtype.element_ty), mask=n_ok)
                tl.atomic_xchg(cnt_ptr + pid_n * M + m_row, 0)

    @triton.jit
    def _gguf_gemm_kernel(a_ptr, lo_ptr, hi_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr, c_ptr, M, N, K, stride_am, stride_cm,
                          stride_lo, stride_hi, stride_d, stride_sc, QT: tl.constexpr, EPW: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
        """c = a @ dequant(W).T with tensor cores: each [BK, BN] weight tile is dequantized in registers
        to a's dtype (its words gathered per element; they are reread from L1) and fed to `tl.dot`."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        m_ok = offs_m < M
        n_ok = offs_n < N
        r = offs_n.to(tl.int64)[None, :]
        offs_k = tl.arange(0, BK)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + offs_k
            k_ok = kk < K
            a = tl.load(
                a_ptr + offs_m[:, None] * stride_am + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
            )
            e = kk[:, None]
            mask = k_ok[:, None] & n_ok[None, :]
            wd = tl.load(lo_ptr + r * stride_lo + e // EPW, mask=mask, other=0)
            if QT == 8:
                u = ((wd >> ((e % 4) * 8)) & 0xFF) ^ 0x80
            else:
                u = (wd >> ((e % 8) * 4)) & 0xF
                if QT == 13:
                    h = tl.load(hi_ptr + r * stride_hi + e // 32, mask=mask, other=0)
                    u = u | (((h >> (e % 32)) & 1) << 4)
                elif QT == 14:
                    h = tl.load(hi_ptr + r * stride_hi + e // 16, mask=mask, other=0)
                    u = u | (((h >> ((e % 16) * 2)) & 3) << 4)
            s, mt = _group_sm(d_ptr, dm_ptr, sc_ptr, mn_ptr, r, e, stride_d, stride_sc, mask, QT)
            w = _u2f(u) * s + mt
            acc += tl.dot(a, w.to(a.dtype), input_precision=PREC)
        c = acc.to(c_ptr.dtype.element_ty)
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], c, mask=m_ok[:, None] & n_ok[None, :])
