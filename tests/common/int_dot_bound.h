/*
 * int_dot_bound.h -- the derived error bound of the AVX-512 KVarN kernel's
 * integer (int16) dot products, computed from a case's own records and
 * query, for the attention tests (test_attn.c, test_attn_cache.c,
 * test_attn_paged_ops.c).
 */
#ifndef KVARN_TEST_INT_DOT_BOUND_H
#define KVARN_TEST_INT_DOT_BOUND_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvarn/kvarn.h"
#include "kvarn/paged.h"
#include "kvarn/record.h"
#include "common/paged_fixture.h" /* pf_hadamard_d */

/* fp16 element i of an array at a byte address, as double. */
static inline double idb_half(const uint8_t *p, int i)
{
    uint16_t x;
    memcpy(&x, p + 2 * (size_t)i, 2);
    return kvarn_fp16_to_fp32(x);
}

static inline double attn_int_dot_bound(const kvarn_paged_kv *kv, const kvarn_seq_view *v, int h,
                                        const float *q, double scale, int lo, int hi, double vmax)
{
    const kvarn_format *fmt = &kv->fmt;
    if (fmt->kind != KVARN_KIND_KVARN || kv->block_size != 128 ||
        (fmt->key_bits != 4 && fmt->value_bits != 2) || hi < lo)
        return 0.0;
    const int D = kv->head_dim, G = kv->block_size;
    kvarn_record_layout L;
    if (kvarn_record_layout_get(fmt, D, &L) != KVARN_OK) return INFINITY;
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
        if (fmt->key_bits == 4) {
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
            const double sq = qmax / 32767.0, lg = log2((double)D) + 3.0;
            for (int d = 0; d < D; d++) {
                double eps = fabs(idb_half(rec + L.k_a_off, d)) * scale * lg * 0x1p-24 * q1 /
                                 sqrt((double)D) / sq + 0x1p-7;
                double x = qa[d] / sq, fr = x - floor(x);
                if (fabs(fr - 0.5) <= eps) {
                    e[d] = 0.0;
                    cw[d] = sq * (0.5 + eps);
                } else {
                    e[d] = qa[d] - sq * nearbyint(x);
                    cw[d] = sq * eps;
                }
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
        if (fmt->value_bits == 2) {
            double amax = 0.0;
            for (int t = 0; t < G; t++) amax = fmax(amax, fabs(idb_half(rec + L.v_a_off, t)));
            for (int d = 0; d < D; d++)
                ev[d] = fmax(ev[d], 3.0 * G * step / 32767.0 * fabs(idb_half(rec + L.v_schan_off, d)) * amax);
        }
    }
    double esum = 0.0;
    for (int d = 0; d < D; d++) esum += ev[d];
    return (exp(2.0 * delta) - 1.0) * vmax + esum / sqrt((double)D);
}

#endif
