/*
 * test_qgemv.c -- the GEMV of the gguf weights (src/model/llama_qgemv*.c,
 * llama_weights.c): a matrix kept as the GGUF's own Q4_0 / Q4_1 / Q8_0
 * blocks times fp32 activations, at every SIMD level this CPU has (the
 * scalar reference is the oracle), and through llama_matmul (one token on
 * 1 and 2 threads; chunks through the dequantized slab and sgemm).
 *
 * Bounds.
 *  - Dequantization is exact: a code (at most 8 bits) times an fp16 scale
 *    (11 significant bits) is exact in fp32, so q d + m has one rounding
 *    and equals fma(q, d, m); every kernel's weights must be src/gguf/
 *    dequant.c's bit for bit (kvarn_ggml_dequantize is the reference).
 *    Checked on the dequant kernels directly and inside the GEMV: with a
 *    one-hot x (x_k = 1, others 0) every term but w_k is an exact zero, so
 *    y equals w_k exactly whatever the summation order.
 *  - One output: sum_i x_i w_i in fp32, any order, each product rounded at
 *    most once: |y - s| <= gamma_K sum_i |x_i w_i| with s the exact sum
 *    (here in double, whose own error, K 2^-53 sum|.|, is 2^-29 of the
 *    bound), K = in, u = 2^-24, gamma_K = K u / (1 - K u) (Higham,
 *    Accuracy and Stability, eq. 3.5). OpenBLAS's sgemm on the slab rounds
 *    each product and sums in any order: the same gamma_K (K - 1
 *    additions and one product rounding per term). A kernel that read a
 *    nibble from the wrong half, a wrong scale, or summed in bf16 misses
 *    it by orders of magnitude (one weight off by one step d is >= 2^-4 of
 *    its block's range; the bound is at most 1536 x 2^-24 = 2^-13.4 of
 *    sum|x w|).
 *  - NaN / Inf: as in fp32. A NaN activation makes every output NaN; an
 *    infinite x_k makes y_j = +-Inf by the sign of w_jk, NaN where
 *    w_jk = 0 (Inf x 0), the other terms finite.
 */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/cpu.h"
#include "common/levels.h"
#include "common/testutil.h"
#include "model/llama_internal.h"
#include "model/llama_qgemv.h"

static const kvarn_ggml_type TYPES[3] = {KVARN_GGML_Q4_0, KVARN_GGML_Q4_1, KVARN_GGML_Q8_0};

/* A random fp16 in [2^lo, 2^hi) of random sign (sign = 1) or positive. */
static uint16_t rand_half(test_rng *r, int lo, int hi, int sign)
{
    double e = lo + (hi - lo) * test_rng_uniform(r);
    float v = (float)pow(2.0, e);
    if (sign && test_rng_below(r, 2)) v = -v;
    return kvarn_fp32_to_fp16(v);
}

/* out rows of in weights of type as GGUF blocks, into q (row_bytes each):
 * every code value occurs; scales over fp16's range (subnormal to 2^15
 * when wide, else about 2^-8 to 2^-4 as real weights), Q4_1 minimums of
 * either sign. */
static void make_blocks(kvarn_ggml_type type, int out, int in, uint8_t *q, test_rng *r, int wide)
{
    size_t rb = (size_t)kvarn_ggml_row_bytes(type, (uint64_t)in);
    uint32_t bb = kvarn_ggml_block_bytes(type);
    for (int row = 0; row < out; row++)
        for (int b = 0; b < in / 32; b++) {
            uint8_t *p = q + (size_t)row * rb + (size_t)b * bb;
            uint16_t d = wide ? rand_half(r, -24, 15, 1) : rand_half(r, -8, -4, 0);
            memcpy(p, &d, 2);
            int hdr = 2;
            if (type == KVARN_GGML_Q4_1) {
                uint16_t m = wide ? rand_half(r, -24, 15, 1) : rand_half(r, -6, -2, 1);
                memcpy(p + 2, &m, 2);
                hdr = 4;
            }
            for (uint32_t k = (uint32_t)hdr; k < bb; k++)
                p[k] = (uint8_t)test_rng_below(r, 256);
        }
}

static void test_dequant_bit_exact(void **state)
{
    (void)state;
    test_rng r;
    test_rng_seed(&r, 11);
    const int out = 7, in = 96;
    uint8_t *q = malloc((size_t)out * 34 * (in / 32));
    float *ref = malloc(sizeof(float) * out * in), *got = malloc(sizeof(float) * out * in);
    float x[96], y[7];
    assert_true(q && ref && got);
    for (int t = 0; t < 3; t++)
        for (int wide = 0; wide < 2; wide++) {
            make_blocks(TYPES[t], out, in, q, &r, wide);
            size_t rb = (size_t)kvarn_ggml_row_bytes(TYPES[t], in);
            for (int row = 0; row < out; row++)
                assert_int_equal(kvarn_ggml_dequantize(TYPES[t], q + row * rb, ref + row * in, in),
                                 KVARN_OK);
            LEVELS_FOR(lv) { /* the kernels of level lv.index */
                const llama_qkernels *k = llama_qkernels_get(TYPES[t], (kvarn_cpu_level)lv.index);
                memset(got, 0xFF, sizeof(float) * out * in);
                k->dequant(q, rb, in, got, out);
                if (memcmp(got, ref, sizeof(float) * out * in) != 0) {
                    print_error("%s %s dequant differs from dequant.c\n",
                                kvarn_ggml_type_name(TYPES[t]), lv.name);
                    fail();
                }
                /* inside the GEMV: a one-hot x picks w_k exactly */
                for (int kk = 0; kk < in; kk++) {
                    memset(x, 0, sizeof x);
                    x[kk] = 1.0f;
                    k->gemv(q, rb, in, x, y, out);
                    for (int row = 0; row < out; row++)
                        if (!(y[row] == ref[row * in + kk])) {
                            print_error("%s %s gemv: row %d weight %d = %.9g, dequant.c %.9g\n",
                                        kvarn_ggml_type_name(TYPES[t]), lv.name, row, kk,
                                        (double)y[row], (double)ref[row * in + kk]);
                            fail();
                        }
                }
            }
        }
    free(q);
    free(ref);
    free(got);
}

/* y against the double sum of the dequantized weights: within gamma_K
 * sum|x w| (header). */
static void check_rows(const char *what, const float *w, const float *x, const float *y,
                       int out, int in, int ld_y)
{
    const double u = 0x1p-24, gamma = in * u / (1.0 - in * u);
    for (int j = 0; j < out; j++) {
        double s = 0, l1 = 0;
        for (int i = 0; i < in; i++) {
            double p = (double)x[i] * w[(size_t)j * in + i];
            s += p;
            l1 += fabs(p);
        }
        double e = fabs((double)y[(size_t)j * ld_y] - s);
        if (!(e <= gamma * l1)) {
            print_error("%s [%d x %d]: y[%d] = %.9g, exact %.9g, bound %.3g\n", what, out, in, j,
                        (double)y[(size_t)j * ld_y], s, gamma * l1);
            fail();
        }
    }
}

/* Every level on odd shapes: rows not a multiple of the 4-row pass, in =
 * 32, 64, 576, 1536. */
static void test_gemv_levels(void **state)
{
    (void)state;
    static const int INS[] = {32, 64, 576, 1536};
    static const int OUTS[] = {1, 3, 6, 13};
    test_rng r;
    test_rng_seed(&r, 23);
    for (int t = 0; t < 3; t++)
        for (int a = 0; a < 4; a++)
            for (int b = 0; b < 4; b++) {
                int in = INS[a], out = OUTS[b];
                size_t rb = (size_t)kvarn_ggml_row_bytes(TYPES[t], in);
                uint8_t *q = malloc(rb * out);
                float *w = malloc(sizeof(float) * out * in), *x = malloc(sizeof(float) * in);
                float *y = malloc(sizeof(float) * out);
                assert_true(q && w && x && y);
                make_blocks(TYPES[t], out, in, q, &r, 0);
                for (int j = 0; j < out; j++)
                    kvarn_ggml_dequantize(TYPES[t], q + j * rb, w + (size_t)j * in, in);
                /* activations as after RMSNorm, a few large channels */
                for (int i = 0; i < in; i++)
                    x[i] = (float)(test_rng_normal(&r) * (i % 97 == 5 ? 20.0 : 1.0));
                LEVELS_FOR(lv) { /* the kernels of level lv.index */
                    char what[64];
                    snprintf(what, sizeof what, "%s %s", kvarn_ggml_type_name(TYPES[t]), lv.name);
                    llama_qkernels_get(TYPES[t], (kvarn_cpu_level)lv.index)->gemv(q, rb, in, x, y, out);
                    check_rows(what, w, x, y, out, in, 1);
                }
                free(q);
                free(w);
                free(x);
                free(y);
            }
}

static void test_nonfinite(void **state)
{
    (void)state;
    const int out = 9, in = 64;
    test_rng r;
    test_rng_seed(&r, 31);
    for (int t = 0; t < 3; t++) {
        size_t rb = (size_t)kvarn_ggml_row_bytes(TYPES[t], in);
        uint8_t q[9 * 68];
        float w[9 * 64], x[64], y[9];
        make_blocks(TYPES[t], out, in, q, &r, 0);
        for (int j = 0; j < out; j++) kvarn_ggml_dequantize(TYPES[t], q + j * rb, w + j * in, in);
        /* a zero weight at channel 3 of row 0: Inf x 0 must give NaN */
        int zero_row = -1;
        for (int j = 0; j < out && zero_row < 0; j++)
            if (w[j * in + 3] == 0.0f) zero_row = j;
        LEVELS_FOR(lv) { /* the kernels of level lv.index */
            const llama_qkernels *k = llama_qkernels_get(TYPES[t], (kvarn_cpu_level)lv.index);
            for (int i = 0; i < in; i++) x[i] = (float)test_rng_normal(&r);
            x[17] = NAN;
            k->gemv(q, rb, in, x, y, out);
            for (int j = 0; j < out; j++) assert_true(isnan(y[j]));
            x[17] = 0.5f;
            x[3] = INFINITY;
            k->gemv(q, rb, in, x, y, out);
            for (int j = 0; j < out; j++) {
                float wj = w[j * in + 3];
                if (wj > 0) assert_true(y[j] == INFINITY);
                else if (wj < 0) assert_true(y[j] == -INFINITY);
                else assert_true(isnan(y[j]));
            }
            (void)zero_row;
        }
    }
}

/* A model shell for llama_weights.c with gguf weights. */
static kvarn_llama *shell(void)
{
    kvarn_llama *m = calloc(1, sizeof *m);
    assert_non_null(m);
    assert_int_equal(kvarn__alloc_init(&m->alloc, NULL), KVARN_OK);
    m->weights = KVARN_LLAMA_WEIGHTS_GGUF;
    return m;
}

typedef struct mm_run {
    llama_mm_ctx *c;
    const float *x;
    const llama_matrix *w;
    float *y;
    int n;
    kvarn_status st;
} mm_run;

static void *mm_thread(void *arg)
{
    mm_run *a = arg;
    a->st = llama_matmul(a->c, a->x, a->n, a->w, a->y);
    return NULL;
}

/* llama_matmul on gguf matrices: one token on 1 and 2 threads (the same
 * bits: a row's value does not depend on the split; matrices above
 * LLAMA_QGEMV_SPLIT weights are split), chunks of 2, 37 and
 * 128 rows through the slab and sgemm, each row within gamma_K; and two
 * contexts (sessions) on other threads sharing the matrix at once. */
static void test_matmul(void **state)
{
    (void)state;
    /* 3072 x 576 (SmolLM2's gate/up) is above LLAMA_QGEMV_SPLIT: the one
     * the 2-thread context splits */
    static const int SH[][2] = {{3072, 576}, {960, 576}, {576, 1536}, {70, 64}, {3, 32}};
    static const int NS[] = {1, 2, 37, 128};
    test_rng r;
    test_rng_seed(&r, 47);
    kvarn_llama *m = shell();
    for (int t = 0; t < 3; t++)
        for (int s = 0; s < 5; s++) {
            int out = SH[s][0], in = SH[s][1];
            llama_matrix w;
            assert_int_equal(llama_matrix_alloc_q(m, &w, out, in, TYPES[t]), KVARN_OK);
            uint8_t *blocks = malloc(w.row_bytes * out);
            float *wf = malloc(sizeof(float) * out * in);
            float *x = malloc(sizeof(float) * 128 * in);
            float *y = malloc(sizeof(float) * 128 * out), *y2 = malloc(sizeof(float) * out);
            assert_true(blocks && wf && x && y && y2);
            make_blocks(TYPES[t], out, in, blocks, &r, 0);
            /* two halves, as a stacked matrix is filled */
            int half = out / 2;
            if (half > 0)
                assert_int_equal(llama_matrix_set_q_rows(&w, 0, half, TYPES[t], blocks,
                                                         (uint64_t)half * w.row_bytes), KVARN_OK);
            assert_int_equal(llama_matrix_set_q_rows(&w, half, out - half, TYPES[t],
                                                     blocks + half * w.row_bytes,
                                                     (uint64_t)(out - half) * w.row_bytes),
                             KVARN_OK);
            for (int j = 0; j < out; j++) llama_matrix_get_row(&w, j, wf + (size_t)j * in);
            for (size_t i = 0; i < (size_t)128 * in; i++)
                x[i] = (float)(test_rng_normal(&r) * (i % 97 == 5 ? 20.0 : 1.0));
            llama_mm_ctx c1, c2;
            assert_int_equal(llama_mm_ctx_create(m, &m->alloc, 128, in, 1, &c1), KVARN_OK);
            assert_int_equal(llama_mm_ctx_create(m, &m->alloc, 1, in, 2, &c2), KVARN_OK);
            assert_null(c2.slab); /* decode only: no slab */
            for (int k = 0; k < 4; k++) {
                int n = NS[k];
                assert_int_equal(llama_matmul(&c1, x, n, &w, y), KVARN_OK);
                for (int row = 0; row < n; row++) {
                    char what[64];
                    snprintf(what, sizeof what, "%s matmul n %d row %d",
                             kvarn_ggml_type_name(TYPES[t]), n, row);
                    check_rows(what, wf, x + (size_t)row * in, y + (size_t)row * out, out, in, 1);
                }
            }
            assert_int_equal(llama_matmul(&c1, x, 1, &w, y), KVARN_OK);
            assert_int_equal(llama_matmul(&c2, x, 1, &w, y2), KVARN_OK);
            assert_memory_equal(y, y2, sizeof(float) * out);
            /* two sessions' contexts on two threads at once, one model */
            float *ya = malloc(sizeof(float) * out), *yb = malloc(sizeof(float) * out);
            assert_true(ya && yb);
            mm_run ra = {&c1, x, &w, ya, 1, KVARN_ERR_INVALID_ARG};
            mm_run rb = {&c2, x, &w, yb, 1, KVARN_ERR_INVALID_ARG};
            pthread_t ta, tb;
            assert_int_equal(pthread_create(&ta, NULL, mm_thread, &ra), 0);
            assert_int_equal(pthread_create(&tb, NULL, mm_thread, &rb), 0);
            pthread_join(ta, NULL);
            pthread_join(tb, NULL);
            assert_int_equal(ra.st, KVARN_OK);
            assert_int_equal(rb.st, KVARN_OK);
            assert_memory_equal(ya, y, sizeof(float) * out);
            assert_memory_equal(yb, y, sizeof(float) * out);
            free(ya);
            free(yb);
            llama_mm_ctx_destroy(&m->alloc, &c1);
            llama_mm_ctx_destroy(&m->alloc, &c2);
            llama_matrix_free(m, &w);
            free(blocks);
            free(wf);
            free(x);
            free(y);
            free(y2);
        }
    free(m);
}

/* Blocks the loader would copy are refused unless whole and of the
 * matrix's type; odd row lengths and unserved types at allocation. */
static void test_refused(void **state)
{
    (void)state;
    kvarn_llama *m = shell();
    llama_matrix w;
    assert_int_equal(llama_matrix_alloc_q(m, &w, 4, 48, KVARN_GGML_Q4_1), KVARN_ERR_BAD_FILE);
    assert_null(w.q);
    assert_int_equal(llama_matrix_alloc_q(m, &w, 4, 64, KVARN_GGML_F16), KVARN_ERR_UNSUPPORTED);
    assert_int_equal(llama_matrix_alloc_q(m, &w, 4, 64, KVARN_GGML_Q4_1), KVARN_OK);
    assert_int_equal(w.row_bytes, 40);
    uint8_t src[160];
    memset(src, 0x5A, sizeof src);
    memset(w.q, 0, 160);
    /* truncated (a byte short), too long, another type, rows outside */
    assert_int_equal(llama_matrix_set_q_rows(&w, 0, 4, KVARN_GGML_Q4_1, src, 159),
                     KVARN_ERR_BAD_FILE);
    assert_int_equal(llama_matrix_set_q_rows(&w, 0, 3, KVARN_GGML_Q4_1, src, 160),
                     KVARN_ERR_BAD_FILE);
    assert_int_equal(llama_matrix_set_q_rows(&w, 0, 4, KVARN_GGML_Q4_0, src, 160),
                     KVARN_ERR_BAD_FILE);
    assert_int_equal(llama_matrix_set_q_rows(&w, 2, 3, KVARN_GGML_Q4_1, src, 120),
                     KVARN_ERR_INVALID_ARG);
    for (int i = 0; i < 160; i++) assert_int_equal(w.q[i], 0); /* untouched */
    assert_int_equal(llama_matrix_set_q_rows(&w, 1, 3, KVARN_GGML_Q4_1, src, 120), KVARN_OK);
    assert_int_equal(w.q[39], 0);
    assert_int_equal(w.q[40], 0x5A);
    llama_matrix_free(m, &w);
    free(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_dequant_bit_exact, levels_teardown),
        cmocka_unit_test_teardown(test_gemv_levels, levels_teardown),
        cmocka_unit_test_teardown(test_nonfinite, levels_teardown),
        cmocka_unit_test(test_matmul),
        cmocka_unit_test(test_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
