/*
 * rtn_row.h -- one row of per-token asymmetric round-to-nearest (the int8
 * and int4 formats, per_token.c's header comment and docs/formats.md): the
 * row's fp16 zero point and scale, and its codes. Static inline so that
 * per_token.c (the build's baseline) and rtn_row_avx512.c (the same C
 * compiled with AVX-512) share one source: the same fp32 operations in the
 * same order (IEEE subtraction, division and round-half-even do not depend
 * on the vector width), so both give the same bytes. Internal to the
 * library.
 */
#ifndef KVARN_CODEC_RTN_ROW_H
#define KVARN_CODEC_RTN_ROW_H

#include <stdint.h>

#include "codec/fp_convert.h"
#include "kvarn/kvarn.h"

static inline int fp16_is_finite(uint16_t h) { return (h & 0x7c00u) != 0x7c00u; }

/* Smallest fp16 >= x, for finite x >= 0 (may return Inf = 0x7c00). */
static inline uint16_t fp16_round_up(float x)
{
    uint16_t h = kvarn__fp16_from_f32(x);
    if (fp16_is_finite(h) && kvarn__fp16_to_f32(h) < x) h++;
    return h;
}

/* Largest fp16 <= x, for finite x (may return -Inf = 0xfc00). */
static inline uint16_t fp16_round_down(float x)
{
    uint16_t h = kvarn__fp16_from_f32(x);
    if (fp16_is_finite(h) && kvarn__fp16_to_f32(h) > x) {
        if (h & 0x8000u) h++;            /* negative: one step away from 0 */
        else h--;                        /* positive (h > 0 since x < h)   */
    }
    if (h == 0x8000u) h = 0;             /* -0 and +0 mean the same; keep +0 */
    return h;
}

/* Round half to even for 0 <= q < 2^22: adding 1.5 * 2^23 leaves no
 * fraction bits in the fp32 sum, so the adder rounds (RNE). */
static inline float round_half_even(float q)
{
    const float magic = 12582912.0f;
    return (q + magic) - magic;
}

typedef struct rtn_params { uint16_t scale, zero; } rtn_params;

/* Scale and zero-point of one row; KVARN_ERR_NONFINITE if either would
 * overflow fp16. */
static inline kvarn_status rtn_row_params(const float *restrict x, int D, int bits, rtn_params *p)
{
    /* min and max of a finite row as an integer reduction: flipping the
     * magnitude bits of negative floats makes the int32 order the float
     * order (-0 sorts just below +0, which is harmless here). */
    int32_t lo_key = INT32_MAX, hi_key = INT32_MIN;
    for (int i = 0; i < D; i++) {
        int32_t b = (int32_t)kvarn__f32_bits(x[i]);
        int32_t key = b ^ (int32_t)((uint32_t)(b >> 31) & 0x7fffffffu);
        lo_key = key < lo_key ? key : lo_key;
        hi_key = key > hi_key ? key : hi_key;
    }
    const float lo = kvarn__bits_f32((uint32_t)(lo_key ^ (int32_t)((uint32_t)(lo_key >> 31) & 0x7fffffffu)));
    const float hi = kvarn__bits_f32((uint32_t)(hi_key ^ (int32_t)((uint32_t)(hi_key >> 31) & 0x7fffffffu)));
    uint16_t z16 = fp16_round_down(lo);
    if (!fp16_is_finite(z16)) return KVARN_ERR_NONFINITE;
    /* hi - zero >= 0; should the fp32 subtraction round down, the top code
     * may land a hair above 2^bits - 1 and is clamped (error still tiny). */
    float range = hi - kvarn__fp16_to_f32(z16);
    uint16_t s16 = range > 0.0f ? fp16_round_up(range / (float)((1 << bits) - 1))
                                : 0x3c00u; /* constant fp16 row: scale 1.0 */
    if (!fp16_is_finite(s16)) return KVARN_ERR_NONFINITE;
    p->scale = s16;
    p->zero = z16;
    return KVARN_OK;
}

/* codes[i] = clamp(rne((x[i] - zero) / scale), 0, 2^bits - 1), one code per
 * byte (packed afterwards for int4). */
static inline void rtn_row_codes(const float *restrict x, int D, int bits, rtn_params p,
                          unsigned char *restrict codes)
{
    const float s = kvarn__fp16_to_f32(p.scale), z = kvarn__fp16_to_f32(p.zero);
    const int32_t qmax = (1 << bits) - 1;
    /* zero <= x makes q >= 0, and the scale rounded up makes q <= qmax but
     * for the fp32 roundings of hi - zero (q <= qmax (1 + 2^-22)), so q is
     * always a small non-negative number and the int conversion is safe; a
     * tiny excess is clamped. The clamps are integer ones so that the loop
     * vectorizes (no conditional fp32 operation). */
    for (int i = 0; i < D; i++) {
        float q = (x[i] - z) / s;
        int32_t c = (int32_t)round_half_even(q);
        c = c < 0 ? 0 : c;
        c = c > qmax ? qmax : c;
        codes[i] = (unsigned char)c;
    }
}

/* Both of the above on one row: codes [D] one per byte (not packed);
 * KVARN_ERR_NONFINITE (nothing written) if the scale or zero point would
 * overflow fp16. x finite, D >= 1. */
static inline kvarn_status rtn_row(const float *restrict x, int D, int bits, uint8_t *restrict codes,
                                   uint16_t *scale, uint16_t *zero)
{
    rtn_params p;
    if (rtn_row_params(x, D, bits, &p) != KVARN_OK) return KVARN_ERR_NONFINITE;
    rtn_row_codes(x, D, bits, p, codes);
    *scale = p.scale;
    *zero = p.zero;
    return KVARN_OK;
}

/* Whether rows k and v (D floats each) are finite and their RTN scale and
 * zero point fit fp16: what rtn_row would refuse (KVARN_ERR_NONFINITE),
 * without forming the codes (a batch's check before any record of it is
 * written). */
static inline int rtn_rows_fit(const float *restrict k, const float *restrict v, int D, int bits)
{
    uint32_t m = 0;
    for (int i = 0; i < D; i++) {
        const uint32_t a = kvarn__f32_bits(k[i]) & 0x7fffffffu, b = kvarn__f32_bits(v[i]) & 0x7fffffffu;
        m = a > m ? a : m;
        m = b > m ? b : m;
    }
    rtn_params p;
    return m < 0x7f800000u && rtn_row_params(k, D, bits, &p) == KVARN_OK &&
           rtn_row_params(v, D, bits, &p) == KVARN_OK;
}

#endif /* KVARN_CODEC_RTN_ROW_H */
