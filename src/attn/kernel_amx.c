/*
 * kernel_amx.c -- the KVarN record kernel of prefill chunks and
 * verification as matrix products on Intel AMX-BF16 tiles (4th generation
 * Xeon and later), for work items of at least ATTN_MATRIX_MIN_ROWS query
 * rows (attn_internal.h); compiled with -mamx-tile -mamx-bf16 and the
 * AVX-512 flags (CMakeLists.txt), and a second time with the tiles
 * emulated in C (kernel_amx_emu.c, amx_tiles.h) so that tests check its
 * logic on any CPU.
 *
 * Per tile (a 128-, 64- or 32-token record, ../shared/spec/KVARN.md
 * "Attention over records"), the keys and values are dequantized once
 * into bf16, k_td = s_tok_t (a_d c_td + b_d) and v_td = s_chan_d (a_t c_td
 * + b_t), each formed in fp32 (one FMA, then the product) and rounded to
 * bf16 (nearest even), as vLLM's bf16 cache holds them; the rows' query is
 * rounded to bf16 once an item (rows_query, shared with the staged
 * tokens' per-token kernel). Then, over all the item's rows, in three
 * passes (each block of 16 rows on the tiles):
 *   scores  S = bf16(q') . bf16(K)              (16 x D) . (D x G), fp32 out
 *   softmax the row's max, then p_t = 2^((S_t - m) log2 e), w_t = bf16(p_t)
 *   sums    O = w . bf16(V)                     (16 x G) . (G x D)
 *           acc_d = corr acc_d + O_d
 * with fp32 sums (TDPBF16PS). The passes run over all rows in turn so that
 * no tile load reads what the instructions just before it stored. The
 * rounding this adds, the statement the tests derive their bounds from
 * (attn.h KVARN_ATTN_ARITH_BF16, matrix_scores and matrix_sums): the
 * query, each key and value and each weight rounded once to bf16
 * (relative error <= 2^-8 each), vLLM's bf16 attention's roundings. An
 * earlier form folded the per-channel key scales into the query per tile
 * and the per-token scales and zero points into the softmax per score
 * (the centred codes exact): its per-score work made the softmax pass the
 * kernel's largest part; dequantizing once per tile moves that work out
 * of the rows' loop (docs/attention-matrix.md). Inputs below 2^-126 read
 * as 0 by the tiles; the softmax and acc stay fp32. A tile whose metadata
 * is not finite, whose keys' bound s_tok (a (2^kb - 1) + b) reaches 2^36,
 * or whose rows reach |q'_d| >= 2^80, runs the fallback kernel (the
 * level's own) instead, as the int16 kernels do: every score then stays
 * below 2^125. (The fp8 and bf16 formats' blocks, below, have no such
 * bound: a bf16 key near 2^127 can overflow a score to +-inf as in the
 * fp32 kernels; the 2^x takes -inf to 0.)
 */
#include <math.h>
#include <string.h>

#include "attn/amx_tiles.h"
#include "attn/attn_internal.h"
#include "codec/fp_convert.h"
#include "codec/pack.h"

#ifdef KVARN_AMX_EMULATE
#define AMX_FN(name) attn_amxemu_##name
#else
#include <immintrin.h>
#define AMX_FN(name) attn_amx_##name
#endif

/* Two rows of n packed codes of `bits` (record.h: low bits first), each
 * with its own scale and zero point, dequantized with per-column scales
 * s: x_ji = s_i fl(a_j c_ji + b_j) (one FMA, then the product), rounded to
 * bf16 (nearest even) in the pair layout of a B operand: out[2 i] = x_0i,
 * out[2 i + 1] = x_1i. n % 16 == 0. */
static void pair_dequant(const uint8_t *r0, const uint8_t *r1, float a0, float b0, float a1, float b1,
                         const float *s, int n, int bits, uint16_t *out)
{
#ifdef KVARN_AMX_EMULATE
    for (int i = 0; i < n; i++) {
        const int sh = (i * bits) % 8, mask = (1 << bits) - 1;
        const int c0 = (r0[(size_t)i * bits / 8] >> sh) & mask, c1 = (r1[(size_t)i * bits / 8] >> sh) & mask;
        out[2 * i] = amx_bf16_of(s[i] * fmaf(a0, (float)c0, b0));
        out[2 * i + 1] = amx_bf16_of(s[i] * fmaf(a1, (float)c1, b1));
    }
#else
    static const int16_t idx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i perm = _mm512_loadu_si512((const void *)idx);
    const __m512 va0 = _mm512_set1_ps(a0), vb0 = _mm512_set1_ps(b0);
    const __m512 va1 = _mm512_set1_ps(a1), vb1 = _mm512_set1_ps(b1);
    for (int i = 0; i < n; i += 16) {
        const __m512 sv = _mm512_loadu_ps(s + i);
        const __m512 x0 = _mm512_mul_ps(sv, _mm512_fmadd_ps(va0, _mm512_cvtepi32_ps(amx_codes16(r0, i, bits)), vb0));
        const __m512 x1 = _mm512_mul_ps(sv, _mm512_fmadd_ps(va1, _mm512_cvtepi32_ps(amx_codes16(r1, i, bits)), vb1));
        /* bf16 of x0 then x1 (16 each), interleaved into pairs */
        _mm512_storeu_si512(out + 2 * i, _mm512_permutexvar_epi16(perm, (__m512i)_mm512_cvtne2ps_pbh(x1, x0)));
    }
#endif
}

/* The record's keys k_td = s_tok_t (a_d c_td + b_d) (c the K codes,
 * record.h: channel d's row of G tokens), rounded to bf16, into the B
 * layout of the score product: kmat[(d / 2) G + t][d % 2]. */
__attribute__((noinline)) static void dequant_k(const uint8_t *kc, int D, int G, int kb, const float *ka,
                                                const float *kbias, const float *stok, uint16_t *kmat)
{
    const size_t krow = (size_t)G * kb / 8;
    for (int d = 0; d < D; d += 2)
        pair_dequant(kc + (size_t)d * krow, kc + (size_t)(d + 1) * krow, ka[d], kbias[d], ka[d + 1],
                     kbias[d + 1], stok, G, kb, kmat + (size_t)d * G);
}

/* The record's values v_td = s_chan_d (a_t c_td + b_t) (c the V codes,
 * token t's row of D channels), rounded to bf16, into the B layout of the
 * value product: vmat[(t / 2) D + d][t % 2]. */
__attribute__((noinline)) static void dequant_v(const uint8_t *vc, int D, int G, int vb, const float *schan,
                                                const float *va, const float *vbias, uint16_t *vmat)
{
    const size_t vrow = (size_t)D * vb / 8;
    for (int t = 0; t < G; t += 2)
        pair_dequant(vc + (size_t)t * vrow, vc + (size_t)(t + 1) * vrow, va[t], vbias[t], va[t + 1],
                     vbias[t + 1], schan, D, vb, vmat + (size_t)t * D);
}

#ifndef KVARN_AMX_EMULATE
/* 2^x on lanes k (0 on the others), for finite x <= 0: x = n + r, n the
 * nearest integer, |r| <= 1/2 exact (x itself when |x| >= 2^23: r = 0);
 * 2^r by a degree-3 polynomial fitted to it on [-1/2, 1/2] (relative
 * error < 7.5e-5 evaluated in fp32: 26 times below the 2^-9 of the
 * weights' bf16 rounding, which the products take anyway, and the same
 * rounding in the row sums l, so the weights' ratios move by less than
 * 1.5e-4); times 2^n by vscalefps, which underflows to 0 below 2^-149
 * however large -n is. The scores are finite (finite metadata,
 * fold_queries' range check), so x is: no -inf to clamp. */
static inline __m512 exp2_512(__mmask16 k, __m512 x, int fine)
{
    /* -inf (a score of the fp8 and bf16 formats' blocks that overflowed)
     * would give roundscale(x) - x = NaN: below -160 every 2^x is 0 here
     * anyway (scalef's result under the smallest denormal); NaN stays NaN */
    x = _mm512_max_ps(_mm512_set1_ps(-160.0f), x);
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    __m512 p;
    if (fine) {
        /* fine: a degree-5 fit, relative error < 2.2e-7 (below 2^-22,
         * evaluated in fp32 with FMA over every r), for the weights of the
         * two-bf16 products (KVARN_ATTN_ARITH_BF16X2, 2^-16), where the
         * degree-3 fit's 7.5e-5 would be the larger rounding */
        p = _mm512_set1_ps(1.3276457320898771e-3f);
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.675540961325169e-3f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.550713464617729e-2f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022120237350464e-1f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.931469440460205e-1f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0000001192092896f));
    } else {
        p = _mm512_set1_ps(5.5171627551317215e-2f);
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.426111400127411e-1f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.932609677314758e-1f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.999280571937561e-1f));
    }
    return _mm512_maskz_scalef_ps(k, p, n);
}

/* bf16 values 16 h .. 16 h + 15 of the 32 in b, as fp32 (exact). */
static inline __m512 amx_bf16_hi_ps(__m512i b, int h)
{
    const __m256i x = h ? _mm512_extracti64x4_epi64(b, 1) : _mm512_castsi512_si256(b);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

/* The lane sums (mx 0) or lane maxima (mx 1) of x[0..15] as one vector:
 * lane j = the sum or max of x[j]'s 16 lanes (in pairs within 128-bit
 * lanes, then across them: 45 operations for 16 rows instead of a
 * reduction of 16 steps each). */
static inline __m512 tree16(const __m512 *x, int mx)
{
#define TREE_OP(a, b) (mx ? _mm512_max_ps((a), (b)) : _mm512_add_ps((a), (b)))
    __m512 p[8], q[4];
    for (int k = 0; k < 8; k++) /* per 128-bit lane: [a0.a2, b0.b2, a1.a3, b1.b3] */
        p[k] = TREE_OP(_mm512_unpacklo_ps(x[2 * k], x[2 * k + 1]), _mm512_unpackhi_ps(x[2 * k], x[2 * k + 1]));
    for (int k = 0; k < 4; k++) /* per 128-bit lane: that lane's results of x[4k .. 4k+3] */
        q[k] = TREE_OP(_mm512_shuffle_ps(p[2 * k], p[2 * k + 1], 0x44),
                       _mm512_shuffle_ps(p[2 * k], p[2 * k + 1], 0xee));
    const __m512 w01 = TREE_OP(_mm512_shuffle_f32x4(q[0], q[1], 0x88), _mm512_shuffle_f32x4(q[0], q[1], 0xdd));
    const __m512 w23 = TREE_OP(_mm512_shuffle_f32x4(q[2], q[3], 0x88), _mm512_shuffle_f32x4(q[2], q[3], 0xdd));
    return TREE_OP(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xdd));
#undef TREE_OP
}
#endif

/* The online-softmax step (attn_internal.h: m, l, psum; acc rescaled) of
 * row i over its tile's score products c [G], of which the first nt are
 * tokens: the scores themselves for a KVarN record (its keys dequantized:
 * stok, kz, va, vbias NULL), else (per-token records) s_t = s_tok_t c_t +
 * kz_t qs, s_tok their K scales, kz their centred K zero points, qs the
 * row's sum_d q'_d (c is overwritten). Writes the weights w_t = bf16(p_t
 * a_t) (a KVarN record: bf16(p_t)) into w [G] (zero where no position is
 * visible; wlo non-NULL: the two bf16 halves of p_t a_t, amx_bf16_split,
 * into w and wlo) and z = sum_t p_t b_t (a KVarN record: 0) into rc_i.
 * G % 32 == 0. */
#ifdef KVARN_AMX_EMULATE
static void softmax_row(attn_rows *r, int i, int t0, int nt, int G, float *c, const float *stok,
                        const float *kz, float qs, const float *va, const float *vbias,
                        uint16_t *w, uint16_t *wlo)
{
    int a, b;
    if (!attn_row_visible(r, i, t0, nt, &a, &b)) {
        memset(w, 0, (size_t)G * sizeof *w);
        if (wlo) memset(wlo, 0, (size_t)G * sizeof *wlo);
        r->rc[i] = 0.0f;
        return;
    }
    const float m_old = r->m[i];
    float mt = -INFINITY;
    for (int t = a; t < b; t++) {
        if (stok) c[t] = stok[t] * c[t] + kz[t] * qs;
        mt = c[t] > mt ? c[t] : mt;
    }
    const float m_new = mt > m_old ? mt : m_old;
    float sum = 0.0f, zz = 0.0f;
    for (int t = 0; t < G; t++) {
        const float p = t >= a && t < b ? expf(c[t] - m_new) : 0.0f;
        sum += p;
        if (vbias) zz += p * vbias[t];
        const float x = va ? p * va[t] : p;
        if (wlo) amx_bf16_split(x, &w[t], &wlo[t]);
        else w[t] = amx_bf16_of(x);
    }
    /* an unchanged max skips the call: expf(0) = 1 */
    const float corr = m_old == -INFINITY ? 0.0f : m_new == m_old ? 1.0f : expf(m_old - m_new);
    r->m[i] = m_new;
    r->psum[i] = sum;
    r->l[i] = r->l[i] * corr + sum;
    r->rc[i] = zz;
    if (corr != 1.0f) {
        float *acc = r->acc + (size_t)i * r->D;
        for (int d = 0; d < r->D; d++) acc[d] *= corr;
    }
}
#endif

#ifndef KVARN_AMX_EMULATE
/* softmax_row for rows [i0, i0 + rb) (rb <= 16) at once, with the same
 * arithmetic but for the order of the row sums: each row's scores and
 * its vector of maxima, the 16 rows' maxima together (tree16), each row's
 * weights and its vectors of sums, the 16 rows' sums together; m, l,
 * psum and rc of the block as vectors, the rescale factor
 * 2^((m_old - m_new) log2 e) of all 16 rows in one exp2_512. c: the
 * block's first row of scores (stride gs), w its weights (stride G; wlo
 * non-NULL: their second bf16 halves, stride G, as softmax_row, and every
 * 2^x by exp2_512's finer fit). */
static inline __attribute__((always_inline)) void softmax_block(attn_rows *r, int i0, int rb, int t0, int nt, int G, float *c, int gs,
                          const float *stok, const float *kz, const float *va, const float *vbias,
                          uint16_t *w, uint16_t *wlo)
{
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 l2e = _mm512_set1_ps(1.44269504088896341f), ninf = _mm512_set1_ps(-INFINITY);
    const __mmask16 valid = (__mmask16)((1u << rb) - 1u);
    const int fine = wlo != NULL;
    __mmask16 ok[16][ATTN_MATRIX_MAX_G / 16];
    __m512 vm[16], vs[16], vz[16];
    __mmask16 seen = 0;
    for (int j = 0; j < 16; j++) {
        vm[j] = ninf;
        vs[j] = vz[j] = _mm512_setzero_ps();
    }
    for (int j = 0; j < rb; j++) {
        const int i = i0 + j;
        float *cj = c + (size_t)j * gs;
        int a, b;
        if (!attn_row_visible(r, i, t0, nt, &a, &b)) {
            memset(w + (size_t)j * G, 0, (size_t)G * sizeof *w);
            if (wlo) memset(wlo + (size_t)j * G, 0, (size_t)G * sizeof *wlo);
            continue;
        }
        seen |= (__mmask16)(1u << j);
        const int full = a == 0 && b == G;
        const __m512i vlo = _mm512_set1_epi32(a - 1), vhi = _mm512_set1_epi32(b);
        const __m512 vqs = _mm512_set1_ps(stok ? r->qsum[i] : 0.0f);
        __m512 mx = ninf;
        for (int t = 0; t < G; t += 16) {
            __mmask16 k = (__mmask16)0xffff;
            if (!full) {
                const __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32(t));
                k = _mm512_cmpgt_epi32_mask(idx, vlo) & _mm512_cmpgt_epi32_mask(vhi, idx);
            }
            __m512 sv = _mm512_loadu_ps(cj + t);
            if (stok) {
                sv = _mm512_fmadd_ps(_mm512_loadu_ps(stok + t), sv, _mm512_mul_ps(_mm512_loadu_ps(kz + t), vqs));
                _mm512_storeu_ps(cj + t, sv);
            }
            mx = _mm512_mask_max_ps(mx, k, mx, sv);
            ok[j][t / 16] = k;
        }
        vm[j] = mx;
    }
    const __m512 m_old = _mm512_mask_loadu_ps(ninf, valid, r->m + i0);
    const __m512 m_new = _mm512_max_ps(tree16(vm, 1), m_old);
    float mn[16];
    _mm512_storeu_ps(mn, _mm512_mul_ps(m_new, l2e));
    for (int j = 0; j < rb; j++) {
        if (!(seen >> j & 1)) continue;
        const float *cj = c + (size_t)j * gs;
        uint16_t *wj = w + (size_t)j * G;
        /* p = 2^((s - m) log2 e): one FMA forms the exponent */
        const __m512 ml2e = _mm512_set1_ps(mn[j]);
        __m512 sum = _mm512_setzero_ps(), z = _mm512_setzero_ps();
        for (int t = 0; t < G; t += 32) {
            const __m512 p0 = exp2_512(ok[j][t / 16], _mm512_fmsub_ps(_mm512_loadu_ps(cj + t), l2e, ml2e), fine);
            const __m512 p1 =
                exp2_512(ok[j][t / 16 + 1], _mm512_fmsub_ps(_mm512_loadu_ps(cj + t + 16), l2e, ml2e), fine);
            sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
            __m512 x0 = p0, x1 = p1;
            if (va) {
                z = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vbias + t), z);
                z = _mm512_fmadd_ps(p1, _mm512_loadu_ps(vbias + t + 16), z);
                x0 = _mm512_mul_ps(p0, _mm512_loadu_ps(va + t));
                x1 = _mm512_mul_ps(p1, _mm512_loadu_ps(va + t + 16));
            }
            const __m512i wb = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
            _mm512_storeu_si512(wj + t, wb);
            if (wlo) /* x - bf16(x) (exact in fp32), rounded to bf16 */
                _mm512_storeu_si512(wlo + (size_t)j * G + t,
                                    (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(x1, amx_bf16_hi_ps(wb, 1)),
                                                                 _mm512_sub_ps(x0, amx_bf16_hi_ps(wb, 0))));
        }
        vs[j] = sum;
        vz[j] = z;
    }
    const __m512 sum = tree16(vs, 0), zz = tree16(vz, 0);
    /* corr: 0 where no score came before (m_old = -inf), 1 where the max
     * did not move (and for rows that see nothing here: m_new = m_old) */
    const __mmask16 moved = _mm512_cmp_ps_mask(m_new, m_old, _CMP_NEQ_OQ) & _mm512_cmp_ps_mask(m_old, ninf, _CMP_NEQ_OQ);
    __m512 corr = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_old, ninf, _CMP_EQ_OQ), _mm512_set1_ps(1.0f),
                                       _mm512_setzero_ps());
    corr = _mm512_mask_mov_ps(corr, moved, exp2_512(moved, _mm512_mul_ps(_mm512_sub_ps(m_old, m_new), l2e), fine));
    const __m512 l_old = _mm512_mask_loadu_ps(_mm512_setzero_ps(), valid, r->l + i0);
    /* rows that see nothing keep m, l and psum, and get rc 0 */
    _mm512_mask_storeu_ps(r->m + i0, valid & seen, m_new);
    _mm512_mask_storeu_ps(r->l + i0, valid & seen, _mm512_fmadd_ps(l_old, corr, sum));
    _mm512_mask_storeu_ps(r->psum + i0, valid & seen, sum);
    _mm512_mask_storeu_ps(r->rc + i0, valid, _mm512_maskz_mov_ps(seen, zz));
    float cf[16];
    _mm512_storeu_ps(cf, corr);
    for (int j = 0; j < rb; j++) {
        if (!(seen >> j & 1) || cf[j] == 1.0f) continue;
        float *acc = r->acc + (size_t)(i0 + j) * r->D;
        const __m512 cv = _mm512_set1_ps(cf[j]);
        for (int d = 0; d < r->D; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), cv));
    }
}
#endif

/* acc[d] += s_chan[d] (o[d] + z), d < D (D % 16 == 0); schan NULL: acc[d]
 * += o[d] + z (per-token records: no channel scale). */
static void acc_update(float *acc, const float *o, const float *schan, float z, int D)
{
#ifdef KVARN_AMX_EMULATE
    for (int d = 0; d < D; d++) acc[d] += schan ? schan[d] * (o[d] + z) : o[d] + z;
#else
    const __m512 vz = _mm512_set1_ps(z);
    for (int d = 0; d < D; d += 16) {
        const __m512 x = _mm512_add_ps(_mm512_loadu_ps(o + d), vz);
        _mm512_storeu_ps(acc + d, _mm512_add_ps(_mm512_loadu_ps(acc + d),
                                                schan ? _mm512_mul_ps(_mm512_loadu_ps(schan + d), x) : x));
    }
#endif
}

/* Every row's query q'_d as one bf16 into aq [n][D] (aqlo non-NULL: as
 * two, amx_bf16_split, the second halves into aqlo). Returns the largest
 * |q'_d| (the callers' range check: below 2^80). */
static float fold_queries(attn_rows *r, uint16_t *aq, uint16_t *aqlo)
{
    const int D = r->D;
#ifdef KVARN_AMX_EMULATE
    float qmax = 0.0f;
    for (int i = 0; i < r->n; i++) {
        float m;
        (void)amx_split_scaled(r->q + (size_t)i * D, NULL, NULL, D, aq + (size_t)i * D,
                               aqlo ? aqlo + (size_t)i * D : NULL, &m);
        qmax = m > qmax ? m : qmax;
    }
    return qmax;
#else
    __m512 mx = _mm512_setzero_ps();
    for (int i = 0; i < r->n; i++) {
        const float *x = r->q + (size_t)i * D;
        uint16_t *h = aq + (size_t)i * D;
        for (int d = 0; d < D; d += 16) {
            const __m512 v = _mm512_loadu_ps(x + d);
            mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
            const __m256i hb = (__m256i)_mm512_cvtneps_pbh(v);
            _mm256_storeu_si256((__m256i *)(h + d), hb);
            if (aqlo) /* v - bf16(v) (exact in fp32), rounded to bf16 */
                _mm256_storeu_si256((__m256i *)(aqlo + (size_t)i * D + d),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(
                                        v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hb), 16)))));
        }
    }
    return _mm512_reduce_max_ps(mx);
#endif
}

/* The rows' bf16 query (x2: and its second halves after it) in r->qa,
 * formed once an item (R x D floats hold 2 nr D halves) and kept while
 * qa_ready says so; a query reaching 2^80 is never kept. Returns whether
 * it is there. */
static int rows_query(attn_rows *r, int x2)
{
    const int want = x2 ? ATTN_QA_BF16X2 : ATTN_QA_BF16;
    if (r->qa_ready == want) return 1;
    r->qa_ready = ATTN_QA_NONE;
    uint16_t *aq = (uint16_t *)(void *)r->qa;
    const float qmax = fold_queries(r, aq, x2 ? aq + (size_t)((r->n + 15) & ~15) * r->D : NULL);
    if (!(qmax < 0x1p80f)) return 0;
    r->qa_ready = want;
    return 1;
}

/* The products and the softmax over a tile of G columns (nt of them
 * tokens) for all r->n rows, in three passes over the rows, so that no
 * tile load reads what the instructions just before it stored (a tile load
 * waits for those stores to reach the cache): the scores of every row
 * (into s, stride gs), the softmax step of every row (softmax_block, 16
 * rows at a time; softmax_row where the tiles are emulated: kz NULL
 * for a KVarN record, else per-token records with the rows' qsum), then
 * the sums (acc_update with schan). aq: the rows' bf16 queries [nr][D];
 * kmat, vmat: the B layouts of the codes; w: the weights' scratch
 * [nr][G]; aqlo, wlo (both NULL, or both scratch of the same shapes):
 * the second bf16 halves of the queries and of the weights, each product
 * then taking both halves (KVARN_ATTN_ARITH_BF16X2). */
static inline __attribute__((always_inline)) void three_passes(attn_rows *r, int t0, int nt, int G, const uint16_t *aq, const uint16_t *aqlo,
                         const uint16_t *kmat, const uint16_t *vmat, uint16_t *w, uint16_t *wlo,
                         const float *stok, const float *kz, const float *va, const float *vbias,
                         const float *schan)
{
    const int D = r->D, n = r->n, gs = r->gs;
    amx_tilecfg cfg;
    amx_config_16x64(&cfg);
    AMX_CONFIG(&cfg);
    for (int r0 = 0; r0 < n; r0 += 16)
        amx_product16(aq + (size_t)r0 * D, aqlo ? aqlo + (size_t)r0 * D : NULL, D, D, kmat, G,
                      r->s + (size_t)r0 * gs, gs);
#ifdef KVARN_AMX_EMULATE
    for (int i = 0; i < n; i++)
        softmax_row(r, i, t0, nt, G, r->s + (size_t)i * gs, stok, kz, kz ? r->qsum[i] : 0.0f, va, vbias,
                    w + (size_t)i * G, wlo ? wlo + (size_t)i * G : NULL);
#else
    for (int r0 = 0; r0 < n; r0 += 16)
        softmax_block(r, r0, n - r0 < 16 ? n - r0 : 16, t0, nt, G, r->s + (size_t)r0 * gs, gs, stok, kz, va,
                      vbias, w + (size_t)r0 * G, wlo ? wlo + (size_t)r0 * G : NULL);
#endif
    float o[16 * ATTN_MATRIX_MAX_D];
    for (int r0 = 0; r0 < n; r0 += 16) {
        const int rb = n - r0 < 16 ? n - r0 : 16;
        amx_product16(w + (size_t)r0 * G, wlo ? wlo + (size_t)r0 * G : NULL, G, G, vmat, D, o, D);
        for (int i = 0; i < rb; i++)
            acc_update(r->acc + (size_t)(r0 + i) * D, o + (size_t)i * D, schan, r->rc[r0 + i], D);
    }
    AMX_RELEASE();
}

void AMX_FN(kvarn_tile)(attn_rows *r, const kvarn_record_layout *L, const uint8_t *rec, int t0,
                        int nt, attn_record_tile_fn fallback)
{
    const int D = r->D, G = L->tile_tokens, gs = r->gs;
    float *ka = r->meta, *kbias = ka + D, *schan = kbias + D;
    float *stok = schan + D, *va = stok + gs, *vbias = va + gs;
    kvarn__fp16_load(rec + L->k_a_off, D, ka);
    kvarn__fp16_load(rec + L->k_b_off, D, kbias);
    kvarn__fp16_load(rec + L->k_stok_off, G, stok);
    kvarn__fp16_load(rec + L->v_schan_off, D, schan);
    kvarn__fp16_load(rec + L->v_a_off, G, va);
    kvarn__fp16_load(rec + L->v_b_off, G, vbias);
    if (!(kvarn__all_finite(ka, (size_t)D) && kvarn__all_finite(kbias, (size_t)D) &&
          kvarn__all_finite(schan, (size_t)D) && kvarn__all_finite(stok, (size_t)G) &&
          kvarn__all_finite(va, (size_t)G) && kvarn__all_finite(vbias, (size_t)G))) {
        r->qa_ready = ATTN_QA_NONE; /* the fallback may use qa */
        fallback(r, L, rec, t0, nt);
        return;
    }
    /* The keys' largest magnitude, bounded by the metadata: with the
     * query below 2^80 and D <= 2^9 every score stays below 2^125 (and
     * every product's bf16 operand finite) */
    float smax = 0.0f, amax = 0.0f, bmax = 0.0f;
    for (int t = 0; t < G; t++) smax = fmaxf(smax, fabsf(stok[t]));
    for (int d = 0; d < D; d++) {
        amax = fmaxf(amax, fabsf(ka[d]));
        bmax = fmaxf(bmax, fabsf(kbias[d]));
    }
    const float kmax = smax * (amax * (float)((1 << L->key_bits) - 1) + bmax);
    /* the rows' bf16 query, once an item (shared with the staged tokens'
     * kernel, token_span); a row reaching 2^80, or keys reaching 2^36,
     * send the tile to the fallback */
    if (!(kmax < 0x1p36f) || !rows_query(r, 0)) {
        r->qa_ready = ATTN_QA_NONE; /* the fallback may use qa */
        fallback(r, L, rec, t0, nt);
        return;
    }
    /* The scratch (attn_internal.h attn_rows.mat): the keys and values in
     * bf16, then every row's weights, for whole blocks of 16 rows (rows n
     * .. nr - 1 hold whatever they hold: they feed only product rows
     * that are never read). */
    uint16_t *kmat = r->mat, *vmat = kmat + (size_t)D * G, *w = vmat + (size_t)D * G;
    attn_prefetch_step(r->pf, attn_prefetch_left(r->pf));
    dequant_k(rec + L->k_codes_off, D, G, L->key_bits, ka, kbias, stok, kmat);
    dequant_v(rec + L->v_codes_off, D, G, L->value_bits, schan, va, vbias, vmat);
    three_passes(r, t0, G, G, (const uint16_t *)(const void *)r->qa, NULL, kmat, vmat, w, NULL, NULL, NULL, NULL,
                 NULL, NULL);
}

/* ------------------------------------------------- per-token records
 *
 * The staged tokens of a KVarN view with int8 or int4 staging (paged.h
 * "Staging": per-token records, record.h, K codes [D] and V codes [D] of
 * 8 or 4 bits with an fp16 scale and zero point each) in the same products:
 * token t's key is k_td = ks_t c_td + kz_t, so with centred codes c' =
 * c - C (C = 2^(bits - 1), exact in bf16)
 *   scores  s_t = ks_t (bf16(q') . c'_t) + (kz_t + C ks_t) sum_d q'_d
 *   sums    acc_d += sum_t bf16(p_t vs_t) c'_td + sum_t p_t (vz_t + C vs_t)
 * with KVARN_ATTN_ARITH_BF16's per-token form (q' and each p_t vs_t
 * rounded once to bf16, the centred codes exact; the records' keys and
 * values are dequantized instead, kvarn_tile above), in spans of
 * attn_token_matrix_span(gs) tokens, one online-softmax step each; also
 * the int4 format's blocks (attn_dispatch.c). The int8 format's blocks
 * (token_tile_x2) take q' and the weights p_t vs_t as two bf16 each
 * (KVARN_ATTN_ARITH_BF16X2: relative error at most 2^-16, far below the
 * format's own; one bf16, 2^-8, would be of its order), each product
 * twice. */

/* Token j's codes (D of `bits`), centred, into column j of the B layout
 * of the score product: kmat[(d / 2) np + j][d % 2], bf16. */
static void token_k_column(const uint8_t *kc, int D, int bits, int np, int j, uint16_t *kmat)
{
    const int centre = 1 << (bits - 1);
#ifdef KVARN_AMX_EMULATE
    for (int d = 0; d < D; d++) {
        const int c = (kc[(size_t)d * bits / 8] >> ((d * bits) % 8)) & ((1 << bits) - 1);
        kmat[((size_t)(d / 2) * np + j) * 2 + (d & 1)] = amx_bf16_of((float)(c - centre));
    }
#else
    const __m512i vc = _mm512_set1_epi32(centre);
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(np));
    uint32_t *k32 = (uint32_t *)(void *)kmat + j;
    for (int d = 0; d < D; d += 32) {
        const __m512 f0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(amx_codes16(kc, d, bits), vc));
        const __m512 f1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(amx_codes16(kc, d + 16, bits), vc));
        /* bf16 of channels d .. d + 31 in order: 32-bit lane m holds the
         * pair (d + 2m, d + 2m + 1), row d / 2 + m of the B layout */
        const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(f1, f0);
        _mm512_i32scatter_epi32(k32 + (size_t)(d / 2) * np, idx, w, 4);
    }
#endif
}

/* The fp8 (E4M3, E5M2) and bf16 formats' blocks (attn_dispatch.c) in the
 * same products. Their codes are exact in bf16 (E4M3 taken as 2^-8 times
 * its value, the 2^8 folded into the K and V scales, as the vector kernels
 * take it), so nothing is centred and nothing but the query and the
 * weights is rounded:
 *   scores  s_t = ks_t (bf16(q') . c_t)
 *   sums    acc_d += sum_t bf16(p_t vs_t) c_td
 * (ks = vs = 1 for bf16, which has no scales): KVARN_ATTN_ARITH_BF16, the
 * statement of the AVX512-BF16 kernel of the same formats
 * (kernel_avx512_bf16.c), which is the fallback here. */
#ifdef KVARN_AMX_EMULATE
/* Code i of an fp8 or bf16 row as its value (E4M3: 2^-8 times it). */
static float fp_code(kvarn_kind kind, const uint8_t *row, int i)
{
    if (kind == KVARN_KIND_FP8_E4M3) return kvarn__e4m3_to_f32(row[i]) * 0x1p-8f;
    if (kind == KVARN_KIND_FP8_E5M2) return kvarn__e5m2_to_f32(row[i]);
    uint16_t h;
    memcpy(&h, row + 2 * (size_t)i, 2);
    return kvarn__bf16_to_f32(h);
}
#else
/* Codes i .. i + 15 of an fp8 or bf16 row as fp32 (E4M3: 2^-8 times its
 * value, by moving its bits into an fp16; E5M2: the high byte of an fp16;
 * bf16: the high half of an fp32): exact. */
static inline __m512 fp_codes16(kvarn_kind kind, const uint8_t *row, int i)
{
    if (kind == KVARN_KIND_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + 2 * (size_t)i))), 16));
    const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(row + i)));
    if (kind == KVARN_KIND_FP8_E5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(x, 8));
    return _mm512_cvtph_ps(_mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7f)), 7),
                                           _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8)));
}
#endif

/* token_k_column of an fp8 or bf16 row: its D values, exact, into column
 * j of the B layout. */
static void token_k_column_fp(kvarn_kind kind, const uint8_t *kc, int D, int np, int j, uint16_t *kmat)
{
#ifdef KVARN_AMX_EMULATE
    for (int d = 0; d < D; d++)
        kmat[((size_t)(d / 2) * np + j) * 2 + (d & 1)] = amx_bf16_of(fp_code(kind, kc, d));
#else
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(np));
    uint32_t *k32 = (uint32_t *)(void *)kmat + j;
    for (int d = 0; d < D; d += 32) {
        const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(fp_codes16(kind, kc, d + 16), fp_codes16(kind, kc, d));
        _mm512_i32scatter_epi32(k32 + (size_t)(d / 2) * np, idx, w, 4);
    }
#endif
}

/* amx_pair_packed of two fp8 or bf16 rows: out[2 i] = value i of r0,
 * out[2 i + 1] = that of r1, exact. */
static void pair_fp(kvarn_kind kind, const uint8_t *r0, const uint8_t *r1, int D, uint16_t *out)
{
#ifdef KVARN_AMX_EMULATE
    for (int i = 0; i < D; i++) {
        out[2 * i] = amx_bf16_of(fp_code(kind, r0, i));
        out[2 * i + 1] = amx_bf16_of(fp_code(kind, r1, i));
    }
#else
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
    for (int i = 0; i < D; i += 16) {
        const __m512i f0 = _mm512_castps_si512(fp_codes16(kind, r0, i));
        const __m512i f1 = _mm512_castps_si512(fp_codes16(kind, r1, i));
        _mm512_storeu_si512(out + 2 * i, _mm512_or_si512(_mm512_srli_epi32(f0, 16), _mm512_and_si512(f1, top)));
    }
#endif
}

/* One span of ns <= attn_token_matrix_span(gs) tokens (see above) of a
 * format of kind (KVARN_KIND_INT8 or _INT4: the integer records, any other
 * kind: fp8 or bf16); x2: the query and the weights as two bf16 each. */
static void token_span(attn_rows *r, const kvarn_record_layout *L, const uint8_t *const *tok,
                       int t0, int ns, attn_token_tile_fn fallback, int x2, kvarn_kind kind)
{
    const int D = r->D, n = r->n, gs = r->gs, bits = L->key_bits;
    const int fp = kind != KVARN_KIND_INT8 && kind != KVARN_KIND_INT4;
    const int np = (ns + 31) & ~31;
    float *ks = r->meta, *kz = ks + gs, *vs = kz + gs, *vz = vs + gs;
    /* fp8: one scale each (E4M3's 2^8 folded in); bf16: none */
    const float unit = kind == KVARN_KIND_FP8_E4M3 ? 256.0f : 1.0f;
    for (int t = 0; t < ns; t++) {
        if (!fp) {
            kvarn__fp16_load(tok[t] + L->k_a_off, 1, ks + t);
            kvarn__fp16_load(tok[t] + L->k_b_off, 1, kz + t);
            kvarn__fp16_load(tok[t] + L->v_a_off, 1, vs + t);
            kvarn__fp16_load(tok[t] + L->v_b_off, 1, vz + t);
            continue;
        }
        ks[t] = vs[t] = unit;
        kz[t] = vz[t] = 0.0f;
        if (L->k_a_bytes) {
            kvarn__fp16_load(tok[t] + L->k_a_off, 1, ks + t);
            kvarn__fp16_load(tok[t] + L->v_a_off, 1, vs + t);
            ks[t] *= unit;
            vs[t] *= unit;
        }
    }
    const int nr = (n + 15) & ~15;
    /* The rows' bf16 query (x2: and its second halves after it), the same
     * for every span of the item (and the item's records, kvarn_tile):
     * formed once (rows_query); a query reaching 2^80 is never kept (each
     * span then runs the fallback). */
    const int have = rows_query(r, x2);
    uint16_t *aq = (uint16_t *)(void *)r->qa, *aqlo = x2 ? aq + (size_t)nr * D : NULL;
    /* the scratch: codes, weights (x2: their second halves after them;
     * attn_plan.c sizes it) */
    uint16_t *kmat = r->mat, *vmat = kmat + (size_t)D * np, *w = vmat + (size_t)D * np;
    uint16_t *wlo = x2 ? w + (size_t)nr * np : NULL;
    if (!(have && kvarn__all_finite(ks, (size_t)ns) && kvarn__all_finite(kz, (size_t)ns) &&
          kvarn__all_finite(vs, (size_t)ns) && kvarn__all_finite(vz, (size_t)ns))) {
        r->qa_ready = ATTN_QA_NONE; /* the fallback may use qa */
        fallback(r, L, tok, t0, ns);
        return;
    }
    attn_prefetch_step(r->pf, attn_prefetch_left(r->pf));
    const float c = fp ? 0.0f : (float)(1 << (bits - 1));
    for (int t = 0; t < ns; t++) {
        kz[t] += c * ks[t];
        vz[t] += c * vs[t];
    }
    for (int t = ns; t < np; t++) ks[t] = kz[t] = vs[t] = vz[t] = 0.0f;
    /* np <= G columns; the padding tokens [ns, np) get codes C (centred
     * 0; fp8 and bf16: code 0, value 0) */
    uint8_t zc[2 * ATTN_MATRIX_MAX_D];
    memset(zc, fp ? 0 : bits == 8 ? 0x80 : 0x88, sizeof zc);
    const size_t voff = L->v_codes_off;
    for (int j = 0; j < np; j++) {
        const uint8_t *kc = j < ns ? tok[j] + L->k_codes_off : zc;
        if (fp) token_k_column_fp(kind, kc, D, np, j, kmat);
        else token_k_column(kc, D, bits, np, j, kmat);
    }
    for (int j = 0; j < np; j += 2) {
        const uint8_t *v0 = j < ns ? tok[j] + voff : zc, *v1 = j + 1 < ns ? tok[j + 1] + voff : zc;
        if (fp) pair_fp(kind, v0, v1, D, vmat + (size_t)j * D);
        else amx_pair_packed(v0, v1, D, bits, vmat + (size_t)j * D);
    }
    three_passes(r, t0, ns, np, aq, aqlo, kmat, vmat, w, wlo, ks, kz, vs, vz, NULL);
}

static void token_spans(attn_rows *r, const kvarn_record_layout *L, const uint8_t *const *tok, int t0,
                        int nt, attn_token_tile_fn fallback, int x2, kvarn_kind kind)
{
    const int span = attn_token_matrix_span(r->gs);
    const int fp = kind != KVARN_KIND_INT8 && kind != KVARN_KIND_INT4;
    const int ok = fp ? L->k_b_bytes == 0 && L->v_b_bytes == 0 && (L->k_a_bytes == 0 || (L->k_a_bytes == 2 && L->v_a_bytes == 2))
                      : (L->key_bits == 8 || L->key_bits == 4) && L->value_bits == L->key_bits &&
                            L->k_a_bytes == 2 && L->k_b_bytes == 2 && L->v_a_bytes == 2 && L->v_b_bytes == 2;
    if (span < 32 || !ok) {
        r->qa_ready = ATTN_QA_NONE;
        fallback(r, L, tok, t0, nt);
        return;
    }
    for (int j0 = 0; j0 < nt; j0 += span)
        token_span(r, L, tok + j0, t0 + j0, nt - j0 < span ? nt - j0 : span, fallback, x2, kind);
}

/* The int4 format's blocks and a KVarN view's int8 or int4 staging
 * (KVARN_KIND_INT4 stands for integer records of either width: token_span
 * reads their bits from the layout). */
void AMX_FN(token_tile)(attn_rows *r, const kvarn_record_layout *L, const uint8_t *const *tok,
                        int t0, int nt, attn_token_tile_fn fallback)
{
    token_spans(r, L, tok, t0, nt, fallback, 0, KVARN_KIND_INT4);
}

void AMX_FN(token_tile_x2)(attn_rows *r, const kvarn_record_layout *L, const uint8_t *const *tok,
                           int t0, int nt, attn_token_tile_fn fallback)
{
    token_spans(r, L, tok, t0, nt, fallback, 1, KVARN_KIND_INT8);
}

#define FP_TOKEN_TILE(NAME, KIND)                                                              \
    void AMX_FN(token_tile_##NAME)(attn_rows *r, const kvarn_record_layout *L,                 \
                                   const uint8_t *const *tok, int t0, int nt,                  \
                                   attn_token_tile_fn fallback)                                \
    {                                                                                          \
        token_spans(r, L, tok, t0, nt, fallback, 0, KIND);                                     \
    }
FP_TOKEN_TILE(fp8_e4m3, KVARN_KIND_FP8_E4M3)
FP_TOKEN_TILE(fp8_e5m2, KVARN_KIND_FP8_E5M2)
FP_TOKEN_TILE(bf16, KVARN_KIND_BF16)
#undef FP_TOKEN_TILE
