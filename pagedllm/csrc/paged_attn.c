/* Paged KV-cache kernels for the CPU attention backend (built at first use by cpu_paged_attn.py).
 *
 * Why C: the pure-PyTorch decode path must gather every request's blocks into a dense tensor, lay it out
 * head-major and run thousands of tiny matmuls; on a 2-core machine that moves the K/V bytes three times
 * and costs ~1 ms per layer at 64 requests. These loops read each K/V row once, straight from the paged
 * cache, with an online softmax in float32.
 *
 * Layouts (all row-major, strides in elements):
 *   k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_size] (contiguous)
 *   query rows: q + tok[d] * q_stride_t + head * head_size
 *   out rows:   out + tok[d] * o_stride_t + head * head_size
 * Element types: float32 ("f32") or bfloat16 stored as uint16 ("bf16"); math is float32 throughout,
 * bfloat16 results are rounded to nearest-even (as torch does).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define MAX_HEAD 512
#define MAX_HEADS 128 /* query heads; with MAX_HEAD bounds the per-thread stack arrays */
#define TILE 32
/* Finite stand-in for -inf: the library is built with -ffast-math (vectorised expf), which assumes
 * no infinities. expf(NEG_BIG - x) is 0 for any score x. */
#define NEG_BIG (-1e30f)

/* One request, all heads: each key tile's cache rows (all kv heads) are read once, contiguously. Online
 * softmax over tiles of TILE positions: scores for the tile, then one rescale of the running sums. */
#define DEFINE_DECODE(SUFFIX, T, LOAD, STORE)                                                              \
    static void decode_one_##SUFFIX(const T* q, int64_t q_stride_t, const T* k_cache, const T* v_cache,   \
                                    const int32_t* bt_row, int32_t seq_len, int64_t tok, T* out,          \
                                    int64_t o_stride_t, int num_heads, int kvh, int hd, int bs,           \
                                    float scale, int32_t window) {                                        \
        const int g = num_heads / kvh;                                                                    \
        float qf[num_heads][hd], acc[num_heads][hd]; /* small: heads x head_size */                      \
        float m[num_heads], l[num_heads], s[num_heads][TILE];                                             \
        const int64_t row = (int64_t)kvh * hd; /* elements per cache slot */                              \
        const T* qr = q + tok * q_stride_t;                                                               \
        for (int j = 0; j < num_heads; j++) {                                                             \
            for (int e = 0; e < hd; e++) qf[j][e] = LOAD(qr[(int64_t)j * hd + e]) * scale;                \
            for (int e = 0; e < hd; e++) acc[j][e] = 0.f;                                                 \
            m[j] = NEG_BIG;                                                                               \
            l[j] = 0.f;                                                                                   \
        }                                                                                                 \
        int32_t start = 0;                                                                                \
        if (window > 0 && seq_len > window) start = seq_len - window;                                     \
        for (int32_t p0 = start; p0 < seq_len; p0 += TILE) {                                              \
            const int n = seq_len - p0 < TILE ? seq_len - p0 : TILE;                                      \
            const T* kr[TILE];                                                                            \
            const T* vr[TILE];                                                                            \
            for (int t = 0; t < n; t++) {                                                                 \
                const int32_t p = p0 + t;                                                                 \
                const int64_t slot = (int64_t)bt_row[p / bs] * bs + p % bs;                               \
                kr[t] = k_cache + slot * row;                                                             \
                vr[t] = v_cache + slot * row;                                                             \
            }                                                                                             \
            for (int t = 0; t < n; t++) { /* scores: rows in order, every head of the row */              \
                const T* krow = kr[t];                                                                    \
                for (int j = 0; j < num_heads; j++) {                                                     \
                    const T* kk = krow + (int64_t)(j / g) * hd;                                           \
                    float dot = 0.f;                                                                      \
                    _Pragma("omp simd reduction(+ : dot)") for (int e = 0; e < hd; e++) dot +=            \
                        qf[j][e] * LOAD(kk[e]);                                                           \
                    s[j][t] = dot;                                                                        \
                }                                                                                         \
            }                                                                                             \
            for (int j = 0; j < num_heads; j++) {                                                         \
                float mx = m[j];                                                                          \
                for (int t = 0; t < n; t++) mx = s[j][t] > mx ? s[j][t] : mx;                             \
                const float corr = expf(m[j] - mx); /* 0 on the first tile (m = NEG_BIG) */               \
                float tile_sum = 0.f;                                                                     \
                _Pragma("omp simd reduction(+ : tile_sum)") for (int t = 0; t < n; t++) {                 \
                    s[j][t] = expf(s[j][t] - mx); /* vectorised (libmvec) under -ffast-math */            \
                    tile_sum += s[j][t];                                                                  \
                }                                                                                         \
                l[j] = l[j] * corr + tile_sum;                                                            \
                m[j] = mx;                                                                                \
                _Pragma("omp simd") for (int e = 0; e < hd; e++) acc[j][e] *= corr;                       \
            }                                                                                             \
            for (int t = 0; t < n; t++) { /* values: rows in order again */                               \
                const T* vrow = vr[t];                                                                    \
                for (int j = 0; j < num_heads; j++) {                                                     \
                    const T* vv = vrow + (int64_t)(j / g) * hd;                                           \
                    const float pr = s[j][t];                                                             \
                    _Pragma("omp simd") for (int e = 0; e < hd; e++) acc[j][e] += pr * LOAD(vv[e]);       \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        T* orow = out + tok * o_stride_t;                                                                 \
        for (int j = 0; j < num_heads; j++) {                                                             \
            const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;                                              \
            for (int e = 0; e < hd; e++) orow[(int64_t)j * hd + e] = STORE(acc[j][e] * inv);              \
        }                                                                                                 \
    }                                                                                                     \
                                                                                                          \
    int paged_decode_##SUFFIX(const T* q, int64_t q_stride_t, const T* k_cache, const T* v_cache,         \
                              const int32_t* block_table, int64_t bt_stride, const int32_t* seq_lens,     \
                              const int64_t* tok_idx, T* out, int64_t o_stride_t, int num_reqs,           \
                              int num_heads, int kvh, int hd, int bs, float scale, int32_t window,        \
                              int num_threads) {                                                          \
        if (hd > MAX_HEAD || num_heads % kvh != 0 || num_heads > MAX_HEADS) return -1;                    \
        _Pragma("omp parallel for num_threads(num_threads) schedule(dynamic, 1)")                         \
        for (int d = 0; d < num_reqs; d++) {                                                              \
            decode_one_##SUFFIX(q, q_stride_t, k_cache, v_cache, block_table + d * bt_stride, seq_lens[d], \
                                tok_idx[d], out, o_stride_t, num_heads, kvh, hd, bs, scale, window);      \
        }                                                                                                 \
        return 0;                                                                                         \
    }                                                                                                     \
                                                                                                          \
    /* Write each new token's K and V rows ([T, kvh, hd], token stride given, heads contiguous) to its    \
     * cache slot; slot < 0 means "padding, skip". */                                                     \
    void reshape_and_cache_##SUFFIX(const T* key, int64_t k_stride_t, const T* value, int64_t v_stride_t, \
                                    T* k_cache, T* v_cache, const int64_t* slots, int64_t num_tokens,     \
                                    int64_t row) {                                                        \
        for (int64_t i = 0; i < num_tokens; i++) {                                                        \
            int64_t s = slots[i];                                                                         \
            if (s < 0) continue;                                                                          \
            memcpy(k_cache + s * row, key + i * k_stride_t, (size_t)row * sizeof(T));                     \
            memcpy(v_cache + s * row, value + i * v_stride_t, (size_t)row * sizeof(T));                   \
        }                                                                                                 \
    }

DEFINE_DECODE(f32, float, LOAD_F32, STORE_F32)
DEFINE_DECODE(bf16, uint16_t, bf16_to_f32, f32_to_bf16)
