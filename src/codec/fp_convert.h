/*
 * fp_convert.h -- branch-free inline forms of the number conversions of
 * include/kvarn/kvarn.h (fp32 <-> fp16, bf16, OCP FP8 E4M3 / E5M2), for the
 * loops inside the library: written with selects instead of branches so that
 * the compiler can vectorize a loop of them. The public kvarn_fp32_to_* /
 * kvarn_*_to_fp32 functions (src/codec/fp_convert.c) are these, so the
 * exhaustive tests of tests/codec/test_convert.c cover both.
 *
 * Rounding: to nearest, ties to even; subnormals exact. fp16/bf16 overflow to
 * Inf; FP8 saturates (finite beyond max and +-Inf -> +-max); NaN stays NaN
 * (made quiet). See fp_convert.c for the formats.
 *
 * The subnormal paths let the fp32 adder round: |x| plus a power of two whose
 * ulp is the target's subnormal spacing rounds (RNE) to a multiple of that
 * spacing, and the sum's low mantissa bits are the code. This needs the
 * default rounding mode and no flush-to-zero. Every path is computed for
 * every input and the right one selected; the unused ones may wrap around
 * (unsigned, well defined) or produce NaN (no trap in the default FP
 * environment).
 */
#ifndef KVARN_CODEC_FP_CONVERT_H
#define KVARN_CODEC_FP_CONVERT_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* c ? a : b on bit patterns, written as a mask blend: every operand is
 * computed unconditionally, which keeps the compiler from moving the fp32
 * arithmetic of an unselected path under a branch (with -ftrapping-math,
 * the default, it would then refuse to vectorize the loop). */
static inline uint32_t kvarn__sel(int c, uint32_t a, uint32_t b)
{
    const uint32_t m = (uint32_t)0 - (uint32_t)(c != 0);
    return (a & m) | (b & ~m);
}

static inline uint32_t kvarn__f32_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static inline float kvarn__bits_f32(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* fp32 -> IEEE half. */
static inline uint16_t kvarn__fp16_from_f32(float x)
{
    const uint32_t u = kvarn__f32_bits(x);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t a = u & 0x7fffffffu;
    /* normal: rebias 127 -> 15, round the 13 dropped bits to even */
    const uint32_t nrm = (a + ((uint32_t)(15 - 127) << 23) + 0xfffu + ((a >> 13) & 1u)) >> 13;
    /* below 2^-14: spacing 2^-24 = ulp(0.5f) */
    const uint32_t sub = kvarn__f32_bits(kvarn__bits_f32(a) + 0.5f) - 0x3f000000u;
    /* NaN keeps its top payload bits and is made quiet */
    const uint32_t nan = 0x7e00u | ((a >> 13) & 0x3ffu);
    uint32_t r = kvarn__sel(a < 0x38800000u, sub, nrm);
    r = kvarn__sel(a >= 0x477ff000u, 0x7c00u, r); /* >= 65520 (the tie above 65504): Inf */
    r = kvarn__sel(a > 0x7f800000u, nan, r);
    return (uint16_t)(sign | r);
}

/* IEEE half -> fp32 (exact). */
static inline float kvarn__fp16_to_f32(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t em = h & 0x7fffu;
    const uint32_t nrm = (em << 13) + ((uint32_t)(127 - 15) << 23);
    const uint32_t sub = kvarn__f32_bits((float)(int32_t)em * 0x1p-24f);
    const uint32_t infnan = 0x7f800000u | ((em & 0x3ffu) << 13) | ((em & 0x3ffu) ? 0x00400000u : 0u);
    uint32_t r = kvarn__sel(em >= 0x0400u, nrm, sub);
    r = kvarn__sel(em >= 0x7c00u, infnan, r);
    return kvarn__bits_f32(sign | r);
}

/* fp32 -> bfloat16. */
static inline uint16_t kvarn__bf16_from_f32(float x)
{
    const uint32_t u = kvarn__f32_bits(x);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16; /* overflow carries into Inf */
    const uint32_t nan = (u >> 16) | 0x0040u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

static inline float kvarn__bf16_to_f32(uint16_t h)
{
    return kvarn__bits_f32((uint32_t)h << 16);
}

/* fp32 -> OCP FP8 E4M3 (bias 7, max 448 = S.1111.110, NaN = S.1111.111). */
static inline uint8_t kvarn__e4m3_from_f32(float x)
{
    const uint32_t u = kvarn__f32_bits(x);
    const uint32_t sign = (u >> 24) & 0x80u;
    const uint32_t a = u & 0x7fffffffu;
    const uint32_t nrm = (a + ((uint32_t)(7 - 127) << 23) + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
    /* below 2^-6: spacing 2^-9 = ulp(2^14) */
    const uint32_t sub = kvarn__f32_bits(kvarn__bits_f32(a) + 16384.0f) - 0x46800000u;
    uint32_t r = kvarn__sel(a < 0x3c800000u, sub, nrm);
    r = kvarn__sel(a >= 0x43e00000u, 0x7eu, r); /* >= 448 and Inf: saturate */
    r = kvarn__sel(a > 0x7f800000u, 0x7fu, r);
    return (uint8_t)(sign | (r & 0x7fu));
}

static inline float kvarn__e4m3_to_f32(uint8_t b)
{
    const uint32_t sign = (uint32_t)(b & 0x80u) << 24;
    const uint32_t em = b & 0x7fu;
    const uint32_t nrm = (em << 20) + ((uint32_t)(127 - 7) << 23);
    const uint32_t sub = kvarn__f32_bits((float)(int32_t)em * 0x1p-9f);
    uint32_t r = kvarn__sel(em >= 0x08u, nrm, sub);
    r = kvarn__sel(em == 0x7fu, 0x7fc00000u, r);
    return kvarn__bits_f32(sign | r);
}

/* fp32 -> OCP FP8 E5M2 (bias 15, max 57344 = S.11110.11, IEEE-like). */
static inline uint8_t kvarn__e5m2_from_f32(float x)
{
    const uint32_t u = kvarn__f32_bits(x);
    const uint32_t sign = (u >> 24) & 0x80u;
    const uint32_t a = u & 0x7fffffffu;
    const uint32_t nrm = (a + ((uint32_t)(15 - 127) << 23) + 0xfffffu + ((a >> 21) & 1u)) >> 21;
    /* below 2^-14: spacing 2^-16 = ulp(2^7) */
    const uint32_t sub = kvarn__f32_bits(kvarn__bits_f32(a) + 128.0f) - 0x43000000u;
    uint32_t r = kvarn__sel(a < 0x38800000u, sub, nrm);
    r = kvarn__sel(a >= 0x47600000u, 0x7bu, r); /* >= 57344 and Inf: saturate */
    r = kvarn__sel(a > 0x7f800000u, 0x7fu, r);
    return (uint8_t)(sign | (r & 0x7fu));
}

/* E5M2 is the top byte of an IEEE half. */
static inline float kvarn__e5m2_to_f32(uint8_t b)
{
    return kvarn__fp16_to_f32((uint16_t)((uint16_t)b << 8));
}

/* Whether x[0..n) holds no NaN or Inf (an all-ones exponent). The test is
 * OR-ed over the whole array, branch-free, so the compiler vectorizes the
 * loop. The inputs every entry point refuses with KVARN_ERR_NONFINITE. */
static inline int kvarn__all_finite(const float *x, size_t n)
{
    uint32_t bad = 0;
    for (size_t i = 0; i < n; i++)
        bad |= (uint32_t)((kvarn__f32_bits(x[i]) & 0x7f800000u) == 0x7f800000u);
    return bad == 0;
}

/* dst[i] = the fp16 stored at src + 2i (host byte order, any alignment),
 * i < n: a record's scales (../shared/spec/KVARN.md "Record layout"). */
static inline void kvarn__fp16_load(const uint8_t *src, int n, float *dst)
{
    for (int i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, src + 2 * (size_t)i, 2);
        dst[i] = kvarn__fp16_to_f32(h);
    }
}

#endif /* KVARN_CODEC_FP_CONVERT_H */
