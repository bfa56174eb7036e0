"""The one-row decode GEMV of 4-bit GGUF weights (Q4_0 / Q4_1 / Q4_K in the pair layout, int8 activations) as
a persistent kernel streaming the weights through a ring of shared-memory stages (Gluon, `cp.async`).

Why (benchmarks/NOTES.md, session 45): the Triton int8 GEMV (`gguf_triton_int8`) cannot keep loads in flight
across its steps (Triton pipelines only loads that feed a `tl.dot`), so its bytes in flight come from many
small programs in waves, each paying the memory latency, and only the first wave's first step can be read
before the PDL wait. W3 Q4_1 spent ~270 us a token in its GEMVs beyond their bytes' time, and the bus idled
during the ~465 us of norms, RoPE, attention and SiLU-mul. Here each program takes a fixed share of the row
tiles and copies its weights (`cp.async`, no registers held) S - 1 stages ahead into shared memory; the first
S - 1 stages are issued before the PDL wait, while the kernel before still runs (weights are never written in
a step). After the wait a program reads the whole activation row's q8 quantization once into shared memory,
then each stage: wait for its copies, one CTA barrier (the stage's bytes are read by other threads than those
that copied them, and the slot refilled next was read by all), the next copy, IDP4A products.

Arithmetic as `_gguf_gemv_q8a_kernel`'s per group (d_x * s * sum(u q) + m * s_x), summed in another order: not
bit for bit that kernel. M = 1 only (the decode graph's batch-1 step); K a multiple of BK.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from pagedllm.triton_utils import HAS_TRITON

HAS_GLUON = False
if HAS_TRITON:
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

        # (Triton 3.6, the device's: async_copy_global_to_shared; newer ones renamed it async_load)
        _async_copy = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
        _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # (renamed likewise)
        HAS_GLUON = True
    except ImportError:  # (a Triton without Gluon: the Triton GEMV serves every shape)
        HAS_GLUON = False

RING_TYPES = (2, 3, 12)
"""Q4_0, Q4_1, Q4_K: the 4-bit pair-layout types (Q8_0 keeps the Triton kernel)."""


class RingConfig(NamedTuple):
    """A ring GEMV launch: rows a tile (BN), weights a row a stage (BK, a multiple of 1024), ring stages (S),
    warps, programs per SM (the grid is at most this many per SM, each a fixed share of the tiles), and the
    stages copied before the PDL wait (-1: all S - 1 the ring holds ahead). The default: the fastest of
    session 45's W3 sweep (H200, benchmarks/NOTES.md)."""

    bn: int = 16
    bk: int = 2048
    stages: int = 4
    warps: int = 8
    per_sm: int = 2
    pre: int = -1


if HAS_GLUON:

    @gluon.jit
    def _dp4a0(a, b, SIGNED: gl.constexpr):
        """The dot product of the 4 bytes of a and b (b's signed; a's signed if SIGNED): one IDP4A, addend 0."""
        if SIGNED:
            return gl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b], dtype=gl.int32,
                                             is_pure=True, pack=1)  # fmt: skip
        else:
            return gl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b], dtype=gl.int32,
                                             is_pure=True, pack=1)  # fmt: skip

    @gluon.jit
    def _dp4a(a, b, c, SIGNED: gl.constexpr):
        """c + the dot product of the 4 bytes of a and b."""
        if SIGNED:
            return gl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=gl.int32, is_pure=True, pack=1)  # fmt: skip
        else:
            return gl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=gl.int32, is_pure=True, pack=1)  # fmt: skip

    @gluon.jit
    def _u2f(bits):
        """int32 0 <= bits < 2^23 -> float32, exactly."""
        return (bits | 0x4B000000).to(gl.float32, bitcast=True) - 8388608.0

    @gluon.jit
    def _pdl_wait_trigger(TRIG: gl.constexpr):
        """The PDL wait, and with TRIG 1 the dependents' launch right after it."""
        gdc_wait()
        if TRIG == 1:
            gdc_launch_dependents()

    @gluon.jit
    def _copy_plane(smem, base, stride, r0, n_rows, col0, ok, R: gl.constexpr, C: gl.constexpr,
                    CL: gl.constexpr):  # fmt: skip
        """cp.async of rows r0.. (clamped to n_rows - 1) x columns col0 + [0, C) of a row-major plane into `smem`
        [R, C] (nothing read, zeros written, where `ok` is false)."""
        # (32-bit offsets: the largest plane a ring GEMV reads, the LM head's words, has 65.7 M elements)
        r = gl.minimum(r0 + gl.arange(0, R, layout=gl.SliceLayout(1, CL)), n_rows - 1)
        c = gl.arange(0, C, layout=gl.SliceLayout(0, CL))
        ptr = base + gl.expand_dims(r * stride, 1) + col0 + gl.expand_dims(c, 0)
        _async_copy(smem, ptr, mask=gl.expand_dims(c >= 0, 0) & ok)

    @gluon.jit
    def _issue(j, J, pid, P, N, lo_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr, stride_lo, stride_d, stride_sc,
               w_s, d_s, dm_s, sc_s, mn_s, QT: gl.constexpr, BN: gl.constexpr, GS: gl.constexpr,
               STEPS: gl.constexpr, S: gl.constexpr, CLW: gl.constexpr, CLD: gl.constexpr,
               CLS: gl.constexpr):  # fmt: skip
        """The copies of the program's stage j (tile pid + (j // STEPS) * P, K step j % STEPS) into ring slot
        j % S, committed as one group (an empty group past the program's J stages)."""
        slot = j % S
        r0 = (pid + (j // STEPS) * P) * BN
        ks = j % STEPS
        ok = j < J
        _copy_plane(w_s.index(slot), lo_ptr, stride_lo, r0, N, ks * (GS * 4), ok, BN, GS * 4, CLW)
        if QT == 12:
            _copy_plane(d_s.index(slot), d_ptr, stride_d, r0, N, ks * (GS // 8), ok, BN, GS // 8, CLD)
            _copy_plane(dm_s.index(slot), dm_ptr, stride_d, r0, N, ks * (GS // 8), ok, BN, GS // 8, CLD)
            _copy_plane(sc_s.index(slot), sc_ptr, stride_sc, r0, N, ks * GS, ok, BN, GS, CLS)
            _copy_plane(mn_s.index(slot), mn_ptr, stride_sc, r0, N, ks * GS, ok, BN, GS, CLS)
        else:
            _copy_plane(d_s.index(slot), d_ptr, stride_d, r0, N, ks * GS, ok, BN, GS, CLD)
            if QT == 3:
                _copy_plane(dm_s.index(slot), dm_ptr, stride_d, r0, N, ks * GS, ok, BN, GS, CLD)
        cp.commit_group()

    @gluon.jit
    def _gguf_ring_gemv_kernel(xq_ptr, xd_ptr, xs_ptr, lo_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr, out_ptr, N,
                               stride_lo, stride_d, stride_sc, K: gl.constexpr, QT: gl.constexpr,
                               BN: gl.constexpr, BK: gl.constexpr, S: gl.constexpr, L4: gl.constexpr,
                               CLW: gl.constexpr, CLD: gl.constexpr, CLS: gl.constexpr, CLX: gl.constexpr,
                               CLG: gl.constexpr, PDL: gl.constexpr, TRIG: gl.constexpr,
                               PRE: gl.constexpr):  # fmt: skip
        """out[0, :N] = q8(x) @ dequant(W).T, one activation row. Program pid takes row tiles pid, pid + P, ...
        (P programs), each tile STEPS stages of BN rows x BK weights. L4: the compute layout of a stage
        [BN, SB, 8, 4] (rows, 8-group blocks, groups, words); CLW / CLD / CLS: the copy layouts of the weight
        words, the fp16 scales and the u8 scales (16-byte copies where the rows allow); CLX / CLG: the activations'
        words / groups of a stage (1-D).
        PDL: 0 ordinary launch, else the weights' first PRE (<= S - 1) stages are copied before the wait. TRIG: the
        dependents' launch: 0 at the end, 1 after the wait, 2 once the program issued its last copies."""
        GS: gl.constexpr = BK // 32  # groups a stage
        SB: gl.constexpr = GS // 8
        STEPS: gl.constexpr = K // BK
        S3: gl.constexpr = gl.SliceLayout(3, L4)  # [BN, SB, 8]
        S23: gl.constexpr = gl.SliceLayout(2, S3)  # [BN, SB]
        S123: gl.constexpr = gl.SliceLayout(1, S23)  # [BN]
        X3: gl.constexpr = gl.SliceLayout(0, L4)  # [SB, 8, 4]
        X2: gl.constexpr = gl.SliceLayout(0, S3)  # [SB, 8]
        # Unswizzled, of the rank of an indexed slot (rings [S, BN, C] -> [BN, C]; [STEPS, C] -> [C])
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        flat2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

        pid = gl.program_id(0)
        P = gl.num_programs(0)
        n_tiles = (N + BN - 1) // BN
        J = ((n_tiles - pid + P - 1) // P) * STEPS  # this program's stages

        w_s = gl.allocate_shared_memory(gl.int32, [S, BN, GS * 4], flat)
        if QT == 12:
            d_s = gl.allocate_shared_memory(gl.float16, [S, BN, GS // 8], flat)
            dm_s = gl.allocate_shared_memory(gl.float16, [S, BN, GS // 8], flat)
            sc_s = gl.allocate_shared_memory(gl.uint8, [S, BN, GS], flat)
            mn_s = gl.allocate_shared_memory(gl.uint8, [S, BN, GS], flat)
        else:
            d_s = gl.allocate_shared_memory(gl.float16, [S, BN, GS], flat)
            dm_s = d_s
            if QT == 3:
                dm_s = gl.allocate_shared_memory(gl.float16, [S, BN, GS], flat)
            sc_s = w_s
            mn_s = w_s
        xl_s = gl.allocate_shared_memory(gl.int32, [STEPS, GS * 4], flat2)
        xh_s = gl.allocate_shared_memory(gl.int32, [STEPS, GS * 4], flat2)
        xd_s = gl.allocate_shared_memory(gl.float32, [STEPS, GS], flat2)
        xs_s = gl.allocate_shared_memory(gl.float32, [STEPS, GS], flat2)

        # The first S - 1 stages' weights, PRE of them before the wait (no kernel of a step writes weights)
        for j0 in gl.static_range(S - 1):
            if PDL and j0 == PRE:
                _pdl_wait_trigger(TRIG)
            _issue(j0, J, pid, P, N, lo_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr, stride_lo, stride_d, stride_sc,
                   w_s, d_s, dm_s, sc_s, mn_s, QT, BN, GS, STEPS, S, CLW, CLD, CLS)  # fmt: skip
        if PDL and PRE >= S - 1:
            _pdl_wait_trigger(TRIG)

        # The activation row's q8 words (low / high halves of each group apart), d and d * sum(q), copied as one
        # more group: all of its copies in flight at once, then every group waited for (the weights' first
        # stages were issued long before)
        cx = gl.arange(0, GS * 4, layout=CLX)
        xw = (cx // 4) * 8 + cx % 4
        cg = gl.arange(0, GS, layout=CLG)
        for st in gl.static_range(STEPS):
            _async_copy(xl_s.index(st), xq_ptr + st * (GS * 8) + xw)
            _async_copy(xh_s.index(st), xq_ptr + st * (GS * 8) + 4 + xw)
            _async_copy(xd_s.index(st), xd_ptr + st * GS + cg)
            _async_copy(xs_s.index(st), xs_ptr + st * GS + cg)
        cp.commit_group()
        cp.wait_group(0)

        rows = gl.arange(0, BN, layout=S123)
        acc = gl.zeros([BN, SB, 8], gl.float32, layout=S3)
        for j in range(J):
            cp.wait_group(S - 2)  # this thread's copies of stage j are in
            _cta_barrier()  # everyone's are; and everyone is done with slot (j - 1) % S
            slot = j % S
            ks = j % STEPS
            w = w_s.index(slot).reshape([BN, SB, 8, 4]).load(L4)
            xl = gl.expand_dims(xl_s.index(ks).reshape([SB, 8, 4]).load(X3), 0)
            xh = gl.expand_dims(xh_s.index(ks).reshape([SB, 8, 4]).load(X3), 0)
            p = _dp4a((w >> 4) & 0x0F0F0F0F, xh, _dp4a0(w & 0x0F0F0F0F, xl, False), False)
            tg = gl.sum(p, axis=3).to(gl.float32)  # [BN, SB, 8]: each group's sum of u * q
            dx = gl.expand_dims(xd_s.index(ks).reshape([SB, 8]).load(X2), 0)
            sx = gl.expand_dims(xs_s.index(ks).reshape([SB, 8]).load(X2), 0)
            if QT == 12:
                a = gl.expand_dims(d_s.index(slot).load(S23), 2).to(gl.float32)
                b = gl.expand_dims(dm_s.index(slot).load(S23), 2).to(gl.float32)
                c = sc_s.index(slot).reshape([BN, SB, 8]).load(S3)
                e = mn_s.index(slot).reshape([BN, SB, 8]).load(S3)
                s = a * _u2f(c.to(gl.int32))
                mt = -b * _u2f(e.to(gl.int32))
            else:
                s = d_s.index(slot).reshape([BN, SB, 8]).load(S3).to(gl.float32)
                if QT == 3:
                    mt = dm_s.index(slot).reshape([BN, SB, 8]).load(S3).to(gl.float32)
                else:
                    mt = -8.0 * s
            acc += tg * s * dx + mt * sx
            # The refill of slot (j - 1) % S after this stage's reads: the barrier above already separates it
            # from every read of that slot and the next one from this stage's, so the compiler adds none
            _issue(j + S - 1, J, pid, P, N, lo_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr, stride_lo, stride_d, stride_sc,
                   w_s, d_s, dm_s, sc_s, mn_s, QT, BN, GS, STEPS, S, CLW, CLD, CLS)  # fmt: skip
            if TRIG == 2:
                if j + S - 1 == J - 1:
                    gdc_launch_dependents()
            if ks == STEPS - 1:  # the tile's last stage: its rows' sums out
                r = (pid + (j // STEPS) * P) * BN + rows
                res = gl.sum(gl.sum(acc, axis=2), axis=1)
                gl.store(out_ptr + r, res.to(out_ptr.dtype.element_ty), mask=r < N)
                acc = gl.zeros([BN, SB, 8], gl.float32, layout=S3)
        cp.wait_group(0)


def _copy_layout(rows: int, cols: int, elem_bytes: int, warps: int) -> Any:
    """A [rows, cols] tile's cp.async layout: 16 bytes a thread along a row where the row has them (the
    copies' width also needs the columns' alignment, which the strides' divisibility gives)."""
    vec = max(1, min(cols, 16 // elem_bytes))
    tpw_c = max(1, min(32, cols // vec))
    return gl.BlockedLayout([1, vec], [32 // tpw_c, tpw_c], [warps, 1], [1, 0])


def _compute_layout(gs: int, warps: int) -> Any:
    """A stage's [BN, SB, 8, 4] layout: a warp a row (its 8-group blocks, groups, 4 words a thread: one 16-byte
    read), the warps over the rows."""
    return gl.BlockedLayout([1, gs // 32, 1, 4], [1, 4, 8, 1], [warps, 1, 1, 1], [3, 2, 1, 0])


def ring_supported(qtype: int, m: int, k: int, x: torch.Tensor) -> bool:
    """Whether the ring GEMV takes this launch: a Gluon Triton, a CUDA device of compute capability 9+, one
    activation row, a 4-bit pair-layout type and K a multiple of 1024."""
    return (
        HAS_GLUON
        and x.is_cuda
        and m == 1
        and qtype in RING_TYPES
        and k % 1024 == 0
        and torch.version.hip is None
        and torch.cuda.get_device_capability(x.device)[0] >= 9
    )


def gguf_ring_gemv(
    xq: torch.Tensor,
    xd: torch.Tensor,
    xs: torch.Tensor,
    planes: list[torch.Tensor],
    strides: list[int],
    qtype: int,
    n: int,
    k: int,
    out: torch.Tensor,
    num_sms: int,
    config: RingConfig,
    pdl: dict[str, Any],
    trigger: int = 0,
) -> torch.Tensor:
    """out [1, n] = the q8 activations (xq int32 words, xd, xs of one row) @ dequant(W).T; `planes` /
    `strides` as `gguf_triton._args` gives them (lo, hi, d, dm, sc, mn; lo, hi, d, sc)."""
    bn, bk, stages, warps, per_sm, pre = config
    if k % bk:
        bk = 1024
    gs = bk // 32
    n_tiles = -(-n // bn)
    grid = (min(n_tiles, per_sm * num_sms),)
    l4 = _compute_layout(gs, warps)
    cld = _copy_layout(bn, gs // 8 if qtype == 12 else gs, 2, warps)
    lo, _, d, dm, sc, mn = planes
    _gguf_ring_gemv_kernel[grid](
        xq, xd, xs, lo, d, dm, sc, mn, out, n, strides[0], strides[2], strides[3], K=k, QT=qtype, BN=bn, BK=bk,
        S=stages, L4=l4, CLW=_copy_layout(bn, gs * 4, 4, warps), CLD=cld, CLS=_copy_layout(bn, gs, 1, warps),
        CLX=gl.BlockedLayout([4], [32], [warps], [0]), CLG=gl.BlockedLayout([1], [32], [warps], [0]),
        PDL=pdl.get("PDL", 0), TRIG=trigger if pdl.get("PDL", 0) else 0,
        PRE=stages - 1 if pre < 0 else min(pre, stages - 1), num_warps=warps,
        launch_pdl=bool(pdl),
    )  # fmt: skip
    return out
