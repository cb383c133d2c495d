/*
 * kernel_avx512_bf16.c -- the per-token spans of the fp8 (E4M3,
 * E5M2) and bf16 formats for items of ATTN_SPAN_F32_MIN_ROWS rows or more
 * on AVX512-BF16 (vdpbf16ps; compiled with -mavx512bf16, CMakeLists.txt),
 * exporting attn_avx512bf16_token_fp8_e4m3 / _fp8_e5m2 / _bf16.
 * attn_dispatch.c picks them in place of attn_avx512_token_* where
 * kvarn__cpu_avx512_bf16() (common/cpu.h) says the CPU has AVX512-BF16.
 *
 * The structure is kernel_avx512.h tm_span_f32's (chunks of cap =
 * attn_token_matrix_span(gs) tokens in r->mat, blocks of up to 8 rows
 * through scores, softmax and V before the next), with the codes kept as
 * bf16 pairs instead of fp32:
 *   K  32-bit words kp[d/2][np] (np: the chunk's tokens rounded up to 8,
 *      the tokens past it 0): word = bf16 of k_t[2j] (low half), k_t[2j+1]
 *      (high half);
 *   V  words vp[t/2][D]: word = v_{2i}[d] (low), v_{2i+1}[d] (high), the
 *      missing odd token 0;
 *   the query as pair words [n][D/2] in r->qa (qa_ready ATTN_QA_NONE after
 *      the call: nothing is kept), the weights as pair words over the front
 *      of the row's r->s.
 * Every fp8 value (E4M3 as load16 gives it, 2^-8 times its value; E5M2) and
 * every bf16 value is exact in bf16: load16's fp32 has its low 16 bits 0,
 * so the bf16 bits are the fp32 bits >> 16, with no rounding.
 *
 * Arithmetic (against the fp32 path, kernel_avx512.h token_tile_body):
 *   scores  the query q_d rounded once to bf16, nearest-even (relative
 *           error <= 2^-8 each: 8 significant bits), times the exact bf16
 *           codes: the products
 *           exact in fp32, the sums fp32 (vdpbf16ps: a pair's two products
 *           added to the fp32 accumulator), then ks_t * dot in fp32;
 *   sums    the weights p_t vs_t (fp32, as fold_weights gives them) rounded
 *           once to bf16, nearest-even (relative error <= 2^-8 each), times
 *           the exact bf16 codes: products exact, fp32 sums.
 *   vdpbf16ps and vcvtne2ps2bf16 treat bf16 denormal inputs as 0 and flush
 *   denormal results (an absolute error below 2^-126 per product: bf16
 *   codes of the bf16 format under 2^-126, a tiny query or weight).
 * A call runs the fp32 path instead where it has fewer than
 * ATTN_SPAN_F32_MIN_ROWS rows, no r->mat, zero-points (none of these kinds
 * has them), any query element not finite or with |q| >= 2^127 (its bf16
 * could round to inf), or any scale not finite.
 */
#define KVARN_AVX512_BF16 1
#include "attn/kernel_avx512.h"
#include "codec/fp_convert.h"

/* acc + the pairwise products of the bf16 pairs of a and b (vdpbf16ps),
 * through inline asm as dot_i16 (kernel_avx512.h): GCC 12's builtin copies
 * and spills the accumulators. */
AI __m512 dot_bf16(__m512 acc, __m512i a, __m512i b)
{
    __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

/* 32 fp32 (x0: lanes 0..15, x1: 16..31) -> 16 words of bf16 pairs
 * (x[2i] low, x[2i + 1] high), rounded to nearest-even. */
AI __m512i pairs_bf16(__m512 x0, __m512 x1)
{
    return (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
}

/* The chunk's codes as bf16 pair words (see the top): K kp[D/2][np],
 * V vp[(n + 1)/2][D]. */
static void bf_codes(kvarn_kind kind, const uint8_t *const *tok, size_t koff, size_t voff, int n,
                     int D, int np, uint32_t *kp, uint32_t *vp)
{
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    for (int i = 0; 2 * i < n; i++) {
        uint32_t *row = vp + (size_t)i * D;
        for (int d = 0; d < D; d += 16) {
            __m512i a = _mm512_castps_si512(load16(kind, tok[2 * i] + voff, d));
            __m512i b = 2 * i + 1 < n ? _mm512_castps_si512(load16(kind, tok[2 * i + 1] + voff, d))
                                      : _mm512_setzero_si512();
            _mm512_storeu_si512(row + d, _mm512_or_si512(_mm512_and_si512(b, hi), _mm512_srli_epi32(a, 16)));
        }
    }
    for (int t = 0; t < np; t += 8) {
        for (int d = 0; d < D; d += 16) {
            __m256 w[8];
            for (int j = 0; j < 8; j++) {
                /* 16 channels -> 16 bf16 = 8 pair words (exact: low halves 0) */
                __m512i x = t + j < n ? _mm512_castps_si512(load16(kind, tok[t + j] + koff, d))
                                      : _mm512_setzero_si512();
                w[j] = _mm256_castsi256_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16)));
            }
            attn_transpose8(w); /* w[m]: pair word d/2 + m of the 8 tokens */
            for (int m = 0; m < 8; m++) _mm256_storeu_ps((float *)(kp + (size_t)(d / 2 + m) * np + t), w[m]);
        }
    }
}

/* Scores of tokens [tb, tb + 16 TW) for rows [r0, r0 + RB) from the pair
 * words (kc_dots' shape): s = ks_t (q . code_t) (ks NULL: the raw dots),
 * the lanes past np masked; qw: the rows' query pair words [n][D/2]. */
AI void bf_dots(attn_rows *r, const uint32_t *kp, const uint32_t *qw, int np, int r0, int RB, int tb,
                int TW, const float *ks)
{
    const int D2 = r->D / 2, gs = r->gs;
    const __mmask16 m0 = lanes(np - tb), m1 = lanes(np - tb - 16);
    __m512 acc[8][2];
#pragma GCC unroll 8
    for (int i = 0; i < RB; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const uint32_t *k = kp + tb;
    for (int j = 0; j < D2; j++, k += np) {
        __m512i c0 = _mm512_maskz_loadu_epi32(m0, k), c1 = TW == 2 ? _mm512_maskz_loadu_epi32(m1, k + 16) : c0;
#pragma GCC unroll 8
        for (int i = 0; i < RB; i++) {
            __m512i w = _mm512_set1_epi32((int)qw[(size_t)(r0 + i) * D2 + j]);
            acc[i][0] = dot_bf16(acc[i][0], c0, w);
            if (TW == 2) acc[i][1] = dot_bf16(acc[i][1], c1, w);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < RB; i++) {
        float *s = r->s + (size_t)(r0 + i) * gs + tb;
        for (int h = 0; h < TW; h++) {
            const __mmask16 m = h ? m1 : m0;
            __m512 a = acc[i][h];
            if (ks) a = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, ks + tb + 16 * h), a);
            _mm512_mask_storeu_ps(s + 16 * h, m, a);
        }
    }
}

typedef void (*bf_scores_fn)(attn_rows *r, const uint32_t *kp, const uint32_t *qw, int np, int r0,
                             const float *ks, int per);
#define BF_SCORES_FN(N)                                                                        \
    NI void bf_scores_##N(attn_rows *r, const uint32_t *kp, const uint32_t *qw, int np, int r0, \
                          const float *ks, int per)                                            \
    {                                                                                          \
        int tb = 0;                                                                            \
        for (; tb + 16 < np; tb += 32) {                                                       \
            attn_prefetch_step(r->pf, per);                                                    \
            bf_dots(r, kp, qw, np, r0, N, tb, 2, ks);                                          \
        }                                                                                      \
        if (tb < np) bf_dots(r, kp, qw, np, r0, N, tb, 1, ks);                                 \
    }
BF_SCORES_FN(1)
BF_SCORES_FN(2)
BF_SCORES_FN(3)
BF_SCORES_FN(4)
BF_SCORES_FN(5)
BF_SCORES_FN(6)
BF_SCORES_FN(7)
BF_SCORES_FN(8)
#undef BF_SCORES_FN

/* acc[r][d0..d0+32) += sum_i pw[r][i] . vp[i][d0..d0+32) for rows
 * [r0, r0 + RB) over np2 pair words; pw: the row's weights as pair words
 * over the front of its s. */
AI void bf_vsum(attn_rows *r, const uint32_t *vp, int np2, int r0, int RB, int d0)
{
    const int D = r->D, gs = r->gs;
    __m512 acc[8][2];
#pragma GCC unroll 8
    for (int i = 0; i < RB; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int p = 0; p < np2; p++) {
        const uint32_t *v = vp + (size_t)p * D + d0;
        __m512i c0 = _mm512_loadu_si512(v), c1 = _mm512_loadu_si512(v + 16);
#pragma GCC unroll 8
        for (int i = 0; i < RB; i++) {
            uint32_t wb;
            memcpy(&wb, r->s + (size_t)(r0 + i) * gs + p, 4);
            __m512i w = _mm512_set1_epi32((int)wb);
            acc[i][0] = dot_bf16(acc[i][0], c0, w);
            acc[i][1] = dot_bf16(acc[i][1], c1, w);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < RB; i++) {
        float *a = r->acc + (size_t)(r0 + i) * D + d0;
        _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), acc[i][0]));
        _mm512_storeu_ps(a + 16, _mm512_add_ps(_mm512_loadu_ps(a + 16), acc[i][1]));
    }
}

#define BF_VSUM_FN(N)                                                                  \
    NI void bf_values_##N(attn_rows *r, const uint32_t *vp, int np2, int r0)           \
    {                                                                                  \
        for (int d0 = 0; d0 < r->D; d0 += 32) bf_vsum(r, vp, np2, r0, N, d0);          \
    }
BF_VSUM_FN(1)
BF_VSUM_FN(2)
BF_VSUM_FN(3)
BF_VSUM_FN(4)
BF_VSUM_FN(5)
BF_VSUM_FN(6)
BF_VSUM_FN(7)
BF_VSUM_FN(8)
#undef BF_VSUM_FN

/* Row i's weights s[0, nv) (nv % 8 == 0) -> bf16 pair words over the
 * front of s: 32 weights a step, both vectors read before the 16 words are
 * written (word t/2 + k <= t for t >= 32: never over weights not yet
 * read). */
AI void bf_weights(float *s, int nv)
{
    for (int t = 0; t < nv; t += 32) {
        __m512 x0 = _mm512_maskz_loadu_ps(lanes(nv - t), s + t);
        __m512 x1 = _mm512_maskz_loadu_ps(lanes(nv - t - 16), s + t + 16);
        _mm512_mask_storeu_epi32(s + t / 2, lanes((nv - t + 1) / 2), pairs_bf16(x0, x1));
    }
}

/* The rows' query as bf16 pair words [n][D/2] in r->qa; 0 (nothing
 * usable) where any element is not finite or |q| >= 2^127. */
static int bf_query(attn_rows *r)
{
    const int D = r->D, n = r->n;
    uint32_t *qw = (uint32_t *)(void *)r->qa;
    const __m512 big = _mm512_set1_ps(0x1p127f);
    for (int i = 0; i < n; i++) {
        const float *q = r->q + (size_t)i * D;
        for (int d = 0; d < D; d += 32) {
            __m512 a = _mm512_loadu_ps(q + d), b = _mm512_loadu_ps(q + d + 16);
            /* NaN compares false */
            if ((__mmask16)(_mm512_cmp_ps_mask(_mm512_abs_ps(a), big, _CMP_LT_OQ) &
                            _mm512_cmp_ps_mask(_mm512_abs_ps(b), big, _CMP_LT_OQ)) != 0xffff)
                return 0;
            _mm512_storeu_si512(qw + (size_t)i * (D / 2) + d / 2, pairs_bf16(a, b));
        }
    }
    return 1;
}

static void bf_token_tile(attn_rows *r, kvarn_kind kind, const kvarn_record_layout *L,
                          const uint8_t *const *tok, int t0, int nt)
{
    const int cap = r->mat ? attn_token_matrix_span(r->gs) : 0;
    token_meta(r, kind, L, tok, nt);
    const int gs = r->gs, D = r->D;
    float *ks = r->meta, *kz = ks + gs, *vs = kz + gs;
    const int has_scale = L->k_a_bytes != 0;
    (void)kz;
    if (r->n < ATTN_SPAN_F32_MIN_ROWS || cap < 16 || L->k_b_bytes != 0 || L->v_b_bytes != 0 ||
        (has_scale && !(kvarn__all_finite(ks, (size_t)nt) && kvarn__all_finite(vs, (size_t)nt))) ||
        !bf_query(r)) {
        r->qa_ready = ATTN_QA_NONE;
        token_tile_rest(r, kind, L, tok, t0, nt);
        return;
    }
    r->qa_ready = ATTN_QA_NONE; /* qa holds this call's bf16 query: not kept */
    const uint32_t *qw = (const uint32_t *)(const void *)r->qa;
    uint32_t *kp = (uint32_t *)(void *)r->mat;
    for (int j0 = 0; j0 < nt; j0 += cap) {
        /* a chunk before the last is cap tokens (a multiple of 32) */
        const int n = nt - j0 < cap ? nt - j0 : cap, np = (n + 7) & ~7, np2 = (n + 1) / 2;
        uint32_t *vp = kp + (size_t)(D / 2) * np;
        bf_codes(kind, tok + j0, L->k_codes_off, L->v_codes_off, n, D, np, kp, vp);
        const float *cks = has_scale ? ks + j0 : NULL, *cvs = has_scale ? vs + j0 : NULL;
        const int steps = (r->n + 7) / 8 * ((np + 31) / 32);
        const int per = (attn_prefetch_left(r->pf) + steps - 1) / steps;
        for (int r0 = 0; r0 < r->n;) {
            const int rb = block_rows(r->n, 8, r0);
#define BSCALL(N) bf_scores_##N(r, kp, qw, np, r0, cks, per)
            ATTN_RB_SWITCH8(rb, BSCALL)
#undef BSCALL
            for (int i = r0; i < r0 + rb; i++) {
                float *s = r->s + (size_t)i * gs;
                softmax_row_avx512(r, i, t0 + j0, n);
                if (cvs) (void)fold_weights(s, cvs, NULL, np);
                bf_weights(s, np);
            }
#define BVCALL(N) bf_values_##N(r, vp, np2, r0)
            ATTN_RB_SWITCH8(rb, BVCALL)
#undef BVCALL
            r0 += rb;
        }
    }
    attn_prefetch_step(r->pf, attn_prefetch_left(r->pf)); /* any left over */
}

#define BF_TOKEN_TILE(NAME, KIND)                                                          \
    void attn_avx512bf16_token_##NAME(attn_rows *r, const kvarn_record_layout *L,          \
                                      const uint8_t *const *rec, int t0, int nt)           \
    {                                                                                      \
        bf_token_tile(r, KIND, L, rec, t0, nt);                                            \
    }

BF_TOKEN_TILE(fp8_e4m3, KVARN_KIND_FP8_E4M3)
BF_TOKEN_TILE(fp8_e5m2, KVARN_KIND_FP8_E5M2)
BF_TOKEN_TILE(bf16, KVARN_KIND_BF16)
