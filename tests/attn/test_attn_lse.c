/* test_attn_lse.c -- the log-sum-exp output of the attention calls
 * (kvarn_attn_decode_lse, kvarn_attn_multi_lse) and non-causal queries
 * after the sequence's keys (q_len > seq_len): LSE against a double
 * reference over the format's dequantized K, scalar, AVX2 and AVX-512 kernels,
 * split-K on and off; the lse-less calls give the same outputs; empty
 * sequences give zeros and -inf; attention over two halves of a context
 * merged by LSE equals attention over the whole (1e-5 relative, plus the
 * derived bound of any kernel that rounds its operands). */
#define KVARN_EXPERIMENTAL_API /* the testing knobs (attn.h, cache.h) */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "common/levels.h"
#include "common/int_dot_bound.h"
#include "common/paged_fixture.h"
#include "kvarn/attn.h"

/* ln sum_t exp(scale q.k_t) over t in [lo, hi] of sequence s, in double,
 * over the dequantized K (attention basis: the query is rotated for KVarN,
 * which leaves the scores unchanged). */
static double ref_lse(const paged_fixture *f, int s, int head, int Hq, const float *q,
                      double scale, int lo, int hi)
{
    const int D = f->D, h = head / (Hq / f->Hk);
    double qq[1024];
    for (int d = 0; d < D; d++) qq[d] = q[d];
    if (f->fmt.kind == KVARN_KIND_KVARN) pf_hadamard_d(qq, D);
    if (hi < lo) return -INFINITY;
    double m = -INFINITY, *sc = malloc(sizeof(double) * (size_t)(hi - lo + 1));
    for (int t = lo; t <= hi; t++) {
        const float *k = f->k_deq[s] + ((size_t)t * f->Hk + h) * D;
        double dot = 0.0;
        for (int d = 0; d < D; d++) dot += qq[d] * k[d];
        sc[t - lo] = dot * scale;
        m = sc[t - lo] > m ? sc[t - lo] : m;
    }
    double l = 0.0;
    for (int t = lo; t <= hi; t++) l += exp(sc[t - lo] - m);
    free(sc);
    return m + log(l);
}

typedef struct call {
    int multi, causal, split, scalar;
} call;

static kvarn_status run(const paged_fixture *f, const kvarn_seq_view *views, int n_seqs,
                        const int32_t *qsl, int Hq, const call *c, int window,
                        const float *q, float *out, float *lse)
{
    kvarn_attn_opts o = KVARN_ATTN_OPTS_DEFAULT((float)(1.0 / sqrt((double)f->D)));
    o.causal = c->causal;
    kvarn_attn_testing knobs = {c->split, c->scalar, 0, 0, 0};
    o.testing = &knobs;
    o.sliding_window = window;
    int total_q = c->multi ? qsl[n_seqs] : n_seqs;
    kvarn_thread_pool *pool = NULL;
    if (test_threads(1) > 1) assert_int_equal(kvarn_thread_pool_create(test_threads(1), &pool), KVARN_OK);
    size_t wsz = kvarn_attn_workspace_bytes(&f->kv, Hq, n_seqs, total_q,
                                            kvarn_thread_pool_size(pool), &o);
    assert_true(wsz > 0);
    void *ws = malloc(wsz);
    kvarn_status st;
    if (c->multi)
        st = lse ? kvarn_attn_multi_lse(&f->kv, views, n_seqs, qsl, Hq, q, out, lse, &o, pool, ws, wsz)
                 : kvarn_attn_multi(&f->kv, views, n_seqs, qsl, Hq, q, out, &o, pool, ws, wsz);
    else
        st = lse ? kvarn_attn_decode_lse(&f->kv, views, n_seqs, Hq, q, out, lse, &o, pool, ws, wsz)
                 : kvarn_attn_decode(&f->kv, views, n_seqs, Hq, q, out, &o, pool, ws, wsz);
    free(ws);
    kvarn_thread_pool_destroy(pool);
    return st;
}

/* Every call kind on a fixture of three sequences (long with sink and
 * tail, shorter than the query chunk, empty). */
static void check_format(const char *fmt, int D, uint64_t seed, double *worst)
{
    const int Hk = 2, group = 3, Hq = Hk * group, n_seqs = 3;
    pf_seq_spec specs[3] = {{300, 1}, {3, 0}, {0, 0}};
    paged_fixture f;
    assert_int_equal(pf_build(&f, fmt, D, Hk, 16, 1, specs, n_seqs, seed), 0);
    const double scale = 1.0 / sqrt((double)D);
    const call calls[] = {
        {0, 1, 1, 0}, {0, 1, 3, 1}, {0, 1, 0, 0},        /* decode */
        {1, 1, 1, 0}, {1, 1, 3, 1},                      /* causal multi */
        {1, 0, 1, 0}, {1, 0, 3, 0}, {1, 0, 1, 1},        /* non-causal */
    };
    for (size_t ci = 0; ci < sizeof calls / sizeof calls[0]; ci++) {
        const call *c = &calls[ci];
        /* causal: q_len <= seq_len; non-causal: q_len > seq_len allowed */
        int ql[3] = {c->multi ? 5 : 1, c->multi ? (c->causal ? 2 : 7) : 1,
                     c->multi ? (c->causal ? 0 : 4) : 1};
        int32_t qsl[4] = {0, ql[0], ql[0] + ql[1], ql[0] + ql[1] + ql[2]};
        size_t rows = (size_t)qsl[3] * Hq;
        float *q = malloc(rows * D * sizeof(float)), *out = malloc(rows * D * sizeof(float));
        float *out2 = malloc(rows * D * sizeof(float)), *lse = malloc(rows * sizeof(float));
        test_rng rng;
        test_rng_seed(&rng, seed + ci);
        for (size_t i = 0; i < rows * D; i++) q[i] = (float)(1.5 * test_rng_normal(&rng));
        for (size_t i = 0; i < rows; i++) lse[i] = 12345.0f;
        assert_int_equal(run(&f, f.views, n_seqs, qsl, Hq, c, 0, q, out, lse), KVARN_OK);
        /* Without lse: the same outputs, bit for bit. */
        assert_int_equal(run(&f, f.views, n_seqs, qsl, Hq, c, 0, q, out2, NULL), KVARN_OK);
        assert_memory_equal(out, out2, rows * D * sizeof(float));
        for (int s = 0; s < n_seqs; s++) {
            int len = specs[s].seq_len;
            for (int qi = 0; qi < ql[s]; qi++) {
                int hi = (c->multi && c->causal) ? len - ql[s] + qi : len - 1;
                for (int head = 0; head < Hq; head++) {
                    size_t row = (size_t)(qsl[s] + qi) * Hq + head;
                    double ref = ref_lse(&f, s, head, Hq, q + row * D, scale, 0, hi);
                    if (len == 0) {
                        assert_true(lse[row] == -INFINITY);
                        for (int d = 0; d < D; d++) assert_true(out[row * D + d] == 0.0f);
                        continue;
                    }
                    /* integer scores (where the library says this
                     * level's kernels use them) move every score, so the
                     * LSE, by at most delta (tests/common/int_dot_bound.h) */
                    const double delta = attn_int_score_delta(&f.kv, &f.views[s], head / group,
                                                              q + row * D, scale, 0, hi);
                    double err = (fabs(lse[row] - ref) - delta) / fmax(1.0, fabs(ref));
                    if (err > *worst) *worst = err;
                    if (err > 1e-5)
                        print_error("%s call %zu seq %d q %d head %d: lse %g ref %g (int bound %g)\n", fmt,
                                    ci, s, qi, head, (double)lse[row], ref, delta);
                    assert_true(err <= 1e-5);
                }
            }
        }
        free(q); free(out); free(out2); free(lse);
    }
    pf_free(&f);
}

static void test_lse_reference(void **state)
{
    (void)state;
    const struct { const char *fmt; int D; } fm[] = {
        {"fp16", 64}, {"bf16", 128}, {"fp8_e4m3", 64}, {"int8", 128}, {"int4", 64},
        {"kvarn_k4v2_g64", 64}, {"kvarn_k4v4_g128", 128}};
    double worst = 0.0;
    /* Every SIMD level up to the one this process runs at (the CPU's, or an
     * outer KVARN_SIMD cap): the cap is set per pass. */
    const char *top = levels_names[levels_top()];
    if (strcmp(top, "avx512") != 0)
        print_message("NOTE: no AVX-512 here (%s): the SIMD pass runs at %s only\n", top, top);
    LEVELS_FOR(it) {
        if (it.index == 0 && it.count > 1) continue; /* the SIMD levels; scalar where it is all */
        for (size_t i = 0; i < sizeof fm / sizeof fm[0]; i++)
            check_format(fm[i].fmt, fm[i].D, 700 + i, &worst);
    }
    print_message("worst LSE error vs double reference: %.3g (relative, floor 1)\n", worst);
}

/* max over positions [lo, hi] and channels of KV head h's dequantized |v|
 * of sequence 0, in the original basis (KVarN: rotated back), the vmax of
 * attn_int_dot_bound. */
static double vmax_original(const paged_fixture *f, int h, int lo, int hi)
{
    const int D = f->D;
    double m = 0.0, y[1024];
    for (int t = lo; t <= hi; t++) {
        for (int d = 0; d < D; d++) y[d] = f->v_deq[0][((size_t)t * f->Hk + h) * D + d];
        if (f->fmt.kind == KVARN_KIND_KVARN) pf_hadamard_d(y, D);
        for (int d = 0; d < D; d++) m = fmax(m, fabs(y[d]));
    }
    return m;
}

/* Non-causal queries after the keys: context [0, L) split at L1 into a
 * prefix view (seq_len L1) and a window of the last L - L1 keys over the
 * full view; the two merged by LSE equal the call over the whole: within
 * 1e-5 (relative) plus, where the library says a kernel rounds its
 * operands (tests/common/int_dot_bound.h), the three calls' derived
 * bounds: each output off its exact value by at most its B (the whole's
 * B_w, the halves' B_a, B_b), each LSE by at most its delta; a merge
 * weight moved by the halves' LSE errors shifts the merged output by at
 * most (e^(2 max(delta_a, delta_b)) - 1) 2 vmax. */
static void test_merge_halves(void **state)
{
    (void)state;
    const char *fmts[] = {"kvarn_k4v2_g64", "int8", "fp8_e5m2", "fp16", "int4"};
    double worst_o = 0.0, worst_l = 0.0;
    for (int fi = 0; fi < 5; fi++)
        for (int scalar = 0; scalar < 2; scalar++) {
            const int D = 64, Hk = 2, Hq = 8, nq = 6;
            pf_seq_spec spec = {400, 1};
            paged_fixture f;
            assert_int_equal(pf_build(&f, fmts[fi], D, Hk, 16, 1, &spec, 1, 900 + fi), 0);
            const int L = spec.seq_len, L1 = 128; /* a tile boundary, within the committed tiles */
            kvarn_seq_view prefix = f.views[0];
            prefix.seq_len = L1;
            int nt1 = (L1 + f.G - 1) / f.G;
            if (prefix.committed_tiles > nt1) prefix.committed_tiles = nt1;
            int32_t qsl[2] = {0, nq};
            size_t rows = (size_t)nq * Hq;
            float *q = malloc(rows * D * sizeof(float));
            float *oa = malloc(rows * D * sizeof(float)), *ob = malloc(rows * D * sizeof(float));
            float *ow = malloc(rows * D * sizeof(float));
            float *la = malloc(rows * sizeof(float)), *lb = malloc(rows * sizeof(float));
            float *lw = malloc(rows * sizeof(float));
            test_rng rng;
            test_rng_seed(&rng, 31 + fi);
            for (size_t i = 0; i < rows * D; i++) q[i] = (float)(2.0 * test_rng_normal(&rng));
            call c = {1, 0, 1, scalar};
            assert_int_equal(run(&f, &prefix, 1, qsl, Hq, &c, 0, q, oa, la), KVARN_OK);
            assert_int_equal(run(&f, f.views, 1, qsl, Hq, &c, L - L1, q, ob, lb), KVARN_OK);
            assert_int_equal(run(&f, f.views, 1, qsl, Hq, &c, 0, q, ow, lw), KVARN_OK);
            const double scale = 1.0 / sqrt((double)D);
            for (size_t r = 0; r < rows; r++) {
                const int h = (int)(r % Hq) / (Hq / Hk);
                const float *qr = q + r * D;
                const double vm = vmax_original(&f, h, 0, L - 1);
                const double da = attn_int_score_delta(&f.kv, &prefix, h, qr, scale, 0, L1 - 1);
                const double db = attn_int_score_delta(&f.kv, f.views, h, qr, scale, L1, L - 1);
                const double dw = attn_int_score_delta(&f.kv, f.views, h, qr, scale, 0, L - 1);
                const double bo =
                    attn_int_dot_bound(&f.kv, &prefix, h, qr, scale, 0, L1 - 1, vmax_original(&f, h, 0, L1 - 1)) +
                    attn_int_dot_bound(&f.kv, f.views, h, qr, scale, L1, L - 1, vmax_original(&f, h, L1, L - 1)) +
                    attn_int_dot_bound(&f.kv, f.views, h, qr, scale, 0, L - 1, vm) +
                    (exp(2.0 * fmax(da, db)) - 1.0) * 2.0 * vm;
                const double bl = fmax(da, db) + dw;
                double m = fmax(la[r], lb[r]);
                double wa = exp(la[r] - m), wb = exp(lb[r] - m), lse = m + log(wa + wb);
                double mx = 0.0, err = 0.0;
                for (int d = 0; d < D; d++) {
                    double o = (wa * oa[r * D + d] + wb * ob[r * D + d]) / (wa + wb);
                    mx = fmax(mx, fabs(ow[r * D + d]));
                    err = fmax(err, fabs(o - ow[r * D + d]));
                }
                double rel = (err - bo) / fmax(mx, 1e-30);
                double rel_l = (fabs(lse - lw[r]) - bl) / fmax(1.0, fabs(lw[r]));
                worst_o = fmax(worst_o, rel);
                worst_l = fmax(worst_l, rel_l);
                if (rel > 1e-5 || rel_l > 1e-5)
                    print_error("%s row %zu: out rel %g lse rel %g\n", fmts[fi], r, rel, rel_l);
                assert_true(rel <= 1e-5);
                assert_true(rel_l <= 1e-5);
            }
            free(q); free(oa); free(ob); free(ow); free(la); free(lb); free(lw);
            pf_free(&f);
        }
    print_message("merge of two halves vs whole, beyond the derived bounds: out %.3g, lse %.3g (relative)\n", worst_o, worst_l);
}

/* Causal multi-query still refuses q_len > seq_len; non-causal accepts it;
 * lse is untouched on errors. */
static void test_lse_bad_inputs(void **state)
{
    (void)state;
    pf_seq_spec spec = {10, 0};
    paged_fixture f;
    assert_int_equal(pf_build(&f, "int8", 64, 1, 16, 0, &spec, 1, 5), 0);
    const int Hq = 2, D = 64;
    float q[20 * 2 * 64], out[20 * 2 * 64], lse[40];
    for (int i = 0; i < 20 * Hq * D; i++) q[i] = 0.01f * (float)(i % 7);
    for (int i = 0; i < 40; i++) lse[i] = 7.0f;
    int32_t qsl[2] = {0, 20};
    call causal = {1, 1, 1, 0}, open = {1, 0, 1, 0};
    assert_int_equal(run(&f, f.views, 1, qsl, Hq, &causal, 0, q, out, lse), KVARN_ERR_INVALID_ARG);
    for (int i = 0; i < 40; i++) assert_true(lse[i] == 7.0f);
    assert_int_equal(run(&f, f.views, 1, qsl, Hq, &open, 0, q, out, lse), KVARN_OK);
    for (int i = 0; i < 40; i++) assert_true(isfinite(lse[i]) && lse[i] != 7.0f);
    q[3] = NAN;
    for (int i = 0; i < 40; i++) lse[i] = 7.0f;
    assert_int_equal(run(&f, f.views, 1, qsl, Hq, &open, 0, q, out, lse), KVARN_ERR_NONFINITE);
    for (int i = 0; i < 40; i++) assert_true(lse[i] == 7.0f);
    pf_free(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_lse_reference, levels_teardown),
        cmocka_unit_test_teardown(test_merge_halves, levels_teardown),
        cmocka_unit_test_teardown(test_lse_bad_inputs, levels_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
