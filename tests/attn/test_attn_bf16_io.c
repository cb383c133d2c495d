/* test_attn_bf16_io.c -- kvarn_attn_opts.io_bf16 (attn.h): q and out as
 * bfloat16. Oracle: the fp32 call on the same query values (bf16 values
 * read as fp32, exact); the bf16 call must write each output element as
 * that call's fp32 output rounded once to bf16 (nearest even), bit for
 * bit, and the same lse, for decode, causal and non-causal multi-query,
 * split-K on and off, query chunks long enough for the matrix kernel
 * where the CPU has one, at every SIMD level this process runs (levels.h);
 * empty
 * sequences give bf16 zeros. Errors: io_bf16 other than 0 and 1, and a
 * NaN or Inf bf16 query, are refused with out and lse untouched. */
#define KVARN_EXPERIMENTAL_API /* the testing knobs (attn.h) */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "codec/fp_convert.h"
#include "common/levels.h"
#include "common/paged_fixture.h"
#include "kvarn/attn.h"

typedef struct call {
    int multi, causal, split;
} call;

static kvarn_status run(const paged_fixture *f, int n_seqs, const int32_t *qsl, int Hq,
                        const call *c, int io_bf16, const void *q, void *out, float *lse)
{
    kvarn_attn_opts o = KVARN_ATTN_OPTS_DEFAULT((float)(1.0 / sqrt((double)f->D)));
    o.causal = c->causal;
    o.io_bf16 = io_bf16;
    kvarn_attn_testing knobs = {c->split, 0, 0, 0, 0};
    o.testing = &knobs;
    const int total_q = c->multi ? qsl[n_seqs] : n_seqs;
    kvarn_thread_pool *pool = NULL;
    if (test_threads(1) > 1) assert_int_equal(kvarn_thread_pool_create(test_threads(1), &pool), KVARN_OK);
    size_t wsz = kvarn_attn_workspace_bytes(&f->kv, Hq, n_seqs, total_q, kvarn_thread_pool_size(pool), &o);
    /* refused options size no workspace: the call itself must refuse them */
    assert_true(wsz > 0 || (io_bf16 != 0 && io_bf16 != 1));
    void *ws = malloc(wsz ? wsz : 64);
    kvarn_status st = c->multi
        ? kvarn_attn_multi_lse(&f->kv, f->views, n_seqs, qsl, Hq, q, out, lse, &o, pool, ws, wsz)
        : kvarn_attn_decode_lse(&f->kv, f->views, n_seqs, Hq, q, out, lse, &o, pool, ws, wsz);
    free(ws);
    kvarn_thread_pool_destroy(pool);
    return st;
}

static void check_format(const char *fmt, uint64_t seed)
{
    const int D = 64, Hk = 2, group = 3, Hq = Hk * group, n_seqs = 3;
    pf_seq_spec specs[3] = {{300, 1}, {40, 0}, {0, 0}};
    paged_fixture f;
    assert_int_equal(pf_build(&f, fmt, D, Hk, 16, 1, specs, n_seqs, seed), 0);
    const call calls[] = {
        {0, 1, 1}, {0, 1, 3},          /* decode */
        {1, 1, 1}, {1, 1, 3},          /* causal multi */
        {1, 0, 1}, {1, 0, 3},          /* non-causal */
    };
    for (size_t ci = 0; ci < sizeof calls / sizeof calls[0]; ci++) {
        const call *c = &calls[ci];
        /* 64 queries of the long sequence: 192 rows, the matrix kernel's
         * size where the CPU has one */
        const int ql[3] = {c->multi ? 64 : 1, c->multi ? 5 : 1, c->multi ? (c->causal ? 0 : 3) : 1};
        const int32_t qsl[4] = {0, ql[0], ql[0] + ql[1], ql[0] + ql[1] + ql[2]};
        const size_t rows = (size_t)(c->multi ? qsl[3] : n_seqs) * Hq, n = rows * D;
        float *q32 = malloc(n * sizeof(float)), *o32 = malloc(n * sizeof(float));
        uint16_t *q16 = malloc(n * sizeof(uint16_t)), *o16 = malloc(n * sizeof(uint16_t));
        float *l32 = malloc(rows * sizeof(float)), *l16 = malloc(rows * sizeof(float));
        test_rng rng;
        test_rng_seed(&rng, seed + ci);
        for (size_t i = 0; i < n; i++) {
            q16[i] = kvarn__bf16_from_f32((float)(1.5 * test_rng_normal(&rng)));
            q32[i] = kvarn__bf16_to_f32(q16[i]);
        }
        assert_int_equal(run(&f, n_seqs, qsl, Hq, c, 0, q32, o32, l32), KVARN_OK);
        memset(o16, 0xa5, n * sizeof(uint16_t));
        assert_int_equal(run(&f, n_seqs, qsl, Hq, c, 1, q16, o16, l16), KVARN_OK);
        for (size_t i = 0; i < n; i++) {
            if (o16[i] != kvarn__bf16_from_f32(o32[i]))
                print_error("%s call %zu element %zu: bf16 %04x, fp32 %g -> %04x\n", fmt, ci, i,
                            o16[i], (double)o32[i], kvarn__bf16_from_f32(o32[i]));
            assert_int_equal(o16[i], kvarn__bf16_from_f32(o32[i]));
        }
        assert_memory_equal(l16, l32, rows * sizeof(float));
        free(q32); free(o32); free(q16); free(o16); free(l32); free(l16);
    }
    pf_free(&f);
}

static void test_bf16_equals_rounded_fp32(void **state)
{
    (void)state;
    const char *fmts[] = {"kvarn_k4v2_g64", "kvarn_k4v4_g64", "int8", "int4", "fp16"};
    LEVELS_FOR(it) {
        for (int fi = 0; fi < 5; fi++) check_format(fmts[fi], 700 + (uint64_t)fi);
    }
}

static void test_bf16_bad_inputs(void **state)
{
    (void)state;
    pf_seq_spec spec = {10, 0};
    paged_fixture f;
    assert_int_equal(pf_build(&f, "int8", 64, 1, 16, 0, &spec, 1, 5), 0);
    const int Hq = 2, D = 64, nq = 4;
    uint16_t q[4 * 2 * 64], out[4 * 2 * 64];
    float lse[8];
    for (int i = 0; i < nq * Hq * D; i++) q[i] = kvarn__bf16_from_f32(0.01f * (float)(i % 7));
    int32_t qsl[2] = {0, nq};
    call c = {1, 1, 1};
    const uint16_t bad[] = {0x7f80u, 0xff80u, 0x7fc0u}; /* +Inf, -Inf, NaN */
    for (int b = 0; b < 3; b++) {
        const uint16_t keep = q[77];
        q[77] = bad[b];
        memset(out, 0x5a, sizeof out);
        for (int i = 0; i < 8; i++) lse[i] = 7.0f;
        assert_int_equal(run(&f, 1, qsl, Hq, &c, 1, q, out, lse), KVARN_ERR_NONFINITE);
        for (size_t i = 0; i < sizeof out / sizeof out[0]; i++) assert_int_equal(out[i], 0x5a5a);
        for (int i = 0; i < 8; i++) assert_true(lse[i] == 7.0f);
        q[77] = keep;
    }
    memset(out, 0x5a, sizeof out);
    assert_int_equal(run(&f, 1, qsl, Hq, &c, 2, q, out, lse), KVARN_ERR_INVALID_ARG);
    assert_int_equal(run(&f, 1, qsl, Hq, &c, -1, q, out, lse), KVARN_ERR_INVALID_ARG);
    /* and the sizing and kernel-info calls refuse those options too */
    kvarn_attn_opts bad_o = KVARN_ATTN_OPTS_DEFAULT(0.125f);
    bad_o.io_bf16 = 2;
    assert_int_equal(kvarn_attn_workspace_bytes(&f.kv, Hq, 1, nq, 1, &bad_o), 0);
    kvarn_attn_kernel_info info;
    assert_int_equal(kvarn_attn_kernel_info_get(&f.kv.fmt, D, 0, &bad_o, &info), KVARN_ERR_INVALID_ARG);
    bad_o.io_bf16 = 1;
    assert_true(kvarn_attn_workspace_bytes(&f.kv, Hq, 1, nq, 1, &bad_o) > 0);
    for (size_t i = 0; i < sizeof out / sizeof out[0]; i++) assert_int_equal(out[i], 0x5a5a);
    /* the same bits read as fp32 are another query: io_bf16 is what says
     * which (a valid bf16 query passes) */
    assert_int_equal(run(&f, 1, qsl, Hq, &c, 1, q, out, lse), KVARN_OK);
    pf_free(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_bf16_equals_rounded_fp32, levels_teardown),
        cmocka_unit_test_teardown(test_bf16_bad_inputs, levels_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
