/*
 * fp8_row.h -- the fp8 formats' record (FP8 E4M3 / E5M2 with a dynamic fp16
 * scale per row; per_token.c's header comment and docs/formats.md): each
 * row's scale and codes. Static inline so that per_token.c (the build's
 * baseline) and fp8_row_avx512.c (the same C compiled with AVX-512) share
 * one source: the same fp32 division and the same integer rounding steps
 * in the same order, so both give the same bytes (as rtn_row.h for int8
 * and int4). Internal to the library.
 */
#ifndef KVARN_CODEC_FP8_ROW_H
#define KVARN_CODEC_FP8_ROW_H

#include <stdint.h>
#include <string.h>

#include "codec/fp_convert.h"
#include "codec/rtn_row.h" /* fp16_round_up, fp16_is_finite */
#include "kvarn/record.h"

#define FP8_E4M3_MAX 448.0f
#define FP8_E5M2_MAX 57344.0f

/* max |x| of a row: for finite floats the order of |x| is the order of
 * their bit patterns with the sign cleared (an integer max reduction);
 * Inf and NaN lie above every finite value. */
static inline float fp8_row_amax(const float *restrict x, int D)
{
    uint32_t m = 0;
    for (int i = 0; i < D; i++) {
        uint32_t a = kvarn__f32_bits(x[i]) & 0x7fffffffu;
        m = a > m ? a : m;
    }
    return kvarn__bits_f32(m);
}

/* The fp16 scale of one row (amax / fp8_max rounded up, so no element
 * saturates; an all-zero row 1.0); 0xffff if it would not be finite (a
 * NaN or Inf in the row, or an amax past fp16's range times fp8_max). A
 * row of denormals whose amax / fp8_max underflows fp32 to 0 gets the
 * smallest fp16 above it, 2^-24 (its codes then 0), not 0: a scale of 0
 * would divide 0 by 0 into the NaN code. */
static inline uint16_t fp8_row_scale(const float *x, int D, float fp8_max)
{
    const float amax = fp8_row_amax(x, D);
    if (amax == 0.0f) return 0x3c00u; /* all-zero row: scale 1.0, codes 0 */
    const uint16_t s = fp16_round_up(amax / fp8_max);
    if (s == 0) return 0x0001u;
    return fp16_is_finite(s) ? s : 0xffffu;
}

/* codes[i] = fp8_rne(x[i] / scale), D codes of one byte. */
static inline void fp8_row_encode(int e4m3, const float *restrict x, int D, uint16_t s16,
                                  unsigned char *restrict codes)
{
    const float s = kvarn__fp16_to_f32(s16);
    if (e4m3)
        for (int i = 0; i < D; i++) codes[i] = kvarn__e4m3_from_f32(x[i] / s);
    else
        for (int i = 0; i < D; i++) codes[i] = kvarn__e5m2_from_f32(x[i] / s);
}

/* One fp8 record (e4m3: E4M3, else E5M2) of the K row k and V row v (fp32
 * [L->head_dim]) into rec: KVARN_ERR_NONFINITE (nothing written) where a
 * row's scale would not be finite. */
static inline kvarn_status fp8_record(int e4m3, const kvarn_record_layout *L, const float *k,
                                      const float *v, unsigned char *rec)
{
    const int D = L->head_dim;
    const float fmax = e4m3 ? FP8_E4M3_MAX : FP8_E5M2_MAX;
    const uint16_t ks = fp8_row_scale(k, D, fmax), vs = fp8_row_scale(v, D, fmax);
    if (ks == 0xffffu || vs == 0xffffu) return KVARN_ERR_NONFINITE;
    fp8_row_encode(e4m3, k, D, ks, rec + L->k_codes_off);
    memcpy(rec + L->k_a_off, &ks, 2);
    fp8_row_encode(e4m3, v, D, vs, rec + L->v_codes_off);
    memcpy(rec + L->v_a_off, &vs, 2);
    return KVARN_OK;
}

/* Whether fp8_record would take rows k and v (their scales finite),
 * without forming the codes. */
static inline int fp8_rows_fit(int e4m3, const float *k, const float *v, int D)
{
    const float fmax = e4m3 ? FP8_E4M3_MAX : FP8_E5M2_MAX;
    return fp8_row_scale(k, D, fmax) != 0xffffu && fp8_row_scale(v, D, fmax) != 0xffffu;
}

#endif /* KVARN_CODEC_FP8_ROW_H */
