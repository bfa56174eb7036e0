/* AVX-512 VNNI matmul for GGUF's 32-element block formats (Q4_0, Q4_1, Q8_0) with the output columns along
 * the vector lanes (built by pagedllm/csrc/__init__.py, called by gguf_mm.c).
 *
 * Why: `gguf_mm.c`'s row kernels dot one weight row with up to 4 activation rows along K, so every (weight row,
 * activation row, block) pays a float conversion, a scale broadcast and an FMA next to its two integer dots,
 * and the weight block is unpacked again for every 4 activation rows: 25-35 GMAC/s on a Zen 4 core at any
 * batch, where `vpdpwssd` alone could do ~100. Here a tile of 16 weight rows is unpacked once per panel of
 * blocks and transposed so that lane r holds row r's element pairs: one `vpdpwssd` with a
 * broadcast activation pair then advances 16 output columns, and the per-block float work (convert, scale,
 * FMA) is shared by those 16 columns. Weights re-laid at load (`gguf_tile_pack`, the engine's default where
 * this kernel runs) skip the transposition and are read in memory order; up to 16 activation rows then dot
 * straight from the unpacked vectors (`tiled_few_rows`), more go through scratch panels (`panel_rows`; two
 * tiles at a time, `two_tiles`, where a tiled weight's rows come in whole pairs of tiles).
 * `decode_stack.c` splits a tiled product's tiles over its own threads (`gguf_mm_tiled_range`).
 *
 * Pairs: Q8_0 lanes hold elements (2j, 2j + 1); Q4 lanes hold (j, 16 + j), the two nibbles of byte j, so the
 * activations of Q4 weights are reordered to match once per product (`pair_halves`).
 *
 * Arithmetic (the same whatever the batch, so a request's logits do not depend on what it is batched with):
 * for weight row n and activation row m, acc = fma((float)dot_b, d_nb * xd_mb, acc) and
 * off = fma(o_nb, xs_mb, off) over the blocks b in order, dot_b the block's exact int32 integer dot, o the
 * block's additive term per unit of the activation sum (Q4_1's m, Q4_0's -8 d, none for Q8_0); the result
 * is acc + off.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "gguf_common.h"

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8 };
#define TILE 16 /* weight rows per tile: the 16 lanes of a zmm */

/* ---- the tiled layout (`gguf_tile_pack`): the same bits as the file's blocks, re-laid at load so that a tile's
 * 16 rows need no transposition and are read in memory order ------------------------------------------------
 * Per (tile of 16 rows, block), tile-major: the 16 rows' float16 d (32 B), Q4_1's 16 mins (32 B), then the
 * quants as 16 chunks j, one per lane vector: Q4 chunk j = byte j of each row (16 B: elements j and 16 + j);
 * Q8_0 chunk j = elements 2j, 2j + 1 of each row (32 B). Rows past N are zeros. */
static int tile_bytes(int type) { return type == T_Q4_0 ? 288 : type == T_Q4_1 ? 320 : 544; }

static int64_t tiled_size(int type, int64_t N, int64_t K) { return (N + TILE - 1) / TILE * (K / 32) * tile_bytes(type); }

/* Between the file's layout (`file`, [N, K / 32 * block bytes]) and the tiled one (`tiled`, `tiled_size` bytes). */
static void retile(int type, uint8_t* file, uint8_t* tiled, int64_t N, int64_t K, int to_tiled) {
    const int bb = type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : 34, tb = tile_bytes(type);
    const int qoff = type == T_Q4_1 ? 64 : 32, qsrc = type == T_Q4_1 ? 4 : 2;
    const int64_t nbx = K / 32, ntiles = (N + TILE - 1) / TILE;
    if (to_tiled) memset(tiled, 0, (size_t)tiled_size(type, N, K));
    for (int64_t t = 0; t < ntiles; t++)
        for (int64_t b = 0; b < nbx; b++) {
            uint8_t* tb_ = tiled + (t * nbx + b) * tb;
            for (int r = 0; r < TILE && t * TILE + r < N; r++) {
                uint8_t* blk = file + (t * TILE + r) * nbx * bb + b * bb;
#define MOVE(F, T_) (to_tiled ? (*(T_) = *(F)) : (*(F) = *(T_)))
                for (int i = 0; i < 2; i++) MOVE(blk + i, tb_ + 2 * r + i);
                if (type == T_Q4_1)
                    for (int i = 0; i < 2; i++) MOVE(blk + 2 + i, tb_ + 32 + 2 * r + i);
                if (type == T_Q8_0)
                    for (int j = 0; j < 16; j++)
                        for (int i = 0; i < 2; i++) MOVE(blk + qsrc + 2 * j + i, tb_ + qoff + 32 * j + 2 * r + i);
                else
                    for (int j = 0; j < 16; j++) MOVE(blk + qsrc + j, tb_ + qoff + 16 * j + r);
#undef MOVE
            }
        }
}

/* Q4_0 / Q4_1 / Q8_0 only (the caller checks); returns the tiled layout's size, or -1. `dst` NULL: the size. */
int64_t gguf_tile_pack(int type, const uint8_t* src, int64_t N, int64_t K, uint8_t* dst) {
    if ((type != T_Q4_0 && type != T_Q4_1 && type != T_Q8_0) || K % 32 || N < 1) return -1;
    if (dst != NULL) retile(type, (uint8_t*)src, dst, N, K, 1);
    return tiled_size(type, N, K);
}

/* The inverse: the file's layout back (for the dequantization and the kernels of other ISAs). */
int gguf_tile_unpack(int type, const uint8_t* tiled, int64_t N, int64_t K, uint8_t* dst) {
    if ((type != T_Q4_0 && type != T_Q4_1 && type != T_Q8_0) || K % 32 || N < 1) return -1;
    retile(type, dst, (uint8_t*)tiled, N, K, 0);
    return 0;
}

#if defined(__x86_64__)
#include <immintrin.h>

#define PANEL 16 /* blocks unpacked at a time: 16 KiB of int16 pairs, kept in L1 while every row group passes */
#define MR 8     /* activation rows per pass: 8 int32 + 8 x 2 float accumulators */
#define PF_TILES 1 /* prefetch distance, in tiles */
#define FEW_ROWS 4 /* up to this many activation rows: `tile_few_rows` (no transposition) */
#define TILED_FEW_ROWS 16 /* tiled layout: `tiled_few_rows` in groups of MR up to here, then scratch panels */
#define MB 128 /* activation rows per chunk of a large product (see gguf_mm_tile_vnni_parts); 128 rather than
                 * 64 since tiles go in pairs (half the panel unpacking, 1.03x at M = 1,024 on a Zen 5 host) */

#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,f16c,fma")))

/* A block's 32 quants as 16 int32 lanes of int16 pairs. Q8_0: element order, pairs (2j, 2j + 1). Q4_0 / Q4_1:
 * byte i holds element i (low nibble) and 16 + i (high), so lane i is the pair (i, 16 + i): one widening, one
 * shift and one bit select (the activations are permuted to match, `pair_halves`). Q4_0's -8 is folded into
 * the block's additive term. */
TGT static inline __m512i unpack_block(const int type, const uint8_t* blk) {
    if (type == T_Q8_0) return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(blk + 2)));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + (type == T_Q4_0 ? 2 : 4))));
    /* mask & (b | b << 12): bits 0-3 the low nibble, bits 16-19 the high one */
    return _mm512_ternarylogic_epi32(_mm512_set1_epi32(0x000F000F), b, _mm512_slli_epi32(b, 12), 0xE0);
}

/* A tiled block (`gguf_tile_pack`'s layout at `base`): lane vector j, and the 16 rows' scales and terms. */
TGT static inline __m512i tiled_vector(const int type, const uint8_t* base, int j) {
    if (type == T_Q8_0) return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(base + 32 + 32 * j)));
    const uint8_t* q = base + (type == T_Q4_1 ? 64 : 32) + 16 * j;
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
    return _mm512_ternarylogic_epi32(_mm512_set1_epi32(0x000F000F), b, _mm512_slli_epi32(b, 12), 0xE0);
}

TGT static inline void tiled_scales(const int type, const uint8_t* base, __m512* d, __m512* o) {
    *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)base));
    if (type == T_Q4_1)
        *o = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(base + 32)));
    else if (type == T_Q4_0)
        *o = _mm512_mul_ps(_mm512_set1_ps(-8.0f), *d);
    else
        *o = _mm512_setzero_ps();
}

/* The float16 scale (and Q4_1's min) of block b of 16 rows in one gather: (d, additive term o). */
TGT static inline void block_scales(const int type, const uint8_t* base, const __m512i idx, __m512* d, __m512* o) {
    const __m512i g = _mm512_i32gather_epi32(idx, base, 1); /* d | second field << 16 */
    *d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
    if (type == T_Q4_1)
        *o = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)));
    else if (type == T_Q4_0)
        *o = _mm512_mul_ps(_mm512_set1_ps(-8.0f), *d);
    else
        *o = _mm512_setzero_ps();
}

/* Row offsets of a tile's 16 rows (rows past N repeat row N - 1) as gather indices. */
TGT static inline __m512i row_index(int64_t row_bytes, int valid) {
    return _mm512_mullo_epi32(_mm512_min_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32(valid - 1)),
                              _mm512_set1_epi32((int32_t)row_bytes));
}

/* r[i] = row i of a 16 x 16 int32 matrix -> r[c] = column c. */
TGT static inline void transpose16(__m512i* r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    /* u[4g + k], 128-bit lane L: column 4L + k of rows 4g .. 4g + 3 */
    for (int g = 0; g < 4; g++) {
        u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int k = 0; k < 4; k++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44), v1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xEE);
        r[k] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[4 + k] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        r[8 + k] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[12 + k] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

/* Blocks [b0, b0 + npb) of weight rows [n0, n0 + TILE) (rows past N repeat row N - 1): pairs transposed into
 * tw[pb * 16 + j] (lane r: row n0 + r's pair j), scales into dv[pb * 16 + r], additive terms into ov. */
TGT static void unpack_panel(const int type, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t N, int64_t b0,
                             int npb, __m512i* tw, float* dv, float* ov) {
    const int bb = type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : 34;
    if (n0 + (PF_TILES + 1) * TILE <= N) /* the same blocks of the next tile (see tile_few_rows) */
        for (int i = 0; i < TILE; i++) {
            const char* p = (const char*)(w + (n0 + PF_TILES * TILE + i) * row_bytes + b0 * bb);
            for (int64_t l = 0; l < npb * bb; l += 64) _mm_prefetch(p + l, _MM_HINT_T1);
        }
    const __m512i idx = row_index(row_bytes, N - n0 < TILE ? (int)(N - n0) : TILE);
    for (int pb = 0; pb < npb; pb++) {
        __m512i r[TILE];
        for (int i = 0; i < TILE; i++) {
            const int64_t n = n0 + i < N ? n0 + i : N - 1;
            r[i] = unpack_block(type, w + n * row_bytes + (b0 + pb) * bb);
        }
        transpose16(r);
        for (int j = 0; j < 16; j++) _mm512_store_si512(tw + pb * 16 + j, r[j]);
        __m512 d, o;
        block_scales(type, w + n0 * row_bytes + (b0 + pb) * bb, idx, &d, &o);
        _mm512_store_ps(dv + pb * 16, d);
        _mm512_store_ps(ov + pb * 16, o);
    }
}

/* `mr` activation rows (xq row stride K, block stats stride nbx) against one unpacked panel: the rows'
 * accumulators acc / off (16 floats a row) carried in and out. */
TGT __attribute__((always_inline)) static inline void panel_rows(const int has_off, const int mr, const __m512i* tw,
                                                                  const float* dv, const float* ov, int npb,
                                                                  const int16_t* xq, const float* xd, const float* xs,
                                                                  int64_t K, int64_t nbx, int64_t b0, float* acc,
                                                                  float* off) {
    __m512 fa[MR], fo[MR];
    for (int i = 0; i < mr; i++) {
        fa[i] = _mm512_load_ps(acc + 16 * i);
        fo[i] = _mm512_load_ps(off + 16 * i);
    }
    for (int pb = 0; pb < npb; pb++) {
        const int64_t b = b0 + pb;
        const __m512i* t = tw + pb * 16;
        __m512i ia[MR];
        if (mr >= 4) {
            /* One accumulator a row, the j loop unrolled: rolled, gcc rotated the accumulators through
             * register copies every step (twice the instructions of the dots). */
            for (int i = 0; i < mr; i++) ia[i] = _mm512_setzero_si512();
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++) {
                const __m512i wj = _mm512_load_si512(t + j);
#pragma GCC unroll 8
                for (int i = 0; i < mr; i++) /* the pair broadcast inside the instruction (m32bcst): gcc
                    * emitted a `vpbroadcastd` per pair, 256 vector ops a block for 128 dots (1.05x at M = 1,024) */
                    __asm__("vpdpwssd %2%{1to16%}, %1, %0"
                            : "+v"(ia[i])
                            : "v"(wj), "m"(*(const int32_t*)(xq + i * K + b * 32 + 2 * j)));
            }
        } else {
            /* Fewer than 4 rows: each row's dots in `chains` independent accumulators (one chain of 16
             * dependent `vpdpwssd` is latency-bound); integer sums, so the split changes nothing. */
            const int chains = mr == 1 ? 4 : 2;
            __m512i ic[MR * 4];
            for (int i = 0; i < mr * chains; i++) ic[i] = _mm512_setzero_si512();
            for (int j = 0; j < 16; j++) {
                const __m512i wj = _mm512_load_si512(t + j);
                for (int i = 0; i < mr; i++) {
                    int32_t pair;
                    memcpy(&pair, xq + i * K + b * 32 + 2 * j, 4);
                    __m512i* a = ic + i * chains + j % chains;
                    *a = _mm512_dpwssd_epi32(*a, wj, _mm512_set1_epi32(pair));
                }
            }
            for (int i = 0; i < mr; i++) {
                ia[i] = ic[i * chains];
                for (int c = 1; c < chains; c++) ia[i] = _mm512_add_epi32(ia[i], ic[i * chains + c]);
            }
        }
        const __m512 d = _mm512_load_ps(dv + pb * 16);
        for (int i = 0; i < mr; i++)
            fa[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[i]), _mm512_mul_ps(d, _mm512_set1_ps(xd[i * nbx + b])), fa[i]);
        if (has_off) {
            const __m512 o = _mm512_load_ps(ov + pb * 16);
            for (int i = 0; i < mr; i++) fo[i] = _mm512_fmadd_ps(o, _mm512_set1_ps(xs[i * nbx + b]), fo[i]);
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm512_store_ps(acc + 16 * i, fa[i]);
        _mm512_store_ps(off + 16 * i, fo[i]);
    }
}

/* 16 int32 vectors -> one: lane r = the sum of p[r]'s lanes (exact integer sums, so the same as the panel
 * path's). Pairwise unpacks (rows 2i, 2i + 1), then 64-bit unpacks (4 rows per 128-bit lane), then the four
 * 128-bit lanes folded. */
TGT static inline __m512i reduce16(const __m512i* p) {
    __m512i a[8], c[4];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2 * i], p[2 * i + 1]),
                                _mm512_unpackhi_epi32(p[2 * i], p[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * i], a[2 * i + 1]),
                                _mm512_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
    const __m512i x = _mm512_add_epi32(_mm512_shuffle_i32x4(c[0], c[1], 0x44), _mm512_shuffle_i32x4(c[0], c[1], 0xEE));
    const __m512i y = _mm512_add_epi32(_mm512_shuffle_i32x4(c[2], c[3], 0x44), _mm512_shuffle_i32x4(c[2], c[3], 0xEE));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(x, y, 0x88), _mm512_shuffle_i32x4(x, y, 0xDD));
}

/* Few activation rows (decode): each block's 16 weight rows are unpacked once and dotted along K with every
 * activation row, the 16 row sums gathered into lanes by `reduce16` (cheaper than `transpose16` when there
 * are too few rows to share it). Writes the 16 output columns of `mr` rows to acc (16 floats a row). */
TGT __attribute__((always_inline)) static inline void tile_few_rows(const int type, const int mr, const uint8_t* w,
                                                                     int64_t row_bytes, int64_t n0, int64_t N,
                                                                     const int16_t* xq, const float* xd,
                                                                     const float* xs, int64_t K, float* acc) {
    const int bb = type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : 34, has_off = type != T_Q8_0;
    const int64_t nbx = K / 32;
    const uint8_t* rows[TILE];
    for (int i = 0; i < TILE; i++) rows[i] = w + (n0 + i < N ? n0 + i : N - 1) * row_bytes;
    const __m512i idx = row_index(row_bytes, N - n0 < TILE ? (int)(N - n0) : TILE);
    __m512 fa[4], fo[4];
    for (int i = 0; i < mr; i++) fa[i] = fo[i] = _mm512_setzero_ps();
    /* The blocks are read across 16 rows at once, a pattern the hardware prefetchers miss (a decode step's
     * weights streamed from memory ran at half the row kernels' speed without help): the next tile is
     * prefetched meanwhile, a few lines a block (the distance and hint measured best on a Zen 4, where a
     * whole SmolLM2 step then runs at 0.85-1.03x the row kernels' time at one row, 1.5x at 16). */
    const char* ahead = (const char*)(w + (n0 + PF_TILES * TILE) * row_bytes);
    const int64_t ahead_lines = n0 + (PF_TILES + 1) * TILE <= N ? TILE * row_bytes / 64 : 0;
    for (int64_t b = 0; b < nbx; b++) {
        for (int64_t l = b * ahead_lines / nbx; l < (b + 1) * ahead_lines / nbx; l++)
            _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
        __m512i wr[TILE];
        for (int r = 0; r < TILE; r++) wr[r] = unpack_block(type, rows[r] + b * bb);
        __m512 d, o;
        block_scales(type, rows[0] + b * bb, idx, &d, &o);
        for (int i = 0; i < mr; i++) {
            const __m512i x = _mm512_loadu_si512(xq + i * K + b * 32);
            __m512i p[TILE];
            for (int r = 0; r < TILE; r++) p[r] = _mm512_dpwssd_epi32(_mm512_setzero_si512(), wr[r], x);
            fa[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(reduce16(p)), _mm512_mul_ps(d, _mm512_set1_ps(xd[i * nbx + b])),
                                    fa[i]);
            if (has_off) fo[i] = _mm512_fmadd_ps(o, _mm512_set1_ps(xs[i * nbx + b]), fo[i]);
        }
    }
    for (int i = 0; i < mr; i++) _mm512_store_ps(acc + 16 * i, _mm512_add_ps(fa[i], fo[i]));
}

/* Few activation rows on the tiled layout: each lane vector is unpacked straight into the dots (no scratch
 * panel: for one row, storing and reloading the unpacked panel cost as much as the dots). */
TGT __attribute__((always_inline)) static inline void tiled_few_rows(const int type, const int mr, const uint8_t* src,
                                                                      const int16_t* xq, const float* xd,
                                                                      const float* xs, int64_t K, float* acc) {
    const int tb = tile_bytes(type), chains = mr >= 4 ? 1 : mr == 1 ? 4 : 2;
    const int64_t nbx = K / 32;
    __m512 fa[MR], fo[MR];
    for (int i = 0; i < mr; i++) fa[i] = fo[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nbx; b++) {
        const uint8_t* base = src + b * tb;
        __m512i ic[8];
        for (int i = 0; i < mr * chains; i++) ic[i] = _mm512_setzero_si512();
        for (int j = 0; j < 16; j++) {
            const __m512i w = tiled_vector(type, base, j);
            for (int i = 0; i < mr; i++) {
                int32_t pair;
                memcpy(&pair, xq + i * K + b * 32 + 2 * j, 4);
                __m512i* a = ic + i * chains + j % chains;
                *a = _mm512_dpwssd_epi32(*a, w, _mm512_set1_epi32(pair));
            }
        }
        __m512 d, o;
        tiled_scales(type, base, &d, &o);
        for (int i = 0; i < mr; i++) {
            __m512i s = ic[i * chains];
            for (int c = 1; c < chains; c++) s = _mm512_add_epi32(s, ic[i * chains + c]);
            fa[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(xd[i * nbx + b])), fa[i]);
            if (type != T_Q8_0) fo[i] = _mm512_fmadd_ps(o, _mm512_set1_ps(xs[i * nbx + b]), fo[i]);
        }
    }
    for (int i = 0; i < mr; i++) _mm512_store_ps(acc + 16 * i, _mm512_add_ps(fa[i], fo[i]));
}

#define TFEW_CALL(T, R) tiled_few_rows(T, R, w + tile * nbx * tile_bytes(T), y, yd, ys, K, a)
/* CALL(A, r) with r = mr as a constant (1..8), so that each row count gets its own unrolled body. */
#define ROWS8_SWITCH(CALL, A)       \
    switch (mr) {                   \
        case 1: CALL(A, 1); break;  \
        case 2: CALL(A, 2); break;  \
        case 3: CALL(A, 3); break;  \
        case 4: CALL(A, 4); break;  \
        case 5: CALL(A, 5); break;  \
        case 6: CALL(A, 6); break;  \
        case 7: CALL(A, 7); break;  \
        default: CALL(A, 8); break; \
    }
#define TFEW_SWITCH(T) ROWS8_SWITCH(TFEW_CALL, T)

#define FEW_CALL(T, R) tile_few_rows(T, R, w, row_bytes, n0, N, xq, xd, xs, K, acc)
#define FEW_SWITCH(T)                  \
    switch (M) {                       \
        case 1: FEW_CALL(T, 1); break; \
        case 2: FEW_CALL(T, 2); break; \
        case 3: FEW_CALL(T, 3); break; \
        default: FEW_CALL(T, 4); break; \
    }

#define PANEL_CALL(H, R) panel_rows(H, R, tw, dv, ov, npb, y, yd, ys, K, nbx, b0, acc + m0 * 16, off + m0 * 16)
#define PANEL_SWITCH(H) ROWS8_SWITCH(PANEL_CALL, H)

/* A panel of a tiled tile: the lane vectors as they are stored (no transposition), scales and terms. */
TGT static void unpack_panel_tiled(const int type, const uint8_t* src, int npb, __m512i* tw, float* dv, float* ov) {
    for (int pb = 0; pb < npb; pb++) {
        const uint8_t* base = src + pb * tile_bytes(type);
        __m512 d, o;
        tiled_scales(type, base, &d, &o);
        _mm512_store_ps(dv + pb * 16, d);
        _mm512_store_ps(ov + pb * 16, o);
        for (int j = 0; j < 16; j++) _mm512_store_si512(tw + pb * 16 + j, tiled_vector(type, base, j));
    }
}

/* Q4_0 / Q4_1 pair element i with 16 + i (`unpack_block`): each block of 32 activations reordered to
 * x0 x16 x1 x17 ... x15 x31 (Q8_0 keeps element order). */
TGT static void pair_halves(const int16_t* x, int64_t n, int16_t* out) {
    const __m512i perm = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                          21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t i = 0; i < n; i += 32)
        _mm512_storeu_si512(out + i, _mm512_permutexvar_epi16(perm, _mm512_loadu_si512(x + i)));
}

/* The calling thread's buffer for `n` paired activations, kept from call to call (grown as needed, never
 * freed): a fresh aligned_alloc per product was a fresh mmap at prefill sizes (1,024 x 1,536 int16 = 3 MB),
 * every page faulted in and zeroed again. NULL when out of memory. */
static int16_t* paired_buffer(size_t n) {
    static __thread int16_t* buf = NULL;
    static __thread size_t cap = 0;
    if (n > cap) {
        free(buf);
        cap = (n + 4095) / 4096 * 4096;
        buf = aligned_alloc(64, cap * sizeof(int16_t));
        if (buf == NULL) cap = 0;
    }
    return buf;
}

/* One tile of 16 output columns for all M rows (acc: M * 32 floats of scratch; tw / dv / ov: a panel's). */
TGT static void one_tile(const int type, const int tiled, const uint8_t* w, const int64_t N, const int64_t K,
                         const int16_t* xq, const float* xd, const float* xs, const int64_t M, void* out,
                         const int64_t out_stride, const int out_bf16, const int64_t tile, float* acc, __m512i* tw,
                         float* dv, float* ov) {
    const int bb = type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : 34, has_off = type != T_Q8_0;
    const int64_t nbx = K / 32, row_bytes = nbx * bb;
    float* off = acc + M * 16;
    const int64_t n0 = tile * TILE;
    const int valid = N - n0 < TILE ? (int)(N - n0) : TILE;
    if (M <= (tiled ? TILED_FEW_ROWS : FEW_ROWS)) {
        if (tiled) { /* row groups of up to MR, each unpacking the tile again (from L1 / L2) */
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                const int64_t mr = M - m0 < MR ? M - m0 : MR;
                const int16_t* y = xq + m0 * K;
                const float* yd = xd + m0 * nbx;
                const float* ys = xs + m0 * nbx;
                float* a = acc + m0 * 16;
                if (type == T_Q4_0) {
                    TFEW_SWITCH(T_Q4_0)
                } else if (type == T_Q4_1) {
                    TFEW_SWITCH(T_Q4_1)
                } else {
                    TFEW_SWITCH(T_Q8_0)
                }
            }
        } else if (type == T_Q4_0) {
            FEW_SWITCH(T_Q4_0)
        } else if (type == T_Q4_1) {
            FEW_SWITCH(T_Q4_1)
        } else {
            FEW_SWITCH(T_Q8_0)
        }
        const __mmask16 keep = (__mmask16)((1u << valid) - 1);
        for (int64_t m = 0; m < M; m++) {
            const int64_t at = m * out_stride + n0;
            if (out_bf16)
                for (int i = 0; i < valid; i++) ((uint16_t*)out)[at + i] = f32_to_bf16(acc[m * 16 + i]);
            else /* a masked store: memcpy was a library call a row */
                _mm512_mask_storeu_ps((float*)out + at, keep, _mm512_load_ps(acc + m * 16));
        }
        return;
    }
    memset(acc, 0, (size_t)M * 16 * 2 * sizeof(float));
    for (int64_t b0 = 0; b0 < nbx; b0 += PANEL) {
        const int npb = nbx - b0 < PANEL ? (int)(nbx - b0) : PANEL;
        if (tiled)
            unpack_panel_tiled(type, w + (tile * nbx + b0) * tile_bytes(type), npb, tw, dv, ov);
        else
            unpack_panel(type, w, row_bytes, n0, N, b0, npb, tw, dv, ov);
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int mr = M - m0 < MR ? (int)(M - m0) : MR;
            const int16_t* y = xq + m0 * K;
            const float* yd = xd + m0 * nbx;
            const float* ys = xs + m0 * nbx;
            if (has_off) {
                PANEL_SWITCH(1)
            } else {
                PANEL_SWITCH(0)
            }
        }
    }
    const __mmask16 keep = (__mmask16)((1u << valid) - 1);
    for (int64_t m = 0; m < M; m++) {
        const __m512 r = _mm512_add_ps(_mm512_load_ps(acc + m * 16), _mm512_load_ps(off + m * 16));
        const int64_t at = m * out_stride + n0;
        if (out_bf16) {
            float rr[16] __attribute__((aligned(64)));
            _mm512_store_ps(rr, r);
            for (int i = 0; i < valid; i++) ((uint16_t*)out)[at + i] = f32_to_bf16(rr[i]);
        } else {
            _mm512_mask_storeu_ps((float*)out + at, keep, r);
        }
    }
}

/* Two tiles' panels (tw, tw + PANEL * 16) against `mr` <= 4 rows: each activation pair, broadcast once, feeds
 * both tiles, so that the activations (read from L2: a 128-row chunk's panel is 128 KiB) are read once for 32
 * output columns (1.06-1.08x over `panel_rows` at M = 1,024 on a Zen 5 host, 1.12x at 64 rows). acc / off: 32
 * floats a row (tile 0's 16, then tile 1's); the first panel (b0 == 0) starts them, so they need no memset. The
 * same float operations, in the same order, as `panel_rows` for each tile: the same bits. */
TGT __attribute__((always_inline)) static inline void panel_rows2(const int has_off, const int mr, const __m512i* tw,
                                                                   const float* dv, const float* ov, int npb,
                                                                   const int16_t* xq, const float* xd,
                                                                   const float* xs, int64_t K, int64_t nbx,
                                                                   int64_t b0, float* acc, float* off) {
    __m512 fa[2][4], fo[2][4];
    for (int i = 0; i < mr; i++) /* the first panel starts the sums (no memset of acc / off) */
        for (int u = 0; u < 2; u++) {
            fa[u][i] = b0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(acc + 32 * i + 16 * u);
            fo[u][i] = b0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(off + 32 * i + 16 * u);
        }
    for (int pb = 0; pb < npb; pb++) {
        const int64_t b = b0 + pb;
        __m512i ia[2][4];
        for (int i = 0; i < mr; i++) ia[0][i] = ia[1][i] = _mm512_setzero_si512();
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++) {
            const __m512i w0 = _mm512_load_si512(tw + pb * 16 + j), w1 = _mm512_load_si512(tw + PANEL * 16 + pb * 16 + j);
#pragma GCC unroll 4
            for (int i = 0; i < mr; i++) {
                int32_t pair;
                memcpy(&pair, xq + i * K + b * 32 + 2 * j, 4);
                const __m512i x = _mm512_set1_epi32(pair);
                ia[0][i] = _mm512_dpwssd_epi32(ia[0][i], w0, x);
                ia[1][i] = _mm512_dpwssd_epi32(ia[1][i], w1, x);
            }
        }
        for (int u = 0; u < 2; u++) {
            const __m512 d = _mm512_load_ps(dv + PANEL * 16 * u + pb * 16);
            for (int i = 0; i < mr; i++)
                fa[u][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[u][i]), _mm512_mul_ps(d, _mm512_set1_ps(xd[i * nbx + b])),
                                           fa[u][i]);
            if (has_off) {
                const __m512 o = _mm512_load_ps(ov + PANEL * 16 * u + pb * 16);
                for (int i = 0; i < mr; i++) fo[u][i] = _mm512_fmadd_ps(o, _mm512_set1_ps(xs[i * nbx + b]), fo[u][i]);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int u = 0; u < 2; u++) {
            _mm512_store_ps(acc + 32 * i + 16 * u, fa[u][i]);
            _mm512_store_ps(off + 32 * i + 16 * u, fo[u][i]);
        }
}

#define PANEL2_CALL(H, R) panel_rows2(H, R, tw, dv, ov, npb, y, yd, ys, K, nbx, b0, acc + m0 * 32, off + m0 * 32)
#define PANEL2_SWITCH(H)                 \
    switch (mr) {                        \
        case 1: PANEL2_CALL(H, 1); break; \
        case 2: PANEL2_CALL(H, 2); break; \
        case 3: PANEL2_CALL(H, 3); break; \
        default: PANEL2_CALL(H, 4); break; \
    }

/* `one_tile` for tiles `tile` and `tile + 1` of a tiled weight (both full) and M > TILED_FEW_ROWS rows: acc
 * M * 64 floats; tw / dv / ov two panels' room. */
TGT static void two_tiles(const int type, const uint8_t* w, const int64_t K, const int16_t* xq, const float* xd,
                          const float* xs, const int64_t M, void* out, const int64_t out_stride, const int out_bf16,
                          const int64_t tile, float* acc, __m512i* tw, float* dv, float* ov) {
    const int has_off = type != T_Q8_0;
    const int64_t nbx = K / 32;
    float* off = acc + M * 32;
    for (int64_t b0 = 0; b0 < nbx; b0 += PANEL) {
        const int npb = nbx - b0 < PANEL ? (int)(nbx - b0) : PANEL;
        for (int u = 0; u < 2; u++)
            unpack_panel_tiled(type, w + ((tile + u) * nbx + b0) * tile_bytes(type), npb, tw + PANEL * 16 * u,
                               dv + PANEL * 16 * u, ov + PANEL * 16 * u);
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int mr = M - m0 < 4 ? (int)(M - m0) : 4;
            const int16_t* y = xq + m0 * K;
            const float* yd = xd + m0 * nbx;
            const float* ys = xs + m0 * nbx;
            if (has_off) {
                PANEL2_SWITCH(1)
            } else {
                PANEL2_SWITCH(0)
            }
        }
    }
    for (int64_t m = 0; m < M; m++)
        for (int u = 0; u < 2; u++) {
            const __m512 r = _mm512_add_ps(_mm512_load_ps(acc + m * 32 + 16 * u), _mm512_load_ps(off + m * 32 + 16 * u));
            const int64_t at = m * out_stride + (tile + u) * TILE;
            if (out_bf16) {
                float rr[16] __attribute__((aligned(64)));
                _mm512_store_ps(rr, r);
                for (int i = 0; i < 16; i++) ((uint16_t*)out)[at + i] = f32_to_bf16(rr[i]);
            } else {
                _mm512_storeu_ps((float*)out + at, r);
            }
        }
}

/* gguf_mm's contract for Q4_0 / Q4_1 / Q8_0 (K % 32 == 0, checked by the caller) over up to GGUF_MAX_PARTS
 * weights stacked by output rows (a fused q/k/v or gate/up projection): part p, of types[p] (in the file's
 * layout or, tiled[p], in `gguf_tile_pack`'s), fills output columns from the sum of the earlier parts' Ns.
 * One parallel region for all parts' tiles and the activations paired once; 0, or -1 when out of memory. */
TGT int gguf_mm_tile_vnni_parts(int n_parts, const int* types, const int* tiled, const uint8_t* const* ws,
                                const int64_t* Ns, int64_t K, const int16_t* xq, const float* xd, const float* xs,
                                int64_t M, void* out, int64_t out_stride, int out_bf16, int num_threads) {
    if (n_parts < 1 || n_parts > GGUF_MAX_PARTS) return -1;
    int64_t first[GGUF_MAX_PARTS + 1], col0[GGUF_MAX_PARTS], N = 0; /* part p: global tiles first[p] .. */
    int any_q4 = 0;
    first[0] = 0;
    for (int p = 0; p < n_parts; p++) {
        col0[p] = N;
        N += Ns[p];
        first[p + 1] = first[p] + (Ns[p] + TILE - 1) / TILE;
        any_q4 |= types[p] != T_Q8_0;
    }
    const int nt = N * K * (M < 4 ? M : 4) >= 131072 ? num_threads : 1;
    int16_t* paired = NULL;
    if (any_q4) {
        paired = paired_buffer((size_t)(M * K));
        if (paired == NULL) return -1;
    }
    /* Rows in chunks of MB, each chunk over all tiles: a chunk's activations (MB x K int16) stay in L2 while
     * the thread's tiles pass, where all M rows (e.g. 256 x 1,536) would be read from L3 for every tile. The
     * result is the same (each output's block sums run in the same order in either path). */
    const int64_t mb_max = M < MB ? M : MB, nbx = K / 32, osize = out_bf16 ? 2 : 4;
    int failed = 0;
    /* Work units: pairs of tiles of a part (`two_tiles`) where the part is tiled and M is large, else one tile. */
    int64_t ufirst[GGUF_MAX_PARTS + 1];
    int upair[GGUF_MAX_PARTS];
    ufirst[0] = 0;
    for (int p = 0; p < n_parts; p++) {
        const int64_t nt_p = first[p + 1] - first[p];
        upair[p] = tiled[p] && M > TILED_FEW_ROWS && Ns[p] % (2 * TILE) == 0;
        ufirst[p + 1] = ufirst[p] + (upair[p] ? nt_p / 2 : nt_p);
    }
    const int64_t nunits = ufirst[n_parts];
#pragma omp parallel num_threads(nt)
    {
        __m512i tw[2 * PANEL * 16];
        float dv[2 * PANEL * 16] __attribute__((aligned(64))), ov[2 * PANEL * 16] __attribute__((aligned(64)));
        float* acc = aligned_alloc(64, (size_t)mb_max * 32 * 2 * sizeof(float));
        if (acc == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        if (paired != NULL) { /* the threads pair slices of whole blocks, then all wait for all */
            const int64_t nb = M * K / 32, t = omp_get_thread_num(), n = omp_get_num_threads();
            const int64_t b0 = nb * t / n, b1 = nb * (t + 1) / n;
            pair_halves(xq + b0 * 32, (b1 - b0) * 32, paired + b0 * 32);
#pragma omp barrier
        }
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            const int64_t mb = M - m0 < MB ? M - m0 : MB;
#pragma omp for schedule(static) nowait
            for (int64_t unit = 0; unit < nunits; unit++) {
                if (acc == NULL) continue;
                int p = 0;
                while (ufirst[p + 1] <= unit) p++;
                const int16_t* x = types[p] == T_Q8_0 ? xq : paired;
                void* o = (char*)out + (m0 * out_stride + col0[p]) * osize;
                if (upair[p])
                    two_tiles(types[p], ws[p], K, x + m0 * K, xd + m0 * nbx, xs + m0 * nbx, mb, o, out_stride,
                              out_bf16, 2 * (unit - ufirst[p]), acc, tw, dv, ov);
                else
                    one_tile(types[p], tiled[p], ws[p], Ns[p], K, x + m0 * K, xd + m0 * nbx, xs + m0 * nbx, mb, o,
                             out_stride, out_bf16, unit - ufirst[p], acc, tw, dv, ov);
            }
        }
        free(acc);
    }
    return failed ? -1 : 0;
}

/* For callers that run their own threads (decode_stack.c): tiles [t0, t1) of a tiled Q4_0 / Q4_1 / Q8_0 weight
 * into float32 `out`, with Q4 activations already paired (`gguf_pair_activations`); acc: M * 32 floats. */
TGT void gguf_mm_tiled_range(int type, const uint8_t* w, int64_t N, int64_t K, const int16_t* xq, const float* xd,
                             const float* xs, int64_t M, float* out, int64_t out_stride, int64_t t0, int64_t t1,
                             float* acc) {
    __m512i tw[PANEL * 16];
    float dv[PANEL * 16] __attribute__((aligned(64))), ov[PANEL * 16] __attribute__((aligned(64)));
    for (int64_t tile = t0; tile < t1; tile++) one_tile(type, 1, w, N, K, xq, xd, xs, M, out, out_stride, 0, tile, acc, tw, dv, ov);
}

TGT void gguf_pair_activations(const int16_t* x, int64_t n, int16_t* out) { pair_halves(x, n, out); }
#endif
