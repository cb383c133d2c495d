/* test_convert.c -- the number conversions of src/codec/fp_convert.c.
 *
 * Oracles, all independent of the code under test:
 *   fp16  gcc's _Float16 conversions (x86-64 gcc >= 12; a slow exact-arithmetic
 *         reference where the compiler lacks _Float16), on every fp16 bit
 *         pattern and on millions of random, midpoint, subnormal and
 *         overflow floats.
 *   bf16  a reference that rounds by comparing exact distances in double.
 *   fp8   the value of each code computed from its fields with ldexp, and a
 *         brute-force nearest-code search (ties to the even code) over all
 *         256 codes; saturation at the largest finite value.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <string.h>
#include <cmocka.h>

#include "kvarn/kvarn.h"
#include "common/testutil.h"

static uint32_t f2u(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static float u2f(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

/* ---------------------------------------------------------------- fp16 */

#if defined(__FLT16_MAX__) /* the compiler has _Float16 (gcc >= 12 on x86-64) */
static uint16_t oracle_fp16(float x)
{
    _Float16 h = (_Float16)x;
    uint16_t b;
    memcpy(&b, &h, 2);
    return b;
}

static float oracle_fp16_to_fp32(uint16_t b)
{
    _Float16 h;
    memcpy(&h, &b, 2);
    return (float)h;
}
#else /* fallback oracle: exact arithmetic in double from the fields */
static float oracle_fp16_to_fp32(uint16_t b)
{
    int e = (b >> 10) & 0x1f, m = b & 0x3ff;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    return (float)((b & 0x8000u) ? -v : v);
}

static uint16_t oracle_fp16(float x)
{
    uint16_t sign = signbit(x) ? 0x8000u : 0;
    double v = fabs((double)x);
    if (isnan(x)) return 0x7e00u | sign;
    if (v >= 65520.0) return 0x7c00u | sign;
    int e;
    frexp(v, &e);                    /* v = f 2^e, f in [0.5, 1) */
    int q = e - 11 < -24 ? -24 : e - 11; /* spacing 2^q: 11 bits, or subnormal */
    double r = nearbyint(ldexp(v, -q)); /* RNE in the default mode */
    if (r >= 2048) { r /= 2; q++; }      /* rounded up into the next binade */
    if (r < 1024) return (uint16_t)(sign | (uint16_t)r); /* subnormal (q = -24) */
    return (uint16_t)(sign | ((q + 25) << 10) | (uint16_t)(r - 1024));
}
#endif

static void test_fp16_all_patterns(void **state)
{
    (void)state;
    for (uint32_t i = 0; i < 65536; i++) {
        uint16_t h = (uint16_t)i;
        float f = kvarn_fp16_to_fp32(h);
        int is_nan = (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0;
        if (is_nan) {
            assert_true(isnan(f));
            assert_int_equal(signbit(f) != 0, (h >> 15) != 0);
            uint16_t back = kvarn_fp32_to_fp16(f);
            assert_int_equal(back & 0x7c00u, 0x7c00u); /* NaN stays NaN */
            assert_int_not_equal(back & 0x3ffu, 0);
            assert_int_equal(back & 0x8000u, h & 0x8000u);
        } else {
            /* decode is exact (bit-equal to the oracle, -0 included) */
            assert_int_equal(f2u(f), f2u(oracle_fp16_to_fp32(h)));
            assert_int_equal(kvarn_fp32_to_fp16(f), h);
        }
    }
}

static void check_fp16(float x)
{
    uint16_t got = kvarn_fp32_to_fp16(x), want = oracle_fp16(x);
    if (isnan(x)) {
        assert_int_equal(got & 0x7c00u, 0x7c00u);
        assert_int_not_equal(got & 0x3ffu, 0);
        return;
    }
    if (got != want) fail_msg("fp16(%a) = 0x%04x, oracle 0x%04x", (double)x, got, want);
}

static void test_fp16_rounding(void **state)
{
    (void)state;
    test_rng r;
    test_rng_seed(&r, 0x16);
    /* every midpoint between neighbouring fp16 values, and its fp32 neighbours */
    for (uint32_t i = 0; i < 0x7c00u; i++) {
        double a = kvarn_fp16_to_fp32((uint16_t)i), b = kvarn_fp16_to_fp32((uint16_t)(i + 1));
        float mid = (float)((a + b) / 2); /* exact: 11 significant bits + 1 */
        for (int s = 0; s < 2; s++) {
            float m = s ? -mid : mid;
            check_fp16(m);
            check_fp16(nextafterf(m, 0.0f));
            check_fp16(nextafterf(m, s ? -INFINITY : INFINITY));
        }
    }
    /* uniformly random bit patterns (every exponent, NaN and Inf) */
    for (int i = 0; i < 1500000; i++) check_fp16(u2f((uint32_t)test_rng_u64(&r)));
    /* random floats in and around the fp16 range: subnormals to overflow */
    for (int i = 0; i < 1500000; i++) {
        uint32_t e = 100u + test_rng_below(&r, 48); /* 2^-27 .. 2^20 */
        uint32_t u = ((uint32_t)test_rng_u64(&r) & 0x807fffffu) | (e << 23);
        check_fp16(u2f(u));
    }
    /* overflow edge: 65504, the 65520 tie, Inf, fp32 max */
    const float edge[] = {65504.0f, 65519.996f, 65520.0f, 65536.0f, 1e30f,
                          INFINITY, -INFINITY, 0x1p-24f, 0x1p-25f, 0x1.000002p-25f,
                          0x1.8p-24f, 0x1p-26f, 0x1p-14f, 0x1.ffcp-15f, 0.0f, -0.0f,
                          3.4028235e38f, 1.4e-45f, NAN};
    for (size_t i = 0; i < sizeof edge / sizeof edge[0]; i++) check_fp16(edge[i]);
    assert_int_equal(kvarn_fp32_to_fp16(65520.0f), 0x7c00u);
    assert_int_equal(kvarn_fp32_to_fp16(65519.996f), 0x7bffu);
    assert_int_equal(kvarn_fp32_to_fp16(0x1p-25f), 0x0000u); /* tie to even 0 */
    assert_int_equal(kvarn_fp32_to_fp16(0x1.8p-24f), 0x0002u); /* tie to even 2 */
}

/* ---------------------------------------------------------------- bf16 */

/* Reference: the two bf16 candidates around x, chosen by exact distance. */
static uint16_t ref_bf16(float x)
{
    uint32_t u = f2u(x);
    uint16_t lo = (uint16_t)(u >> 16), hi = (uint16_t)(lo + 1);
    double dx = x, dlo = kvarn_bf16_to_fp32(lo);
    if ((u & 0xffffu) == 0) return lo;
    /* hi may be Inf: its distance is then that of the value 2^128 */
    double dhi = ((hi & 0x7fffu) == 0x7f80u) ? copysign(ldexp(1.0, 128), dx)
                                             : (double)kvarn_bf16_to_fp32(hi);
    double el = fabs(dx - dlo), eh = fabs(dhi - dx);
    if (el < eh) return lo;
    if (eh < el) return hi;
    return (lo & 1u) ? hi : lo;
}

static void check_bf16(float x)
{
    uint16_t got = kvarn_fp32_to_bf16(x);
    if (isnan(x)) {
        assert_int_equal(got & 0x7f80u, 0x7f80u);
        assert_int_not_equal(got & 0x7fu, 0);
        return;
    }
    uint16_t want = ref_bf16(x);
    if (got != want) fail_msg("bf16(%a) = 0x%04x, reference 0x%04x", (double)x, got, want);
}

static void test_bf16(void **state)
{
    (void)state;
    for (uint32_t i = 0; i < 65536; i++) {
        float f = kvarn_bf16_to_fp32((uint16_t)i);
        assert_int_equal(f2u(f), i << 16); /* decode is exact */
        if (isnan(f)) assert_true(isnan(kvarn_bf16_to_fp32(kvarn_fp32_to_bf16(f))));
        else assert_int_equal(kvarn_fp32_to_bf16(f), i);
    }
    test_rng r;
    test_rng_seed(&r, 0xbf);
    for (int i = 0; i < 1000000; i++) {
        uint32_t u = (uint32_t)test_rng_u64(&r);
        check_bf16(u2f(u));
        check_bf16(u2f((u & 0xffff0000u) | 0x8000u)); /* a midpoint */
        check_bf16(u2f((u & 0xffff0000u) | 0x7fffu));
        check_bf16(u2f((u & 0xffff0000u) | 0x8001u));
    }
    assert_int_equal(kvarn_fp32_to_bf16(3.4028235e38f), 0x7f80u); /* overflow -> Inf */
    assert_int_equal(kvarn_fp32_to_bf16(INFINITY), 0x7f80u);
    assert_int_equal(kvarn_fp32_to_bf16(1.0f + 0x1p-8f), 0x3f80u); /* tie to even */
    assert_int_equal(kvarn_fp32_to_bf16(1.0f + 0x1p-8f + 0x1p-7f), 0x3f82u);
}

/* ----------------------------------------------------------------- fp8 */

typedef struct fp8_desc {
    const char *name;
    int ebits, mbits, bias;
    int has_inf;         /* E5M2: S.11111.00 is Inf */
    float max;
    uint8_t max_code;
    uint8_t (*enc)(float);
    float (*dec)(uint8_t);
} fp8_desc;

static const fp8_desc k_e4m3 = {"e4m3", 4, 3, 7, 0, 448.0f, 0x7e,
                                kvarn_fp32_to_fp8_e4m3, kvarn_fp8_e4m3_to_fp32};
static const fp8_desc k_e5m2 = {"e5m2", 5, 2, 15, 1, 57344.0f, 0x7b,
                                kvarn_fp32_to_fp8_e5m2, kvarn_fp8_e5m2_to_fp32};

/* Value of a code from its fields; NaN codes give NAN, Inf gives INFINITY. */
static double fp8_ref_value(const fp8_desc *d, uint8_t c)
{
    int s = c >> 7, e = (c >> d->mbits) & ((1 << d->ebits) - 1), m = c & ((1 << d->mbits) - 1);
    int emax = (1 << d->ebits) - 1;
    double v;
    if (d->has_inf && e == emax) v = m ? NAN : INFINITY;
    else if (!d->has_inf && e == emax && m == (1 << d->mbits) - 1) v = NAN;
    else if (e == 0) v = ldexp((double)m, 1 - d->bias - d->mbits);
    else v = ldexp(1.0 + (double)m / (1 << d->mbits), e - d->bias);
    return s ? -v : v;
}

/* Brute force: nearest finite code, ties to the even code, saturating. */
static uint8_t fp8_ref_encode(const fp8_desc *d, float x)
{
    double ax = fabs((double)x);
    if (ax >= d->max) return (uint8_t)((x < 0 ? 0x80 : 0) | d->max_code);
    int best = 0;
    double beste = INFINITY;
    for (int c = 0; c <= d->max_code; c++) {
        double e = fabs(fp8_ref_value(d, (uint8_t)c) - ax);
        if (e < beste || (e == beste && (c & 1) == 0)) { best = c; beste = e; }
    }
    return (uint8_t)((x < 0 || (x == 0 && signbit(x))) ? (best | 0x80) : best);
}

static void check_fp8_desc(const fp8_desc *d)
{
    /* all 256 codes: exact decode, special codes, encode(decode(c)) == c */
    for (int c = 0; c < 256; c++) {
        double want = fp8_ref_value(d, (uint8_t)c);
        float got = d->dec((uint8_t)c);
        if (isnan(want)) {
            assert_true(isnan(got));
            assert_true(isnan(d->dec(d->enc(got))));
            continue;
        }
        if (isinf(want)) {
            assert_true(isinf(got) && (got < 0) == (want < 0));
            continue;
        }
        assert_true((double)got == want);
        assert_int_equal(d->enc(got), c);
    }
    if (!d->has_inf) { /* E4M3: NaN only at S.1111.111 */
        assert_true(isnan(d->dec(0x7f)) && isnan(d->dec(0xff)));
        assert_false(isnan(d->dec(0x7e)));
    }
    assert_true(d->dec(d->max_code) == d->max);
    /* monotonic: positive codes strictly increase */
    for (int c = 1; c <= d->max_code; c++) assert_true(d->dec((uint8_t)c) > d->dec((uint8_t)(c - 1)));
    /* midpoints round to the even code; their neighbours to the nearer one */
    for (int c = 0; c < d->max_code; c++) {
        float a = d->dec((uint8_t)c), b = d->dec((uint8_t)(c + 1));
        float mid = (float)(((double)a + b) / 2);
        int even = (c & 1) ? c + 1 : c;
        assert_int_equal(d->enc(mid), even);
        assert_int_equal(d->enc(-mid), even | 0x80);
        assert_int_equal(d->enc(nextafterf(mid, 0.0f)), c);
        assert_int_equal(d->enc(nextafterf(mid, INFINITY)), c + 1);
    }
    /* saturation: beyond max, the next-binade midpoint, Inf */
    const float big[] = {d->max, nextafterf(d->max, INFINITY), d->max * 1.07f,
                         d->max * 1.5f, 1e30f, 3.4028235e38f, INFINITY};
    for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) {
        assert_int_equal(d->enc(big[i]), d->max_code);
        assert_int_equal(d->enc(-big[i]), d->max_code | 0x80);
    }
    uint8_t n = d->enc(NAN);
    assert_true(isnan(d->dec(n)));
    /* random floats against the brute-force encoder */
    test_rng r;
    test_rng_seed(&r, (uint64_t)d->ebits * 1000 + 8);
    for (int i = 0; i < 60000; i++) {
        /* exponents from below the smallest subnormal to above the max */
        int e = -d->bias - d->mbits - 3 + (int)test_rng_below(&r, (uint32_t)(2 * d->bias + d->mbits + 8));
        float x = (float)ldexp(1.0 + test_rng_uniform(&r), e);
        if (test_rng_u64(&r) & 1) x = -x;
        uint8_t got = d->enc(x), want = fp8_ref_encode(d, x);
        if (got != want) fail_msg("%s(%a) = 0x%02x, reference 0x%02x", d->name, (double)x, got, want);
    }
}

static void test_fp8_e4m3(void **state)
{
    (void)state;
    check_fp8_desc(&k_e4m3);
    assert_int_equal(kvarn_fp32_to_fp8_e4m3(464.0f), 0x7e); /* not into NaN */
    assert_int_equal(kvarn_fp32_to_fp8_e4m3(0x1p-10f), 0x00); /* tie to even 0 */
    assert_int_equal(kvarn_fp32_to_fp8_e4m3(0x1.8p-9f), 0x02);
}

static void test_fp8_e5m2(void **state)
{
    (void)state;
    check_fp8_desc(&k_e5m2);
    assert_true(isinf(kvarn_fp8_e5m2_to_fp32(0x7c)));
    assert_true(isnan(kvarn_fp8_e5m2_to_fp32(0x7d)));
    assert_int_equal(kvarn_fp32_to_fp8_e5m2(61440.0f), 0x7b); /* saturate, not Inf */
    assert_int_equal(kvarn_fp32_to_fp8_e5m2(0x1p-17f), 0x00);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fp16_all_patterns),
        cmocka_unit_test(test_fp16_rounding),
        cmocka_unit_test(test_bf16),
        cmocka_unit_test(test_fp8_e4m3),
        cmocka_unit_test(test_fp8_e5m2),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
