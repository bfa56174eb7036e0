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
#include <stdint.h>
#include <string.h>

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
void gguf_quantize_act_f32(const float* x, int64_t x_stride, int64_t M, int64_t K, int16_t* xq, float* xd,
                           float* xs, int num_threads);
int gguf_mm(int type, const uint8_t* w, int64_t N, int64_t K, const int16_t* xq, const float* xd, const float* xs,
            int64_t M, void* out, int64_t out_stride, int out_bf16, int num_threads);

#define MAX_PARTS 4

/* One linear layer: up to MAX_PARTS packed weights stacked by output rows (mixed block types). */
typedef struct {
    int32_t n_parts;
    int32_t type[MAX_PARTS];
    int64_t rows[MAX_PARTS];
    const uint8_t* w[MAX_PARTS];
} GLinear;

typedef struct {
    const float* in_norm;
    const float* post_norm;
    GLinear qkv, o, gate_up, down;
    float* k_cache; /* [num_blocks, block_size, kv_heads, head_size] */
    float* v_cache;
} GLayer;

typedef struct {
    int32_t hidden, heads, kv_heads, head_size, inter, rot_dim, block_size;
    float eps, scale;
    const float* cos_sin;
} GDims;

/* Scratch: x [T, hidden], qkv [T, q + 2kv], attn [T, q], gu [T, 2 inter], act [T, inter]; xq int16 [T, K],
 * xd / xs [T, K / 32] for the largest K. */
typedef struct {
    float *x, *qkv, *attn, *gu, *act;
    int16_t* xq;
    float *xd, *xs;
} GScratch;

/* out[T, sum(rows)] = x[T, K] @ W.T, as gguf_matmul does it: activations quantized once, one gguf_mm a part. */
static int linear(const GLinear* l, const float* x, int64_t T, int64_t K, float* out, const GScratch* s, int nt) {
    gguf_quantize_act_f32(x, K, T, K, s->xq, s->xd, s->xs, nt);
    int64_t n = 0, start = 0;
    for (int p = 0; p < l->n_parts; p++) n += l->rows[p];
    for (int p = 0; p < l->n_parts; p++) {
        if (gguf_mm(l->type[p], l->w[p], l->rows[p], K, s->xq, s->xd, s->xs, T, out + start, n, 0, nt) != 0)
            return -1;
        start += l->rows[p];
    }
    return 0;
}

/* hidden [T, H]: the embeddings in, the last layer's MLP output out; residual [T, H]: the residual stream
 * out (the model's final norm adds the two, as in Python). T == the number of decoding requests; token t
 * belongs to request t (tok_idx = 0..T-1). Returns 0, or -1 if a kernel refused its shape. */
int gguf_decode_stack_f32(const GLayer* layers, int n_layers, const GDims* d, int64_t T, const int64_t* positions,
                          const int64_t* slots, const int32_t* block_table, int64_t bt_stride, const int32_t* seq_lens,
                          const int64_t* tok_idx, float* hidden, float* residual, const GScratch* s, int nt) {
    const int64_t H = d->hidden, Q = (int64_t)d->heads * d->head_size, KV = (int64_t)d->kv_heads * d->head_size;
    const int64_t QKV = Q + 2 * KV, I = d->inter;
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
        reshape_and_cache_f32(k, QKV, v, QKV, L->k_cache, L->v_cache, slots, T, KV);
        if (paged_decode_f32(q, QKV, L->k_cache, L->v_cache, block_table, bt_stride, seq_lens, tok_idx, s->attn, Q,
                             (int)T, d->heads, d->kv_heads, d->head_size, d->block_size, d->scale, 0, nt))
            return -1;
        if (linear(&L->o, s->attn, T, Q, hidden, s, nt)) return -1;
        rms_norm_f32(hidden, H, residual, H, L->post_norm, s->x, H, T, H, d->eps, nt);
        if (linear(&L->gate_up, s->x, T, H, s->gu, s, nt)) return -1;
        silu_and_mul_f32(s->gu, 2 * I, s->act, I, T, I, nt);
        if (linear(&L->down, s->act, T, I, hidden, s, nt)) return -1;
    }
    return 0;
}
