/* One query tile of the CPU prefill attention with bfloat16 dot products (`vdpbf16ps`, AVX512-BF16), for a
 * bfloat16 KV cache; the tiles are scheduled by prefill_attn.c, which calls `prefill_dot_tile_*`.
 *
 * Why: on a Zen 4, `vdpbf16ps` does twice the multiply-adds of a float32 FMA per instruction (measured 228
 * against 111 GFLOP/s a core), and the Q.K^T and P.V products are two thirds of a long prefill. The inputs
 * are rounded to bfloat16 as FlashAttention does on a GPU: Q once per tile, P (the softmax numerators,
 * in [0, 1]) before P.V; K and V are bfloat16 already (the cache). Scores, the running max and sum and the
 * output accumulate in float32; the scale is applied to the float32 scores.
 *
 * Layout: as in prefill_attn.c the tile is transposed, rows (query position x group head) along the vector
 * lanes, 16 a zmm. `vdpbf16ps` adds the products of a pair of bfloat16 per 32-bit lane, so operands are
 * pairs along the reduced dimension: Qp[e/2][r] = (q[r][e], q[r][e+1]); a key row of the cache read as
 * 32-bit words is (k[e], k[e+1]) already, broadcast one word to all rows; Pp[j/2][r] = (p[j][r],
 * p[j+1][r]); Vp[j/2][e] = (v[j][e], v[j+1][e]), interleaved per key tile. Q.K^T keeps 8 keys x 3 row
 * vectors of accumulators in registers, P.V 8 head dims x 3 row vectors.
 *
 * Without AVX512-BF16 at build time only `prefill_dot_isa` (returning 0) is compiled.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define DOT_ISA 1
#else
#define DOT_ISA 0
#endif

#define DOT_RV 3              /* zmm vectors of 16 rows per micro-kernel */
#define DOT_RB (16 * DOT_RV)  /* rows per micro-kernel */
#define DOT_KC 8              /* keys (Q.K^T) or head dims (P.V) per micro-kernel */
#define DOT_KB 64             /* keys per tile: a multiple of DOT_KC */
#define DOT_MAX_HEAD 512
#define NEG_BIG (-1e30f)      /* finite -inf (built with -ffast-math), as in prefill_attn.c */

/* Whether this build has the bfloat16 dot-product tiles, and whether they take head size hd. */
int prefill_dot_isa(void) { return DOT_ISA; }
int prefill_dot_supports(int hd) { return DOT_ISA && hd > 0 && hd <= DOT_MAX_HEAD && hd % DOT_KC == 0; }
int prefill_dot_rows_multiple(void) { return DOT_RB; }

#if DOT_ISA

typedef struct {
    uint32_t *Qp, *Pp, *Vp; /* [hd/2][Mp], [KB/2][Mp], [KB/2][hd] */
    float *Ot, *St;         /* [hd][Mp], [KB][Mp] */
    float *m, *l, *mx, *sum, *corr;
    int32_t *rpos, *wlo;
    uint16_t* zero; /* a zero key row, for the keys that pad a tile to DOT_KC */
} DotScratch;

static inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

static inline uint32_t bf16_pair(uint16_t lo, uint16_t hi) { return (uint32_t)lo | (uint32_t)hi << 16; }

void* prefill_dot_scratch(int Mp, int hd) {
    DotScratch* s = calloc(1, sizeof(DotScratch));
    if (s == NULL) return NULL;
    const size_t sizes[] = {(size_t)hd / 2 * Mp, (size_t)DOT_KB / 2 * Mp, (size_t)DOT_KB / 2 * hd, (size_t)hd * Mp,
                            (size_t)DOT_KB * Mp, Mp, Mp, Mp, Mp, Mp, Mp, Mp, (size_t)hd};
    void** ptrs[] = {(void**)&s->Qp, (void**)&s->Pp,  (void**)&s->Vp,   (void**)&s->Ot,   (void**)&s->St,
                     (void**)&s->m,  (void**)&s->l,   (void**)&s->mx,   (void**)&s->sum,  (void**)&s->corr,
                     (void**)&s->rpos, (void**)&s->wlo, (void**)&s->zero};
    int ok = 1;
    for (int i = 0; i < 13; i++) {
        *ptrs[i] = aligned_alloc(64, (sizes[i] * 4 + 63) / 64 * 64);
        ok &= *ptrs[i] != NULL;
    }
    if (ok) memset(s->zero, 0, (size_t)hd * 2);
    if (!ok) {
        void* all[] = {s->Qp, s->Pp, s->Vp, s->Ot, s->St, s->m, s->l, s->mx, s->sum, s->corr, s->rpos, s->wlo, s->zero};
        for (int i = 0; i < 13; i++) free(all[i]);
        free(s);
        return NULL;
    }
    return s;
}

void prefill_dot_scratch_free(void* p) {
    DotScratch* s = p;
    if (s == NULL) return;
    void* all[] = {s->Qp, s->Pp, s->Vp, s->Ot, s->St, s->m, s->l, s->mx, s->sum, s->corr, s->rpos, s->wlo, s->zero};
    for (int i = 0; i < 13; i++) free(all[i]);
    free(s);
}

/* St[j][r] = sum_e q[r][e] k_j[e] for the n8 keys of kp (a multiple of DOT_KC), all Mp rows. */
static void qk_tile(const uint32_t* restrict Qp, int Mp, const uint32_t* const* kp, int hd2, int n8,
                    float* restrict St) {
    for (int rb = 0; rb < Mp; rb += DOT_RB) {
        for (int jb = 0; jb < n8; jb += DOT_KC) {
            __m512 a[DOT_KC][DOT_RV];
            for (int c = 0; c < DOT_KC; c++)
                for (int v = 0; v < DOT_RV; v++) a[c][v] = _mm512_setzero_ps();
            const uint32_t* k[DOT_KC];
            for (int c = 0; c < DOT_KC; c++) k[c] = kp[jb + c];
            for (int e = 0; e < hd2; e++) {
                __m512i q[DOT_RV];
                for (int v = 0; v < DOT_RV; v++) q[v] = _mm512_load_si512(Qp + (int64_t)e * Mp + rb + 16 * v);
                for (int c = 0; c < DOT_KC; c++) {
                    const __m512i b = _mm512_set1_epi32((int)k[c][e]);
                    for (int v = 0; v < DOT_RV; v++)
                        a[c][v] = _mm512_dpbf16_ps(a[c][v], (__m512bh)q[v], (__m512bh)b);
                }
            }
            for (int c = 0; c < DOT_KC; c++)
                for (int v = 0; v < DOT_RV; v++) _mm512_store_ps(St + (int64_t)(jb + c) * Mp + rb + 16 * v, a[c][v]);
        }
    }
}

/* Ot[e][r] += sum_j p[j][r] v[j][e] over n2 key pairs, e < hd (a multiple of DOT_KC). */
static void pv_tile(const uint32_t* restrict Pp, int Mp, const uint32_t* restrict Vp, int hd, int n2,
                    float* restrict Ot) {
    for (int rb = 0; rb < Mp; rb += DOT_RB) {
        for (int eb = 0; eb < hd; eb += DOT_KC) {
            __m512 a[DOT_KC][DOT_RV];
            for (int c = 0; c < DOT_KC; c++)
                for (int v = 0; v < DOT_RV; v++) a[c][v] = _mm512_load_ps(Ot + (int64_t)(eb + c) * Mp + rb + 16 * v);
            for (int j = 0; j < n2; j++) {
                __m512i p[DOT_RV];
                for (int v = 0; v < DOT_RV; v++) p[v] = _mm512_load_si512(Pp + (int64_t)j * Mp + rb + 16 * v);
                const uint32_t* vr = Vp + (int64_t)j * hd + eb;
                for (int c = 0; c < DOT_KC; c++) {
                    const __m512i b = _mm512_set1_epi32((int)vr[c]);
                    for (int v = 0; v < DOT_RV; v++)
                        a[c][v] = _mm512_dpbf16_ps(a[c][v], (__m512bh)p[v], (__m512bh)b);
                }
            }
            for (int c = 0; c < DOT_KC; c++)
                for (int v = 0; v < DOT_RV; v++) _mm512_store_ps(Ot + (int64_t)(eb + c) * Mp + rb + 16 * v, a[c][v]);
        }
    }
}

/* exp(x) for x <= 0 to ~1e-7 relative (P is rounded to bfloat16 next): 2^n * 2^f, n = round(x log2 e),
 * f in [-0.5, 0.5] by a degree-6 polynomial; scalef gives 0 for the masked NEG_BIG scores. */
static inline __m512 exp16(__m512 x) {
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.540353e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022651f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69314718f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* Finite non-negative floats rounded to bfloat16 (nearest-even), kept as float32 bit patterns. */
static inline __m512i bf16_round(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    return _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
}

/* Scale and mask the tile's scores (keys k0 .. k0 + n - 1), update the rows' running max and sum, rescale
 * Ot, and leave P = exp(s - max) rounded to bfloat16 in Pp (pairs of keys; an odd last key pairs with 0).
 * The sum adds the rounded P, so the output is a weighted mean of V with exactly the weights P.V used. */
static void softmax_tile(DotScratch* s, int Mp, int hd, int n, int32_t k0, int need_mask, float scale) {
    float *St = s->St, *m = s->m, *mx = s->mx, *sum = s->sum, *corr = s->corr;
    const int32_t *rpos = s->rpos, *wlo = s->wlo;
    for (int r = 0; r < Mp; r++) mx[r] = m[r];
    for (int j = 0; j < n; j++) {
        float* sj = St + (int64_t)j * Mp;
        const int32_t kp = k0 + j;
        if (need_mask)
            for (int r = 0; r < Mp; r++) sj[r] = (kp > rpos[r] || kp <= wlo[r]) ? NEG_BIG : sj[r] * scale;
        else
            for (int r = 0; r < Mp; r++) sj[r] *= scale;
        for (int r = 0; r < Mp; r++) mx[r] = sj[r] > mx[r] ? sj[r] : mx[r];
    }
    for (int r = 0; r < Mp; r++) {
        corr[r] = expf(m[r] - mx[r]); /* 0 on a row's first visible tile (m = NEG_BIG) */
        m[r] = mx[r];
        sum[r] = 0.f;
    }
    for (int j = 0; j < n; j += 2) {
        const float* s0 = St + (int64_t)j * Mp;
        const float* s1 = s0 + Mp;
        uint32_t* pp = s->Pp + (int64_t)(j / 2) * Mp;
        for (int r = 0; r < Mp; r += 16) { /* Mp is a multiple of 16 */
            const __m512 m16 = _mm512_load_ps(mx + r);
            const __m512i p0 = bf16_round(exp16(_mm512_sub_ps(_mm512_load_ps(s0 + r), m16)));
            const __m512i p1 = j + 1 < n ? bf16_round(exp16(_mm512_sub_ps(_mm512_load_ps(s1 + r), m16)))
                                         : _mm512_setzero_si512();
            /* the rounded values (their low halves are zero) summed; the pair: p0's high half low, p1's high */
            const __m512 t = _mm512_add_ps(_mm512_castsi512_ps(p0), _mm512_castsi512_ps(p1));
            _mm512_store_ps(sum + r, _mm512_add_ps(_mm512_load_ps(sum + r), t));
            _mm512_store_si512(pp + r, _mm512_or_si512(_mm512_srli_epi32(p0, 16), p1));
        }
    }
    for (int r = 0; r < Mp; r++) s->l[r] = s->l[r] * corr[r] + sum[r];
    for (int e = 0; e < hd; e++) {
        float* o = s->Ot + (int64_t)e * Mp;
        for (int r = 0; r < Mp; r++) o[r] *= corr[r];
    }
}

/* The key-row pointers of keys k0 .. k0 + n - 1 (padded with the zero row to n8) and their V pairs. */
static void load_kv(DotScratch* s, const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* bt, int32_t k0,
                    int n, int n8, int kv, int kvh, int hd, int bs, const uint32_t** kp) {
    const int64_t row = (int64_t)kvh * hd;
    for (int j = 0; j < n8; j++) {
        const int32_t p = k0 + j;
        kp[j] = (const uint32_t*)(j < n ? k_cache + ((int64_t)bt[p / bs] * bs + p % bs) * row + (int64_t)kv * hd
                                        : s->zero);
    }
    for (int j = 0; j < n; j += 2) {
        const int32_t p = k0 + j;
        const uint16_t* v0 = v_cache + ((int64_t)bt[p / bs] * bs + p % bs) * row + (int64_t)kv * hd;
        const uint16_t* v1 =
            j + 1 < n ? v_cache + ((int64_t)bt[(p + 1) / bs] * bs + (p + 1) % bs) * row + (int64_t)kv * hd : s->zero;
        uint32_t* vp = s->Vp + (int64_t)(j / 2) * hd;
        for (int e = 0; e < hd; e++) vp[e] = bf16_pair(v0[e], v1[e]);
    }
}

/* One query tile: positions p0 .. p0 + qb - 1 of one request (rows tok0 ..), the g heads of kv head kv,
 * over keys up to p0 + qb - 1 (from max(0, p0 - window + 1) with a sliding window). */
#define DEFINE_DOT_TILE(SUFFIX, T, TO_BF16, STORE)                                                          \
    void prefill_dot_tile_##SUFFIX(void* scratch, const T* q, int64_t q_stride_t, const uint16_t* k_cache,   \
                                   const uint16_t* v_cache, const int32_t* bt, int64_t tok0, int32_t p0,     \
                                   int qb, int kv, T* out, int64_t o_stride_t, int g, int kvh, int hd, int bs, \
                                   float scale, int32_t window) {                                           \
        DotScratch* s = scratch;                                                                            \
        const int M = qb * g, Mp = round_up(M, DOT_RB), hd2 = hd / 2;                                        \
        const int32_t p_last = p0 + qb - 1;                                                                  \
        memset(s->Ot, 0, sizeof(float) * (size_t)hd * Mp);                                                  \
        for (int r = 0; r < Mp; r++) {                                                                      \
            const int i = r < M ? r / g : qb - 1; /* padding rows: zero queries at the last position */      \
            s->rpos[r] = p0 + i;                                                                            \
            s->wlo[r] = window > 0 ? p0 + i - window : -1; /* keys <= wlo are outside the window */         \
            s->m[r] = NEG_BIG;                                                                              \
            s->l[r] = 0.f;                                                                                  \
            const T* qr = q + (tok0 + i) * q_stride_t + (int64_t)(kv * g + r % g) * hd;                     \
            for (int e = 0; e < hd2; e++)                                                                   \
                s->Qp[(int64_t)e * Mp + r] = r < M ? bf16_pair(TO_BF16(qr[2 * e]), TO_BF16(qr[2 * e + 1])) : 0; \
        }                                                                                                   \
        int32_t start = 0;                                                                                  \
        if (window > 0 && p0 - window + 1 > 0) start = p0 - window + 1;                                     \
        const int32_t nkeys = p_last + 1 - start;                                                           \
        const uint32_t* kp[DOT_KB];                                                                         \
        for (int32_t k0 = start, n = nkeys % DOT_KB ? nkeys % DOT_KB : DOT_KB; k0 <= p_last; k0 += n, n = DOT_KB) { \
            const int n8 = round_up(n, DOT_KC);                                                             \
            const int need_mask = k0 + n - 1 > p0 || (window > 0 && k0 <= p_last - window);                \
            load_kv(s, k_cache, v_cache, bt, k0, n, n8, kv, kvh, hd, bs, kp);                               \
            qk_tile(s->Qp, Mp, kp, hd2, n8, s->St);                                                         \
            softmax_tile(s, Mp, hd, n, k0, need_mask, scale);                                               \
            pv_tile(s->Pp, Mp, s->Vp, hd, (n + 1) / 2, s->Ot);                                              \
        }                                                                                                   \
        for (int r = 0; r < M; r++) {                                                                       \
            const float inv = s->l[r] > 0.f ? 1.f / s->l[r] : 0.f;                                          \
            T* orow = out + (tok0 + r / g) * o_stride_t + (int64_t)(kv * g + r % g) * hd;                   \
            for (int e = 0; e < hd; e++) orow[e] = STORE(s->Ot[(int64_t)e * Mp + r] * inv);                 \
        }                                                                                                   \
    }

#define BF16_ID(x) (x)
DEFINE_DOT_TILE(f32, float, f32_to_bf16, STORE_F32)
DEFINE_DOT_TILE(bf16, uint16_t, BF16_ID, f32_to_bf16)

#endif
