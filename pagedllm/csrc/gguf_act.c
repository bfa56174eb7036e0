/* Activation quantization for the GGUF kernels (gguf_mm.c, gguf_tile.c, decode_stack.c; built by
 * pagedllm/csrc/__init__.py): x [M, K] float32 or bfloat16 (row stride x_stride) -> xq int16 [M, K],
 * xd [M, K / 32] = each block's scale, xs [M, K / 32] = scale * sum(q), so that a weight block's additive term
 * costs one multiply per block. 16-bit, not llama.cpp's 8-bit Q8 activations: with 8 bits the SmolLM2 GGUF's
 * greedy outputs matched the dequantized float32 model at 4 of 20 prompts (16 bits: 20 of 20; NOTES, session 25).
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

/* ---- activation quantization -------------------------------------------------------------------
 * Per block of 32: d = amax / 32767, q = roundf(x / d) (round half away from zero), xs = d * sum(q). The AVX2
 * body computes the same floats and the same roundf, 8 lanes at a time (the scalar loop, roundf a libm call,
 * ran at ~0.23 G elements/s: 7 ms of a batch-16 decode step of SmolLM2, 3 s of an 8,000-token prefill). */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__AVX512F__)
/* AVX-512: the AVX2 body's floats and rounding, 16 lanes at a time (a block is two vectors; 1.5-2x the AVX2
 * body, whose 8-lane loop was ~2 % of an 8,000-token prefill). */
#include <immintrin.h>
static inline __m512 load16_f32(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

/* roundf(y) exactly, as int32: trunc(y), plus sign(y) where |y - trunc(y)| >= 0.5 (the difference is exact). */
static inline __m512i round_half_away(__m512 y) {
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    const __m512 t = _mm512_roundscale_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m512 diff = _mm512_castsi512_ps(_mm512_andnot_si512(sign, _mm512_castps_si512(_mm512_sub_ps(y, t))));
    const __mmask16 half = _mm512_cmp_ps_mask(diff, _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    const __m512 step = _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_castps_si512(_mm512_set1_ps(1.0f)), _mm512_and_si512(_mm512_castps_si512(y), sign)));
    return _mm512_cvttps_epi32(_mm512_mask_add_ps(t, half, t, step));
}

#define QUANT_BLOCK(SUFFIX, T)                                                                                 \
    static inline void quant_block_##SUFFIX(const T* xr, int16_t* q, float* xd, float* xs) {                 \
        const __m512i sign = _mm512_set1_epi32((int)0x80000000u);                                             \
        __m512 v[2], m = _mm512_setzero_ps();                                                                 \
        for (int i = 0; i < 2; i++) {                                                                         \
            v[i] = load16_##SUFFIX(xr + 16 * i);                                                              \
            m = _mm512_max_ps(m, _mm512_castsi512_ps(_mm512_andnot_si512(sign, _mm512_castps_si512(v[i])))); \
        }                                                                                                     \
        const float amax = _mm512_reduce_max_ps(m), d = amax / 32767.0f, id = d != 0.0f ? 1.0f / d : 0.0f;    \
        const __m512i r0 = round_half_away(_mm512_mul_ps(v[0], _mm512_set1_ps(id)));                          \
        const __m512i r1 = round_half_away(_mm512_mul_ps(v[1], _mm512_set1_ps(id)));                          \
        _mm256_storeu_si256((__m256i*)q, _mm512_cvtsepi32_epi16(r0)); /* saturating, as packs */              \
        _mm256_storeu_si256((__m256i*)(q + 16), _mm512_cvtsepi32_epi16(r1));                                  \
        *xd = d;                                                                                              \
        *xs = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(r0, r1));                                   \
    }
#elif (defined(__x86_64__) || defined(__i386__)) && defined(__AVX2__)
#include <immintrin.h>
static inline __m256 load8_f32(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

/* roundf(y) exactly, as int32: trunc(y), plus sign(y) where |y - trunc(y)| >= 0.5 (the difference is exact). */
static inline __m256i round_half_away(__m256 y) {
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    const __m256 t = _mm256_round_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 half = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(y, t)), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    const __m256 step = _mm256_or_ps(_mm256_set1_ps(1.0f), _mm256_and_ps(y, sign));
    return _mm256_cvttps_epi32(_mm256_add_ps(t, _mm256_and_ps(half, step)));
}

#define QUANT_BLOCK(SUFFIX, T)                                                                                 \
    static inline void quant_block_##SUFFIX(const T* xr, int16_t* q, float* xd, float* xs) {                 \
        const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));                       \
        __m256 v[4], m = _mm256_setzero_ps();                                                                 \
        for (int i = 0; i < 4; i++) {                                                                         \
            v[i] = load8_##SUFFIX(xr + 8 * i);                                                                \
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));                                               \
        }                                                                                                     \
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));                        \
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));                                                               \
        h = _mm_max_ss(h, _mm_movehdup_ps(h));                                                                \
        const float amax = _mm_cvtss_f32(h), d = amax / 32767.0f, id = d != 0.0f ? 1.0f / d : 0.0f;          \
        __m256i r[4], s = _mm256_setzero_si256();                                                             \
        for (int i = 0; i < 4; i++) {                                                                         \
            r[i] = round_half_away(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));                                  \
            s = _mm256_add_epi32(s, r[i]);                                                                    \
        }                                                                                                     \
        for (int i = 0; i < 2; i++) /* packs interleaves 128-bit halves; the permute restores the order */    \
            _mm256_storeu_si256((__m256i*)(q + 16 * i),                                                       \
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(r[2 * i], r[2 * i + 1]), 0xD8));  \
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));                \
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));                                                  \
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));                                                  \
        *xd = d;                                                                                              \
        *xs = d * (float)_mm_cvtsi128_si32(s4);                                                               \
    }
#else
#define QUANT_BLOCK(SUFFIX, T)                                                                                 \
    static inline void quant_block_##SUFFIX(const T* xr, int16_t* q, float* xd, float* xs) {                 \
        float v[32], amax = 0.0f;                                                                             \
        for (int i = 0; i < 32; i++) {                                                                        \
            v[i] = LOAD_##SUFFIX(xr[i]);                                                                      \
            amax = fmaxf(amax, fabsf(v[i]));                                                                  \
        }                                                                                                     \
        const float d = amax / 32767.0f, id = d != 0.0f ? 1.0f / d : 0.0f;                                   \
        int sum = 0;                                                                                          \
        for (int i = 0; i < 32; i++) {                                                                        \
            const int qi = (int)roundf(v[i] * id);                                                            \
            q[i] = (int16_t)qi;                                                                               \
            sum += qi;                                                                                        \
        }                                                                                                     \
        *xd = d;                                                                                              \
        *xs = d * (float)sum;                                                                                 \
    }
#define LOAD_f32(x) (x)
#define LOAD_bf16(x) bf16_to_f32(x)
#endif

#define DEFINE_QUANT(SUFFIX, T)                                                                                \
    QUANT_BLOCK(SUFFIX, T)                                                                                    \
    void gguf_quantize_act_##SUFFIX(const T* x, int64_t x_stride, int64_t M, int64_t K, int16_t* xq,         \
                                   float* xd, float* xs, int num_threads) {                                  \
        const int64_t nb = K / 32;                                                                           \
        const int nt = M * K >= 262144 ? num_threads : 1;                                                    \
        _Pragma("omp parallel for num_threads(nt) schedule(static)") for (int64_t m = 0; m < M; m++) {       \
            for (int64_t b = 0; b < nb; b++)                                                                 \
                quant_block_##SUFFIX(x + m * x_stride + b * 32, xq + m * K + b * 32, xd + m * nb + b,        \
                                     xs + m * nb + b);                                                        \
        }                                                                                                    \
    }
DEFINE_QUANT(f32, float)
DEFINE_QUANT(bf16, uint16_t)
