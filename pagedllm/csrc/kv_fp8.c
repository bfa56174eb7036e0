/* FP8 KV cache (see fp8.h): the quantizing cache write.
 *
 * Not built with -ffast-math (unlike paged_attn.c): the write must round exactly as the PyTorch path,
 * kv_quant.quantize: x.float() / scale (a true float32 division, not a product with a reciprocal), clamped
 * to +-max of the format, then torch's float -> FP8 conversion (round to nearest-even, c10's
 * fp8e4m3fn_from_fp32_value / fp8e5m2_from_fp32_value, ported below: its rounding of subnormals adds a magic
 * float, which reassociation would break). */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "fp8.h"

/* c10's fp8e4m3fn_from_fp32_value (torch 2.13): round to nearest-even, saturating at 448, NaN -> 0x7f. Its
 * three cases are computed on every element and selected (no branches, so that the row loops vectorise: a
 * 4,000-token write took 2.5x torch's time with c10's branches). */
static inline uint8_t f32_to_e4m3fn(float f) {
    const uint32_t fp8_max = UINT32_C(1087) << 20;     /* 480.0f, the first value past the range */
    const uint32_t denorm_mask = UINT32_C(141) << 23; /* ((127 - 7) + (23 - 3) + 1) */
    uint32_t u = f32_bits(f);
    const uint32_t sign = u & UINT32_C(0x80000000);
    u ^= sign;
    /* below 2^-6, the smallest normal: the float adder rounds the value into the low bits */
    const uint32_t sub = f32_bits(f32_from_bits(u) + f32_from_bits(denorm_mask)) - denorm_mask;
    uint32_t nrm = (u + ((uint32_t)(7 - 127) << 23) + 0x7FFFF + ((u >> 20) & 1)) >> 20; /* rebias, round */
    nrm = (nrm & 0xff) == 0x7f ? 0x7e : nrm; /* a carry into the NaN code saturates */
    const uint32_t big = u > UINT32_C(0x7F800000) ? 0x7f : 0x7e;
    const uint32_t r = u >= fp8_max ? big : (u < (UINT32_C(121) << 23) ? sub : nrm);
    return (uint8_t)(r | (sign >> 24));
}

/* c10's fp8e5m2_from_fp32_value: round to nearest-even, inf past the range, NaN -> 0x7f (selected likewise). */
static inline uint8_t f32_to_e5m2(float f) {
    const uint32_t fp32_inf = UINT32_C(255) << 23;
    const uint32_t fp8_max = UINT32_C(143) << 23;     /* 65536.0f */
    const uint32_t denorm_mask = UINT32_C(134) << 23; /* ((127 - 15) + (23 - 2) + 1) */
    uint32_t u = f32_bits(f);
    const uint32_t sign = u & UINT32_C(0x80000000);
    u ^= sign;
    const uint32_t sub = f32_bits(f32_from_bits(u) + f32_from_bits(denorm_mask)) - denorm_mask; /* below 2^-14 */
    const uint32_t nrm = (u + ((uint32_t)(15 - 127) << 23) + 0xFFFFF + ((u >> 21) & 1)) >> 21;
    const uint32_t big = u > fp32_inf ? 0x7F : 0x7C;
    const uint32_t r = u >= fp8_max ? big : (u < (UINT32_C(113) << 23) ? sub : nrm);
    return (uint8_t)(r | (sign >> 24));
}

/* kv_quant.quantize: x / scale, clamped to +-max (a NaN stays a NaN, as torch's clamp), then converted. */
static inline uint8_t quant_e4m3fn(float x, float scale) {
    float y = x / scale;
    y = y < -448.f ? -448.f : (y > 448.f ? 448.f : y);
    return f32_to_e4m3fn(y);
}

static inline uint8_t quant_e5m2(float x, float scale) {
    float y = x / scale;
    y = y < -57344.f ? -57344.f : (y > 57344.f ? 57344.f : y);
    return f32_to_e5m2(y);
}

/* Each new token's K and V rows quantized into its cache slot, with the layer's K or V scale (DEFINE_CACHE_WRITE
 * in bf16.h; the float32 / bfloat16 caches' writes are in paged_attn.c). */
#define Q_E4M3_F32(x, kv) quant_e4m3fn(LOAD_F32(x), kv##_scale)
#define Q_E5M2_F32(x, kv) quant_e5m2(LOAD_F32(x), kv##_scale)
#define Q_E4M3_BF16(x, kv) quant_e4m3fn(bf16_to_f32(x), kv##_scale)
#define Q_E5M2_BF16(x, kv) quant_e5m2(bf16_to_f32(x), kv##_scale)
DEFINE_CACHE_WRITE(f32_kfp8e4m3, float, uint8_t, Q_E4M3_F32, , float k_scale, float v_scale)
DEFINE_CACHE_WRITE(f32_kfp8e5m2, float, uint8_t, Q_E5M2_F32, , float k_scale, float v_scale)
DEFINE_CACHE_WRITE(bf16_kfp8e4m3, uint16_t, uint8_t, Q_E4M3_BF16, , float k_scale, float v_scale)
DEFINE_CACHE_WRITE(bf16_kfp8e5m2, uint16_t, uint8_t, Q_E5M2_BF16, , float k_scale, float v_scale)
