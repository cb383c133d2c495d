/* test_per_token.c -- the per-token formats (fp16, bf16, fp8_e4m3, fp8_e5m2,
 * int8, int4) through kvarn_encode / kvarn_decode.
 *
 * The stored fields are read back with the offsets of include/kvarn/record.h
 * and dequantized here with the documented formulas (docs/formats.md):
 *   fp16/bf16  x' = the stored half / bfloat16
 *   fp8        x' = fp8(code) * scale
 *   int8/int4  x' = code * scale + zero   (int4: even index = low nibble)
 * and the choice of fields is checked against its definition (zero <= row
 * min, scale >= range / qmax, each within one fp16 step; |x - x'| <=
 * scale / 2; the fp8 code is the RNE fp8 of x / scale).
 * Errors: non-finite input, fp16 overflow of a stored field, short buffers,
 * bad head_dim and NULLs leave the record (poisoned beforehand) untouched. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <string.h>
#include <cmocka.h>

#include "kvarn/kvarn.h"
#include "kvarn/record.h"
#include "codec/codec_internal.h"
#include "common/cpu.h"
#include "common/testutil.h"

#define MAXD 1024
#define POISON 0xa5

static const char *const k_names[] = {"fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"};
#define N_NAMES (sizeof k_names / sizeof k_names[0])

static kvarn_format parse_ok(const char *name)
{
    kvarn_format f;
    assert_int_equal(kvarn_format_parse(name, &f), KVARN_OK);
    return f;
}

static uint16_t rd16(const unsigned char *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* A row of Gaussian values with a few large channels and a random offset. */
static void fill_row(test_rng *r, float *x, int D, double sigma)
{
    double off = sigma * (test_rng_uniform(r) - 0.5);
    for (int i = 0; i < D; i++) x[i] = (float)(off + sigma * test_rng_normal(r));
    for (int j = 0; j < 3 && D >= 8; j++) x[test_rng_below(r, (uint32_t)D)] *= 12.0f;
}

static int all_bytes(const unsigned char *p, size_t n, unsigned char b)
{
    for (size_t i = 0; i < n; i++) if (p[i] != b) return 0;
    return 1;
}

/* ------------------------------------------------------------ sizes */

static void test_record_bytes(void **state)
{
    (void)state;
    const int dims[] = {2, 64, 96, 128, 256, 512, 1024};
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++) {
        size_t D = (size_t)dims[i];
        kvarn_format f = parse_ok("fp16");
        assert_int_equal(kvarn_record_bytes(&f, (int)D), 4 * D);
        f = parse_ok("bf16");
        assert_int_equal(kvarn_record_bytes(&f, (int)D), 4 * D);
        f = parse_ok("fp8_e4m3");
        assert_int_equal(kvarn_record_bytes(&f, (int)D), 2 * D + 4);
        f = parse_ok("fp8_e5m2");
        assert_int_equal(kvarn_record_bytes(&f, (int)D), 2 * D + 4);
        f = parse_ok("int8");
        assert_int_equal(kvarn_record_bytes(&f, (int)D), 2 * D + 8);
        f = parse_ok("int4");
        assert_int_equal(kvarn_record_bytes(&f, (int)D), D + 8);
        assert_true(kvarn_bytes_per_token_head(&f, (int)D) == (double)(D + 8));
    }
}

/* ------------------------------------------------ fields and formulas */

/* Dequantize one row from the stored fields by the documented formula,
 * and check the fields against their definition for the input row x. */
static void check_row(const kvarn_format *f, const unsigned char *rec, size_t codes_off,
                      size_t a_off, size_t b_off, int D, const float *x, const float *dec)
{
    const unsigned char *codes = rec + codes_off;
    switch (f->kind) {
    case KVARN_KIND_FP16:
    case KVARN_KIND_BF16:
        for (int i = 0; i < D; i++) {
            uint16_t h = rd16(codes + 2 * i);
            uint16_t want = f->kind == KVARN_KIND_FP16 ? kvarn_fp32_to_fp16(x[i]) : kvarn_fp32_to_bf16(x[i]);
            assert_int_equal(h, want);
            float y = f->kind == KVARN_KIND_FP16 ? kvarn_fp16_to_fp32(h) : kvarn_bf16_to_fp32(h);
            assert_true(dec[i] == y);
        }
        break;
    case KVARN_KIND_FP8_E4M3:
    case KVARN_KIND_FP8_E5M2: {
        const int e4 = f->kind == KVARN_KIND_FP8_E4M3;
        const double fp8_max = e4 ? 448.0 : 57344.0;
        float s = kvarn_fp16_to_fp32(rd16(rec + a_off));
        double amax = 0;
        for (int i = 0; i < D; i++) amax = fmax(amax, fabs((double)x[i]));
        assert_true(s > 0.0f);
        if (amax == 0) assert_true(s == 1.0f); /* documented all-zero scale */
        else {
            /* scale = amax / fp8_max rounded up to fp16: >= and within a step */
            assert_true((double)s >= amax / fp8_max);
            assert_true((double)s <= amax / fp8_max * (1 + 0x1p-10 + 0x1p-20) + 0x1p-24);
        }
        for (int i = 0; i < D; i++) {
            uint8_t c = codes[i];
            uint8_t want = e4 ? kvarn_fp32_to_fp8_e4m3(x[i] / s) : kvarn_fp32_to_fp8_e5m2(x[i] / s);
            assert_int_equal(c, want);
            float q = e4 ? kvarn_fp8_e4m3_to_fp32(c) : kvarn_fp8_e5m2_to_fp32(c);
            assert_true(dec[i] == q * s);
        }
        break;
    }
    case KVARN_KIND_INT8:
    case KVARN_KIND_INT4: {
        const int bits = f->kind == KVARN_KIND_INT8 ? 8 : 4;
        const int qmax = (1 << bits) - 1;
        float s = kvarn_fp16_to_fp32(rd16(rec + a_off));
        uint16_t zh = rd16(rec + b_off);
        float z = kvarn_fp16_to_fp32(zh);
        /* the fp16 value just above z */
        uint16_t up = (zh & 0x8000u) ? (uint16_t)(zh - 1) : (uint16_t)(zh + 1);
        double lo = x[0], hi = x[0];
        for (int i = 1; i < D; i++) { lo = fmin(lo, x[i]); hi = fmax(hi, x[i]); }
        /* zero: the row minimum rounded down to fp16 */
        assert_true((double)z <= lo);
        assert_true((double)kvarn_fp16_to_fp32(up) > lo);
        assert_true(s > 0.0f);
        if (hi > z) {
            double need = (hi - z) / qmax;
            assert_true((double)s >= need * (1 - 0x1p-22));
            assert_true((double)s <= need * (1 + 0x1p-10 + 0x1p-20) + 0x1p-24);
        }
        for (int i = 0; i < D; i++) {
            int c = bits == 8 ? codes[i] : (codes[i / 2] >> ((i & 1) * 4)) & 0xf;
            assert_true(c >= 0 && c <= qmax);
            float y = (float)c * s + z;
            assert_true(dec[i] == y);
            /* RTN: within half a step (plus fp32 rounding of the formula) */
            double err = fabs((double)x[i] - (double)y);
            assert_true(err <= 0.5 * s + 1e-6 * (fabs(x[i]) + fabs(z)) + 1e-30);
        }
        break;
    }
    default:
        fail();
    }
}

static void test_fields_and_formula(void **state)
{
    (void)state;
    test_rng r;
    test_rng_seed(&r, 0x70c);
    static float k[MAXD], v[MAXD], kd[MAXD], vd[MAXD];
    static unsigned char rec[4 * MAXD + 64];
    const int dims[] = {2, 8, 64, 96, 128, 256, 512, 1024};
    const double sigmas[] = {1.0, 1e-3, 30.0, 1e-6};
    for (size_t n = 0; n < N_NAMES; n++) {
        kvarn_format f = parse_ok(k_names[n]);
        for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
            const int D = dims[di];
            kvarn_record_layout L;
            assert_int_equal(kvarn_record_layout_get(&f, D, &L), KVARN_OK);
            for (int trial = 0; trial < 24; trial++) {
                double sigma = sigmas[trial % 4];
                fill_row(&r, k, D, sigma);
                fill_row(&r, v, D, sigma * 0.5);
                if (trial == 5) memset(k, 0, sizeof(float) * (size_t)D); /* all-zero */
                if (trial == 6) for (int i = 0; i < D; i++) v[i] = 0.75f; /* constant */
                if (trial == 7) for (int i = 0; i < D; i++) v[i] = -1.3f; /* not fp16 */
                memset(rec, POISON, sizeof rec);
                assert_int_equal(kvarn_encode(&f, D, k, v, rec, L.record_bytes, NULL, 0, NULL), KVARN_OK);
                assert_true(all_bytes(rec + L.record_bytes, sizeof rec - L.record_bytes, POISON));
                assert_int_equal(kvarn_decode(&f, D, rec, L.record_bytes, kd, vd, 0), KVARN_OK);
                check_row(&f, rec, L.k_codes_off, L.k_a_off, L.k_b_off, D, k, kd);
                check_row(&f, rec, L.v_codes_off, L.v_a_off, L.v_b_off, D, v, vd);
                /* either output may be skipped */
                static float vd2[MAXD];
                assert_int_equal(kvarn_decode(&f, D, rec, L.record_bytes, NULL, vd2, 0), KVARN_OK);
                assert_memory_equal(vd, vd2, sizeof(float) * (size_t)D);
                assert_int_equal(kvarn_decode(&f, D, rec, L.record_bytes, kd, NULL, 0), KVARN_OK);
            }
        }
    }
}

/* fp16 inputs come back bit-exact from fp16, bf16 inputs from bf16. */
static void test_exact(void **state)
{
    (void)state;
    test_rng r;
    test_rng_seed(&r, 0xe7);
    float k[128], v[128], kd[128], vd[128];
    unsigned char rec[4 * 128];
    for (int bf = 0; bf < 2; bf++) {
        kvarn_format f = parse_ok(bf ? "bf16" : "fp16");
        for (int trial = 0; trial < 200; trial++) {
            for (int i = 0; i < 128; i++) {
                /* random bit patterns of the 16-bit type, finite only */
                uint16_t hk, hv;
                do hk = (uint16_t)test_rng_u64(&r); while (bf ? (hk & 0x7f80u) == 0x7f80u : (hk & 0x7c00u) == 0x7c00u);
                do hv = (uint16_t)test_rng_u64(&r); while (bf ? (hv & 0x7f80u) == 0x7f80u : (hv & 0x7c00u) == 0x7c00u);
                k[i] = bf ? kvarn_bf16_to_fp32(hk) : kvarn_fp16_to_fp32(hk);
                v[i] = bf ? kvarn_bf16_to_fp32(hv) : kvarn_fp16_to_fp32(hv);
            }
            assert_int_equal(kvarn_encode(&f, 128, k, v, rec, sizeof rec, NULL, 0, NULL), KVARN_OK);
            assert_int_equal(kvarn_decode(&f, 128, rec, sizeof rec, kd, vd, 0), KVARN_OK);
            assert_memory_equal(k, kd, sizeof k);
            assert_memory_equal(v, vd, sizeof v);
        }
    }
}

/* Ties of (x - zero) / scale go to the even code. */
static void test_int_round_half_even(void **state)
{
    (void)state;
    for (int b = 0; b < 2; b++) {
        kvarn_format f = parse_ok(b ? "int8" : "int4");
        const int qmax = b ? 255 : 15;
        float k[8] = {0.0f, (float)qmax, 0.5f, 1.5f, 2.5f, 3.5f, 6.5f, 7.0f};
        float v[8] = {0};
        unsigned char rec[2 * 8 + 8];
        kvarn_record_layout L;
        assert_int_equal(kvarn_record_layout_get(&f, 8, &L), KVARN_OK);
        assert_int_equal(kvarn_encode(&f, 8, k, v, rec, sizeof rec, NULL, 0, NULL), KVARN_OK);
        assert_true(kvarn_fp16_to_fp32(rd16(rec + L.k_a_off)) == 1.0f);
        assert_true(kvarn_fp16_to_fp32(rd16(rec + L.k_b_off)) == 0.0f);
        const int want[8] = {0, qmax, 0, 2, 2, 4, 6, 7};
        for (int i = 0; i < 8; i++) {
            int c = b ? rec[L.k_codes_off + (size_t)i]
                      : (rec[L.k_codes_off + (size_t)i / 2] >> ((i & 1) * 4)) & 0xf;
            assert_int_equal(c, want[i]);
        }
    }
}

/* The batch entry of a format's records (kvarn__rtn_record_encode for
 * int4 and int8, kvarn__fp8_record_encode for fp8_e4m3 and fp8_e5m2) in
 * build `wide` (0: the baseline C, 1: its AVX-512 build). */
static kvarn_status batch_encode(const kvarn_format *f, const kvarn_record_layout *L, const float *k,
                                 const float *v, unsigned char *rec, int wide)
{
    if (f->kind == KVARN_KIND_INT8 || f->kind == KVARN_KIND_INT4)
        return kvarn__rtn_record_encode(f->kind == KVARN_KIND_INT8 ? 8 : 4, L, k, v, rec, wide);
    return kvarn__fp8_record_encode(f->kind == KVARN_KIND_FP8_E4M3, L, k, v, rec, wide);
}

static int batch_fit(const kvarn_format *f, const float *k, const float *v, int D, int wide)
{
    if (f->kind == KVARN_KIND_INT8 || f->kind == KVARN_KIND_INT4)
        return kvarn__rtn_rows_fit(k, v, D, f->kind == KVARN_KIND_INT8 ? 8 : 4, wide);
    return kvarn__fp8_rows_fit(f->kind == KVARN_KIND_FP8_E4M3, k, v, D, wide);
}

static const char *const batch_formats[4] = {"int4", "int8", "fp8_e4m3", "fp8_e5m2"};

/* The batch entry of the staging and of kvarn_paged_store (both row
 * variants: the baseline C and its AVX-512 build) writes kvarn_encode's
 * bytes, for int4, int8, fp8_e4m3 and fp8_e5m2: rows of Gaussians,
 * constant rows, rows of ties (int: (x - zero) / scale = c + 1/2), rows
 * whose range rounds the scale up, rows of magnitude 400, every D the
 * format serves from 2 to 1024 in steps. The AVX-512 variant runs only
 * where the CPU level is AVX-512 (it says so otherwise). The error cases
 * (an fp16 overflow of a zero point or scale) give kvarn_encode's status
 * and write nothing. */
static void test_rtn_batch_entry(void **state)
{
    (void)state;
    const int wide_ok = kvarn__cpu_level() == KVARN_CPU_AVX512;
    if (!wide_ok) print_message("test_rtn_batch_entry: AVX-512 rows skipped (CPU level below AVX-512)\n");
    test_rng r;
    test_rng_seed(&r, 0x2b);
    static float k[MAXD], v[MAXD];
    static unsigned char want[4 * MAXD], got[4 * MAXD];
    const int dims[] = {2, 8, 62, 64, 96, 128, 256, 512, 1024};
    for (int b = 0; b < 4; b++) {
        kvarn_format f = parse_ok(batch_formats[b]);
        for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
            const int D = dims[di];
            kvarn_record_layout L;
            assert_int_equal(kvarn_record_layout_get(&f, D, &L), KVARN_OK);
            for (int trial = 0; trial < 40; trial++) {
                const int kind = trial % 4;
                for (int i = 0; i < D; i++) {
                    if (kind == 1) k[i] = 0.375f; /* constant, an fp16 */
                    else if (kind == 2) k[i] = (float)(test_rng_below(&r, 15)) + 0.5f; /* ties */
                    else k[i] = 0.0f;
                }
                if (kind == 2) { k[0] = 0.0f; k[1] = 15.0f; }
                if (kind == 0 || kind == 3) fill_row(&r, k, D, kind == 3 ? 400.0 : 1.0);
                fill_row(&r, v, D, 0.1 + trial);
                memset(want, POISON, L.record_bytes);
                assert_int_equal(kvarn_encode(&f, D, k, v, want, L.record_bytes, NULL, 0, NULL), KVARN_OK);
                for (int wide = 0; wide <= wide_ok; wide++) {
                    memset(got, POISON, L.record_bytes);
                    assert_int_equal(batch_encode(&f, &L, k, v, got, wide), KVARN_OK);
                    assert_memory_equal(want, got, L.record_bytes);
                }
            }
            /* int: a zero point below -65504; fp8: a scale past fp16's
             * range (1e10 / 448 and 1e10 / 57344 > 65504): refused,
             * nothing written */
            fill_row(&r, k, D, 1.0);
            fill_row(&r, v, D, 1.0);
            k[D / 2] = b < 2 ? -70000.0f : 1e10f;
            for (int wide = 0; wide <= wide_ok; wide++) {
                memset(got, POISON, L.record_bytes);
                assert_int_equal(kvarn_encode(&f, D, k, v, want, L.record_bytes, NULL, 0, NULL),
                                 KVARN_ERR_NONFINITE);
                assert_int_equal(batch_encode(&f, &L, k, v, got, wide), KVARN_ERR_NONFINITE);
                assert_true(all_bytes(got, L.record_bytes, POISON));
            }
        }
    }
    assert_int_equal(kvarn__rtn_record_encode(6, NULL, k, v, got, 0), KVARN_ERR_INVALID_ARG);
}

/* kvarn__rtn_rows_fit and kvarn__fp8_rows_fit (the batch checks of
 * kvarn_paged_store) accept exactly the rows kvarn_encode of int4, int8,
 * fp8_e4m3 and fp8_e5m2 accepts: ordinary rows, NaN, +-Inf, a zero point
 * below -65504, a range or magnitude whose scale overflows fp16, values
 * just inside; both builds. */
static void test_rtn_rows_fit_matches_encode(void **state)
{
    (void)state;
    const int wide_ok = kvarn__cpu_level() == KVARN_CPU_AVX512;
    test_rng r;
    test_rng_seed(&r, 0x3c);
    float k[128], v[128];
    unsigned char rec[4 * 128];
    /* (fp8: 65504 times E4M3's and E5M2's largest value, the largest
     * magnitudes whose scale is an fp16, and just past them) */
    const float specials[] = {NAN, INFINITY, -INFINITY, -70000.0f, -65504.0f, 1e30f, -1e30f,
                              65504.0f * 255.0f, 3.4e38f, 0.0f, 65504.0f * 448.0f,
                              -65504.0f * 448.0f * 1.0001f, 65504.0f * 57344.0f,
                              65504.0f * 57344.0f * 1.0001f};
    const int n_sp = (int)(sizeof specials / sizeof specials[0]);
    int refused = 0, accepted = 0;
    for (int b = 0; b < 4; b++) {
        kvarn_format f = parse_ok(batch_formats[b]);
        const int D = 64;
        for (int trial = 0; trial < 400; trial++) {
            fill_row(&r, k, D, 1.0 + trial % 7);
            fill_row(&r, v, D, 1.0);
            if (trial % 2) {
                float *x = trial % 4 == 1 ? k : v;
                x[test_rng_below(&r, (uint32_t)D)] = specials[trial / 4 % n_sp];
            }
            const int want = kvarn_encode(&f, D, k, v, rec, sizeof rec, NULL, 0, NULL) == KVARN_OK;
            refused += !want;
            accepted += want;
            for (int wide = 0; wide <= wide_ok; wide++)
                assert_int_equal(batch_fit(&f, k, v, D, wide), want);
        }
        assert_int_equal(batch_fit(&f, k, v, 3, 0), 0); /* odd D */
    }
    assert_int_equal(kvarn__rtn_rows_fit(k, v, 64, 6, 0), 0);
    assert_true(refused > 100 && accepted > 100); /* both answers were asked for */
}

/* fp8 rows of denormals so small that amax / fp8_max underflows fp32 to 0
 * (the scale "rounded up to fp16" is then its smallest, 2^-24, not 0,
 * which divided 0 by 0 into the NaN code): the record decodes to finite
 * values, 0 here, in kvarn_encode and both batch builds. */
static void test_fp8_tiny_rows(void **state)
{
    (void)state;
    const int wide_ok = kvarn__cpu_level() == KVARN_CPU_AVX512;
    enum { D = 64 };
    float k[D], v[D], dk[D], dv[D];
    unsigned char rec[4 * D], rec2[4 * D];
    for (int i = 0; i < D; i++) {
        k[i] = i % 3 == 0 ? 1e-44f : i % 3 == 1 ? 0.0f : -3e-45f;
        v[i] = i % 2 ? 1.4e-45f : 0.0f;
    }
    for (int b = 2; b < 4; b++) {
        kvarn_format f = parse_ok(batch_formats[b]);
        kvarn_record_layout L;
        assert_int_equal(kvarn_record_layout_get(&f, D, &L), KVARN_OK);
        assert_int_equal(kvarn_encode(&f, D, k, v, rec, L.record_bytes, NULL, 0, NULL), KVARN_OK);
        assert_int_equal(kvarn_decode(&f, D, rec, L.record_bytes, dk, dv, 0), KVARN_OK);
        for (int i = 0; i < D; i++) {
            assert_true(isfinite(dk[i]) && isfinite(dv[i]));
            assert_true(fabsf(dk[i] - k[i]) <= 1e-43f && fabsf(dv[i] - v[i]) <= 1e-43f);
        }
        for (int wide = 0; wide <= wide_ok; wide++) {
            assert_int_equal(batch_fit(&f, k, v, D, wide), 1);
            assert_int_equal(batch_encode(&f, &L, k, v, rec2, wide), KVARN_OK);
            assert_memory_equal(rec, rec2, L.record_bytes);
        }
    }
}

/* ------------------------------------------------------------ errors */

static void test_errors(void **state)
{
    (void)state;
    test_rng r;
    test_rng_seed(&r, 0xe44);
    float k[128], v[128], kd[128], vd[128];
    unsigned char rec[4 * 128 + 64];
    for (size_t n = 0; n < N_NAMES; n++) {
        kvarn_format f = parse_ok(k_names[n]);
        const int D = 128;
        size_t bytes = kvarn_record_bytes(&f, D);
        fill_row(&r, k, D, 1.0);
        fill_row(&r, v, D, 1.0);

        /* non-finite input anywhere in K or V: nothing written */
        const float bad[] = {NAN, INFINITY, -INFINITY};
        for (int t = 0; t < 12; t++) {
            float *row = (t & 1) ? v : k;
            int at = (int)test_rng_below(&r, (uint32_t)D);
            float keep = row[at];
            row[at] = bad[t % 3];
            memset(rec, POISON, sizeof rec);
            assert_int_equal(kvarn_encode(&f, D, k, v, rec, bytes, NULL, 0, NULL), KVARN_ERR_NONFINITE);
            assert_true(all_bytes(rec, sizeof rec, POISON));
            row[at] = keep;
        }

        /* a stored field would overflow: beyond fp16 (bf16: beyond bf16;
         * fp8: the scale amax / fp8_max beyond fp16) */
        float huge = f.kind == KVARN_KIND_BF16 ? 3.4028235e38f
                   : f.kind == KVARN_KIND_FP8_E4M3 ? 448.0f * 70000.0f
                   : f.kind == KVARN_KIND_FP8_E5M2 ? 3e38f
                   : f.kind == KVARN_KIND_INT4 || f.kind == KVARN_KIND_INT8 ? -70000.0f
                   : 70000.0f;
        for (int side = 0; side < 2; side++) {
            float *row = side ? v : k;
            float keep = row[7];
            row[7] = huge;
            memset(rec, POISON, sizeof rec);
            assert_int_equal(kvarn_encode(&f, D, k, v, rec, bytes, NULL, 0, NULL), KVARN_ERR_NONFINITE);
            assert_true(all_bytes(rec, sizeof rec, POISON));
            row[7] = keep;
        }
        /* int: a range too wide for an fp16 scale */
        if (f.kind == KVARN_KIND_INT4) {
            float keep0 = k[0], keep1 = k[1];
            k[0] = -65000.0f;
            k[1] = 65000.0f * 20; /* (hi - lo) / 15 > 65504 */
            memset(rec, POISON, sizeof rec);
            assert_int_equal(kvarn_encode(&f, D, k, v, rec, bytes, NULL, 0, NULL), KVARN_ERR_NONFINITE);
            assert_true(all_bytes(rec, sizeof rec, POISON));
            k[0] = keep0;
            k[1] = keep1;
        }

        /* short record buffer */
        memset(rec, POISON, sizeof rec);
        assert_int_equal(kvarn_encode(&f, D, k, v, rec, bytes - 1, NULL, 0, NULL), KVARN_ERR_BUFFER_TOO_SMALL);
        assert_true(all_bytes(rec, sizeof rec, POISON));
        assert_int_equal(kvarn_encode(&f, D, k, v, rec, bytes, NULL, 0, NULL), KVARN_OK);
        memset(kd, POISON, sizeof kd);
        assert_int_equal(kvarn_decode(&f, D, rec, bytes - 1, kd, vd, 0), KVARN_ERR_BUFFER_TOO_SMALL);
        assert_true(all_bytes((unsigned char *)kd, sizeof kd, POISON));

        /* bad head_dim */
        const int bad_d[] = {0, -2, 3, 127, 1026, 2048};
        for (size_t i = 0; i < sizeof bad_d / sizeof bad_d[0]; i++) {
            memset(rec, POISON, sizeof rec);
            assert_int_equal(kvarn_encode(&f, bad_d[i], k, v, rec, sizeof rec, NULL, 0, NULL),
                             KVARN_ERR_UNSUPPORTED_HEAD_DIM);
            assert_true(all_bytes(rec, sizeof rec, POISON));
            assert_int_equal(kvarn_decode(&f, bad_d[i], rec, sizeof rec, kd, vd, 0),
                             KVARN_ERR_UNSUPPORTED_HEAD_DIM);
        }

        /* NULLs */
        assert_int_equal(kvarn_encode(&f, D, NULL, v, rec, bytes, NULL, 0, NULL), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_encode(&f, D, k, NULL, rec, bytes, NULL, 0, NULL), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_encode(&f, D, k, v, NULL, bytes, NULL, 0, NULL), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_encode(NULL, D, k, v, rec, bytes, NULL, 0, NULL), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_decode(&f, D, NULL, bytes, kd, vd, 0), KVARN_ERR_INVALID_ARG);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_record_bytes),
        cmocka_unit_test(test_fields_and_formula),
        cmocka_unit_test(test_exact),
        cmocka_unit_test(test_int_round_half_even),
        cmocka_unit_test(test_rtn_batch_entry),
        cmocka_unit_test(test_rtn_rows_fit_matches_encode),
        cmocka_unit_test(test_fp8_tiny_rows),
        cmocka_unit_test(test_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
