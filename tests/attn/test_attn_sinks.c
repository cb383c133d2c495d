/* test_attn_sinks.c -- learned attention sinks (kvarn_attn_opts.sinks, one
 * logit per query head, gpt-oss): every call kind (decode, causal and
 * non-causal multi-query, sliding window, GQA 4:1), split-K on and off, at
 * every SIMD level this CPU has and the scalar reference, for per-token and
 * KVarN formats:
 *   - against a direct double softmax with the sink term, over the format's
 *     dequantized K/V (outputs within 1e-4 plus the integer dot products'
 *     derived bound, tests/common/int_dot_bound.h; lse within the scores'
 *     bound);
 *   - against the same call without sinks: the sink is one more part of
 *     the log-sum-exp merge with output zero, so out_sink = out e^(lse -
 *     lse_sink) and lse_sink = ln(e^lse + e^s) (the same kernels, so only
 *     the final fp32 rounding differs); -inf sinks give the plain call's
 *     bits;
 *   - empty sequences: zero output, lse = the sink;
 *   - NaN and +Inf sink logits refused with out and lse untouched; a huge
 *     finite sink gives a zero output, no NaN. */
#define KVARN_EXPERIMENTAL_API /* the testing knobs (attn.h) */
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

#define HK 2
#define GROUP 4
#define HQ (HK * GROUP)

/* Sink logits of the HQ heads: none, below, around and far above the
 * scores' log-sum-exp (ln 300 + a few), so the sink's share runs from 0 to
 * nearly 1. */
static const float SINKS[HQ] = {-INFINITY, -3.0f, 0.0f, 2.0f, 5.0f, 8.0f, 12.0f, 30.0f};

/* Direct softmax with a sink, in double, over positions [lo, hi] of
 * sequence s and the dequantized K/V (the query rotated in and the output
 * back out for KVarN): o = sum_t e^(x_t - m) v_t / (e^(sink - m) + sum_t
 * e^(x_t - m)), m the max of the x_t and the sink; *lse = ln of the
 * denominator (plus m). */
static void ref_sink(const paged_fixture *f, int s, int head, const float *q, double scale,
                     int lo, int hi, double sink, double *out, double *lse)
{
    const int D = f->D, h = head / GROUP, rot = f->fmt.kind == KVARN_KIND_KVARN;
    double qq[1024];
    for (int d = 0; d < D; d++) qq[d] = q[d];
    if (rot) pf_hadamard_d(qq, D);
    for (int d = 0; d < D; d++) out[d] = 0.0;
    if (lo < 0) lo = 0;
    int n = hi >= lo ? hi - lo + 1 : 0;
    double *x = malloc(sizeof(double) * (size_t)(n + 1)), m = sink;
    for (int t = 0; t < n; t++) {
        const float *k = f->k_deq[s] + ((size_t)(lo + t) * f->Hk + h) * D;
        double dot = 0.0;
        for (int d = 0; d < D; d++) dot += qq[d] * k[d];
        x[t] = dot * scale;
        m = x[t] > m ? x[t] : m;
    }
    double l = sink == -INFINITY ? 0.0 : exp(sink - m);
    for (int t = 0; t < n; t++) {
        const float *v = f->v_deq[s] + ((size_t)(lo + t) * f->Hk + h) * D;
        double p = exp(x[t] - m);
        l += p;
        for (int d = 0; d < D; d++) out[d] += p * v[d];
    }
    free(x);
    *lse = l > 0.0 ? m + log(l) : -INFINITY;
    if (l > 0.0)
        for (int d = 0; d < D; d++) out[d] /= l;
    if (rot) pf_hadamard_d(out, D);
}

typedef struct call {
    int multi, causal, split, window;
} call;

static kvarn_status run(const paged_fixture *f, int n_seqs, const int32_t *qsl, const call *c,
                        int scalar, const float *sinks, const float *q, float *out, float *lse)
{
    kvarn_attn_opts o = KVARN_ATTN_OPTS_DEFAULT((float)(1.0 / sqrt((double)f->D)));
    o.causal = c->causal;
    o.sliding_window = c->window;
    o.sinks = sinks;
    kvarn_attn_testing knobs = {c->split, scalar, 0, 0, 0};
    o.testing = &knobs;
    int total_q = c->multi ? qsl[n_seqs] : n_seqs;
    kvarn_thread_pool *pool = NULL;
    if (test_threads(1) > 1)
        assert_int_equal(kvarn_thread_pool_create(test_threads(1), &pool), KVARN_OK);
    size_t wsz = kvarn_attn_workspace_bytes(&f->kv, HQ, n_seqs, total_q,
                                            kvarn_thread_pool_size(pool), &o);
    assert_true(wsz > 0);
    void *ws = malloc(wsz);
    kvarn_status st = c->multi
        ? kvarn_attn_multi_lse(&f->kv, f->views, n_seqs, qsl, HQ, q, out, lse, &o, pool, ws, wsz)
        : kvarn_attn_decode_lse(&f->kv, f->views, n_seqs, HQ, q, out, lse, &o, pool, ws, wsz);
    free(ws);
    kvarn_thread_pool_destroy(pool);
    return st;
}

/* The integer dot products' bound on one row's output (0 where the
 * library says the level keeps fp32); vmax over the dequantized V in the
 * original basis. */
static double int_bound(const paged_fixture *f, int s, int h, const float *q, double scale,
                        int lo, int hi)
{
    if (hi < lo) return 0.0;
    const int D = f->D;
    double vmax = 0.0, v[1024];
    for (int t = lo; t <= hi; t++) {
        const float *src = f->v_deq[s] + ((size_t)t * f->Hk + h) * D;
        for (int d = 0; d < D; d++) v[d] = src[d];
        if (f->fmt.kind == KVARN_KIND_KVARN) pf_hadamard_d(v, D);
        for (int d = 0; d < D; d++) vmax = fmax(vmax, fabs(v[d]));
    }
    return attn_int_dot_bound(&f->kv, &f->views[s], h, q, scale, lo, hi, vmax);
}

typedef struct worst {
    double ref_out, ref_lse, merge_out, merge_lse;
} worst;

static void check_format(const char *fmt, int D, int G, uint64_t seed, int scalar, worst *w)
{
    const int n_seqs = 3;
    pf_seq_spec specs[3] = {{300, 1}, {5, 0}, {0, 0}};
    paged_fixture f;
    assert_int_equal(pf_build(&f, fmt, D, HK, G, 1, specs, n_seqs, seed), 0);
    const double scale = 1.0 / sqrt((double)D);
    const call calls[] = {
        {0, 1, 1, 0}, {0, 1, 3, 0},              /* decode, split-K off / 3 chunks */
        {1, 1, 1, 0}, {1, 1, 3, 0},              /* causal multi-query */
        {1, 1, 2, 100},                          /* causal, sliding window */
        {1, 0, 1, 0}, {1, 0, 3, 0},              /* non-causal, q_len > seq_len */
    };
    for (size_t ci = 0; ci < sizeof calls / sizeof calls[0]; ci++) {
        const call *c = &calls[ci];
        int ql[3] = {c->multi ? 5 : 1, c->multi ? (c->causal ? 2 : 7) : 1,
                     c->multi ? (c->causal ? 0 : 4) : 1};
        int32_t qsl[4] = {0, ql[0], ql[0] + ql[1], ql[0] + ql[1] + ql[2]};
        size_t rows = (size_t)qsl[3] * HQ;
        float *q = malloc(rows * D * sizeof(float));
        float *os = malloc(rows * D * sizeof(float)), *on = malloc(rows * D * sizeof(float));
        float *ls = malloc(rows * sizeof(float)), *ln = malloc(rows * sizeof(float));
        float *oi = malloc(rows * D * sizeof(float)), *li = malloc(rows * sizeof(float));
        test_rng rng;
        test_rng_seed(&rng, seed * 31 + ci);
        for (size_t i = 0; i < rows * D; i++) q[i] = (float)(1.5 * test_rng_normal(&rng));
        float none[HQ];
        for (int h = 0; h < HQ; h++) none[h] = -INFINITY;
        assert_int_equal(run(&f, n_seqs, qsl, c, scalar, SINKS, q, os, ls), KVARN_OK);
        assert_int_equal(run(&f, n_seqs, qsl, c, scalar, NULL, q, on, ln), KVARN_OK);
        /* every sink -inf: the plain call, bit for bit */
        assert_int_equal(run(&f, n_seqs, qsl, c, scalar, none, q, oi, li), KVARN_OK);
        assert_memory_equal(oi, on, rows * D * sizeof(float));
        assert_memory_equal(li, ln, rows * sizeof(float));
        double ref[1024], ref_lse;
        for (int s = 0; s < n_seqs; s++) {
            const int len = specs[s].seq_len;
            for (int qi = 0; qi < ql[s]; qi++) {
                int hi = (c->multi && c->causal) ? len - ql[s] + qi : len - 1;
                int lo = 0;
                if (c->window > 0) lo = hi - c->window + 1 < 0 ? 0 : hi - c->window + 1;
                for (int head = 0; head < HQ; head++) {
                    const size_t row = (size_t)(qsl[s] + qi) * HQ + head;
                    const float *qq = q + row * D, *o = os + row * D, *o0 = on + row * D;
                    const double sk = SINKS[head];
                    if (len == 0) {
                        for (int d = 0; d < D; d++) assert_true(o[d] == 0.0f);
                        assert_true(ls[row] == SINKS[head]);
                        continue;
                    }
                    if (sk == -INFINITY) { /* this head: the plain call's bits */
                        assert_memory_equal(o, o0, D * sizeof(float));
                        assert_true(ls[row] == ln[row]);
                    }
                    /* (1) the direct formula */
                    ref_sink(&f, s, head, qq, scale, lo, hi, sk, ref, &ref_lse);
                    const double ib = int_bound(&f, s, head / GROUP, qq, scale, lo, hi);
                    const double delta = attn_int_score_delta(&f.kv, &f.views[s], head / GROUP,
                                                              qq, scale, lo, hi);
                    double mx = 0.0, err = 0.0;
                    for (int d = 0; d < D; d++) {
                        mx = fmax(mx, fabs(ref[d]));
                        err = fmax(err, fabs(o[d] - ref[d]));
                    }
                    const double tol = 1e-4 * mx + ib + 1e-30;
                    w->ref_out = fmax(w->ref_out, err / (1e-4 * mx + ib + 1e-30));
                    if (!(err <= tol))
                        print_error("%s %s call %zu seq %d q %d head %d sink %g: err %g (max %g, "
                                    "int bound %g)\n", fmt, scalar ? "scalar" : "simd", ci, s, qi,
                                    head, sk, err, mx, ib);
                    assert_true(err <= tol);
                    const double el = (fabs(ls[row] - ref_lse) - delta) / fmax(1.0, fabs(ref_lse));
                    w->ref_lse = fmax(w->ref_lse, el);
                    assert_true(el <= 1e-5);
                    /* (2) one more part of the merge, with output zero */
                    const double lm = fmax((double)ln[row], sk);
                    const double lse_m = lm + log(exp((double)ln[row] - lm) + exp(sk - lm));
                    const double f_out = exp((double)ln[row] - lse_m);
                    double mo = 0.0, eo = 0.0;
                    for (int d = 0; d < D; d++) {
                        mo = fmax(mo, fabs(o0[d] * f_out));
                        eo = fmax(eo, fabs(o[d] - o0[d] * f_out));
                    }
                    const double rel_o = eo / fmax(mo, 1e-30) / fmax(1.0, fabs(lse_m));
                    const double rel_l = fabs(ls[row] - lse_m) / fmax(1.0, fabs(lse_m));
                    w->merge_out = fmax(w->merge_out, rel_o);
                    w->merge_lse = fmax(w->merge_lse, rel_l);
                    if (rel_o > 1e-6 || rel_l > 1e-6)
                        print_error("%s call %zu seq %d q %d head %d: merge out %g lse %g\n", fmt,
                                    ci, s, qi, head, rel_o, rel_l);
                    assert_true(rel_o <= 1e-6 && rel_l <= 1e-6);
                }
            }
        }
        free(q); free(os); free(on); free(ls); free(ln); free(oi); free(li);
    }
    pf_free(&f);
}

static void test_sinks_every_level(void **state)
{
    (void)state;
    const struct { const char *fmt; int D, G; } fm[] = {
        {"fp16", 64, 16}, {"int8", 128, 16}, {"int4", 64, 16}, {"fp8_e4m3", 64, 16},
        {"kvarn_k4v2_g64", 64, 64}, {"kvarn_k4v2_g128", 128, 128},
        {"kvarn_k4v4_g128", 64, 128}};
    const char *top = levels_names[levels_top()];
    if (strcmp(top, "avx512") != 0)
        print_message("NOTE: no AVX-512 here (%s): the SIMD pass runs at %s only\n", top, top);
    worst w = {0};
    int pass = 0;
    LEVELS_FOR(it) {
        if (it.index == 0 && it.count > 1) continue; /* the SIMD levels; scalar where it is all */
        for (size_t i = 0; i < sizeof fm / sizeof fm[0]; i++) {
            check_format(fm[i].fmt, fm[i].D, fm[i].G, 40 + i, 0, &w);
            if (pass == 0) check_format(fm[i].fmt, fm[i].D, fm[i].G, 40 + i, 1, &w);
        }
        pass++;
    }
    print_message("sinks: worst output error / allowance vs double formula %.3g, lse %.3g; "
                  "vs the plain call merged with the sink: out %.3g, lse %.3g (relative)\n",
                  w.ref_out, w.ref_lse, w.merge_out, w.merge_lse);
}

static void test_sinks_bad_and_extreme(void **state)
{
    (void)state;
    pf_seq_spec spec = {40, 0};
    paged_fixture f;
    assert_int_equal(pf_build(&f, "int8", 64, HK, 16, 0, &spec, 1, 5), 0);
    const int D = 64, nq = 3;
    float q[3 * HQ * 64], out[3 * HQ * 64], lse[3 * HQ];
    for (int i = 0; i < nq * HQ * D; i++) q[i] = 0.05f * (float)(i % 11) - 0.2f;
    int32_t qsl[2] = {0, nq};
    call c = {1, 1, 1, 0};
    float sinks[HQ];
    const float bad[2] = {NAN, INFINITY};
    for (int b = 0; b < 2; b++) {
        for (int h = 0; h < HQ; h++) sinks[h] = 1.0f;
        sinks[HQ - 1] = bad[b];
        for (int i = 0; i < nq * HQ * D; i++) out[i] = 7.0f;
        for (int i = 0; i < nq * HQ; i++) lse[i] = 7.0f;
        assert_int_equal(run(&f, 1, qsl, &c, 0, sinks, q, out, lse), KVARN_ERR_NONFINITE);
        for (int i = 0; i < nq * HQ * D; i++) assert_true(out[i] == 7.0f);
        for (int i = 0; i < nq * HQ; i++) assert_true(lse[i] == 7.0f);
    }
    /* a sink far above every score: the output vanishes, nothing overflows */
    for (int h = 0; h < HQ; h++) sinks[h] = 1e30f;
    assert_int_equal(run(&f, 1, qsl, &c, 0, sinks, q, out, lse), KVARN_OK);
    for (int i = 0; i < nq * HQ * D; i++) assert_true(out[i] == 0.0f);
    for (int i = 0; i < nq * HQ; i++) assert_true(lse[i] == 1e30f);
    /* and far below: the plain call's output (the sink's term underflows) */
    float plain[3 * HQ * 64], pl[3 * HQ];
    assert_int_equal(run(&f, 1, qsl, &c, 0, NULL, q, plain, pl), KVARN_OK);
    for (int h = 0; h < HQ; h++) sinks[h] = -1e30f;
    assert_int_equal(run(&f, 1, qsl, &c, 0, sinks, q, out, lse), KVARN_OK);
    for (int i = 0; i < nq * HQ * D; i++)
        assert_true(fabsf(out[i] - plain[i]) <= 1e-6f * fmaxf(1.0f, fabsf(plain[i])));
    for (int i = 0; i < nq * HQ; i++) assert_true(fabsf(lse[i] - pl[i]) <= 1e-6f * fabsf(pl[i]) + 1e-6f);
    pf_free(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_sinks_every_level, levels_teardown),
        cmocka_unit_test_teardown(test_sinks_bad_and_extreme, levels_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
