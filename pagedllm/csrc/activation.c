/* SiLU-and-mul for the CPU path (see layers.c for why fused kernels). Built with -ffast-math so that
 * expf vectorises (glibc libmvec); the silu value is rounded to T before the product, as
 * F.silu(gate) * up rounds it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define PAR_MIN 16384

#define DEFINE_SILU(SUFFIX, T, LOAD, STORE, ROUND)                                                         \
    /* out[r, :d] = silu(x[r, :d]) * x[r, d:2d] (silu rounded to T first, as F.silu(...) * ... does). */  \
    void silu_and_mul_##SUFFIX(const T* x, int64_t x_stride, T* out, int64_t o_stride, int64_t rows,      \
                               int64_t d, int num_threads) {                                              \
        const int nt = rows * d >= PAR_MIN ? num_threads : 1;                                             \
        _Pragma("omp parallel for num_threads(nt) schedule(static)")                                      \
        for (int64_t r = 0; r < rows; r++) {                                                              \
            const T* g = x + r * x_stride;                                                                \
            const T* u = g + d;                                                                           \
            T* o = out + r * o_stride;                                                                    \
            _Pragma("omp simd") for (int64_t c = 0; c < d; c++) {                                        \
                const float v = LOAD(g[c]);                                                               \
                const float sv = ROUND(v / (1.f + expf(-v)));                                             \
                o[c] = STORE(sv * LOAD(u[c]));                                                            \
            }                                                                                             \
        }                                                                                                 \
    }

DEFINE_SILU(f32, float, LOAD_F32, STORE_F32, ROUND_F32)
DEFINE_SILU(bf16, uint16_t, bf16_to_f32, f32_to_bf16, ROUND_BF16)
