/*
 * int_dot_bound.h -- the derived error bound of the attention kernels'
 * integer (int16) dot products (the AVX-512 KVarN kernel, and the int8
 * kernel over int8 records and int4 records widened to bytes),
 * computed from a case's own records and query, for the attention tests
 * (test_attn.c, test_attn_cache.c, test_attn_lse.c, test_attn_paged_ops.c).
 * Where a kernel multiplies in integers is read from the library
 * (kvarn_attn_kernel_info_get, at the SIMD level KVARN_SIMD caps when the
 * bound is computed), never restated here: a half the library calls fp32
 * gets no allowance, and an integer half whose derivation is not below
 * (other code widths or tiles) gets a NaN bound, which fails every
 * comparison.
 */
#ifndef KVARN_TEST_INT_DOT_BOUND_H
#define KVARN_TEST_INT_DOT_BOUND_H

#include <math.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#ifndef KVARN_EXPERIMENTAL_API
#define KVARN_EXPERIMENTAL_API /* kvarn_attn_testing (idb_info) */
#endif
#include "kvarn/attn.h"
#include "kvarn/kvarn.h"
#include "kvarn/paged.h"
#include "kvarn/record.h"
#include "common/paged_fixture.h" /* pf_hadamard_d */

/* The kernels attention runs for kv's format, head_dim and staging at the
 * level KVARN_SIMD caps now; 0 when the library cannot say (the bound is
 * then NaN). */
/* The testing knob amx (attn.h kvarn_attn_testing) of the calls being
 * bounded: a test that forces the emulated matrix kernel (2) or none (1)
 * sets it before computing bounds; 0 = the library's default. */
static int idb_amx = 0;
/* The testing knob no_bf16 of the calls being bounded (the fp8 and bf16
 * formats' fp32 spans: no allowance for the AVX512-BF16 kernel). */
static int idb_no_bf16 = 0;
/* The rows of the work items the bounded row lies in, where the test
 * knows them (a sequence's query tokens x the GQA group): below
 * info.matrix_rows no item takes the matrix kernel, so the bounds add
 * nothing for it; 0: not known (the allowance is added). */
static int idb_rows = 0;

static inline int idb_info(const kvarn_paged_kv *kv, kvarn_attn_kernel_info *info)
{
    kvarn_attn_testing knobs = {0, 0, 0, idb_amx, idb_no_bf16};
    kvarn_attn_opts o = KVARN_ATTN_OPTS_DEFAULT(1.0f);
    o.testing = &knobs;
    return kvarn_attn_kernel_info_get(&kv->fmt, kv->head_dim, kv->staging, &o, info) == KVARN_OK;
}

/* Code i of a row of packed codes (record.h: low bits first). */
static inline unsigned idb_code(const uint8_t *row, int i, int bits)
{
    const int per = 8 / bits;
    return (row[i / per] >> ((i % per) * bits)) & ((1u << bits) - 1u);
}

/* fp16 element i of an array at a byte address, as double. */
static inline double idb_half(const uint8_t *p, int i)
{
    uint16_t x;
    memcpy(&x, p + 2 * (size_t)i, 2);
    return kvarn_fp16_to_fp32(x);
}

/* The int8 per-token kernel (AVX-512, docs/attention-intdot.md "int8: integer
 * dot products"), for the row with query q (original basis, before the
 * softmax scale), positions [lo, hi] of sequence view v, KV head h.
 *
 * K: the kernel rounds q'_d = scale q_d to sq qi_d, sq = max_d |q'_d| /
 * 32639, and computes s_t = scale_t (sum_d sq qi_d (c_td - 128) + 128
 * sum_d q'_d) + zero_t sum_d q'_d, whose exact value differs from the
 * reference's scale_t sum_d q'_d c_td + zero_t sum_d q'_d by
 *     ds_t = -scale_t sum_d e_d (c_td - 128),  e_d = q'_d - sq qi_d.
 * e_d is known from the data (round to nearest of q'_d / sq, in double)
 * up to the kernel's fp32 (q'_d, 32639 / max and the product each one
 * rounding: under 2^-7 steps, eps); a channel within eps of a rounding
 * boundary may round either way: |e_d| <= sq (1/2 + eps), the others are
 * known within sq eps:
 *     |ds_t| <= |scale_t| (|sum_d e_d (c_td - 128)| + sum_d cw_d |c_td - 128|)
 * with cw_d = sq eps or sq (1/2 + eps), e_d = 0 for the latter. The
 * softmax turns max_t |ds_t| = delta into ||p' - p||_1 <= e^(2 delta) - 1,
 * at most (e^(2 delta) - 1) max_t ||v'_t||_inf on the output.
 * V: per span of at most S tokens (the kernel's call: S = 128 tokens of
 * whole blocks, or one block of G >= 128) the weights w_t = p_t scale_t
 * are rounded to sw wi_t, sw = max_t w_t / 32639, |w_t - sw wi_t| <= sw
 * (1/2 + 2^-8); centred codes: channel d of acc moves by at most
 * sw (1/2 + 2^-8) sum_t |c_td - 128| over the span's visible tokens.
 * Divided by the final l: sw / l <= max_t (pi_t) max_t (scale_t) / 32639
 * (pi = the normalized weights), and the spans' largest pi_t sum to at
 * most 1, so output channel d moves by at most
 *     (1/2 + 2^-8) / 32639 max_t scale_t max over windows W of S
 *         consecutive visible positions of sum_{t in W} |c_td - 128|.
 * The int32 sums are exact; the fp32 rest is the 1e-4 / 1e-5 the tests
 * add. */
/* The int8 kernel's query rounding, qi_d = rne(q'_d / sq), per channel:
 * the error e_d = q'_d - sq qi_d known from the data, cw_d = sq eps, but
 * within eps (in steps of sq) of a rounding boundary, where it may round
 * either way (e_d = 0, cw_d = sq (1/2 + eps)); sq = 0 (the kernel's qi =
 * 0): e_d = q'_d, cw_d = |q'_d| 2^-20 + zslack (up to fp32). */
/* One channel of it, sq > 0: q rounded in steps of sq, eps in steps. */
static inline void idb_int16_round(double q, double sq, double eps, double *e, double *cw)
{
    const double x = q / sq, fr = x - floor(x);
    if (fabs(fr - 0.5) <= eps) {
        *e = 0.0;
        *cw = sq * (0.5 + eps);
    } else {
        *e = q - sq * nearbyint(x);
        *cw = sq * eps;
    }
}

static inline void idb_int16_query(const double *qp, int D, double sq, double eps, double zslack,
                                   double *e, double *cw)
{
    for (int d = 0; d < D; d++) {
        if (sq == 0.0) {
            e[d] = qp[d];
            cw[d] = fabs(qp[d]) * 0x1p-20 + zslack;
        } else {
            idb_int16_round(qp[d], sq, eps, &e[d], &cw[d]);
        }
    }
}

/* The centre of the int8 kernel's codes in units of the record's own
 * codes: int8 codes c - 128; int4 codes, widened to 16 c + 8 with scale
 * / 16 (kernel_avx512_int8.c i4_widen), scale (16 c + 8 - 128) / 16 =
 * scale (c - 7.5). */
static inline double idb_centre(int bits)
{
    return bits == 8 ? 128.0 : 7.5;
}

/* Code d of a per-token row of 8- or 4-bit codes. */
static inline double idb_tcode(const uint8_t *row, int d, int bits)
{
    return bits == 8 ? (double)row[d] : (double)idb_code(row, d, 4);
}

/* The most the int8 kernel's query rounding (idb_int16_query: e, cw)
 * moves the score of the int8 or int4 (bits) token record rec: |ks|
 * (|sum_d e_d c_d| + sum_d cw_d |c_d|), c_d = code - idb_centre(bits). */
static inline double idb_int8_score_err(const uint8_t *rec, const kvarn_record_layout *L, int D,
                                        int bits, const double *e, const double *cw)
{
    const double ks = fabs(idb_half(rec + L->k_a_off, 0));
    double sgn = 0.0, wc = 0.0;
    for (int d = 0; d < D; d++) {
        const double c = idb_tcode(rec + L->k_codes_off, d, bits) - idb_centre(bits);
        sgn += e[d] * c;
        wc += cw[d] * fabs(c);
    }
    return ks * (fabs(sgn) + wc);
}

/* delta = max_t |ds_t| over positions [lo, hi] (the K half above); also
 * the most the kernel's log-sum-exp of the row can move (every score by at
 * most delta). 0 where the library says the int8 kernel's scores are fp32
 * (below AVX-512, D > 256). */
static inline double attn_int8_k_delta(const kvarn_paged_kv *kv, const kvarn_seq_view *v, int h,
                                       const float *q, double scale, int lo, int hi)
{
    const int D = kv->head_dim, G = kv->block_size;
    kvarn_attn_kernel_info info;
    if (!idb_info(kv, &info) || (kv->fmt.kind != KVARN_KIND_INT8 && kv->fmt.kind != KVARN_KIND_INT4))
        return NAN;
    const int bits = kv->fmt.kind == KVARN_KIND_INT8 ? 8 : 4;
    if (info.scores == KVARN_ATTN_ARITH_FP32 || hi < lo) return 0.0;
    kvarn_record_layout L;
    if (kvarn_record_layout_get(&kv->fmt, D, &L) != KVARN_OK) return INFINITY;
    const double qmaxi = 32639.0, eps = 0x1p-7;
    double qp[1024], e[1024], cw[1024], qmax = 0.0;
    for (int d = 0; d < D; d++) {
        qp[d] = (double)q[d] * scale;
        qmax = fmax(qmax, fabs(qp[d]));
    }
    const double sq = qmax >= 0x1p-100 ? qmax / qmaxi : 0.0;
    idb_int16_query(qp, D, sq, eps, 0.0, e, cw);
    double delta = 0.0;
    for (int t = lo; t <= hi; t++) {
        const uint8_t *rec = kvarn_paged_token_record(kv, v->block_table[t / G], h, t % G);
        delta = fmax(delta, idb_int8_score_err(rec, &L, D, bits, e, cw));
    }
    return delta;
}

/* The V half alone: the most any output channel moves by the rounding of
 * the weights (0 where the library says the sums are fp32). */
static inline double attn_int8_v_err(const kvarn_paged_kv *kv, const kvarn_seq_view *v, int h, int lo,
                                     int hi)
{
    const int D = kv->head_dim, G = kv->block_size;
    kvarn_attn_kernel_info info;
    if (!idb_info(kv, &info)) return NAN;
    if (hi < lo || info.sums == KVARN_ATTN_ARITH_FP32) return 0.0;
    kvarn_record_layout L;
    if (kvarn_record_layout_get(&kv->fmt, D, &L) != KVARN_OK) return INFINITY;
    const double qmaxi = 32639.0, c0 = idb_centre(kv->fmt.kind == KVARN_KIND_INT8 ? 8 : 4);
    const int bits = kv->fmt.kind == KVARN_KIND_INT8 ? 8 : 4;
    const int S = G >= 128 ? G : 128 / G * G;
    double ev = 0.0, smax = 0.0;
    double *wsum = calloc((size_t)D, sizeof(double)); /* window sums per channel */
    if (wsum == NULL) return INFINITY;
    for (int t = lo; t <= hi; t++) {
        const uint8_t *rec = kvarn_paged_token_record(kv, v->block_table[t / G], h, t % G);
        smax = fmax(smax, fabs(idb_half(rec + L.v_a_off, 0)));
    }
    /* V: windows of S consecutive visible positions (a span holds at most
     * S; fewer visible ones only shrink the sums), sliding; the largest
     * scale of all visible positions stands for each window's */
    for (int t = lo; t <= hi; t++) {
        const uint8_t *rec = kvarn_paged_token_record(kv, v->block_table[t / G], h, t % G);
        for (int d = 0; d < D; d++) wsum[d] += fabs(idb_tcode(rec + L.v_codes_off, d, bits) - c0);
        if (t - S >= lo) {
            const int u = t - S;
            const uint8_t *old = kvarn_paged_token_record(kv, v->block_table[u / G], h, u % G);
            for (int d = 0; d < D; d++) wsum[d] -= fabs(idb_tcode(old + L.v_codes_off, d, bits) - c0);
        }
        for (int d = 0; d < D; d++) ev = fmax(ev, (0.5 + 0x1p-8) / qmaxi * smax * wsum[d]);
    }
    free(wsum);
    return ev;
}

static inline double attn_int8_dot_bound(const kvarn_paged_kv *kv, const kvarn_seq_view *v, int h,
                                         const float *q, double scale, int lo, int hi, double vmax)
{
    const double delta = attn_int8_k_delta(kv, v, h, q, scale, lo, hi);
    return (exp(2.0 * delta) - 1.0) * vmax + attn_int8_v_err(kv, v, h, lo, hi);
}

/* The staged int8 or int4 token record of position t of view v, KV head h
 * (KVARN_STAGING_INT8 / _INT4, paged.h "Staging"), or NULL when t is read from a
 * KVarN record. */
static inline const uint8_t *idb_staged_rec(const kvarn_paged_kv *kv, const kvarn_seq_view *v,
                                            int h, int t)
{
    const int G = kv->block_size, ti = t / G;
    if (kvarn_paged_tile_in_tail_pages(kv, v->committed_tiles, ti)) {
        const int64_t off = t - kvarn_paged_tail_start(kv, v->committed_tiles);
        return kvarn_paged_tail_rec(kv, v->tail_pages[off / kv->tail_page_tokens], h,
                                    (int)(off % kv->tail_page_tokens));
    }
    if (kvarn_paged_tile_is_page(kv, v->committed_tiles, ti))
        return kvarn_paged_page_rec(kv, v->block_table[ti], h, t % G);
    if (t % G < kvarn_paged_tile_sink_tokens(kv, v->committed_tiles, ti))
        return kvarn_paged_sink_rec(kv, v->sink_slot, h, t % G);
    return NULL;
}

/* A KVarN key or value as the matrix kernel dequantizes it (kernel_amx.c
 * dequant_k, dequant_v): bf16 (nearest even) of the fp32 s (a c + b), the
 * multiply-add one FMA; values the tiles read as 0 (below 2^-126) as 0. */
static inline double idb_dequant_bf16(float s, float a, int c, float b)
{
    const float x = s * fmaf(a, (float)c, b);
    uint32_t u;
    memcpy(&u, &x, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    float y;
    memcpy(&y, &u, 4);
    return fabsf(y) < 0x1p-126f ? 0.0 : (double)y;
}

/* The bf16 rounding (nearest even) the matrix kernel applies to a value
 * whose exact form is X and whose fp32 form in the kernel lies within ea
 * of it: where no rounding boundary (a midpoint between neighbouring bf16
 * values, or a power of two) lies within ea of X, the kernel's bf16 value
 * is bf16(X), so its error *e = bf16(X) - X is known and *w = 0; else it
 * may round either way: *e = 0, *w = one bf16 step at X's exponent plus
 * ea. Values whose bf16 is below 2^-126 read as 0 on the tiles: *e = -X
 * (|X| < 2^-126 + ea: *w = 2^-126 + ea). */
static inline void idb_bf16_err(double X, double ea, double *e, double *w)
{
    const double ax = fabs(X);
    if (ax < 0x1p-126 + ea) {
        *e = -X;
        *w = 0x1p-126 + ea;
        return;
    }
    int ex;
    frexp(ax, &ex);                     /* ax in [2^(ex-1), 2^ex) */
    const double ulp = ldexp(1.0, ex - 8); /* 8 significant bits */
    const double y = ax / ulp, fr = y - floor(y);
    const double lo2 = ldexp(1.0, ex - 1), hi2 = ldexp(1.0, ex);
    if (fabs(fr - 0.5) * ulp <= ea || ax - lo2 <= ea || hi2 - ax <= ea) {
        *e = 0.0;
        *w = 2.0 * ulp + ea;
        return;
    }
    *e = copysign(nearbyint(y) * ulp, X) - X;
    *w = 0.0;
}

/* The matrix kernel over per-token records of `bits` (kernel_amx.c
 * token_tile; attn.h KVARN_ATTN_ARITH_BF16): the most a score moves, and
 * per channel the most acc / l moves (evm[d], max with what it holds),
 * over the positions [lo, hi] whose record rec_of gives (NULL: none);
 * qp: the kernel's query q' in double (scaled; rotated for KVarN), qraw1:
 * sum_d |q_d| before. q'_d rounded once to bf16 (its error known from the
 * data but near a rounding boundary, idb_bf16_err, on top of the fp32
 * slack ea_d as for the records), times the centred codes c' = c -
 * 2^(bits - 1): score t moves by at most |ks_t| (|sum_d e_d c'_td| + sum_d
 * cw_d |c'_td| + D 2^-24 sum_d |bf16(q'_d) c'_td|) (the tiles' fp32 sums)
 * plus 2^-22 (|kz_t| + 2^(bits - 1) |ks_t|) sum_d |q'_d| (the centred zero
 * point formed in fp32); the weights p_t vs_t rounded once to bf16:
 * channel d of acc / l moves by at most max_t (2^-8 |vs_t| + 2^-126)
 * |c'_td| (their share of l is at most 1). */
typedef const uint8_t *(*idb_rec_fn)(const kvarn_paged_kv *kv, const kvarn_seq_view *v, int h, int t);
static inline double idb_token_matrix(const kvarn_paged_kv *kv, const kvarn_seq_view *v, int h,
                                      const double *qp, double qraw1, double scale, int lo, int hi,
                                      int bits, const kvarn_record_layout *L, idb_rec_fn rec_of,
                                      double *evm)
{
    const int D = kv->head_dim;
    const double u = 0x1p-8, cen = (double)(1 << (bits - 1)), lg = log2((double)D) + 3.0;
    double e[1024], cw[1024], rq[1024], q1 = 0.0, dmat = 0.0;
    for (int d = 0; d < D; d++) {
        q1 += fabs(qp[d]);
        const double ea = scale * lg * 0x1p-24 * qraw1 / sqrt((double)D) + fabs(qp[d]) * 0x1p-23;
        idb_bf16_err(qp[d], ea, &e[d], &cw[d]);
        rq[d] = fabs(qp[d] + e[d]) + cw[d];
    }
    for (int t = lo; t <= hi; t++) {
        const uint8_t *rec = rec_of(kv, v, h, t);
        if (rec == NULL) continue;
        const double ks = fabs(idb_half(rec + L->k_a_off, 0)), kz = fabs(idb_half(rec + L->k_b_off, 0));
        const double vs = fabs(idb_half(rec + L->v_a_off, 0));
        double sgn = 0.0, wc = 0.0, mag = 0.0;
        for (int d = 0; d < D; d++) {
            const double ck = (double)idb_code(rec + L->k_codes_off, d, bits) - cen;
            sgn += e[d] * ck;
            wc += cw[d] * fabs(ck);
            mag += rq[d] * fabs(ck);
            const double cv = fabs((double)idb_code(rec + L->v_codes_off, d, bits) - cen);
            evm[d] = fmax(evm[d], (u * vs + 0x1p-126) * cv);
        }
        dmat = fmax(dmat, ks * (fabs(sgn) + wc + D * 0x1p-24 * mag) + 0x1p-22 * (kz + cen * ks) * q1);
    }
    return dmat;
}

/* Token t's record of a per-token format's view. */
static inline const uint8_t *idb_block_rec(const kvarn_paged_kv *kv, const kvarn_seq_view *v, int h, int t)
{
    return kvarn_paged_token_record(kv, v->block_table[t / kv->block_size], h, t % kv->block_size);
}

/* The AVX512-BF16 kernel of the fp8 and bf16 formats' blocks
 * (src/attn/kernel_avx512_bf16.c; reported as info.matrix
 * "avx512-bf16", matrix_rows ATTN_SPAN_F32_MIN_ROWS = 16, matrix_scores =
 * matrix_sums = KVARN_ATTN_ARITH_BF16). Code d of a per-token row as its
 * value (exact in bf16: E4M3, E5M2, bf16), before the scale. */
static inline double idb_fcode(kvarn_kind kind, const uint8_t *row, int d)
{
    if (kind == KVARN_KIND_BF16) {
        uint16_t b;
        memcpy(&b, row + 2 * d, 2);
        uint32_t u = (uint32_t)b << 16;
        float f;
        memcpy(&f, &u, 4);
        return (double)f;
    }
    const unsigned c = row[d], sg = c >> 7;
    double m;
    if (kind == KVARN_KIND_FP8_E4M3) {
        const unsigned e = (c >> 3) & 15u, f = c & 7u;
        if (e == 15 && f == 7) return NAN;
        m = e ? ldexp(1.0 + f / 8.0, (int)e - 7) : ldexp((double)f, -9);
    } else { /* E5M2: the high byte of an fp16 */
        const unsigned e = (c >> 2) & 31u, f = c & 3u;
        if (e == 31) return f ? NAN : INFINITY;
        m = e ? ldexp(1.0 + f / 4.0, (int)e - 15) : ldexp((double)f, -16);
    }
    return sg ? -m : m;
}

/* The kernel's error (kernel_avx512_bf16.c "Arithmetic"), as
 * idb_token_matrix's with the codes' values c_td in place of the centred
 * codes and no zero point: the query q'_d rounded once to bf16
 * (idb_bf16_err on top of its fp32 slack), products exact, fp32 sums:
 * score t moves by at most |ks_t| (|sum_d e_d c_td| + sum_d cw_d |c_td| +
 * (D + 1) 2^-24 sum_d |bf16(q'_d) c_td| (the D-term fp32 sum and the
 * product by ks_t) + D 2^-126 e (q1 + 1)) (vdpbf16ps reads bf16 inputs
 * below 2^-126 as 0 (bf16 codes) and flushes products below it; e = 2^8
 * for E4M3, whose codes enter as 2^-8 times their value, else 1). The
 * weights w_t = p_t vs_t (p_t <= 1, l >= 1; fp32, then rounded once to
 * bf16), flushed to 0 below 2^-126: channel d of acc / l moves by at most
 * max_t (2^-8 + 2^-23) |vs_t| |c_td| + n 2^-126 (max_t |c_td| + 1) (n
 * tokens: flushed weights and products) + 2^-126 max_t |vs_t| (bf16 codes
 * below 2^-126 read as 0). */
static inline double idb_token_bf16(const kvarn_paged_kv *kv, const kvarn_seq_view *v, int h,
                                    const double *qp, double qraw1, double scale, int lo, int hi,
                                    const kvarn_record_layout *L, double *evm)
{
    const int D = kv->head_dim;
    const kvarn_kind kind = kv->fmt.kind;
    const double u = 0x1p-8 + 0x1p-23, tiny = 0x1p-126; /* bf16 of the fp32 product p_t vs_t */
    /* E4M3's codes enter as 2^-8 times their value (its 2^8 in the
     * scale): a flushed product is worth 2^8 more */
    const double e8 = kind == KVARN_KIND_FP8_E4M3 ? 256.0 : 1.0;
    double e[1024], cw[1024], rq[1024], cmax[1024], q1 = 0.0, dmat = 0.0, vsmax = 0.0;
    int n = 0;
    for (int d = 0; d < D; d++) {
        q1 += fabs(qp[d]);
        const double ea = fabs(qp[d]) * 0x1p-23 + scale * 0x1p-24 * qraw1 / sqrt((double)D);
        idb_bf16_err(qp[d], ea, &e[d], &cw[d]);
        rq[d] = fabs(qp[d] + e[d]) + cw[d];
        cmax[d] = 0.0;
    }
    for (int t = lo; t <= hi; t++) {
        const uint8_t *rec = idb_block_rec(kv, v, h, t);
        if (rec == NULL) continue;
        n++;
        const double ks = L->k_a_bytes ? fabs(idb_half(rec + L->k_a_off, 0)) : 1.0;
        const double vs = L->v_a_bytes ? fabs(idb_half(rec + L->v_a_off, 0)) : 1.0;
        vsmax = fmax(vsmax, vs);
        double sgn = 0.0, wc = 0.0, mag = 0.0;
        for (int d = 0; d < D; d++) {
            const double ck = idb_fcode(kind, rec + L->k_codes_off, d);
            sgn += e[d] * ck;
            wc += cw[d] * fabs(ck);
            mag += rq[d] * fabs(ck);
            const double cv = fabs(idb_fcode(kind, rec + L->v_codes_off, d));
            evm[d] = fmax(evm[d], u * vs * cv);
            cmax[d] = fmax(cmax[d], cv);
        }
        dmat = fmax(dmat, ks * (fabs(sgn) + wc + (D + 1) * 0x1p-24 * mag + D * tiny * e8 * (q1 + 1.0)));
    }
    for (int d = 0; d < D; d++) evm[d] += n * tiny * (cmax[d] + 1.0) + tiny * vsmax;
    return dmat;
}

/* The per-token formats' blocks through the kernel info.matrix names
 * (items of matrix_rows rows or more): *delta, the most a score moves, and
 * *ev = max_d of the most output channel d moves; 0 where the library
 * reports no such kernel (info.matrix_rows 0). The int4 format's
 * (idb_token_matrix; the token kernel's part is attn_int8_k_delta and
 * attn_int8_v_err) and the fp8 and bf16 formats' (idb_token_bf16);
 * attn_int_score_delta and attn_int_dot_bound read them. */
static inline void idb_block_matrix(const kvarn_paged_kv *kv, const kvarn_seq_view *v, int h,
                                    const float *q, double scale, int lo, int hi, double *delta,
                                    double *ev)
{
    *delta = *ev = 0.0;
    kvarn_attn_kernel_info info;
    if (!idb_info(kv, &info)) {
        *delta = NAN;
        return;
    }
    if (info.matrix_rows == 0 || hi < lo || (idb_rows > 0 && idb_rows < info.matrix_rows)) return;
    kvarn_record_layout L;
    if (kvarn_record_layout_get(&kv->fmt, kv->head_dim, &L) != KVARN_OK) {
        *delta = INFINITY;
        return;
    }
    double qp[1024], evm[1024], qraw1 = 0.0;
    for (int d = 0; d < kv->head_dim; d++) {
        qp[d] = (double)q[d] * scale;
        qraw1 += fabs((double)q[d]);
        evm[d] = 0.0;
    }
    *delta = kv->fmt.kind == KVARN_KIND_INT4
                 ? idb_token_matrix(kv, v, h, qp, qraw1, scale, lo, hi, 4, &L, idb_block_rec, evm)
                 : idb_token_bf16(kv, v, h, qp, qraw1, scale, lo, hi, &L, evm);
    for (int d = 0; d < kv->head_dim; d++) *ev = fmax(*ev, evm[d]);
}

/* The staged tokens of a KVarN view (KVARN_STAGING_INT8 or _INT4): *delta = the most a staged score moves,
 * *ev = the sum over channels of the most each output channel moves, in
 * the rotated basis; both 0 where the library says the staged tokens
 * keep fp32, NaN where it names arithmetic not derived here. Two kernels
 * may read them (the one an item takes depends on its rows): the larger
 * of the two bounds, per channel.
 * - the int8 token kernel (staged_scores/staged_sums INT16; int4 codes
 *   widened, centred at 7.5: idb_centre): the
 *   derivation of attn_int8_dot_bound above, with the kernel's query
 *   q' = H(scale q) / sqrt(D) (rotated in fp32: at most (log2 D + 3)
 *   2^-24 sum_i |q'_i| / sqrt(D) per channel, added to eps in steps of sq
 *   as the KVarN part below does); one kernel call reads the staged tokens
 *   of one tile (or of one sink slot), so the window is a tile's staged
 *   tokens.
 * - the matrix kernel (matrix_staged; attn.h KVARN_ATTN_ARITH_BF16):
 *   q'_d rounded once to bf16 (u = 2^-8 of |q'_d| plus the kernel's fp32
 *   slack ea_d, as for the records below), times the centred codes c' =
 *   c - 2^(bits - 1): score t moves by at most |ks_t| sum_d cw_d |c'_td|
 *   plus 2^-22 (|kz_t| + 2^(bits - 1) |ks_t|) sum_d |q'_d| (the centred
 *   zero point kz_t + 2^(bits - 1) ks_t formed in fp32); the weights
 *   p_t vs_t rounded once to bf16: channel d of acc / l moves by at most
 *   max_t (u |vs_t| + 2^-126) |c'_td| (the staged tokens' share of l is
 *   at most 1). */
static inline void idb_staged_int8(const kvarn_paged_kv *kv, const kvarn_seq_view *v, int h,
                                   const float *q, double scale, int lo, int hi, double *delta,
                                   double *ev)
{
    *delta = 0.0;
    *ev = 0.0;
    const int D = kv->head_dim, G = kv->block_size;
    kvarn_attn_kernel_info info;
    if (!idb_info(kv, &info)) {
        *delta = NAN;
        return;
    }
    const int ints = info.staged_scores != KVARN_ATTN_ARITH_FP32 || info.staged_sums != KVARN_ATTN_ARITH_FP32;
    const int mat = info.matrix_staged != 0;
    if ((!ints && !mat) || hi < lo) return;
    if ((ints && kv->staging != KVARN_STAGING_INT8 && kv->staging != KVARN_STAGING_INT4) ||
        (mat && kv->staging != KVARN_STAGING_INT8 && kv->staging != KVARN_STAGING_INT4) ||
        (mat && (info.matrix_scores != KVARN_ATTN_ARITH_BF16 || info.matrix_sums != KVARN_ATTN_ARITH_BF16))) {
        *delta = NAN; /* a kernel not derived below */
        return;
    }
    const int bits = kv->staging == KVARN_STAGING_INT8 ? 8 : 4;
    kvarn_format sfmt;
    kvarn_record_layout L;
    if (kvarn_format_parse(bits == 8 ? "int8" : "int4", &sfmt) != KVARN_OK ||
        kvarn_record_layout_get(&sfmt, D, &L) != KVARN_OK) {
        *delta = INFINITY;
        return;
    }
    const double qmaxi = 32639.0, lg = log2((double)D) + 3.0;
    double qp[1024], e[1024], cw[1024], qmax = 0.0, q1 = 0.0, qraw1 = 0.0;
    for (int d = 0; d < D; d++) {
        qp[d] = (double)q[d] * scale;
        qraw1 += fabs((double)q[d]);
    }
    pf_hadamard_d(qp, D);
    for (int d = 0; d < D; d++) {
        qmax = fmax(qmax, fabs(qp[d]));
        q1 += fabs(qp[d]);
    }
    double evi[1024], evm[1024], wsum[1024], dint = 0.0, dmat = 0.0;
    for (int d = 0; d < D; d++) evi[d] = evm[d] = 0.0;
    if (ints) {
        const double sq = qmax >= 0x1p-100 ? qmax / qmaxi : 0.0;
        const double eps = sq > 0.0 ? lg * 0x1p-24 * q1 / sqrt((double)D) / sq + 0x1p-7 : 0.0;
        idb_int16_query(qp, D, sq, eps, q1 * 0x1p-20, e, cw);
        double smax = 0.0;
        for (int t = lo; t <= hi; t++) {
            const uint8_t *rec = idb_staged_rec(kv, v, h, t);
            if (rec == NULL) continue;
            dint = fmax(dint, idb_int8_score_err(rec, &L, D, bits, e, cw));
            smax = fmax(smax, fabs(idb_half(rec + L.v_a_off, 0)));
        }
        for (int ti = lo / G; ti <= hi / G; ti++) {
            for (int d = 0; d < D; d++) wsum[d] = 0.0;
            for (int t = ti * G > lo ? ti * G : lo; t <= hi && t < (ti + 1) * G; t++) {
                const uint8_t *rec = idb_staged_rec(kv, v, h, t);
                if (rec == NULL) continue;
                for (int d = 0; d < D; d++)
                    wsum[d] += fabs(idb_tcode(rec + L.v_codes_off, d, bits) - idb_centre(bits));
            }
            for (int d = 0; d < D; d++) evi[d] = fmax(evi[d], (0.5 + 0x1p-8) / qmaxi * smax * wsum[d]);
        }
        if (info.staged_scores == KVARN_ATTN_ARITH_FP32) dint = 0.0;
        if (info.staged_sums == KVARN_ATTN_ARITH_FP32)
            for (int d = 0; d < D; d++) evi[d] = 0.0;
    }
    if (mat) dmat = idb_token_matrix(kv, v, h, qp, qraw1, scale, lo, hi, bits, &L, idb_staged_rec, evm);
    *delta = fmax(dint, dmat);
    for (int d = 0; d < D; d++) *ev += fmax(evi[d], evm[d]);
}

/* The KVarN records' part of the AVX-512 integer dot products (the
 * derivation at the top of this file): *delta = the most a score moves
 * (K), *esum = the sum over rotated channels of the most each output
 * channel moves (V); both 0 where the library says the half keeps fp32,
 * NaN where it names an integer half this derivation does not cover. */
static inline void idb_kvarn_records(const kvarn_paged_kv *kv, const kvarn_seq_view *v, int h,
                                     const float *q, double scale, int lo, int hi,
                                     double *delta_out, double *esum_out)
{
    *delta_out = *esum_out = 0.0;
    const kvarn_format *fmt = &kv->fmt;
    kvarn_attn_kernel_info info;
    if (!idb_info(kv, &info)) {
        *delta_out = NAN;
        return;
    }
    const int kint = info.scores != KVARN_ATTN_ARITH_FP32, vint = info.sums != KVARN_ATTN_ARITH_FP32;
    /* the matrix kernel (bf16, items of matrix_rows rows or more) */
    const int mat = info.matrix_rows > 0;
    if ((!kint && !vint && !mat) || hi < lo) return;
    if (mat && ((info.matrix_scores != KVARN_ATTN_ARITH_BF16X2 && info.matrix_scores != KVARN_ATTN_ARITH_BF16) ||
                (info.matrix_sums != KVARN_ATTN_ARITH_BF16X2 && info.matrix_sums != KVARN_ATTN_ARITH_BF16))) {
        *delta_out = NAN;
        return;
    }
    /* the derivation below: 4-bit K and 2-bit V codes of 128-token tiles */
    if (fmt->kind != KVARN_KIND_KVARN || (kint && fmt->key_bits != 4) ||
        (vint && fmt->value_bits != 2) || ((kint || vint) && kv->block_size != 128)) {
        *delta_out = NAN;
        return;
    }
    const int D = kv->head_dim, G = kv->block_size;
    kvarn_record_layout L;
    if (kvarn_record_layout_get(fmt, D, &L) != KVARN_OK) {
        *delta_out = NAN;
        return;
    }
    double qr[1024], ev[1024];
    for (int d = 0; d < D; d++) {
        qr[d] = q[d];
        ev[d] = 0.0;
    }
    pf_hadamard_d(qr, D);
    const double step = 0.5 + 1.0 / 256;
    double delta = 0.0;
    for (int ti = lo / G; ti <= hi / G; ti++) {
        if (kvarn_paged_tile_is_page(kv, v->committed_tiles, ti)) continue;
        const uint8_t *rec = kvarn_paged_record(kv, v->block_table[ti], h);
        if (kint) {
            /* The rounding error e_d of each channel is known from the
             * data (round to nearest of qa_d / sq, in double) up to the
             * kernel's fp32: its rotated query differs from qr by at most
             * (log2 D + 3) 2^-24 sum_i |q_i| / sqrt(D) per channel (one
             * rounding per butterfly stage, the scale, the product with
             * a_d), and qa_d 32767 / max, sq and the conversions add
             * under 2^-7 steps; eps_d (in steps of sq) is the sum. A
             * channel whose qa_d / sq lies within eps_d of a rounding
             * boundary may round either way: |e_d| <= sq (1/2 + eps_d);
             * the others' e_d is known within eps_d sq, and
             *   |ds_t| <= |s_tok_t| (|sum_d e_d code_dt| + sum_d c_d code_dt),
             * c_d = sq eps_d or sq (1/2 + eps_d), summed over the 4-bit
             * codes of the record. (The worst case over all codes,
             * 15 D sq / 2 |s_tok_t|, is about ten times larger.) */
            double qmax = 0.0, qa[1024], e[1024], cw[1024], q1 = 0.0;
            for (int d = 0; d < D; d++) q1 += fabs(q[d]);
            for (int d = 0; d < D; d++) {
                qa[d] = scale * qr[d] * idb_half(rec + L.k_a_off, d);
                qmax = fmax(qmax, fabs(qa[d]));
            }
            /* a row whose max |qa_d| is below 2^-100 (an all-zero query)
             * makes the kernel keep fp32 scores for the tile: nothing
             * rounded (the fp32 slack is the 1e-4 / 1e-5 the tests add) */
            if (qmax >= 0x1p-100) {
                const double sq = qmax / 32767.0, lg = log2((double)D) + 3.0;
                for (int d = 0; d < D; d++) {
                    const double eps = fabs(idb_half(rec + L.k_a_off, d)) * scale * lg * 0x1p-24 * q1 /
                                           sqrt((double)D) / sq + 0x1p-7;
                    idb_int16_round(qa[d], sq, eps, &e[d], &cw[d]);
                }
                const uint8_t *kc = rec + L.k_codes_off;
                for (int t = 0; t < G; t++) {
                    double sgn = 0.0, wc = 0.0;
                    for (int d = 0; d < D; d++) {
                        int code = (kc[(size_t)d * (G / 2) + t / 2] >> (4 * (t & 1))) & 15;
                        sgn += e[d] * code;
                        wc += cw[d] * code;
                    }
                    delta = fmax(delta, fabs(idb_half(rec + L.k_stok_off, t)) * (fabs(sgn) + wc));
                }
            }
        }
        if (mat) {
            /* The matrix kernel (attn.h KVARN_ATTN_ARITH_BF16): the query
             * q'_d rounded to bf16 (its error e_d known from the data but
             * near a rounding boundary, idb_bf16_err, on top of the
             * kernel's fp32 q'_d, off the exact one by at most ea_d: its
             * rotation (log2 D + 3) 2^-24 sum_i |q_i| / sqrt(D) per
             * channel, the scale one more rounding), each key formed as
             * the kernel forms it, K_td = bf16(fl(s_tok_t fl(a_d c_td +
             * b_d))) (idb_dequant_bf16: exactly), so that score t moves by at
             * most
             *   |sum_d e_d K_td + sum_d q'_d (K_td - k_td)| + sum_d cw_d |K_td|
             *   + sum_d ea_d |K_td - k_td| + D 2^-24 sum_d |bf16(q'_d) K_td|
             * (k_td = s_tok_t (a_d c_td + b_d) exact; the last term the
             * tiles' fp32 sums). V: each value formed likewise, V_td =
             * bf16(fl(s_chan_d fl(a_t c_td + b_t))) (exactly), the weights
             * p_t rounded to bf16 (2^-8, plus 2^-126 a token for the ones
             * the tiles read as 0): channel d of acc / l moves by at most
             * the largest over the tiles of 2^-8 max_t |V_td| + max_t
             * |V_td - v_td| + G 2^-126 max_t |V_td| (the tiles' shares of
             * l sum to at most 1). */
            const int kb = fmt->key_bits, vb = fmt->value_bits;
            const double lg = log2((double)D) + 3.0;
            double q1 = 0.0, e[1024], cw[1024], ea[1024];
            for (int d = 0; d < D; d++) q1 += fabs(q[d]);
            for (int d = 0; d < D; d++) {
                const double x = scale * qr[d];
                ea[d] = scale * lg * 0x1p-24 * q1 / sqrt((double)D) + fabs(x) * 0x1p-23;
                idb_bf16_err(x, ea[d], &e[d], &cw[d]);
            }
            const uint8_t *kc = rec + L.k_codes_off, *vc = rec + L.v_codes_off;
            const size_t krow = (size_t)G * kb / 8, vrow = (size_t)D * vb / 8;
            for (int t = 0; t < G; t++) {
                const float st = (float)idb_half(rec + L.k_stok_off, t);
                double sgn = 0.0, wc = 0.0, mag = 0.0;
                for (int d = 0; d < D; d++) {
                    const float a = (float)idb_half(rec + L.k_a_off, d), b = (float)idb_half(rec + L.k_b_off, d);
                    const int c = idb_code(kc + (size_t)d * krow, t, kb);
                    const double K = idb_dequant_bf16(st, a, c, b), k = (double)st * ((double)a * c + (double)b);
                    const double x = scale * qr[d];
                    sgn += e[d] * K + x * (K - k);
                    wc += cw[d] * fabs(K) + ea[d] * fabs(K - k);
                    mag += (fabs(x + e[d]) + cw[d]) * fabs(K);
                }
                delta = fmax(delta, fabs(sgn) + wc + D * 0x1p-24 * mag);
            }
            for (int d = 0; d < D; d++) {
                const float sc = (float)idb_half(rec + L.v_schan_off, d);
                double vmax = 0.0, dv = 0.0;
                for (int t = 0; t < G; t++) {
                    const float a = (float)idb_half(rec + L.v_a_off, t), b = (float)idb_half(rec + L.v_b_off, t);
                    const int c = idb_code(vc + (size_t)t * vrow, d, vb);
                    const double V = idb_dequant_bf16(sc, a, c, b), vx = (double)sc * ((double)a * c + (double)b);
                    vmax = fmax(vmax, fabs(V));
                    dv = fmax(dv, fabs(V - vx));
                }
                ev[d] = fmax(ev[d], 0x1p-8 * vmax + dv + G * 0x1p-126 * vmax);
            }
        }
        if (vint) {
            /* weights rounded in 32767 steps of the row's largest (INT16),
             * or 255 (U8: the VNNI build, where every a_t of the tile is
             * >= 0; a tile with a negative one keeps int16, whose bound is
             * the smaller); the fp32 of w_t 255 / max adds under 2^-8
             * steps there too */
            double amax = 0.0;
            int neg = 0;
            for (int t = 0; t < G; t++) {
                const double a = idb_half(rec + L.v_a_off, t);
                amax = fmax(amax, fabs(a));
                neg |= !(a >= 0.0);
            }
            const double steps = info.sums == KVARN_ATTN_ARITH_U8 && !neg ? 255.0 : 32767.0;
            for (int d = 0; d < D; d++)
                ev[d] = fmax(ev[d], 3.0 * G * step / steps * fabs(idb_half(rec + L.v_schan_off, d)) * amax);
        }
    }
    double esum = 0.0;
    for (int d = 0; d < D; d++) esum += ev[d];
    *delta_out = delta;
    *esum_out = esum;
}


/* The formats of the AVX512-BF16 span kernel (idb_token_bf16). */
static inline int idb_is_fp8_bf16(kvarn_kind k)
{
    return k == KVARN_KIND_FP8_E4M3 || k == KVARN_KIND_FP8_E5M2 || k == KVARN_KIND_BF16;
}

/* 1 where the library names an integer half for kv's per-token format (not
 * int8, int4 or KVarN), which no derivation here covers. */
static inline int idb_unknown_int(const kvarn_paged_kv *kv)
{
    kvarn_attn_kernel_info info;
    if (!idb_info(kv, &info)) return 1;
    return kv->fmt.kind != KVARN_KIND_INT8 && kv->fmt.kind != KVARN_KIND_INT4 &&
           kv->fmt.kind != KVARN_KIND_KVARN && !idb_is_fp8_bf16(kv->fmt.kind) &&
           (info.scores != KVARN_ATTN_ARITH_FP32 || info.sums != KVARN_ATTN_ARITH_FP32 ||
            info.matrix_rows > 0);
}

/* The most the integer dot products move any score of the row with query
 * q over positions [lo, hi] of view v, KV head h (records and staged
 * tokens): also the most its log-sum-exp moves. 0 where the library says
 * every half keeps fp32. */
static inline double attn_int_score_delta(const kvarn_paged_kv *kv, const kvarn_seq_view *v, int h,
                                          const float *q, double scale, int lo, int hi)
{
    if (idb_unknown_int(kv)) return NAN;
    if (kv->fmt.kind == KVARN_KIND_INT8) return attn_int8_k_delta(kv, v, h, q, scale, lo, hi);
    if (idb_is_fp8_bf16(kv->fmt.kind)) {
        double d, e;
        idb_block_matrix(kv, v, h, q, scale, lo, hi, &d, &e);
        return d;
    }
    if (kv->fmt.kind == KVARN_KIND_INT4) {
        /* an item takes the token kernel or the matrix kernel (a row may
         * mix them): the larger */
        double d4, e4;
        idb_block_matrix(kv, v, h, q, scale, lo, hi, &d4, &e4);
        const double dk = attn_int8_k_delta(kv, v, h, q, scale, lo, hi);
        return isnan(d4) || isnan(dk) ? NAN : fmax(d4, dk);
    }
    if (kv->fmt.kind != KVARN_KIND_KVARN) return 0.0;
    double sdelta, sev, delta, esum;
    idb_staged_int8(kv, v, h, q, scale, lo, hi, &sdelta, &sev);
    idb_kvarn_records(kv, v, h, q, scale, lo, hi, &delta, &esum);
    return fmax(sdelta, delta) + (isnan(sdelta) || isnan(delta) ? NAN : 0.0);
}

/* The most the integer dot products move the row's output (any channel,
 * original basis); vmax: max over visible positions and channels of the
 * dequantized |v|. 0 where the library says every half keeps fp32. */
static inline double attn_int_dot_bound(const kvarn_paged_kv *kv, const kvarn_seq_view *v, int h,
                                        const float *q, double scale, int lo, int hi, double vmax)
{
    if (idb_unknown_int(kv)) return NAN;
    if (kv->fmt.kind == KVARN_KIND_INT8) return attn_int8_dot_bound(kv, v, h, q, scale, lo, hi, vmax);
    if (idb_is_fp8_bf16(kv->fmt.kind)) {
        /* the span kernel's items move scores by at most d, acc / l by
         * e per channel; the fp32 path's items nothing */
        double d, e;
        idb_block_matrix(kv, v, h, q, scale, lo, hi, &d, &e);
        return isnan(d) ? NAN : (exp(2.0 * d) - 1.0) * vmax + e;
    }
    if (kv->fmt.kind == KVARN_KIND_INT4) {
        /* an item takes the token kernel or the matrix kernel (whose
         * fallback, a span outside its conditions, is the token kernel: a
         * row may mix them): every score moves by at most the larger
         * delta, and the two kernels' V errors add at most */
        double d4, e4;
        idb_block_matrix(kv, v, h, q, scale, lo, hi, &d4, &e4);
        const double dk = attn_int8_k_delta(kv, v, h, q, scale, lo, hi), ek = attn_int8_v_err(kv, v, h, lo, hi);
        return isnan(d4) || isnan(dk) || isnan(ek) ? NAN : (exp(2.0 * fmax(d4, dk)) - 1.0) * vmax + e4 + ek;
    }
    if (kv->fmt.kind != KVARN_KIND_KVARN) return 0.0;
    /* staged int8 tokens (their scores move by at most sdelta, like the
     * records' by delta: the softmax sees the max of the two) */
    double sdelta, sev, delta, esum;
    idb_staged_int8(kv, v, h, q, scale, lo, hi, &sdelta, &sev);
    idb_kvarn_records(kv, v, h, q, scale, lo, hi, &delta, &esum);
    if (isnan(sdelta) || isnan(delta)) return NAN;
    return (exp(2.0 * fmax(sdelta, delta)) - 1.0) * vmax + (sev + esum) / sqrt((double)kv->head_dim);
}

#endif
