/* test_cache_staging.c -- staged KVarN tokens held as token records of a
 * per-token format (kvarn_cache_opts.staging = KVARN_STAGING_INT8,
 * _FP8_E4M3, _INT4; include/kvarn/paged.h "Staging"), every test run for
 * each of them: what a staged token reads back as, what commit encodes,
 * rollback and fork within staged tokens, and the sink slot. The oracle is
 * the codec applied by hand: rotate with kvarn_hadamard, kvarn_encode /
 * kvarn_decode of the staging's per-token format, kvarn_encode(prerotated
 * = 1) of the decoded tile. Attention over such caches:
 * tests/attn/test_attn_cache.c.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "codec/hadamard.h"
#include "common/testutil.h"
#include "kvarn/cache.h"
#include "kvarn/kvarn.h"

enum { L = 2, HK = 2, D = 64 };

/* The record stagings, their per-token formats and record bytes at D
 * (include/kvarn/record.h: a * D + b per token-head). */
typedef struct staging_case {
    int staging;
    const char *fmt;
    size_t a, b;
} staging_case;
static const staging_case k_cases[] = {
    {KVARN_STAGING_INT8, "int8", 2, 8},
    {KVARN_STAGING_FP8_E4M3, "fp8_e4m3", 2, 4},
    {KVARN_STAGING_INT4, "int4", 1, 8},
};
#define N_CASES (int)(sizeof k_cases / sizeof k_cases[0])

static kvarn_cache *make(const staging_case *sc, const char *fmt, int sink_tokens, int T)
{
    kvarn_cache_opts o = kvarn_cache_default_opts();
    assert_int_equal(kvarn_format_parse(fmt, &o.format), KVARN_OK);
    o.n_layers = L;
    o.n_kv_heads = HK;
    o.head_dim = D;
    o.max_seqs = 4;
    o.n_pages = 24;
    o.budget_bytes = 8u << 20;
    o.sink_tokens = sink_tokens;
    o.tail_page_tokens = T;
    o.staging = sc->staging;
    kvarn_cache *c = NULL;
    assert_int_equal(kvarn_cache_create(&o, &c), KVARN_OK);
    return c;
}

/* k, v: fp32 [L][n][HK][D], normal with a per-channel spread */
static void fill(test_rng *r, float *k, float *v, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        k[i] = (float)(1.5 * test_rng_normal(r)) + (float)(i % D == 3 ? 6.0 : 0.0);
        v[i] = (float)test_rng_normal(r);
    }
}

static void write_all(kvarn_cache *c, int seq, int pos, int n, int len, const float *k,
                      const float *v)
{
    const size_t row = (size_t)HK * D;
    for (int l = 0; l < L; l++)
        assert_int_equal(kvarn_cache_write(c, seq, l, pos, n, k + ((size_t)l * len + pos) * row,
                                           v + ((size_t)l * len + pos) * row),
                         KVARN_OK);
}

/* The staging's codec applied by hand to one rotated token-head: *kq, *vq;
 * its record is a * D + b bytes (record.h). */
static void by_hand(const staging_case *sc, const float *k, const float *v, float *kq, float *vq)
{
    kvarn_format f;
    assert_int_equal(kvarn_format_parse(sc->fmt, &f), KVARN_OK);
    float kr[D], vr[D];
    memcpy(kr, k, sizeof kr);
    memcpy(vr, v, sizeof vr);
    kvarn_hadamard(kr, D);
    kvarn_hadamard(vr, D);
    unsigned char rec[4 * D];
    const size_t rb = kvarn_record_bytes(&f, D);
    assert_int_equal(rb, sc->a * D + sc->b);
    assert_int_equal(kvarn_encode(&f, D, kr, vr, rec, rb, NULL, 0, NULL), KVARN_OK);
    assert_int_equal(kvarn_decode(&f, D, rec, rb, kq, vq, 0), KVARN_OK);
}

/* The step bound of the staging's codec on one rotated row x against what
 * it reads back as (src/codec/per_token.c's rules):
 *   int8 / int4 (qmax = 2^bits - 1 = 255 / 15): zero = lo rounded down to
 *     fp16 (at most 2^-10 |lo| + 2^-24 below lo), scale = (hi - zero) /
 *     qmax rounded up to fp16 (factor <= 1 + 2^-10, the fp32 division and
 *     subtraction 2^-23 each), so every element is within scale / 2 of a
 *     code, plus the fp32 rounding of the decode's c * s + z and the
 *     encode's (x - z) / s: at most 2^-22 (|x| + |z| + qmax s).
 *   fp8_e4m3: scale = max|x| / 448 rounded up to fp16 (factor <= 1 +
 *     2^-10 and the fp32 division 2^-23, or one fp16 subnormal step 2^-24
 *     for a tiny max), y = x / s has |y| <= 448; E4M3 with 3 mantissa bits
 *     rounds y to nearest within 2^-4 |y| (normals) or half its subnormal
 *     step 2^-9 (|y| < 2^-6): |x - x'| <= 2^-4 |x| + 2^-10 s, plus the
 *     fp32 rounding of x / s and of fp8(code) * s: 2^-22 (|x| + 448 s). */
static void assert_step_bound(const staging_case *sc, const float *x, const float *xq)
{
    double lo = INFINITY, hi = -INFINITY, amax = 0.0;
    for (int d = 0; d < D; d++) {
        lo = fmin(lo, x[d]);
        hi = fmax(hi, x[d]);
        amax = fmax(amax, fabs(x[d]));
    }
    if (sc->staging == KVARN_STAGING_FP8_E4M3) {
        const double s = amax / 448.0 * (1.0 + 0x1p-10) * (1.0 + 0x1p-21) + 0x1p-24;
        for (int d = 0; d < D; d++) {
            const double bound =
                0x1p-4 * fabs(x[d]) + 0x1p-10 * s + 0x1p-22 * (fabs(x[d]) + 448.0 * s);
            assert_true(fabs((double)xq[d] - (double)x[d]) <= bound);
        }
        return;
    }
    const double qmax = sc->staging == KVARN_STAGING_INT4 ? 15.0 : 255.0;
    const double z = lo - (0x1p-10 * fabs(lo) + 0x1p-24);
    const double s = (hi - z) / qmax * (1.0 + 0x1p-10) * (1.0 + 0x1p-21);
    for (int d = 0; d < D; d++) {
        const double bound = 0.5 * s + 0x1p-22 * (fabs(x[d]) + fabs(z) + qmax * s);
        assert_true(fabs((double)xq[d] - (double)x[d]) <= bound);
    }
}

/* A staged token reads back as the staging's codec applied to its rotated
 * vector, bit for bit (KVARN_DECODE_ROTATED) and within that codec's step
 * of the rotated input; unrotated, as the inverse rotation of that. Sink
 * tile and tail, whole and small tail pages. */
static void test_staged_read_back(void **state)
{
    (void)state;
    const int Ts[2] = {0, 16};
    for (int ci = 0; ci < N_CASES; ci++)
    for (int m = 0; m < 2; m++) {
        const staging_case *sc = &k_cases[ci];
        kvarn_cache *c = make(sc, "kvarn_k4v2_g64", 0, Ts[m]);
        const int len = 64 + 37; /* the sink tile and a partial tail */
        const size_t row = (size_t)HK * D, n = (size_t)L * len * row;
        float *k = malloc(n * sizeof(float)), *v = malloc(n * sizeof(float));
        float *rk = malloc((size_t)len * row * sizeof(float));
        float *rv = malloc((size_t)len * row * sizeof(float));
        test_rng rng;
        test_rng_seed(&rng, 11 + m);
        fill(&rng, k, v, n);
        int seq;
        assert_int_equal(kvarn_cache_seq_create(c, &seq), KVARN_OK);
        assert_int_equal(kvarn_cache_reserve(c, seq, len), KVARN_OK);
        write_all(c, seq, 0, len, len, k, v);
        assert_int_equal(kvarn_cache_commit(c, seq, len), KVARN_OK); /* no full tail tile */
        for (int l = 0; l < L; l++) {
            assert_int_equal(kvarn_cache_read(c, seq, l, 0, len, rk, rv, KVARN_DECODE_ROTATED),
                             KVARN_OK);
            for (int t = 0; t < len; t++)
                for (int h = 0; h < HK; h++) {
                    const size_t o = (size_t)t * row + (size_t)h * D;
                    const size_t in = ((size_t)l * len + t) * row + (size_t)h * D;
                    float kq[D], vq[D], kr[D], vr[D];
                    by_hand(sc, k + in, v + in, kq, vq);
                    assert_memory_equal(rk + o, kq, sizeof kq);
                    assert_memory_equal(rv + o, vq, sizeof vq);
                    memcpy(kr, k + in, sizeof kr);
                    memcpy(vr, v + in, sizeof vr);
                    kvarn_hadamard(kr, D);
                    kvarn_hadamard(vr, D);
                    assert_step_bound(sc, kr, rk + o);
                    assert_step_bound(sc, vr, rv + o);
                }
            /* unrotated: the same values through the inverse rotation */
            float *uk = malloc((size_t)len * row * sizeof(float));
            float *uv = malloc((size_t)len * row * sizeof(float));
            assert_int_equal(kvarn_cache_read(c, seq, l, 0, len, uk, uv, 0), KVARN_OK);
            for (int t = 0; t < len; t++)
                for (int h = 0; h < HK; h++) {
                    float x[D];
                    memcpy(x, rk + (size_t)t * row + (size_t)h * D, sizeof x);
                    kvarn_hadamard(x, D);
                    assert_memory_equal(uk + (size_t)t * row + (size_t)h * D, x, sizeof x);
                }
            free(uk);
            free(uv);
        }
        free(k); free(v); free(rk); free(rv);
        kvarn_cache_destroy(c);
    }
}

/* Commit: the record of a full tail tile is kvarn_encode(prerotated = 1)
 * of its staged tokens as decoded (what the tail read back as), byte for
 * byte; staged tokens before it are unchanged; the 5-token sink slot keeps
 * the staged records of the tile's first tokens (they read back the same
 * after the commit as before it). */
static void test_commit_encodes_decoded_tile(void **state)
{
    (void)state;
    const int Ts[2] = {0, 16};
    for (int ci = 0; ci < N_CASES; ci++)
    for (int m = 0; m < 2; m++) {
        kvarn_cache *c = make(&k_cases[ci], "kvarn_k4v2_g64", 64 + 5, Ts[m]);
        const int G = 64, len = 3 * G + 9; /* sink, the partial-sink tile, a tile, a tail */
        const size_t row = (size_t)HK * D, n = (size_t)L * len * row;
        float *k = malloc(n * sizeof(float)), *v = malloc(n * sizeof(float));
        float *bk0 = malloc((size_t)L * len * row * sizeof(float));
        float *bv0 = malloc((size_t)L * len * row * sizeof(float));
        float *ak = malloc((size_t)len * row * sizeof(float));
        float *av = malloc((size_t)len * row * sizeof(float));
        test_rng rng;
        test_rng_seed(&rng, 21 + m);
        fill(&rng, k, v, n);
        int seq;
        assert_int_equal(kvarn_cache_seq_create(c, &seq), KVARN_OK);
        assert_int_equal(kvarn_cache_reserve(c, seq, len), KVARN_OK);
        write_all(c, seq, 0, len, len, k, v);
        kvarn_format fmt;
        assert_int_equal(kvarn_format_parse("kvarn_k4v2_g64", &fmt), KVARN_OK);
        const size_t rb = kvarn_record_bytes(&fmt, D);
        uint8_t *want = malloc(rb), *got = malloc(rb);
        const size_t ws_bytes = kvarn_encode_workspace_bytes(&fmt, D);
        void *ws = malloc(ws_bytes);
        float *tk = malloc((size_t)G * D * sizeof(float)), *tv = malloc((size_t)G * D * sizeof(float));
        /* what every layer's staged tokens read back as before the commit */
        for (int l = 0; l < L; l++)
            assert_int_equal(kvarn_cache_read(c, seq, l, 0, len, bk0 + (size_t)l * len * row,
                                              bv0 + (size_t)l * len * row, KVARN_DECODE_ROTATED),
                             KVARN_OK);
        assert_int_equal(kvarn_cache_commit(c, seq, len), KVARN_OK);
        for (int l = 0; l < L; l++) {
            const float *bk = bk0 + (size_t)l * len * row, *bv = bv0 + (size_t)l * len * row;
            kvarn_cache_seq_info si;
            assert_int_equal(kvarn_cache_seq_get_info(c, seq, &si), KVARN_OK);
            assert_int_equal(si.quantized_tiles, 2);
            assert_int_equal(kvarn_cache_read(c, seq, l, 0, len, ak, av, KVARN_DECODE_ROTATED),
                             KVARN_OK);
            /* the sink tile, the slot's 5 tokens and the tail: unchanged */
            for (int t = 0; t < len; t++) {
                if ((t >= G + 5 && t < 3 * G)) continue;
                assert_memory_equal(ak + (size_t)t * row, bk + (size_t)t * row, row * sizeof(float));
                assert_memory_equal(av + (size_t)t * row, bv + (size_t)t * row, row * sizeof(float));
            }
            /* tiles 1 and 2: the record of the decoded staged tile */
            kvarn_codec_opts co = KVARN_CODEC_OPTS_DEFAULT;
            co.prerotated = 1;
            for (int ti = 1; ti <= 2; ti++)
                for (int h = 0; h < HK; h++) {
                    for (int j = 0; j < G; j++) {
                        memcpy(tk + (size_t)j * D, bk + (size_t)(ti * G + j) * row + (size_t)h * D,
                               D * sizeof(float));
                        memcpy(tv + (size_t)j * D, bv + (size_t)(ti * G + j) * row + (size_t)h * D,
                               D * sizeof(float));
                    }
                    assert_int_equal(kvarn_encode(&fmt, D, tk, tv, want, rb, ws, ws_bytes, &co),
                                     KVARN_OK);
                    float dk[64 * D], dv[64 * D];
                    assert_int_equal(kvarn_decode(&fmt, D, want, rb, dk, dv, KVARN_DECODE_ROTATED),
                                     KVARN_OK);
                    for (int j = ti == 1 ? 5 : 0; j < G; j++) {
                        assert_memory_equal(ak + (size_t)(ti * G + j) * row + (size_t)h * D,
                                            dk + (size_t)j * D, D * sizeof(float));
                        assert_memory_equal(av + (size_t)(ti * G + j) * row + (size_t)h * D,
                                            dv + (size_t)j * D, D * sizeof(float));
                    }
                }
        }
        (void)got;
        free(want); free(got); free(ws); free(tk); free(tv);
        free(k); free(v); free(bk0); free(bv0); free(ak); free(av);
        kvarn_cache_destroy(c);
    }
}

/* Rollback within staged tokens is exact: append, reject, re-append reads
 * back as never appending the rejected tokens; a fork shares the staged
 * tail and its copy-on-write keeps the parent's tokens. */
static void test_rollback_and_fork(void **state)
{
    (void)state;
    const int Ts[2] = {0, 16};
    for (int ci = 0; ci < N_CASES; ci++)
    for (int m = 0; m < 2; m++) {
        const staging_case *sc = &k_cases[ci];
        kvarn_cache *a = make(sc, "kvarn_k4v2_g64", 0, Ts[m]);
        kvarn_cache *b = make(sc, "kvarn_k4v2_g64", 0, Ts[m]);
        const int len = 64 + 40, extra = 13;
        const size_t row = (size_t)HK * D, n = (size_t)L * (len + extra) * row;
        float *k = malloc(n * sizeof(float)), *v = malloc(n * sizeof(float));
        float *junk_k = malloc(n * sizeof(float)), *junk_v = malloc(n * sizeof(float));
        test_rng rng;
        test_rng_seed(&rng, 31 + m);
        fill(&rng, k, v, n);
        fill(&rng, junk_k, junk_v, n);
        const int all = len + extra;
        int sa, sb;
        assert_int_equal(kvarn_cache_seq_create(a, &sa), KVARN_OK);
        assert_int_equal(kvarn_cache_seq_create(b, &sb), KVARN_OK);
        /* a: len - 10 tokens, 10 rejected draft tokens, then the rest */
        assert_int_equal(kvarn_cache_reserve(a, sa, len), KVARN_OK);
        write_all(a, sa, 0, len - 10, all, k, v);
        write_all(a, sa, len - 10, 10, all, junk_k, junk_v);
        assert_int_equal(kvarn_cache_commit(a, sa, len - 10), KVARN_OK);
        assert_int_equal(kvarn_cache_truncate(a, sa, len - 10), KVARN_OK);
        assert_int_equal(kvarn_cache_reserve(a, sa, 10 + extra), KVARN_OK);
        write_all(a, sa, len - 10, 10 + extra, all, k, v);
        /* b: straight */
        assert_int_equal(kvarn_cache_reserve(b, sb, all), KVARN_OK);
        write_all(b, sb, 0, all, all, k, v);
        float *ra = malloc((size_t)all * row * 2 * sizeof(float)), *rb = malloc((size_t)all * row * 2 * sizeof(float));
        for (int l = 0; l < L; l++) {
            assert_int_equal(kvarn_cache_read(a, sa, l, 0, all, ra, ra + (size_t)all * row, 0), KVARN_OK);
            assert_int_equal(kvarn_cache_read(b, sb, l, 0, all, rb, rb + (size_t)all * row, 0), KVARN_OK);
            assert_memory_equal(ra, rb, (size_t)all * row * 2 * sizeof(float));
        }
        /* fork a at len; the child writes other tokens past it */
        int child;
        assert_int_equal(kvarn_cache_truncate(a, sa, len), KVARN_OK);
        assert_int_equal(kvarn_cache_seq_fork(a, sa, &child), KVARN_OK);
        assert_int_equal(kvarn_cache_reserve(a, child, extra), KVARN_OK);
        write_all(a, child, len, extra, all, junk_k, junk_v);
        for (int l = 0; l < L; l++) {
            assert_int_equal(kvarn_cache_read(a, sa, l, 0, len, ra, ra + (size_t)len * row, 0), KVARN_OK);
            assert_int_equal(kvarn_cache_read(b, sb, l, 0, len, rb, rb + (size_t)len * row, 0), KVARN_OK);
            assert_memory_equal(ra, rb, (size_t)len * row * 2 * sizeof(float));
            assert_int_equal(kvarn_cache_read(a, child, l, 0, len, ra, ra + (size_t)len * row, 0), KVARN_OK);
            assert_memory_equal(ra, rb, (size_t)len * row * 2 * sizeof(float));
        }
        free(ra); free(rb); free(k); free(v); free(junk_k); free(junk_v);
        kvarn_cache_destroy(a);
        kvarn_cache_destroy(b);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_staged_read_back),
        cmocka_unit_test(test_commit_encodes_decoded_tile),
        cmocka_unit_test(test_rollback_and_fork),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
