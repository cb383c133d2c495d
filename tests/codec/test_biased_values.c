/* test_biased_values.c -- KVarN on value tiles with a mean: the spec's
 * presets against their mean-centred variants (kvarn_k{kb}v{vb}_g128c,
 * kvarn.h kvarn_format.centred) and the error-minimizing RTN range
 * (KVARN_RTN_MSE), on one 128-token tile at a time, D in {64, 128}.
 *
 * Value cases (K is N(0,1) throughout):
 *   n01      V ~ N(0,1)
 *   bias1    V ~ N(0,1) + a per-channel bias ~ N(0,1) (drawn per tile)
 *   bias3    V ~ N(0,1) + a per-channel bias ~ N(0,3)
 *   uniform  V ~ U[5,6] (one offset common to all channels)
 * rel-RMS = RMS of V - V' over RMS of V's per-channel-centred values
 * (centred over the tile's tokens), pooled over NTILES tiles. The table is
 * printed (docs/kvarn-centred.md "Mean-centred values" quotes it).
 *
 * The bound (every centred format, both ranges, every tile and token row
 * t): the codec's step for the centred data. In the rotated basis the
 * record holds xc[t,d] = V_rot[t,d] - mu_d (mu_d: the stored fp16 channel
 * mean, subtracted as stored), balanced to y[t,d] = xc[t,d] / s_d / r_t
 * (s_d: the stored channel scale, r_t the row's balance scale). Min/max RTN
 * of row t leaves |y - y'| <= range_d(y) / (2 qmax), i.e. in x units
 *   |e[t,d]| <= h0[t,d] = range_d(xc[t,d] / s_d) s_d / (2 qmax)
 * (r_t cancels), where qmax = 2^vb - 1. Slack, all from the record's own
 * fields: the encoder's s_d is the fp32 value the stored fp16 rounds (2^-11
 * relative), which moves range_d(xc / s_d) by at most 2^-10 max_d |xc /
 * s_d|; the stored a_t, b_t, s_d are fp16 (2^-11 relative each, on the
 * decoded c a_t + b_t and its product: 2^-10 (c |a_t| + |b_t|) s_d with
 * margin); the codec's fp32 rotation, centring and decode against this
 * file's double rotation: 2^-20 (|V_rot| + |mu|). So
 *   h[t,d] = h0 + 2^-10 max_d |xc / s_d| s_d / qmax
 *            + 2^-10 (c |a_t| + |b_t|) s_d + 2^-20 (|V_rot| + |mu_d|).
 * KVARN_RTN_MINMAX: |e[t,d]| <= h[t,d] for every element. KVARN_RTN_MSE
 * clips, so no element bound holds, but its range is the one of least
 * sum_d s_d^2 (y - y')^2 among candidates that include min/max
 * (kvarn_tile.c rtn_row_mse), so row t's fp32 error is at most min/max's,
 * sqrt(sum_d h0^2), and with the slack (triangle inequality)
 *   ||e[t,:]|| <= ||h0[t,:]|| + ||h[t,:] - h0[t,:]||.
 * The uncentred presets fail this bound on the biased cases (their step is
 * that of the biased data): printed beside, not asserted.
 *
 * Asserted besides, the goals of the issue that asked for the centred
 * formats: the centred k4v2 with the MSE range on each biased case within
 * 1.2x its error on n01 (after centring, bias1 and bias3 are n01 less the
 * tile's sample mean, and uniform is a flatter distribution, so the step
 * and the error are those of n01 or below), and on n01 no worse than the
 * spec's kvarn_k4v2_g128 (the MSE range never raises a row's error on its
 * objective, and centring removes the sample means). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "kvarn/kvarn.h"
#include "kvarn/record.h"
#include "common/testutil.h"

#define G 128
#define MAXD 128
#define NTILES 8

enum { CASE_N01, CASE_BIAS1, CASE_BIAS3, CASE_UNIFORM, NCASE };
static const char *const k_case_names[NCASE] = {"N(0,1)", "N(0,1) + bias N(0,1)",
                                                "N(0,1) + bias N(0,3)", "U[5,6]"};

/* One tile: K ~ N(0,1), V by case; fp32 [G][D]. */
static void make_tile(test_rng *r, int c, int D, float *k, float *v)
{
    double bias[MAXD];
    for (int d = 0; d < D; d++)
        bias[d] = c == CASE_BIAS1 ? test_rng_normal(r) : c == CASE_BIAS3 ? 3.0 * test_rng_normal(r) : 0.0;
    for (int t = 0; t < G; t++)
        for (int d = 0; d < D; d++) {
            k[t * D + d] = (float)test_rng_normal(r);
            v[t * D + d] = c == CASE_UNIFORM ? (float)(5.0 + test_rng_uniform(r))
                                             : (float)(test_rng_normal(r) + bias[d]);
        }
}

/* x [D] *= H / sqrt(D), Sylvester natural order (spec step 1), in double. */
static void hadamard(double *x, int D)
{
    for (int h = 1; h < D; h *= 2)
        for (int i = 0; i < D; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                double a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    for (int i = 0; i < D; i++) x[i] /= sqrt((double)D);
}

static float f16_at(const uint8_t *rec, size_t off, int i)
{
    uint16_t h;
    memcpy(&h, rec + off + 2 * (size_t)i, 2);
    return kvarn_fp16_to_fp32(h);
}

static unsigned code_at(const uint8_t *row, int i, int bits)
{
    int per = 8 / bits;
    return (row[i / per] >> ((i % per) * bits)) & ((1u << bits) - 1u);
}

/* Sum of squared V errors of one tile under fmt (per-token formats: G
 * records), decoded to the original basis. */
static double tile_err2(const kvarn_format *f, int rtn, int D, const float *k, const float *v,
                        uint8_t *rec, void *ws, size_t wsz)
{
    static float kd[G * MAXD], vd[G * MAXD];
    const size_t rb = kvarn_record_bytes(f, D);
    kvarn_codec_opts o = KVARN_CODEC_OPTS_DEFAULT;
    o.rtn_range = rtn;
    if (f->per_tile) {
        assert_int_equal(kvarn_encode(f, D, k, v, rec, rb, ws, wsz, &o), KVARN_OK);
        assert_int_equal(kvarn_decode(f, D, rec, rb, kd, vd, 0), KVARN_OK);
    } else {
        for (int t = 0; t < G; t++) {
            assert_int_equal(kvarn_encode(f, D, k + t * D, v + t * D, rec, rb, NULL, 0, &o), KVARN_OK);
            assert_int_equal(kvarn_decode(f, D, rec, rb, kd + t * D, vd + t * D, 0), KVARN_OK);
        }
    }
    double e2 = 0.0;
    for (int i = 0; i < G * D; i++) e2 += ((double)vd[i] - v[i]) * ((double)vd[i] - v[i]);
    return e2;
}

/* Sum of squared per-channel-centred values (the rel-RMS denominator). */
static double centred_energy(int D, const float *v)
{
    double e2 = 0.0;
    for (int d = 0; d < D; d++) {
        double m = 0.0;
        for (int t = 0; t < G; t++) m += v[t * D + d];
        m /= G;
        for (int t = 0; t < G; t++) e2 += (v[t * D + d] - m) * (v[t * D + d] - m);
    }
    return e2;
}

/* The step bound of the header on the record just encoded (fmt centred);
 * returns sum_t ||h[t,:]||^2 (the predicted error energy, for the table). */
static double check_step_bound(const kvarn_format *f, int rtn, int D, const float *v,
                               const uint8_t *rec)
{
    kvarn_record_layout L;
    assert_int_equal(kvarn_record_layout_get(f, D, &L), KVARN_OK);
    assert_int_equal((int)L.v_mu_bytes, 2 * D);
    static float vd[G * MAXD];
    assert_int_equal(kvarn_decode(f, D, rec, L.record_bytes, NULL, vd, KVARN_DECODE_ROTATED), KVARN_OK);
    const int vb = L.value_bits;
    const double qmax = (double)((1 << vb) - 1);
    const size_t vrow = (size_t)D * vb / 8;
    double pred2 = 0.0;
    for (int t = 0; t < G; t++) {
        double vr[MAXD], xs[MAXD];
        for (int d = 0; d < D; d++) vr[d] = v[t * D + d];
        hadamard(vr, D);
        double lo = INFINITY, hi = -INFINITY, amax = 0.0;
        for (int d = 0; d < D; d++) {
            xs[d] = (vr[d] - f16_at(rec, L.v_mu_off, d)) / f16_at(rec, L.v_schan_off, d);
            lo = xs[d] < lo ? xs[d] : lo;
            hi = xs[d] > hi ? xs[d] : hi;
            amax = fabs(xs[d]) > amax ? fabs(xs[d]) : amax;
        }
        const double at = fabs(f16_at(rec, L.v_a_off, t)), bt = fabs(f16_at(rec, L.v_b_off, t));
        double e2 = 0.0, h02 = 0.0, sl2 = 0.0;
        for (int d = 0; d < D; d++) {
            const double s = f16_at(rec, L.v_schan_off, d), mu = f16_at(rec, L.v_mu_off, d);
            const double c = code_at(rec + L.v_codes_off + (size_t)t * vrow, d, vb);
            const double h0 = (hi - lo) * s / (2.0 * qmax);
            const double sl = 0x1p-10 * amax * s / qmax + 0x1p-10 * (c * at + bt) * s +
                              0x1p-20 * (fabs(vr[d]) + fabs(mu));
            const double e = (double)vd[t * D + d] - vr[d];
            if (rtn == KVARN_RTN_MINMAX && !(fabs(e) <= h0 + sl)) {
                print_error("%s D=%d token %d channel %d: |e| %.6g > step bound %.6g\n", f->name, D,
                            t, d, fabs(e), h0 + sl);
                fail();
            }
            e2 += e * e;
            h02 += h0 * h0;
            sl2 += sl * sl;
        }
        if (!(sqrt(e2) <= sqrt(h02) + sqrt(sl2))) {
            print_error("%s D=%d rtn %d token %d: ||e|| %.6g > step bound %.6g + %.3g\n", f->name, D,
                        rtn, t, sqrt(e2), sqrt(h02), sqrt(sl2));
            fail();
        }
        pred2 += (sqrt(h02) + sqrt(sl2)) * (sqrt(h02) + sqrt(sl2));
    }
    return pred2;
}

/* The rows of the table: format name and RTN range. */
typedef struct variant {
    const char *name;
    int rtn;
} variant;

static const variant k_variants[] = {
    {"kvarn_k4v2_g128", KVARN_RTN_MINMAX}, {"kvarn_k4v2_g128", KVARN_RTN_MSE},
    {"kvarn_k4v2_g128c", KVARN_RTN_MINMAX}, {"kvarn_k4v2_g128c", KVARN_RTN_MSE},
    {"kvarn_k4v4_g128", KVARN_RTN_MINMAX}, {"kvarn_k4v4_g128", KVARN_RTN_MSE},
    {"kvarn_k4v4_g128c", KVARN_RTN_MINMAX}, {"kvarn_k4v4_g128c", KVARN_RTN_MSE},
    {"int4", KVARN_RTN_MINMAX},
};
#define NVAR ((int)(sizeof k_variants / sizeof k_variants[0]))

static void run_table(int D, double rel[NVAR][NCASE])
{
    static float k[G * MAXD], v[G * MAXD];
    static uint8_t rec[32768];
    kvarn_format c;
    assert_int_equal(kvarn_format_parse("kvarn_k8v8_g128c", &c), KVARN_OK);
    const size_t wsz = kvarn_encode_workspace_bytes(&c, D);
    void *ws = malloc(wsz);
    assert_non_null(ws);
    double pred[NVAR][NCASE] = {{0}};
    for (int cs = 0; cs < NCASE; cs++) {
        double err2[NVAR] = {0}, pred2[NVAR] = {0}, ref2 = 0.0;
        test_rng r;
        test_rng_seed(&r, 1000u * (uint64_t)D + (uint64_t)cs);
        for (int tile = 0; tile < NTILES; tile++) {
            make_tile(&r, cs, D, k, v);
            ref2 += centred_energy(D, v);
            for (int i = 0; i < NVAR; i++) {
                kvarn_format f;
                assert_int_equal(kvarn_format_parse(k_variants[i].name, &f), KVARN_OK);
                assert_true((size_t)kvarn_record_bytes(&f, D) <= sizeof rec);
                err2[i] += tile_err2(&f, k_variants[i].rtn, D, k, v, rec, ws, wsz);
                if (f.centred) pred2[i] += check_step_bound(&f, k_variants[i].rtn, D, v, rec);
            }
        }
        for (int i = 0; i < NVAR; i++) {
            rel[i][cs] = sqrt(err2[i] / ref2);
            pred[i][cs] = sqrt(pred2[i] / ref2);
        }
    }
    free(ws);
    printf("D = %d, %d tiles of %d tokens per case; V rel-RMS (step bound of the centred "
           "formats in brackets)\n| variant |", D, NTILES, G);
    for (int cs = 0; cs < NCASE; cs++) printf(" %s |", k_case_names[cs]);
    printf("\n");
    for (int i = 0; i < NVAR; i++) {
        printf("| %s%s |", k_variants[i].name,
               strncmp(k_variants[i].name, "kvarn", 5) ? "" : k_variants[i].rtn == KVARN_RTN_MSE ? " mse" : " minmax");
        for (int cs = 0; cs < NCASE; cs++)
            if (pred[i][cs] > 0.0) printf(" %.3f (%.3f) |", rel[i][cs], pred[i][cs]);
            else printf(" %.3f |", rel[i][cs]);
        printf("\n");
    }
}

static void check_goals(double rel[NVAR][NCASE])
{
    const int spec = 0, best = 3; /* kvarn_k4v2_g128 minmax, kvarn_k4v2_g128c mse */
    for (int cs = CASE_BIAS1; cs < NCASE; cs++) assert_true(rel[best][cs] <= 1.2 * rel[best][CASE_N01]);
    assert_true(rel[best][CASE_N01] <= rel[spec][CASE_N01]);
}

static void test_table_d64(void **state)
{
    (void)state;
    double rel[NVAR][NCASE];
    run_table(64, rel);
    check_goals(rel);
}

static void test_table_d128(void **state)
{
    (void)state;
    double rel[NVAR][NCASE];
    run_table(128, rel);
    check_goals(rel);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_table_d64),
        cmocka_unit_test(test_table_d128),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
