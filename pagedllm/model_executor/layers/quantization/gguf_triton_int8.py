"""The int8-activation decode GEMV of GGUF weights on the GPU (Q4_0 / Q4_1 / Q4_K / Q8_0 in the pair layout of
`gguf_triton_kernels`, 16-bit activations), and the activations' quantizer (llama.cpp's q8_1), shared with
the norms' and SiLU-mul's twins (quantization/act_twin.py, `layers/triton_ops.py`).

Why int8: the float GEMV spends ~4 instructions a 4-bit weight (the exponent trick, an FADD and an FFMA);
IDP4A takes 4 products and their sum in one. Why small programs (a row or a few, whole rows, no split-K):
Triton pipelines no loads that feed no `tl.dot`, so each program waits out the memory latency every step
and the bytes in flight come from many resident programs (the H200 sweeps of benchmarks/NOTES.md, session
41: tiles of 64-256 rows stayed at 1.7-3x the packed floor whatever their split; (2, 1024, 2) gate_up
1.12x). The activations are quantized before the GEMV (by their producer, or `_q8_quant_kernel`): done in
the GEMV's loop, the per-step reductions and layout conversions put barriers between a program's loads.
"""

from __future__ import annotations

from pagedllm.triton_utils import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    from pagedllm.attention.qkv_rope import rope_pair_inputs, rope_pair_rows, rope_pair_store
    from pagedllm.model_executor.layers.quantization.gguf_triton_kernels import (
        _gemv_program,
        _k4_scales,
        _store_split,
    )
    from pagedllm.triton_utils import mul_rn, pdl_enter

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
        # v rounded before it is split: a plain product feeding `v - t` was contracted into an FMA on sm_90
        # (the fraction taken from the unrounded product), which turns some exact halves of 16-bit inputs the
        # other way (session 42; `mul.rn` is never contracted).
        v = mul_rn(x, inv[:, None])
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
    def _opaque(x):
        """x, through an identity the compiler cannot see into (the GPU only): a load indexed by it is not known
        contiguous, so Triton loads it in its user's layout instead of a vectorized load whose values then
        move between threads by shuffles (sm_90a census, Q4_K (4, 512, 1): 195 -> 174 instructions a step)."""
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def _q8a_groups(k0, k_end, offs_g, EVEN_K: tl.constexpr):
        """The step at k0's groups and their mask [1, GS] (K is a multiple of 32: whole groups)."""
        g = k0 // 32 + offs_g
        if EVEN_K:
            gm = (g >= 0)[None, :]
        else:
            gm = (g * 32 < k_end)[None, :]
        return g, gm

    @triton.jit
    def _q8a_wload(lo_rows, d_rows, dm_rows, sc_rows, mn_rows, k0, k_end, offs_g,
                   QT: tl.constexpr, EVEN_K: tl.constexpr, WPG: tl.constexpr, GS: tl.constexpr,
                   OPQ: tl.constexpr = False):  # fmt: skip
        """The weights the step at k0 reads: the words [BN, GS, 4] (Q8_0: each group's first and second 4; the
        4-bit types: the 4, twice) and the scale fields [BN, GS] (Q4_K: its packed d | dmin, sc | mn; Q4_1: d, m;
        else d; the unused ones repeat d)."""
        g, gm = _q8a_groups(k0, k_end, offs_g, EVEN_K)
        kw = tl.multiple_of(k0 // (32 // WPG), 4 * GS)
        wm = gm[:, :, None]
        words = tl.load(lo_rows + kw, mask=wm, other=0, eviction_policy="evict_first")
        words2 = words
        if QT == 8:
            words2 = tl.load(lo_rows + kw + 4, mask=wm, other=0, eviction_policy="evict_first")
        if OPQ:
            g = _opaque(g)
        if QT == 12:  # the packed scale planes: d | dmin << 16 a super-block, sc | mn << 8 a group
            a = tl.load(d_rows + (g // 8)[None, :], mask=gm, other=0)
            b = a
            c = tl.load(sc_rows + g[None, :], mask=gm, other=0)
            e = c
        else:
            a = tl.load(d_rows + g[None, :], mask=gm, other=0.0)
            b = a
            if QT == 3:
                b = tl.load(dm_rows + g[None, :], mask=gm, other=0.0)
            c = a
            e = a
        return words, words2, a, b, c, e

    @triton.jit
    def _q8a_xload(xq_row, xd_row, xs_row, xw, k0, k_end, offs_g, QT: tl.constexpr, EVEN_K: tl.constexpr,
                   GS: tl.constexpr, OPQ: tl.constexpr = False):  # fmt: skip
        """The activations the step at k0 reads: the int8 words matching the weight words [BN, GS, 4] (low and
        high halves of each group), d and d * sum(q) [1, GS]."""
        g, gm = _q8a_groups(k0, k_end, offs_g, EVEN_K)
        kx = tl.multiple_of(k0 // 4, 8 * GS)
        wm = gm[:, :, None]
        xl = tl.load(xq_row + kx + xw, mask=wm, other=0)
        xh = tl.load(xq_row + kx + 4 + xw, mask=wm, other=0)
        if OPQ:
            g = _opaque(g)
        dx = tl.load(xd_row + g[None, :], mask=gm, other=0.0)
        sx = dx
        if QT != 8:
            sx = tl.load(xs_row + g[None, :], mask=gm, other=0.0)
        return xl, xh, dx, sx

    @triton.jit
    def _q8a_step(acc, words, words2, a, b, c, e, xl, xh, dx, sx, zero, QT: tl.constexpr, ASM: tl.constexpr):
        """acc [BN, GS] plus one step's products: IDP4A word sums scaled once a group."""
        if QT == 8:
            p = _dp4a(words, xl, _dp4a(words2, xh, zero, ASM, True), ASM, True)
        else:
            p = _dp4a((words >> 4) & 0x0F0F0F0F, xh, zero, ASM, False)
            p = _dp4a(words & 0x0F0F0F0F, xl, p, ASM, False)
        tg = tl.sum(p, axis=2).to(tl.float32)  # [BN, GS]: each group's sum of u * q
        if QT == 12:
            s, mt = _k4_scales(a, c)
        else:
            s = a.to(tl.float32)
            mt = b.to(tl.float32) if QT == 3 else -8.0 * s  # (Q8_0: unused)
        if QT == 8:
            acc += tg * s * dx
        elif QT == 12:  # each product rounded: the same bits whichever way ptxas would contract (`flags`)
            acc += mul_rn(mul_rn(tg, s), dx) + mul_rn(mt, sx)
        else:
            acc += tg * s * dx + mt * sx
        return acc

    @triton.jit
    def _gguf_gemv_q8a_kernel(xq_ptr, xd_ptr, xs_ptr, lo_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr, part_ptr, out_ptr,
                              cnt_ptr, M, N, K, stride_xq, stride_xd, stride_om, stride_lo, stride_d, stride_sc,
                              K_SPLIT, SPLIT, QT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                              EVEN_K: tl.constexpr, ASM: tl.constexpr, PRE: tl.constexpr = False,
                              PDL: tl.constexpr = 0, OPQ: tl.constexpr = False, pos_ptr=None, cos_sin_ptr=None,
                              slot_ptr=None, kv_ptr=None, stride_cs=0, v_off=0, stride_cb=0, stride_ct=0,
                              stride_ch=0, n_tok=0, q_heads=0, kv_heads=0, HEAD: tl.constexpr = 0,
                              CACHE_BLOCK: tl.constexpr = 1):  # fmt: skip
        """out[m, n-block] = q8(x[m]) @ dequant(W[n-block, k-slice]).T for Q4_0 / Q4_1 / Q4_K / Q8_0 weights in
        the pair layout (`gguf_triton.prepare`), split-K over programs, from the activations quantized by
        `_q8_quant_kernel` (xq: int8 quants as int32 words, xd: d, xs: d * sum(q), per group of 32). Each weight
        word is dotted with the matching activation word by IDP4A (4 products and their sum in one
        instruction; a 4-bit word gives two words of nibbles, w & 0x0F0F0F0F with the group's first 16
        elements and (w >> 4) & 0x0F0F0F0F with the last 16), a group's word sums are scaled once:
        d_x * s * sum(u q) + m * s_x. The activations are loaded in the weight tile's own layout (each thread
        the words of its groups, from L1): no shared memory, no barrier in the loop, as the float kernel.
        PRE: the first step's weights are read before the PDL wait, while the kernel before still runs (no
        kernel of a step writes weights): W3 Q4_1 2.000 -> 1.915 ms on an H200 (benchmarks/NOTES.md, session 42).
        HEAD > 0: a qkv projection whose epilogue applies RoPE and writes the new K / V to the paged cache
        (`attention/qkv_rope.py`; no split-K): a program takes rotation pairs of one head, their inputs read
        before the PDL wait."""
        GS: tl.constexpr = BK // 32
        WPG: tl.constexpr = 8 if QT == 8 else 4  # weight words a group
        if HEAD > 0:
            head, pj, offs_n = rope_pair_rows(tl.program_id(0), BN, HEAD)
            pid_n, m_row, split, n_ok = tl.program_id(0), tl.program_id(1), 0, offs_n < N
            r = offs_n.to(tl.int64)[:, None]
            cos, sin, slot = rope_pair_inputs(pos_ptr, cos_sin_ptr, stride_cs, slot_ptr, m_row, n_tok, pj, HEAD // 2,
                                              out_ptr.dtype.element_ty)  # fmt: skip
        else:
            pid_n, m_row, split, offs_n, n_ok, r = _gemv_program(N, BN)
        if not PRE:
            pdl_enter(PDL)
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
        acc = tl.zeros([BN, GS], dtype=tl.float32)
        k_first = k_begin
        if PRE:  # the first step's weights, read before the wait: no kernel of the step writes them
            pw = _q8a_wload(lo_rows, d_rows, dm_rows, sc_rows, mn_rows, k_begin, k_end, offs_g, QT, EVEN_K, WPG, GS,
                            OPQ)  # fmt: skip
            pdl_enter(PDL)
            px = _q8a_xload(xq_row, xd_row, xs_row, xw, k_begin, k_end, offs_g, QT, EVEN_K, GS, OPQ)
            acc = _q8a_step(acc, *pw, *px, zero, QT, ASM)
            k_first = k_begin + BK
        for k0 in range(k_first, k_end, BK):
            w0, w1, a, b, c, e = _q8a_wload(lo_rows, d_rows, dm_rows, sc_rows, mn_rows, k0, k_end, offs_g,
                                            QT, EVEN_K, WPG, GS, OPQ)  # fmt: skip
            xl, xh, dx, sx = _q8a_xload(xq_row, xd_row, xs_row, xw, k0, k_end, offs_g, QT, EVEN_K, GS, OPQ)
            acc = _q8a_step(acc, w0, w1, a, b, c, e, xl, xh, dx, sx, zero, QT, ASM)
        if HEAD > 0:
            rope_pair_store(tl.sum(acc, axis=1), out_ptr + m_row * stride_om, head, pj, cos, sin, slot, kv_ptr, v_off,
                            stride_cb, stride_ct, stride_ch, q_heads, kv_heads, BN, HEAD, CACHE_BLOCK)  # fmt: skip
        else:
            _store_split(tl.sum(acc, axis=1), part_ptr, out_ptr, cnt_ptr, M, N, stride_om, m_row, pid_n, split,
                         offs_n, n_ok, SPLIT, BN)  # fmt: skip
