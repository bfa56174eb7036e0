/* Matrix multiply with GGUF block-quantized weights kept packed (built by pagedllm/csrc/__init__.py).
 *
 * y[m, n] = sum_k W[n, k] * x[m, k], W in one of the GGUF block formats (the bytes of the file, row-major
 * [N, K / QK * block_bytes]), x quantized on the fly per block of 32 to int16 with a float scale (as
 * llama.cpp quantizes activations per block, but to 16 bits: its 8-bit Q8 activations moved SmolLM2's layer
 * outputs by up to 2.6% and its greedy outputs at 17 of 20 prompts, see benchmarks/NOTES.md): each block
 * product is an integer dot (AVX-512 VNNI `vpdpwssd`, or AVX2 `vpmaddwd`), scaled once per block. Scalar C is the portable fallback and the
 * reference the SIMD paths are tested against (`gguf_set_isa`). K-quant blocks are unpacked by the portable code and
 * dotted with AVX2 (`rows_kquant_avx2`).
 *
 * Formats (ggml's block layouts; `value` = dequantized weight):
 *   Q4_0 (32, 18 B): f16 d, 16 B nibbles (low = elements 0..15, high = 16..31); value = d * (q - 8)
 *   Q4_1 (32, 20 B): f16 d, f16 m, 16 B nibbles;                                 value = d * q + m
 *   Q8_0 (32, 34 B): f16 d, 32 int8;                                             value = d * q
 *   Q4_K (256, 144 B), Q5_K (256, 176 B): f16 d, f16 dmin, 12 B of 6-bit scales/mins for 8 sub-blocks of
 *     32, (Q5_K: 32 B of high bits), 128 B nibbles;                   value = d * sc_j * q - dmin * m_j
 *   Q6_K (256, 210 B): 128 B low nibbles, 64 B high 2-bit pairs, 16 int8 scales, f16 d;
 *                                                                      value = d * sc_g * (q - 32)
 * Activation blocks: xq int16 [M, K] (row stride K), xd[M, K/32] = scale, xs[M, K/32] = scale * sum(q), so a
 * weight block's additive term (Q4_1's m, the K-quants' mins, Q4_0's -8) costs one multiply per block.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "gguf_common.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define GGUF_X86 1
#endif

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };
#define ROWS_MAX 4 /* activation rows sharing one pass over a weight row */

static float fp16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    uint32_t u;
    if (exp == 0) {
        float f = (float)mant * (1.0f / 16777216.0f); /* subnormal: mant * 2^-24 */
        memcpy(&u, &f, 4);
        u |= sign;
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (mant << 13);
    } else {
        u = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t rd16(const uint8_t* p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* ---- portable path: unpack a block to int8 + per-16 scales + per-32 offsets, then integer dots ---- */
/* value[i] = sc[i / 16] * q[i] - mn[i / 32]; a K-quant block with q == NULL gives its scales only */
static void scale_min_k4(int j, const uint8_t* s, int* sc, int* mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static void unpack_block(int type, const uint8_t* b, int8_t* q, float* sc, float* mn) {
    switch (type) {
        case T_Q4_0:
        case T_Q4_1: {
            const float d = fp16_to_f32(rd16(b));
            const uint8_t* qs = b + (type == T_Q4_0 ? 2 : 4);
            const int off = type == T_Q4_0 ? 8 : 0;
            for (int i = 0; i < 16; i++) {
                q[i] = (int8_t)((qs[i] & 0xF) - off);
                q[i + 16] = (int8_t)((qs[i] >> 4) - off);
            }
            sc[0] = sc[1] = d;
            mn[0] = type == T_Q4_0 ? 0.0f : -fp16_to_f32(rd16(b + 2));
            break;
        }
        case T_Q8_0: {
            const float d = fp16_to_f32(rd16(b));
            memcpy(q, b + 2, 32);
            sc[0] = sc[1] = d;
            mn[0] = 0.0f;
            break;
        }
        case T_Q4_K:
        case T_Q5_K: {
            const float d = fp16_to_f32(rd16(b)), dmin = fp16_to_f32(rd16(b + 2));
            const uint8_t* scales = b + 4;
            const uint8_t* qh = b + 16;
            const uint8_t* qs = b + (type == T_Q4_K ? 16 : 48);
            for (int j = 0; j < 4; j++) { /* 64 elements: sub-blocks 2j (low nibbles), 2j+1 (high) */
                int s0, m0, s1, m1;
                scale_min_k4(2 * j, scales, &s0, &m0);
                scale_min_k4(2 * j + 1, scales, &s1, &m1);
                for (int l = 0; q != NULL && l < 32; l++) { /* q == NULL: the scales only */
                    int lo = qs[32 * j + l] & 0xF, hi = qs[32 * j + l] >> 4;
                    if (type == T_Q5_K) {
                        lo += (qh[l] >> (2 * j)) & 1 ? 16 : 0;
                        hi += (qh[l] >> (2 * j + 1)) & 1 ? 16 : 0;
                    }
                    q[64 * j + l] = (int8_t)lo;
                    q[64 * j + 32 + l] = (int8_t)hi;
                }
                sc[4 * j] = sc[4 * j + 1] = d * (float)s0;
                sc[4 * j + 2] = sc[4 * j + 3] = d * (float)s1;
                mn[2 * j] = dmin * (float)m0;
                mn[2 * j + 1] = dmin * (float)m1;
            }
            break;
        }
        case T_Q6_K: {
            const uint8_t* ql = b;
            const uint8_t* qh = b + 128;
            const int8_t* scales = (const int8_t*)(b + 192);
            const float d = fp16_to_f32(rd16(b + 208));
            for (int h = 0; q != NULL && h < 2; h++) {
                for (int l = 0; l < 32; l++) {
                    const uint8_t a = ql[64 * h + l], c = ql[64 * h + l + 32], hb = qh[32 * h + l];
                    q[128 * h + l] = (int8_t)(((a & 0xF) | ((hb & 3) << 4)) - 32);
                    q[128 * h + l + 32] = (int8_t)(((c & 0xF) | (((hb >> 2) & 3) << 4)) - 32);
                    q[128 * h + l + 64] = (int8_t)(((a >> 4) | (((hb >> 4) & 3) << 4)) - 32);
                    q[128 * h + l + 96] = (int8_t)(((c >> 4) | (((hb >> 6) & 3) << 4)) - 32);
                }
            }
            for (int g = 0; g < 16; g++) sc[g] = d * (float)scales[g];
            for (int j = 0; j < 8; j++) mn[j] = 0.0f;
            break;
        }
        default:
            break;
    }
}

static int block_elems(int type) { return type >= T_Q4_K ? 256 : 32; }

static int block_bytes(int type) {
    switch (type) {
        case T_Q4_0: return 18;
        case T_Q4_1: return 20;
        case T_Q8_0: return 34;
        case T_Q4_K: return 144;
        case T_Q5_K: return 176;
        case T_Q6_K: return 210;
        default: return 0;
    }
}

static inline int idot16(const int8_t* a, const int16_t* b) {
    int s = 0;
    for (int i = 0; i < 16; i++) s += (int)a[i] * (int)b[i];
    return s;
}

/* One weight row against `nm` activation rows (`xstride` elements apart; block stats `bstride` apart). */
static void rows_generic(int type, const uint8_t* w, int64_t K, const int16_t* xq, const float* xd,
                         const float* xs, int64_t xstride, int64_t bstride, int nm, float* out) {
    const int qk = block_elems(type), bb = block_bytes(type);
    const int64_t nblk = K / qk;
    float acc[ROWS_MAX] = {0};
    int8_t q[256];
    float sc[16], mn[8];
    for (int64_t b = 0; b < nblk; b++) {
        unpack_block(type, w + b * bb, q, sc, mn);
        for (int m = 0; m < nm; m++) {
            const int16_t* y = xq + m * xstride + b * qk;
            const float* yd = xd + m * bstride + b * (qk / 32);
            const float* ys = xs + m * bstride + b * (qk / 32);
            float a = 0.0f;
            for (int j = 0; j < qk / 32; j++) {
                const int s0 = idot16(q + 32 * j, y + 32 * j), s1 = idot16(q + 32 * j + 16, y + 32 * j + 16);
                a += yd[j] * (sc[2 * j] * (float)s0 + sc[2 * j + 1] * (float)s1) - mn[j] * ys[j];
            }
            acc[m] += a;
        }
    }
    for (int m = 0; m < nm; m++) out[m] = acc[m];
}

/* ---- SIMD paths for the 32-element formats -------------------------------------------------------- */
#ifdef GGUF_X86
/* The integer dot of 32 int16 weights (w0: elements 0..15, w1: 16..31) with 32 int16 activations as 8
 * int32 lanes: AVX2 `vpmaddwd`, or AVX-512 VNNI `vpdpwssd`. */
#define DOT_VNNI(w0, w1, y0, y1) _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), (w0), (y0)), (w1), (y1))
#define DOT_AVX2(w0, w1, y0, y1) _mm256_add_epi32(_mm256_madd_epi16((w0), (y0)), _mm256_madd_epi16((w1), (y1)))

/* Q4_0/Q4_1: nibbles 0..15 (Q4_0's -8 folds into the per-block offset, -8 d * xs); Q8_0: int8.
 * `rows_body_*` is instantiated for each (type, rows) pair by `rows_*` (ROWS_SWITCH), so that the block's
 * type is no branch and the per-row accumulators live in registers (a runtime row count kept them in
 * memory). */
#define ROWS_CALL(F, T, N) F(T, w, K, xq, xd, xs, xstride, bstride, N, out)
#define ROWS_SWITCH(F, T)                   \
    switch (nm) {                           \
        case 1: ROWS_CALL(F, T, 1); break;  \
        case 2: ROWS_CALL(F, T, 2); break;  \
        case 3: ROWS_CALL(F, T, 3); break;  \
        default: ROWS_CALL(F, T, 4); break; \
    }
#define DEFINE_ROWS_SIMD(ISA, TARGET, DOT)                                                               \
    __attribute__((target(TARGET))) static inline float hsum_##ISA(__m256 v) {                            \
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));                  \
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                                           \
        s = _mm_add_ss(s, _mm_movehdup_ps(s));                                                            \
        return _mm_cvtss_f32(s);                                                                          \
    }                                                                                                     \
    __attribute__((target(TARGET), always_inline)) static inline void rows_body_##ISA(                    \
        const int type, const uint8_t* w, int64_t K, const int16_t* xq, const float* xd, const float* xs, \
        int64_t xstride, int64_t bstride, const int nm, float* out) {                                     \
        const int bb = block_bytes(type);                                                                 \
        const int64_t nblk = K / 32;                                                                      \
        const __m256i m4 = _mm256_set1_epi16(0xF);                                                        \
        __m256 acc[ROWS_MAX];                                                                             \
        float off[ROWS_MAX] = {0};                                                                        \
        for (int m = 0; m < ROWS_MAX; m++) acc[m] = _mm256_setzero_ps();                                  \
        for (int64_t b = 0; b < nblk; b++) {                                                              \
            const uint8_t* blk = w + b * bb;                                                              \
            const float d = _cvtsh_ss(rd16(blk));                                                         \
            float o; /* additive term per unit of xs */                                                   \
            __m256i w0, w1;                                                                               \
            if (type == T_Q8_0) {                                                                         \
                w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + 2)));                    \
                w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + 18)));                   \
                o = 0.0f;                                                                                 \
            } else {                                                                                      \
                /* byte i = element i (low nibble) | element 16 + i (high): widened once, then split */   \
                const __m256i v = _mm256_cvtepu8_epi16(                                                   \
                    _mm_loadu_si128((const __m128i*)(blk + (type == T_Q4_0 ? 2 : 4))));                   \
                w0 = _mm256_and_si256(v, m4);                                                             \
                w1 = _mm256_srli_epi16(v, 4);                                                             \
                o = type == T_Q4_0 ? -8.0f * d : _cvtsh_ss(rd16(blk + 2));                                \
            }                                                                                             \
            for (int m = 0; m < nm; m++) {                                                                \
                const int16_t* y = xq + m * xstride + b * 32;                                             \
                const __m256i y0 = _mm256_loadu_si256((const __m256i*)y);                                 \
                const __m256i y1 = _mm256_loadu_si256((const __m256i*)(y + 16));                          \
                const __m256 p = _mm256_cvtepi32_ps(DOT(w0, w1, y0, y1));                                 \
                acc[m] = _mm256_fmadd_ps(p, _mm256_set1_ps(d * xd[m * bstride + b]), acc[m]);             \
                off[m] += o * xs[m * bstride + b];                                                        \
            }                                                                                             \
        }                                                                                                 \
        for (int m = 0; m < nm; m++) out[m] = hsum_##ISA(acc[m]) + off[m];                                \
    }                                                                                                     \
    __attribute__((target(TARGET))) static void rows_##ISA(int type, const uint8_t* w, int64_t K,         \
                                                           const int16_t* xq, const float* xd,            \
                                                           const float* xs, int64_t xstride,              \
                                                           int64_t bstride, int nm, float* out) {         \
        if (type == T_Q4_0) {                                                                             \
            ROWS_SWITCH(rows_body_##ISA, T_Q4_0)                                                          \
        } else if (type == T_Q4_1) {                                                                      \
            ROWS_SWITCH(rows_body_##ISA, T_Q4_1)                                                          \
        } else {                                                                                          \
            ROWS_SWITCH(rows_body_##ISA, T_Q8_0)                                                          \
        }                                                                                                 \
    }

DEFINE_ROWS_SIMD(avx2, "avx2,fma,f16c", DOT_AVX2)
DEFINE_ROWS_SIMD(vnni, "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni", DOT_VNNI)

/* A K-quant block's 256 quants as int16, 16 per register, in element order (`unpack_block`'s q, widened). */
__attribute__((target("avx2"))) static inline void kquant_quants_avx2(int type, const uint8_t* b, __m256i* wq) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    __m256i v[8]; /* 32 int8 quants each */
    if (type == T_Q6_K) {
        const __m256i m30 = _mm256_set1_epi8(0x30), k32 = _mm256_set1_epi8(32);
        for (int h = 0; h < 2; h++) {
            const __m256i a = _mm256_loadu_si256((const __m256i*)(b + 64 * h));
            const __m256i c = _mm256_loadu_si256((const __m256i*)(b + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h));
            const __m256i hi2[4] = {_mm256_slli_epi16(hb, 4), _mm256_slli_epi16(hb, 2), hb, _mm256_srli_epi16(hb, 2)};
            const __m256i lo4[4] = {a, c, _mm256_srli_epi16(a, 4), _mm256_srli_epi16(c, 4)};
            for (int i = 0; i < 4; i++)
                v[4 * h + i] = _mm256_sub_epi8(
                    _mm256_or_si256(_mm256_and_si256(lo4[i], m4), _mm256_and_si256(hi2[i], m30)), k32);
        }
    } else { /* Q4_K / Q5_K: 32 bytes of nibbles per 64 elements (low nibbles first); Q5_K's fifth bits */
        const uint8_t* qs = b + (type == T_Q4_K ? 16 : 48);
        const __m256i qh = _mm256_loadu_si256((const __m256i*)(b + 16)), k16 = _mm256_set1_epi8(16);
        for (int j = 0; j < 4; j++) {
            const __m256i x = _mm256_loadu_si256((const __m256i*)(qs + 32 * j));
            v[2 * j] = _mm256_and_si256(x, m4);
            v[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
            if (type == T_Q5_K) {
                for (int t = 0; t < 2; t++) {
                    const __m256i bit = _mm256_set1_epi8((char)(1 << (2 * j + t)));
                    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
                    v[2 * j + t] = _mm256_add_epi8(v[2 * j + t], _mm256_and_si256(set, k16));
                }
            }
        }
    }
    for (int i = 0; i < 8; i++) {
        wq[2 * i] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v[i]));
        wq[2 * i + 1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v[i], 1));
    }
}

/* K-quants (256-element blocks): each block's scales come from `unpack_block` (portable), its quants are
 * widened to int16 in registers (`kquant_quants_avx2`), then every activation row takes its integer dots with `vpmaddwd`, 32 elements per
 * sub-block, scaled per 16 (Q6_K) or per 32 (Q4_K / Q5_K, whose two halves share a scale). */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void rows_kquant_body(
    const int type, const uint8_t* w, int64_t K, const int16_t* xq, const float* xd, const float* xs, int64_t xstride,
    int64_t bstride, const int nm, float* out) {
    const int bb = block_bytes(type), per16 = type == T_Q6_K;
    const int64_t nblk = K / 256;
    __m256 acc[ROWS_MAX];
    float off[ROWS_MAX] = {0};
    for (int m = 0; m < ROWS_MAX; m++) acc[m] = _mm256_setzero_ps();
    float sc[16], mn[8];
    for (int64_t b = 0; b < nblk; b++) {
        unpack_block(type, w + b * bb, NULL, sc, mn);
        __m256i wq[16];
        kquant_quants_avx2(type, w + b * bb, wq);
        for (int m = 0; m < nm; m++) {
            const int16_t* y = xq + m * xstride + b * 256;
            const float* yd = xd + m * bstride + b * 8;
            const float* ys = xs + m * bstride + b * 8;
            for (int j = 0; j < 8; j++) {
                const __m256i p0 = _mm256_madd_epi16(wq[2 * j], _mm256_loadu_si256((const __m256i*)(y + 32 * j)));
                const __m256i p1 =
                    _mm256_madd_epi16(wq[2 * j + 1], _mm256_loadu_si256((const __m256i*)(y + 32 * j + 16)));
                if (per16) {
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(yd[j] * sc[2 * j]), acc[m]);
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(yd[j] * sc[2 * j + 1]), acc[m]);
                } else {
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)),
                                             _mm256_set1_ps(yd[j] * sc[2 * j]), acc[m]);
                }
                off[m] -= mn[j] * ys[j];
            }
        }
    }
    for (int m = 0; m < nm; m++) out[m] = hsum_avx2(acc[m]) + off[m];
}

__attribute__((target("avx2,fma,f16c"))) static void rows_kquant_avx2(int type, const uint8_t* w, int64_t K,
                                                                    const int16_t* xq, const float* xd,
                                                                    const float* xs, int64_t xstride,
                                                                    int64_t bstride, int nm, float* out) {
    if (type == T_Q4_K) {
        ROWS_SWITCH(rows_kquant_body, T_Q4_K)
    } else if (type == T_Q5_K) {
        ROWS_SWITCH(rows_kquant_body, T_Q5_K)
    } else {
        ROWS_SWITCH(rows_kquant_body, T_Q6_K)
    }
}
#endif

/* ---- ISA selection (tests force each level) ----------------------------------------------------- */
static int g_isa = -1; /* 0 portable, 1 AVX2, 2 AVX-512 VNNI */

static int isa_supported(void) {
#ifdef GGUF_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma"))
        return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma")) return 1;
#endif
    return 0;
}

/* Selects the ISA level (-1: the best this CPU has); returns the level in use (never above the CPU's). */
int gguf_set_isa(int level) {
    const int best = isa_supported();
    g_isa = (level < 0 || level > best) ? best : level;
    return g_isa;
}

int gguf_block_bytes(int type) { return block_bytes(type); }

static int g_tile = 1; /* AVX-512 VNNI: the column-tile kernel (gguf_tile.c) instead of the row kernels */

/* Turns the column-tile kernel on or off (benchmarks and tests compare both; -1: no change); returns the
 * previous setting. */
int gguf_set_tile(int on) {
    const int prev = g_tile;
    if (on >= 0) g_tile = on != 0;
    return prev;
}

/* The ISA level in use (gguf_set_isa's). */
int gguf_isa(void) {
    if (g_isa < 0) gguf_set_isa(-1);
    return g_isa;
}

/* gguf_tile.c: the AVX-512 VNNI kernel for the 32-element formats (output columns along the lanes) and its
 * tiled weight layout, flagged by GGUF_TILED in the type. */
int gguf_tile_unpack(int type, const uint8_t* tiled, int64_t N, int64_t K, uint8_t* dst);
#ifdef GGUF_X86
int gguf_mm_tile_vnni_parts(int n_parts, const int* types, const int* tiled, const uint8_t* const* ws,
                            const int64_t* Ns, int64_t K, const int16_t* xq, const float* xd, const float* xs,
                            int64_t M, void* out, int64_t out_stride, int out_bf16, int num_threads);
static int gguf_mm_tile_vnni(int type, int tiled, const uint8_t* w, int64_t N, int64_t K, const int16_t* xq,
                             const float* xd, const float* xs, int64_t M, void* out, int64_t out_stride, int out_bf16,
                             int num_threads) {
    return gguf_mm_tile_vnni_parts(1, &type, &tiled, &w, &N, K, xq, xd, xs, M, out, out_stride, out_bf16,
                                   num_threads);
}
#endif

/* A tiled weight's bytes back in the file's layout (malloc'd; NULL when out of memory), for the kernels that
 * read the file's blocks. */
static uint8_t* untiled_copy(int base, const uint8_t* w, int64_t N, int64_t K) {
    uint8_t* file = malloc((size_t)(N * (K / 32) * block_bytes(base)));
    if (file != NULL && gguf_tile_unpack(base, w, N, K, file) != 0) {
        free(file);
        return NULL;
    }
    return file;
}

/* out[m * out_stride + n] (float32, or bfloat16 when out_bf16) for n < N, m < M. Rows of W are split
 * across threads in chunks; each chunk stays in cache while every group of ROWS_MAX activation rows
 * passes over it. Returns 0, or -1 for a type or K the kernels do not take. */
int gguf_mm(int type, const uint8_t* w, int64_t N, int64_t K, const int16_t* xq, const float* xd,
            const float* xs, int64_t M, void* out, int64_t out_stride, int out_bf16, int num_threads) {
    if (g_isa < 0) gguf_set_isa(-1);
    if (type & GGUF_TILED) { /* gguf_tile_pack's layout: its kernel, or the file's layout back for the others */
        const int base = type & ~GGUF_TILED;
        if ((base != T_Q4_0 && base != T_Q4_1 && base != T_Q8_0) || K % 32 != 0) return -1;
#ifdef GGUF_X86
        if (g_isa == 2 && g_tile)
            return gguf_mm_tile_vnni(base, 1, w, N, K, xq, xd, xs, M, out, out_stride, out_bf16, num_threads);
#endif
        uint8_t* file = untiled_copy(base, w, N, K);
        if (file == NULL) return -1;
        const int rc = gguf_mm(base, file, N, K, xq, xd, xs, M, out, out_stride, out_bf16, num_threads);
        free(file);
        return rc;
    }
    const int bb = block_bytes(type);
    if (bb == 0 || K % block_elems(type) != 0) return -1;
#ifdef GGUF_X86
    if (g_isa == 2 && g_tile && block_elems(type) == 32)
        return gguf_mm_tile_vnni(type, 0, w, N, K, xq, xd, xs, M, out, out_stride, out_bf16, num_threads);
#endif
    const int simd = g_isa > 0 && block_elems(type) == 32, kquant_simd = g_isa > 0 && block_elems(type) == 256;
    const int64_t row_bytes = K / block_elems(type) * bb, nbx = K / 32;
    const int64_t chunk = 16, nchunks = (N + chunk - 1) / chunk;
    const int nt = N * K * (M < 4 ? M : 4) >= 131072 ? num_threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t c = 0; c < nchunks; c++) {
        const int64_t n1 = (c + 1) * chunk < N ? (c + 1) * chunk : N;
        for (int64_t m0 = 0; m0 < M; m0 += ROWS_MAX) {
            const int nm = M - m0 < ROWS_MAX ? (int)(M - m0) : ROWS_MAX;
            const int16_t* y = xq + m0 * K;
            const float* yd = xd + m0 * nbx;
            const float* ys = xs + m0 * nbx;
            for (int64_t n = c * chunk; n < n1; n++) {
                float r[ROWS_MAX];
                const uint8_t* wr = w + n * row_bytes;
#ifdef GGUF_X86
                if (simd && g_isa == 2)
                    rows_vnni(type, wr, K, y, yd, ys, K, nbx, nm, r);
                else if (simd)
                    rows_avx2(type, wr, K, y, yd, ys, K, nbx, nm, r);
                else if (kquant_simd)
                    rows_kquant_avx2(type, wr, K, y, yd, ys, K, nbx, nm, r);
                else
#endif
                    rows_generic(type, wr, K, y, yd, ys, K, nbx, nm, r);
                for (int i = 0; i < nm; i++) {
                    const int64_t at = (m0 + i) * out_stride + n;
                    if (out_bf16)
                        ((uint16_t*)out)[at] = f32_to_bf16(r[i]);
                    else
                        ((float*)out)[at] = r[i];
                }
            }
        }
    }
    return 0;
}

/* Up to GGUF_MAX_PARTS weights stacked by output rows (a fused q/k/v or gate/up projection), each of its own type as in
 * gguf_mm, in one call: part p fills output columns from the sum of the earlier parts' Ns. With the VNNI tile
 * kernel for every part, one parallel region runs all parts' tiles (activations paired once); else part by
 * part. Returns 0, or -1 as gguf_mm. */
int gguf_mm_parts(int n_parts, const int* types, const uint8_t* const* ws, const int64_t* Ns, int64_t K,
                  const int16_t* xq, const float* xd, const float* xs, int64_t M, void* out, int64_t out_stride,
                  int out_bf16, int num_threads) {
    if (g_isa < 0) gguf_set_isa(-1);
    if (n_parts < 1 || n_parts > GGUF_MAX_PARTS) return -1;
#ifdef GGUF_X86
    if (g_isa == 2 && g_tile && K % 32 == 0) {
        int base[GGUF_MAX_PARTS], tiled[GGUF_MAX_PARTS], ok = 1;
        for (int p = 0; p < n_parts; p++) {
            base[p] = types[p] & ~GGUF_TILED;
            tiled[p] = (types[p] & GGUF_TILED) != 0;
            ok &= base[p] == T_Q4_0 || base[p] == T_Q4_1 || base[p] == T_Q8_0;
        }
        if (ok)
            return gguf_mm_tile_vnni_parts(n_parts, base, tiled, ws, Ns, K, xq, xd, xs, M, out, out_stride, out_bf16,
                                           num_threads);
    }
#endif
    int64_t col = 0;
    for (int p = 0; p < n_parts; p++) {
        const int rc = gguf_mm(types[p], ws[p], Ns[p], K, xq, xd, xs, M, (char*)out + col * (out_bf16 ? 2 : 4),
                               out_stride, out_bf16, num_threads);
        if (rc != 0) return rc;
        col += Ns[p];
    }
    return 0;
}

/* Dequantizes rows [0, N) of W to float32 out[N, K] (the tests' and the no-SIMD prefill's reference). */
int gguf_dequantize(int type, const uint8_t* w, int64_t N, int64_t K, float* out, int num_threads) {
    if (type & GGUF_TILED) {
        const int base = type & ~GGUF_TILED;
        uint8_t* file = untiled_copy(base, w, N, K);
        const int rc = file == NULL ? -1 : gguf_dequantize(base, file, N, K, out, num_threads);
        free(file);
        return rc;
    }
    const int bb = block_bytes(type), qk = block_elems(type);
    if (bb == 0 || K % qk != 0) return -1;
    const int64_t row_bytes = K / qk * bb;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        int8_t q[256];
        float sc[16], mn[8];
        for (int64_t b = 0; b < K / qk; b++) {
            unpack_block(type, w + n * row_bytes + b * bb, q, sc, mn);
            for (int i = 0; i < qk; i++) out[n * K + b * qk + i] = sc[i / 16] * (float)q[i] - mn[i / 32];
        }
    }
    return 0;
}
