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
the int8-activation GEMV's (`gguf_triton_int8`); 4-bit: byte i of a group's 16 holds element i in its
low nibble and element 16 + i in its high one (Q4_0 / Q4_1 as the file stores them, Q4_K's 32-element
sub-blocks brought to the same form); Q8_0: the bytes in element order. So word w's low nibbles (bytes) are
elements 4w..4w+3, the same 4 bytes an int8 activation word holds. "Word-major" layout, Q5_K / Q6_K: with
WPG = G / EPW words per group (EPW quants a word), quant j of word w is element WPG * j + w of the group,
so the float GEMV loads each x_j slice as one contiguous run.

Decode GEMV with 16-bit activations and a pair-layout type: int8 activations and IDP4A, 4 products an
instruction (`gguf_triton_int8`).

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
    def _k4_scales(dd, sm):
        """Q4_K's (s, m) of a group from its packed scale fields (`gguf_triton.prepare`): dd, the super-block's
        d | dmin << 16 (two float16 bit patterns in an int32), and sm, the group's sc | mn << 8 (int16)."""
        dd = dd.to(tl.uint32, bitcast=True)
        d = (dd & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = (dd >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        sm = sm.to(tl.int32) & 0xFFFF
        return d * _u2f(sm & 0xFF), -dmin * _u2f(sm >> 8)

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
        PAIR: tl.constexpr = QT != 13 and QT != 14  # the pair layout (`gguf_triton.Q8A_TYPES`)
        pdl_enter(PDL)
        pid_n, m_row, split, offs_n, n_ok, r = _gemv_program(N, BN)
        offs_w = tl.arange(0, W)
        offs_g = tl.arange(0, GS)
        # Element of quant 0 of each word, from the step's start (quant j: + xj_at below).
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
            if QT == 12:
                s, mt = _k4_scales(tl.load(d_rows + (g // 8)[None, :], mask=g_ok, other=0),
                                   tl.load(sc_ptr + r * stride_sc + g[None, :], mask=g_ok, other=0))  # fmt: skip
            elif QT == 13 or QT == 14:
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
                elif QT == 13:
                    dmin = tl.load(dm_ptr + r * stride_d + (g // 8)[None, :], mask=g_ok, other=0.0).to(tl.float32)
                    mn = tl.load(mn_ptr + r * stride_sc + g[None, :], mask=g_ok, other=0)
                    mt = -dmin * _u2f(mn.to(tl.int32))
                acc += tg * s + mt * xg
            else:
                acc += tg * s
        _store_split(tl.sum(acc, axis=1), part_ptr, out_ptr, cnt_ptr, M, N, stride_om, m_row, pid_n, split,
                     offs_n, n_ok, SPLIT, BN)  # fmt: skip

    @triton.jit
    def _gemv_program(N, BN: tl.constexpr):
        """A GEMV program's place: (column block, activation row, K split, its BN rows, which of them are < N,
        the rows clamped to N - 1 as int64 [BN, 1], so that no weight load needs a row mask). Column blocks
        are on grid x: a row a program makes more of them than grid y's 65,535 (the LM head's 128,256)."""
        pid_n = tl.program_id(0)
        offs_n = pid_n * BN + tl.arange(0, BN)
        r = tl.minimum(offs_n, N - 1).to(tl.int64)[:, None]
        return pid_n, tl.program_id(1), tl.program_id(2), offs_n, offs_n < N, r

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
    def _group_sm(d_ptr, dm_ptr, sc_ptr, mn_ptr, r, e, stride_d, stride_sc, mask, QT: tl.constexpr):
        """(s, m) of the groups holding elements `e` of rows `r` (int64; broadcastable): value = s * u + m."""
        if QT == 14:  # Q6_K
            big = tl.load(d_ptr + r * stride_d + e // 256, mask=mask, other=0.0).to(tl.float32)
            s = big * tl.load(sc_ptr + r * stride_sc + e // 16, mask=mask, other=0).to(tl.float32)
            m = -32.0 * s
        elif QT == 12:  # Q4_K: the packed scale planes
            s, m = _k4_scales(tl.load(d_ptr + r * stride_d + e // 256, mask=mask, other=0),
                              tl.load(sc_ptr + r * stride_sc + e // 32, mask=mask, other=0))  # fmt: skip
        elif QT == 13:  # Q5_K
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
    def _gguf_dequant_pair_kernel(lo_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr, w_ptr, row0, N, K, stride_lo, stride_d,
                                  stride_sc, stride_w, QT: tl.constexpr, BN: tl.constexpr,
                                  GB: tl.constexpr):  # fmt: skip
        """`_gguf_dequant_kernel` for the pair-layout types (Q4_0 / Q4_1 / Q4_K / Q8_0), vectorized: a program
        takes [BN rows, GB groups of 32], loads each group's words at once (4, Q8_0 8) and its scales once,
        splits the words into their bytes / nibbles in registers (4-bit: word w's low nibbles are elements
        4w..4w+3, its high ones 16 + 4w..), and stores the [BN, GB * 32] tile in row order."""
        WPG: tl.constexpr = 8 if QT == 8 else 4
        offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
        g = tl.program_id(1) * GB + tl.arange(0, GB)
        ok = (offs_n < N)[:, None] & (g * 32 < K)[None, :]  # [BN, GB]
        r = (row0 + offs_n).to(tl.int64)[:, None]
        words = tl.load(lo_ptr + (r * stride_lo + g[None, :] * WPG)[:, :, None] + tl.arange(0, WPG)[None, None, :],
                        mask=ok[:, :, None], other=0)  # fmt: skip
        shift = (tl.arange(0, 4) * 8)[None, None, None, :]
        if QT == 8:
            b = (words[:, :, :, None] >> shift) & 0xFF  # [BN, GB, 8, 4]: byte b of word w is element 4w + b
            u = tl.reshape(((b ^ 0x80) - 128).to(tl.float32), [BN, GB, 32])
        else:
            lo4 = tl.reshape((words[:, :, :, None] >> shift) & 0xF, [BN, GB, 16])
            hi4 = tl.reshape((words[:, :, :, None] >> (shift + 4)) & 0xF, [BN, GB, 16])
            u = tl.reshape(tl.permute(tl.join(lo4, hi4), (0, 1, 3, 2)), [BN, GB, 32]).to(tl.float32)
        if QT == 12:
            s, m = _k4_scales(tl.load(d_ptr + r * stride_d + (g // 8)[None, :], mask=ok, other=0),
                              tl.load(sc_ptr + r * stride_sc + g[None, :], mask=ok, other=0))  # fmt: skip
        else:
            s = tl.load(d_ptr + r * stride_d + g[None, :], mask=ok, other=0.0).to(tl.float32)
            if QT == 3:
                m = tl.load(dm_ptr + r * stride_d + g[None, :], mask=ok, other=0.0).to(tl.float32)
            elif QT == 2:
                m = -8.0 * s
            else:
                m = 0.0 * s
        w = u * s[:, :, None] + m[:, :, None]
        dst = (offs_n.to(tl.int64)[:, None] * stride_w + g[None, :] * 32)[:, :, None] + tl.arange(0, 32)[None, None, :]
        tl.store(w_ptr + dst, w.to(w_ptr.dtype.element_ty), mask=ok[:, :, None])

    @triton.jit
    def _gguf_dequant_kernel(lo_ptr, hi_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr, w_ptr, row0, N, K, stride_lo, stride_hi,
                             stride_d, stride_sc, stride_w, QT: tl.constexpr, EPW: tl.constexpr, G: tl.constexpr,
                             BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
        """w[n - row0, k] = dequant(W)[n, k] for rows row0 .. row0 + N of W, in w's dtype (float32 math, one
        rounding): the prefill GEMM's operand for cuBLAS (`gguf_triton.gguf_gemm_triton`). A [BN, BK] tile a
        program, each element's word and scales gathered (they are reread from L1), the stores coalesced."""
        offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
        kk = tl.program_id(1) * BK + tl.arange(0, BK)
        n_ok = offs_n < N
        mask = n_ok[:, None] & (kk < K)[None, :]
        r = (row0 + offs_n).to(tl.int64)[:, None]
        e = kk[None, :]
        # The quant position of element e (word p // EPW, quant p % EPW): in order for Q8_0; 4-bit pair layout:
        # byte e % 16 of the group, its high nibble for the second 16; word-major (Q5_K, Q6_K): word
        # (e // G) * WPG + e % WPG, quant (e % G) // WPG.
        WPG: tl.constexpr = G // EPW
        if QT == 8:
            p = e
        elif QT == 13 or QT == 14:
            p = (e // G) * G + (e % WPG) * EPW + (e % G) // WPG
        else:
            p = (e // G) * G + (e % 16) * 2 + (e % G) // 16
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
        tl.store(w_ptr + offs_n.to(tl.int64)[:, None] * stride_w + e, w.to(w_ptr.dtype.element_ty), mask=mask)
