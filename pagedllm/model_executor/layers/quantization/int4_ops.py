"""Int4 weight-only GEMMs (AWQ / GPTQ checkpoints after repacking at load).

One canonical layout for both formats: `qweight` int32 [K/8, N] (nibble j of row r holds input row
8r + j, lowest bits first), `zeros` uint8 [K/G, N] (the zero point itself, 0..15, or 16 for GPTQ v1's
stored 15), `scales` [K/G, N]; w[k, n] = (q[k, n] - zeros[k/G, n]) * scales[k/G, n]. On the GPU the
packed weight is re-tiled at load into column blocks of 64 (`tile_columns`: int32 [N/64, K/8, 64], a 3-D
tensor, so the kernels know it by its shape): a program's [rows, 64] tile is then one contiguous run of
memory instead of 256-byte rows N * 4 bytes apart.

GPU: a Triton dequant-GEMM (tensor cores, the tile dequantized in registers) for prefill and a split-K
GEMV for decode (M <= 8) that reads each packed weight once. CPU: the dequantized float32 reference.
"""

from __future__ import annotations

import torch

from pagedllm.triton_utils import HAS_TRITON, interpreted, num_sms, split_counters

if HAS_TRITON:
    import triton
    import triton.language as tl

GEMV_MAX_M = 8


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """int values 0..15 [K, N] -> int32 [K/8, N] (nibble j of row r is row 8r + j)."""
    k, n = q.shape
    q64 = q.to(torch.int64).reshape(k // 8, 8, n)
    shifts = (torch.arange(8, dtype=torch.int64, device=q.device) * 4).view(1, 8, 1)
    packed = (q64 << shifts).sum(dim=1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4_rows`: int32 [K/8, N] -> int32 [K, N] values 0..15."""
    r, n = packed.shape
    shifts = (torch.arange(8, dtype=torch.int32, device=packed.device) * 4).view(1, 8, 1)
    return ((packed.unsqueeze(1) >> shifts) & 0xF).reshape(r * 8, n)


def unpack_int4_cols(packed: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    """int32 [R, N/8] packed along columns -> int32 [R, N]; nibble i holds column `order[i]` of its 8
    (identity for GPTQ; AWQ's interleaved [0, 2, 4, 6, 1, 3, 5, 7])."""
    r, c = packed.shape
    order = order or list(range(8))
    nibble_of_col = torch.tensor([order.index(j) for j in range(8)], dtype=torch.int32, device=packed.device)
    shifts = (nibble_of_col * 4).view(1, 1, 8)
    return ((packed.unsqueeze(2) >> shifts) & 0xF).reshape(r, c * 8)


TILE_N = 64


def tile_columns(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K/8, N] -> [N/64, K/8, 64] (N a multiple of 64): column block b is `tiled[b]`, contiguous."""
    r, n = qweight.shape
    return qweight.view(r, n // TILE_N, TILE_N).permute(1, 0, 2).contiguous()


def untile_columns(qweight: torch.Tensor) -> torch.Tensor:
    """The inverse of `tile_columns` (a 2-D weight is returned as it is)."""
    if qweight.dim() == 2:
        return qweight
    nb, r, t = qweight.shape
    return qweight.permute(1, 0, 2).reshape(r, nb * t)


def packed_shape(qweight: torch.Tensor) -> tuple[int, int]:
    """(K/8, N) of a row-major or column-tiled packed weight."""
    if qweight.dim() == 3:
        return qweight.shape[1], qweight.shape[0] * qweight.shape[2]
    return qweight.shape[0], qweight.shape[1]


def dequantize(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """The canonical layout's weight as float32 [K, N]."""
    q = unpack_int4_rows(untile_columns(qweight)).float()
    z = zeros.float().repeat_interleave(group, dim=0)
    s = scales.float().repeat_interleave(group, dim=0)
    return (q - z) * s


def _use_triton(x: torch.Tensor) -> bool:
    return HAS_TRITON and (x.is_cuda or interpreted())


if HAS_TRITON:

    @triton.jit
    def _packed_offsets(rows, offs_n, N, K, TILED: tl.constexpr):
        """Element offsets of packed rows x columns in the row-major [K/8, N] or the [N/64, K/8, 64] layout."""
        if TILED:
            return ((offs_n // 64) * (K // 8))[None, :] * 64 + rows[:, None] * 64 + (offs_n % 64)[None, :]
        return rows[:, None] * N + offs_n[None, :]

    @triton.jit
    def _int4_gemm_kernel(a_ptr, qw_ptr, z_ptr, s_ptr, c_ptr, M, N, K, stride_am, stride_cm,
                          G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                          PREC: tl.constexpr, TILED: tl.constexpr):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        m_ok = offs_m < M
        n_ok = offs_n < N
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + offs_k
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + kk[None, :], mask=m_ok[:, None], other=0.0)
            q = tl.load(qw_ptr + _packed_offsets(kk // 8, offs_n, N, K, TILED), mask=n_ok[None, :], other=0)
            q = (q >> ((kk % 8) * 4)[:, None]) & 0xF
            g = k0 // G  # BK divides G: one group per K step
            z = tl.load(z_ptr + g * N + offs_n, mask=n_ok, other=0).to(tl.float32)
            s = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            w = (q.to(tl.float32) - z[None, :]) * s[None, :]
            acc += tl.dot(a, w.to(a.dtype), input_precision=PREC)
        c = acc.to(c_ptr.dtype.element_ty)
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], c, mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _int4_gemv_kernel(x_ptr, qw_ptr, z_ptr, s_ptr, part_ptr, out_ptr, cnt_ptr, M, N, K, stride_xm, stride_om,
                          K_SPLIT, SPLIT, G: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
                          TILED: tl.constexpr):  # fmt: skip
        """out[m, n-block] = x[m] @ dequant(W[k-slice, n-block]), split-K over programs.

        Each packed [BR, BN] int32 tile is loaded once and its 8 nibbles taken in turn (`static_range`) into
        a 2-D accumulator (a [BR, 8, BN] one was 2.1x slower on an H100: registers, fewer loads in flight).
        A nibble becomes a float by the exponent trick (`q | 0x4B000000` is the float 2^23 + q, exact), not an
        int-to-float conversion, whose throughput is 1/8 of an FMA's on Hopper; the group's scale and zero
        are applied once per [BR, BN] tile: sum_j x_j (q_j s - z s) = s (sum_j x_j q_j) - z s (sum_j x_j).
        BR * 8 divides G, so a tile stays in one group. The split-K partials (float32) are summed by the
        last program of each column block to finish (an atomic counter, reset by that program for the next
        launch or graph replay), in split order, so no separate reduction or cast kernel runs."""
        m = tl.program_id(0)
        pid_n = tl.program_id(1)
        split = tl.program_id(2)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < N
        offs_r = tl.arange(0, BR)
        acc = tl.zeros([BR, BN], dtype=tl.float32)
        k_begin = split * K_SPLIT
        k_end = tl.minimum(k_begin + K_SPLIT, K)
        x_row = x_ptr + m * stride_xm
        for k0 in range(k_begin, k_end, BR * 8):
            rows = k0 // 8 + offs_r
            packed = tl.load(qw_ptr + _packed_offsets(rows, offs_n, N, K, TILED), mask=n_ok[None, :], other=0)
            g = k0 // G
            z = tl.load(z_ptr + g * N + offs_n, mask=n_ok, other=0).to(tl.float32)
            s = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            t = tl.zeros([BR, BN], dtype=tl.float32)
            xsum = tl.zeros([BR], dtype=tl.float32)
            for j in tl.static_range(8):
                bits = ((packed >> (4 * j)) & 0xF) | 0x4B000000
                q = bits.to(tl.float32, bitcast=True) - 8388608.0
                xj = tl.load(x_row + rows * 8 + j).to(tl.float32)
                t += xj[:, None] * q
                xsum += xj
            acc += t * s[None, :] - xsum[:, None] * (z * s)[None, :]
        res = tl.sum(acc, axis=0)
        if SPLIT == 1:
            tl.store(out_ptr + m * stride_om + offs_n, res.to(out_ptr.dtype.element_ty), mask=n_ok)
        else:
            tl.store(part_ptr + (split * M + m) * N + offs_n, res, mask=n_ok)
            tl.debug_barrier()  # every thread's partial is written before the counter moves
            done = tl.atomic_add(cnt_ptr + pid_n * M + m, 1, sem="acq_rel")
            tl.debug_barrier()
            if done == SPLIT - 1:
                tot = tl.zeros([BN], dtype=tl.float32)
                for i in range(0, SPLIT):
                    tot += tl.load(part_ptr + (i * M + m) * N + offs_n, mask=n_ok, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + m * stride_om + offs_n, tot.to(out_ptr.dtype.element_ty), mask=n_ok)
                tl.atomic_xchg(cnt_ptr + pid_n * M + m, 0)


def _block_k(group: int) -> int:
    return 64 if group % 64 == 0 else 32


def int4_gemm_triton(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                     group: int) -> torch.Tensor:  # fmt: skip
    """x [M, K] (16-bit or float32) @ dequant(W) [K, N] with tensor cores -> [M, N] in x's dtype."""
    m, k = x.shape
    n = packed_shape(qweight)[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    bn, bk = TILE_N, _block_k(group)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _int4_gemm_kernel[grid](x, qweight, zeros, scales, out, m, n, k, x.stride(0), out.stride(0),
                            G=group, BM=bm, BN=bn, BK=bk, PREC="ieee" if x.dtype == torch.float32 else "tf32",
                            TILED=qweight.dim() == 3)  # fmt: skip
    return out


def int4_gemv_triton(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                     group: int, num_sms: int = 132) -> torch.Tensor:  # fmt: skip
    """x [M <= 8, K] @ dequant(W) -> [M, N] in x's dtype: every program streams a [K / split, 64] slice of
    the packed weight. The configuration is the best of `benchmarks/gemv_tune.py`'s sweep on
    Llama-3.1-8B's shapes on an H100 (benchmarks/NOTES.md)."""
    m, k = x.shape
    n = packed_shape(qweight)[1]
    bn, br = TILE_N, min(16, group // 8)
    bk = br * 8
    n_blocks = triton.cdiv(n, bn)
    split = max(1, min(8 * num_sms // max(1, m * n_blocks), k // (bk * 4)))
    k_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    cnt = split_counters(x.device, m * n_blocks)
    _int4_gemv_kernel[(m, n_blocks, split)](x, qweight, zeros, scales, part, out, cnt, m, n, k, x.stride(0),
                                             out.stride(0), k_split, split, G=group, BN=bn, BR=br, num_warps=4,
                                             num_stages=4, TILED=qweight.dim() == 3)  # fmt: skip
    return out


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    group: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x [..., K] @ dequant(W) (+ bias) in x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = packed_shape(qweight)[1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] == 0:
        out = x2.new_empty(0, n)
    elif _use_triton(x2):
        if x2.shape[0] <= GEMV_MAX_M:
            sms = num_sms(x2.device) if x2.is_cuda else 4
            out = int4_gemv_triton(x2, qweight, zeros, scales, group, sms)
        else:
            out = int4_gemm_triton(x2, qweight, zeros, scales, group)
    else:
        out = (x2.float() @ dequantize(qweight, zeros, scales, group)).to(x.dtype)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.view(*lead, n)
