/* test_attn.c -- fused attention over the paged cache (src/attn) in every
 * format: against double-precision attention over the format's own
 * dequantized K/V (kvarn_decode; relative error < 1e-4) and over the
 * original K/V (within a bound derived from the round-trip error, below);
 * shapes (sequence lengths around the tile size, GQA 1/3/4/8, head_dim 64
 * and 128, sliding window, sink and tail tiles, multi-query causal and
 * non-causal, empty sequences); every SIMD level the CPU has (AVX2,
 * AVX-512; KVARN_SIMD set per case) and threads against the scalar
 * reference; determinism; bad inputs. */
#define KVARN_EXPERIMENTAL_API /* the testing knobs (attn.h, cache.h) */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "attn/attn_internal.h"
#include "codec/format_kinds.h"
#include "common/cpu.h"
#include "common/int_dot_bound.h"
#include "common/levels.h"
#include "common/paged_fixture.h"
#define KVARN_TEST_PARTS 2 /* ctest entries test_attn.1, test_attn.2 (test_parts.h) */
#include "common/test_parts.h"
#include "kvarn/attn.h"

#define MAXS 8

typedef struct attn_case {
    const char *fmt;
    int D, Hk, group, G, sink;
    int sink_partial;     /* KVarN: r sink tokens of tile `sink` in slots */
    int n_seqs;
    pf_seq_spec seqs[MAXS];
    int multi;            /* 0: decode; 1: multi-query with q_lens */
    int q_lens[MAXS];
    int causal, window, split, threads, force_scalar;
    int level;            /* SIMD level cap (LV_AVX2, LV_AVX512; 0: the
                             best); force_scalar wins */
    int no_vnni;          /* 1: the AVX-512 KVarN kernel's vpmaddwd build
                             even on a CPU with AVX512-VNNI */
    int no_bf16;          /* 1: the fp8 and bf16 formats' fp32 spans even
                             on a CPU with AVX512-BF16 */
    int amx;              /* the testing knob amx (attn.h): 0 default, 1
                             no matrix kernel, 2 the emulated one */
    int bound_level, bound_amx; /* non-zero: the level and knob amx whose
                             kernels the bounds are derived for, where the
                             call's own would add allowances for kernels
                             that do not run (a call whose every work item
                             takes the matrix kernel: bounded by its
                             statement alone, read with the emulated one) */
} attn_case;

/* SIMD levels, as indices of levels_names (tests/common/levels.h). The
 * tests walk the levels this process runs (LEVELS_FOR, which puts
 * KVARN_SIMD back); run_attn sets a case's level, capped at the highest
 * one this CPU (or an outer KVARN_SIMD, as a test matrix may set) runs. */
enum { LV_SCALAR, LV_AVX2, LV_AVX512, LV_COUNT = LEVELS_MAX };
static int g_max_level = LV_AVX512; /* set in main: levels_top() */

static void set_level(int level) { levels_set_capped(level, g_max_level); }

/* Bound on the error of attention over quantized K'/V' against the original
 * K/V, derived from the round-trip errors (written here so that it is
 * checked, not assumed). With delta = max_t |scale * q.(k'_t - k_t)| over
 * the visible positions, each weight moves by at most a factor e^(+-2 delta)
 * (p'_t = p_t e^(d_t) / sum p e^(d)), so ||p' - p||_1 <= e^(2 delta) - 1, and
 *   ||o' - o||_inf <= max_t ||v'_t - v_t||_inf + (e^(2 delta) - 1) max_t ||v'_t||_inf.
 * The measured round trip of each format (this fixture's data) sets delta
 * and the V error, and so the bound: typically fp16/bf16 tiny, int8 and
 * fp8 a few percent of the V scale, int4 and the KVarN presets tens of
 * percent (2-bit V). */
static double orig_bound(const paged_fixture *f, int s, int h, const double *qo, double scale,
                         int lo, int hi, const float *kdo, const float *vdo)
{
    const int D = f->D, Hk = f->Hk;
    double delta = 0.0, ev = 0.0, vmax = 0.0;
    for (int t = lo; t <= hi; t++) {
        const float *k = f->k_orig[s] + ((size_t)t * Hk + h) * D, *v = f->v_orig[s] + ((size_t)t * Hk + h) * D;
        const float *kq = kdo + ((size_t)t * Hk + h) * D, *vq = vdo + ((size_t)t * Hk + h) * D;
        double dot = 0.0;
        for (int d = 0; d < D; d++) {
            dot += qo[d] * ((double)kq[d] - k[d]);
            double e = fabs((double)vq[d] - v[d]);
            ev = e > ev ? e : ev;
            vmax = fabs(vq[d]) > vmax ? fabs(vq[d]) : vmax;
        }
        dot = fabs(dot * scale);
        delta = dot > delta ? dot : delta;
    }
    return ev + (exp(2.0 * delta) - 1.0) * vmax;
}

/* The extra error of the AVX-512 KVarN kernel's integer dot products
 * (kernel_avx512_kvarn.c, docs/attention-intdot.md "Integer (int16) dot products"),
 * bounded from this case's records and query; 0 where they are not used
 * (levels below AVX-512, formats other than KVarN of 128-token tiles with
 * 4-bit K or 2-bit V).
 *   K (4-bit, G = 128): per tile the query qa_d = q'_d a_d (q' = scale H q,
 *   rotated) is rounded to sq qi_d, sq = max_d |qa_d| / 32767, with
 *   |qa_d - sq qi_d| <= sq (1/2 + 2^-8) (the half step, plus the fp32
 *   rounding of qa_d 32767 / max, < 32767 2^-23 < 2^-8 steps); a 4-bit code
 *   is at most 15, so score t moves by at most
 *       ds_t = |s_tok_t| 15 D sq (1/2 + 2^-8),
 *   and with delta = max_t ds_t over the visible committed tiles the
 *   softmax weights move by ||p' - p||_1 <= e^(2 delta) - 1 (as in
 *   orig_bound), the output by at most (e^(2 delta) - 1) max_t ||v'_t||_inf.
 *   V (2-bit, G = 128): per tile and row the weights w_t = p_t a_t are
 *   rounded to sw wi_t, sw = max_t |w_t| / 32767, error <= sw (1/2 + 2^-8)
 *   per weight; codes <= 3, so acc_d moves by at most
 *   |s_chan_d| 3 G sw (1/2 + 2^-8). Divided by l = sum_t p_t: sw / l =
 *   max_t (p_t / l) |a_t| / 32767 <= max_t pi_t * max_t |a_t| / 32767, and
 *   the pi_t maxima of the tiles sum to at most 1, so rotated channel d of
 *   the output moves by at most
 *       e_d = 3 G (1/2 + 2^-8) / 32767 max over tiles, t (|s_chan_d| |a_t|),
 *   and the output in the original basis (H / sqrt(D) applied to the
 *   error vector) by at most sum_d e_d / sqrt(D). Nothing else changes:
 *   the int32 sums are exact. */
/* tests/common/int_dot_bound.h for sequence s, KV head h of the fixture,
 * at the level KVARN_SIMD caps now (a walk's pass, run_case's hold): 0 where the
 * library says the kernels keep fp32. */
static double int_dot_bound(const paged_fixture *f, int s, int h, const float *q, double scale,
                            int lo, int hi, const float *vdo)
{
    if (hi < lo) return 0.0;
    double vmax = 0.0;
    for (int t = lo; t <= hi; t++)
        for (int d = 0; d < f->D; d++) vmax = fmax(vmax, fabs(vdo[((size_t)t * f->Hk + h) * f->D + d]));
    return attn_int_dot_bound(&f->kv, &f->views[s], h, q, scale, lo, hi, vmax);
}

/* Dequantized K/V of sequence s in the original basis (KVarN: rotate back). */
static void deq_original(const paged_fixture *f, int s, float *kdo, float *vdo)
{
    const int D = f->D;
    size_t n = (size_t)f->views[s].seq_len * f->Hk;
    for (size_t i = 0; i < n; i++) {
        double x[1024], y[1024];
        for (int d = 0; d < D; d++) {
            x[d] = f->k_deq[s][i * D + d];
            y[d] = f->v_deq[s][i * D + d];
        }
        if (f->fmt.kind == KVARN_KIND_KVARN) {
            pf_hadamard_d(x, D);
            pf_hadamard_d(y, D);
        }
        for (int d = 0; d < D; d++) {
            kdo[i * D + d] = (float)x[d];
            vdo[i * D + d] = (float)y[d];
        }
    }
}

/* int_dot_bound of output row `row` ([token][Hq] order) of a call with
 * query_start_loc qsl (decode: one token per sequence), no window; vdo[s]:
 * sequence s's dequantized V in the original basis (deq_original). */
static double row_int_bound(const paged_fixture *f, const attn_case *c, const int32_t *qsl,
                            const float *q, size_t row, float *const *vdo)
{
    const int Hq = c->Hk * c->group;
    const int tok = (int)(row / (size_t)Hq), head = (int)(row % (size_t)Hq);
    int s = 0;
    while (tok >= qsl[s + 1]) s++;
    const int len = c->seqs[s].seq_len, ql = qsl[s + 1] - qsl[s];
    const int pos = c->multi ? len - ql + (tok - qsl[s]) : len - 1;
    const int hi = (c->multi && !c->causal) ? len - 1 : pos;
    /* the row's items hold at most its sequence's query tokens x group */
    idb_rows = ql * c->group;
    idb_no_bf16 = c->no_bf16;
    const double b = int_dot_bound(f, s, head / c->group, q + row * (size_t)c->D,
                                   1.0 / sqrt((double)c->D), 0, hi, vdo[s]);
    idb_rows = idb_no_bf16 = 0;
    return b;
}

/* The SIMD level a case runs at (before the cap at the level the library
 * runs): scalar with force_scalar, its level, 0: the best. */
static int case_level(const attn_case *c)
{
    return c->force_scalar ? LV_SCALAR : c->level ? c->level : LV_AVX512;
}

static kvarn_status run_attn(const paged_fixture *f, const attn_case *c, const int32_t *qsl,
                             const float *q, float *out, kvarn_thread_pool *pool)
{
    const int Hq = c->Hk * c->group;
    kvarn_attn_opts o = KVARN_ATTN_OPTS_DEFAULT((float)(1.0 / sqrt((double)c->D)));
    o.sliding_window = c->window;
    o.causal = c->causal;
    kvarn_attn_testing knobs = {c->split, c->force_scalar, c->no_vnni, c->amx, c->no_bf16};
    o.testing = &knobs;
    /* the case's level for this call only: KVARN_SIMD put back after it,
     * so that a walk around the call keeps walking its own levels */
    levels_iter hold = levels_hold(case_level(c));
    int total_q = c->multi ? qsl[c->n_seqs] : c->n_seqs;
    size_t wsz = kvarn_attn_workspace_bytes(&f->kv, Hq, c->n_seqs, total_q,
                                            kvarn_thread_pool_size(pool), &o);
    assert_true(wsz > 0);
    void *ws = malloc(wsz);
    kvarn_status st = c->multi
        ? kvarn_attn_multi(&f->kv, f->views, c->n_seqs, qsl, Hq, q, out, &o, pool, ws, wsz)
        : kvarn_attn_decode(&f->kv, f->views, c->n_seqs, Hq, q, out, &o, pool, ws, wsz);
    free(ws);
    levels_end(&hold);
    return st;
}

typedef struct case_result {
    double max_rel_deq;   /* vs attention over the dequantized K/V */
    double max_rel_orig;  /* vs attention over the original K/V */
    double max_bound_use; /* error / derived bound (must be <= 1) */
    double max_int_use;   /* error / (int_dot_bound + 1e-4 max|o|), where
                             the integer dot products ran */
} case_result;

/* Build the fixture, run the case, compare every output row with the
 * double-precision references. Returns the worst errors. */
static case_result run_case(const attn_case *c, uint64_t seed)
{
    paged_fixture f;
    assert_int_equal(pf_build_sink(&f, c->fmt, c->D, c->Hk, c->G, c->sink, c->sink_partial,
                                   c->seqs, c->n_seqs, seed), 0);
    const int D = c->D, Hq = c->Hk * c->group;
    int32_t qsl[MAXS + 1];
    qsl[0] = 0;
    for (int s = 0; s < c->n_seqs; s++) qsl[s + 1] = qsl[s] + (c->multi ? c->q_lens[s] : 1);
    int total_q = qsl[c->n_seqs];
    size_t nq = (size_t)(total_q ? total_q : 1) * Hq * D;
    float *q = malloc(nq * sizeof(float)), *out = malloc(nq * sizeof(float));
    test_rng rng;
    test_rng_seed(&rng, seed ^ 0x5151);
    for (size_t i = 0; i < nq; i++) q[i] = (float)test_rng_normal(&rng);
    for (size_t i = 0; i < nq; i++) out[i] = 12345.0f;
    kvarn_thread_pool *pool = NULL;
    if (test_threads(1) > 1) assert_int_equal(kvarn_thread_pool_create(test_threads(1), &pool), KVARN_OK);
    assert_int_equal(run_attn(&f, c, qsl, q, out, pool), KVARN_OK);
    kvarn_thread_pool_destroy(pool);
    idb_amx = c->bound_amx ? c->bound_amx : c->amx; /* the bounds below read the kernels of this call */
    levels_iter bound_hold = levels_hold(c->bound_level ? c->bound_level : case_level(c));
    idb_no_bf16 = c->no_bf16;

    case_result res = {0, 0, 0, 0};
    const double scale = 1.0 / sqrt((double)D);
    double ref[1024], ref_o[1024];
    for (int s = 0; s < c->n_seqs; s++) {
        int len = c->seqs[s].seq_len, ql = qsl[s + 1] - qsl[s];
        size_t n = (size_t)len * c->Hk * D + 1;
        float *kdo = malloc(n * sizeof(float)), *vdo = malloc(n * sizeof(float));
        deq_original(&f, s, kdo, vdo);
        /* the sequence's items hold at most its query tokens x group */
        idb_rows = (ql ? ql : 1) * c->group;
        for (int qi = 0; qi < ql; qi++) {
            int pos = c->multi ? len - ql + qi : len - 1;
            int hi = (c->multi && !c->causal) ? len - 1 : pos;
            int anchor = (c->multi && !c->causal) ? len - 1 : pos;
            int lo = c->window > 0 ? anchor - c->window + 1 : 0;
            if (lo < 0) lo = 0;
            for (int head = 0; head < Hq; head++) {
                const float *qq = q + ((size_t)(qsl[s] + qi) * Hq + head) * D;
                const float *o = out + ((size_t)(qsl[s] + qi) * Hq + head) * D;
                pf_ref_attention(&f, s, head, Hq, qq, scale, lo, hi, 1, ref);
                pf_ref_attention(&f, s, head, Hq, qq, scale, lo, hi, 0, ref_o);
                double mx = 0, err = 0, mxo = 0, erro = 0;
                for (int d = 0; d < D; d++) {
                    mx = fmax(mx, fabs(ref[d]));
                    err = fmax(err, fabs(o[d] - ref[d]));
                    mxo = fmax(mxo, fabs(ref_o[d]));
                    erro = fmax(erro, fabs(o[d] - ref_o[d]));
                }
                if (len == 0 || hi < lo) {
                    for (int d = 0; d < D; d++) assert_true(o[d] == 0.0f);
                    continue;
                }
                /* the integer dot products' derived error (0 where the
                 * library says this level's kernels keep fp32) on top of
                 * 1e-4 */
                const double ib = int_dot_bound(&f, s, head / c->group, qq, scale, lo, hi, vdo);
                double rel = err / fmax(mx, 1e-6);
                if (rel > res.max_rel_deq) res.max_rel_deq = rel;
                if (ib > 0.0 && err / (ib + 1e-4 * fmax(mx, 1e-6)) > res.max_int_use)
                    res.max_int_use = err / (ib + 1e-4 * fmax(mx, 1e-6));
                if (!(err < 1e-4 * fmax(mx, 1e-6) + ib))
                    print_error("%s D=%d seq %d q %d head %d: rel err %g (int bound %g)\n", c->fmt, D, s,
                                qi, head, rel, ib / fmax(mx, 1e-6));
                assert_true(err < 1e-4 * fmax(mx, 1e-6) + ib);
                double qo[1024];
                for (int d = 0; d < D; d++) qo[d] = qq[d];
                double bound = orig_bound(&f, s, head / c->group, qo, scale, lo, hi, kdo, vdo) + ib;
                double use = erro / (bound * (1.0 + 1e-6) + 1e-4 * mxo + 1e-12);
                if (use > res.max_bound_use) res.max_bound_use = use;
                assert_true(use <= 1.0);
                double relo = erro / fmax(mxo, 1e-6);
                if (relo > res.max_rel_orig) res.max_rel_orig = relo;
            }
        }
        free(kdo);
        free(vdo);
    }
    levels_end(&bound_hold);
    idb_rows = idb_no_bf16 = 0;
    free(q);
    free(out);
    pf_free(&f);
    return res;
}

/* Every format of the table, and KVarN at every other pair of bit widths
 * (each a specialization of the SIMD record kernels), decode, head_dim 64
 * and 128, lengths around the tile size, every kernel set (scalar, AVX2,
 * AVX-512): every entry of every kind's kernel row (kernel_table.c) against
 * the reference. */
static void test_every_format(void **state)
{
    (void)state;
    /* Against attention over the ORIGINAL K/V each row is held to the bound
     * derived from its own round-trip error (orig_bound, in run_case); the
     * relative error is only printed (a fixed per-format ceiling would be
     * this fixture's measurement). */
    struct { const char *name; } fm[] = {
        {"fp16"}, {"bf16"}, {"fp8_e4m3"}, {"fp8_e5m2"}, {"int8"}, {"int4"},
        {"kvarn_k4v4_g128"}, {"kvarn_k4v4_g64"}, {"kvarn_k4v2_g128"}, {"kvarn_k4v2_g64"},
        {"kvarn_k2v2_g32"}, {"kvarn_k2v4_g32"}, {"kvarn_k2v8_g32"}, {"kvarn_k4v8_g32"},
        {"kvarn_k8v2_g32"}, {"kvarn_k8v4_g32"}, {"kvarn_k8v8_g32"},
        /* mean-centred records (the driver's add_value_means after each
         * kernel; V biased per channel by the fixture) */
        {"kvarn_k4v2_g128c"}, {"kvarn_k4v4_g64c"}, {"kvarn_k2v8_g32c"}};
    /* the list covers every kind of the table */
    for (int k = 0; k < KVARN_KIND_COUNT; k++) {
        int seen = 0;
        for (size_t i = 0; i < sizeof fm / sizeof fm[0]; i++) {
            kvarn_format f;
            assert_int_equal(kvarn_format_parse(fm[i].name, &f), KVARN_OK);
            seen += f.kind == (kvarn_kind)k;
        }
        assert_true(seen > 0);
    }
    for (size_t i = 0; i < sizeof fm / sizeof fm[0]; i++) {
        for (int di = 0; di < 2; di++) {
            double worst_deq = 0, worst_orig = 0, worst_use = 0, worst_int = 0;
            /* the AVX-512 level twice: its VNNI and AVX512-BF16 kernels
             * (where the CPU has them) and its vpmaddwd build with the
             * fp8 and bf16 formats' fp32 spans (knobs no_vnni, no_bf16) */
            LEVELS_FOR(it) /* and the AVX-512 level twice: its vpmaddwd build */
            for (int vp = 0; vp <= (it.index == LV_AVX512); vp++) {
                const int pass = vp ? LV_COUNT : it.index;
                const int lv = pass == LV_COUNT ? LV_AVX512 : pass;
                attn_case c;
                memset(&c, 0, sizeof c);
                c.no_vnni = c.no_bf16 = pass == LV_COUNT;
                c.fmt = fm[i].name;
                c.D = di ? 128 : 64;
                c.Hk = 2;
                c.group = 3;
                c.G = 16;
                c.sink = 1;
                c.causal = 1;
                c.force_scalar = lv == LV_SCALAR;
                c.level = lv;
                kvarn_format fmt;
                assert_int_equal(kvarn_format_parse(c.fmt, &fmt), KVARN_OK);
                int G = fmt.kind == KVARN_KIND_KVARN ? fmt.tile_tokens : c.G;
                int lens[5] = {1, G - 1, G, G + 1, 3 * G + 5};
                c.n_seqs = 5;
                for (int s = 0; s < 5; s++) {
                    c.seqs[s].seq_len = lens[s];
                    c.seqs[s].tail_tiles = s == 4 ? 1 : 0;
                }
                case_result r = run_case(&c, 100 + i * 7 + di);
                worst_deq = fmax(worst_deq, r.max_rel_deq);
                worst_orig = fmax(worst_orig, r.max_rel_orig);
                worst_use = fmax(worst_use, r.max_bound_use);
                worst_int = fmax(worst_int, r.max_int_use);
            }
            printf("  %-16s D=%3d  rel err vs dequantized %.2e, vs original %.3f, "
                   "error/derived bound %.3f",
                   fm[i].name, di ? 128 : 64, worst_deq, worst_orig, worst_use);
            if (worst_int > 0.0) printf(", error/integer-dot bound %.3f", worst_int);
            printf("\n");
            assert_true(worst_use <= 1.0);
        }
    }
}

/* head_dim 256 and 512 (Gemma-2/3's and Gemma-4's global layers): the
 * KVarN presets (plain and mean-centred) and the per-token formats a
 * staging uses, decode and a causal multi-query chunk, lengths around the
 * tile size, every kernel set (AVX-512 also in its vpmaddwd build), each
 * against the reference within run_case's derived bounds (at 512 the
 * integer dot products are off where kvarn_attn_kernel_info_get says so:
 * the bounds read it). */
static void test_large_head_dim(void **state)
{
    (void)state;
    const char *fmts[] = {"kvarn_k4v2_g128", "kvarn_k4v4_g64", "kvarn_k4v2_g128c", "int8",
                          "fp16", "int4", "fp8_e4m3", "bf16"};
    const int dims[] = {256, 512};
    for (size_t fi = 0; fi < sizeof fmts / sizeof fmts[0]; fi++)
        for (int di = 0; di < 2; di++)
            for (int multi = 0; multi <= 1; multi++)
                LEVELS_FOR(it) /* and the AVX-512 level twice: its vpmaddwd build */
                for (int vp = 0; vp <= (it.index == LV_AVX512); vp++) {
                    const int pass = vp ? LV_COUNT : it.index;
                    if (di == 0 && fi > 0) continue; /* 256: the default preset (runtime) */
                    if (pass == LV_COUNT && strncmp(fmts[fi], "kvarn", 5) != 0 &&
                        strcmp(fmts[fi], "fp8_e4m3") != 0 && strcmp(fmts[fi], "bf16") != 0)
                        continue; /* the vpmaddwd build is the KVarN kernel's; the
                                     fp8 and bf16 formats' fp32 spans (no_bf16) */
                    const int lv = pass == LV_COUNT ? LV_AVX512 : pass;
                    attn_case c;
                    memset(&c, 0, sizeof c);
                    c.fmt = fmts[fi];
                    c.no_vnni = c.no_bf16 = pass == LV_COUNT;
                    c.D = dims[di];
                    c.Hk = 1;
                    c.group = 4;
                    c.G = 16;
                    c.sink = 1;
                    c.causal = 1;
                    c.multi = multi;
                    c.force_scalar = lv == LV_SCALAR;
                    c.level = lv;
                    kvarn_format fmt;
                    assert_int_equal(kvarn_format_parse(c.fmt, &fmt), KVARN_OK);
                    const int G = fmt.kind == KVARN_KIND_KVARN ? fmt.tile_tokens : c.G;
                    const int lens[2] = {G + 1, 2 * G + 5}, qls[2] = {1, G + 3};
                    c.n_seqs = 2;
                    for (int s = 0; s < 2; s++) {
                        c.seqs[s].seq_len = lens[s];
                        c.q_lens[s] = qls[s];
                    }
                    c.seqs[1].tail_tiles = 1;
                    run_case(&c, 1700 + (int)fi * 11 + di * 3 + multi);
                }
}

/* GQA ratios 1, 3, 4, 8 with head_dim 64 and 128. */
static void test_gqa(void **state)
{
    (void)state;
    /* the non-preset KVarN widths run the 8-bit and 2-bit code paths */
    const char *fmts[] = {"kvarn_k4v2_g64", "int8", "fp16", "kvarn_k8v2_g64", "kvarn_k2v8_g32"};
    const int groups[] = {1, 3, 4, 8};
    for (int fi = 0; fi < 5; fi++)
        for (int gi = 0; gi < 4; gi++)
            for (int di = 0; di < 2; di++) {
                attn_case c;
                memset(&c, 0, sizeof c);
                c.fmt = fmts[fi];
                c.D = di ? 128 : 64;
                c.Hk = 2;
                c.group = groups[gi];
                c.G = 32;
                c.sink = 1;
                c.causal = 1;
                c.n_seqs = 2;
                c.seqs[0].seq_len = 200;
                c.seqs[1].seq_len = 77;
                LEVELS_FOR(it) {
                    const int lv = it.index;
                    if (lv == LV_SCALAR) continue;
                    c.level = lv;
                    run_case(&c, 300 + fi * 31 + gi * 7 + di);
                }
            }
}

/* The int8 and int4 AVX-512 kernel's integer path (int4: its codes
 * widened to bytes) and its fp32 fallback: head_dim 64, 96 (32 channels
 * per V pass), 256 (the largest the int32 K sums allow) and 320 (fp32
 * path); blocks of 16 (spans of 8 blocks), 256 (one block, the longest
 * span the int32 V sums allow) and 512 tokens (fp32 path); odd lengths
 * (the last token pair and 4-token group partial); decode, and prefill
 * chunks of 20 queries (60 rows a work item: the VNNI build's K codes
 * transposed once per span) where the integer path takes them, the matrix
 * kernel off so that the vector kernels run on a CPU with AMX too; every
 * level, and the AVX-512 level's vpmaddwd build. */
static void test_int8_paths(void **state)
{
    (void)state;
    const int dims[] = {64, 96, 256, 320}, blocks[] = {16, 256, 512};
    const char *fmts[] = {"int8", "int4"};
    for (int fi = 0; fi < 2; fi++)
    for (int di = 0; di < 4; di++)
        for (int bi = 0; bi < 3; bi++)
            for (int multi = 0; multi <= 1; multi++)
            LEVELS_FOR(it) /* and the AVX-512 level twice: its vpmaddwd build */
            for (int vp = 0; vp <= (it.index == LV_AVX512); vp++) {
                const int pass = vp ? LV_COUNT : it.index;
                /* prefill chunks where the integer path may take them (the
                 * fp32 fallbacks and the reference are decode's loops) */
                if (multi && (di == 3 || bi == 2 || it.index == LV_SCALAR)) continue;
                attn_case c;
                memset(&c, 0, sizeof c);
                c.fmt = fmts[fi];
                c.D = dims[di];
                c.Hk = 2;
                c.group = 3;
                c.G = blocks[bi];
                c.causal = 1;
                c.level = pass == LV_COUNT ? LV_AVX512 : pass;
                c.force_scalar = c.level == LV_SCALAR;
                c.no_vnni = pass == LV_COUNT;
                c.amx = 1;
                c.n_seqs = 3;
                c.seqs[0].seq_len = 1;
                c.seqs[1].seq_len = 301;
                c.seqs[2].seq_len = 2 * c.G + 7;
                if (multi) {
                    c.multi = 1;
                    c.q_lens[0] = 1;
                    c.q_lens[1] = 20;
                    c.q_lens[2] = 20;
                }
                run_case(&c, 1400 + fi * 100 + di * 5 + bi + 50 * multi);
            }
    /* the VNNI build (K by vpdpbusd on transposed codes where D % 64 == 0,
     * else as the other build) and the vpmaddwd build: the same exact
     * int32 sums, the same bits (test_simd_threads checks D = 128) */
    for (int fi = 0; fi < 2; fi++)
    for (int di = 0; di < 4; di++) {
        attn_case c;
        memset(&c, 0, sizeof c);
        c.fmt = fmts[fi];
        c.D = dims[di];
        c.Hk = 2;
        c.group = 3;
        c.G = 16;
        c.causal = 1;
        c.level = LV_AVX512;
        c.n_seqs = 2;
        c.seqs[0].seq_len = 301;
        c.seqs[1].seq_len = 45;
        paged_fixture f;
        assert_int_equal(pf_build(&f, c.fmt, c.D, c.Hk, c.G, 0, c.seqs, c.n_seqs, 1650 + fi * 10 + di), 0);
        int32_t qsl[3] = {0, 1, 2};
        const size_t nq = (size_t)2 * c.Hk * c.group * c.D;
        float *q = malloc(nq * sizeof(float)), *a = malloc(nq * sizeof(float)), *b = malloc(nq * sizeof(float));
        test_rng rng;
        test_rng_seed(&rng, 1680 + fi * 10 + di);
        for (size_t i = 0; i < nq; i++) q[i] = (float)test_rng_normal(&rng);
        assert_int_equal(run_attn(&f, &c, qsl, q, a, NULL), KVARN_OK);
        c.no_vnni = 1;
        assert_int_equal(run_attn(&f, &c, qsl, q, b, NULL), KVARN_OK);
        assert_memory_equal(a, b, nq * sizeof(float));
        free(q); free(a); free(b);
        pf_free(&f);
    }
}

/* Sink tiles 0 and 1, fp16 tail of 0, 1 or 2 full tiles plus a partial one. */
static void test_sink_and_tail(void **state)
{
    (void)state;
    for (int sink = 0; sink < 2; sink++)
        for (int tail = 0; tail < 3; tail++) {
            attn_case c;
            memset(&c, 0, sizeof c);
            c.fmt = "kvarn_k4v4_g64";
            c.D = 64;
            c.Hk = 1;
            c.group = 4;
            c.sink = sink;
            c.causal = 1;
            c.n_seqs = 3;
            c.seqs[0].seq_len = 5 * 64;
            c.seqs[1].seq_len = 5 * 64 + 10;
            c.seqs[2].seq_len = 64;
            for (int s = 0; s < 3; s++) c.seqs[s].tail_tiles = tail;
            LEVELS_FOR(it) {
                const int lv = it.index;
                c.force_scalar = lv == LV_SCALAR;
                c.level = lv;
                run_case(&c, 500 + sink * 3 + tail);
            }
        }
}

/* Sink lengths S in {0, 4, 16, 32, 64, 128} tokens (paged.h "Sink shorter
 * than a tile"): floor(S / G) whole fp16 sink tiles and r = S mod G tokens
 * of the next tile read from the sequence's fp16 sink slot once that tile
 * is quantized, the rest of it from its record. Every kernel set (scalar,
 * AVX2, AVX-512) against double-precision attention over exactly that
 * data (run_case: rel < 1e-4 against the dequantized K/V, where the first
 * r tokens of the tile are fp16, not the record's values), decode and
 * multi-query (causal queries inside the sink tile, non-causal), with a
 * sliding window that starts inside the sink and one past it, and split-K
 * across the sink tile. Sequences whose partial sink tile is still in the
 * fp16 tail read the page only. */
static void test_sink_tokens(void **state)
{
    (void)state;
    const char *fmts[] = {"kvarn_k4v2_g128", "kvarn_k4v4_g64", "kvarn_k4v2_g32"};
    const int S[] = {0, 4, 16, 32, 64, 128};
    for (int fi = 0; fi < 3; fi++)
        for (int si = 0; si < 6; si++)
            for (int mode = 0; mode < 4; mode++) {
                kvarn_format fmt;
                assert_int_equal(kvarn_format_parse(fmts[fi], &fmt), KVARN_OK);
                const int G = fmt.tile_tokens;
                attn_case c;
                memset(&c, 0, sizeof c);
                c.fmt = fmts[fi];
                c.D = 64;
                c.Hk = 2;
                c.group = 2;
                c.sink = S[si] / G;
                c.sink_partial = S[si] % G;
                c.causal = mode != 2;
                c.multi = mode >= 1;
                c.window = mode == 3 ? (si % 2 ? 3 : G + 5) : 0;
                c.split = mode == 1 ? 3 : 0;
                c.n_seqs = 4;
                int base = (c.sink + 1) * G; /* the partial sink tile full */
                c.seqs[0].seq_len = base + 2 * G + 7;         /* committed, tail */
                c.seqs[1].seq_len = base;                      /* just committed */
                c.seqs[2].seq_len = base + G;
                c.seqs[2].tail_tiles = 2;                      /* sink tile in tail */
                c.seqs[3].seq_len = c.sink * G + (c.sink_partial ? c.sink_partial : 1);
                for (int s = 0; s < 4; s++)
                    c.q_lens[s] = c.seqs[s].seq_len < 5 ? c.seqs[s].seq_len : 5;
                LEVELS_FOR(it) {
                    const int lv = it.index;
                    c.force_scalar = lv == LV_SCALAR;
                    c.level = lv;
                    run_case(&c, 700 + fi * 97 + si * 13 + mode);
                }
            }
}

/* Sliding windows shorter than a tile, across tiles, longer than the
 * context; decode and multi-query. */
static void test_sliding_window(void **state)
{
    (void)state;
    const int windows[] = {1, 7, 64, 100, 1000};
    const char *fmts[] = {"kvarn_k4v2_g64", "int4", "int8"};
    for (int fi = 0; fi < 3; fi++)
        for (int wi = 0; wi < 5; wi++)
            for (int multi = 0; multi < 2; multi++) {
                attn_case c;
                memset(&c, 0, sizeof c);
                c.fmt = fmts[fi];
                c.D = 64;
                c.Hk = 2;
                c.group = 2;
                c.G = 16;
                c.sink = 1;
                c.causal = 1;
                c.window = windows[wi];
                c.multi = multi;
                c.n_seqs = 2;
                c.seqs[0].seq_len = 300;
                c.seqs[0].tail_tiles = 1;
                c.seqs[1].seq_len = 90;
                c.q_lens[0] = 20;
                c.q_lens[1] = 90;
                LEVELS_FOR(it) {
                    const int lv = it.index;
                    if (lv == LV_SCALAR) continue;
                    c.level = lv;
                    run_case(&c, 700 + fi * 11 + wi * 2 + multi);
                }
            }
}

/* Multi-query chunks, causal and not, including a whole-sequence chunk and
 * chunks crossing tile boundaries. */
static void test_multi_query(void **state)
{
    (void)state;
    /* the last three in blocks of 256 tokens: spans longer than the
     * vector kernels' fp32 chunk (items of 16 rows or more: kernel_avx2.c
     * tm_span, kernel_avx512.h tm_span_f32; 128 tokens), chunks ending
     * inside the causal rows */
    const char *fmts[] = {"kvarn_k4v2_g64", "fp8_e4m3", "fp16", "int8", "bf16", "fp8_e5m2", "int4"};
    for (int fi = 0; fi < 7; fi++)
        for (int causal = 0; causal < 2; causal++)
            LEVELS_FOR(it)
            /* the fp8 and bf16 formats at AVX-512 also with their fp32
             * spans (knob no_bf16) */
            for (int nb = 0; nb <= (it.index == LV_AVX512 && (fi == 1 || fi == 4 || fi == 5)); nb++) {
                const int lv = it.index;
                attn_case c;
                memset(&c, 0, sizeof c);
                c.no_bf16 = nb;
                c.fmt = fmts[fi];
                c.D = 64;
                c.Hk = 2;
                c.group = 3;
                c.G = fi < 4 ? 16 : 256;
                c.sink = 1;
                c.causal = causal;
                c.multi = 1;
                c.force_scalar = lv == LV_SCALAR;
                c.level = lv;
                c.n_seqs = 4;
                int lens[4] = {10, 200, 300, 65}, qls[4] = {1, 5, 70, 65};
                for (int s = 0; s < 4; s++) {
                    c.seqs[s].seq_len = lens[s];
                    c.q_lens[s] = qls[s];
                }
                c.seqs[2].tail_tiles = 1;
                run_case(&c, 900 + fi * 5 + causal * 2 + (lv == LV_SCALAR));
            }
}

/* A chunk longer than one work item's query block (512 rows / GQA
 * group, attn_plan.c ROWS_TARGET), so that one sequence's queries span several items; with and without
 * forced split-K. */
static void test_long_chunk(void **state)
{
    (void)state;
    for (int split = 0; split < 2; split++) {
        attn_case c;
        memset(&c, 0, sizeof c);
        c.fmt = "kvarn_k4v2_g64";
        c.D = 64;
        c.Hk = 1;
        c.group = 3;
        c.sink = 1;
        c.causal = 1;
        c.multi = 1;
        c.split = split ? 3 : 1;
        c.n_seqs = 2;
        c.seqs[0].seq_len = 400;
        c.seqs[0].tail_tiles = 1;
        c.seqs[1].seq_len = 30;
        c.q_lens[0] = 300;
        c.q_lens[1] = 2;
        LEVELS_FOR(it) {
            const int lv = it.index;
            if (lv == LV_SCALAR) continue;
            c.level = lv;
            run_case(&c, 1200 + split);
        }
    }
}

/* The matrix kernel of KVarN records and of the fp8 and bf16 formats'
 * blocks (kernel_amx.c; attn.h kvarn_attn_kernel_info.matrix), its tiles
 * emulated in C so that it runs
 * on any CPU (testing knob amx = 2): prefill chunks whose work items have
 * 16 rows or more (here 4 queries x group 4 and up, with a remainder block
 * of fewer than 16 rows), every tile length and bit width it takes, head_dim
 * 64, 96 and 128, sink and fp16 tail pages, causal and not, against the
 * double references with the bound derived from the library's statement
 * of its bf16 rounding (tests/common/int_dot_bound.h). Then the same call
 * with the knob amx = 1 must give other bits: the emulated kernel ran. */
static void test_matrix_kernel(void **state)
{
    (void)state;
    /* and the fp8 and bf16 formats' blocks (32-token blocks) */
    static const char *const fmts[] = {"kvarn_k4v2_g128", "kvarn_k4v4_g64", "kvarn_k2v4_g32",
                                       "kvarn_k8v8_g128", "kvarn_k4v8_g128", "fp8_e4m3", "bf16"};
    static const int Ds[] = {64, 128, 64, 256, 128, 128, 64};
    for (int fi = 0; fi < 7; fi++)
        for (int causal = 0; causal < 2; causal++) {
            kvarn_format fmt;
            assert_int_equal(kvarn_format_parse(fmts[fi], &fmt), KVARN_OK);
            attn_case c;
            memset(&c, 0, sizeof c);
            c.fmt = fmts[fi];
            c.D = Ds[fi];
            c.Hk = 2;
            c.group = 4;
            c.G = fmt.kind == KVARN_KIND_KVARN ? fmt.tile_tokens : 32;
            c.sink = 1;
            c.causal = causal;
            c.multi = 1;
            c.amx = 2;
            c.level = LV_AVX2;
            c.n_seqs = 3;
            const int G = c.G;
            int lens[3] = {3 * G + 17, 2 * G, G + 5}, qls[3] = {G + 9, 4, 7};
            for (int s = 0; s < 3; s++) {
                c.seqs[s].seq_len = lens[s];
                c.q_lens[s] = qls[s];
            }
            c.seqs[0].tail_tiles = 1;
            idb_amx = 2;
            kvarn_attn_kernel_info info;
            assert_int_equal(kvarn_attn_kernel_info_get(&fmt, c.D, 0, NULL, &info), KVARN_OK);
            kvarn_attn_testing emu = {0, 0, 0, 2, 0};
            kvarn_attn_opts eo = KVARN_ATTN_OPTS_DEFAULT(1.0f);
            eo.testing = &emu;
            assert_int_equal(kvarn_attn_kernel_info_get(&fmt, c.D, 0, &eo, &info), KVARN_OK);
            assert_string_equal(info.matrix, "amx-bf16-emulated");
            assert_int_equal(info.matrix_rows, 16);
            assert_int_equal(info.matrix_scores, KVARN_ATTN_ARITH_BF16);
            assert_int_equal(info.matrix_sums, KVARN_ATTN_ARITH_BF16);
            case_result res = run_case(&c, 1500 + fi * 2 + causal);
            print_message("%s D=%d causal %d: error / bf16 bound %.3f, rel err %.2e\n", fmts[fi],
                          c.D, causal, res.max_int_use, res.max_rel_deq);
            assert_true(res.max_int_use > 0.0); /* the bound was computed */
            /* the hardware's tiles, where this CPU grants them */
            set_level(LV_AVX512);
            if (kvarn__cpu_amx() == KVARN_CPU_AMX_TILES) {
                /* every work item here has 16 rows or more: all records
                 * go through the tiles, bounded by the matrix kernel's
                 * statement alone (as the emulated run, at a level whose
                 * record kernels keep fp32), not by the AVX-512 integer
                 * kernels' looser allowances, which would hide a fault */
                attn_case h = c;
                h.amx = 0;
                h.level = LV_AVX512;
                h.bound_level = LV_AVX2;
                h.bound_amx = 2;
                case_result hr = run_case(&h, 1500 + fi * 2 + causal);
                print_message("  AMX tiles: error / bound %.3f\n", hr.max_int_use);
                assert_true(hr.max_int_use > 0.0); /* the bound was computed */
            } else if (fi == 0 && causal == 0) {
                print_message("  AMX tiles: skipped: no AMX (emulated only)\n");
            }
            idb_amx = 2;

            if (causal) continue;
            /* the emulated kernel ran: other bits than without it */
            paged_fixture f;
            assert_int_equal(pf_build_sink(&f, c.fmt, c.D, c.Hk, c.G, c.sink, 0, c.seqs, c.n_seqs,
                                           77 + fi),
                             0);
            int32_t qsl[4] = {0, qls[0], qls[0] + qls[1], qls[0] + qls[1] + qls[2]};
            const size_t nq = (size_t)qsl[3] * c.Hk * c.group * c.D;
            float *q = malloc(nq * sizeof(float)), *o1 = malloc(nq * sizeof(float)),
                  *o2 = malloc(nq * sizeof(float));
            test_rng rng;
            test_rng_seed(&rng, 99 + fi);
            for (size_t i = 0; i < nq; i++) q[i] = (float)test_rng_normal(&rng);
            assert_int_equal(run_attn(&f, &c, qsl, q, o1, NULL), KVARN_OK);
            c.amx = 1;
            assert_int_equal(run_attn(&f, &c, qsl, q, o2, NULL), KVARN_OK);
            size_t differ = 0;
            for (size_t i = 0; i < nq; i++) differ += o1[i] != o2[i];
            assert_true(differ > nq / 4);
            free(q);
            free(o1);
            free(o2);
            pf_free(&f);
        }
    idb_amx = 0;
}

/* head_dim not a multiple of 16 (per-token formats serve any even D): the
 * scalar kernels take over; a multiple of 16 but not of 32 (48, 80): the
 * AVX-512 level steps down to the AVX2 kernels. */
static void test_odd_head_dim(void **state)
{
    (void)state;
    const char *fmts[] = {"int8", "fp16", "int4", "int8", "fp8_e4m3"};
    const int dims[] = {10, 24, 2, 48, 80};
    for (int i = 0; i < 5; i++) {
        attn_case c;
        memset(&c, 0, sizeof c);
        c.fmt = fmts[i];
        c.D = dims[i];
        c.Hk = 2;
        c.group = 2;
        c.G = 16;
        c.causal = 1;
        c.n_seqs = 2;
        c.seqs[0].seq_len = 50;
        c.seqs[1].seq_len = 16;
        c.level = LV_AVX512;
        run_case(&c, 1250 + i);
    }
}

/* seq_len 0 in a decode batch gives zeros; q_len 0 in multi-query writes
 * nothing for that sequence. */
static void test_empty(void **state)
{
    (void)state;
    attn_case c;
    memset(&c, 0, sizeof c);
    c.fmt = "kvarn_k4v2_g64";
    c.D = 64;
    c.Hk = 1;
    c.group = 2;
    c.sink = 1;
    c.causal = 1;
    c.n_seqs = 3;
    c.seqs[0].seq_len = 70;
    c.seqs[1].seq_len = 0;
    c.seqs[2].seq_len = 3;
    run_case(&c, 1100);
    c.multi = 1;
    c.q_lens[0] = 0;
    c.q_lens[1] = 0;
    c.q_lens[2] = 2;
    run_case(&c, 1101);
}


/* Every output row of a call against the scalar reference's (ref): 1e-5
 * of the row's largest |ref| (fp32 sums in another order) plus the derived
 * error of the integer dot products (tests/common/int_dot_bound.h). */
static void check_rows(const paged_fixture *f, const attn_case *c, const int32_t *qsl,
                       const float *q, const float *ref, const float *out, float *const *vdo,
                       const char *what)
{
    const int Hq = c->Hk * c->group;
    const size_t rows = (size_t)qsl[c->n_seqs] * Hq;
    for (size_t row = 0; row < rows; row++) {
        double mx = 0, err = 0;
        for (int d = 0; d < c->D; d++) {
            mx = fmax(mx, fabs(ref[row * c->D + d]));
            err = fmax(err, fabs(out[row * c->D + d] - ref[row * c->D + d]));
        }
        const double lim = 1e-5 * mx + row_int_bound(f, c, qsl, q, row, vdo);
        if (err > lim)
            print_error("%s %s split %d row %zu: %g (limit %g)\n", c->fmt, what, c->split, row,
                        err / mx, lim / mx);
        assert_true(err <= lim);
    }
}

/* Whether the VNNI build rounds as the vpmaddwd build (no_vnni) does for
 * this fixture's format: the library's word (kernel info with and without
 * the knob), at the level KVARN_SIMD caps now. */
static int same_rounding_without_vnni(const paged_fixture *f)
{
    kvarn_attn_opts o = KVARN_ATTN_OPTS_DEFAULT(0.125f);
    kvarn_attn_testing nv = {0, 0, 1, 0, 0};
    kvarn_attn_kernel_info a, b;
    assert_int_equal(kvarn_attn_kernel_info_get(&f->kv.fmt, f->D, f->kv.staging, &o, &a), KVARN_OK);
    o.testing = &nv;
    assert_int_equal(kvarn_attn_kernel_info_get(&f->kv.fmt, f->D, f->kv.staging, &o, &b), KVARN_OK);
    return a.scores == b.scores && a.sums == b.sums && a.staged_scores == b.staged_scores &&
           a.staged_sums == b.staged_sums;
}

/* Every SIMD level (AVX2, AVX-512) and threads (1, 2, 3 workers; split-K
 * off, auto, forced) against the single-threaded scalar reference; repeat
 * runs are bit-identical; kvarn_attn_kernel_name names the level. */
static void test_simd_threads(void **state)
{
    (void)state;
    const char *fmts[] = {"kvarn_k4v2_g128", "kvarn_k4v4_g64", "int4", "int8", "fp16", "fp8_e5m2", "bf16"};
    kvarn_thread_pool *pools[4] = {NULL, NULL, NULL, NULL};
    for (int t = 1; t <= 3; t++) assert_int_equal(kvarn_thread_pool_create(t, &pools[t]), KVARN_OK);
    for (int fi = 0; fi < 7; fi++)
        for (int multi = 0; multi < 2; multi++) {
            attn_case c;
            memset(&c, 0, sizeof c);
            c.fmt = fmts[fi];
            c.D = 128;
            c.Hk = 2;
            c.group = 4;
            c.G = 16;
            c.sink = 1;
            c.causal = 1;
            c.multi = multi;
            c.n_seqs = 2;
            c.seqs[0].seq_len = 1000;
            c.seqs[0].tail_tiles = 1;
            c.seqs[1].seq_len = 130;
            c.q_lens[0] = 3;
            c.q_lens[1] = 1;
            paged_fixture f;
            assert_int_equal(pf_build(&f, c.fmt, c.D, c.Hk, c.G, c.sink, c.seqs, c.n_seqs, 1300 + fi), 0);
            int32_t qsl[3] = {0, multi ? 3 : 1, multi ? 4 : 2};
            const int Hq = c.Hk * c.group;
            size_t nq = (size_t)qsl[2] * Hq * c.D;
            float *q = malloc(nq * sizeof(float)), *ref = malloc(nq * sizeof(float));
            float *out = malloc(nq * sizeof(float)), *again = malloc(nq * sizeof(float));
            test_rng rng;
            test_rng_seed(&rng, 77 + fi);
            for (size_t i = 0; i < nq; i++) q[i] = (float)(2.0 * test_rng_normal(&rng));
            c.force_scalar = 1;
            c.split = 1;
            assert_int_equal(run_attn(&f, &c, qsl, q, ref, NULL), KVARN_OK);
            c.force_scalar = 0;
            float *vdo[2];
            for (int s = 0; s < 2; s++) {
                size_t nv = (size_t)c.seqs[s].seq_len * c.Hk * c.D + 1;
                float *kdo = malloc(nv * sizeof(float));
                vdo[s] = malloc(nv * sizeof(float));
                deq_original(&f, s, kdo, vdo[s]);
                free(kdo);
            }
            const int splits[3] = {1, 0, 3};
            LEVELS_FOR(it)
            for (int t = 1; t <= 3 && it.index != LV_SCALAR; t++)
                for (int si = 0; si < 3; si++) {
                    const int lv = it.index;
                    c.level = lv;
                    assert_string_equal(kvarn_attn_kernel_name(NULL), it.name);
                    c.split = splits[si];
                    assert_int_equal(run_attn(&f, &c, qsl, q, out, pools[t]), KVARN_OK);
                    assert_int_equal(run_attn(&f, &c, qsl, q, again, pools[t]), KVARN_OK);
                    assert_memory_equal(out, again, nq * sizeof(float));
                    /* the vpmaddwd and VNNI builds: the same exact int32
                     * sums, the same bits, where they round alike (the
                     * VNNI build's u8 weights aside: then both are held
                     * to the reference below) */
                    c.no_vnni = 1;
                    assert_int_equal(run_attn(&f, &c, qsl, q, again, pools[t]), KVARN_OK);
                    if (same_rounding_without_vnni(&f))
                        assert_memory_equal(out, again, nq * sizeof(float));
                    else
                        check_rows(&f, &c, qsl, q, ref, again, vdo, "vpmaddwd build");
                    c.no_vnni = 0;
                    check_rows(&f, &c, qsl, q, ref, out, vdo, it.name);
                    /* the scalar kernels threaded and split agree too */
                    c.force_scalar = 1;
                    assert_int_equal(run_attn(&f, &c, qsl, q, again, pools[t]), KVARN_OK);
                    for (size_t i = 0; i < nq; i++)
                        assert_true(fabs(again[i] - ref[i]) <= 1e-5 * (fabs(ref[i]) + 1.0));
                    c.force_scalar = 0;
                }
            free(q); free(ref); free(out); free(again);
            free(vdo[0]); free(vdo[1]);
            pf_free(&f);
        }
    for (int t = 1; t <= 3; t++) kvarn_thread_pool_destroy(pools[t]);
}

/* Queries far from unit size (|q| ~ 1e30 and 1e-30 times a normal draw),
 * KVarN at every key width the SIMD kernels specialize (4-bit K of
 * 128-token tiles, 4-bit, 2-bit and 8-bit K of shorter ones), the int8
 * and int4 formats, and the fp8 and bf16 formats in prefill chunks: every SIMD
 * level finite and within the bound test_simd_threads holds it to (1e-5 of
 * the row's largest output: the levels differ only in the order of the
 * fp32 sums). The AVX-512 KVarN kernels convert codes as code * 2^(bits k)
 * (k up to 7 for 4-bit, 15 for 2-bit codes) and undo the power of two
 * after the sums; with |q a_d| near 1e28 those sums overflowed to inf
 * (NaN outputs) where the reference's do not, so such tiles go to the
 * AVX2 kernel. */
static void test_extreme_query(void **state)
{
    (void)state;
    /* the last three as a prefill chunk of 16 queries (48-row items: the
     * AVX512-BF16 kernel, its query rounded to bf16; at |q| ~ 1e30 its
     * derived bound is unbounded, so those rows are held to finite
     * outputs only) */
    const char *fmts[] = {"kvarn_k4v2_g128", "kvarn_k4v4_g64", "kvarn_k2v2_g32", "kvarn_k8v2_g64",
                          "int8", "int4", "fp8_e4m3", "fp8_e5m2", "bf16"};
    const double mags[] = {1e30, 1e-30, 0.0};
    for (int fi = 0; fi < 9; fi++)
        for (int D = 64; D <= 128; D += 64)
            for (int mi = 0; mi < 3; mi++) {
                attn_case c;
                memset(&c, 0, sizeof c);
                c.fmt = fmts[fi];
                c.D = D;
                c.Hk = 2;
                c.group = 3;
                c.sink = 1;
                c.n_seqs = 1;
                c.seqs[0].seq_len = 600;
                c.multi = fi >= 6;
                c.q_lens[0] = c.multi ? 16 : 1;
                paged_fixture f;
                kvarn_format fmt;
                assert_int_equal(kvarn_format_parse(c.fmt, &fmt), KVARN_OK);
                c.G = fmt.kind == KVARN_KIND_KVARN ? fmt.tile_tokens : 16;
                assert_int_equal(pf_build(&f, c.fmt, D, c.Hk, c.G, c.sink, c.seqs, 1, 1500 + fi), 0);
                int32_t qsl[2] = {0, c.q_lens[0]};
                const size_t nq = (size_t)c.q_lens[0] * c.Hk * c.group * D;
                float *q = malloc(nq * sizeof(float)), *ref = malloc(nq * sizeof(float));
                float *out = malloc(nq * sizeof(float));
                test_rng rng;
                test_rng_seed(&rng, 91 + fi);
                for (size_t i = 0; i < nq; i++) q[i] = (float)(mags[mi] * test_rng_normal(&rng));
                c.force_scalar = 1;
                assert_int_equal(run_attn(&f, &c, qsl, q, ref, NULL), KVARN_OK);
                c.force_scalar = 0;
                float *vdo[1], *kdo = malloc((size_t)600 * c.Hk * D * sizeof(float));
                vdo[0] = malloc((size_t)600 * c.Hk * D * sizeof(float));
                deq_original(&f, 0, kdo, vdo[0]);
                free(kdo);
                LEVELS_FOR(it) {
                    const int lv = it.index;
                    if (lv == LV_SCALAR) continue;
                    c.level = lv;
                    assert_int_equal(run_attn(&f, &c, qsl, q, out, NULL), KVARN_OK);
                    for (size_t row = 0; row < nq / D; row++) {
                        double mx = 0, err = 0;
                        for (int d = 0; d < D; d++) {
                            assert_true(isfinite(out[row * D + d]));
                            mx = fmax(mx, fabs(ref[row * D + d]));
                            err = fmax(err, fabs(out[row * D + d] - ref[row * D + d]));
                        }
                        const double lim = 1e-5 * mx + row_int_bound(&f, &c, qsl, q, row, vdo);
                        if (!(err <= lim))
                            print_error("%s D=%d |q|~%g %s row %zu: %g (limit %g)\n", c.fmt, D, mags[mi],
                                        it.name, row, err / mx, lim / mx);
                        assert_true(err <= lim);
                    }
                }
                free(vdo[0]);
                free(q); free(ref); free(out);
                pf_free(&f);
            }
}

/* Bad inputs: the right status, and the output left untouched. */
static void test_bad_inputs(void **state)
{
    (void)state;
    pf_seq_spec specs[2] = {{100, 0}, {40, 0}};
    paged_fixture f;
    assert_int_equal(pf_build(&f, "kvarn_k4v2_g32", 64, 2, 16, 1, specs, 2, 4242), 0);
    const int Hq = 4, D = 64;
    float q[2 * 4 * 64], out[2 * 4 * 64], sentinel[2 * 4 * 64];
    for (int i = 0; i < 2 * Hq * D; i++) {
        q[i] = (float)(i % 13) * 0.1f;
        out[i] = sentinel[i] = -777.0f;
    }
    kvarn_attn_opts o = KVARN_ATTN_OPTS_DEFAULT(0.125f);
    size_t wsz = kvarn_attn_workspace_bytes(&f.kv, Hq, 2, 2, 1, &o);
    assert_true(wsz > 0);
    void *ws = malloc(wsz);
#define EXPECT(st, call)                                            \
    do {                                                            \
        assert_int_equal((call), (st));                             \
        assert_memory_equal(out, sentinel, sizeof out);             \
    } while (0)
    EXPECT(KVARN_ERR_INVALID_ARG, kvarn_attn_decode(NULL, f.views, 2, Hq, q, out, &o, NULL, ws, wsz));
    EXPECT(KVARN_ERR_INVALID_ARG, kvarn_attn_decode(&f.kv, NULL, 2, Hq, q, out, &o, NULL, ws, wsz));
    EXPECT(KVARN_ERR_INVALID_ARG, kvarn_attn_decode(&f.kv, f.views, 2, Hq, NULL, out, &o, NULL, ws, wsz));
    EXPECT(KVARN_ERR_INVALID_ARG, kvarn_attn_decode(&f.kv, f.views, -1, Hq, q, out, &o, NULL, ws, wsz));
    /* GQA ratio not integral, zero heads */
    EXPECT(KVARN_ERR_INVALID_ARG, kvarn_attn_decode(&f.kv, f.views, 2, 3, q, out, &o, NULL, ws, wsz));
    EXPECT(KVARN_ERR_INVALID_ARG, kvarn_attn_decode(&f.kv, f.views, 2, 0, q, out, &o, NULL, ws, wsz));
    assert_int_equal(kvarn_attn_workspace_bytes(&f.kv, 3, 2, 2, 1, &o), 0);
    /* workspace */
    EXPECT(KVARN_ERR_BUFFER_TOO_SMALL, kvarn_attn_decode(&f.kv, f.views, 2, Hq, q, out, &o, NULL, ws, wsz - 1));
    EXPECT(KVARN_ERR_BUFFER_TOO_SMALL, kvarn_attn_decode(&f.kv, f.views, 2, Hq, q, out, &o, NULL, NULL, wsz));
    /* non-finite query */
    q[77] = NAN;
    EXPECT(KVARN_ERR_NONFINITE, kvarn_attn_decode(&f.kv, f.views, 2, Hq, q, out, &o, NULL, ws, wsz));
    q[77] = INFINITY;
    EXPECT(KVARN_ERR_NONFINITE, kvarn_attn_decode(&f.kv, f.views, 2, Hq, q, out, &o, NULL, ws, wsz));
    q[77] = 0.5f;
    /* bad options */
    kvarn_attn_opts bad = o;
    bad.softmax_scale = NAN;
    EXPECT(KVARN_ERR_INVALID_ARG, kvarn_attn_decode(&f.kv, f.views, 2, Hq, q, out, &bad, NULL, ws, wsz));
    bad = o;
    bad.sliding_window = -1;
    EXPECT(KVARN_ERR_INVALID_ARG, kvarn_attn_decode(&f.kv, f.views, 2, Hq, q, out, &bad, NULL, ws, wsz));
    const kvarn_attn_testing bad_knobs[8] = {{-1, 0, 0, 0, 0}, {1025, 0, 0, 0, 0}, {0, 2, 0, 0, 0},
                                             {0, 0, 2, 0, 0},  {0, 0, 0, -1, 0},   {0, 0, 0, 3, 0},
                                             {0, 0, 0, 0, 2},  {0, 0, 0, 0, -1}};
    for (int i = 0; i < 8; i++) {
        bad = o;
        bad.testing = &bad_knobs[i];
        EXPECT(KVARN_ERR_INVALID_ARG, kvarn_attn_decode(&f.kv, f.views, 2, Hq, q, out, &bad, NULL, ws, wsz));
    }
    /* bad sequence views */
    kvarn_seq_view v[2] = {f.views[0], f.views[1]};
    v[1].seq_len = -1;
    EXPECT(KVARN_ERR_INVALID_ARG, kvarn_attn_decode(&f.kv, v, 2, Hq, q, out, &o, NULL, ws, wsz));
    v[1] = f.views[1];
    v[1].committed_tiles = 99;
    EXPECT(KVARN_ERR_INVALID_ARG, kvarn_attn_decode(&f.kv, v, 2, Hq, q, out, &o, NULL, ws, wsz));
    v[1] = f.views[1];
    v[1].seq_len = 1000; /* table too short for that: ids past the arena are refused */
    int32_t tab[64];
    for (int i = 0; i < 64; i++) tab[i] = f.views[0].block_table[i % 4];
    tab[20] = f.kv.n_blocks; /* one past the arena */
    v[1].block_table = tab;
    v[1].committed_tiles = 25;
    EXPECT(KVARN_ERR_INVALID_ARG, kvarn_attn_decode(&f.kv, v, 2, Hq, q, out, &o, NULL, ws, wsz));
    v[1] = f.views[1];
    int32_t tab2[2] = {-1, 0};
    v[1].block_table = tab2;
    EXPECT(KVARN_ERR_INVALID_ARG, kvarn_attn_decode(&f.kv, v, 2, Hq, q, out, &o, NULL, ws, wsz));
    /* bad paged geometry */
    kvarn_paged_kv kv = f.kv;
    kv.record_stride = 8;
    EXPECT(KVARN_ERR_INVALID_ARG, kvarn_attn_decode(&kv, f.views, 2, Hq, q, out, &o, NULL, ws, wsz));
    kv = f.kv;
    kv.head_dim = 96;
    EXPECT(KVARN_ERR_UNSUPPORTED_HEAD_DIM, kvarn_attn_decode(&kv, f.views, 2, Hq, q, out, &o, NULL, ws, wsz));
    kv = f.kv;
    kv.block_size = 16; /* KVarN: must equal the tile size */
    EXPECT(KVARN_ERR_INVALID_ARG, kvarn_attn_decode(&kv, f.views, 2, Hq, q, out, &o, NULL, ws, wsz));
    kv = f.kv;
    kv.fp16_pages = NULL;
    EXPECT(KVARN_ERR_INVALID_ARG, kvarn_attn_decode(&kv, f.views, 2, Hq, q, out, &o, NULL, ws, wsz));
    /* fp16 page strides (include/kvarn/paged.h): a head's K+V tile must fit,
     * the heads must fit in a page, and fp16 needs 2-byte steps */
    kv = f.kv;
    kv.page_head_stride = kvarn_paged_fp16_tile_bytes(kv.block_size, kv.head_dim) - 2;
    EXPECT(KVARN_ERR_INVALID_ARG, kvarn_attn_decode(&kv, f.views, 2, Hq, q, out, &o, NULL, ws, wsz));
    kv = f.kv;
    kv.page_stride = (size_t)kv.n_kv_heads * kv.page_head_stride - 2;
    EXPECT(KVARN_ERR_INVALID_ARG, kvarn_attn_decode(&kv, f.views, 2, Hq, q, out, &o, NULL, ws, wsz));
    kv = f.kv;
    kv.page_stride += 1;
    EXPECT(KVARN_ERR_INVALID_ARG, kvarn_attn_decode(&kv, f.views, 2, Hq, q, out, &o, NULL, ws, wsz));
    kv = f.kv;
    kv.page_head_stride = SIZE_MAX / 2 + 1; /* Hk * stride wraps size_t */
    EXPECT(KVARN_ERR_INVALID_ARG, kvarn_attn_decode(&kv, f.views, 2, Hq, q, out, &o, NULL, ws, wsz));
    /* multi-query: NULL / malformed query_start_loc, q_len > seq_len */
    int32_t qsl[3] = {0, 1, 2};
    EXPECT(KVARN_ERR_INVALID_ARG, kvarn_attn_multi(&f.kv, f.views, 2, NULL, Hq, q, out, &o, NULL, ws, wsz));
    qsl[0] = 1;
    EXPECT(KVARN_ERR_INVALID_ARG, kvarn_attn_multi(&f.kv, f.views, 2, qsl, Hq, q, out, &o, NULL, ws, wsz));
    qsl[0] = 0; qsl[1] = 2; qsl[2] = 1;
    EXPECT(KVARN_ERR_INVALID_ARG, kvarn_attn_multi(&f.kv, f.views, 2, qsl, Hq, q, out, &o, NULL, ws, wsz));
    v[0] = f.views[0];
    v[1] = f.views[1];
    v[0].seq_len = 0;
    v[0].committed_tiles = 0;
    qsl[1] = 1; qsl[2] = 2;
    EXPECT(KVARN_ERR_INVALID_ARG, kvarn_attn_multi(&f.kv, v, 2, qsl, Hq, q, out, &o, NULL, ws, wsz));
    /* and the good call works */
    assert_int_equal(kvarn_attn_decode(&f.kv, f.views, 2, Hq, q, out, &o, NULL, ws, wsz), KVARN_OK);
    assert_true(out[0] != -777.0f);
    /* thread pool arguments */
    kvarn_thread_pool *p = NULL;
    assert_int_equal(kvarn_thread_pool_create(0, &p), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_thread_pool_create(2, NULL), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_thread_pool_size(NULL), 1);
    kvarn_thread_pool_destroy(NULL);
#undef EXPECT
    free(ws);
    pf_free(&f);
}


/* The kernel table (src/attn/kernel_table.c): every kind's row is at its
 * index and has its scalar kernel, of the shape its codec row says (token
 * kernels for per-token kinds, a record kernel for per-tile kinds), and
 * nothing of the other shape; every level row has a name and an fp16 page
 * kernel. The selection: the level capped by head_dim, and an entry NULL at
 * a level taken from the next lower one (on a made-up row). */
/* A made-up arithmetic entry for test_kernel_table: both halves int16. */
static void arith_int16(const kvarn_format *f, int D, int vnni, kvarn_attn_arith *scores,
                        kvarn_attn_arith *sums)
{
    (void)f;
    (void)D;
    (void)vnni;
    *scores = *sums = KVARN_ATTN_ARITH_INT16;
}

/* The VNNI build's u8 weights for 2-bit V (kernel_avx512_kvarn.c kv_vsum2_u8,
 * docs/attention-intdot.md "u8 weights"), exactly. An all-zero query gives
 * every position the score 0 and p_t = 1, so the weights are the records'
 * value scales a_t; with every a_t = k_t / 256, k_t in 1..255 and 255 in
 * each tile, the u8 rounding is exact (sw = 1/256, wi_t = k_t) and so are
 * the int32 sums: the output must equal double-precision attention over
 * the records to fp32 (1e-5 of max |o|). A token, channel or 4^j scale out
 * of place in the interleaving moves it by a multiple of that. Then one
 * negative a_t in every tile (no encoder writes one; a u8 of it would drop
 * that weight): the tiles must keep the int16 loop, so the output is the
 * vpmaddwd build's to the bit. D 64, 128, 256 (one to four 64-channel
 * passes). The first half runs the default build and the vpmaddwd one
 * (testing knob no_vnni); where the library names no u8 weights for a
 * build (int16, or fp32 below AVX-512), it is held to that arithmetic's
 * bound (int_dot_bound.h) instead. */
static void test_value_weights_u8(void **state)
{
    (void)state;
    set_level(LV_AVX512);
    const int dims[3] = {64, 128, 256};
    for (int di = 0; di < 3; di++) {
        attn_case c;
        memset(&c, 0, sizeof c);
        c.fmt = "kvarn_k4v2_g128";
        c.D = dims[di];
        c.Hk = 2;
        c.group = 3;
        c.G = 128;
        c.level = LV_AVX512;
        c.n_seqs = 1;
        c.seqs[0].seq_len = 3 * 128 + 5; /* 3 records and 5 staged tokens */
        paged_fixture f;
        assert_int_equal(pf_build(&f, c.fmt, c.D, c.Hk, c.G, 0, c.seqs, 1, 1500 + di), 0);
        kvarn_record_layout L;
        assert_int_equal(kvarn_record_layout_get(&f.kv.fmt, c.D, &L), KVARN_OK);
        const int D = c.D, Hq = c.Hk * c.group;
        float *dk = malloc(sizeof(float) * 128 * (size_t)D), *dv = malloc(sizeof(float) * 128 * (size_t)D);
        float *q = calloc((size_t)Hq * D, sizeof(float)), *out = malloc(sizeof(float) * (size_t)Hq * D);
        float *again = malloc(sizeof(float) * (size_t)Hq * D);
        for (int neg = 0; neg < 2; neg++) {
            for (int ti = 0; ti < 3; ti++)
                for (int h = 0; h < c.Hk; h++) {
                    uint8_t *rec = kvarn_paged_record(&f.kv, f.tables[0][ti], h);
                    for (int t = 0; t < 128; t++) {
                        int k = 1 + (t * 37 + ti * 11 + h * 5) % 254;
                        if (t == (ti * 17 + h * 3) % 128) k = 255;
                        float a = (float)k / 256.0f;
                        if (neg && t == 7 + ti) a = -a;
                        const uint16_t x = kvarn_fp32_to_fp16(a);
                        memcpy(rec + L.v_a_off + 2 * (size_t)t, &x, 2);
                    }
                    assert_int_equal(kvarn_decode(&f.kv.fmt, D, rec, L.record_bytes, dk, dv,
                                                  KVARN_DECODE_ROTATED), KVARN_OK);
                    for (int t = 0; t < 128; t++)
                        memcpy(f.v_deq[0] + ((size_t)(ti * 128 + t) * c.Hk + h) * D, dv + (size_t)t * D,
                               sizeof(float) * D);
                }
            int32_t qsl[2] = {0, 1};
            c.no_vnni = 0;
            assert_int_equal(run_attn(&f, &c, qsl, q, out, NULL), KVARN_OK);
            if (neg) {
                c.no_vnni = 1;
                assert_int_equal(run_attn(&f, &c, qsl, q, again, NULL), KVARN_OK);
                assert_memory_equal(out, again, sizeof(float) * (size_t)Hq * D);
                continue;
            }
            /* the default build, then the vpmaddwd one (int16 weights) */
            for (int nv = 0; nv < 2; nv++) {
            kvarn_attn_opts o = KVARN_ATTN_OPTS_DEFAULT(0.125f);
            kvarn_attn_testing knob = {0, 0, nv, 0, 0};
            o.testing = &knob;
            kvarn_attn_kernel_info info;
            assert_int_equal(kvarn_attn_kernel_info_get(&f.kv.fmt, D, f.kv.staging, &o, &info), KVARN_OK);
            c.no_vnni = nv;
            assert_int_equal(run_attn(&f, &c, qsl, q, out, NULL), KVARN_OK);
            float *vdo[1] = {NULL};
            if (info.sums != KVARN_ATTN_ARITH_U8) { /* other arithmetic: its bound */
                size_t nvals = (size_t)c.seqs[0].seq_len * c.Hk * D + 1;
                float *kdo = malloc(nvals * sizeof(float));
                vdo[0] = malloc(nvals * sizeof(float));
                deq_original(&f, 0, kdo, vdo[0]);
                free(kdo);
            }
            for (int head = 0; head < Hq; head++) {
                double ref[1024], mx = 0.0, err = 0.0;
                pf_ref_attention(&f, 0, head, Hq, q + (size_t)head * D, 1.0 / sqrt((double)D), 0,
                                 c.seqs[0].seq_len - 1, 1, ref);
                for (int d = 0; d < D; d++) {
                    mx = fmax(mx, fabs(ref[d]));
                    err = fmax(err, fabs(out[(size_t)head * D + d] - ref[d]));
                }
                const double lim = 1e-5 * mx + (vdo[0] ? row_int_bound(&f, &c, qsl, q, (size_t)head, vdo) : 0.0);
                if (!(err <= lim))
                    print_error("u8 weights D=%d no_vnni %d head %d: %g (limit %g)\n", D, nv, head, err / mx,
                                lim / mx);
                assert_true(err <= lim);
            }
            free(vdo[0]);
            }
        }
        free(dk); free(dv); free(q); free(out); free(again);
        pf_free(&f);
    }
}

/* Items of many rows (ATTN_PACK_MIN_ROWS or more) take the AVX-512 KVarN
 * kernel's packed codes (kernel_avx512_kvarn.c kv_pack_k, kv_pack_v: the
 * code vectors formed once per tile), items of few rows unpack them per
 * block of rows; both sum the same exact int32 products, so a row's output
 * must be the same bits either way. ATTN_PACK_MIN_ROWS / 3 + 2 queries of
 * a sequence in one call (one work item of 3 rows a query per KV head;
 * not causal, so that each sees what it sees alone) against each query in
 * a call of its own (3 rows), in both AVX-512 builds. Split-K off and
 * no AMX matrix kernel, so that the vector kernels run both; at the best
 * level this CPU runs (on AVX2 both calls take the AVX2 kernel, whose
 * record rows are likewise independent). kvarn_k4v2_g128: packed K and
 * u8 V; kvarn_k4v4_g128: packed K, fp32 V. Records only: staged tokens
 * are per-token spans, whose fp32 sums items of 16 rows or more take in
 * another order (kernel_avx2.c tm_span, kernel_avx512.h tm_span_f32),
 * bounded by the cases above, not the same bits. */
static void test_many_rows_same_bits(void **state)
{
    (void)state;
    const char *fmts[2] = {"kvarn_k4v2_g128", "kvarn_k4v4_g128"};
    const int dims[2] = {64, 128};
    for (int fi = 0; fi < 2; fi++)
        for (int di = 0; di < 2; di++) {
            attn_case c;
            memset(&c, 0, sizeof c);
            c.fmt = fmts[fi];
            c.D = dims[di];
            c.Hk = 2;
            c.group = 3;
            c.G = 128;
            c.multi = 1;
            c.split = 1;
            c.amx = 1;
            c.n_seqs = 1;
            c.seqs[0].seq_len = 3 * 128; /* 3 records */
            paged_fixture f;
            assert_int_equal(pf_build(&f, c.fmt, c.D, c.Hk, c.G, 0, c.seqs, 1, 1700 + 2 * fi + di), 0);
            /* rows in blocks of 6 and 5 (both packed loops) */
            const int nq = ATTN_PACK_MIN_ROWS / 3 + 2, Hq = c.Hk * c.group;
            const size_t per_q = (size_t)Hq * c.D;
            float *q = malloc(sizeof(float) * nq * per_q), *out = malloc(sizeof(float) * nq * per_q);
            float *one = malloc(sizeof(float) * per_q);
            test_rng rng;
            test_rng_seed(&rng, 1717 + fi * 2 + di);
            for (size_t i = 0; i < nq * per_q; i++) q[i] = (float)(2.0 * test_rng_normal(&rng));
            /* the VNNI build, then the vpmaddwd one (packed K, int16 V) */
            for (int nv = 0; nv < 2; nv++) {
                c.no_vnni = nv;
                int32_t qsl[2] = {0, nq};
                assert_int_equal(run_attn(&f, &c, qsl, q, out, NULL), KVARN_OK);
                qsl[1] = 1;
                for (int i = 0; i < nq; i++) {
                    assert_int_equal(run_attn(&f, &c, qsl, q + i * per_q, one, NULL), KVARN_OK);
                    if (memcmp(one, out + i * per_q, sizeof(float) * per_q) != 0)
                        print_error("%s D=%d no_vnni %d query %d: many-row call differs from the query alone\n",
                                    c.fmt, c.D, nv, i);
                    assert_memory_equal(one, out + i * per_q, sizeof(float) * per_q);
                }
            }
            free(q); free(out); free(one);
            pf_free(&f);
        }
}

/* kvarn_attn_kernel_info_get (attn.h): errors leave *out untouched; the
 * scalar kernels and the AVX2 ones compute in fp32 (the kernel files'
 * contract, which test_attn's cases hold to 1e-5 of the reference); the
 * level follows KVARN_SIMD, the CPU and head_dim as the kernel name does;
 * a KVarN format's staged halves are what the staging's own per-token
 * format reports (fp16 staging: fp32), whatever the level. */
static void test_kernel_info(void **state)
{
    (void)state;
    kvarn_format k42, i8;
    assert_int_equal(kvarn_format_parse("kvarn_k4v2_g128", &k42), KVARN_OK);
    assert_int_equal(kvarn_format_parse("int8", &i8), KVARN_OK);
    kvarn_attn_kernel_info info, pat;
    memset(&pat, 0x5a, sizeof pat);
    info = pat;
    assert_int_equal(kvarn_attn_kernel_info_get(NULL, 64, 0, NULL, &info), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_attn_kernel_info_get(&k42, 64, 0, NULL, NULL), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_attn_kernel_info_get(&k42, 64, 4, NULL, &info), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_attn_kernel_info_get(&k42, 64, -1, NULL, &info), KVARN_ERR_INVALID_ARG);
    kvarn_record_layout L;
    const kvarn_status bad_d = kvarn_record_layout_get(&k42, 2000, &L);
    assert_int_not_equal(bad_d, KVARN_OK);
    assert_int_equal(kvarn_attn_kernel_info_get(&k42, 2000, 0, NULL, &info), bad_d);
    assert_memory_equal(&info, &pat, sizeof info);
    /* staging is read for KVarN formats only */
    assert_int_equal(kvarn_attn_kernel_info_get(&i8, 64, 4, NULL, &info), KVARN_OK);
    assert_int_equal(info.staged_scores, info.scores);
    assert_int_equal(info.staged_sums, info.sums);

    kvarn_attn_opts o = KVARN_ATTN_OPTS_DEFAULT(0.125f);
    kvarn_attn_testing scalar_knob = {0, 1, 0, 0, 0};
    const int dims[] = {64, 128, 256, 512, 48};
    /* the walk below starts from the level the process runs (run_attn
     * puts KVARN_SIMD back; a set_level of an earlier test may not) */
    set_level(g_max_level);
    LEVELS_FOR(it) {
        const int lv = it.index;
        for (int i = 0; i < kvarn_format_count(); i++) {
            kvarn_format fmt;
            assert_int_equal(kvarn_format_parse(kvarn_format_name_at(i), &fmt), KVARN_OK);
            for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++)
                for (int st = KVARN_STAGING_FP16; st <= KVARN_STAGING_INT4; st++) {
                    const int D = dims[di];
                    if (kvarn_record_layout_get(&fmt, D, &L) != KVARN_OK) continue;
                    assert_int_equal(kvarn_attn_kernel_info_get(&fmt, D, st, NULL, &info), KVARN_OK);
                    const int top = lv > g_max_level ? g_max_level : lv;
                    /* at the capped level, or below where D is no multiple
                     * of the level's head_dim multiple (kernel_table.c) */
                    int want = top;
                    while (want > LV_SCALAR && D % attn_level_row_of(want)->head_dim_multiple != 0)
                        want--;
                    assert_string_equal(info.level, levels_names[want]);
                    if (want <= LV_AVX2) {
                        assert_int_equal(info.scores, KVARN_ATTN_ARITH_FP32);
                        assert_int_equal(info.sums, KVARN_ATTN_ARITH_FP32);
                        assert_int_equal(info.staged_scores, KVARN_ATTN_ARITH_FP32);
                        assert_int_equal(info.staged_sums, KVARN_ATTN_ARITH_FP32);
                    }
                    if (fmt.kind == KVARN_KIND_KVARN) {
                        kvarn_format sf;
                        kvarn_attn_kernel_info si;
                        const char *sname[] = {"fp16", "int8", "fp8_e4m3", "int4"};
                        assert_int_equal(kvarn_format_parse(sname[st], &sf), KVARN_OK);
                        assert_int_equal(kvarn_attn_kernel_info_get(&sf, D, 0, NULL, &si), KVARN_OK);
                        /* fp16 staging rows go through the fp16 page kernel */
                        assert_int_equal(info.staged_scores, st == 0 ? KVARN_ATTN_ARITH_FP32 : si.scores);
                        assert_int_equal(info.staged_sums, st == 0 ? KVARN_ATTN_ARITH_FP32 : si.sums);
                    } else {
                        assert_int_equal(info.staged_scores, info.scores);
                        assert_int_equal(info.staged_sums, info.sums);
                    }
                    /* the matrix kernel: KVarN tiles of 32-128 tokens and
                     * the int4, int8, fp8 and bf16 formats' blocks (int8:
                     * two bf16 halves), at head_dim a multiple of 32 up to 512,
                     * where the CPU grants AMX-BF16 at the AVX-512 level
                     * (cpu.h); with it, the staged tokens of int8 and int4
                     * staging */
                    const int fp_fmt = fmt.kind == KVARN_KIND_FP8_E4M3 || fmt.kind == KVARN_KIND_FP8_E5M2 ||
                                       fmt.kind == KVARN_KIND_BF16;
                    const int mat_fmt = (fmt.kind == KVARN_KIND_KVARN || fmt.kind == KVARN_KIND_INT4 ||
                                         fmt.kind == KVARN_KIND_INT8 || fp_fmt) &&
                                        D % 32 == 0 && D <= 512;
                    const kvarn_attn_arith mat_arith =
                        fmt.kind == KVARN_KIND_INT8 ? KVARN_ATTN_ARITH_BF16X2 : KVARN_ATTN_ARITH_BF16;
                    /* the tiles, or their emulation where KVARN_AMX=emulate
                     * asks for it (cpu.h) */
                    const kvarn_cpu_amx amx = kvarn__cpu_amx();
                    const int amx_here = amx != KVARN_CPU_AMX_NONE && mat_fmt;
                    const int staged_mat = fmt.kind == KVARN_KIND_KVARN &&
                                           (st == KVARN_STAGING_INT8 || st == KVARN_STAGING_INT4);
                    /* the fp8 and bf16 formats' blocks through
                     * vdpbf16ps (kernel_avx512_bf16.c) at the AVX-512
                     * level on a CPU with AVX512-BF16, head_dim as the
                     * matrix kernel's, where the tiles do not take them */
                    const int bf16_cpu = fp_fmt && D % 32 == 0 && D <= 512 && want == LV_AVX512 &&
                                         kvarn__cpu_avx512_bf16();
                    const int bf16_here = bf16_cpu && !amx_here;
                    assert_int_equal(info.matrix != NULL, amx_here || bf16_here);
                    assert_int_equal(info.matrix_rows, amx_here || bf16_here ? 16 : 0);
                    if (bf16_here) {
                        assert_string_equal(info.matrix, "avx512-bf16");
                        assert_int_equal(info.matrix_scores, KVARN_ATTN_ARITH_BF16);
                        assert_int_equal(info.matrix_sums, KVARN_ATTN_ARITH_BF16);
                        /* the knob no_bf16: the fp32 kernels */
                        kvarn_attn_testing nb = {0, 0, 0, 0, 1};
                        kvarn_attn_kernel_info ni;
                        o.testing = &nb;
                        assert_int_equal(kvarn_attn_kernel_info_get(&fmt, D, st, &o, &ni), KVARN_OK);
                        assert_null(ni.matrix);
                        assert_int_equal(ni.matrix_rows, 0);
                        o.testing = NULL;
                    }
                    assert_int_equal(info.matrix_staged, amx_here && staged_mat ? 32 : 0);
                    if (amx_here) {
                        assert_string_equal(info.matrix,
                                            amx == KVARN_CPU_AMX_TILES ? "amx-bf16" : "amx-bf16-emulated");
                        assert_int_equal(info.matrix_scores, mat_arith);
                        assert_int_equal(info.matrix_sums, mat_arith);
                    }
                    /* the knob amx: 1 none, 2 emulated (any level) */
                    for (int knob = 1; knob <= 2; knob++) {
                        kvarn_attn_testing ak = {0, 0, 0, knob, 0};
                        o.testing = &ak;
                        assert_int_equal(kvarn_attn_kernel_info_get(&fmt, D, st, &o, &info), KVARN_OK);
                        const int emu = knob == 2 && mat_fmt;
                        assert_int_equal(info.matrix != NULL, emu || bf16_cpu);
                        if (!emu && bf16_cpu) assert_string_equal(info.matrix, "avx512-bf16");
                        assert_int_equal(info.matrix_staged, emu && staged_mat ? 32 : 0);
                        if (emu) {
                            assert_string_equal(info.matrix, "amx-bf16-emulated");
                            assert_int_equal(info.matrix_scores, mat_arith);
                            assert_int_equal(info.matrix_sums, mat_arith);
                        }
                        o.testing = NULL;
                    }
                    /* the force_scalar knob: the reference kernels */
                    o.testing = &scalar_knob;
                    assert_int_equal(kvarn_attn_kernel_info_get(&fmt, D, st, &o, &info), KVARN_OK);
                    assert_string_equal(info.level, "scalar");
                    assert_int_equal(info.scores | info.sums | info.staged_scores | info.staged_sums,
                                     KVARN_ATTN_ARITH_FP32);
                    assert_null(info.matrix);
                    o.testing = NULL;
                }
        }
    }
    /* the k4v2 g128 preset at AVX-512 is the integer kernel's case
     * (docs/attention-intdot.md); where this CPU runs it, both halves say
     * so: int16 scores, and sums with u8 weights where the CPU has
     * AVX512-VNNI (the vpmaddwd build, testing knob no_vnni: int16) */
    LEVELS_FOR(it) {
        if (it.index != LV_AVX512) continue;
        assert_int_equal(kvarn_attn_kernel_info_get(&k42, 64, 0, NULL, &info), KVARN_OK);
        assert_int_equal(info.scores, KVARN_ATTN_ARITH_INT16);
        assert_int_equal(info.sums, kvarn__cpu_avx512_vnni() ? KVARN_ATTN_ARITH_U8 : KVARN_ATTN_ARITH_INT16);
        kvarn_attn_testing no_vnni = {0, 0, 1, 0, 0};
        o.testing = &no_vnni;
        assert_int_equal(kvarn_attn_kernel_info_get(&k42, 64, 0, &o, &info), KVARN_OK);
        assert_int_equal(info.scores, KVARN_ATTN_ARITH_INT16);
        assert_int_equal(info.sums, KVARN_ATTN_ARITH_INT16);
        o.testing = NULL;
    }
}

static void test_kernel_table(void **state)
{
    (void)state;
    assert_null(attn_kind_row_of(KVARN_KIND_COUNT));
    assert_null(attn_level_row_of(ATTN_LEVELS));
    assert_null(attn_level_row_of(-1));
    for (int lv = 0; lv < ATTN_LEVELS; lv++) {
        const attn_level_row *L = attn_level_row_of(lv);
        assert_non_null(L->name);
        assert_non_null(L->fp16_tile);
        assert_true(L->head_dim_multiple >= 1);
    }
    assert_int_equal(attn_level_row_of(KVARN_CPU_SCALAR)->head_dim_multiple, 1);
    assert_string_equal(attn_level_row_of(KVARN_CPU_AVX2)->name, "avx2");
    assert_string_equal(attn_level_row_of(KVARN_CPU_AVX512)->name, "avx512");
    for (int k = 0; k < KVARN_KIND_COUNT; k++) {
        const attn_kind_row *row = attn_kind_row_of((kvarn_kind)k);
        assert_non_null(row);
        assert_int_equal(row->kind, k);
        const int per_tile = kvarn__kind_ops((kvarn_kind)k)->per_tile;
        if (per_tile) assert_non_null(row->record_tile[KVARN_CPU_SCALAR]);
        else assert_non_null(row->token_tile[KVARN_CPU_SCALAR]);
        for (int lv = 0; lv < ATTN_LEVELS; lv++) {
            if (per_tile) assert_null(row->token_tile[lv]);
            else assert_null(row->record_tile[lv]);
        }
        /* every (D, level) selection yields the kernels the kind needs */
        for (int D = 2; D <= 256; D += 2)
            for (int top = 0; top < ATTN_LEVELS; top++) {
                attn_kernels kk;
                int lv = attn_select_kernels((kvarn_kind)k, D, top, &kk);
                assert_true(lv >= 0 && lv <= top);
                assert_int_equal(D % attn_level_row_of(lv)->head_dim_multiple, 0);
                assert_ptr_equal(kk.fp16_tile, attn_level_row_of(lv)->fp16_tile);
                assert_string_equal(kk.name, attn_level_row_of(lv)->name);
                if (per_tile) assert_ptr_equal(kk.kvarn_tile, row->record_tile[lv]);
                else assert_ptr_equal(kk.token_tile, row->token_tile[lv]);
            }
    }
    attn_kernels out;
    assert_int_equal(attn_select_kernels(KVARN_KIND_COUNT, 64, 2, &out), -1);
    /* head_dim caps the level: 48 is a multiple of 16, not of 32; 40 neither */
    const attn_kind_row *i8 = attn_kind_row_of(KVARN_KIND_INT8);
    assert_int_equal(attn_select_kernels_from(i8, 64, KVARN_CPU_AVX512, &out), KVARN_CPU_AVX512);
    assert_int_equal(attn_select_kernels_from(i8, 48, KVARN_CPU_AVX512, &out), KVARN_CPU_AVX2);
    assert_ptr_equal(out.token_tile, attn_avx2_token_int8);
    assert_int_equal(attn_select_kernels_from(i8, 40, KVARN_CPU_AVX512, &out), KVARN_CPU_SCALAR);
    assert_ptr_equal(out.token_tile, attn_ref_token_int8);
    /* a made-up kind with no AVX-512 kernel, and one with only the scalar */
    attn_kind_row partial = {KVARN_KIND_INT8, {attn_ref_token_int8, attn_avx2_token_int8, NULL},
                             {NULL, NULL, NULL}, {NULL, NULL, arith_int16}};
    assert_int_equal(attn_select_kernels_from(&partial, 64, KVARN_CPU_AVX512, &out),
                     KVARN_CPU_AVX512);
    assert_ptr_equal(out.token_tile, attn_avx2_token_int8);
    assert_ptr_equal(out.fp16_tile, attn_avx512_fp16_tile);
    /* the arithmetic is that of the level whose kernel runs (AVX2's: fp32),
     * not the AVX-512 entry's, which has no kernel */
    kvarn_format i8f;
    assert_int_equal(kvarn_format_parse("int8", &i8f), KVARN_OK);
    kvarn_attn_arith sc = KVARN_ATTN_ARITH_INT8, su = KVARN_ATTN_ARITH_INT8;
    attn_select_arith_from(&partial, &i8f, 64, KVARN_CPU_AVX512, 0, &sc, &su);
    assert_int_equal(sc, KVARN_ATTN_ARITH_FP32);
    assert_int_equal(su, KVARN_ATTN_ARITH_FP32);
    partial.token_tile[2] = attn_avx512_token_int8;
    attn_select_arith_from(&partial, &i8f, 64, KVARN_CPU_AVX512, 0, &sc, &su);
    assert_int_equal(sc, KVARN_ATTN_ARITH_INT16);
    assert_int_equal(su, KVARN_ATTN_ARITH_INT16);
    attn_kind_row scalar_only = {KVARN_KIND_KVARN, {NULL, NULL, NULL},
                                 {attn_ref_kvarn_tile, NULL, NULL}, {NULL, NULL, NULL}};
    assert_int_equal(attn_select_kernels_from(&scalar_only, 128, KVARN_CPU_AVX512, &out),
                     KVARN_CPU_AVX512);
    assert_ptr_equal(out.kvarn_tile, attn_ref_kvarn_tile);
    assert_null(out.token_tile);
}

/* The prefetch listing of a record (attn_internal.h, attn_prefetch_base /
 * attn_prefetch_lines): for every start offset inside a 64-byte line and
 * record sizes of the KVarN presets (k4v2 g128 at D 64 and 128, k4v4 g64
 * at D 128) and odd ones, the listed lines cover every byte of the record
 * and at most one line more. (Before, records off the line were listed
 * from their first byte with ceil(bytes / 64) lines: the line holding
 * their last bytes went unfetched for most offsets.) */
static void test_prefetch_lines(void **state)
{
    (void)state;
    size_t sizes[8] = {1, 63, 64, 65, 100, 0, 0, 0};
    const char *names[3] = {"kvarn_k4v2_g128", "kvarn_k4v2_g128", "kvarn_k4v4_g64"};
    const int dims[3] = {64, 128, 128};
    for (int i = 0; i < 3; i++) {
        kvarn_format fmt;
        kvarn_record_layout L;
        assert_int_equal(kvarn_format_parse(names[i], &fmt), KVARN_OK);
        assert_int_equal(kvarn_record_layout_get(&fmt, dims[i], &L), KVARN_OK);
        sizes[5 + i] = L.record_bytes;
    }
    static uint8_t arena[2 * 65536] __attribute__((aligned(64)));
    for (int si = 0; si < 8; si++)
        for (int off = 0; off < 64; off++) {
            const size_t bytes = sizes[si];
            const uint8_t *rec = arena + 64 + off;
            const int aligned = off == 0;
            const uint8_t *base = attn_prefetch_base(rec, aligned);
            const int lines = attn_prefetch_lines(bytes, aligned);
            /* a prefetch of address a fetches line a / 64: the listed
             * addresses base + 64 k, k < lines, fetch lines first..last */
            const uintptr_t b = (uintptr_t)base, r0 = (uintptr_t)rec;
            const uintptr_t first = b / 64, last = (b + (uintptr_t)(lines - 1) * 64) / 64;
            assert_true(first <= r0 / 64);
            assert_true(last >= (r0 + bytes - 1) / 64);
            /* and at most one line more than the record touches (the
             * count is the same for every record of the view), none more
             * when it starts on a line */
            const uintptr_t touched = (r0 + bytes - 1) / 64 - r0 / 64 + 1;
            assert_true(last - first + 1 <= touched + (aligned ? 0 : 1));
        }
}

int main(void)
{
    /* The highest level this CPU runs under any outer KVARN_SIMD cap. */
    g_max_level = levels_top();
    const char *top = levels_names[g_max_level];
    if (strcmp(kvarn_attn_kernel_name(NULL), top) != 0) {
        fprintf(stderr, "attention runs %s, kvarn_simd_level says %s\n", kvarn_attn_kernel_name(NULL), top);
        return 1;
    }
    if (g_max_level < LV_COUNT - 1)
        printf("NOTE: SIMD levels above %s are not available here (CPU or KVARN_SIMD); "
               "the walks stop there, cases that name one run capped at %s\n", top, top);
    /* Two parts of about equal time (release: ~20 s each; ThreadSanitizer:
     * ~165 s each, on Zen 4), run side by side by ctest (test_parts.h). */
    const struct CMUnitTest part1[] = {
        cmocka_unit_test_teardown(test_matrix_kernel, levels_teardown),
        cmocka_unit_test_teardown(test_int8_paths, levels_teardown),
        cmocka_unit_test_teardown(test_extreme_query, levels_teardown),
        cmocka_unit_test_teardown(test_sliding_window, levels_teardown),
        cmocka_unit_test_teardown(test_gqa, levels_teardown),
        cmocka_unit_test_teardown(test_every_format, levels_teardown),
        cmocka_unit_test_teardown(test_odd_head_dim, levels_teardown),
        cmocka_unit_test_teardown(test_empty, levels_teardown),
        cmocka_unit_test_teardown(test_value_weights_u8, levels_teardown),
        cmocka_unit_test_teardown(test_bad_inputs, levels_teardown),
        cmocka_unit_test_teardown(test_kernel_table, levels_teardown),
        cmocka_unit_test_teardown(test_kernel_info, levels_teardown),
        cmocka_unit_test_teardown(test_prefetch_lines, levels_teardown),
    };
    const struct CMUnitTest part2[] = {
        cmocka_unit_test_teardown(test_large_head_dim, levels_teardown),
        cmocka_unit_test_teardown(test_multi_query, levels_teardown),
        cmocka_unit_test_teardown(test_simd_threads, levels_teardown),
        cmocka_unit_test_teardown(test_sink_tokens, levels_teardown),
        cmocka_unit_test_teardown(test_long_chunk, levels_teardown),
        cmocka_unit_test_teardown(test_sink_and_tail, levels_teardown),
        cmocka_unit_test_teardown(test_many_rows_same_bits, levels_teardown),
    };
    const test_part parts[KVARN_TEST_PARTS] = {TEST_PART(part1), TEST_PART(part2)};
    /* e.g. KVARN_TEST_FILTER='test_large*' to run one test while iterating */
    if (getenv("KVARN_TEST_FILTER")) cmocka_set_test_filter(getenv("KVARN_TEST_FILTER"));
    return test_run_parts("test_attn", parts, KVARN_TEST_PARTS);
}
