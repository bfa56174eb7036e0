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

/* Branch-free, so that loops of it vectorise. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = (u >> 16) | 0x40u; /* NaN stays NaN */
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

#define ROUND_F32(x) (x)
#define ROUND_BF16(x) bf16_to_f32(f32_to_bf16(x)) /* round a float to bfloat16 and back */
#define AS_IS(x) (x) /* no conversion (a kernel macro's element-type parameter where types match) */
#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
