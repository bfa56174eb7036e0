"""Triton kernels for GGUF weights in the layout of `gguf_triton.prepare` (see `gguf.GGUFTritonWeight`).

Every type is read as value = s * (u - c) + m with u an unsigned integer quant and (s, m) constant over a
group of G elements:
    Q4_0  u = q (0..15)         c = 8     s = d                  m = 0                  G 32
    Q4_1  u = q                 c = 0     s = d                  m = min                G 32
    Q8_0  u = q + 128 (0..255)  c = 128   s = d                  m = 0                  G 32
    Q4_K  u = q                 c = 0     s = d * sc[j]          m = -dmin * mn[j]      G 32 (d, dmin per 256)
    Q5_K  u = q (0..31)         as Q4_K                                                 G 32
    Q6_K  u = q (0..63)         c = 32    s = d * sc[j] (int8)   m = 0                  G 16 (d per 256)

Layouts (int32 words, a group's words contiguous in its row). "Pair" layout, Q4_0 / Q4_1 / Q4_K / Q8_0:
the int8-activation GEMV's (`_gguf_gemv_q8a_kernel`); 4-bit: byte i of a group's 16 holds element i in its
low nibble and element 16 + i in its high one (Q4_0 / Q4_1 as the file stores them, Q4_K's 32-element
sub-blocks brought to the same form); Q8_0: the bytes in element order. So word w's low nibbles (bytes) are
elements 4w..4w+3, the same 4 bytes an int8 activation word holds. "Word-major" layout, Q5_K / Q6_K: with
WPG = G / EPW words per group (EPW quants a word), quant j of word w is element WPG * j + w of the group,
so the float GEMV loads each x_j slice as one contiguous run.

Decode GEMV with 16-bit activations and a pair-layout type: the activations are quantized to int8 per
group of 32 inside the program and the products summed by IDP4A, 4 per instruction (see the kernel).

Float decode GEMV (float32 activations, and Q5_K / Q6_K). At the packed-bytes floor a 4-bit GEMV must
turn ~7e12 weights/s into products on an H200, about 30 per SM per clock, and an SM issues 4 warp
instructions a clock (integer ops at half the FMA rate): every instruction per weight counts. A quant is
made a float by the exponent trick without shifting it down: the nibble (byte for Q8_0) stays in place at
bit P < 20 of the word (the upper half of a word is shifted down by 12 once per word), `(word & mask) | E`
is the float 2^(23 - P) + u exactly, and one subtraction of the constant 2^(23 - P) + c leaves u - c. So a
weight costs one LOP3 (E comes in as the argument EXP0 so that it sits in a register and the mask is the
immediate), one FADD and one FFMA. Scales are applied once per group after summing its words in
registers. Checked on the SASS (sm_90a): the 4-bit loop is ~4.0-4.5 instructions per weight (BN 64-128,
BK 256): issue-bound on an H200 (1.9-2.5x the packed floor, session 36), hence the IDP4A kernel.
"""

from __future__ import annotations

from pagedllm.triton_utils import HAS_TRITON

# ggml type ids (the kernels' QT).
Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 8, 12, 13, 14

if HAS_TRITON:
    import triton
    import triton.language as tl

    from pagedllm.triton_utils import pdl_enter

    @triton.jit
    def _u2f(bits):
        """int32 0 <= bits < 2^23 -> float32, exactly, without an int-to-float conversion."""
        return (bits | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def _quant(words, hi16, hb, exp0, J: tl.constexpr, QT: tl.constexpr):
        """Quant J of every word as float32 u - c (see the module docstring). `hi16` is words >> 12,
        `hb` the Q5_K / Q6_K high bits of the word (bit / bit pair J)."""
        if QT == 13 or QT == 14:
            u = (words >> (4 * J)) & 0xF
            if QT == 13:
                u = u | (((hb >> J) & 1) << 4)
            else:
                u = u | (((hb >> (2 * J)) & 3) << 4)
            C6: tl.constexpr = 8388608 + (32 if QT == 14 else 0)
            return (u | 0x4B000000).to(tl.float32, bitcast=True) - C6
        else:
            BITS: tl.constexpr = 8 if QT == 8 else 4
            PER: tl.constexpr = 16 // BITS  # quants in the low half of a word
            # Bit position of the quant: in place in the low half, from `hi16` (words >> 12: never a
            # field at bit 0, which the compiler would turn into a shift and a bit-field extract per use)
            P: tl.constexpr = BITS * J if J < PER else BITS * J - 12
            OFF: tl.constexpr = 128 if QT == 8 else (8 if QT == 2 else 0)
            MASK: tl.constexpr = ((1 << BITS) - 1) << P
            C: tl.constexpr = (1 << (23 - P)) + OFF
            exp = exp0 - (P << 23)  # exponent field of 2^(23 - P): the float 2^(23 - P) + u
            if J < PER:
                bits = (words & MASK) | exp
            else:
                bits = (hi16 & MASK) | exp
            return bits.to(tl.float32, bitcast=True) - C

    @triton.jit
    def _gguf_gemv_kernel(x_ptr, lo_ptr, hi_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr, part_ptr, out_ptr, cnt_ptr,
                          M, N, K, stride_xm, stride_om, stride_lo, stride_hi, stride_d, stride_sc, K_SPLIT, SPLIT,
                          EXP0, QT: tl.constexpr, EPW: tl.constexpr, G: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr = 0):  # fmt: skip
        """out[m, n-block] = x[m] @ dequant(W[n-block, k-slice]).T, split-K over programs.

        A program streams [BN, BK / EPW] tiles of int32 words (each row's words contiguous, 16-byte loads;
        rows past N are clamped to N - 1, so no load is masked when K is a multiple of BK), takes the EPW
        quants of every word in turn (`static_range`) into a [BN, words] float32 tile t of sum_j x_j (u_j - c),
        sums each group's words (a reshape [BN, groups, WPG] and an in-register sum) and applies the
        group's s (and m times the group's sum of x) once per group. Split-K partials are summed in split
        order by the last program of the column block (an atomic counter it resets for the next launch or
        CUDA-graph replay), as `int4_ops._int4_gemv_kernel` does."""
        W: tl.constexpr = BK // EPW
        WPG: tl.constexpr = G // EPW
        GS: tl.constexpr = BK // G
        HAS_MIN: tl.constexpr = QT == 3 or QT == 12 or QT == 13
        PAIR: tl.constexpr = QT != 13 and QT != 14  # the int8-activation kernel's layout (`_q8a` types)
        pdl_enter(PDL)
        pid_n = tl.program_id(0)  # (grid x: a row a program makes more column blocks than y's 65,535)
        m_row = tl.program_id(1)
        split = tl.program_id(2)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < N
        r = tl.minimum(offs_n, N - 1).to(tl.int64)[:, None]
        offs_w = tl.arange(0, W)
        offs_g = tl.arange(0, GS)
        # Element of quant 0 of each word, from the step's start (quant j: + _xj(j)).
        if PAIR:
            xo = (offs_w // WPG) * G + (offs_w % WPG) * 4
        else:
            xo = (offs_w // WPG) * G + offs_w % WPG
        k_begin = split * K_SPLIT
        k_end = tl.minimum(k_begin + K_SPLIT, K)
        x_row = x_ptr + m_row * stride_xm
        lo_rows = lo_ptr + r * stride_lo + offs_w[None, :]
        d_rows = d_ptr + r * stride_d
        acc = tl.zeros([BN, GS], dtype=tl.float32)
        for k0 in range(k_begin, k_end, BK):
            kw = tl.multiple_of(k0 // EPW, W)  # K_SPLIT is a multiple of BK: 16-byte aligned row runs
            if EVEN_K:
                w_ok = offs_w >= 0
                words = tl.load(lo_rows + kw, eviction_policy="evict_first")
            else:
                w_ok = k0 + xo < k_end  # whole groups: K is a multiple of G
                words = tl.load(lo_rows + kw, mask=w_ok[None, :], other=0, eviction_policy="evict_first")
            hi16 = words
            hb = words
            if QT == 13:  # Q5_K: 8 high bits a word, from the [K / 32] plane of 32-bit words
                hb = tl.load(hi_ptr + r * stride_hi + ((kw + offs_w) // 4)[None, :], mask=w_ok[None, :], other=0)
                hb = hb >> ((offs_w % 4) * 8)[None, :]
            elif QT == 14:  # Q6_K: 8 2-bit pairs a word, from the [K / 16] plane
                hb = tl.load(hi_ptr + r * stride_hi + ((kw + offs_w) // 2)[None, :], mask=w_ok[None, :], other=0)
                hb = hb >> ((offs_w % 2) * 16)[None, :]
            elif QT == 8:
                words = words ^ -2139062144  # 0x80808080: every byte becomes u = q + 128
                hi16 = words >> 12
            else:
                hi16 = words >> 12
            t = tl.zeros([BN, W], dtype=tl.float32)
            xw = tl.zeros([W], dtype=tl.float32)
            kx = tl.multiple_of(k0, BK)
            for j in tl.static_range(EPW):
                xj_at = (j if QT == 8 else j // 2 + 16 * (j % 2)) if PAIR else j * WPG
                if EVEN_K:
                    xj = tl.load(x_row + kx + xo + xj_at).to(tl.float32)
                else:
                    xj = tl.load(x_row + kx + xo + xj_at, mask=w_ok, other=0.0).to(tl.float32)
                t += _quant(words, hi16, hb, EXP0, j, QT) * xj[None, :]
                if HAS_MIN:
                    xw += xj
            tg = tl.sum(tl.reshape(t, [BN, GS, WPG]), axis=2)  # [BN, GS]: each group's sum_j x_j (u_j - c)
            g = k0 // G + offs_g
            if EVEN_K:
                g_ok = (g >= 0)[None, :]
            else:
                g_ok = (g * G < k_end)[None, :]
            if QT == 12 or QT == 13 or QT == 14:
                big = tl.load(d_rows + (g // (256 // G))[None, :], mask=g_ok, other=0.0).to(tl.float32)
                sc = tl.load(sc_ptr + r * stride_sc + g[None, :], mask=g_ok, other=0)
                if QT == 14:
                    s = big * sc.to(tl.float32)
                else:
                    s = big * _u2f(sc.to(tl.int32))
            else:
                s = tl.load(d_rows + g[None, :], mask=g_ok, other=0.0).to(tl.float32)
            if HAS_MIN:
                # Each group's sum of x (Triton loads x again for it, in a layout of its own: cheaper
                # than the alternatives tried, which moved x through shared memory).
                xg = tl.sum(tl.reshape(xw, [GS, WPG]), axis=1)[None, :]
                if QT == 3:
                    mt = tl.load(dm_ptr + r * stride_d + g[None, :], mask=g_ok, other=0.0).to(tl.float32)
                else:
                    dmin = tl.load(dm_ptr + r * stride_d + (g // 8)[None, :], mask=g_ok, other=0.0).to(tl.float32)
                    mn = tl.load(mn_ptr + r * stride_sc + g[None, :], mask=g_ok, other=0)
                    mt = -dmin * _u2f(mn.to(tl.int32))
                acc += tg * s + mt * xg
            else:
                acc += tg * s
        _store_split(tl.sum(acc, axis=1), part_ptr, out_ptr, cnt_ptr, M, N, stride_om, m_row, pid_n, split,
                     offs_n, n_ok, SPLIT, BN)  # fmt: skip

    @triton.jit
    def _store_split(res, part_ptr, out_ptr, cnt_ptr, M, N, stride_om, m_row, pid_n, split, offs_n, n_ok,
                     SPLIT, BN: tl.constexpr):  # fmt: skip
        """A GEMV program's [BN] sums: stored as the output (no split), or as its split-K partial, the last
        program of the column block summing the partials in split order (an atomic counter it resets for the
        next launch or CUDA-graph replay), as `int4_ops._int4_gemv_kernel` does."""
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
    def _dp4a(a, b, c, ASM: tl.constexpr, SIGNED: tl.constexpr):
        """c + the dot product of the 4 bytes of a and b (int32 words; b's bytes signed, a's signed if SIGNED
        else unsigned): one IDP4A on the GPU, shifts and products under the interpreter (ASM false)."""
        if ASM:
            if SIGNED:
                return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                                 dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip
            else:
                return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                                 dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip
        else:
            s = c
            for i in tl.static_range(4):
                ai = (a >> (8 * i)) & 0xFF
                if SIGNED:
                    ai = ai - ((ai & 0x80) << 1)
                bi = (b >> (8 * i)) & 0xFF
                s += ai * (bi - ((bi & 0x80) << 1))
            return s

    @triton.jit
    def quant_groups_q8(y, q_ptr, d_ptr, s_ptr, col0, n_cols, BLOCK: tl.constexpr):
        """Elements col0 .. col0 + BLOCK of a row, y [BLOCK] float32 (zero past n_cols; col0 and n_cols
        multiples of 32), quantized for the int8 GEMV, llama.cpp's q8_1: per group of 32, d = amax / 127,
        q = roundf(x * (127 / amax)) as int8 at q_ptr + column, d and s = d * sum(q) at d_ptr / s_ptr + group.
        The quantizer of `_q8_quant_kernel` and of the norms' and SiLU-mul's twins (act_twin.py)."""
        GB: tl.constexpr = BLOCK // 32
        x = tl.reshape(y, [GB, 32])
        g = col0 // 32 + tl.arange(0, GB)
        e = g[:, None] * 32 + tl.arange(0, 32)[None, :]
        ok = g * 32 < n_cols
        amax = tl.max(tl.abs(x), axis=1)
        inv = tl.where(amax > 0.0, tl.div_rn(tl.full([GB], 127.0, tl.float32), tl.maximum(amax, 1e-30)), 0.0)
        d = tl.div_rn(amax, tl.full([GB], 127.0, tl.float32))
        v = x * inv[:, None]
        t = v.to(tl.int32)
        f = v - t.to(tl.float32)  # exact: roundf (half away from zero) as trunc plus the sign at >= 0.5
        q = t + (f >= 0.5).to(tl.int32) - (f <= -0.5).to(tl.int32)
        tl.store(q_ptr + e, q.to(tl.int8), mask=ok[:, None])
        tl.store(d_ptr + g, d, mask=ok)
        tl.store(s_ptr + g, d * tl.sum(q, axis=1).to(tl.float32), mask=ok)

    @triton.jit
    def _q8_quant_kernel(x_ptr, q_ptr, d_ptr, s_ptr, K, stride_xm, stride_qm, stride_dm, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = 0):  # fmt: skip
        """`quant_groups_q8` over x [M, K]: a program per (row, BLOCK columns)."""
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        col0 = tl.program_id(1) * BLOCK
        offs = col0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        quant_groups_q8(x, q_ptr + row * stride_qm, d_ptr + row * stride_dm, s_ptr + row * stride_dm, col0, K, BLOCK)

    @triton.jit
    def _q8a_load(lo_rows, xq_row, xd_row, xs_row, d_rows, dm_rows, sc_rows, mn_rows, xw, k0, k_end, offs_g,
                  QT: tl.constexpr, EVEN_K: tl.constexpr, WPG: tl.constexpr, GS: tl.constexpr):  # fmt: skip
        """Everything the step at k0 reads, as loaded (converted by the step that uses it, so that a prefetch
        leaves its loads in flight): the weight words [BN, GS, 4] (Q8_0: each group's first and second 4; the
        4-bit types: the 4, twice), the activation words for them, the activations' d and d * sum(q) [1, GS],
        and the weights' scale fields [BN, GS] (Q4_K: d, dmin, sc, mn; Q4_1: d, m; else d)."""
        g = k0 // 32 + offs_g
        kw = tl.multiple_of(k0 // (32 // WPG), 4 * GS)
        kx = tl.multiple_of(k0 // 4, 8 * GS)
        if EVEN_K:
            gm = (g >= 0)[None, :]
        else:
            gm = (g * 32 < k_end)[None, :]  # whole groups: K is a multiple of 32
        wm = gm[:, :, None]
        words = tl.load(lo_rows + kw, mask=wm, other=0, eviction_policy="evict_first")
        words2 = words
        if QT == 8:
            words2 = tl.load(lo_rows + kw + 4, mask=wm, other=0, eviction_policy="evict_first")
        xl = tl.load(xq_row + kx + xw, mask=wm, other=0)
        xh = tl.load(xq_row + kx + 4 + xw, mask=wm, other=0)
        dx = tl.load(xd_row + g[None, :], mask=gm, other=0.0)
        sx = dx
        if QT != 8:
            sx = tl.load(xs_row + g[None, :], mask=gm, other=0.0)
        if QT == 12:
            a = tl.load(d_rows + (g // 8)[None, :], mask=gm, other=0.0)
            b = tl.load(dm_rows + (g // 8)[None, :], mask=gm, other=0.0)
            c = tl.load(sc_rows + g[None, :], mask=gm, other=0)
            e = tl.load(mn_rows + g[None, :], mask=gm, other=0)
        else:
            a = tl.load(d_rows + g[None, :], mask=gm, other=0.0)
            b = a
            if QT == 3:
                b = tl.load(dm_rows + g[None, :], mask=gm, other=0.0)
            c = a
            e = a
        return words, words2, xl, xh, dx, sx, a, b, c, e

    @triton.jit
    def _gguf_gemv_q8a_kernel(xq_ptr, xd_ptr, xs_ptr, lo_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr, part_ptr, out_ptr,
                              cnt_ptr, M, N, K, stride_xq, stride_xd, stride_om, stride_lo, stride_d, stride_sc,
                              K_SPLIT, SPLIT, QT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                              EVEN_K: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr,
                              PDL: tl.constexpr = 0):  # fmt: skip
        """out[m, n-block] = q8(x[m]) @ dequant(W[n-block, k-slice]).T for Q4_0 / Q4_1 / Q4_K / Q8_0 weights in
        the pair layout (`gguf_triton.prepare`), split-K over programs, from the activations quantized by
        `_q8_quant_kernel` (xq: int8 quants as int32 words, xd: d, xs: d * sum(q), per group of 32). Each weight
        word is dotted with the matching activation word by IDP4A (4 products and their sum in one
        instruction; a 4-bit word gives two words of nibbles, w & 0x0F0F0F0F with the group's first 16
        elements and (w >> 4) & 0x0F0F0F0F with the last 16), a group's word sums are scaled once:
        d_x * s * sum(u q) + m * s_x. The activations are loaded in the weight tile's own layout (each thread
        the words of its groups, from L1): no shared memory, no barrier in the loop, as the float kernel.
        PREFETCH: everything the next step reads is loaded before this step's values are used (Triton
        pipelines no loads that feed no `tl.dot`, so a program otherwise waits out the memory latency every
        step)."""
        GS: tl.constexpr = BK // 32
        WPG: tl.constexpr = 8 if QT == 8 else 4  # weight words a group
        pdl_enter(PDL)
        pid_n = tl.program_id(0)  # (grid x: a row a program makes more column blocks than y's 65,535)
        m_row = tl.program_id(1)
        split = tl.program_id(2)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < N
        r = tl.minimum(offs_n, N - 1).to(tl.int64)[:, None]
        offs_g = tl.arange(0, GS)
        offs_i = tl.arange(0, 4)
        gw = (offs_g[:, None] * WPG + offs_i[None, :])[None, :, :]  # [1, GS, 4]: words of the step's groups
        lo_rows = lo_ptr + r[:, :, None] * stride_lo + gw
        xw = (offs_g[:, None] * 8 + offs_i[None, :])[None, :, :] + 0 * r[:, :, None].to(tl.int32)  # [BN, GS, 4]
        xq_row = xq_ptr + m_row * stride_xq
        xd_row = xd_ptr + m_row * stride_xd
        xs_row = xs_ptr + m_row * stride_xd
        d_rows = d_ptr + r * stride_d
        dm_rows = dm_ptr + r * stride_d
        sc_rows = sc_ptr + r * stride_sc
        mn_rows = mn_ptr + r * stride_sc
        zero = tl.zeros([BN, GS, 4], dtype=tl.int32)
        k_begin = split * K_SPLIT
        k_end = tl.minimum(k_begin + K_SPLIT, K)
        k_last = k_begin + (k_end - 1 - k_begin) // BK * BK  # the last step's start
        acc = tl.zeros([BN, GS], dtype=tl.float32)
        if PREFETCH:
            nw, nw2, nxl, nxh, ndx, nsx, na, nb, nc, ne = _q8a_load(
                lo_rows, xq_row, xd_row, xs_row, d_rows, dm_rows, sc_rows, mn_rows, xw, k_begin, k_end, offs_g,
                QT, EVEN_K, WPG, GS,
            )  # fmt: skip
        for k0 in range(k_begin, k_end, BK):
            if PREFETCH:  # the next step's loads in flight while this step's values are multiplied
                words, words2, xl, xh, dx, sx, a, b, c, e = nw, nw2, nxl, nxh, ndx, nsx, na, nb, nc, ne
                nw, nw2, nxl, nxh, ndx, nsx, na, nb, nc, ne = _q8a_load(
                    lo_rows, xq_row, xd_row, xs_row, d_rows, dm_rows, sc_rows, mn_rows, xw,
                    tl.minimum(k0 + BK, k_last), k_end, offs_g, QT, EVEN_K, WPG, GS,
                )  # fmt: skip
            else:
                words, words2, xl, xh, dx, sx, a, b, c, e = _q8a_load(
                    lo_rows, xq_row, xd_row, xs_row, d_rows, dm_rows, sc_rows, mn_rows, xw, k0, k_end, offs_g,
                    QT, EVEN_K, WPG, GS,
                )  # fmt: skip
            if QT == 8:
                p = _dp4a(words, xl, _dp4a(words2, xh, zero, ASM, True), ASM, True)
            else:
                p = _dp4a((words >> 4) & 0x0F0F0F0F, xh, zero, ASM, False)
                p = _dp4a(words & 0x0F0F0F0F, xl, p, ASM, False)
            tg = tl.sum(p, axis=2).to(tl.float32)  # [BN, GS]: each group's sum of u * q
            if QT == 12:
                s = a.to(tl.float32) * _u2f(c.to(tl.int32))
                mt = -b.to(tl.float32) * _u2f(e.to(tl.int32))
            else:
                s = a.to(tl.float32)
                mt = b.to(tl.float32) if QT == 3 else -8.0 * s  # (Q8_0: unused)
            if QT == 8:
                acc += tg * s * dx
            else:
                acc += tg * s * dx + mt * sx
        _store_split(tl.sum(acc, axis=1), part_ptr, out_ptr, cnt_ptr, M, N, stride_om, m_row, pid_n, split,
                     offs_n, n_ok, SPLIT, BN)  # fmt: skip

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
    def _gguf_gemm_kernel(a_ptr, lo_ptr, hi_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr, c_ptr, M, N, K, stride_am, stride_cm,
                          stride_lo, stride_hi, stride_d, stride_sc, QT: tl.constexpr, EPW: tl.constexpr,
                          G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                          PREC: tl.constexpr):  # fmt: skip
        """c = a @ dequant(W).T with tensor cores: each [BK, BN] weight tile is dequantized in registers
        to a's dtype (its words gathered per element; they are reread from L1) and fed to `tl.dot`."""
        WPG: tl.constexpr = G // EPW
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
            # The quant position of element e (word p // EPW, quant p % EPW): in order for Q8_0; 4-bit pair
            # layout: byte e % 16 of the group, its high nibble for the second 16; word-major (Q5_K, Q6_K):
            # word (e // G) * WPG + e % WPG, quant (e % G) // WPG.
            if QT == 8:
                p = e
            elif QT == 13 or QT == 14:
                p = (e // G) * G + (e % WPG) * EPW + (e % G) // WPG
            else:
                p = (e // G) * G + (e % 16) * 2 + (e % G) // 16
            mask = k_ok[:, None] & n_ok[None, :]
            wd = tl.load(lo_ptr + r * stride_lo + p // EPW, mask=mask, other=0)
            if QT == 8:
                u = ((wd >> ((p % 4) * 8)) & 0xFF) ^ 0x80
            else:
                u = (wd >> ((p % 8) * 4)) & 0xF
                if QT == 13:
                    h = tl.load(hi_ptr + r * stride_hi + p // 32, mask=mask, other=0)
                    u = u | (((h >> (p % 32)) & 1) << 4)
                elif QT == 14:
                    h = tl.load(hi_ptr + r * stride_hi + p // 16, mask=mask, other=0)
                    u = u | (((h >> ((p % 16) * 2)) & 3) << 4)
            s, mt = _group_sm(d_ptr, dm_ptr, sc_ptr, mn_ptr, r, e, stride_d, stride_sc, mask, QT)
            w = _u2f(u) * s + mt
            acc += tl.dot(a, w.to(a.dtype), input_precision=PREC)
        c = acc.to(c_ptr.dtype.element_ty)
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], c, mask=m_ok[:, None] & n_ok[None, :])
