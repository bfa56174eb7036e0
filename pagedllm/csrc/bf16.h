/* bfloat16 <-> float32 for the CPU kernels: bfloat16 is stored as uint16_t (the top half of a float32);
 * rounding to nearest-even, as torch does. */
#pragma once
#include <stdint.h>
#include <string.h>

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float bf16_to_f32(uint16_t x) { return f32_from_bits((uint32_t)x << 16); }

/* Branch-free, so that loops of it vectorise. */
static inline uint16_t f32_to_bf16(float f) {
    const uint32_t u = f32_bits(f);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = (u >> 16) | 0x40u; /* NaN stays NaN */
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

#define ROUND_F32(x) (x)
#define ROUND_BF16(x) bf16_to_f32(f32_to_bf16(x)) /* round a float to bfloat16 and back */
#define AS_IS(x) (x) /* no conversion (a kernel macro's element-type parameter where types match) */
#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)

/* Write each new token's K and V rows ([T, kvh, hd] of T, token stride given, heads contiguous) to its cache
 * slot (rows of C); slot < 0 means "padding, skip". CONV(x, kv) converts one element, kv being k or v (so that a
 * quantizing write can name k_scale / v_scale); the variadic part is extra parameters after `row`
 * (paged_attn.c: float32 / bfloat16 caches; kv_fp8.c: FP8 caches with their scales). */
#define DEFINE_CACHE_WRITE(SUFFIX, T, C, CONV, ...)                                                          \
    void reshape_and_cache_##SUFFIX(const T* key, int64_t k_stride_t, const T* value, int64_t v_stride_t,   \
                                    C* k_cache, C* v_cache, const int64_t* slots, int64_t num_tokens,       \
                                    int64_t row __VA_ARGS__) {                                              \
        for (int64_t i = 0; i < num_tokens; i++) {                                                          \
            const int64_t s = slots[i];                                                                     \
            if (s < 0) continue;                                                                            \
            const T* k = key + i * k_stride_t;                                                              \
            const T* v = value + i * v_stride_t;                                                            \
            C* kc = k_cache + s * row;                                                                      \
            C* vc = v_cache + s * row;                                                                      \
            for (int64_t e = 0; e < row; e++) kc[e] = CONV(k[e], k);                                        \
            for (int64_t e = 0; e < row; e++) vc[e] = CONV(v[e], v);                                        \
        }                                                                                                   \
    }
