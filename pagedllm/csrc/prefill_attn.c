/* Blocked (flash-style) causal prefill attention over the paged KV cache, for the CPU backend (called by
 * pagedllm/attention/ops/cpu_prefill_attn.py).
 *
 * Why: torch's CPU SDPA ran prefill at ~6-7 GFLOP/s on a 2-core Zen 3 (a float32 GEMM: ~75), and chunks with
 * a cached prefix first gathered K/V out of the cache and built a dense T x T mask. Here each work item is
 * (request, kv head, query tile): the tile's rows are its QB positions x the g query heads sharing the kv
 * head, so every K/V tile (gathered from the cache and widened to float32 once) serves all of them. Online
 * softmax over key tiles (running max / sum per row), no score matrix beyond one tile, keys past the tile's
 * last position never loaded.
 *
 * Layout trick: the tile is kept transposed, rows (query x head) along the vector lanes: Qt[e][r],
 * St[key][r], Ot[e][r]. Then Q.K^T is "broadcast one K element, FMA into 3 vectors of rows" over 4 keys at
 * once (12 accumulators, the K tile needs no transposition), the softmax's row max / sum are vertical vector
 * ops, and P.V is "broadcast one V element, FMA into 3 vectors of P" over 4 head dims. Written with GCC
 * vector extensions (8 x float32): -march=native turns them into AVX2 FMAs here, SSE/NEON pairs elsewhere.
 *
 * Layouts (row-major, strides in elements):
 *   k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_size] (contiguous)
 *   query / out rows: q + t * q_stride_t + head * head_size (t: the token's row in the flattened batch)
 *   request i: query rows q_start[i] .. q_start[i] + seq_lens[i] - ctx_lens[i] - 1 are positions
 *   ctx_lens[i] .. seq_lens[i] - 1; its K/V (all seq_lens[i] positions) are in the blocks of
 *   block_table[i * bt_stride ...].
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

typedef float v8 __attribute__((vector_size(32)));

#ifndef RV
#define RV 3 /* vectors of 8 rows per micro-kernel */
#endif
#ifndef KR
#define KR 4 /* keys (Q.K^T) or head dims (P.V) per micro-kernel, broadcast */
#endif
#ifndef KB
#define KB 64 /* keys per tile (a multiple of KR) */
#endif
#ifndef ROWS
#define ROWS 48 /* rows (positions x group heads) per query tile, when the group allows */
#endif
#define RB (8 * RV) /* rows per micro-kernel */
#define KBR ((KB + KR - 1) / KR * KR) /* key rows of the tile buffers (a tile is padded to KR keys) */
#define MAX_HEAD 512
#define MAX_GROUP 256
#define NEG_BIG (-1e30f) /* finite -inf: built with -ffast-math (no infinities); expf(NEG_BIG - x) = 0 */

/* Keeps a vector in a register: without it GCC folds the row loads into each FMA's memory operand, 12
 * vector loads per 12 FMAs instead of 3 (load-port bound on Zen 3). */
#if defined(__AVX__) && !defined(NO_PIN)
#define PIN(x) __asm__("" : "+x"(x))
#else
#define PIN(x) ((void)0)
#endif

static inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

/* St[j][r] = sum_e Qt[e][r] * Kf[j][e] for j < n4 (a multiple of KR), all Mp rows (a multiple of RB). */
static void qk_tile(const float* restrict Qt, int Mp, const float* restrict Kf, int hd, int n4,
                    float* restrict St) {
    for (int rb = 0; rb < Mp; rb += RB) {
        for (int jb = 0; jb < n4; jb += KR) {
            v8 a[KR][RV];
            for (int c = 0; c < KR; c++)
                for (int v = 0; v < RV; v++) a[c][v] = (v8){0};
            const float* k = Kf + (int64_t)jb * hd;
            for (int e = 0; e < hd; e++) {
                const v8* qp = (const v8*)(Qt + (int64_t)e * Mp + rb);
                v8 q[RV];
                for (int v = 0; v < RV; v++) {
                    q[v] = qp[v];
                    PIN(q[v]);
                }
                for (int c = 0; c < KR; c++) {
                    const float kc = k[c * hd + e];
                    for (int v = 0; v < RV; v++) a[c][v] += q[v] * kc;
                }
            }
            for (int c = 0; c < KR; c++) {
                v8* sp = (v8*)(St + (int64_t)(jb + c) * Mp + rb);
                for (int v = 0; v < RV; v++) sp[v] = a[c][v];
            }
        }
    }
}

/* Ot[e][r] += sum_{j<n} Pt[j][r] * Vf[j][e], e < hdp (a multiple of KR). */
static void pv_tile(const float* restrict Pt, int Mp, const float* restrict Vf, int hdp, int n,
                    float* restrict Ot) {
    for (int rb = 0; rb < Mp; rb += RB) {
        for (int eb = 0; eb < hdp; eb += KR) {
            v8 a[KR][RV];
            for (int c = 0; c < KR; c++) {
                const v8* op = (const v8*)(Ot + (int64_t)(eb + c) * Mp + rb);
                for (int v = 0; v < RV; v++) a[c][v] = op[v];
            }
            for (int j = 0; j < n; j++) {
                const v8* pp = (const v8*)(Pt + (int64_t)j * Mp + rb);
                v8 p[RV];
                for (int v = 0; v < RV; v++) {
                    p[v] = pp[v];
                    PIN(p[v]);
                }
                const float* vr = Vf + (int64_t)j * hdp + eb;
                for (int c = 0; c < KR; c++)
                    for (int v = 0; v < RV; v++) a[c][v] += p[v] * vr[c];
            }
            for (int c = 0; c < KR; c++) {
                v8* op = (v8*)(Ot + (int64_t)(eb + c) * Mp + rb);
                for (int v = 0; v < RV; v++) op[v] = a[c][v];
            }
        }
    }
}

/* Per-thread scratch, sized for the largest tile of the call; float arrays 32-byte aligned (Mp is a
 * multiple of RB = 24 floats = 96 bytes, so every row of a [x][Mp] array is aligned too). */
typedef struct {
    float *Qt, *Ot, *St, *Kf, *Vf, *m, *l, *mx, *sum, *corr;
    int32_t *rpos, *wlo;
} Scratch;

static int scratch_alloc(Scratch* s, int Mp, int hd, int hdp) {
    const size_t f = sizeof(float);
    size_t sizes[] = {(size_t)hd * Mp, (size_t)hdp * Mp, (size_t)KBR * Mp, (size_t)KBR * hd, (size_t)KBR * hdp,
                      Mp, Mp, Mp, Mp, Mp, Mp, Mp};
    void** ptrs[] = {(void**)&s->Qt, (void**)&s->Ot,  (void**)&s->St,  (void**)&s->Kf,
                     (void**)&s->Vf, (void**)&s->m,   (void**)&s->l,   (void**)&s->mx,
                     (void**)&s->sum, (void**)&s->corr, (void**)&s->rpos, (void**)&s->wlo};
    int ok = 1;
    for (int i = 0; i < 12; i++) {
        *ptrs[i] = aligned_alloc(64, (sizes[i] * f + 63) / 64 * 64);
        ok &= *ptrs[i] != NULL;
    }
    return ok;
}

static void scratch_free(Scratch* s) {
    void* ptrs[] = {s->Qt, s->Ot, s->St, s->Kf, s->Vf, s->m, s->l, s->mx, s->sum, s->corr, s->rpos, s->wlo};
    for (int i = 0; i < 12; i++) free(ptrs[i]);
}

/* The drivers' handles on a thread's scratch (NULL: out of memory). */
static void* scratch_new(int Mp, int hd) {
    Scratch* s = calloc(1, sizeof(Scratch));
    if (s != NULL && !scratch_alloc(s, Mp, hd, round_up(hd, KR))) {
        scratch_free(s);
        free(s);
        return NULL;
    }
    return s;
}

static void scratch_delete(void* s) {
    if (s == NULL) return;
    scratch_free(s);
    free(s);
}

/* Masking, online-softmax update of rows' (m, l) and rescale of Ot, for keys k0 .. k0 + n - 1 in St.
 * Leaves St[j][r] = exp(s - m_new) (P for the tile). */
static void softmax_tile(Scratch* s, int Mp, int hdp, int n, int32_t k0, int need_mask) {
    float *St = s->St, *m = s->m, *mx = s->mx, *sum = s->sum, *corr = s->corr;
    if (need_mask) {
        const int32_t *rpos = s->rpos, *wlo = s->wlo;
        for (int j = 0; j < n; j++) {
            const int32_t kp = k0 + j;
            float* sj = St + (int64_t)j * Mp;
            for (int r = 0; r < Mp; r++) sj[r] = (kp > rpos[r] || kp <= wlo[r]) ? NEG_BIG : sj[r];
        }
    }
    for (int r = 0; r < Mp; r++) mx[r] = m[r];
    for (int j = 0; j < n; j++) {
        const float* sj = St + (int64_t)j * Mp;
        for (int r = 0; r < Mp; r++) mx[r] = sj[r] > mx[r] ? sj[r] : mx[r];
    }
    for (int r = 0; r < Mp; r++) {
        corr[r] = expf(m[r] - mx[r]); /* 0 on a row's first visible tile (m = NEG_BIG) */
        m[r] = mx[r];
        sum[r] = 0.f;
    }
    for (int j = 0; j < n; j++) {
        float* sj = St + (int64_t)j * Mp;
        for (int r = 0; r < Mp; r++) {
            sj[r] = expf(sj[r] - mx[r]); /* vectorised (libmvec) under -ffast-math */
            sum[r] += sj[r];
        }
    }
    for (int r = 0; r < Mp; r++) s->l[r] = s->l[r] * corr[r] + sum[r];
    for (int e = 0; e < hdp; e++) {
        float* o = s->Ot + (int64_t)e * Mp;
        for (int r = 0; r < Mp; r++) o[r] *= corr[r];
    }
}

#define DEFINE_TILE(SUFFIX, T, LOAD, STORE, C, LOADC) /* queries / outputs of T, the cache of C */     \
    /* Cache rows of keys k0 .. k0 + n - 1 of one kv head, widened once: Kf [n4][hd], Vf [n][hdp]. */      \
    static void load_kv_##SUFFIX(Scratch* s, const C* k_cache, const C* v_cache, const int32_t* bt,       \
                                 int32_t k0, int n, int n4, int kv, int kvh, int hd, int hdp, int bs) {   \
        const int64_t row = (int64_t)kvh * hd;                                                            \
        for (int j = 0; j < n; j++) {                                                                     \
            const int32_t p = k0 + j;                                                                     \
            const int64_t off = ((int64_t)bt[p / bs] * bs + p % bs) * row + (int64_t)kv * hd;             \
            const C* kr = k_cache + off;                                                                  \
            const C* vr = v_cache + off;                                                                  \
            float* kf = s->Kf + (int64_t)j * hd;                                                          \
            float* vf = s->Vf + (int64_t)j * hdp;                                                         \
            for (int e = 0; e < hd; e++) kf[e] = LOADC(kr[e]);                                             \
            for (int e = 0; e < hd; e++) vf[e] = LOADC(vr[e]);                                             \
            for (int e = hd; e < hdp; e++) vf[e] = 0.f;                                                   \
        }                                                                                                 \
        memset(s->Kf + (int64_t)n * hd, 0, sizeof(float) * (size_t)(n4 - n) * hd);                        \
    }                                                                                                     \
                                                                                                          \
    /* Positions p0 .. p0 + qb - 1 of one request, the g heads of kv head kv. */                          \
    static void tile_##SUFFIX(void* scratch, const T* q, int64_t q_stride_t, const C* k_cache,              \
                              const C* v_cache, const int32_t* bt, int64_t tok0, int32_t p0, int qb,      \
                              int kv, T* out, int64_t o_stride_t, int g, int kvh, int hd, int bs,         \
                              float scale, int32_t window) {                                              \
        Scratch* s = scratch;                                                                             \
        const int M = qb * g, Mp = round_up(M, RB), hdp = round_up(hd, KR);                               \
        const int32_t p_last = p0 + qb - 1;                                                               \
        memset(s->Qt, 0, sizeof(float) * (size_t)hd * Mp);                                                \
        memset(s->Ot, 0, sizeof(float) * (size_t)hdp * Mp);                                               \
        for (int r = 0; r < Mp; r++) {                                                                    \
            const int i = r < M ? r / g : qb - 1; /* padding rows: zero queries at the last position */   \
            s->rpos[r] = p0 + i;                                                                          \
            s->wlo[r] = window > 0 ? p0 + i - window : -1; /* keys <= wlo are outside the window */       \
            s->m[r] = NEG_BIG;                                                                            \
            s->l[r] = 0.f;                                                                                \
            if (r >= M) continue;                                                                         \
            const T* qr = q + (tok0 + i) * q_stride_t + (int64_t)(kv * g + r % g) * hd;                   \
            for (int e = 0; e < hd; e++) s->Qt[(int64_t)e * Mp + r] = LOAD(qr[e]) * scale;                \
        }                                                                                                 \
        int32_t start = 0;                                                                                \
        if (window > 0 && p0 - window + 1 > 0) start = p0 - window + 1;                                   \
        const int32_t nkeys = p_last + 1 - start;                                                         \
        /* The last tile ends at p_last (the diagonal one), so only it and the first may be partial. */   \
        for (int32_t k0 = start, n = nkeys % KB ? nkeys % KB : KB; k0 <= p_last; k0 += n, n = KB) {       \
            const int n4 = round_up(n, KR);                                                               \
            const int need_mask = k0 + n - 1 > p0 || (window > 0 && k0 <= p_last - window);              \
            load_kv_##SUFFIX(s, k_cache, v_cache, bt, k0, n, n4, kv, kvh, hd, hdp, bs);                   \
            qk_tile(s->Qt, Mp, s->Kf, hd, n4, s->St);                                                     \
            softmax_tile(s, Mp, hdp, n, k0, need_mask);                                                   \
            pv_tile(s->St, Mp, s->Vf, hdp, n, s->Ot);                                                     \
        }                                                                                                 \
        for (int r = 0; r < M; r++) {                                                                     \
            const float inv = s->l[r] > 0.f ? 1.f / s->l[r] : 0.f;                                        \
            T* orow = out + (tok0 + r / g) * o_stride_t + (int64_t)(kv * g + r % g) * hd;                 \
            for (int e = 0; e < hd; e++) orow[e] = STORE(s->Ot[(int64_t)e * Mp + r] * inv);               \
        }                                                                                                 \
    }                                                                                                     \

DEFINE_TILE(f32, float, LOAD_F32, STORE_F32, float, LOAD_F32)
DEFINE_TILE(bf16, uint16_t, bf16_to_f32, f32_to_bf16, uint16_t, bf16_to_f32)
DEFINE_TILE(f32_kbf16, float, LOAD_F32, STORE_F32, uint16_t, bf16_to_f32)

/* Rows per work item: `rows`, or `big` (> rows) where the step still makes at least ITEMS_PER_THREAD items a
 * thread of it (a bigger item shares each key tile's loads among more query rows; too few items would leave
 * a thread idle at the end). */
#define ITEMS_PER_THREAD 4
static int item_rows(int rows, int big, int g, int kvh, const int32_t* ctx_lens, const int32_t* seq_lens,
                     int num_reqs, int num_threads) {
    if (big <= rows) return rows;
    const int qb = big / g > 1 ? big / g : 1;
    int64_t items = 0;
    for (int i = 0; i < num_reqs; i++) items += (int64_t)(seq_lens[i] - ctx_lens[i] + qb - 1) / qb * kvh;
    return items >= (int64_t)ITEMS_PER_THREAD * num_threads ? big : rows;
}

/* The entry points: work items (request, query tile, kv head), a request's last (heaviest) tiles first,
 * spread over the threads; TILE computes one item with a thread's scratch from NEW (rows per tile: QROWS, or
 * QROWS_BIG by `item_rows`, padded to a multiple of RBLK). Queries and outputs are T, the cache is C. */
#define DEFINE_PREFILL(NAME, T, C, TILE, NEW, DEL, QROWS, QROWS_BIG, RBLK)                                  \
    int NAME(const T* q, int64_t q_stride_t, const C* k_cache, const C* v_cache, const int32_t* block_table,  \
             int64_t bt_stride, const int64_t* q_start, const int32_t* ctx_lens, const int32_t* seq_lens,     \
             int num_reqs, T* out, int64_t o_stride_t, int num_heads, int kvh, int hd, int bs, float scale,   \
             int32_t window, int num_threads) {                                                             \
        if (hd > MAX_HEAD || hd < 1 || kvh < 1 || num_heads % kvh != 0 || num_heads / kvh > MAX_GROUP)      \
            return -1;                                                                                      \
        const int g = num_heads / kvh;                                                                      \
        const int qrows = item_rows(QROWS, QROWS_BIG, g, kvh, ctx_lens, seq_lens, num_reqs, num_threads);  \
        const int qb = qrows / g > 1 ? qrows / g : 1; /* positions per query tile */                        \
        const int Mp = round_up(qb * g, RBLK);                                                              \
        int64_t* first = malloc(sizeof(int64_t) * (size_t)(num_reqs + 1));                                 \
        if (first == NULL) return -2;                                                                       \
        first[0] = 0;                                                                                       \
        for (int i = 0; i < num_reqs; i++) {                                                                \
            const int64_t tiles = (seq_lens[i] - ctx_lens[i] + qb - 1) / qb;                                \
            first[i + 1] = first[i] + tiles * kvh;                                                          \
        }                                                                                                   \
        const int64_t items = first[num_reqs];                                                              \
        int failed = 0;                                                                                     \
        _Pragma("omp parallel num_threads(num_threads) reduction(| : failed)") {                            \
            void* s = NEW(Mp, hd);                                                                          \
            failed = s == NULL;                                                                             \
            { /* every thread meets the loop (a worksharing construct); one without scratch skips */         \
                _Pragma("omp for schedule(dynamic, 1)") for (int64_t it = 0; it < items; it++) {            \
                    if (s == NULL) continue;                                                                \
                    int i = 0;                                                                              \
                    while (first[i + 1] <= it) i++;                                                         \
                    const int64_t local = it - first[i];                                                    \
                    const int64_t tiles = (first[i + 1] - first[i]) / kvh;                                  \
                    const int64_t t = tiles - 1 - local / kvh;                                              \
                    const int kv = (int)(local % kvh);                                                      \
                    const int32_t qlen = seq_lens[i] - ctx_lens[i];                                         \
                    const int32_t r0 = (int32_t)(t * qb);                                                   \
                    const int n = qlen - r0 < qb ? qlen - r0 : qb;                                          \
                    TILE(s, q, q_stride_t, k_cache, v_cache, block_table + i * bt_stride, q_start[i] + r0,  \
                         ctx_lens[i] + r0, n, kv, out, o_stride_t, g, kvh, hd, bs, scale, window);          \
                }                                                                                           \
            }                                                                                               \
            DEL(s);                                                                                         \
        }                                                                                                   \
        free(first);                                                                                        \
        return failed ? -2 : 0;                                                                             \
    }

DEFINE_PREFILL(prefill_attn_f32, float, float, tile_f32, scratch_new, scratch_delete, ROWS, 0, RB)
DEFINE_PREFILL(prefill_attn_bf16, uint16_t, uint16_t, tile_bf16, scratch_new, scratch_delete, ROWS, 0, RB)
DEFINE_PREFILL(prefill_attn_f32_kbf16, float, uint16_t, tile_f32_kbf16, scratch_new, scratch_delete, ROWS, 0, RB)

#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* prefill_attn_dot.c: the same tiles with bfloat16 dot products (a bfloat16 cache; see that file). */
#define DOT_ROWS 384 /* rows per work item: 4 sub-tiles of 96 rows sharing each key tile */
#define DOT_ROWS_BIG 768 /* 8 sub-tiles, where there are enough items (one SmolLM2 layer at 8,000 tokens in
                          * chunks of 1,024: 294 -> 276 ms, fewer V pairs built) */
#define DOT_RB 48
void* prefill_dot_scratch(int Mp, int hd);
void prefill_dot_scratch_free(void* s);
void prefill_dot_tile_f32(void* s, const float* q, int64_t q_stride_t, const uint16_t* k_cache,
                          const uint16_t* v_cache, const int32_t* bt, int64_t tok0, int32_t p0, int qb, int kv,
                          float* out, int64_t o_stride_t, int g, int kvh, int hd, int bs, float scale, int32_t window);
void prefill_dot_tile_bf16(void* s, const uint16_t* q, int64_t q_stride_t, const uint16_t* k_cache,
                           const uint16_t* v_cache, const int32_t* bt, int64_t tok0, int32_t p0, int qb, int kv,
                           uint16_t* out, int64_t o_stride_t, int g, int kvh, int hd, int bs, float scale,
                           int32_t window);
DEFINE_PREFILL(prefill_attn_dot_f32, float, uint16_t, prefill_dot_tile_f32, prefill_dot_scratch,
               prefill_dot_scratch_free, DOT_ROWS, DOT_ROWS_BIG, DOT_RB)
DEFINE_PREFILL(prefill_attn_dot_bf16, uint16_t, uint16_t, prefill_dot_tile_bf16, prefill_dot_scratch,
               prefill_dot_scratch_free, DOT_ROWS, DOT_ROWS_BIG, DOT_RB)
#endif
