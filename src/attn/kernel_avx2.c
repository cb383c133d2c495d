/*
 * kernel_avx2.c -- AVX2/FMA/F16C tile kernels of the attention. Same math,
 * same folding and same order of tiles as kernel_ref.c (the oracle); only
 * the order of the fp32 sums inside a tile differs, so results agree with
 * the reference to ~1e-6 relative. Chosen at run time (attn_dispatch.c) when the CPU
 * has AVX2, FMA and F16C and D % 16 == 0.
 *
 * Register blocking (16 ymm registers):
 *   token-major K (fp16 pages, per-token formats): 4 tokens x 1-2 query
 *     rows, or 2 tokens x up to 6 rows, of 8-channel partial dots, reduced
 *     with hadd at the end;
 *   KVarN K (channel-major codes): 16 tokens x up to 6 rows, one broadcast
 *     of (q_d * a_d) per row and channel, codes unpacked once per channel
 *     for each block of rows (a decode step's GQA group of up to 6 shares
 *     one pass over the tile);
 *   V (all formats, token-major): 16 channels x up to 6 rows, one broadcast
 *     weight per row and token.
 * Each block of up to 6 rows goes through a tile (or span) start to end,
 * scores, softmax and values, before the next block (kv_rows, tm_rows):
 * its queries, scores and accumulators stay in L1 with the tile's codes.
 * Codes are unpacked in registers (broadcast, variable shift, mask,
 * int -> float); fp16 goes through F16C; FP8 E5M2 is the top byte of an
 * fp16, FP8 E4M3 becomes an fp16 of 2^-8 times its value by moving its bits
 * (the 2^8 is folded into the scale). Nothing is expanded to memory,
 * except for items of ATTN_SPAN_F32_MIN_ROWS rows or more: a per-token span's (or
 * fp16 page's) codes converted to fp32 once, K channel-major, in r->mat
 * (tm_span: 16 tokens x up to 6 rows, no horizontal sums).
 * The score loops also issue the software prefetches of the next tiles
 * (attn_prefetch_step, attn_internal.h).
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "attn/attn_internal.h"
#include "attn/transpose8.h"

#define AI static inline __attribute__((always_inline))

/* ------------------------------------------------------------ helpers */

AI float hsum8(__m256 v)
{
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

AI float hmax8(__m256 v)
{
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* exp(x) for x <= 0: 2^n * P(r), n = round(x / ln 2), r = x - n ln 2 split
 * in two parts (Cody-Waite), P the degree-7 Taylor polynomial (relative
 * error < 2e-7 on |r| <= ln2/2). x below -87 gives ~1e-38 (callers mask
 * the positions that must be exactly 0). */
AI __m256 exp256(__m256 x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

AI uint32_t load_u32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* fp16 [n] (n % 8 == 0) at a possibly unaligned byte address -> fp32. */
static void fp16_array(const uint8_t *src, int n, float *dst)
{
    for (int i = 0; i < n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * i))));
}

/* 16 consecutive codes i0..i0+15 (i0 % 16 == 0) of a packed row -> 2 x 8
 * floats in natural order. */
AI void unpack16(const uint8_t *row, int i0, int bits, __m256 *c0, __m256 *c1)
{
    if (bits == 4) {
        const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        const __m256i mk = _mm256_set1_epi32(15);
        const uint8_t *p = row + i0 / 2;
        __m256i w0 = _mm256_set1_epi32((int)load_u32(p));
        __m256i w1 = _mm256_set1_epi32((int)load_u32(p + 4));
        *c0 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(w0, sh), mk));
        *c1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(w1, sh), mk));
    } else if (bits == 2) {
        const __m256i sh0 = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
        const __m256i sh1 = _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30);
        const __m256i mk = _mm256_set1_epi32(3);
        __m256i w = _mm256_set1_epi32((int)load_u32(row + i0 / 4));
        *c0 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(w, sh0), mk));
        *c1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(w, sh1), mk));
    } else { /* 8 */
        *c0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + i0))));
        *c1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + i0 + 8))));
    }
}

/* 8 elements d..d+7 (d % 8 == 0) of a per-token code array, before scale
 * and zero-point (E4M3: 2^-8 times the value). */
AI __m256 load8(kvarn_kind kind, const uint8_t *codes, int d)
{
    switch (kind) {
    case KVARN_KIND_FP16:
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(codes + 2 * d)));
    case KVARN_KIND_BF16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(codes + 2 * d))), 16));
    case KVARN_KIND_FP8_E4M3: {
        __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(codes + d)));
        __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7f)), 7),
                                 _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8));
        return _mm256_cvtph_ps(h);
    }
    case KVARN_KIND_FP8_E5M2: {
        __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(codes + d)));
        return _mm256_cvtph_ps(_mm_slli_epi16(x, 8));
    }
    case KVARN_KIND_INT8:
        return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + d))));
    case KVARN_KIND_INT4: {
        const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        __m256i w = _mm256_set1_epi32((int)load_u32(codes + d / 2));
        return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(w, sh), _mm256_set1_epi32(15)));
    }
    default:
        return _mm256_setzero_ps();
    }
}

/* Split n rows into balanced blocks of at most max_rb rows. */
AI int block_rows(int n, int max_rb, int r0)
{
    int rest = n - r0;
    int left = (rest + max_rb - 1) / max_rb; /* blocks still to go */
    return (rest + left - 1) / left;
}

/* ------------------------------------------------- online softmax step */

/* Rows [i0, i1) of the span's scores: the running max, sum and acc
 * rescale, s becoming the weights exp(s - m) (0 outside each row's
 * visible positions). */
static void softmax_rows_avx2(attn_rows *r, int t0, int nt, int i0, int i1)
{
    const int D = r->D, gs = r->gs;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (int i = i0; i < i1; i++) {
        float *s = r->s + (size_t)i * gs;
        int a, b;
        if (!attn_row_visible(r, i, t0, nt, &a, &b)) {
            for (int t = 0; t < nt; t += 8) _mm256_storeu_ps(s + t, _mm256_setzero_ps());
            continue;
        }
        const __m256i va = _mm256_set1_epi32(a - 1), vb = _mm256_set1_epi32(b);
        __m256 mx = ninf;
        for (int t = 0; t < nt; t += 8) {
            __m256i idx = _mm256_add_epi32(lane, _mm256_set1_epi32(t));
            __m256 ok = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(idx, va),
                                                             _mm256_cmpgt_epi32(vb, idx)));
            mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + t), ok));
        }
        float mt = hmax8(mx), m_old = r->m[i];
        float m_new = mt > m_old ? mt : m_old;
        float corr = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
        const __m256 vm = _mm256_set1_ps(m_new);
        __m256 sum = _mm256_setzero_ps();
        for (int t = 0; t < nt; t += 8) {
            __m256i idx = _mm256_add_epi32(lane, _mm256_set1_epi32(t));
            __m256 ok = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(idx, va),
                                                             _mm256_cmpgt_epi32(vb, idx)));
            __m256 p = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm)), ok);
            _mm256_storeu_ps(s + t, p);
            sum = _mm256_add_ps(sum, p);
        }
        r->m[i] = m_new;
        r->psum[i] = hsum8(sum);
        r->l[i] = r->l[i] * corr + r->psum[i];
        if (corr != 1.0f) {
            float *acc = r->acc + (size_t)i * D;
            const __m256 vc = _mm256_set1_ps(corr);
            for (int d = 0; d < D; d += 8)
                _mm256_storeu_ps(acc + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), vc));
        }
    }
}

/* Rows [i0, i1) of the weights: p_t scale_t in place, and out[i] =
 * sum_t p_t bias_t (the zero point's or b_t's sum, one constant per row),
 * over whole 8-float vectors of t < nt (past nt the caller's p, scales and
 * biases are 0, or nt % 8 == 0). */
AI void fold_weights(attn_rows *r, int i0, int i1, int nt, const float *scale, const float *bias,
                     float *out)
{
    for (int i = i0; i < i1; i++) {
        float *p = r->s + (size_t)i * r->gs;
        __m256 z = _mm256_setzero_ps();
        for (int t = 0; t < nt; t += 8) {
            __m256 pv = _mm256_loadu_ps(p + t);
            z = _mm256_fmadd_ps(pv, _mm256_loadu_ps(bias + t), z);
            _mm256_storeu_ps(p + t, _mm256_mul_ps(pv, _mm256_loadu_ps(scale + t)));
        }
        out[i] = hsum8(z);
    }
}

/* ------------------------------------------- token-major K: dot products */

/* Scores of tokens [t, t + TB) for rows [r0, r0 + RB): raw q . code.
 * TB * RB + TB <= 16 registers: (TB 4, RB <= 3) or (TB 2, RB <= 6). */
AI void tm_dots(const attn_rows *r, kvarn_kind kind, const uint8_t *const *tok, size_t koff,
                int r0, int RB, int t, int TB, float out[6][4])
{
    const int D = r->D;
    __m256 acc[6][4];
#pragma GCC unroll 6
    for (int i = 0; i < RB; i++)
#pragma GCC unroll 4
        for (int j = 0; j < TB; j++) acc[i][j] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        __m256 kv[4];
#pragma GCC unroll 4
        for (int j = 0; j < TB; j++) kv[j] = load8(kind, tok[t + j] + koff, d);
#pragma GCC unroll 6
        for (int i = 0; i < RB; i++) {
            __m256 qv = _mm256_loadu_ps(r->q + (size_t)(r0 + i) * D + d);
#pragma GCC unroll 4
            for (int j = 0; j < TB; j++) acc[i][j] = _mm256_fmadd_ps(qv, kv[j], acc[i][j]);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < RB; i++) {
        if (TB == 4) {
            __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[i][0], acc[i][1]),
                                      _mm256_hadd_ps(acc[i][2], acc[i][3]));
            __m128 x = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            _mm_storeu_ps(out[i], x);
        } else if (TB == 2) {
            /* hadd: [a01 a23 b01 b23 | a45 a67 b45 b67]; fold the halves */
            __m256 h = _mm256_hadd_ps(acc[i][0], acc[i][1]);
            __m128 x = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            x = _mm_hadd_ps(x, x);
            out[i][0] = _mm_cvtss_f32(x);
            out[i][1] = _mm_cvtss_f32(_mm_shuffle_ps(x, x, 1));
        } else {
            out[i][0] = hsum8(acc[i][0]);
        }
    }
}

/* One block of rows [r0, r0 + RB) over all nt tokens. */
AI void tm_block(attn_rows *r, kvarn_kind kind, const uint8_t *const *tok, size_t koff, int nt,
                 int r0, int RB, int TB)
{
    float out[6][4];
    int t = 0;
    const int per = (attn_prefetch_left(r->pf) * TB + nt - 1) / nt;
    for (; t + TB <= nt; t += TB) {
        attn_prefetch_step(r->pf, per);
        tm_dots(r, kind, tok, koff, r0, RB, t, TB, out);
#pragma GCC unroll 6
        for (int i = 0; i < RB; i++)
            for (int j = 0; j < TB; j++) r->s[(size_t)(r0 + i) * r->gs + t + j] = out[i][j];
    }
    for (; t < nt; t++) {
        tm_dots(r, kind, tok, koff, r0, RB, t, 1, out);
#pragma GCC unroll 6
        for (int i = 0; i < RB; i++) r->s[(size_t)(r0 + i) * r->gs + t] = out[i][0];
    }
}

/* ------------------------------------------------ token-major V: sums */

/* acc[r][d0..d0+16) += sum_t w[r][t] * v_t[d0..d0+16) (+ bias[r]) for rows
 * [r0, r0 + RB), tokens t < nt; the codes from the records, or (vf not
 * NULL) already fp32, vf[nt][D] (tm_span). */
AI void tm_vsum(attn_rows *r, kvarn_kind kind, const uint8_t *const *tok, size_t voff,
                const float *vf, int nt, int r0, int RB, int d0, const float *bias)
{
    const int D = r->D, gs = r->gs;
    __m256 acc[6][2];
#pragma GCC unroll 6
    for (int i = 0; i < RB; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int t = 0; t < nt; t++) {
        __m256 c0, c1;
        if (vf) {
            c0 = _mm256_loadu_ps(vf + (size_t)t * D + d0);
            c1 = _mm256_loadu_ps(vf + (size_t)t * D + d0 + 8);
        } else {
            c0 = load8(kind, tok[t] + voff, d0);
            c1 = load8(kind, tok[t] + voff, d0 + 8);
        }
#pragma GCC unroll 6
        for (int i = 0; i < RB; i++) {
            __m256 w = _mm256_broadcast_ss(r->s + (size_t)(r0 + i) * gs + t);
            acc[i][0] = _mm256_fmadd_ps(w, c0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(w, c1, acc[i][1]);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < RB; i++) {
        float *a = r->acc + (size_t)(r0 + i) * D + d0;
        __m256 b = _mm256_set1_ps(bias ? bias[r0 + i] : 0.0f);
        _mm256_storeu_ps(a, _mm256_add_ps(_mm256_loadu_ps(a), _mm256_add_ps(acc[i][0], b)));
        _mm256_storeu_ps(a + 8, _mm256_add_ps(_mm256_loadu_ps(a + 8), _mm256_add_ps(acc[i][1], b)));
    }
}

/* Rows [r0, r0 + RB) of a span, after their scores: the online-softmax
 * update, the weights p_t vs_t with the zero-point sum pz = sum_t p_t vz_t
 * as one constant per row (vs NULL: weights as they are; bias: vz's pz, or
 * none), then acc += the value sums (from the records, or vf not NULL:
 * fp32 codes [nt][D]). */
AI void tm_rows_values(attn_rows *r, kvarn_kind kind, const uint8_t *const *tok, size_t voff,
                       const float *vf, int t0, int nt, int r0, int RB, const float *vs,
                       const float *vz, int bias)
{
    softmax_rows_avx2(r, t0, nt, r0, r0 + RB);
    float *pz = r->rc;
    if (vs) fold_weights(r, r0, r0 + RB, nt, vs, vz, pz); /* p, vs, vz 0 past nt */
    for (int d0 = 0; d0 < r->D; d0 += 16)
        tm_vsum(r, kind, tok, voff, vf, nt, r0, RB, d0, bias ? pz : NULL);
}

/* Rows [r0, r0 + RB) of a span of nt token-major tokens, start to end:
 * the scores (tm_block: TB tokens a pass), s = kscale_t (q . code_t) +
 * kzero_t qsum (ks NULL: raw dots; kz NULL: no zero point), the
 * online-softmax update, the weights p_t vs_t with the zero-point sum
 * pz = sum_t p_t vz_t as one constant per row (vs NULL: weights as they
 * are; bias: vz's pz, or none), then acc += the value sums. One block at a
 * time, so that its rows' scores and accumulators and the span's codes stay
 * in L1 through all four steps: passes over all rows of an item (up to
 * 512 rows in prefill: 256 KiB of scores alone) streamed them through L2
 * once per pass. Every row's operations are those of the per-pass order. */
AI void tm_rows(attn_rows *r, kvarn_kind kind, const uint8_t *const *tok, size_t koff,
                size_t voff, int t0, int nt, int r0, int RB, int TB, const float *ks,
                const float *kz, const float *vs, const float *vz, int bias)
{
    const int gs = r->gs;
    tm_block(r, kind, tok, koff, nt, r0, RB, TB);
    if (ks) {
        /* Whole vectors: ks/kz are zero past nt, the softmax masks s there. */
        for (int i = r0; i < r0 + RB; i++) {
            float *s = r->s + (size_t)i * gs;
            const __m256 qs = _mm256_set1_ps(kz ? r->qsum[i] : 0.0f);
            for (int t = 0; t < nt; t += 8) {
                __m256 z = kz ? _mm256_mul_ps(_mm256_loadu_ps(kz + t), qs) : _mm256_setzero_ps();
                _mm256_storeu_ps(s + t, _mm256_fmadd_ps(_mm256_loadu_ps(ks + t), _mm256_loadu_ps(s + t), z));
            }
        }
    }
    tm_rows_values(r, kind, tok, voff, NULL, t0, nt, r0, RB, vs, vz, bias);
}

/* ------------------------- channel-major K: items of many rows (prefill) */

/* A span's codes (before scale and zero-point, as load8 gives them) as
 * fp32: K channel-major, kf[d][np] for tokens [0, np), np = nt rounded up
 * to 8, the tokens past nt 0 (8 tokens x 8 channels a step); V as they
 * are, vf[nt][D]. */
AI void tm_codes_f32(kvarn_kind kind, const uint8_t *const *tok, size_t koff, size_t voff, int nt,
                     int D, int np, float *kf, float *vf)
{
    for (int t = 0; t < nt; t++)
        for (int d = 0; d < D; d += 8) _mm256_storeu_ps(vf + (size_t)t * D + d, load8(kind, tok[t] + voff, d));
    for (int t = 0; t < np; t += 8) {
        for (int d = 0; d < D; d += 8) {
            __m256 x[8];
            for (int j = 0; j < 8; j++)
                x[j] = t + j < nt ? load8(kind, tok[t + j] + koff, d) : _mm256_setzero_ps();
            attn_transpose8(x);
            for (int j = 0; j < 8; j++) _mm256_storeu_ps(kf + (size_t)(d + j) * np + t, x[j]);
        }
    }
}

/* Scores of tokens [tb, tb + 8 TW) for rows [r0, r0 + RB) from the
 * channel-major codes: s = ks_t (q . code_t) + kz_t qsum (ks NULL: the raw
 * dots; kz NULL: no zero point), 8 TW tokens x up to 6 rows of
 * accumulators, one broadcast of q[r][d] per row and channel. */
AI void kc_dots(attn_rows *r, const float *kf, int np, int r0, int RB, int tb, int TW,
                const float *ks, const float *kz)
{
    const int D = r->D, gs = r->gs;
    __m256 acc[6][2];
#pragma GCC unroll 6
    for (int i = 0; i < RB; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    const float *kp = kf + tb;
    for (int d = 0; d < D; d++, kp += np) {
        __m256 c0 = _mm256_loadu_ps(kp), c1 = TW == 2 ? _mm256_loadu_ps(kp + 8) : c0;
#pragma GCC unroll 6
        for (int i = 0; i < RB; i++) {
            __m256 w = _mm256_broadcast_ss(r->q + (size_t)(r0 + i) * D + d);
            acc[i][0] = _mm256_fmadd_ps(w, c0, acc[i][0]);
            if (TW == 2) acc[i][1] = _mm256_fmadd_ps(w, c1, acc[i][1]);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < RB; i++) {
        float *s = r->s + (size_t)(r0 + i) * gs + tb;
        const __m256 qs = _mm256_set1_ps(kz ? r->qsum[r0 + i] : 0.0f);
        for (int h = 0; h < TW; h++) {
            __m256 a = acc[i][h];
            if (ks) {
                __m256 z = kz ? _mm256_mul_ps(_mm256_loadu_ps(kz + tb + 8 * h), qs) : _mm256_setzero_ps();
                a = _mm256_fmadd_ps(_mm256_loadu_ps(ks + tb + 8 * h), a, z);
            }
            _mm256_storeu_ps(s + 8 * h, a);
        }
    }
}

/* kc_dots over a span for one block of rows, out of line per row count
 * (kv_rows' reason: the 12 accumulators stay in registers). */
typedef void (*kc_scores_fn)(attn_rows *r, const float *kf, int np, int r0, const float *ks,
                             const float *kz, int per);
#define KC_SCORES_FN(N)                                                                     \
    static __attribute__((noinline)) void kc_scores_##N(attn_rows *r, const float *kf, int np, \
                                                       int r0, const float *ks,              \
                                                       const float *kz, int per)             \
    {                                                                                       \
        int tb = 0;                                                                         \
        for (; tb + 16 <= np; tb += 16) {                                                   \
            attn_prefetch_step(r->pf, per);                                                 \
            kc_dots(r, kf, np, r0, N, tb, 2, ks, kz);                                       \
        }                                                                                   \
        if (tb < np) kc_dots(r, kf, np, r0, N, tb, 1, ks, kz);                              \
    }
KC_SCORES_FN(1)
KC_SCORES_FN(2)
KC_SCORES_FN(3)
KC_SCORES_FN(4)
KC_SCORES_FN(5)
KC_SCORES_FN(6)
static const kc_scores_fn kc_scores[7] = {NULL,         kc_scores_1, kc_scores_2, kc_scores_3,
                                          kc_scores_4, kc_scores_5, kc_scores_6};

/* tm_rows over fp32 codes (tm_codes_f32): the scores from the
 * channel-major K (kc_scores), the same steps after them, V from vf. */
AI void tm_rows_kc(attn_rows *r, kvarn_kind kind, const float *kf, int np, int t0, int nt, int r0,
                   int RB, const float *ks, const float *kz, const float *vs, const float *vz,
                   int bias, int per)
{
    kc_scores[RB](r, kf, np, r0, ks, kz, per);
    tm_rows_values(r, kind, NULL, 0, kf + (size_t)r->D * np, t0, nt, r0, RB, vs, vz, bias);
}

/* A span of nt token-major tokens for all rows: 1 or 2 rows take 4 tokens
 * per score pass, more rows go 2 tokens at a time in blocks of up to 6
 * (measured faster than 4 tokens x 3 rows, which needs 17 registers), so
 * that each code is converted once per block of rows; from ATTN_SPAN_F32_MIN_ROWS
 * rows the codes are converted once per span instead (tm_codes_f32), and
 * the scores take 16 tokens x 6 rows from the channel-major K (bench_attn
 * --queries 512 at KVARN_SIMD=avx2 on AMD Zen 4, int8: 70.5 -> 55.7 ms
 * SmolLM2 heads, 426.6 -> 348.9 ms Llama; docs/attention-simd.md). */
AI void tm_span(attn_rows *r, kvarn_kind kind, const uint8_t *const *tok, size_t koff,
                size_t voff, int t0, int nt, const float *ks, const float *kz, const float *vs,
                const float *vz, int bias)
{
    if (r->n <= 2) {
        if (r->n == 2)
            tm_rows(r, kind, tok, koff, voff, t0, nt, 0, 2, 4, ks, kz, vs, vz, bias);
        else
            tm_rows(r, kind, tok, koff, voff, t0, nt, 0, 1, 4, ks, kz, vs, vz, bias);
        return;
    }
    const int cap = r->mat ? attn_token_matrix_span(r->gs) : 0;
    if (r->n >= ATTN_SPAN_F32_MIN_ROWS && cap >= 8) {
        /* Many rows: the span's codes made fp32 once (K channel-major, V
         * as they are: in r->mat, 2 D cap floats, attn_plan.c), in chunks
         * of cap tokens, each scored 16 tokens x 6 rows a pass with no
         * horizontal sums (kc_dots) and summed with no conversion. */
        float *kf = (float *)(void *)r->mat;
        for (int j0 = 0; j0 < nt; j0 += cap) {
            const int n = nt - j0 < cap ? nt - j0 : cap, np = (n + 7) & ~7;
            tm_codes_f32(kind, tok + j0, koff, voff, n, r->D, np, kf, kf + (size_t)r->D * np);
            const int nblk = (r->n + 5) / 6, steps = nblk * ((np + 15) / 16);
            const int per = (attn_prefetch_left(r->pf) + steps - 1) / steps;
            for (int r0 = 0; r0 < r->n;) {
                int rb = block_rows(r->n, 6, r0);
#define KCALL(N)                                                                               \
    tm_rows_kc(r, kind, kf, np, t0 + j0, n, r0, N, ks ? ks + j0 : NULL,                      \
               kz ? kz + j0 : NULL, vs ? vs + j0 : NULL, vz ? vz + j0 : NULL, bias, per)
                ATTN_RB_SWITCH6(rb, KCALL)
#undef KCALL
                r0 += rb;
            }
        }
        return;
    }
    for (int r0 = 0; r0 < r->n;) {
        int rb = block_rows(r->n, 6, r0);
#define TCALL(N) tm_rows(r, kind, tok, koff, voff, t0, nt, r0, N, 2, ks, kz, vs, vz, bias)
        ATTN_RB_SWITCH6(rb, TCALL)
#undef TCALL
        r0 += rb;
    }
}

/* ---------------------------------------------------------- fp16 pages */

void attn_avx2_fp16_tile(attn_rows *r, const uint16_t *k, const uint16_t *v, int t0, int nt)
{
    /* Token t's K row; its V row is at the same place in the V half. */
    for (int t = 0; t < nt; t++) r->tok[t] = (const uint8_t *)(k + (size_t)t * r->D);
    tm_span(r, KVARN_KIND_FP16, r->tok, 0, (size_t)((const uint8_t *)v - (const uint8_t *)k), t0,
            nt, NULL, NULL, NULL, NULL, 0);
}

/* ----------------------------------------------------- per-token blocks */

/* Per-kind specializations, so that load8's switch folds away. */
#define TOKEN_TILE(NAME, KIND)                                                        \
    void attn_avx2_token_##NAME(attn_rows *r, const kvarn_record_layout *L,           \
                     const uint8_t *const *rec, int t0, int nt)                       \
    {                                                                                 \
        token_tile_body(r, KIND, L, rec, t0, nt);                                     \
    }

AI void token_tile_body(attn_rows *r, kvarn_kind kind, const kvarn_record_layout *L,
                        const uint8_t *const *recs, int t0, int nt)
{
    const int gs = r->gs;
    float *ks = r->meta, *kz = ks + gs, *vs = kz + gs, *vz = vs + gs;
    const int has_zero = L->k_b_bytes != 0, has_scale = L->k_a_bytes != 0;
    /* E4M3 codes load as 2^-8 times their value: fold 2^8 into the scale. */
    const float fix = kind == KVARN_KIND_FP8_E4M3 ? 256.0f : 1.0f;
    if (has_scale) {
        for (int t = 0; t < nt; t++) {
            const uint8_t *rec = recs[t];
            uint16_t h[4] = {0, 0, 0, 0};
            memcpy(&h[0], rec + L->k_a_off, 2);
            memcpy(&h[2], rec + L->v_a_off, 2);
            if (has_zero) {
                memcpy(&h[1], rec + L->k_b_off, 2);
                memcpy(&h[3], rec + L->v_b_off, 2);
            }
            __m128 f = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)h));
            float fv[4];
            _mm_storeu_ps(fv, f);
            ks[t] = fv[0] * fix;
            kz[t] = fv[1];
            vs[t] = fv[2] * fix;
            vz[t] = fv[3];
        }
        for (int t = nt; t < gs; t++) ks[t] = kz[t] = vs[t] = vz[t] = 0.0f;
    }
    tm_span(r, kind, recs, L->k_codes_off, L->v_codes_off, t0, nt, has_scale ? ks : NULL,
            has_scale && has_zero ? kz : NULL, has_scale ? vs : NULL, vz, has_zero);
}

TOKEN_TILE(fp16, KVARN_KIND_FP16)
TOKEN_TILE(bf16, KVARN_KIND_BF16)
TOKEN_TILE(fp8_e4m3, KVARN_KIND_FP8_E4M3)
TOKEN_TILE(fp8_e5m2, KVARN_KIND_FP8_E5M2)
TOKEN_TILE(int8, KVARN_KIND_INT8)
TOKEN_TILE(int4, KVARN_KIND_INT4)

/* --------------------------------------------------------- KVarN records */

/* Scores of tokens [tb, tb + 16) for rows [r0, r0 + RB):
 * s = s_tok * (sum_d qa[r][d] code[d][t] + rc[r]). */
AI void kv_kdots(attn_rows *r, const uint8_t *kc, size_t krow, int kb, const float *stok,
                 int r0, int RB, int tb)
{
    const int D = r->D, gs = r->gs;
    __m256 acc[6][2];
#pragma GCC unroll 6
    for (int i = 0; i < RB; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int d = 0; d < D; d++) {
        __m256 c0, c1;
        unpack16(kc + (size_t)d * krow, tb, kb, &c0, &c1);
#pragma GCC unroll 6
        for (int i = 0; i < RB; i++) {
            __m256 w = _mm256_broadcast_ss(r->qa + (size_t)(r0 + i) * D + d);
            acc[i][0] = _mm256_fmadd_ps(w, c0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(w, c1, acc[i][1]);
        }
    }
    const __m256 s0 = _mm256_loadu_ps(stok + tb), s1 = _mm256_loadu_ps(stok + tb + 8);
#pragma GCC unroll 6
    for (int i = 0; i < RB; i++) {
        __m256 c = _mm256_set1_ps(r->rc[r0 + i]);
        float *s = r->s + (size_t)(r0 + i) * gs + tb;
        _mm256_storeu_ps(s, _mm256_mul_ps(s0, _mm256_add_ps(acc[i][0], c)));
        _mm256_storeu_ps(s + 8, _mm256_mul_ps(s1, _mm256_add_ps(acc[i][1], c)));
    }
}

/* tmp = sum_t w[r][t] code[t][d0..d0+16); acc += s_chan * (tmp + pb[r]). */
AI void kv_vsum(attn_rows *r, const uint8_t *vc, size_t vrow, int vb, int G,
                const float *schan, const float *pb, int r0, int RB, int d0)
{
    const int D = r->D, gs = r->gs;
    __m256 acc[6][2];
#pragma GCC unroll 6
    for (int i = 0; i < RB; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int t = 0; t < G; t++) {
        __m256 c0, c1;
        unpack16(vc + (size_t)t * vrow, d0, vb, &c0, &c1);
#pragma GCC unroll 6
        for (int i = 0; i < RB; i++) {
            __m256 w = _mm256_broadcast_ss(r->s + (size_t)(r0 + i) * gs + t);
            acc[i][0] = _mm256_fmadd_ps(w, c0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(w, c1, acc[i][1]);
        }
    }
    const __m256 s0 = _mm256_loadu_ps(schan + d0), s1 = _mm256_loadu_ps(schan + d0 + 8);
#pragma GCC unroll 6
    for (int i = 0; i < RB; i++) {
        float *a = r->acc + (size_t)(r0 + i) * D + d0;
        __m256 b = _mm256_set1_ps(pb[r0 + i]);
        _mm256_storeu_ps(a, _mm256_fmadd_ps(s0, _mm256_add_ps(acc[i][0], b), _mm256_loadu_ps(a)));
        _mm256_storeu_ps(a + 8, _mm256_fmadd_ps(s1, _mm256_add_ps(acc[i][1], b), _mm256_loadu_ps(a + 8)));
    }
}

/* Rows [r0, r0 + RB) of one tile, start to end: a_d folded into the
 * query (the b_d sum one constant per row), the scores of 16 tokens a pass,
 * the online-softmax update, the weights p_t a_t (the b_t sum one constant
 * per row), then acc += the value sums, 16 channels a pass. One block at a
 * time, so that its rows' queries, scores and accumulators and the tile's
 * codes stay in L1 through all of it: passes over all rows of an item (up
 * to 512 rows in prefill: 256 KiB of scores alone) streamed them through L2
 * once per pass. Every row's operations are those of the per-pass order.
 * r->meta: the tile's metadata as kvarn_tile_body laid it out; per:
 * prefetch lines per score pass. */
AI void kv_rows(attn_rows *r, int t0, int G, const uint8_t *kc, size_t krow, int kb,
                const uint8_t *vc, size_t vrow, int vb, int per, int r0, int RB)
{
    const int D = r->D, gs = r->gs;
    const float *ka = r->meta, *kbias = ka + D, *schan = kbias + D;
    const float *stok = schan + D, *va = stok + gs, *vbias = va + gs;
    for (int i = r0; i < r0 + RB; i++) {
        const float *q = r->q + (size_t)i * D;
        float *qa = r->qa + (size_t)i * D;
        __m256 c = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8) {
            __m256 qv = _mm256_loadu_ps(q + d);
            _mm256_storeu_ps(qa + d, _mm256_mul_ps(qv, _mm256_loadu_ps(ka + d)));
            c = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kbias + d), c);
        }
        r->rc[i] = hsum8(c);
    }
    for (int tb = 0; tb < G; tb += 16) {
        attn_prefetch_step(r->pf, per);
        kv_kdots(r, kc, krow, kb, stok, r0, RB, tb);
    }
    softmax_rows_avx2(r, t0, G, r0, r0 + RB);
    float *pb = r->rc;
    fold_weights(r, r0, r0 + RB, G, va, vbias, pb);
    for (int d0 = 0; d0 < D; d0 += 16) kv_vsum(r, vc, vrow, vb, G, schan, pb, r0, RB, d0);
}

/* kv_rows out of line, one per pair of bit widths and row count (the
 * bit widths stay constants, so unpack16's branches fold away): inlined
 * into the tile body, GCC 12 kept one of the 6-row K loop's 12
 * accumulators on the stack, a load, FMA and store every channel with a
 * register free (objdump), and that chain bounded the loop; alone it keeps
 * them in registers: the same operations, so the same bits, 25-27% less
 * time at bench_attn --queries 512 (KVARN_SIMD=avx2 on AMD Zen 4). */
typedef void (*kv_rows_fn)(attn_rows *r, int t0, int G, const uint8_t *kc, size_t krow,
                           const uint8_t *vc, size_t vrow, int per, int r0);
#define KV_ROWS_FN(KB, VB, N)                                                                      \
    static __attribute__((noinline)) void kv_rows_k##KB##v##VB##_##N(                              \
        attn_rows *r, int t0, int G, const uint8_t *kc, size_t krow, const uint8_t *vc,           \
        size_t vrow, int per, int r0)                                                             \
    {                                                                                             \
        kv_rows(r, t0, G, kc, krow, KB, vc, vrow, VB, per, r0, N);                                 \
    }

/* rows[n]: kv_rows for blocks of n rows (1..6) at this tile's bit widths. */
AI void kvarn_tile_body(attn_rows *r, const kvarn_record_layout *L, const uint8_t *rec,
                        int t0, int kb, int vb, const kv_rows_fn *rows)
{
    const int D = r->D, G = L->tile_tokens, gs = r->gs;
    float *ka = r->meta, *kbias = ka + D, *schan = kbias + D;
    float *stok = schan + D, *va = stok + gs, *vbias = va + gs;
    fp16_array(rec + L->k_a_off, D, ka);
    fp16_array(rec + L->k_b_off, D, kbias);
    fp16_array(rec + L->k_stok_off, G, stok);
    fp16_array(rec + L->v_schan_off, D, schan);
    fp16_array(rec + L->v_a_off, G, va);
    fp16_array(rec + L->v_b_off, G, vbias);
    const uint8_t *kc = rec + L->k_codes_off, *vc = rec + L->v_codes_off;
    const size_t krow = (size_t)G * kb / 8, vrow = (size_t)D * vb / 8;

    /* One block of rows at a time through scores, softmax and values
     * (kv_rows); the next tiles' prefetches spread over every block's
     * score steps. */
    const int nblk = (r->n + 5) / 6, steps = nblk * (G / 16);
    const int per = (attn_prefetch_left(r->pf) + steps - 1) / steps;
    for (int r0 = 0; r0 < r->n;) {
        int rb = block_rows(r->n, 6, r0);
        rows[rb](r, t0, G, kc, krow, vc, vrow, per, r0);
        r0 += rb;
    }
}

/* Specializations on the bit widths, so unpack16's branches fold away. */
#define KVARN_TILE(KB, VB)                                                                  \
    KV_ROWS_FN(KB, VB, 1)                                                                   \
    KV_ROWS_FN(KB, VB, 2)                                                                   \
    KV_ROWS_FN(KB, VB, 3)                                                                   \
    KV_ROWS_FN(KB, VB, 4)                                                                   \
    KV_ROWS_FN(KB, VB, 5)                                                                   \
    KV_ROWS_FN(KB, VB, 6)                                                                   \
    static const kv_rows_fn kv_rows_k##KB##v##VB[7] = {                                     \
        NULL, kv_rows_k##KB##v##VB##_1, kv_rows_k##KB##v##VB##_2, kv_rows_k##KB##v##VB##_3, \
        kv_rows_k##KB##v##VB##_4, kv_rows_k##KB##v##VB##_5, kv_rows_k##KB##v##VB##_6};     \
    static void kvarn_tile_k##KB##v##VB(attn_rows *r, const kvarn_record_layout *L,         \
                                        const uint8_t *rec, int t0)                         \
    {                                                                                       \
        kvarn_tile_body(r, L, rec, t0, KB, VB, kv_rows_k##KB##v##VB);                       \
    }
KVARN_TILE(4, 2)
KVARN_TILE(4, 4)
KVARN_TILE(2, 2)
KVARN_TILE(2, 4)
KVARN_TILE(4, 8)
KVARN_TILE(8, 8)
KVARN_TILE(2, 8)
KVARN_TILE(8, 2)
KVARN_TILE(8, 4)

void attn_avx2_kvarn_tile(attn_rows *r, const kvarn_record_layout *L, const uint8_t *rec,
                            int t0, int nt)
{
    (void)nt; /* committed records are full: nt == G */
    switch (L->key_bits * 10 + L->value_bits) {
    case 42: kvarn_tile_k4v2(r, L, rec, t0); break;
    case 44: kvarn_tile_k4v4(r, L, rec, t0); break;
    case 22: kvarn_tile_k2v2(r, L, rec, t0); break;
    case 24: kvarn_tile_k2v4(r, L, rec, t0); break;
    case 48: kvarn_tile_k4v8(r, L, rec, t0); break;
    case 88: kvarn_tile_k8v8(r, L, rec, t0); break;
    case 28: kvarn_tile_k2v8(r, L, rec, t0); break;
    case 82: kvarn_tile_k8v2(r, L, rec, t0); break;
    case 84: kvarn_tile_k8v4(r, L, rec, t0); break;
    default: attn_ref_kvarn_tile(r, L, rec, t0, nt); break;
    }
}
