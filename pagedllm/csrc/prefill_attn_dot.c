/* Work items of the CPU prefill attention with bfloat16 dot products (`vdpbf16ps`, AVX512-BF16), for a
 * bfloat16 KV cache; prefill_attn.c schedules the items and calls `prefill_dot_tile_*` for each.
 *
 * Why: on a Zen 4, `vdpbf16ps` does twice the multiply-adds of a float32 FMA per instruction (measured 228
 * against 111 GFLOP/s a core), and the Q.K^T and P.V products are two thirds of a long prefill. The inputs
 * are rounded to bfloat16 as FlashAttention does on a GPU: float32 queries once, P (the softmax numerators)
 * before P.V; K and V are bfloat16 already (the cache). Scores, the running max and sum and the output stay
 * float32, and the softmax scale is applied to the float32 scores (in the exponent).
 *
 * Layout: as in prefill_attn.c a tile is transposed, rows (query position x group head) along the vector
 * lanes, 16 a zmm. `vdpbf16ps` adds the products of a pair of bfloat16 per 32-bit lane, so operands are
 * pairs along the reduced dimension: Qp[e/2][r] = (q[r][e], q[r][e+1]); a key row of the cache read as
 * 32-bit words is (k[e], k[e+1]) already, broadcast one word to all rows; Pp[j/2][r] = (p[j][r],
 * p[j+1][r]); Vp[j/2][e] = (v[j][e], v[j+1][e]), interleaved per key tile. Q.K^T keeps 8 keys x 3 row
 * vectors of accumulators in registers, P.V 8 head dims x 3 row vectors.
 *
 * A work item is up to 4 (or 8: prefill_attn.c's `item_rows`) sub-tiles of ~96 rows (consecutive positions)
 * that share each key tile: its key rows are fetched and its V pairs built once for all of them (fetching
 * them per 96 rows was cache-miss bound). The running max moves only when a score exceeds it by LAZY_RESCALE, so most key tiles skip the
 * rescale of the output rows (P then stays <= e^8, well inside bfloat16's range).
 *
 * Without AVX512-BF16 at build time only `prefill_dot_supports` (always 0) is compiled.
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

/* Whether this build has the bfloat16 dot-product tiles and they take head size hd. */
int prefill_dot_supports(int hd) { return DOT_ISA && hd > 0 && hd <= DOT_MAX_HEAD && hd % DOT_KC == 0; }

#if DOT_ISA

#define DOT_SUB_ROWS 96 /* rows per sub-tile: the query tiles an item's key tiles are shared by */
#define DOT_MAX_SUB 16  /* sub-tiles an item may have (prefill_attn.c's 768-row items of a large group) */
#define LAZY_RESCALE 8.f /* a row's running max moves only when a score exceeds it by this (P <= e^8) */

/* A thread's scratch: per sub-tile s, rows row0[s] .. of the arrays sized for R rows in all. */
typedef struct {
    int R, hd;
    uint32_t *Qp, *Pp, *Vp; /* [hd/2] per row (sub-tile-major), [KB/2][R], [KB/2][hd] */
    float *Ot, *St;         /* [hd] per row (sub-tile-major), [KB][R] */
    float *m, *l, *mx, *corr;
    int32_t *rpos, *wlo;
    uint16_t* zero; /* a zero key row, for the keys that pad a tile to DOT_KC */
} DotScratch;

static inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

static inline uint32_t bf16_pair(uint16_t lo, uint16_t hi) { return (uint32_t)lo | (uint32_t)hi << 16; }

static void dot_scratch_free(DotScratch* s) {
    void* all[] = {s->Qp, s->Pp, s->Vp, s->Ot, s->St, s->m, s->l, s->mx, s->corr, s->rpos, s->wlo, s->zero};
    for (int i = 0; i < 12; i++) free(all[i]);
    free(s);
}

/* Mp: the driver's padded rows of an item (prefill_attn.c); sub-tiles pad each of theirs to DOT_RB. */
void* prefill_dot_scratch(int Mp, int hd) {
    DotScratch* s = calloc(1, sizeof(DotScratch));
    if (s == NULL) return NULL;
    const int R = Mp + DOT_MAX_SUB * DOT_RB;
    s->R = R;
    s->hd = hd;
    const size_t sizes[] = {(size_t)hd / 2 * R, (size_t)DOT_KB / 2 * R, (size_t)DOT_KB / 2 * hd, (size_t)hd * R,
                            (size_t)DOT_KB * R, R, R, R, R, R, R, (size_t)hd};
    void** ptrs[] = {(void**)&s->Qp, (void**)&s->Pp, (void**)&s->Vp,  (void**)&s->Ot,   (void**)&s->St,
                     (void**)&s->m,  (void**)&s->l,  (void**)&s->mx,  (void**)&s->corr, (void**)&s->rpos,
                     (void**)&s->wlo, (void**)&s->zero};
    int ok = 1;
    for (int i = 0; i < 12; i++) {
        *ptrs[i] = aligned_alloc(64, (sizes[i] * 4 + 63) / 64 * 64);
        ok &= *ptrs[i] != NULL;
    }
    if (!ok) {
        dot_scratch_free(s);
        return NULL;
    }
    memset(s->zero, 0, (size_t)hd * 2);
    return s;
}

void prefill_dot_scratch_free(void* p) {
    if (p != NULL) dot_scratch_free(p);
}

/* St[j][r] = sum_e q[r][e] k_j[e] for the n8 keys of kp (a multiple of DOT_KC), all Mp rows; mx (unless NULL,
 * NEG_BIG on entry) gets each row's max over the tile's scores, taken from the registers (a tile that needs no
 * mask: the separate pass over St was ~1/4 of the softmax). */
static void qk_tile(const uint32_t* restrict Qp, int Mp, const uint32_t* const* kp, int hd2, int n8,
                    float* restrict St, float* restrict mx) {
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
            if (mx != NULL)
                for (int v = 0; v < DOT_RV; v++) {
                    __m512 m = _mm512_load_ps(mx + rb + 16 * v);
                    for (int c = 0; c < DOT_KC; c++) m = _mm512_max_ps(m, a[c][v]);
                    _mm512_store_ps(mx + rb + 16 * v, m);
                }
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

/* 2^t for t <= LAZY_RESCALE log2 e, to ~8e-5 relative (P is rounded to bfloat16 next, a relative step of
 * 2^-8): 2^n * 2^f with n = round(t) and f in [-0.5, 0.5] by a degree-3 minimax polynomial; scalef gives 0
 * for the NEG_BIG scores' t. */
static inline __m512 exp2_16(__m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(5.5171661e-2f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24261115f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69326097f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99992806f));
    return _mm512_scalef_ps(p, n);
}

/* One sub-tile's rows: its scratch views. */
typedef struct {
    uint32_t* Qp;
    float *Ot, *m, *l;
    int32_t *rpos, *wlo;
    int M, Mp;             /* rows, padded rows */
    int64_t tok0;          /* its first position's row in the batch */
    int32_t p0, p_last, start; /* positions; first key (a sliding window's start) */
} Sub;

/* Mask the tile's scores (keys k0 .. k0 + n - 1), move the rows' running max where a score exceeds it by
 * more than LAZY_RESCALE (rescaling l and Ot then), and leave P = exp(s - max) rounded to bfloat16 in Pp
 * (pairs of keys; an odd last key pairs with 0). The sum adds the rounded P, so the output is a weighted
 * mean of V with exactly the weights P.V used. need_mask 0: qk_tile left the rows' max in s->mx. */
static void softmax_tile(DotScratch* s, const Sub* t, int hd, int n, int32_t k0, int need_mask, float scale) {
    const int Mp = t->Mp;
    float *St = s->St, *m = t->m, *mx = s->mx, *corr = s->corr;
    const int32_t *rpos = t->rpos, *wlo = t->wlo;
    if (need_mask) {
        for (int r = 0; r < Mp; r++) mx[r] = NEG_BIG;
        for (int j = 0; j < n; j++) {
            float* sj = St + (int64_t)j * Mp;
            const int32_t kp = k0 + j;
            for (int r = 0; r < Mp; r++) sj[r] = (kp > rpos[r] || kp <= wlo[r]) ? NEG_BIG : sj[r];
            for (int r = 0; r < Mp; r++) mx[r] = sj[r] > mx[r] ? sj[r] : mx[r];
        }
    }
    int moved = 0;
    for (int r = 0; r < Mp; r++) {
        const int up = (mx[r] - m[r]) * scale > LAZY_RESCALE; /* always on a row's first visible tile */
        corr[r] = up ? expf((m[r] - mx[r]) * scale) : 1.f;
        m[r] = up ? mx[r] : m[r];
        moved |= up;
    }
    if (moved) {
        for (int r = 0; r < Mp; r++) t->l[r] *= corr[r];
        for (int e = 0; e < hd; e++) {
            float* o = t->Ot + (int64_t)e * Mp;
            for (int r = 0; r < Mp; r++) o[r] *= corr[r];
        }
    }
    /* word i of the converted pair: (p0[i], p1[i]) */
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i ones = _mm512_set1_epi16(0x3f80); /* bfloat16 1.0 in both halves */
    /* P = 2^(s c - m c): the scale (in c = scale x log2 e) folded into one FMA with the row's max. A row
     * that sees no key yet (max NEG_BIG; only with a sliding window) takes m c = 0, so its P are 0 (s c - m c
     * of two NEG_BIG would not cancel exactly). */
    const __m512 c = _mm512_set1_ps(scale * 1.44269504089f);
    for (int r = 0; r < Mp; r += 16) { /* Mp is a multiple of 16 */
        const __m512 m16 = _mm512_load_ps(m + r);
        const __m512 mc = _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(m16, _mm512_set1_ps(NEG_BIG), _CMP_GT_OQ), m16, c);
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < n; j += 2) {
            const __m512 p0 = exp2_16(_mm512_fmsub_ps(_mm512_load_ps(St + (int64_t)j * Mp + r), c, mc));
            const __m512 p1 = j + 1 < n ? exp2_16(_mm512_fmsub_ps(_mm512_load_ps(St + (int64_t)(j + 1) * Mp + r), c, mc))
                                        : _mm512_setzero_ps();
            const __m512i pair = _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
            sum = _mm512_dpbf16_ps(sum, (__m512bh)pair, (__m512bh)ones); /* + the two rounded P, exactly */
            _mm512_store_si512(s->Pp + (int64_t)(j / 2) * Mp + r, pair);
        }
        _mm512_store_ps(t->l + r, _mm512_add_ps(_mm512_load_ps(t->l + r), sum));
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

/* One work item: positions p0 .. p0 + qb - 1 of one request (rows tok0 ..), the g heads of kv head kv, in
 * sub-tiles of about DOT_SUB_ROWS rows that share each key tile (loaded once for all of them, then in cache):
 * a sub-tile's queries see keys from max(0, position - window + 1) to their position. */
#define DEFINE_DOT_TILE(SUFFIX, T, TO_BF16, STORE)                                                          \
    void prefill_dot_tile_##SUFFIX(void* scratch, const T* q, int64_t q_stride_t, const uint16_t* k_cache,   \
                                   const uint16_t* v_cache, const int32_t* bt, int64_t tok0, int32_t p0,     \
                                   int qb, int kv, T* out, int64_t o_stride_t, int g, int kvh, int hd, int bs, \
                                   float scale, int32_t window) {                                           \
        DotScratch* s = scratch;                                                                            \
        const int hd2 = hd / 2, sub_qb = DOT_SUB_ROWS / g > 1 ? DOT_SUB_ROWS / g : 1;                       \
        Sub subs[DOT_MAX_SUB] = {0};                                                                        \
        int nsub = 0, row0 = 0;                                                                             \
        for (int i0 = 0; i0 < qb && nsub < DOT_MAX_SUB; i0 += sub_qb, nsub++) {                             \
            Sub* t = &subs[nsub];                                                                           \
            const int n = qb - i0 < sub_qb ? qb - i0 : sub_qb;                                              \
            t->M = n * g;                                                                                   \
            t->Mp = round_up(t->M, DOT_RB);                                                                 \
            t->Qp = s->Qp + (int64_t)row0 * hd2;                                                            \
            t->Ot = s->Ot + (int64_t)row0 * hd;                                                             \
            t->m = s->m + row0;                                                                             \
            t->l = s->l + row0;                                                                             \
            t->rpos = s->rpos + row0;                                                                       \
            t->wlo = s->wlo + row0;                                                                         \
            t->tok0 = tok0 + i0;                                                                            \
            t->p0 = p0 + i0;                                                                                \
            t->p_last = p0 + i0 + n - 1;                                                                    \
            t->start = window > 0 && t->p0 - window + 1 > 0 ? t->p0 - window + 1 : 0;                       \
            row0 += t->Mp;                                                                                  \
            memset(t->Ot, 0, sizeof(float) * (size_t)hd * t->Mp);                                           \
            for (int r = 0; r < t->Mp; r++) {                                                               \
                const int i = r < t->M ? r / g : n - 1; /* padding rows: zero queries at the last position */ \
                t->rpos[r] = t->p0 + i;                                                                     \
                t->wlo[r] = window > 0 ? t->p0 + i - window : -1; /* keys <= wlo are outside the window */  \
                t->m[r] = NEG_BIG;                                                                          \
                t->l[r] = 0.f;                                                                              \
                const T* qr = q + (t->tok0 + i) * q_stride_t + (int64_t)(kv * g + r % g) * hd;              \
                for (int e = 0; e < hd2; e++)                                                               \
                    t->Qp[(int64_t)e * t->Mp + r] = r < t->M ? bf16_pair(TO_BF16(qr[2 * e]), TO_BF16(qr[2 * e + 1])) : 0; \
            }                                                                                               \
        }                                                                                                   \
        const int32_t first = subs[0].start / DOT_KB * DOT_KB, last = subs[nsub - 1].p_last;                \
        const uint32_t* kp[DOT_KB];                                                                         \
        for (int32_t k0 = first; k0 <= last; k0 += DOT_KB) { /* key tiles aligned to DOT_KB positions */     \
            const int n = last + 1 - k0 < DOT_KB ? last + 1 - k0 : DOT_KB, n8 = round_up(n, DOT_KC);        \
            load_kv(s, k_cache, v_cache, bt, k0, n, n8, kv, kvh, hd, bs, kp);                               \
            for (int si = 0; si < nsub; si++) {                                                             \
                const Sub* t = &subs[si];                                                                   \
                if (k0 > t->p_last || k0 + DOT_KB <= t->start) continue; /* no key of it is visible */      \
                const int tn = t->p_last + 1 - k0 < n ? t->p_last + 1 - k0 : n, tn8 = round_up(tn, DOT_KC);  \
                /* every tile of padded keys (tn < tn8) is the diagonal's, masked */                        \
                const int need_mask = k0 + tn - 1 > t->p0 || k0 < t->start ||                               \
                                      (window > 0 && k0 <= t->p_last - window) || tn < tn8;                 \
                if (!need_mask)                                                                             \
                    for (int r = 0; r < t->Mp; r++) s->mx[r] = NEG_BIG;                                     \
                qk_tile(t->Qp, t->Mp, kp, hd2, tn8, s->St, need_mask ? NULL : s->mx);                       \
                softmax_tile(s, t, hd, tn, k0, need_mask, scale);                                                  \
                pv_tile(s->Pp, t->Mp, s->Vp, hd, (tn + 1) / 2, t->Ot);                                      \
            }                                                                                               \
        }                                                                                                   \
        for (int si = 0; si < nsub; si++) {                                                                 \
            const Sub* t = &subs[si];                                                                       \
            for (int r = 0; r < t->M; r++) {                                                                \
                const float inv = t->l[r] > 0.f ? 1.f / t->l[r] : 0.f;                                      \
                T* orow = out + (t->tok0 + r / g) * o_stride_t + (int64_t)(kv * g + r % g) * hd;            \
                for (int e = 0; e < hd; e++) orow[e] = STORE(t->Ot[(int64_t)e * t->Mp + r] * inv);          \
            }                                                                                               \
        }                                                                                                   \
    }

DEFINE_DOT_TILE(f32, float, f32_to_bf16, STORE_F32)
DEFINE_DOT_TILE(bf16, uint16_t, AS_IS, f32_to_bf16)

#endif
