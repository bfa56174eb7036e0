/* bfloat16 <-> float32 for the CPU kernels: bfloat16 is stored as uint16_t (the top half of a float32);
 * rounding to nearest-even, as torch does. */
#pragma once
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define ROUND_F32(x) (x)
#define ROUND_BF16(x) bf16_to_f32(f32_to_bf16(x)) /* round a float to bfloat16 and back */
#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
