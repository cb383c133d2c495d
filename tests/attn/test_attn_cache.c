/* test_attn_cache.c -- attention over the views of the real paged cache
 * (include/kvarn/cache.h), so that the cache and the kernels read the
 * layout of include/kvarn/paged.h the same way: sequences written through
 * kvarn_cache_write, partly committed (fp16 sink, quantized middle, fp16
 * tail), decode and multi-query attention against double-precision attention
 * over what kvarn_cache_read returns in the attention basis; then the same
 * bytes in caller-owned, padded arenas give the same outputs bit for bit. */
#define KVARN_EXPERIMENTAL_API /* kvarn_attn_testing: split-K, scalar kernels */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "common/cpu.h"
#include "common/int_dot_bound.h"
#include "common/levels.h"
#include "common/paged_fixture.h"
#include "kvarn/attn.h"
#include "kvarn/cache.h"
#include "kvarn/paged.h"

/* sink_tokens: opts.sink_tokens (0: the default whole sink tile);
 * staging: opts.staging; T: opts.tail_page_tokens; D: head_dim. */
static void check_format_std(const char *name, int sink_tokens, int staging, int T, int D)
{
    const int Hk = 2, group = 3, Hq = Hk * group, L = 2;
    kvarn_cache_opts co = kvarn_cache_default_opts();
    assert_int_equal(kvarn_format_parse(name, &co.format), KVARN_OK);
    co.n_layers = L;
    co.n_kv_heads = Hk;
    co.head_dim = D;
    co.max_seqs = 4;
    co.n_pages = co.format.kind == KVARN_KIND_KVARN ? 16 : 0;
    co.budget_bytes = (size_t)(8u << 20) / 64 * (size_t)D;
    co.sink_tokens = sink_tokens;
    co.staging = staging;
    co.tail_page_tokens = T;
    kvarn_cache *c = NULL;
    assert_int_equal(kvarn_cache_create(&co, &c), KVARN_OK);

    /* Two sequences; the first keeps its last 6 tokens uncommitted (being
     * verified), as speculative decoding leaves them: 6 x the group = 18
     * query rows, an item the matrix kernel takes (ATTN_MATRIX_MIN_ROWS). */
    const int lens[2] = {300, 40}, qls[2] = {6, 1};
    int seq[2];
    test_rng rng;
    test_rng_seed(&rng, 2024);
    paged_fixture ref; /* only the fields pf_ref_attention reads */
    memset(&ref, 0, sizeof ref);
    ref.fmt = co.format;
    ref.D = D;
    ref.Hk = Hk;
    float *kd[2], *vd[2];
    ref.k_deq = kd;
    ref.v_deq = vd;
    for (int s = 0; s < 2; s++) {
        assert_int_equal(kvarn_cache_seq_create(c, &seq[s]), KVARN_OK);
        assert_int_equal(kvarn_cache_reserve(c, seq[s], lens[s]), KVARN_OK);
        size_t n = (size_t)lens[s] * Hk * D;
        float *k = malloc(n * sizeof(float)), *v = malloc(n * sizeof(float));
        for (int l = 0; l < L; l++) {
            for (size_t i = 0; i < n; i++) {
                k[i] = (float)(1.5 * test_rng_normal(&rng));
                v[i] = (float)test_rng_normal(&rng);
            }
            assert_int_equal(kvarn_cache_write(c, seq[s], l, 0, lens[s], k, v), KVARN_OK);
        }
        assert_int_equal(kvarn_cache_commit(c, seq[s], lens[s] - qls[s]), KVARN_OK);
        kd[s] = k;
        vd[s] = v;
        /* what attention sees in layer 1 (rotated basis for KVarN) */
        assert_int_equal(kvarn_cache_read(c, seq[s], 1, 0, lens[s], kd[s], vd[s],
                                          KVARN_DECODE_ROTATED), KVARN_OK);
    }
    kvarn_paged_kv kv;
    kvarn_seq_view views[2];
    assert_int_equal(kvarn_cache_layer_view(c, 1, &kv), KVARN_OK);
    for (int s = 0; s < 2; s++) assert_int_equal(kvarn_cache_seq_view(c, seq[s], &views[s]), KVARN_OK);
    if (co.format.kind == KVARN_KIND_KVARN) assert_true(views[0].committed_tiles > kv.sink_tiles);

    int32_t qsl[3] = {0, qls[0], qls[0] + qls[1]};
    size_t nq = (size_t)qsl[2] * Hq * D;
    float *q = malloc(nq * sizeof(float)), *out = malloc(nq * sizeof(float));
    for (size_t i = 0; i < nq; i++) q[i] = (float)test_rng_normal(&rng);
    kvarn_attn_opts o = KVARN_ATTN_OPTS_DEFAULT(0.125f);
    kvarn_thread_pool *pool = NULL;
    if (test_threads(1) > 1) assert_int_equal(kvarn_thread_pool_create(test_threads(1), &pool), KVARN_OK);
    size_t wsz = kvarn_attn_workspace_bytes(&kv, Hq, 2, qsl[2], kvarn_thread_pool_size(pool), &o);
    void *ws = malloc(wsz);
    /* the library's kernels, then (multi-query) the emulated matrix kernel
     * (testing knob amx = 2), which also reads the staged tokens of int8
     * and int4 staging (kernel_amx.c), on any CPU */
    for (int run = 0; run < 3; run++) {
        const int multi = run > 0, amx = run == 2 ? 2 : 0;
        kvarn_attn_testing knobs = {0, 0, 0, amx, 0};
        o.testing = amx ? &knobs : NULL;
        idb_amx = amx;
        if (amx) {
            kvarn_attn_kernel_info info;
            assert_int_equal(kvarn_attn_kernel_info_get(&kv.fmt, D, kv.staging, &o, &info), KVARN_OK);
            assert_int_equal(info.matrix_staged != 0, co.format.kind == KVARN_KIND_KVARN &&
                                                          (staging == KVARN_STAGING_INT8 ||
                                                           staging == KVARN_STAGING_INT4));
        }
        const int32_t dq[3] = {0, 1, 2};
        const int32_t *starts = multi ? qsl : dq;
        kvarn_status st = multi ? kvarn_attn_multi(&kv, views, 2, qsl, Hq, q, out, &o, pool, ws, wsz)
                                : kvarn_attn_decode(&kv, views, 2, Hq, q, out, &o, pool, ws, wsz);
        assert_int_equal(st, KVARN_OK);
        for (int s = 0; s < 2; s++) {
            int ql = starts[s + 1] - starts[s];
            for (int qi = 0; qi < ql; qi++)
                for (int h = 0; h < Hq; h++) {
                    size_t row = ((size_t)(starts[s] + qi) * Hq + h) * D;
                    double r[1024], mx = 0, err = 0;
                    int pos = lens[s] - ql + qi;
                    pf_ref_attention(&ref, s, h, Hq, q + row, 0.125, 0, pos, 1, r);
                    for (int d = 0; d < D; d++) {
                        mx = fmax(mx, fabs(r[d]));
                        err = fmax(err, fabs(out[row + d] - r[d]));
                    }
                    /* plus the integer dot products' derived error where
                     * the library says a kernel multiplies in integers
                     * (tests/common/int_dot_bound.h: 0 where every half is
                     * fp32); vmax in the original basis from the rotated V:
                     * ||H v / sqrt(D)||_inf <= ||v||_1 / sqrt(D) */
                    const int kvh = h / (Hq / Hk);
                    double vmax = 0.0;
                    for (int t = 0; t <= pos; t++) {
                        double l1 = 0.0;
                        for (int d = 0; d < D; d++) l1 += fabs(vd[s][((size_t)t * Hk + kvh) * D + d]);
                        vmax = fmax(vmax, l1 / sqrt((double)D));
                    }
                    const double ib = attn_int_dot_bound(&kv, &views[s], kvh, q + row, 0.125, 0, pos, vmax);
                    assert_true(err < 1e-4 * mx + ib);
                }
        }
    }

    o.testing = NULL;
    idb_amx = 0;

    /* The same layer copied into arenas the caller owns, shaped as a vLLM
     * plug-in hands them over (include/kvarn/paged.h): records
     * [n_blocks][Hk][record_stride + 64 bytes], 128 more bytes after each
     * block; fp16 pages [n_pages][Hk][K+V tile + 32 bytes], 64 more after each
     * page; padding 0xff (NaN in fp16), so reading it would show. Same bytes,
     * same kernels, same order of operations: only the addresses differ, so
     * the outputs must be equal bit for bit. */
    kvarn_paged_kv own = kv;
    own.record_stride = kv.record_stride + 64;
    own.block_stride = (size_t)Hk * own.record_stride + 128;
    own.page_head_stride = kvarn_paged_staging_bytes(&kv, kv.block_size) + 32;
    own.page_stride = (size_t)Hk * own.page_head_stride + 64;
    uint8_t *blocks = malloc((size_t)kv.n_blocks * own.block_stride);
    uint16_t *pages = malloc((size_t)kv.n_fp16_pages * own.page_stride + 2);
    memset(blocks, 0xff, (size_t)kv.n_blocks * own.block_stride);
    memset(pages, 0xff, (size_t)kv.n_fp16_pages * own.page_stride + 2);
    own.blocks = blocks;
    own.fp16_pages = kv.fp16_pages ? pages : NULL;
    for (int id = 0; id < kv.n_blocks; id++)
        for (int h = 0; h < Hk; h++)
            memcpy(kvarn_paged_record(&own, id, h), kvarn_paged_record(&kv, id, h), kv.record_stride);
    for (int id = 0; kv.fp16_pages && id < kv.n_fp16_pages; id++)
        for (int h = 0; h < Hk; h++)
            memcpy(kvarn_paged_page_k(&own, id, h), kvarn_paged_page_k(&kv, id, h),
                   kvarn_paged_staging_bytes(&kv, kv.block_size));
    uint16_t *sinks = NULL;
    if (kv.sink_partial > 0) {
        /* sink slots [n_slots][Hk][K+V r x D + 16 bytes], 32 more after each */
        const size_t sb = kvarn_paged_staging_bytes(&kv, kv.sink_partial);
        own.sink_head_stride = sb + 16;
        own.sink_stride = (size_t)Hk * own.sink_head_stride + 32;
        sinks = malloc((size_t)kv.n_sink_slots * own.sink_stride);
        memset(sinks, 0xff, (size_t)kv.n_sink_slots * own.sink_stride);
        own.fp16_sinks = sinks;
        for (int id = 0; id < kv.n_sink_slots; id++)
            for (int h = 0; h < Hk; h++)
                memcpy(kvarn_paged_sink_k(&own, id, h), kvarn_paged_sink_k(&kv, id, h), sb);
    }
    float *out2 = malloc(nq * sizeof(float));
    assert_int_equal(kvarn_attn_multi(&kv, views, 2, qsl, Hq, q, out, &o, pool, ws, wsz), KVARN_OK);
    assert_int_equal(kvarn_attn_multi(&own, views, 2, qsl, Hq, q, out2, &o, pool, ws, wsz), KVARN_OK);
    assert_memory_equal(out, out2, nq * sizeof(float));
    free(out2); free(blocks); free(pages); free(sinks);

    free(ws); free(q); free(out);
    for (int s = 0; s < 2; s++) { free(kd[s]); free(vd[s]); }
    kvarn_cache_destroy(c);
}

static void check_format_st(const char *name, int sink_tokens, int staging, int T)
{
    check_format_std(name, sink_tokens, staging, T, 64);
}

static void check_format_s(const char *name, int sink_tokens)
{
    check_format_st(name, sink_tokens, KVARN_STAGING_FP16, 0);
}

static void check_format(const char *name)
{
    check_format_s(name, 0);
}

/* Staged tokens as records of each record staging's per-token format
 * (cache.h staging: int8, fp8_e4m3, int4): that format's token kernels
 * read the sink tiles, the tail (whole pages and small pages of 16) and
 * the sink slots, against kvarn_cache_read's decoded values (with the
 * AVX-512 int8 kernel's derived bound for int8 and int4, whose codes it
 * takes widened, tests/common/int_dot_bound.h; the fp8 kernels compute
 * in fp32), and the same
 * bytes in padded caller-owned arenas give the same outputs. */
static void test_cache_staging(void **state)
{
    (void)state;
    const char *fmts[] = {"kvarn_k4v2_g128", "kvarn_k4v2_g64", "kvarn_k4v4_g128"};
    const int stagings[] = {KVARN_STAGING_INT8, KVARN_STAGING_FP8_E4M3, KVARN_STAGING_INT4};
    for (int si = 0; si < 3; si++)
        for (int f = 0; f < 3; f++) {
            const int st = stagings[si];
            check_format_st(fmts[f], 0, st, 0);   /* whole sink tile */
            check_format_st(fmts[f], 16, st, 0);  /* 16-token sink slot */
            check_format_st(fmts[f], 69, st, 16); /* tile + 5, small pages */
        }
}

static void test_cache_kvarn(void **state)
{
    (void)state;
    check_format("kvarn_k4v2_g64");
    check_format("kvarn_k4v4_g128");
    check_format("kvarn_k4v2_g128c"); /* mean-centred records */
    /* head_dim 512 (Gemma-4's global layers): fp16 and int8 staging, the
     * whole sink tile and a tile + 5 sink with small tail pages */
    check_format_std("kvarn_k4v2_g128", 0, KVARN_STAGING_FP16, 0, 512);
    check_format_std("kvarn_k4v2_g128", 69, KVARN_STAGING_INT8, 16, 512);
}

/* Sinks shorter than a tile through the cache: the slot the commit fills
 * is what attention reads (against kvarn_cache_read), and the same bytes in
 * caller-owned padded slots give the same outputs. */
static void test_cache_sink_tokens(void **state)
{
    (void)state;
    const int S[] = {4, 16, 32, 64 + 5};
    for (int i = 0; i < 4; i++) {
        check_format_s("kvarn_k4v2_g64", S[i]);
        check_format_s("kvarn_k4v4_g128", S[i]);
    }
}

/* The matrix kernel over per-token records (kernel_amx.c token_tile: a
 * KVarN view's int8 and int4 staging, the int4 format's blocks; and
 * token_tile_x2: the int8 format's blocks), against a
 * double-precision oracle of its own arithmetic, so that its bound is
 * tight: a KVarN cache whose sequence (100 tokens) lies wholly in its
 * staged sink tile, 32 queries x a GQA group of 3 = 96 rows (an item the
 * matrix kernel takes, its staged tokens too:
 * ATTN_STAGED_MATRIX_MIN_QUERIES), or an int4 or int8 cache of 300 tokens
 * (three spans, each a softmax step), 30 queries (90 rows). In the
 * kernel's basis (rotated for KVarN) it computes
 *   s_t = ks_t sum_d bf16(q'_d) c'_td + (kz_t + C ks_t) sum_d q'_d
 *   o_d = (sum_t bf16(p_t vs_t) c'_td + sum_t p_t (vz_t + C vs_t)) / l
 * (c' = code - C, C = 2^(bits - 1)); the oracle computes the same in
 * double with the weights unrounded, and allows per channel (attn.h
 * KVARN_ATTN_ARITH_BF16) 2^-8 sum_t p_t |vs_t| |c'_td| / l, plus a score
 * allowance for channels near a bf16 rounding boundary (idb_bf16_err) and
 * the fp32 sums, and 1e-5 of the row's largest |o| for the fp32 of the
 * rest (the queries' rotation, the inverse rotation of the output; the
 * real tiles' 2^x: the degree-3 fit's 7.5e-5 lies within the weights'
 * 2^-8, the degree-5 fit's 2.2e-7 within this). The int8 format's
 * two bf16 halves (KVARN_ATTN_ARITH_BF16X2): 2^-16 of each query element
 * and each weight in place of 2^-8 and the near-tie allowance. Run
 * emulated (testing knob amx = 2) on every CPU, and on the AMX tiles where
 * the CPU grants them. The fp8 and bf16 formats' blocks (token_tile_fp8_*,
 * _bf16) the same way with their codes' values for c' and no zero points
 * (C = 0, kz = vz = 0), and with the tiles off (amx = 1) through their
 * AVX512-BF16 kernel (kernel_avx512_bf16.c, the same statement) where the
 * library reports it. Faults tried by hand: a V token pair swapped, V's
 * zero point off by one step: both fail this (not the looser bound of
 * test_cache_staging). */
static void check_token_matrix(const char *fmt, int staging, int amx)
{
    kvarn_cache_opts co = kvarn_cache_default_opts();
    assert_int_equal(kvarn_format_parse(fmt, &co.format), KVARN_OK);
    const int kvarn = co.format.kind == KVARN_KIND_KVARN;
    /* KVarN: within its staged sink tile; per-token formats: 300 tokens,
     * spans of 128, 128 and 44 (a last span narrower than the scores'
     * stride), and 30 x 3 = 90 rows (a last block of 10 rows) */
    const int Hk = 2, group = 3, Hq = Hk * group, D = 64, len = kvarn ? 100 : 300, ql = kvarn ? 32 : 30;
    co.n_layers = 1;
    co.n_kv_heads = Hk;
    co.head_dim = D;
    co.max_seqs = 2;
    co.n_pages = kvarn ? 8 : 0;
    co.budget_bytes = (size_t)8u << 20;
    co.staging = staging;
    kvarn_cache *c = NULL;
    assert_int_equal(kvarn_cache_create(&co, &c), KVARN_OK);
    int seq;
    assert_int_equal(kvarn_cache_seq_create(c, &seq), KVARN_OK);
    assert_int_equal(kvarn_cache_reserve(c, seq, len), KVARN_OK);
    test_rng rng;
    test_rng_seed(&rng, 77 + (uint64_t)staging);
    const size_t n = (size_t)len * Hk * D;
    float *k = malloc(n * sizeof(float)), *v = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        k[i] = (float)(1.5 * test_rng_normal(&rng) + 0.3);
        v[i] = (float)test_rng_normal(&rng);
    }
    assert_int_equal(kvarn_cache_write(c, seq, 0, 0, len, k, v), KVARN_OK);
    assert_int_equal(kvarn_cache_commit(c, seq, len - ql), KVARN_OK);
    kvarn_paged_kv kv;
    kvarn_seq_view view;
    assert_int_equal(kvarn_cache_layer_view(c, 0, &kv), KVARN_OK);
    assert_int_equal(kvarn_cache_seq_view(c, seq, &view), KVARN_OK);
    /* every token staged: its record read below (idb_staged_rec) */

    int32_t qsl[2] = {0, ql};
    const size_t nq = (size_t)ql * Hq * D;
    float *q = malloc(nq * sizeof(float)), *out = malloc(nq * sizeof(float));
    for (size_t i = 0; i < nq; i++) q[i] = (float)test_rng_normal(&rng);
    const double scale = 0.125;
    kvarn_attn_opts o = KVARN_ATTN_OPTS_DEFAULT((float)scale);
    kvarn_attn_testing knobs = {0, 0, 0, amx, 0};
    o.testing = &knobs;
    kvarn_attn_kernel_info info;
    assert_int_equal(kvarn_attn_kernel_info_get(&kv.fmt, D, kv.staging, &o, &info), KVARN_OK);
    /* the fp8 and bf16 formats: codes exact in bf16, no zero points */
    const kvarn_kind fk = co.format.kind;
    const int fp = fk == KVARN_KIND_FP8_E4M3 || fk == KVARN_KIND_FP8_E5M2 || fk == KVARN_KIND_BF16;
    if (fp && amx == 1 && info.matrix == NULL) {
        /* no AVX512-BF16 kernel on this CPU or level */
        print_message("%s, amx off: no matrix kernel here (%s level): skipped\n", fmt, info.level);
        kvarn_cache_destroy(c);
        free(k); free(v); free(q); free(out);
        return;
    }
    assert_int_equal(kvarn ? info.matrix_staged : info.matrix_rows, kvarn ? ql : 16);
    size_t wsz = kvarn_attn_workspace_bytes(&kv, Hq, 1, ql, 1, &o);
    void *ws = malloc(wsz);
    assert_int_equal(kvarn_attn_multi(&kv, &view, 1, qsl, Hq, q, out, &o, NULL, ws, wsz), KVARN_OK);

    kvarn_format sf;
    kvarn_record_layout L;
    const int x2 = co.format.kind == KVARN_KIND_INT8; /* the int8 format's blocks */
    const int bits = (kvarn && staging == KVARN_STAGING_INT8) || x2 ? 8 : 4;
    assert_int_equal(info.matrix_scores, x2 ? KVARN_ATTN_ARITH_BF16X2 : KVARN_ATTN_ARITH_BF16);
    if (fp) sf = co.format;
    else assert_int_equal(kvarn_format_parse(bits == 8 ? "int8" : "int4", &sf), KVARN_OK);
    /* the staged tokens of the KVarN view, or the int4 and int8 formats'
     * blocks */
    const idb_rec_fn rec_of = kvarn ? idb_staged_rec : idb_block_rec;
    assert_int_equal(kvarn_record_layout_get(&sf, D, &L), KVARN_OK);
    const double cen = fp ? 0.0 : (double)(1 << (bits - 1)), lg = log2((double)D) + 3.0;
    double worst = 0.0;
    for (int qi = 0; qi < ql; qi++)
        for (int head = 0; head < Hq; head++) {
            const int h = head / group, pos = len - ql + qi;
            const float *qq = q + ((size_t)qi * Hq + head) * D;
            double qp[64], e[64], w[64], q1 = 0.0, qraw1 = 0.0, qs = 0.0;
            for (int d = 0; d < D; d++) {
                qp[d] = qq[d] * scale;
                qraw1 += fabs((double)qq[d]);
            }
            if (kvarn) pf_hadamard_d(qp, D);
            for (int d = 0; d < D; d++) {
                q1 += fabs(qp[d]);
                qs += qp[d];
                const double ea = scale * lg * 0x1p-24 * qraw1 / sqrt((double)D) + fabs(qp[d]) * 0x1p-23;
                if (x2) { /* two bf16 halves: 2^-16 of the fp32 value, the low half's flush */
                    e[d] = 0.0;
                    w[d] = ea + 0x1p-16 * (fabs(qp[d]) + ea) + 0x1p-126;
                } else {
                    idb_bf16_err(qp[d], ea, &e[d], &w[d]);
                }
            }
            double sc[300], dl[300], m = -INFINITY;
            for (int t = 0; t <= pos; t++) {
                const uint8_t *rec = rec_of(&kv, &view, h, t);
                assert_non_null(rec);
                const double ks = L.k_a_bytes ? idb_half(rec + L.k_a_off, 0) : 1.0,
                             kz = L.k_b_bytes ? idb_half(rec + L.k_b_off, 0) : 0.0;
                double dot = 0.0, wc = 0.0, mag = 0.0;
                for (int d = 0; d < D; d++) {
                    const double ck = fp ? idb_fcode(fk, rec + L.k_codes_off, d)
                                         : (double)idb_code(rec + L.k_codes_off, d, bits) - cen;
                    dot += (qp[d] + e[d]) * ck;
                    wc += w[d] * fabs(ck);
                    mag += (fabs(qp[d] + e[d]) + w[d]) * fabs(ck);
                }
                sc[t] = ks * dot + (kz + cen * ks) * qs;
                /* near-tie channels, the tiles' fp32 sums, the zero point's
                 * and the score's fp32 */
                dl[t] = fabs(ks) * (wc + (x2 ? 2 : 1) * D * 0x1p-24 * mag) + 0x1p-22 * (fabs(kz) + cen * fabs(ks)) * q1 +
                        0x1p-22 * fabs(sc[t]);
                m = fmax(m, sc[t]);
            }
            double l = 0.0, ref[64], ev[64], p[300], dmax = 0.0, vmax = 0.0;
            for (int d = 0; d < D; d++) ref[d] = ev[d] = 0.0;
            for (int t = 0; t <= pos; t++) {
                p[t] = exp(sc[t] - m);
                l += p[t];
                dmax = fmax(dmax, dl[t]);
            }
            for (int t = 0; t <= pos; t++) {
                const uint8_t *rec = rec_of(&kv, &view, h, t);
                const double vs = L.v_a_bytes ? idb_half(rec + L.v_a_off, 0) : 1.0,
                             vz = L.v_b_bytes ? idb_half(rec + L.v_b_off, 0) : 0.0;
                for (int d = 0; d < D; d++) {
                    const double cv = fp ? idb_fcode(fk, rec + L.v_codes_off, d)
                                         : (double)idb_code(rec + L.v_codes_off, d, bits) - cen;
                    const double x = vs * cv + vz + cen * vs;
                    ref[d] += p[t] / l * x;
                    ev[d] += x2 ? (0x1p-16 * p[t] * fabs(vs) + 0x1p-126) / l * fabs(cv) + 0x1p-24 * p[t] / l * fabs(cv * vs)
                                : 0x1p-8 * p[t] / l * (fabs(vs) * fabs(cv) + 0x1p-126);
                    vmax = fmax(vmax, fabs(x));
                }
            }
            /* the output back in the rotated basis (KVarN) */
            double got[64], omax = 0.0;
            const float *oo = out + ((size_t)qi * Hq + head) * D;
            for (int d = 0; d < D; d++) {
                got[d] = oo[d];
                omax = fmax(omax, fabs((double)oo[d]));
            }
            if (kvarn) pf_hadamard_d(got, D);
            for (int d = 0; d < D; d++) {
                const double bound = ev[d] + (exp(2.0 * dmax) - 1.0) * vmax + 1e-5 * omax;
                const double err = fabs(got[d] - ref[d]);
                worst = fmax(worst, err / bound);
                assert_true(err <= bound);
            }
        }
    print_message("%s%s, matrix %s: error / bound %.3f\n", fmt,
                  kvarn ? (bits == 8 ? " staging int8" : " staging int4") : "", info.matrix, worst);
    assert_true(worst > 0.0);
    free(ws); free(q); free(out); free(k); free(v);
    kvarn_cache_destroy(c);
}

static void test_staged_matrix(void **state)
{
    (void)state;
    const char *fmts[] = {"kvarn_k4v2_g128", "kvarn_k4v2_g128", "int4", "int8", "fp8_e4m3", "fp8_e5m2", "bf16"};
    const int stagings[] = {KVARN_STAGING_INT8, KVARN_STAGING_INT4, KVARN_STAGING_FP16, KVARN_STAGING_FP16,
                            KVARN_STAGING_FP16, KVARN_STAGING_FP16, KVARN_STAGING_FP16};
    for (int i = 0; i < 7; i++) {
        check_token_matrix(fmts[i], stagings[i], 2);
        if (kvarn__cpu_amx() == KVARN_CPU_AMX_TILES) check_token_matrix(fmts[i], stagings[i], 0);
        else if (i == 0) print_message("AMX tiles: skipped: no AMX (emulated only)\n");
        /* the fp8 and bf16 formats without the tiles: their AVX512-BF16
         * kernel (the same statement), where the CPU has it */
        if (i >= 4) check_token_matrix(fmts[i], stagings[i], 1);
    }
}

static void test_cache_per_token(void **state)
{
    (void)state;
    check_format("int8");
    check_format("fp8_e4m3");
    check_format("int4");
}

/* ---------------------------------------------------- small tail pages */

/* Two caches fed the same K/V through the same calls, one with whole tail
 * pages (tail_page_tokens 0), one with tail pages of 16 tokens. Sequence 0
 * gets `tail` uncommitted tokens after its sink and 2 committed tiles,
 * sequence 1 a tail of tail2; their reserves interleave a few tokens at a
 * time so the small page ids of the two tails alternate. */
typedef struct tail_pair {
    kvarn_cache *c[2];
    int seq[2][2];
    int lens[2], qls[2];
} tail_pair;

static void tail_pair_make(tail_pair *tp, const char *fmt, int D, int Hk, int tail, int tail2)
{
    const int L = 2;
    kvarn_format f;
    assert_int_equal(kvarn_format_parse(fmt, &f), KVARN_OK);
    const int G = f.tile_tokens, T = 16;
    tp->lens[0] = G + 2 * G + tail; /* sink, two committed tiles, the tail */
    tp->lens[1] = G + tail2;
    tp->qls[0] = tail < 3 ? tail : 3;
    tp->qls[1] = 1;
    test_rng rng;
    test_rng_seed(&rng, 77);
    const size_t row = (size_t)Hk * D;
    float *k[2], *v[2];
    for (int s = 0; s < 2; s++) {
        size_t n = (size_t)tp->lens[s] * row * L;
        k[s] = malloc(n * sizeof(float));
        v[s] = malloc(n * sizeof(float));
        for (size_t i = 0; i < n; i++) {
            k[s][i] = (float)(1.5 * test_rng_normal(&rng));
            v[s][i] = (float)test_rng_normal(&rng);
        }
    }
    for (int m = 0; m < 2; m++) {
        kvarn_cache_opts co = kvarn_cache_default_opts();
        co.format = f;
        co.n_layers = L;
        co.n_kv_heads = Hk;
        co.head_dim = D;
        co.max_seqs = 4;
        co.budget_bytes = 16u << 20;
        co.tail_page_tokens = m ? T : 0;
        kvarn_cache *c = NULL;
        assert_int_equal(kvarn_cache_create(&co, &c), KVARN_OK);
        for (int s = 0; s < 2; s++) assert_int_equal(kvarn_cache_seq_create(c, &tp->seq[m][s]), KVARN_OK);
        int len[2] = {0, 0};
        /* interleaved growth: 7 tokens of one, then 5 of the other */
        while (len[0] < tp->lens[0] || len[1] < tp->lens[1]) {
            for (int s = 0; s < 2; s++) {
                int n = s ? 5 : 7;
                if (n > tp->lens[s] - len[s]) n = tp->lens[s] - len[s];
                if (n == 0) continue;
                const int id = tp->seq[m][s];
                assert_int_equal(kvarn_cache_reserve(c, id, n), KVARN_OK);
                for (int l = 0; l < L; l++)
                    assert_int_equal(kvarn_cache_write(c, id, l, len[s], n,
                                                       k[s] + ((size_t)l * tp->lens[s] + len[s]) * row,
                                                       v[s] + ((size_t)l * tp->lens[s] + len[s]) * row),
                                     KVARN_OK);
                len[s] += n;
                /* sequence 0 commits all but its tail, sequence 1 nothing
                 * past its sink: its tail is all it has */
                const int keep = s ? tail2 : tail;
                if (len[s] > keep) assert_int_equal(kvarn_cache_commit(c, id, len[s] - keep), KVARN_OK);
            }
        }
        tp->c[m] = c;
    }
    for (int s = 0; s < 2; s++) { free(k[s]); free(v[s]); }
}

static void tail_pair_free(tail_pair *tp)
{
    for (int m = 0; m < 2; m++) kvarn_cache_destroy(tp->c[m]);
}

/* Attention (decode, then multi-query) over one layer of cache m. */
static void tail_attn(const tail_pair *tp, int m, int multi, int Hq, int split, int scalar,
                      const float *q, float *out)
{
    kvarn_paged_kv kv;
    kvarn_seq_view views[2];
    assert_int_equal(kvarn_cache_layer_view(tp->c[m], 1, &kv), KVARN_OK);
    for (int s = 0; s < 2; s++)
        assert_int_equal(kvarn_cache_seq_view(tp->c[m], tp->seq[m][s], &views[s]), KVARN_OK);
    assert_int_equal(kvarn_paged_small_tail(&kv), m);
    kvarn_attn_testing knobs = {split, scalar, 0, 0, 0};
    kvarn_attn_opts o = KVARN_ATTN_OPTS_DEFAULT(0.125f);
    o.testing = &knobs;
    int32_t qsl[3] = {0, tp->qls[0], tp->qls[0] + tp->qls[1]};
    kvarn_thread_pool *pool = NULL;
    if (test_threads(2) > 1) assert_int_equal(kvarn_thread_pool_create(test_threads(2), &pool), KVARN_OK);
    size_t wsz = kvarn_attn_workspace_bytes(&kv, Hq, 2, qsl[2], kvarn_thread_pool_size(pool), &o);
    void *ws = malloc(wsz);
    kvarn_status st = multi ? kvarn_attn_multi(&kv, views, 2, qsl, Hq, q, out, &o, pool, ws, wsz)
                            : kvarn_attn_decode(&kv, views, 2, Hq, q, out, &o, pool, ws, wsz);
    assert_int_equal(st, KVARN_OK);
    free(ws);
    kvarn_thread_pool_destroy(pool);
}

/* Attention over small tail pages equals attention over whole tail pages
 * holding the same rows, bit for bit: the committed records are the same
 * bytes (commit gathers the same fp16 rows), and the tile walk gathers a
 * small-page tail tile's rows in token order and makes the same kernel
 * call, so nothing in the arithmetic differs. Every kernel level this CPU
 * runs (the walk of tests/common/levels.h: KVARN_SIMD set per pass;
 * scalar also through the force_scalar knob), GQA (3 query heads per KV head), decode and
 * multi-query, unsplit and split-K, tails of 1, 15, 16, 17, 127 tokens and
 * one of two tiles (200 tokens, a commit lag). */
static void test_small_tail_pages(void **state)
{
    (void)state;
    const int tails[] = {1, 15, 16, 17, 127, 200};
    const struct { const char *fmt; int D; } cases[] = {{"kvarn_k4v2_g128", 64},
                                                        {"kvarn_k4v4_g64", 128}};
    const int Hk = 2, Hq = 6;
    for (size_t ci = 0; ci < 2; ci++)
        for (size_t ti = 0; ti < sizeof tails / sizeof tails[0]; ti++) {
            tail_pair tp;
            const int G = cases[ci].fmt[12] == '1' ? 128 : 64;
            const int tail = tails[ti] < 2 * G ? tails[ti] : G + 1;
            tail_pair_make(&tp, cases[ci].fmt, cases[ci].D, Hk, tail, tails[(ti + 2) % 6] % G);
            const size_t nq = (size_t)(tp.qls[0] + tp.qls[1]) * Hq * cases[ci].D;
            float *q = malloc(nq * sizeof(float)), *o0 = malloc(nq * sizeof(float)),
                  *o1 = malloc(nq * sizeof(float));
            test_rng rng;
            test_rng_seed(&rng, 5 + ti);
            for (size_t i = 0; i < nq; i++) q[i] = (float)test_rng_normal(&rng);
            LEVELS_FOR(lv) {
                for (int multi = 0; multi < 2; multi++)
                    for (int split = 1; split <= 3; split += 2) {
                        const size_t n = multi ? nq : (size_t)2 * Hq * cases[ci].D;
                        memset(o0, 0, nq * sizeof(float));
                        memset(o1, 0xff, nq * sizeof(float));
                        tail_attn(&tp, 0, multi, Hq, split, lv.index == 0, q, o0);
                        tail_attn(&tp, 1, multi, Hq, split, lv.index == 0, q, o1);
                        assert_memory_equal(o0, o1, n * sizeof(float));
                    }
            }
            free(q); free(o0); free(o1);
            tail_pair_free(&tp);
        }
}

/* check_seq validates every small tail page id the tail needs: one out of
 * range, negative, or a missing array is refused, not followed. */
static void test_small_tail_bad_ids(void **state)
{
    (void)state;
    tail_pair tp;
    tail_pair_make(&tp, "kvarn_k4v2_g128", 64, 2, 17, 40);
    kvarn_paged_kv kv;
    kvarn_seq_view views[2];
    assert_int_equal(kvarn_cache_layer_view(tp.c[1], 0, &kv), KVARN_OK);
    for (int s = 0; s < 2; s++)
        assert_int_equal(kvarn_cache_seq_view(tp.c[1], tp.seq[1][s], &views[s]), KVARN_OK);
    const int Hq = 6, D = 64;
    float q[2 * 6 * 64] = {0}, out[2 * 6 * 64];
    kvarn_attn_opts o = KVARN_ATTN_OPTS_DEFAULT(0.125f);
    size_t wsz = kvarn_attn_workspace_bytes(&kv, Hq, 2, 2, 1, &o);
    void *ws = malloc(wsz);
    assert_int_equal(kvarn_attn_decode(&kv, views, 2, Hq, q, out, &o, NULL, ws, wsz), KVARN_OK);
    /* sequence 0's tail: 17 tokens, two small pages; sequence 1: 40, three */
    int32_t ids[3];
    memcpy(ids, views[1].tail_pages, sizeof ids);
    const int32_t bad[3] = {-1, kv.n_tail_pages, INT32_MAX};
    for (int j = 0; j < 3; j++)
        for (int b = 0; b < 3; b++) {
            int32_t t[3];
            memcpy(t, ids, sizeof t);
            t[j] = bad[b];
            kvarn_seq_view sv[2] = {views[0], views[1]};
            sv[1].tail_pages = t;
            assert_int_equal(kvarn_attn_decode(&kv, sv, 2, Hq, q, out, &o, NULL, ws, wsz),
                             KVARN_ERR_INVALID_ARG);
        }
    kvarn_seq_view sv[2] = {views[0], views[1]};
    sv[0].tail_pages = NULL;
    assert_int_equal(kvarn_attn_decode(&kv, sv, 2, Hq, q, out, &o, NULL, ws, wsz),
                     KVARN_ERR_INVALID_ARG);
    /* a view whose T does not divide G, or exceeds it */
    kvarn_paged_kv k2 = kv;
    k2.tail_page_tokens = 24;
    assert_int_equal(kvarn_attn_decode(&k2, views, 2, Hq, q, out, &o, NULL, ws, wsz),
                     KVARN_ERR_INVALID_ARG);
    k2.tail_page_tokens = 256;
    assert_int_equal(kvarn_attn_decode(&k2, views, 2, Hq, q, out, &o, NULL, ws, wsz),
                     KVARN_ERR_INVALID_ARG);
    /* a workspace sized for the whole-page view is too small here (the
     * gathered tail tile): refused, not overrun */
    kvarn_paged_kv whole;
    assert_int_equal(kvarn_cache_layer_view(tp.c[0], 0, &whole), KVARN_OK);
    size_t w0 = kvarn_attn_workspace_bytes(&whole, Hq, 2, 2, 1, &o);
    assert_true(w0 < wsz);
    assert_int_not_equal(kvarn_attn_decode(&kv, views, 2, Hq, q, out, &o, NULL, ws, w0), KVARN_OK);
    free(ws);
    (void)D;
    tail_pair_free(&tp);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cache_kvarn),
        cmocka_unit_test(test_cache_staging),
        cmocka_unit_test(test_cache_sink_tokens),
        cmocka_unit_test(test_cache_per_token),
        cmocka_unit_test(test_staged_matrix),
        cmocka_unit_test_teardown(test_small_tail_pages, levels_teardown),
        cmocka_unit_test(test_small_tail_bad_ids),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
