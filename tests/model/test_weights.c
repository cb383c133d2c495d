/*
 * test_weights.c -- the weight matrices of the llama runner
 * (src/model/llama_weights.c): the bf16 matmul (oneDNN) and the fp32 one
 * (OpenBLAS) against a double-precision reference on random matrices of
 * SmolLM2's shapes, for one token (decode), a prefill chunk and odd counts.
 *
 * Bound. In bf16 the matmul rounds X to bf16 (x^) and holds W in bf16
 * (w^, rounded at load); a product of two bf16 numbers (8-bit significands)
 * is exact in fp32 (24 bits), so the only error left is the fp32 summation
 * of K exact terms in some order: |y - sum x^ w^| <= gamma_K sum |x^ w^|,
 * gamma_K = K u / (1 - K u), u = 2^-24 (Higham, Accuracy and Stability,
 * eq. 3.5; any order, any blocking). The reference applies the same
 * rounding (kvarn_fp32_to_bf16, nearest even) and sums in double (its own
 * error, K 2^-53 sum|.|, is far below). In fp32 the same bound holds for the
 * unrounded x, w (OpenBLAS: fp32 products, one rounding each, are covered
 * by gamma_(K+1) instead: used for both). A matmul that truncated instead of
 * rounding, read W in another layout or summed in bf16 exceeds it by orders
 * of magnitude (2^-8 relative against 1536 * 2^-24 = 2^-13.4).
 *
 * int8 (check_int8): W row j is held as codes times s_j = max|w_j| / 127,
 * each weight within s_j / 2 of the given one; X row t likewise with
 * c_t = max|x_t| / 127. With dw, dx those errors,
 *   |y - sum x w| <= sum |x||dw| + sum |w||dx| + sum |dx||dw| + rounding
 *                 <= (s_j/2) sum|x| + (c_t/2) sum|w| + K s_j c_t / 4 + r,
 * each half-step term taken x (1 + 2^-15) for the float rounding of
 * x * (127 / max) before the rint (two roundings of a value <= 127 move
 * it by at most 2 x 127 x 2^-24 < 2^-16, a 2^-15 share of the half
 * step). The int32 sum of codes is exact (K 127^2 < 2^31); the result is
 * rounded three times (int32 -> float, x s_j, x c_t):
 * r = 3.01 u sum (|x| + c_t/2)(|w| + s_j/2), u = 2^-24. The reference is
 * the unquantized double sum. That bound is a worst case (a few % of
 * sum|x||w|), so a second, tight check recomputes the codes by the
 * documented rule (rint of x * (127 / max) in float, clamped to 127) and
 * the exact sum c_t s_j sum p q in double: y is within the three
 * roundings, 3.01 u |c_t s_j sum p q|. A scale off by 1% on one row, a
 * row's scale applied to another (rows here differ in scale by up to 16x)
 * or codes read in another layout fail it.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/testutil.h"
#include "model/llama_internal.h"

/* A model shell holding only what llama_weights.c reads. */
static kvarn_llama *shell(kvarn_llama_weights w)
{
    kvarn_llama *m = calloc(1, sizeof *m);
    assert_non_null(m);
    assert_int_equal(kvarn__alloc_init(&m->alloc, NULL), KVARN_OK);
    m->weights = w;
    return m;
}

static void check_shape(kvarn_llama_weights wt, int out, int in, const int *ns, int n_ns)
{
    kvarn_llama *m = shell(wt);
    if (wt == KVARN_LLAMA_WEIGHTS_BF16) {
        kvarn_status st = llama_weights_engine_create(m);
        if (st == KVARN_ERR_UNSUPPORTED) { free(m); skip(); }
        assert_int_equal(st, KVARN_OK);
    }
    llama_matrix w;
    assert_int_equal(llama_matrix_alloc(m, &w, out, in), KVARN_OK);
    test_rng rng;
    test_rng_seed(&rng, (uint64_t)out * 7919 + (uint64_t)in);
    float *row = malloc(sizeof(float) * (size_t)in);
    assert_non_null(row);
    for (int r = 0; r < out; r++) {
        for (int i = 0; i < in; i++) row[i] = (float)(test_rng_normal(&rng) * 0.05);
        llama_matrix_set_rows(&w, r, 1, row);
    }
    float *wr = malloc(sizeof(float) * (size_t)out * in);
    assert_non_null(wr);
    for (int r = 0; r < out; r++) llama_matrix_get_row(&w, r, wr + (size_t)r * in);
    /* bf16: reordered into oneDNN's layout, the plain copy freed; a CPU
     * without AVX-512 has no oneDNN bf16 matmul (unsupported, a skip) */
    kvarn_status pst = llama_matrix_prepare(m, &w, 0);
    if (wt == KVARN_LLAMA_WEIGHTS_BF16 && pst == KVARN_ERR_UNSUPPORTED) {
        llama_matrix_free(m, &w);
        llama_weights_engine_destroy(m);
        free(wr);
        free(row);
        free(m);
        skip();
    }
    assert_int_equal(pst, KVARN_OK);
    int nmax = 0;
    for (int i = 0; i < n_ns; i++) nmax = ns[i] > nmax ? ns[i] : nmax;
    llama_mm_ctx c;
    assert_int_equal(llama_mm_ctx_create(m, &m->alloc, nmax, in, 1, &c), KVARN_OK);
    float *x = malloc(sizeof(float) * (size_t)nmax * in);
    float *y = malloc(sizeof(float) * (size_t)nmax * out);
    assert_true(x && y);
    const int bf = wt == KVARN_LLAMA_WEIGHTS_BF16;
    const double u = 1.0 / 16777216.0, gamma = (in + 1) * u / (1.0 - (in + 1) * u);
    for (int k = 0; k < n_ns; k++) {
        int n = ns[k];
        /* activations of both signs and a spread of magnitudes, as after
         * RMSNorm (|x| up to ~10) */
        for (size_t i = 0; i < (size_t)n * in; i++)
            x[i] = (float)(test_rng_normal(&rng) * (i % 97 == 0 ? 8.0 : 1.0));
        assert_int_equal(llama_matmul(&c, x, n, &w, y), KVARN_OK);
        double worst = 0;
        for (int t = 0; t < n; t++)
            for (int j = 0; j < out; j++) {
                double s = 0, l1 = 0;
                for (int i = 0; i < in; i++) {
                    float xi = x[(size_t)t * in + i];
                    if (bf) xi = kvarn_bf16_to_fp32(kvarn_fp32_to_bf16(xi));
                    double p = (double)xi * wr[(size_t)j * in + i];
                    s += p;
                    l1 += fabs(p);
                }
                double e = fabs((double)y[(size_t)t * out + j] - s);
                double b = gamma * l1;
                if (!(e <= b)) {
                    print_error("%s [%d x %d] n %d: y[%d][%d] = %.9g, ref %.9g, bound %.3g\n",
                                bf ? "bf16" : "fp32", out, in, n, t, j, (double)y[(size_t)t * out + j],
                                s, b);
                    fail();
                }
                if (e / (b > 0 ? b : 1) > worst) worst = e / b;
            }
        (void)worst;
    }
    if (bf) {
        /* the weights are bf16: each within half a bf16 step (2^-8
         * relative) of what was given, and exactly representable */
        for (int i = 0; i < in; i++) {
            float v = wr[(size_t)(out - 1) * in + i];
            assert_true(kvarn_bf16_to_fp32(kvarn_fp32_to_bf16(v)) == v);
        }
    }
    llama_mm_ctx_destroy(&m->alloc, &c);
    llama_matrix_free(m, &w);
    llama_weights_engine_destroy(m);
    free(x);
    free(y);
    free(wr);
    free(row);
    free(m);
}

/* The int8 codes of a row by the documented rule; returns the scale. */
static float ref_codes(const float *x, int in, int8_t *q)
{
    float amax = 0.0f;
    for (int i = 0; i < in; i++) amax = fmaxf(amax, fabsf(x[i]));
    if (amax == 0.0f) {
        for (int i = 0; i < in; i++) q[i] = 0;
        return 0.0f;
    }
    float inv = 127.0f / amax;
    for (int i = 0; i < in; i++) {
        float v = rintf(x[i] * inv);
        q[i] = (int8_t)(v >= 127.0f ? 127 : v <= -127.0f ? -127 : (int)v);
    }
    return amax / 127.0f;
}

/* int8: the bounds in the header, against the unquantized double sum and
 * against the exact sum of the codes. */
static void check_int8(int out, int in, const int *ns, int n_ns)
{
    kvarn_llama *m = shell(KVARN_LLAMA_WEIGHTS_INT8);
    kvarn_status st = llama_weights_engine_create(m);
    if (st == KVARN_ERR_UNSUPPORTED) { free(m); skip(); }
    assert_int_equal(st, KVARN_OK);
    llama_matrix w;
    assert_int_equal(llama_matrix_alloc(m, &w, out, in), KVARN_OK);
    test_rng rng;
    test_rng_seed(&rng, (uint64_t)out * 104729 + (uint64_t)in);
    float *wt = malloc(sizeof(float) * (size_t)out * in); /* as given */
    float *wq = malloc(sizeof(float) * (size_t)out * in); /* as held */
    assert_true(wt && wq);
    for (size_t i = 0; i < (size_t)out * in; i++)
        wt[i] = (float)(test_rng_normal(&rng) * (i % 61 == 0 ? 0.3 : 0.05) *
                        (1 << (i / (size_t)in % 3)));
    for (int r = 0; r < out; r++) llama_matrix_set_rows(&w, r, 1, wt + (size_t)r * in);
    for (int r = 0; r < out; r++) llama_matrix_get_row(&w, r, wq + (size_t)r * in);
    /* each held weight within half a step of the given one */
    for (int r = 0; r < out; r++) {
        double amax = 0;
        for (int i = 0; i < in; i++) amax = fmax(amax, fabs(wt[(size_t)r * in + i]));
        for (int i = 0; i < in; i++)
            assert_true(fabs(wq[(size_t)r * in + i] - wt[(size_t)r * in + i]) <=
                        amax / 254.0 * (1 + 0x1p-15));
    }
    assert_int_equal(llama_matrix_prepare(m, &w, 0), KVARN_OK);
    int nmax = 0;
    for (int i = 0; i < n_ns; i++) nmax = ns[i] > nmax ? ns[i] : nmax;
    llama_mm_ctx c;
    assert_int_equal(llama_mm_ctx_create(m, &m->alloc, nmax, in, 1, &c), KVARN_OK);
    float *x = malloc(sizeof(float) * (size_t)nmax * in);
    float *y = malloc(sizeof(float) * (size_t)nmax * out);
    int8_t *xq = malloc((size_t)in), *qw = malloc((size_t)in);
    assert_true(x && y && xq && qw);
    const double u = 0x1p-24, slack = 1 + 0x1p-15;
    for (int k = 0; k < n_ns; k++) {
        int n = ns[k];
        /* rows of scales 1, 2, 4, 8, 16 apart, and a zero row */
        for (size_t i = 0; i < (size_t)n * in; i++)
            x[i] = (float)(test_rng_normal(&rng) * (i % 97 == 0 ? 8.0 : 1.0) *
                           (1 << (i / (size_t)in % 5)));
        if (n > 2) memset(x + (size_t)in * 2, 0, sizeof(float) * (size_t)in);
        assert_int_equal(llama_matmul(&c, x, n, &w, y), KVARN_OK);
        for (int t = 0; t < n; t++) {
            const float *xr = x + (size_t)t * in;
            double xmax = 0, xl1 = 0;
            for (int i = 0; i < in; i++) {
                xmax = fmax(xmax, fabs(xr[i]));
                xl1 += fabs(xr[i]);
            }
            double ct = xmax / 127.0;
            float ctf = ref_codes(xr, in, xq);
            for (int j = 0; j < out; j++) {
                float sjf = ref_codes(wt + (size_t)j * in, in, qw);
                int64_t acc = 0;
                for (int i = 0; i < in; i++) acc += (int64_t)xq[i] * qw[i];
                double exact = (double)ctf * (double)sjf * (double)acc;
                double et = fabs((double)y[(size_t)t * out + j] - exact);
                if (!(et <= 3.01 * 0x1p-24 * fabs(exact))) {
                    print_error("int8 [%d x %d] n %d: y[%d][%d] = %.9g, codes' exact sum %.9g\n",
                                out, in, n, t, j, (double)y[(size_t)t * out + j], exact);
                    fail();
                }
                const float *wr = wt + (size_t)j * in;
                double s = 0, wl1 = 0, wmax = 0, rr = 0;
                for (int i = 0; i < in; i++) wmax = fmax(wmax, fabs(wr[i]));
                double sj = wmax / 127.0;
                for (int i = 0; i < in; i++) {
                    s += (double)xr[i] * wr[i];
                    wl1 += fabs(wr[i]);
                    rr += (fabs(xr[i]) + ct / 2) * (fabs(wr[i]) + sj / 2);
                }
                double b = slack * (sj / 2 * xl1 + ct / 2 * wl1 + in * sj * ct / 4) + 3.01 * u * rr;
                double e = fabs((double)y[(size_t)t * out + j] - s);
                if (!(e <= b)) {
                    print_error("int8 [%d x %d] n %d: y[%d][%d] = %.9g, ref %.9g, bound %.3g\n",
                                out, in, n, t, j, (double)y[(size_t)t * out + j], s, b);
                    fail();
                }
            }
        }
    }
    llama_mm_ctx_destroy(&m->alloc, &c);
    llama_matrix_free(m, &w);
    llama_weights_engine_destroy(m);
    free(x);
    free(y);
    free(wt);
    free(wq);
    free(xq);
    free(qw);
    free(m);
}

/* SmolLM2-135M's matrices (hidden 576, QKV 960, ffn 1536), tokens: one
 * (decode, the M = 1 primitive), a 128-token chunk (whole blocks of
 * LLAMA_MM_BLOCK), one block exactly, and odd counts: 2 (a block padded
 * with rows left by the call before, whose outputs are dropped), 37 (two
 * blocks, the last ending at row 37 over rows of the one before). */
static const int NS[] = { 1, 2, LLAMA_MM_BLOCK, 37, 128 };

static void test_bf16_matmul(void **state)
{
    (void)state;
    check_shape(KVARN_LLAMA_WEIGHTS_BF16, 960, 576, NS, 5);
    check_shape(KVARN_LLAMA_WEIGHTS_BF16, 576, 1536, NS, 5);
    check_shape(KVARN_LLAMA_WEIGHTS_BF16, 3072, 576, NS, 2);
    check_shape(KVARN_LLAMA_WEIGHTS_BF16, 33, 70, NS, 5); /* odd sizes */
}

static void test_int8_matmul(void **state)
{
    (void)state;
    check_int8(960, 576, NS, 5);
    check_int8(576, 1536, NS, 5);
    check_int8(33, 70, NS, 5); /* odd sizes */
}

static void test_fp32_matmul(void **state)
{
    (void)state;
    check_shape(KVARN_LLAMA_WEIGHTS_FP32, 960, 576, NS, 5);
    check_shape(KVARN_LLAMA_WEIGHTS_FP32, 576, 1536, NS, 5);
    check_shape(KVARN_LLAMA_WEIGHTS_FP32, 33, 70, NS, 5);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bf16_matmul),
        cmocka_unit_test(test_int8_matmul),
        cmocka_unit_test(test_fp32_matmul),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
