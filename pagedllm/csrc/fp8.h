/* FP8 KV-cache elements (kv_cache_dtype="fp8" / "fp8_e4m3" / "fp8_e5m2", attention/kv_quant.py), stored as
 * uint8_t: each code's exact value as torch reads it (e4m3fn's 0x7f / 0xff are NaN, it has no infinity; e5m2's
 * 0x7c / 0xfc are +-inf, 0x7d-0x7f / 0xfd-0xff NaN). The cache holds fp8(x / scale) with one float32 scale per
 * layer for K and one for V; the decode kernels fold the K scale into the query scale and apply the V scale to
 * the output. The quantizing write is in kv_fp8.c. */
#pragma once
#include <stdint.h>

#include "bf16.h" /* f32_bits, f32_from_bits */

/* The value computed branch-free from the code's bits (integer shifts and selects, one int -> float conversion
 * for subnormals: exact under -ffast-math, and no float32 denormal is involved), rather than read from a
 * 256-entry table: this vectorises, where a table load is a gather (one decode over 640 keys took 2.7x the
 * bfloat16 cache's time with tables, 1.7x with this). tests/attention/test_cpu_paged_attn_fp8.py checks every
 * code against torch. */
static inline float e4m3fn_to_f32(uint8_t b) {
    const uint32_t em = b & 0x7fu, sign = (uint32_t)(b & 0x80u) << 24;
    const float sub = (float)(int32_t)em * 0x1p-9f; /* exponent 0: m * 2^-9 */
    const uint32_t nrm = (em << 20) + (UINT32_C(120) << 23); /* (1 + m / 8) * 2^(e - 7) */
    uint32_t u = em < 8 ? f32_bits(sub) : nrm;
    u = em == 0x7fu ? UINT32_C(0x7fc00000) : u; /* S.1111.111: NaN */
    return f32_from_bits(u | sign);
}

static inline float e5m2_to_f32(uint8_t b) {
    const uint32_t em = b & 0x7fu, sign = (uint32_t)(b & 0x80u) << 24;
    const float sub = (float)(int32_t)em * 0x1p-16f; /* exponent 0: m * 2^-16 */
    const uint32_t nrm = (em << 21) + (UINT32_C(112) << 23); /* (1 + m / 4) * 2^(e - 15) */
    uint32_t u = em < 4 ? f32_bits(sub) : nrm;
    u = em >= 0x7cu ? (em << 21) | UINT32_C(0x7f800000) : u; /* exponent 31: inf (m == 0) or NaN */
    return f32_from_bits(u | sign);
}

#define LOAD_E4M3(x) e4m3fn_to_f32(x)
#define LOAD_E5M2(x) e5m2_to_f32(x)

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
/* 16 codes -> 16 floats through the float16 converter (vcvtph2ps is exact, subnormals, inf and NaN included):
 * an e5m2 code is the top byte of a float16; an e4m3fn code, shifted into a float16's exponent and mantissa,
 * is its value / 256 (S.EEEE.MMM -> S.0EEEE.MMM0000000: exponent bias 15 for 7). */
static inline __m512 e5m2x16_to_f32(const uint8_t* p) {
    const __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p)), 8);
    return _mm512_cvtph_ps(h);
}

static inline __m512 e4m3fnx16_to_f32(const uint8_t* p) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
    const __m256i em = _mm256_and_si256(b, _mm256_set1_epi16(0x7f));
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
    const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(_mm256_slli_epi16(em, 7), sign)),
                                   _mm512_set1_ps(256.f));
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(em, _mm256_set1_epi16(0x7f)); /* S.1111.111 */
    return _mm512_mask_mov_ps(v, nan, _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
}

/* A row of n codes to floats: 16 at a time, the scalar conversion for the tail. */
#define FP8_ROW(NAME, VEC, SCALAR)                                                                             \
    static inline void NAME(const uint8_t* src, float* dst, int n) {                                           \
        int e = 0;                                                                                             \
        for (; e + 16 <= n; e += 16) _mm512_storeu_ps(dst + e, VEC(src + e));                                  \
        for (; e < n; e++) dst[e] = SCALAR(src[e]);                                                            \
    }
#else
#define FP8_ROW(NAME, VEC, SCALAR)                                                                             \
    static inline void NAME(const uint8_t* src, float* dst, int n) {                                           \
        for (int e = 0; e < n; e++) dst[e] = SCALAR(src[e]);                                                   \
    }
#endif
FP8_ROW(e4m3fn_row_to_f32, e4m3fnx16_to_f32, e4m3fn_to_f32)
FP8_ROW(e5m2_row_to_f32, e5m2x16_to_f32, e5m2_to_f32)
