/* test_cache_exact.c -- kvarn_cache_write_exact (include/kvarn/cache.h),
 * the direct path of a prefill chunk's whole tiles, with fp16 staging and
 * each record staging (int8, fp8_e4m3, int4):
 *   - after the commit, the record of every non-sink tile that lay wholly
 *     inside one write_exact call is kvarn_encode(prerotated = 0) of the
 *     exact K/V of its tokens, byte for byte (the codec's own record of the
 *     tile, rounded once), and differs from what the staged path commits;
 *   - every other tile (cut by a chunk boundary, written by
 *     kvarn_cache_write, or in a layer written that way) is committed from
 *     its staged copy: byte for byte what a cache fed by kvarn_cache_write
 *     alone holds;
 *   - before the commit the tile reads back staged, as kvarn_cache_write's;
 *   - the record is forgotten when its tile is written again or truncated
 *     into (rejected draft tokens: the staged copy of the new tokens is
 *     committed), and a fork shares it (a child's commit keeps the record
 *     in the block it shares);
 *   - errors are kvarn_cache_write's and change nothing.
 * Records are compared in the arena (kvarn_cache_layer_view, the block
 * table of kvarn_cache_seq_view). Attention over such a tile:
 * tests/attn/test_attn_paged_ops.c. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "common/testutil.h"
#include "kvarn/cache.h"
#include "kvarn/kvarn.h"
#include "kvarn/paged.h"

enum { L = 2, HK = 2, D = 64, G = 64 };
#define FMT "kvarn_k4v2_g64"

static const int k_stagings[4] = {KVARN_STAGING_FP16, KVARN_STAGING_INT8,
                                  KVARN_STAGING_FP8_E4M3, KVARN_STAGING_INT4};

static kvarn_cache *make(int staging)
{
    kvarn_cache_opts o = kvarn_cache_default_opts();
    assert_int_equal(kvarn_format_parse(FMT, &o.format), KVARN_OK);
    o.n_layers = L;
    o.n_kv_heads = HK;
    o.head_dim = D;
    o.max_seqs = 4;
    o.n_pages = 24;
    o.budget_bytes = 4u << 20;
    o.staging = staging;
    kvarn_cache *c = NULL;
    assert_int_equal(kvarn_cache_create(&o, &c), KVARN_OK);
    return c;
}

/* k, v: fp32 [L][n][HK][D]; keys with an offset channel */
static void fill(test_rng *r, float *k, float *v, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        k[i] = (float)(1.5 * test_rng_normal(r)) + (float)(i % D == 3 ? 6.0 : 0.0);
        v[i] = (float)test_rng_normal(r);
    }
}

/* Write tokens [pos, pos + n) of layer l (of a [L][len] buffer) exactly
 * (kvarn_cache_write_exact) or staged only (kvarn_cache_write). */
static kvarn_status put(kvarn_cache *c, int seq, int l, int pos, int n, int len, const float *k,
                        const float *v, int exact)
{
    const size_t row = (size_t)HK * D, at = ((size_t)l * len + pos) * row;
    return exact ? kvarn_cache_write_exact(c, seq, l, pos, n, k + at, v + at)
                 : kvarn_cache_write(c, seq, l, pos, n, k + at, v + at);
}

/* The committed record of tile t, layer l, KV head h. */
static const uint8_t *record_of(const kvarn_cache *c, int seq, int l, int t, int h)
{
    kvarn_paged_kv kv;
    kvarn_seq_view sv;
    assert_int_equal(kvarn_cache_layer_view(c, l, &kv), KVARN_OK);
    assert_int_equal(kvarn_cache_seq_view(c, seq, &sv), KVARN_OK);
    assert_true(t < sv.committed_tiles && t >= kv.sink_tiles);
    return kvarn_paged_record(&kv, sv.block_table[t], h);
}

/* kvarn_encode(prerotated = 0, default options) of tokens [t * G, t * G +
 * G) of layer l, head h: the exact tile's own record. */
static void exact_record(const float *k, const float *v, int len, int l, int t, int h,
                         uint8_t *rec, size_t rb)
{
    kvarn_format f;
    assert_int_equal(kvarn_format_parse(FMT, &f), KVARN_OK);
    float *tk = malloc(sizeof(float) * G * D), *tv = malloc(sizeof(float) * G * D);
    const size_t row = (size_t)HK * D;
    for (int j = 0; j < G; j++) {
        const size_t at = ((size_t)l * len + (size_t)t * G + j) * row + (size_t)h * D;
        memcpy(tk + (size_t)j * D, k + at, D * sizeof(float));
        memcpy(tv + (size_t)j * D, v + at, D * sizeof(float));
    }
    size_t ws = kvarn_encode_workspace_bytes(&f, D);
    void *w = malloc(ws + 16);
    assert_int_equal(kvarn_encode(&f, D, tk, tv, rec, rb, w, ws, NULL), KVARN_OK);
    free(w);
    free(tk);
    free(tv);
}

/* want[t][l] = 1: tile t of layer l must hold the exact record, 0: the
 * staged path's (the reference cache's), for tiles [1, n_full) */
static void check_records(kvarn_cache *c, int seq, kvarn_cache *ref, int rseq, const float *k,
                          const float *v, int len, int n_full, const int want[][L])
{
    kvarn_format f;
    assert_int_equal(kvarn_format_parse(FMT, &f), KVARN_OK);
    const size_t rb = kvarn_record_bytes(&f, D);
    uint8_t *rec = malloc(rb);
    for (int t = 1; t < n_full; t++)
        for (int l = 0; l < L; l++) {
            int same_as_staged = 1;
            for (int h = 0; h < HK; h++) {
                const uint8_t *got = record_of(c, seq, l, t, h);
                const uint8_t *staged = record_of(ref, rseq, l, t, h);
                if (want[t][l]) {
                    exact_record(k, v, len, l, t, h, rec, rb);
                    assert_memory_equal(got, rec, rb);
                    same_as_staged &= memcmp(got, staged, rb) == 0;
                } else {
                    assert_memory_equal(got, staged, rb);
                }
            }
            /* the direct path is not the staged one under another name */
            if (want[t][l]) assert_false(same_as_staged);
        }
    free(rec);
}

/* A prompt of 4 tiles and 9 tokens in three chunks, [0, 70), [70, 3G), [3G,
 * len): tile 0 is the sink, tile 1 is cut by the first boundary, tile 2
 * lies inside the second chunk; tile 3 inside the third. Layer 0 takes
 * kvarn_cache_write_exact, layer 1 kvarn_cache_write for the third chunk
 * (the mark is per layer). Then: tiles 2 (both layers) and 3 (layer 0)
 * hold the exact record, the rest the staged path's; before the commit
 * every token reads back as the reference's. */
static void test_whole_tiles_take_the_direct_path(void **state)
{
    (void)state;
    for (int si = 0; si < 4; si++) {
        kvarn_cache *c = make(k_stagings[si]), *ref = make(k_stagings[si]);
        const int len = 4 * G + 9;
        const size_t row = (size_t)HK * D, n = (size_t)L * len * row;
        float *k = malloc(n * sizeof(float)), *v = malloc(n * sizeof(float));
        test_rng rng;
        test_rng_seed(&rng, 101 + (uint64_t)si);
        fill(&rng, k, v, n);
        int s, r;
        assert_int_equal(kvarn_cache_seq_create(c, &s), KVARN_OK);
        assert_int_equal(kvarn_cache_seq_create(ref, &r), KVARN_OK);
        const int cut[4] = {0, 70, 3 * G, len};
        for (int ch = 0; ch < 3; ch++) {
            const int pos = cut[ch], m = cut[ch + 1] - cut[ch];
            assert_int_equal(kvarn_cache_reserve(c, s, m), KVARN_OK);
            assert_int_equal(kvarn_cache_reserve(ref, r, m), KVARN_OK);
            for (int l = 0; l < L; l++) {
                assert_int_equal(put(c, s, l, pos, m, len, k, v, !(ch == 2 && l == 1)), KVARN_OK);
                assert_int_equal(put(ref, r, l, pos, m, len, k, v, 0), KVARN_OK);
            }
            if (ch == 1) {
                /* staged until the commit: reads back as the reference */
                float *a = malloc((size_t)cut[2] * row * 2 * sizeof(float));
                float *b = malloc((size_t)cut[2] * row * 2 * sizeof(float));
                for (int l = 0; l < L; l++) {
                    assert_int_equal(kvarn_cache_read(c, s, l, 0, cut[2], a, a + (size_t)cut[2] * row,
                                                      KVARN_DECODE_ROTATED), KVARN_OK);
                    assert_int_equal(kvarn_cache_read(ref, r, l, 0, cut[2], b,
                                                      b + (size_t)cut[2] * row,
                                                      KVARN_DECODE_ROTATED), KVARN_OK);
                    assert_memory_equal(a, b, (size_t)cut[2] * row * 2 * sizeof(float));
                }
                free(a);
                free(b);
            }
            assert_int_equal(kvarn_cache_commit(c, s, pos + m), KVARN_OK);
            assert_int_equal(kvarn_cache_commit(ref, r, pos + m), KVARN_OK);
        }
        const int want[4][L] = {{0, 0}, {0, 0}, {1, 1}, {1, 0}};
        check_records(c, s, ref, r, k, v, len, 4, want);
        free(k);
        free(v);
        kvarn_cache_destroy(c);
        kvarn_cache_destroy(ref);
    }
}

/* The record is forgotten when its tile changes before the commit:
 *   (a) one token of a whole tile written again (kvarn_cache_write);
 *   (b) a chunk bringing tiles 1 and 2 whole, as draft tokens, truncated
 *       back into tile 2 (rejected) and the rest written again, exactly:
 *       tile 1 keeps its record, tile 2 (now cut by the chunk boundary)
 *       commits from its staged copy of the accepted tokens;
 *   (c) a fork before the commit: parent and child both commit the tile
 *       from the exact record they share, and the parent's block is not
 *       re-encoded by the child's commit. */
static void test_record_forgotten_when_its_tile_changes(void **state)
{
    (void)state;
    for (int si = 0; si < 4; si++) {
        const int len = 3 * G + 5;
        const size_t row = (size_t)HK * D, n = (size_t)L * len * row;
        float *k = malloc(n * sizeof(float)), *v = malloc(n * sizeof(float));
        float *junk_k = malloc(n * sizeof(float)), *junk_v = malloc(n * sizeof(float));
        test_rng rng;
        test_rng_seed(&rng, 202 + (uint64_t)si);
        fill(&rng, k, v, n);
        fill(&rng, junk_k, junk_v, n);

        /* reference: every token through kvarn_cache_write */
        kvarn_cache *ref = make(k_stagings[si]);
        int r;
        assert_int_equal(kvarn_cache_seq_create(ref, &r), KVARN_OK);
        assert_int_equal(kvarn_cache_reserve(ref, r, len), KVARN_OK);
        for (int l = 0; l < L; l++) assert_int_equal(put(ref, r, l, 0, len, len, k, v, 0), KVARN_OK);
        assert_int_equal(kvarn_cache_commit(ref, r, len), KVARN_OK);

        /* (a) */
        kvarn_cache *c = make(k_stagings[si]);
        int s;
        assert_int_equal(kvarn_cache_seq_create(c, &s), KVARN_OK);
        assert_int_equal(kvarn_cache_reserve(c, s, len), KVARN_OK);
        for (int l = 0; l < L; l++) {
            assert_int_equal(put(c, s, l, 0, len, len, k, v, 1), KVARN_OK);
            /* token 2G + 7 (tile 2) of layer 1 written again, same values */
            assert_int_equal(put(c, s, l, 2 * G + 7, 1, len, k, v, l == 0), KVARN_OK);
        }
        assert_int_equal(kvarn_cache_commit(c, s, len), KVARN_OK);
        /* layer 0 rewrote through write_exact, one token: not whole */
        const int want_a[3][L] = {{0, 0}, {1, 1}, {0, 0}};
        check_records(c, s, ref, r, k, v, len, 3, want_a);
        kvarn_cache_destroy(c);

        /* (b) */
        c = make(k_stagings[si]);
        assert_int_equal(kvarn_cache_seq_create(c, &s), KVARN_OK);
        assert_int_equal(kvarn_cache_reserve(c, s, G), KVARN_OK);
        for (int l = 0; l < L; l++) assert_int_equal(put(c, s, l, 0, G, len, k, v, 1), KVARN_OK);
        assert_int_equal(kvarn_cache_reserve(c, s, 2 * G), KVARN_OK);
        for (int l = 0; l < L; l++) {
            /* tiles 1 and 2: tile 1 accepted, tile 2's last 40 rejected */
            const size_t at = ((size_t)l * len + G) * row, cut = (size_t)(2 * G - 40) * row;
            memcpy(junk_k + at, k + at, cut * sizeof(float));
            memcpy(junk_v + at, v + at, cut * sizeof(float));
            assert_int_equal(put(c, s, l, G, 2 * G, len, junk_k, junk_v, 1), KVARN_OK);
        }
        assert_int_equal(kvarn_cache_commit(c, s, 3 * G - 40), KVARN_OK);
        assert_int_equal(kvarn_cache_truncate(c, s, 3 * G - 40), KVARN_OK);
        assert_int_equal(kvarn_cache_reserve(c, s, len - (3 * G - 40)), KVARN_OK);
        for (int l = 0; l < L; l++)
            assert_int_equal(put(c, s, l, 3 * G - 40, len - (3 * G - 40), len, k, v, 1), KVARN_OK);
        assert_int_equal(kvarn_cache_commit(c, s, len), KVARN_OK);
        const int want_b[3][L] = {{0, 0}, {1, 1}, {0, 0}};
        check_records(c, s, ref, r, k, v, len, 3, want_b);
        kvarn_cache_destroy(c);

        /* (c) */
        c = make(k_stagings[si]);
        assert_int_equal(kvarn_cache_seq_create(c, &s), KVARN_OK);
        assert_int_equal(kvarn_cache_reserve(c, s, len), KVARN_OK);
        for (int l = 0; l < L; l++) assert_int_equal(put(c, s, l, 0, len, len, k, v, 1), KVARN_OK);
        int child;
        assert_int_equal(kvarn_cache_seq_fork(c, s, &child), KVARN_OK);
        assert_int_equal(kvarn_cache_commit(c, child, len), KVARN_OK);
        assert_int_equal(kvarn_cache_commit(c, s, len), KVARN_OK);
        const int want_c[3][L] = {{0, 0}, {1, 1}, {1, 1}};
        check_records(c, s, ref, r, k, v, len, 3, want_c);
        check_records(c, child, ref, r, k, v, len, 3, want_c);
        kvarn_cache_destroy(c);

        kvarn_cache_destroy(ref);
        free(k); free(v); free(junk_k); free(junk_v);
    }
}

/* kvarn_cache_write_exact refuses what kvarn_cache_write refuses, with the
 * same status, and writes nothing: the commit afterwards is the
 * reference's (no record was marked). Per-token formats: the same bytes as
 * kvarn_cache_write. */
static void test_errors_and_per_token(void **state)
{
    (void)state;
    const int len = 2 * G;
    const size_t row = (size_t)HK * D, n = (size_t)L * len * row;
    float *k = malloc(n * sizeof(float)), *v = malloc(n * sizeof(float));
    test_rng rng;
    test_rng_seed(&rng, 303);
    fill(&rng, k, v, n);
    kvarn_cache *c = make(KVARN_STAGING_INT8), *ref = make(KVARN_STAGING_INT8);
    int s, r;
    assert_int_equal(kvarn_cache_seq_create(c, &s), KVARN_OK);
    assert_int_equal(kvarn_cache_seq_create(ref, &r), KVARN_OK);
    assert_int_equal(kvarn_cache_reserve(c, s, len), KVARN_OK);
    assert_int_equal(kvarn_cache_reserve(ref, r, len), KVARN_OK);
    assert_int_equal(kvarn_cache_write_exact(NULL, s, 0, 0, len, k, v), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_write_exact(c, s + 1, 0, 0, len, k, v), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_write_exact(c, s, L, 0, len, k, v), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_write_exact(c, s, 0, 0, len, NULL, v), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_write_exact(c, s, 0, 0, len + 1, k, v), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_write_exact(c, s, 0, 0, -1, k, v), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_write_exact(c, s, 0, 5, G, k, v), KVARN_ERR_STATE); /* a gap */
    /* a NaN in the last token: nothing written, nothing marked */
    const float keep = k[(size_t)(len - 1) * row + 7];
    k[(size_t)(len - 1) * row + 7] = NAN;
    assert_int_equal(kvarn_cache_write_exact(c, s, 0, 0, len, k, v), KVARN_ERR_NONFINITE);
    k[(size_t)(len - 1) * row + 7] = keep;
    kvarn_cache_seq_info si;
    assert_int_equal(kvarn_cache_seq_get_info(c, s, &si), KVARN_OK);
    assert_int_equal(kvarn_cache_commit(c, s, 1), KVARN_ERR_STATE); /* layer 0 unwritten */
    for (int l = 0; l < L; l++) {
        assert_int_equal(put(c, s, l, 0, len, len, k, v, 0), KVARN_OK);
        assert_int_equal(put(ref, r, l, 0, len, len, k, v, 0), KVARN_OK);
    }
    assert_int_equal(kvarn_cache_commit(c, s, len), KVARN_OK);
    assert_int_equal(kvarn_cache_commit(ref, r, len), KVARN_OK);
    const int want[2][L] = {{0, 0}, {0, 0}};
    check_records(c, s, ref, r, k, v, len, 2, want);
    kvarn_cache_destroy(c);
    kvarn_cache_destroy(ref);

    /* int8 per-token records: write_exact is write */
    kvarn_cache_opts o = kvarn_cache_default_opts();
    assert_int_equal(kvarn_format_parse("int8", &o.format), KVARN_OK);
    o.n_layers = L;
    o.n_kv_heads = HK;
    o.head_dim = D;
    o.max_seqs = 2;
    o.budget_bytes = 1u << 20;
    kvarn_cache *a = NULL, *b = NULL;
    assert_int_equal(kvarn_cache_create(&o, &a), KVARN_OK);
    assert_int_equal(kvarn_cache_create(&o, &b), KVARN_OK);
    assert_int_equal(kvarn_cache_seq_create(a, &s), KVARN_OK);
    assert_int_equal(kvarn_cache_seq_create(b, &r), KVARN_OK);
    assert_int_equal(kvarn_cache_reserve(a, s, len), KVARN_OK);
    assert_int_equal(kvarn_cache_reserve(b, r, len), KVARN_OK);
    for (int l = 0; l < L; l++) {
        assert_int_equal(put(a, s, l, 0, len, len, k, v, 1), KVARN_OK);
        assert_int_equal(put(b, r, l, 0, len, len, k, v, 0), KVARN_OK);
    }
    float *ra = malloc((size_t)len * row * 2 * sizeof(float));
    float *rb = malloc((size_t)len * row * 2 * sizeof(float));
    for (int l = 0; l < L; l++) {
        assert_int_equal(kvarn_cache_read(a, s, l, 0, len, ra, ra + (size_t)len * row, 0), KVARN_OK);
        assert_int_equal(kvarn_cache_read(b, r, l, 0, len, rb, rb + (size_t)len * row, 0), KVARN_OK);
        assert_memory_equal(ra, rb, (size_t)len * row * 2 * sizeof(float));
    }
    free(ra); free(rb);
    kvarn_cache_destroy(a);
    kvarn_cache_destroy(b);
    free(k); free(v);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_whole_tiles_take_the_direct_path),
        cmocka_unit_test(test_record_forgotten_when_its_tile_changes),
        cmocka_unit_test(test_errors_and_per_token),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
