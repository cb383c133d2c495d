/* test_hadamard.c -- the normalized fast Walsh-Hadamard transform of
 * src/codec/hadamard.c (../shared/spec/KVARN.md "Store pipeline" step 1).
 *
 * Oracles, independent of the code under test: the explicit Sylvester
 * matrix H[i][j] = (-1)^popcount(i & j) / sqrt(D) multiplied out in double;
 * orthonormality (H*H = I, norms preserved); the scalar version as the
 * oracle of the SIMD one (bit-identical). D in {64, 128, 256, 512}. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "codec/hadamard.h"
#include "common/levels.h"
#include "common/testutil.h"

static const int k_dims[] = {64, 128, 256, 512};
#define N_DIMS ((int)(sizeof k_dims / sizeof k_dims[0]))
enum { MAXD = 512 };

static double sylvester(int i, int j, int d)
{
    return (__builtin_popcount((unsigned)(i & j)) & 1 ? -1.0 : 1.0) / sqrt((double)d);
}

/* Error bound of the fp32 transform, derived from its structure: log2(d)
 * butterfly stages of one addition each, then one multiplication by the
 * rounded scale fl(1/sqrt(d)). Every input reaches output i through log2(d)
 * additions, so before scaling the error is at most gamma_L * sum|x_j|
 * (L = log2 d, gamma_L = L u / (1 - L u), u = 2^-24; Higham, "Accuracy and
 * Stability of Numerical Algorithms", Lemma 3.1 / eq. 4.4); the rounded
 * scale and the product add 2u of the result:
 *   |y_i - (Hx)_i| <= gamma_L * sum_j |x_j| / sqrt(d) + 2u |(Hx)_i|. */
static double fwht_bound(const float *x, int d, double ref_i)
{
    const double u = 1.0 / 16777216.0;
    int L = 0;
    while ((1 << L) < d) L++;
    double l1 = 0.0;
    for (int j = 0; j < d; j++) l1 += fabs((double)x[j]);
    double gamma = L * u / (1.0 - L * u);
    return (gamma * l1 / sqrt((double)d) + 2.0 * u * fabs(ref_i)) * (1.0 + 1e-12);
}

static void fill_normal(test_rng *r, float *x, int n, double sd)
{
    for (int i = 0; i < n; i++) x[i] = (float)(sd * test_rng_normal(r));
}

/* Rotating the unit vectors gives the columns of H/sqrt(D); their products
 * must be the identity (H*H = I: H is symmetric and orthonormal). */
static void test_orthonormal(void **state)
{
    (void)state;
    static float cols[MAXD][MAXD];
    for (int k = 0; k < N_DIMS; k++) {
        const int d = k_dims[k];
        for (int j = 0; j < d; j++) {
            memset(cols[j], 0, sizeof cols[j]);
            cols[j][j] = 1.0f;
            kvarn_hadamard(cols[j], d);
        }
        double worst = 0.0;
        for (int i = 0; i < d; i++) {
            for (int j = 0; j < d; j++) {
                /* symmetric: column j, row i equals column i, row j */
                assert_true(cols[j][i] == cols[i][j]);
                double dot = 0.0;
                for (int l = 0; l < d; l++) dot += (double)cols[i][l] * cols[j][l];
                double err = fabs(dot - (i == j ? 1.0 : 0.0));
                worst = err > worst ? err : worst;
            }
        }
        /* Each column entry is +-fl(1/sqrt(d)) (additions of 0 and one
         * nonzero are exact): relative error u; a product of two entries
         * 2u + u^2, d of them summed in double: |dot - exact| <= 3u. */
        assert_true(worst <= 3.0 / 16777216.0);
    }
}

/* Random vectors: matches the explicit matrix product (in double), keeps the
 * L2 norm, and applying it twice gives the input back. */
static void test_matches_matrix(void **state)
{
    (void)state;
    test_rng r;
    test_rng_seed(&r, 0x4ada3a4dull);
    float x[MAXD], y[MAXD];
    for (int k = 0; k < N_DIMS; k++) {
        const int d = k_dims[k];
        for (int rep = 0; rep < 20; rep++) {
            fill_normal(&r, x, d, rep % 2 ? 1.0 : 1000.0);
            memcpy(y, x, sizeof(float) * (size_t)d);
            kvarn_hadamard(y, d);
            double nx = 0.0, ny = 0.0, b2 = 0.0, bmax = 0.0;
            float y1[MAXD];
            for (int i = 0; i < d; i++) {
                double ref = 0.0;
                for (int j = 0; j < d; j++) ref += sylvester(i, j, d) * x[j];
                double b = fwht_bound(x, d, ref);
                assert_true(fabs(y[i] - ref) <= b);
                b2 += b * b;
                bmax = fmax(bmax, b);
                nx += (double)x[i] * x[i];
                ny += (double)y[i] * y[i];
            }
            /* the norm moves by at most the error vector's norm */
            assert_true(fabs(sqrt(ny) - sqrt(nx)) <= sqrt(b2));
            memcpy(y1, y, sizeof(float) * (size_t)d);
            kvarn_hadamard(y, d); /* its own inverse */
            /* the first pass's error, rotated (each element at most
             * sum_j |e_j| / sqrt(d) <= sqrt(d) bmax), plus the second pass's */
            for (int i = 0; i < d; i++)
                assert_true(fabs(y[i] - x[i]) <= sqrt((double)d) * bmax + fwht_bound(y1, d, x[i]));
        }
    }
}

/* The SIMD path (and the dispatching entry points, at every level this
 * process runs: the walk of tests/common/levels.h) equal the scalar oracle
 * bit for bit, one vector and many rows at a time. The AVX2 kernels run
 * where the library runs AVX2 (levels_top). */
#ifdef KVARN_HADAMARD_HAVE_AVX2
/* One SIMD variant against the scalar oracle, bit for bit: rows vectors
 * of d through its rows entry, then one vector through the single one
 * (a, b: scratch of rows * d floats). */
static void check_variant(test_rng *r, void (*rows_fn)(float *, int, int), void (*one)(float *, int),
                          int d, int rows, float *a, float *b)
{
    const int n = rows * d;
    fill_normal(r, a, n, 3.0);
    memcpy(b, a, sizeof(float) * (size_t)n);
    for (int i = 0; i < rows; i++) kvarn_hadamard_scalar(a + i * d, d);
    rows_fn(b, rows, d);
    assert_memory_equal(a, b, sizeof(float) * (size_t)n);
    fill_normal(r, a, d, 1.0);
    memcpy(b, a, sizeof(float) * (size_t)d);
    kvarn_hadamard_scalar(a, d);
    one(b, d);
    assert_memory_equal(a, b, sizeof(float) * (size_t)d);
}
#endif

static void test_simd_equals_scalar(void **state)
{
    (void)state;
    test_rng r;
    test_rng_seed(&r, 0x51dull);
    static float a[8 * MAXD], b[8 * MAXD], c[8 * MAXD];
    for (int k = 0; k < N_DIMS; k++) {
        const int d = k_dims[k], rows = 8, n = rows * d;
        fill_normal(&r, a, n, 3.0);
        a[5] = 1e30f; /* large values take the same path too */
        memcpy(c, a, sizeof(float) * (size_t)n); /* the input, kept */
        for (int i = 0; i < rows; i++) kvarn_hadamard_scalar(a + i * d, d);
        LEVELS_FOR(it) {
            memcpy(b, c, sizeof(float) * (size_t)n);
            kvarn_hadamard_rows(b, rows, d);
            assert_memory_equal(a, b, sizeof(float) * (size_t)n);
            memcpy(b, c, sizeof(float) * (size_t)n);
            for (int i = 0; i < rows; i++) kvarn_hadamard(b + i * d, d);
            assert_memory_equal(a, b, sizeof(float) * (size_t)n);
            /* the choice made once (kvarn__hadamard_pick): the same bits */
            const kvarn_hadamard_fn f = kvarn__hadamard_pick(d);
            assert_non_null(f);
            memcpy(b, c, sizeof(float) * (size_t)n);
            for (int i = 0; i < rows; i++) f(b + i * d, d);
            assert_memory_equal(a, b, sizeof(float) * (size_t)n);
            if (it.index == 0) assert_true(f == kvarn_hadamard_scalar);
        }
#ifdef KVARN_HADAMARD_HAVE_AVX2
        if (levels_top() >= levels_index_of("avx512"))
            check_variant(&r, kvarn_hadamard_rows_avx512, kvarn_hadamard_avx512, d, rows, a, b);
        if (levels_top() >= levels_index_of("avx2"))
            check_variant(&r, kvarn_hadamard_rows_avx2, kvarn_hadamard_avx2, d, rows, a, b);
#endif
    }
#ifdef KVARN_HADAMARD_HAVE_AVX2
    /* the AVX2 and AVX-512 block sizes below 64 as well */
    if (levels_top() >= levels_index_of("avx2"))
        for (int d = 8; d <= 32; d <<= 1) {
            fill_normal(&r, a, d, 2.0);
            memcpy(b, a, sizeof(float) * (size_t)d);
            kvarn_hadamard_scalar(a, d);
            kvarn_hadamard_avx2(b, d);
            assert_memory_equal(a, b, sizeof(float) * (size_t)d);
            if (d < 16 || levels_top() < levels_index_of("avx512")) continue;
            fill_normal(&r, a, d, 2.0);
            memcpy(b, a, sizeof(float) * (size_t)d);
            kvarn_hadamard_scalar(a, d);
            kvarn_hadamard_avx512(b, d);
            assert_memory_equal(a, b, sizeof(float) * (size_t)d);
        }
#endif
    /* Small powers of two: below one AVX2 vector the scalar path runs. */
    for (int d = 1; d <= 16; d <<= 1) {
        float x1[16], x2[16];
        fill_normal(&r, x1, d, 1.0);
        memcpy(x2, x1, sizeof x1);
        kvarn_hadamard(x1, d);
        for (int i = 0; i < d; i++) {
            double ref = 0.0;
            for (int j = 0; j < d; j++) ref += sylvester(i, j, d) * x2[j];
            assert_true(fabs(x1[i] - ref) <= fwht_bound(x2, d, ref));
        }
    }
}

/* Known values: H/sqrt(D) maps e_0 to the constant 1/sqrt(D) vector and the
 * constant vector back to sqrt(D) e_0. */
static void test_known_vectors(void **state)
{
    (void)state;
    float x[MAXD];
    for (int k = 0; k < N_DIMS; k++) {
        const int d = k_dims[k];
        memset(x, 0, sizeof x);
        x[0] = 1.0f;
        kvarn_hadamard(x, d);
        /* e_0: every output is 1 * fl(1/sqrt(d)); against 1/sqrt(d) in
         * double: u relative. The constant vector: d (exact integer sums)
         * times fl(1/sqrt(d)), rounded: 2u relative of sqrt(d). */
        const double u = 1.0 / 16777216.0, rd = 1.0 / sqrt((double)d);
        for (int i = 0; i < d; i++) assert_true(fabs(x[i] - rd) <= u * rd);
        for (int i = 0; i < d; i++) x[i] = 1.0f;
        kvarn_hadamard(x, d);
        assert_true(fabs(x[0] - sqrt((double)d)) <= 2.0 * u * sqrt((double)d));
        for (int i = 1; i < d; i++) assert_true(x[i] == 0.0f);
    }
}

/* A d that is not a power of two leaves x unchanged (and reads nothing
 * past x[d-1]: ASan build). */
static void test_bad_d(void **state)
{
    (void)state;
    const int bad[] = {0, -8, 3, 12, 96, 100};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int n = bad[i] > 0 ? bad[i] : 1;
        float *x = malloc(sizeof(float) * (size_t)n), *y = malloc(sizeof(float) * (size_t)n);
        assert_non_null(x);
        assert_non_null(y);
        for (int j = 0; j < n; j++) x[j] = y[j] = (float)j + 0.5f;
        kvarn_hadamard(x, bad[i]);
        kvarn_hadamard_rows(x, 1, bad[i]);
        kvarn_hadamard_scalar(x, bad[i]);
        assert_memory_equal(x, y, sizeof(float) * (size_t)n);
        free(x);
        free(y);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_orthonormal),
        cmocka_unit_test(test_matches_matrix),
        cmocka_unit_test_teardown(test_simd_equals_scalar, levels_teardown),
        cmocka_unit_test(test_known_vectors),
        cmocka_unit_test(test_bad_d),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
