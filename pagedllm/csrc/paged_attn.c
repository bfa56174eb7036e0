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
 * bfloat16 results are rounded to nearest-even (as torch does). Caches may also hold FP8 codes ("kfp8e4m3",
 * "kfp8e5m2", fp8.h: exact values), with the layer's K scale folded into the query scale and its V scale applied
 * to the output (the cache holds fp8(x / scale)).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "fp8.h"

#define MAX_HEAD 512
#define MAX_HEADS 128 /* query heads; with MAX_HEAD bounds the per-thread stack arrays */
#define TILE 32
/* Keys per work item: a request's longer context is split into parts of PART keys, computed in parallel and
 * merged in order. Fixed, so a request's result does not depend on its batch or the thread count; a multiple
 * of TILE, so a part's tiles are the ones the whole range would have had. */
#define PART 512
/* ROWC of the caches read element by element (DEFINE_DECODE's STAGED = 0): never called. */
static inline void no_rowc(const void* src, float* dst, int n) { (void)src, (void)dst, (void)n; }
/* Keys a decode attends to: the last `window` of seq_len when a sliding window is set, else all. */
static inline int32_t window_len(int32_t seq_len, int32_t window) {
    return window > 0 && seq_len > window ? window : seq_len;
}
static inline int64_t num_parts(int32_t keys) { return keys > PART ? (keys + PART - 1) / PART : 1; }
/* Finite stand-in for -inf: the library is built with -ffast-math (vectorised expf), which assumes
 * no infinities. expf(NEG_BIG - x) is 0 for any score x. */
#define NEG_BIG (-1e30f)

/* One request's keys [p_begin, p_end), all heads: each key tile's cache rows (all kv heads) are read once,
 * contiguously. Online softmax over tiles of TILE positions: scores for the tile, then one rescale of the
 * running sums. `out` set: the normalised result goes there (the whole range in one part); else the part's
 * running max, sum and unnormalised accumulator go to part_m / part_l / part_acc ([heads], [heads],
 * [heads][hd]) for `merge_parts`. The output is scaled by v_scale (1 except over an FP8 cache: exact then).
 * STAGED (a constant): each cache row is converted to float once (ROWC(src, dst, n)) into rf, which the query
 * heads then read (an FP8 code's conversion costs several instructions: once per element, not once per query
 * head; rf aligned to 64 bytes, or the loads that straddle cache lines cost ~15 % of the kernel). */
#define DEFINE_DECODE(SUFFIX, T, LOAD, STORE, C, LOADC, STAGED, ROWC) /* queries / outputs T, cache C */ \
    static void decode_part_##SUFFIX(const T* q, int64_t q_stride_t, const C* k_cache, const C* v_cache,  \
                                     const int32_t* bt_row, int32_t p_begin, int32_t seq_len, int64_t tok, \
                                     T* out, int64_t o_stride_t, int num_heads, int kvh, int hd, int bs,  \
                                     float scale, float v_scale, float* part_m, float* part_l,            \
                                     float* part_acc) {                                                   \
        const int g = num_heads / kvh;                                                                    \
        float qf[num_heads][hd], acc[num_heads][hd]; /* small: heads x head_size */                      \
        float m[num_heads], l[num_heads], s[num_heads][TILE];                                             \
        const int64_t row = (int64_t)kvh * hd; /* elements per cache slot */                              \
        float rf[STAGED ? row : 1] __attribute__((aligned(64))); /* a widened row (STAGED) */            \
        const T* qr = q + tok * q_stride_t;                                                               \
        for (int j = 0; j < num_heads; j++) {                                                             \
            for (int e = 0; e < hd; e++) qf[j][e] = LOAD(qr[(int64_t)j * hd + e]) * scale;                \
            for (int e = 0; e < hd; e++) acc[j][e] = 0.f;                                                 \
            m[j] = NEG_BIG;                                                                               \
            l[j] = 0.f;                                                                                   \
        }                                                                                                 \
        for (int32_t p0 = p_begin; p0 < seq_len; p0 += TILE) {                                            \
            const int n = seq_len - p0 < TILE ? seq_len - p0 : TILE;                                      \
            const C* kr[TILE];                                                                            \
            const C* vr[TILE];                                                                            \
            for (int t = 0; t < n; t++) {                                                                 \
                const int32_t p = p0 + t;                                                                 \
                const int64_t slot = (int64_t)bt_row[p / bs] * bs + p % bs;                               \
                kr[t] = k_cache + slot * row;                                                             \
                vr[t] = v_cache + slot * row;                                                             \
            }                                                                                             \
            if (STAGED) {                                                                                 \
                for (int t = 0; t < n; t++) { /* scores: as below, the row widened once */                \
                    ROWC(kr[t], rf, (int)row);                                                            \
                    for (int j = 0; j < num_heads; j++) {                                                 \
                        const float* kk = rf + (int64_t)(j / g) * hd;                                     \
                        float dot = 0.f;                                                                  \
                        _Pragma("omp simd reduction(+ : dot)") for (int e = 0; e < hd; e++) dot +=        \
                            qf[j][e] * kk[e];                                                             \
                        s[j][t] = dot;                                                                    \
                    }                                                                                     \
                }                                                                                         \
            } else                                                                                        \
                for (int t = 0; t < n; t++) { /* scores: rows in order, every head of the row */          \
                    const C* krow = kr[t];                                                                \
                    for (int j = 0; j < num_heads; j++) {                                                 \
                        const C* kk = krow + (int64_t)(j / g) * hd;                                       \
                        float dot = 0.f;                                                                  \
                        _Pragma("omp simd reduction(+ : dot)") for (int e = 0; e < hd; e++) dot +=        \
                            qf[j][e] * LOADC(kk[e]);                                                      \
                        s[j][t] = dot;                                                                    \
                    }                                                                                     \
                }                                                                                         \
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
            if (STAGED) {                                                                                 \
                for (int t = 0; t < n; t++) { /* values: likewise */                                      \
                    ROWC(vr[t], rf, (int)row);                                                            \
                    for (int j = 0; j < num_heads; j++) {                                                 \
                        const float* vv = rf + (int64_t)(j / g) * hd;                                     \
                        const float pr = s[j][t];                                                         \
                        _Pragma("omp simd") for (int e = 0; e < hd; e++) acc[j][e] += pr * vv[e];         \
                    }                                                                                     \
                }                                                                                         \
            } else                                                                                        \
                for (int t = 0; t < n; t++) { /* values: rows in order again */                           \
                    const C* vrow = vr[t];                                                                \
                    for (int j = 0; j < num_heads; j++) {                                                 \
                        const C* vv = vrow + (int64_t)(j / g) * hd;                                       \
                        const float pr = s[j][t];                                                         \
                        _Pragma("omp simd") for (int e = 0; e < hd; e++) acc[j][e] += pr * LOADC(vv[e]);  \
                    }                                                                                     \
                }                                                                                         \
        }                                                                                                 \
        if (out == NULL) {                                                                                \
            for (int j = 0; j < num_heads; j++) {                                                         \
                part_m[j] = m[j];                                                                         \
                part_l[j] = l[j];                                                                         \
                memcpy(part_acc + (int64_t)j * hd, acc[j], (size_t)hd * sizeof(float));                   \
            }                                                                                             \
            return;                                                                                       \
        }                                                                                                 \
        T* orow = out + tok * o_stride_t;                                                                 \
        for (int j = 0; j < num_heads; j++) {                                                             \
            const float inv = (l[j] > 0.f ? 1.f / l[j] : 0.f) * v_scale;                                  \
            for (int e = 0; e < hd; e++) orow[(int64_t)j * hd + e] = STORE(acc[j][e] * inv);              \
        }                                                                                                 \
    }                                                                                                     \
                                                                                                          \
    /* A request's parts merged in order (the same order whatever the batch or the threads). */           \
    static void merge_parts_##SUFFIX(const float* pm, const float* pl, const float* pacc, int parts,       \
                                     T* orow, int num_heads, int hd, float v_scale) {                     \
        for (int j = 0; j < num_heads; j++) {                                                             \
            float mx = NEG_BIG;                                                                           \
            for (int c = 0; c < parts; c++) mx = pm[c * num_heads + j] > mx ? pm[c * num_heads + j] : mx; \
            float o[MAX_HEAD], l = 0.f;                                                                   \
            for (int e = 0; e < hd; e++) o[e] = 0.f;                                                      \
            for (int c = 0; c < parts; c++) {                                                             \
                const float w = expf(pm[c * num_heads + j] - mx);                                         \
                const float* a = pacc + ((int64_t)c * num_heads + j) * hd;                                \
                l += pl[c * num_heads + j] * w;                                                           \
                for (int e = 0; e < hd; e++) o[e] += a[e] * w;                                            \
            }                                                                                             \
            const float inv = (l > 0.f ? 1.f / l : 0.f) * v_scale;                                        \
            for (int e = 0; e < hd; e++) orow[(int64_t)j * hd + e] = STORE(o[e] * inv);                   \
        }                                                                                                 \
    }                                                                                                     \
                                                                                                          \
    static int decode_##SUFFIX(const T* q, int64_t q_stride_t, const C* k_cache, const C* v_cache,        \
                               const int32_t* block_table, int64_t bt_stride, const int32_t* seq_lens,    \
                               const int64_t* tok_idx, T* out, int64_t o_stride_t, int num_reqs,          \
                               int num_heads, int kvh, int hd, int bs, float scale, float v_scale,        \
                               int32_t window, int num_threads) {                                         \
        if (hd > MAX_HEAD || num_heads % kvh != 0 || num_heads > MAX_HEADS) return -1;                    \
        if (num_reqs <= 0) return 0;                                                                      \
        /* Work items: each request's keys in parts of PART keys (one part up to PART keys). */          \
        int64_t items = 0;                                                                                \
        for (int d = 0; d < num_reqs; d++) items += num_parts(window_len(seq_lens[d], window));            \
        if (items == num_reqs) { /* every context fits one part: one work item per request */             \
            _Pragma("omp parallel for num_threads(num_threads) schedule(dynamic, 1)")                     \
            for (int d = 0; d < num_reqs; d++)                                                            \
                decode_part_##SUFFIX(q, q_stride_t, k_cache, v_cache, block_table + d * bt_stride,        \
                                     seq_lens[d] - window_len(seq_lens[d], window), seq_lens[d],          \
                                     tok_idx[d], out, o_stride_t, num_heads, kvh, hd, bs, scale, v_scale, \
                                     NULL, NULL, NULL);                                                   \
            return 0;                                                                                     \
        }                                                                                                 \
        int64_t* first = malloc(((size_t)num_reqs + 1) * sizeof(int64_t)); /* request d: items first[d].. */ \
        float* parts = malloc((size_t)items * num_heads * (hd + 2) * sizeof(float));                      \
        if (first == NULL || parts == NULL) {                                                             \
            free(first);                                                                                  \
            free(parts);                                                                                  \
            return -1;                                                                                    \
        }                                                                                                 \
        first[0] = 0;                                                                                     \
        for (int d = 0; d < num_reqs; d++)                                                                \
            first[d + 1] = first[d] + num_parts(window_len(seq_lens[d], window));                         \
        float* pm = parts;                                                                                \
        float* pl = parts + items * num_heads;                                                            \
        float* pacc = parts + 2 * items * num_heads;                                                      \
        _Pragma("omp parallel num_threads(num_threads)") {                                                \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t it = 0; it < items; it++) {              \
                int lo = 0, hi = num_reqs - 1; /* the request of item it: last d with first[d] <= it */    \
                while (lo < hi) {                                                                         \
                    const int mid = (lo + hi + 1) / 2;                                                    \
                    if (first[mid] <= it)                                                                 \
                        lo = mid;                                                                         \
                    else                                                                                  \
                        hi = mid - 1;                                                                     \
                }                                                                                         \
                const int d = lo;                                                                         \
                const int32_t n = seq_lens[d];                                                            \
                const int32_t p0 = n - window_len(n, window) + (int32_t)(it - first[d]) * PART;           \
                const int32_t p1 = n - p0 < PART ? n : p0 + PART;                                         \
                const int whole = first[d + 1] - first[d] == 1;                                           \
                decode_part_##SUFFIX(q, q_stride_t, k_cache, v_cache, block_table + d * bt_stride, p0, p1, \
                                     tok_idx[d], whole ? out : NULL, o_stride_t, num_heads, kvh, hd, bs,  \
                                     scale, v_scale, pm + it * num_heads, pl + it * num_heads,            \
                                     pacc + it * num_heads * hd);                                         \
            }                                                                                             \
            _Pragma("omp for schedule(static)") for (int d = 0; d < num_reqs; d++) {                      \
                const int64_t c0 = first[d], nc = first[d + 1] - c0;                                      \
                if (nc > 1)                                                                               \
                    merge_parts_##SUFFIX(pm + c0 * num_heads, pl + c0 * num_heads, pacc + c0 * num_heads * hd, \
                                         (int)nc, out + tok_idx[d] * o_stride_t, num_heads, hd, v_scale); \
            }                                                                                             \
        }                                                                                                 \
        free(parts);                                                                                      \
        free(first);                                                                                      \
        return 0;                                                                                         \
    }                                                                                                     \

/* The entry points: (q, q_stride_t, k_cache, v_cache, block_table, bt_stride, seq_lens, tok_idx, out,
 * o_stride_t, num_reqs, num_heads, kvh, hd, bs, scale, window, num_threads); the FP8 caches' take the layer's
 * k_scale and v_scale after `scale`. Returns 0, or -1 for an unsupported shape (or no memory). */
#define DECODE_ARGS(T, C)                                                                                      \
    const T *q, int64_t q_stride_t, const C *k_cache, const C *v_cache, const int32_t *block_table,           \
        int64_t bt_stride, const int32_t *seq_lens, const int64_t *tok_idx, T *out, int64_t o_stride_t,        \
        int num_reqs, int num_heads, int kvh, int hd, int bs
#define DECODE_PASS                                                                                            \
    q, q_stride_t, k_cache, v_cache, block_table, bt_stride, seq_lens, tok_idx, out, o_stride_t, num_reqs,    \
        num_heads, kvh, hd, bs

#define DEFINE_PAGED_DECODE(SUFFIX, T, C)                                                                      \
    int paged_decode_##SUFFIX(DECODE_ARGS(T, C), float scale, int32_t window, int num_threads) {               \
        return decode_##SUFFIX(DECODE_PASS, scale, 1.f, window, num_threads);                                  \
    }
/* (scale * k_scale: the K scale folded into the query, as q . (k * k_scale) * scale up to rounding) */
#define DEFINE_PAGED_DECODE_FP8(SUFFIX, T)                                                                     \
    int paged_decode_##SUFFIX(DECODE_ARGS(T, uint8_t), float scale, float k_scale, float v_scale,              \
                              int32_t window, int num_threads) {                                               \
        return decode_##SUFFIX(DECODE_PASS, scale * k_scale, v_scale, window, num_threads);                    \
    }

DEFINE_DECODE(f32, float, LOAD_F32, STORE_F32, float, LOAD_F32, 0, no_rowc)
DEFINE_PAGED_DECODE(f32, float, float)
DEFINE_DECODE(bf16, uint16_t, bf16_to_f32, f32_to_bf16, uint16_t, bf16_to_f32, 0, no_rowc)
DEFINE_PAGED_DECODE(bf16, uint16_t, uint16_t)
/* float32 queries over a bfloat16 cache (`kv_cache_dtype="bfloat16"` under a float32 model) */
DEFINE_DECODE(f32_kbf16, float, LOAD_F32, STORE_F32, uint16_t, bf16_to_f32, 0, no_rowc)
DEFINE_PAGED_DECODE(f32_kbf16, float, uint16_t)
/* FP8 caches (kv_cache_dtype="fp8" / "fp8_e5m2") under float32 or bfloat16 queries */
DEFINE_DECODE(f32_kfp8e4m3, float, LOAD_F32, STORE_F32, uint8_t, LOAD_E4M3, 1, e4m3fn_row_to_f32)
DEFINE_PAGED_DECODE_FP8(f32_kfp8e4m3, float)
DEFINE_DECODE(f32_kfp8e5m2, float, LOAD_F32, STORE_F32, uint8_t, LOAD_E5M2, 1, e5m2_row_to_f32)
DEFINE_PAGED_DECODE_FP8(f32_kfp8e5m2, float)
DEFINE_DECODE(bf16_kfp8e4m3, uint16_t, bf16_to_f32, f32_to_bf16, uint8_t, LOAD_E4M3, 1, e4m3fn_row_to_f32)
DEFINE_PAGED_DECODE_FP8(bf16_kfp8e4m3, uint16_t)
DEFINE_DECODE(bf16_kfp8e5m2, uint16_t, bf16_to_f32, f32_to_bf16, uint8_t, LOAD_E5M2, 1, e5m2_row_to_f32)
DEFINE_PAGED_DECODE_FP8(bf16_kfp8e5m2, uint16_t)

/* The float32 / bfloat16 caches' writes (DEFINE_CACHE_WRITE in bf16.h). */
#define KEEP_KV(x, kv) (x)
#define TO_BF16_KV(x, kv) f32_to_bf16(x)
DEFINE_CACHE_WRITE(f32, float, float, KEEP_KV, )
DEFINE_CACHE_WRITE(bf16, uint16_t, uint16_t, KEEP_KV, )
DEFINE_CACHE_WRITE(f32_kbf16, float, uint16_t, TO_BF16_KV, )
