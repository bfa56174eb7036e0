/* A Llama decoder stack for decode steps with GGUF-packed weights, float32 activations, in one C call.
 *
 * Why: at one token a step's arithmetic is a few milliseconds, while driving 30 layers x ~12 kernels from
 * Python (module calls, tensor allocations, argument checks, ctypes) costs as much again (benchmarks/NOTES.md,
 * "GGUF decode stack"). This file calls the same kernels as the Python path, in the same order, with the
 * same arguments, so its result is bit-identical to it; only the glue between them moves to C:
 *
 *   per layer: [residual +] RMSNorm -> quantize -> q/k/v GEMV (gguf_mm) -> rotary (in place) -> cache write
 *              -> paged decode attention -> quantize -> o GEMV -> residual + RMSNorm -> quantize -> gate/up
 *              GEMV -> SiLU-and-mul -> quantize -> down GEMV
 *
 * The caller (model_executor/layers/quantization/gguf_decode_stack.py) checks that every layer is a plain
 * Llama layer (no biases, no q/k norm, no sliding window, no LoRA hooks) and that the step only decodes.
 */
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#define FUTEX_WAIT_ON(addr, v) syscall(SYS_futex, (addr), FUTEX_WAIT_PRIVATE, (v), NULL, NULL, 0)
#define FUTEX_WAKE_ALL(addr) syscall(SYS_futex, (addr), FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0)
#else
#include <sched.h>
#define FUTEX_WAIT_ON(addr, v) sched_yield()
#define FUTEX_WAKE_ALL(addr) ((void)0)
#endif

#include "gguf_common.h"

/* The kernels of the other sources of this library (layers.c, activation.c, paged_attn.c, gguf_mm.c). */
void rms_norm_f32(float* x, int64_t x_stride, float* residual, int64_t r_stride, const float* w, float* out,
                  int64_t o_stride, int64_t rows, int64_t cols, float eps, int num_threads);
void rotary_f32(const int64_t* positions, float* q, int64_t q_stride, int nq, float* k, int64_t k_stride, int nk,
                const float* cos_sin, int head_size, int rot_dim, int64_t num_tokens, int num_threads);
void silu_and_mul_f32(const float* x, int64_t x_stride, float* out, int64_t o_stride, int64_t rows, int64_t d,
                      int num_threads);
int paged_decode_f32(const float* q, int64_t q_stride_t, const float* k_cache, const float* v_cache,
                     const int32_t* block_table, int64_t bt_stride, const int32_t* seq_lens, const int64_t* tok_idx,
                     float* out, int64_t o_stride_t, int num_reqs, int num_heads, int kvh, int hd, int bs,
                     float scale, int32_t window, int num_threads);
void reshape_and_cache_f32(const float* key, int64_t k_stride_t, const float* value, int64_t v_stride_t,
                           float* k_cache, float* v_cache, const int64_t* slots, int64_t num_tokens, int64_t row);
int paged_decode_f32_kbf16(const float* q, int64_t q_stride_t, const uint16_t* k_cache, const uint16_t* v_cache,
                           const int32_t* block_table, int64_t bt_stride, const int32_t* seq_lens,
                           const int64_t* tok_idx, float* out, int64_t o_stride_t, int num_reqs, int num_heads,
                           int kvh, int hd, int bs, float scale, int32_t window, int num_threads);
void reshape_and_cache_f32_kbf16(const float* key, int64_t k_stride_t, const float* value, int64_t v_stride_t,
                                 uint16_t* k_cache, uint16_t* v_cache, const int64_t* slots, int64_t num_tokens,
                                 int64_t row);
/* FP8 caches (paged_attn.c, kv_fp8.c): the layer's K / V scales after `scale` / `row`. */
#define FP8_DECODE(SUFFIX)                                                                                     \
    int paged_decode_##SUFFIX(const float* q, int64_t q_stride_t, const uint8_t* k_cache, const uint8_t* v_cache, \
                              const int32_t* block_table, int64_t bt_stride, const int32_t* seq_lens,         \
                              const int64_t* tok_idx, float* out, int64_t o_stride_t, int num_reqs,           \
                              int num_heads, int kvh, int hd, int bs, float scale, float k_scale,             \
                              float v_scale, int32_t window, int num_threads);                                \
    void reshape_and_cache_##SUFFIX(const float* key, int64_t k_stride_t, const float* value,                 \
                                    int64_t v_stride_t, uint8_t* k_cache, uint8_t* v_cache,                   \
                                    const int64_t* slots, int64_t num_tokens, int64_t row, float k_scale,     \
                                    float v_scale);
FP8_DECODE(f32_kfp8e4m3)
FP8_DECODE(f32_kfp8e5m2)
void gguf_quantize_act_f32(const float* x, int64_t x_stride, int64_t M, int64_t K, int16_t* xq, float* xd,
                           float* xs, int num_threads);
int gguf_mm_parts(int n_parts, const int* types, const uint8_t* const* ws, const int64_t* Ns, int64_t K,
                  const int16_t* xq, const float* xd, const float* xs, int64_t M, void* out, int64_t out_stride,
                  int out_bf16, int num_threads);

/* gguf_tile.c: the AVX-512 VNNI kernel on tiled weights, for threads this file runs itself. */
int gguf_isa(void);
int gguf_set_tile(int on);
void gguf_mm_tiled_range(int type, const uint8_t* w, int64_t N, int64_t K, const int16_t* xq, const float* xd,
                         const float* xs, int64_t M, float* out, int64_t out_stride, int64_t t0, int64_t t1,
                         float* acc);
void gguf_pair_activations(const int16_t* x, int64_t n, int16_t* out);

/* One linear layer: up to GGUF_MAX_PARTS packed weights stacked by output rows (mixed block types). */
typedef struct {
    int32_t n_parts;
    int32_t type[GGUF_MAX_PARTS];
    int64_t rows[GGUF_MAX_PARTS];
    const uint8_t* w[GGUF_MAX_PARTS];
} GLinear;

typedef struct {
    const float* in_norm;
    const float* post_norm;
    GLinear qkv, o, gate_up, down;
    void* k_cache; /* [num_blocks, block_size, kv_heads, head_size] of float32, bfloat16 (cache_bf16) or FP8 */
    void* v_cache;
    const float* k_scale; /* an FP8 cache's scales (float32 [1]; read at every step: calculate_kv_scales sets */
    const float* v_scale; /* them on the first batch) */
} GLayer;

typedef struct {
    int32_t hidden, heads, kv_heads, head_size, inter, rot_dim, block_size;
    float eps, scale;
    const float* cos_sin;
    int32_t cache_bf16; /* the KV cache holds bfloat16 (kv_cache_dtype="bfloat16") */
    int32_t cache_fp8;  /* FP8 codes: 1 e4m3fn (kv_cache_dtype="fp8"), 2 e5m2 ("fp8_e5m2"); 0 neither */
} GDims;

/* The new tokens' K and V rows (row stride `stride`) into layer L's cache, of any of its dtypes (FP8: quantized
 * with the layer's scales, as kv_quant.quantize). */
static void cache_write(const GDims* d, const GLayer* L, const float* k, const float* v, int64_t stride,
                        const int64_t* slots, int64_t T, int64_t KV) {
    if (d->cache_fp8 == 1)
        reshape_and_cache_f32_kfp8e4m3(k, stride, v, stride, L->k_cache, L->v_cache, slots, T, KV, *L->k_scale,
                                       *L->v_scale);
    else if (d->cache_fp8 == 2)
        reshape_and_cache_f32_kfp8e5m2(k, stride, v, stride, L->k_cache, L->v_cache, slots, T, KV, *L->k_scale,
                                       *L->v_scale);
    else if (d->cache_bf16)
        reshape_and_cache_f32_kbf16(k, stride, v, stride, L->k_cache, L->v_cache, slots, T, KV);
    else
        reshape_and_cache_f32(k, stride, v, stride, L->k_cache, L->v_cache, slots, T, KV);
}

/* paged_decode over layer L's cache, of any of those dtypes. */
static int attend(const GDims* d, const GLayer* L, const float* q, int64_t q_stride, const int32_t* bt,
                  int64_t bt_stride, const int32_t* seq_lens, const int64_t* tok_idx, float* out, int64_t o_stride,
                  int n, int nt) {
    if (d->cache_fp8 == 1)
        return paged_decode_f32_kfp8e4m3(q, q_stride, L->k_cache, L->v_cache, bt, bt_stride, seq_lens, tok_idx, out,
                                         o_stride, n, d->heads, d->kv_heads, d->head_size, d->block_size, d->scale,
                                         *L->k_scale, *L->v_scale, 0, nt);
    if (d->cache_fp8 == 2)
        return paged_decode_f32_kfp8e5m2(q, q_stride, L->k_cache, L->v_cache, bt, bt_stride, seq_lens, tok_idx, out,
                                         o_stride, n, d->heads, d->kv_heads, d->head_size, d->block_size, d->scale,
                                         *L->k_scale, *L->v_scale, 0, nt);
    if (d->cache_bf16)
        return paged_decode_f32_kbf16(q, q_stride, L->k_cache, L->v_cache, bt, bt_stride, seq_lens, tok_idx, out,
                                      o_stride, n, d->heads, d->kv_heads, d->head_size, d->block_size, d->scale, 0,
                                      nt);
    return paged_decode_f32(q, q_stride, L->k_cache, L->v_cache, bt, bt_stride, seq_lens, tok_idx, out, o_stride, n,
                            d->heads, d->kv_heads, d->head_size, d->block_size, d->scale, 0, nt);
}

/* Scratch: x [T, hidden], qkv [T, q + 2kv], attn [T, q], gu [T, 2 inter], act [T, inter]; xq int16 [T, K],
 * xd / xs [T, K / 32] for the largest K. */
typedef struct {
    float *x, *qkv, *attn, *gu, *act;
    int16_t* xq;
    float *xd, *xs;
} GScratch;

/* out[T, sum(rows)] = x[T, K] @ W.T, as gguf_matmul does it: activations quantized once, one gguf_mm_parts call. */
static int linear(const GLinear* l, const float* x, int64_t T, int64_t K, float* out, const GScratch* s, int nt) {
    gguf_quantize_act_f32(x, K, T, K, s->xq, s->xd, s->xs, nt);
    int64_t n = 0;
    for (int p = 0; p < l->n_parts; p++) n += l->rows[p];
    return gguf_mm_parts(l->n_parts, l->type, l->w, l->rows, K, s->xq, s->xd, s->xs, T, out, n, 0, nt) ? -1 : 0;
}

/* ---- one parallel region per step ----------------------------------------------------------------------
 * Each kernel above opens its own OpenMP region, ~5 a layer, and with the engine's short spin
 * (GOMP_SPINCOUNT=2000, envs.set_openmp_defaults) the other threads are asleep by the next one: every region
 * pays a futex wake-up (a quiet Zen 4 decoded 10-20 % faster with 50,000 spins). When every linear is tiled
 * for the AVX-512 VNNI kernel, the whole step runs in one region instead: thread 0 does the small row-wise
 * kernels, all threads split each linear's tiles and the attention's requests, and they meet at a barrier
 * that spins for a while and then sleeps (so a busy neighbour still gets the core). Same kernels, same
 * arithmetic per output, so the result is the same to the bit. */
typedef struct {
    atomic_int count, gen, sleepers;
    int n;
} SpinBarrier;

/* Spins a while (the gaps between a step's kernels are microseconds), then sleeps on a futex: a waiter that
 * only yielded kept a busy neighbour's core (a 32-token request 10x slower under two spinning processes). */
#define SPIN_MAX 2048

static void barrier_wait(SpinBarrier* b) {
    const int g = atomic_load_explicit(&b->gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->count, 1, memory_order_acq_rel) == b->n - 1) {
        atomic_store_explicit(&b->count, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&b->gen, 1, memory_order_release);
        if (atomic_load_explicit(&b->sleepers, memory_order_acquire) > 0)
            FUTEX_WAKE_ALL(&b->gen);
        return;
    }
    for (int spins = 0; atomic_load_explicit(&b->gen, memory_order_acquire) == g; spins++) {
        if (spins < SPIN_MAX) {
#if defined(__x86_64__)
            __builtin_ia32_pause();
#endif
            continue;
        }
        atomic_fetch_add_explicit(&b->sleepers, 1, memory_order_acq_rel);
        if (atomic_load_explicit(&b->gen, memory_order_acquire) == g)
            FUTEX_WAIT_ON(&b->gen, g);
        atomic_fetch_sub_explicit(&b->sleepers, 1, memory_order_acq_rel);
    }
}

static int g_one_region = 0;

/* PAGEDLLM_CPU_DECODE_ONE_REGION (envs.py, off by default: see there). Returns the previous setting. */
int gguf_decode_stack_set_one_region(int on) {
    const int prev = g_one_region;
    g_one_region = on != 0;
    return prev;
}

static int all_tiled(const GLinear* l) {
    for (int p = 0; p < l->n_parts; p++) {
        const int base = l->type[p] & ~GGUF_TILED;
        if (!(l->type[p] & GGUF_TILED) || (base != 2 && base != 3 && base != 8)) return 0;
    }
    return 1;
}

static int any_q4(const GLinear* l) {
    for (int p = 0; p < l->n_parts; p++)
        if ((l->type[p] & ~GGUF_TILED) != 8) return 1;
    return 0;
}

/* This thread's share of every part's tiles; Q4 parts read the paired activations xp. */
static void linear_share(const GLinear* l, const int16_t* xq, const int16_t* xp, const float* xd, const float* xs,
                         int64_t T, int64_t K, float* out, int tid, int nth, float* acc) {
    int64_t n = 0, start = 0;
    for (int p = 0; p < l->n_parts; p++) n += l->rows[p];
    for (int p = 0; p < l->n_parts; p++) {
        const int base = l->type[p] & ~GGUF_TILED;
        const int64_t tiles = (l->rows[p] + 15) / 16;
        gguf_mm_tiled_range(base, l->w[p], l->rows[p], K, base == 8 ? xq : xp, xd, xs, T, out + start, n,
                            tiles * tid / nth, tiles * (tid + 1) / nth, acc);
        start += l->rows[p];
    }
}

/* x [T, K] quantized (and paired when a Q4 part will read it) by the calling thread. */
static void quantize_for(const GLinear* l, const float* x, int64_t T, int64_t K, const GScratch* s, int16_t* xp) {
    gguf_quantize_act_f32(x, K, T, K, s->xq, s->xd, s->xs, 1);
    if (any_q4(l)) gguf_pair_activations(s->xq, T * K, xp);
}

/* One linear in the region: thread 0 quantizes (and pairs) x, then every thread takes its share of the tiles. */
static void linear_step(SpinBarrier* bar, const GLinear* l, const float* x, int64_t T, int64_t K, float* out,
                        const GScratch* s, int16_t* xp, int tid, int nt, float* acc) {
    if (tid == 0) quantize_for(l, x, T, K, s, xp);
    barrier_wait(bar);
    linear_share(l, s->xq, xp, s->xd, s->xs, T, K, out, tid, nt, acc);
    barrier_wait(bar);
}

static int stack_one_region(const GLayer* layers, int n_layers, const GDims* d, int64_t T, const int64_t* positions,
                            const int64_t* slots, const int32_t* block_table, int64_t bt_stride,
                            const int32_t* seq_lens, const int64_t* tok_idx, float* hidden, float* residual,
                            const GScratch* s, int nt) {
    const int64_t H = d->hidden, Q = (int64_t)d->heads * d->head_size, KV = (int64_t)d->kv_heads * d->head_size;
    const int64_t QKV = Q + 2 * KV, I = d->inter, kmax = H > Q ? (H > I ? H : I) : (Q > I ? Q : I);
    int16_t* xp = aligned_alloc(64, (size_t)(T * kmax * (int64_t)sizeof(int16_t) + 63) / 64 * 64);
    if (xp == NULL) return -1;
    SpinBarrier bar = {0, 0, 0, nt};
    int failed = 0;
#pragma omp parallel num_threads(nt)
    {
        const int tid = omp_get_thread_num();
        float* acc = aligned_alloc(64, (size_t)T * 32 * sizeof(float));
        if (omp_get_num_threads() != nt || acc == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            for (int li = 0; li < n_layers; li++) {
                const GLayer* L = &layers[li];
                float* q = s->qkv;
                if (tid == 0) {
                    if (li == 0) {
                        memcpy(residual, hidden, (size_t)(T * H) * sizeof(float));
                        rms_norm_f32(hidden, H, NULL, 0, L->in_norm, s->x, H, T, H, d->eps, 1);
                    } else {
                        rms_norm_f32(hidden, H, residual, H, L->in_norm, s->x, H, T, H, d->eps, 1);
                    }
                }
                linear_step(&bar, &L->qkv, s->x, T, H, s->qkv, s, xp, tid, nt, acc);
                if (tid == 0) {
                    rotary_f32(positions, q, QKV, d->heads, q + Q, QKV, d->kv_heads, d->cos_sin, d->head_size,
                               d->rot_dim, T, 1);
                    cache_write(d, L, q + Q, q + Q + KV, QKV, slots, T, KV);
                }
                barrier_wait(&bar);
                const int64_t r0 = T * tid / nt, r1 = T * (tid + 1) / nt;
                if (r1 > r0)
                    attend(d, L, q, QKV, block_table + r0 * bt_stride, bt_stride, seq_lens + r0, tok_idx + r0,
                           s->attn, Q, (int)(r1 - r0), 1);
                barrier_wait(&bar);
                linear_step(&bar, &L->o, s->attn, T, Q, hidden, s, xp, tid, nt, acc);
                if (tid == 0) rms_norm_f32(hidden, H, residual, H, L->post_norm, s->x, H, T, H, d->eps, 1);
                linear_step(&bar, &L->gate_up, s->x, T, H, s->gu, s, xp, tid, nt, acc);
                if (tid == 0) silu_and_mul_f32(s->gu, 2 * I, s->act, I, T, I, 1);
                linear_step(&bar, &L->down, s->act, T, I, hidden, s, xp, tid, nt, acc);
            }
        }
        free(acc);
    }
    free(xp);
    return failed ? -1 : 0;
}

/* hidden [T, H]: the embeddings in, the last layer's MLP output out; residual [T, H]: the residual stream
 * out (the model's final norm adds the two, as in Python). T == the number of decoding requests; token t
 * belongs to request t (tok_idx = 0..T-1). Returns 0, or -1 if a kernel refused its shape. */
int gguf_decode_stack_f32(const GLayer* layers, int n_layers, const GDims* d, int64_t T, const int64_t* positions,
                          const int64_t* slots, const int32_t* block_table, int64_t bt_stride, const int32_t* seq_lens,
                          const int64_t* tok_idx, float* hidden, float* residual, const GScratch* s, int nt) {
    const int64_t H = d->hidden, Q = (int64_t)d->heads * d->head_size, KV = (int64_t)d->kv_heads * d->head_size;
    const int64_t QKV = Q + 2 * KV, I = d->inter;
    if (nt > 1 && g_one_region && gguf_isa() == 2 && gguf_set_tile(-1)) {
        int ok = paged_decode_f32(NULL, 0, NULL, NULL, NULL, 0, NULL, NULL, NULL, 0, 0, d->heads, d->kv_heads,
                                  d->head_size, d->block_size, d->scale, 0, 1) == 0; /* (shape checks only) */
        for (int li = 0; ok && li < n_layers; li++)
            ok = all_tiled(&layers[li].qkv) && all_tiled(&layers[li].o) && all_tiled(&layers[li].gate_up) &&
                 all_tiled(&layers[li].down);
        if (ok)
            return stack_one_region(layers, n_layers, d, T, positions, slots, block_table, bt_stride, seq_lens,
                                    tok_idx, hidden, residual, s, nt);
    }
    for (int li = 0; li < n_layers; li++) {
        const GLayer* L = &layers[li];
        if (li == 0) { /* residual = embeddings; x = norm(embeddings) */
            memcpy(residual, hidden, (size_t)(T * H) * sizeof(float));
            rms_norm_f32(hidden, H, NULL, 0, L->in_norm, s->x, H, T, H, d->eps, nt);
        } else { /* residual += hidden; x = norm(residual) */
            rms_norm_f32(hidden, H, residual, H, L->in_norm, s->x, H, T, H, d->eps, nt);
        }
        if (linear(&L->qkv, s->x, T, H, s->qkv, s, nt)) return -1;
        float* q = s->qkv;
        float* k = s->qkv + Q;
        float* v = s->qkv + Q + KV;
        rotary_f32(positions, q, QKV, d->heads, k, QKV, d->kv_heads, d->cos_sin, d->head_size, d->rot_dim, T, nt);
        cache_write(d, L, k, v, QKV, slots, T, KV);
        if (attend(d, L, q, QKV, block_table, bt_stride, seq_lens, tok_idx, s->attn, Q, (int)T, nt)) return -1;
        if (linear(&L->o, s->attn, T, Q, hidden, s, nt)) return -1;
        rms_norm_f32(hidden, H, residual, H, L->post_norm, s->x, H, T, H, d->eps, nt);
        if (linear(&L->gate_up, s->x, T, H, s->gu, s, nt)) return -1;
        silu_and_mul_f32(s->gu, 2 * I, s->act, I, T, I, nt);
        if (linear(&L->down, s->act, T, I, hidden, s, nt)) return -1;
    }
    return 0;
}
