/* Fused elementwise layers for the CPU path: residual add + RMSNorm, rotary embedding.
 *
 * Why: in PyTorch each of these is 5-8 separate ops per layer (each a dispatch, a parallel region and a
 * pass over memory); at decode sizes that overhead, not arithmetic, is the cost. Each kernel here is one
 * pass over its rows. They reproduce PyTorch's roundings: bfloat16 results are rounded after every op
 * where PyTorch would round (HF's residual add, the normalized value before the weight product, each
 * product of the rotation), and the file is built with -ffp-contract=off so that a*b - c*d is not fused.
 *
 * Rows are [num_rows, row_stride] with contiguous columns. T is float ("f32") or uint16_t bfloat16
 * ("bf16").
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* Work below this many elements runs on one thread: a parallel region costs a few microseconds. */
#define PAR_MIN 16384

#define DEFINE_LAYERS(SUFFIX, T, LOAD, STORE, ROUND)                                                       \
    /* residual != NULL: residual = x + residual (rounded to T), x = rms_norm(residual) * w.              \
     * residual == NULL: out = rms_norm(x) * w. out may alias x. */                                        \
    void rms_norm_##SUFFIX(T* x, int64_t x_stride, T* residual, int64_t r_stride, const T* w, T* out,     \
                           int64_t o_stride, int64_t rows, int64_t cols, float eps, int num_threads) {    \
        const int nt = rows * cols >= PAR_MIN ? num_threads : 1;                                          \
        _Pragma("omp parallel for num_threads(nt) schedule(static)")                                      \
        for (int64_t r = 0; r < rows; r++) {                                                              \
            T* xr = x + r * x_stride;                                                                     \
            T* src = xr;                                                                                  \
            if (residual != NULL) {                                                                       \
                T* rr = residual + r * r_stride;                                                          \
                for (int64_t c = 0; c < cols; c++) rr[c] = STORE(LOAD(xr[c]) + LOAD(rr[c]));              \
                src = rr;                                                                                 \
            }                                                                                             \
            float ss = 0.f;                                                                               \
            _Pragma("omp simd reduction(+ : ss)") for (int64_t c = 0; c < cols; c++) {                    \
                const float v = LOAD(src[c]);                                                             \
                ss += v * v;                                                                              \
            }                                                                                             \
            const float inv = 1.f / sqrtf(ss / (float)cols + eps);                                        \
            T* orow = out + r * o_stride;                                                                 \
            _Pragma("omp simd") for (int64_t c = 0; c < cols; c++) orow[c] =                              \
                STORE(LOAD(w[c]) * ROUND(LOAD(src[c]) * inv));                                           \
        }                                                                                                 \
    }                                                                                                     \
                                                                                                          \
    /* Neox-style rotary embedding in place on q [T, nq heads] and k [T, nk heads] (row strides given,   \
     * heads of head_size contiguous). cos_sin: float32 [max_pos, rot_dim] (cos halves, then sin). */     \
    void rotary_##SUFFIX(const int64_t* positions, T* q, int64_t q_stride, int nq, T* k, int64_t k_stride, \
                         int nk, const float* cos_sin, int head_size, int rot_dim, int64_t num_tokens,    \
                         int num_threads) {                                                               \
        const int half = rot_dim / 2;                                                                     \
        const int nt = num_tokens * (nq + nk) * rot_dim >= PAR_MIN ? num_threads : 1;                     \
        _Pragma("omp parallel for num_threads(nt) schedule(static)")                                      \
        for (int64_t t = 0; t < num_tokens; t++) {                                                        \
            const float* cs = cos_sin + positions[t] * rot_dim;                                           \
            for (int hh = 0; hh < nq + nk; hh++) {                                                        \
                T* x = hh < nq ? q + t * q_stride + (int64_t)hh * head_size                               \
                               : k + t * k_stride + (int64_t)(hh - nq) * head_size;                       \
                _Pragma("omp simd") for (int i = 0; i < half; i++) {                                      \
                    const float c = ROUND(cs[i]), s = ROUND(cs[half + i]);                                \
                    const float x1 = LOAD(x[i]), x2 = LOAD(x[half + i]);                                  \
                    const float a = ROUND(x1 * c), b = ROUND(x2 * s);                                     \
                    const float d = ROUND(x2 * c), e = ROUND(x1 * s);                                     \
                    x[i] = STORE(a - b);                                                                  \
                    x[half + i] = STORE(d + e);                                                           \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \

DEFINE_LAYERS(f32, float, LOAD_F32, STORE_F32, ROUND_F32)
DEFINE_LAYERS(bf16, uint16_t, bf16_to_f32, f32_to_bf16, ROUND_BF16)
