/* test_cache.c -- the paged quantized KV cache (include/kvarn/cache.h):
 * write/read-back of every format against the codec applied by hand, the
 * views attention reads (decoded here with attn.h's own address formulas),
 * KVarN sink / tail / commit, rollback, truncate into a quantized tile,
 * fork + copy-on-write + free, pool exhaustion, scrambled block ids, hostile
 * arguments. The randomized model test is test_cache_random.c. */
#define KVARN_EXPERIMENTAL_API /* the testing knobs (attn.h, cache.h) */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <cmocka.h>

#include "cache/cache_fixture.h"

enum { L = 2, HK = 2, D = 64 };
#define ROW ((size_t)HK * D)

/* Raw K/V of one sequence, all layers: [L][cap][Hk][D]. */
typedef struct tokens {
    int cap;
    float *k[L], *v[L];
} tokens;

static tokens tok_new(int cap, test_rng *r, float scale)
{
    tokens t;
    t.cap = cap;
    for (int l = 0; l < L; l++) {
        t.k[l] = malloc((size_t)cap * ROW * sizeof(float));
        t.v[l] = malloc((size_t)cap * ROW * sizeof(float));
        assert_non_null(t.k[l]);
        assert_non_null(t.v[l]);
        if (r) {
            fx_fill(r, t.k[l], (size_t)cap * ROW, scale);
            fx_fill(r, t.v[l], (size_t)cap * ROW, scale);
        }
    }
    return t;
}

static void tok_free(tokens *t)
{
    for (int l = 0; l < L; l++) {
        free(t->k[l]);
        free(t->v[l]);
    }
}

/* Reserve n tokens and write tokens [from, from + n) of src at the end of
 * the sequence, every layer (in two chunks when n > 1, to exercise pos). */
static kvarn_status append(kvarn_cache *c, int seq, const tokens *src, int from, int n)
{
    kvarn_cache_seq_info si;
    assert_int_equal(kvarn_cache_seq_get_info(c, seq, &si), KVARN_OK);
    kvarn_status st = kvarn_cache_reserve(c, seq, n);
    if (st != KVARN_OK) return st;
    const int a = n / 2;
    for (int l = 0; l < L; l++) {
        const float *k = src->k[l] + (size_t)from * ROW, *v = src->v[l] + (size_t)from * ROW;
        assert_int_equal(kvarn_cache_write(c, seq, l, si.seq_len, a, k, v), KVARN_OK);
        assert_int_equal(kvarn_cache_write(c, seq, l, si.seq_len + a, n - a, k + a * ROW,
                                           v + a * ROW),
                         KVARN_OK);
    }
    return KVARN_OK;
}

/* Read back every token of every layer and compare bit for bit with the
 * codec applied by hand to src's first seq_len tokens. */
static void check_contents(kvarn_cache *c, int seq, const tokens *src)
{
    kvarn_cache_info ci;
    kvarn_cache_seq_info si;
    assert_int_equal(kvarn_cache_get_info(c, &ci), KVARN_OK);
    assert_int_equal(kvarn_cache_seq_get_info(c, seq, &si), KVARN_OK);
    const int n = si.seq_len;
    if (n == 0) return;
    float *ek = malloc((size_t)n * ROW * sizeof(float)), *ev = malloc((size_t)n * ROW * sizeof(float));
    float *gk = malloc((size_t)n * ROW * sizeof(float)), *gv = malloc((size_t)n * ROW * sizeof(float));
    for (int l = 0; l < L; l++) {
        assert_true(fx_expect(&ci.format, ci.block_size, ci.sink_tiles, si.quantized_tiles, HK,
                              D, src->k[l], src->v[l], n, ek, ev));
        assert_int_equal(kvarn_cache_read(c, seq, l, 0, n, gk, gv, 0), KVARN_OK);
        fx_assert_same(gk, ek, (size_t)n * ROW * sizeof(float));
        fx_assert_same(gv, ev, (size_t)n * ROW * sizeof(float));
    }
    free(ek);
    free(ev);
    free(gk);
    free(gv);
}

/* Decode a sequence's layer through the views only, with the address
 * helpers of include/kvarn/paged.h, in the original basis. */
static void read_via_views(kvarn_cache *c, int seq, int layer, float *k, float *v)
{
    kvarn_paged_kv kv;
    kvarn_seq_view sv;
    assert_int_equal(kvarn_cache_layer_view(c, layer, &kv), KVARN_OK);
    assert_int_equal(kvarn_cache_seq_view(c, seq, &sv), KVARN_OK);
    const int G = kv.block_size, Dd = kv.head_dim, H = kv.n_kv_heads;
    const size_t GD = (size_t)G * Dd, row = (size_t)H * Dd;
    const int is_kvarn = kv.fmt.kind == KVARN_KIND_KVARN;
    size_t rb = kvarn_record_bytes(&kv.fmt, Dd);
    float *tk = malloc(GD * sizeof(float)), *tv = malloc(GD * sizeof(float));
    const int nt = (sv.seq_len + G - 1) / G;
    for (int t = 0; t < nt; t++) {
        const int id = sv.block_table[t];
        const int page = kvarn_paged_tile_is_page(&kv, sv.committed_tiles, t);
        if (page) assert_true(id >= 0 && id < kv.n_fp16_pages);
        else assert_true(id >= 0 && id < kv.n_blocks);
        for (int h = 0; h < H; h++) {
            if (page) {
                const uint16_t *pk = kvarn_paged_page_k(&kv, id, h);
                const uint16_t *pv = kvarn_paged_page_v(&kv, id, h);
                for (size_t i = 0; i < GD; i++) {
                    tk[i] = kvarn_fp16_to_fp32(pk[i]);
                    tv[i] = kvarn_fp16_to_fp32(pv[i]);
                }
                kvarn_hadamard_rows(tk, G, Dd);
                kvarn_hadamard_rows(tv, G, Dd);
            } else {
                const uint8_t *rec = kvarn_paged_record(&kv, id, h);
                if (is_kvarn) {
                    assert_int_equal(kvarn_decode(&kv.fmt, Dd, rec, rb, tk, tv, 0), KVARN_OK);
                } else {
                    for (int j = 0; j < G; j++)
                        assert_int_equal(kvarn_decode(&kv.fmt, Dd, kvarn_paged_token_record(&kv, id, h, j),
                                                      kv.token_record_bytes, tk + (size_t)j * Dd,
                                                      tv + (size_t)j * Dd, 0),
                                         KVARN_OK);
                }
            }
            for (int j = 0; j < G && t * G + j < sv.seq_len; j++) {
                memcpy(k + (size_t)(t * G + j) * row + (size_t)h * Dd, tk + (size_t)j * Dd, (size_t)Dd * 4);
                memcpy(v + (size_t)(t * G + j) * row + (size_t)h * Dd, tv + (size_t)j * Dd, (size_t)Dd * 4);
            }
        }
    }
    free(tk);
    free(tv);
}

static kvarn_cache *make(const char *name, int G, int sink, int n_blocks, int n_pages, int max_seqs)
{
    kvarn_cache_opts o = fx_opts(name, L, HK, D, G, sink, n_blocks, n_pages, max_seqs);
    kvarn_cache *c = NULL;
    assert_int_equal(kvarn_cache_create(&o, &c), KVARN_OK);
    kvarn_cache_info ci;
    assert_int_equal(kvarn_cache_get_info(c, &ci), KVARN_OK);
    assert_int_equal(ci.n_blocks, n_blocks);
    return c;
}

/* ------------------------------------------------------------------------ */

static void test_create_and_geometry(void **state)
{
    (void)state;
    kvarn_cache_opts o = fx_opts("kvarn_k4v2_g32", L, HK, D, 0, 1, 10, 5, 4);
    kvarn_cache *c = NULL;
    assert_int_equal(kvarn_cache_create(&o, &c), KVARN_OK);
    kvarn_cache_info ci;
    assert_int_equal(kvarn_cache_get_info(c, &ci), KVARN_OK);
    const size_t rec = kvarn_record_bytes(&o.format, D);
    assert_int_equal(ci.block_size, 32);
    assert_int_equal(ci.sink_tiles, 1);
    assert_int_equal(ci.n_blocks, 10);
    assert_int_equal(ci.n_pages, 5);
    assert_int_equal(ci.record_stride, rec);
    assert_int_equal(ci.block_stride, HK * rec);
    assert_int_equal(ci.block_bytes, L * HK * rec);
    assert_int_equal(ci.page_bytes, L * HK * 2 * 32 * D * 2);
    assert_int_equal(ci.capacity_tokens, 10 * 32);
    assert_int_equal(ci.max_seq_len, (10 + 1) * 32);
    assert_int_equal(ci.arena_bytes, o.budget_bytes);

    /* plan = what create builds, without allocating */
    kvarn_cache_info pi;
    assert_int_equal(kvarn_cache_plan(&o, &pi), KVARN_OK);
    fx_assert_same(&pi, &ci, sizeof pi);
    kvarn_cache_opts z = o;
    z.budget_bytes = 0;
    assert_int_equal(kvarn_cache_plan(&z, &pi), KVARN_OK);
    assert_int_equal(pi.n_blocks, 0);
    assert_int_equal(pi.n_pages, 5);
    assert_int_equal(pi.block_bytes, ci.block_bytes);
    assert_int_equal(pi.page_bytes, ci.page_bytes);
    kvarn_cache *zc = NULL;
    assert_int_equal(kvarn_cache_create(&z, &zc), KVARN_ERR_INVALID_ARG);
    assert_null(zc);
    assert_int_equal(kvarn_cache_plan(NULL, &pi), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_plan(&o, NULL), KVARN_ERR_INVALID_ARG);

    kvarn_paged_kv v0, v1;
    assert_int_equal(kvarn_cache_layer_view(c, 0, &v0), KVARN_OK);
    assert_int_equal(kvarn_cache_layer_view(c, 1, &v1), KVARN_OK);
    assert_int_equal(v0.block_size, 32);
    assert_int_equal(v0.n_kv_heads, HK);
    assert_int_equal(v0.head_dim, D);
    assert_int_equal(v0.sink_tiles, 1);
    assert_int_equal(v0.n_blocks, 10);
    assert_int_equal(v0.n_fp16_pages, 5);
    assert_int_equal(v0.record_stride, rec);
    assert_int_equal(v0.token_record_bytes, 0);
    assert_true(v1.blocks - v0.blocks == (ptrdiff_t)(10 * v0.block_stride));
    assert_true(v1.fp16_pages - v0.fp16_pages == (ptrdiff_t)(5 * HK * 2 * 32 * D));
    assert_int_equal(kvarn_cache_layer_view(c, 2, &v0), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_layer_view(c, -1, &v0), KVARN_ERR_INVALID_ARG);
    kvarn_cache_stats s;
    assert_int_equal(kvarn_cache_get_stats(c, &s), KVARN_OK);
    assert_int_equal(s.blocks_free, 10);
    assert_int_equal(s.pages_free, 5);
    assert_true(fabs(s.record_bytes_per_token - (double)(L * HK * rec) / 32.0) < 1e-9);
    assert_true(fabs(s.arena_bytes_per_token - (double)o.budget_bytes / 320.0) < 1e-9);
    kvarn_cache_destroy(c);

    /* per-token format: G is a setting, no pages, no sink */
    o = fx_opts("int8", L, HK, D, 16, 0, 7, 0, 4);
    o.sink_tiles = 1; /* ignored for per-token formats */
    assert_int_equal(kvarn_cache_create(&o, &c), KVARN_OK);
    assert_int_equal(kvarn_cache_get_info(c, &ci), KVARN_OK);
    assert_int_equal(ci.block_size, 16);
    assert_int_equal(ci.sink_tiles, 0);
    assert_int_equal(ci.n_pages, 0);
    assert_int_equal(ci.n_blocks, 7);
    assert_int_equal(ci.token_record_bytes, 2 * D + 8);
    assert_int_equal(ci.record_stride, 16 * (2 * D + 8));
    assert_int_equal(kvarn_cache_layer_view(c, 1, &v0), KVARN_OK);
    assert_null(v0.fp16_pages);
    assert_int_equal(v0.token_record_bytes, 2 * D + 8);
    kvarn_cache_destroy(c);

    /* default block size of per-token formats */
    o = fx_opts("fp16", L, HK, D, 16, 0, 3, 0, 2);
    o.block_size = 0;
    assert_int_equal(kvarn_cache_create(&o, &c), KVARN_OK);
    assert_int_equal(kvarn_cache_get_info(c, &ci), KVARN_OK);
    assert_int_equal(ci.block_size, 16);
    assert_int_equal(ci.n_blocks, 3);
    kvarn_cache_destroy(c);

    /* bad options: nothing created */
    kvarn_cache_opts good = fx_opts("kvarn_k4v2_g32", L, HK, D, 0, 1, 4, 3, 2);
    kvarn_cache_opts bad[12];
    for (int i = 0; i < 12; i++) bad[i] = good;
    bad[0].n_layers = 0;
    bad[1].n_kv_heads = -1;
    bad[2].head_dim = 96;
    bad[3].block_size = 64;          /* KVarN: must be the tile */
    bad[4].sink_tiles = -1;
    bad[5].budget_bytes = 100;       /* smaller than the pages */
    bad[6].max_seqs = 0;
    bad[7].n_pages = -2;
    bad[8].balance_iters = 65;
    bad[9].format.kind = KVARN_KIND_COUNT;
    bad[10] = fx_opts("int4", L, HK, D, 16, 0, 3, 0, 2);
    bad[10].n_pages = 4;             /* per-token formats have no pages */
    bad[11] = fx_opts("int4", L, HK, D, 2000, 0, 3, 0, 2);
    kvarn_status want[12] = {KVARN_ERR_INVALID_ARG, KVARN_ERR_INVALID_ARG,
                             KVARN_ERR_UNSUPPORTED_HEAD_DIM, KVARN_ERR_INVALID_ARG,
                             KVARN_ERR_INVALID_ARG, KVARN_ERR_INVALID_ARG,
                             KVARN_ERR_INVALID_ARG, KVARN_ERR_INVALID_ARG,
                             KVARN_ERR_INVALID_ARG, KVARN_ERR_INVALID_ARG,
                             KVARN_ERR_INVALID_ARG, KVARN_ERR_INVALID_ARG};
    for (int i = 0; i < 12; i++) {
        kvarn_cache *x = (kvarn_cache *)&good; /* sentinel: must stay */
        assert_int_equal(kvarn_cache_create(&bad[i], &x), want[i]);
        assert_ptr_equal(x, (kvarn_cache *)&good);
    }
    /* budget for the pages but not one block */
    kvarn_cache_opts nb = fx_opts("kvarn_k4v2_g32", L, HK, D, 0, 1, 1, 3, 2);
    nb.budget_bytes -= 1;
    assert_int_equal(kvarn_cache_create(&nb, &c), KVARN_ERR_INVALID_ARG);
    /* page bytes * n_pages beyond 64 bits: refused before any allocation */
    kvarn_cache_opts huge = fx_opts("kvarn_k4v2_g128", 1, 1, 256, 0, 1, 1, 1, 2);
    huge.n_layers = 4096;
    huge.n_kv_heads = 4096;
    huge.n_pages = 1 << 29;
    huge.budget_bytes = UINT64_MAX;
    assert_int_equal(kvarn_cache_create(&huge, &c), KVARN_ERR_TOO_LARGE);
    assert_int_equal(kvarn_cache_create(NULL, &c), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_create(&good, NULL), KVARN_ERR_INVALID_ARG);
    kvarn_cache_destroy(NULL);
    /* auto pages: max_seqs * (sink + 1) + ceil(max_seqs / 8) */
    kvarn_cache_opts ap = fx_opts("kvarn_k4v2_g32", L, HK, D, 0, 2, 6, 3 * (2 + 1) + 1, 3);
    ap.n_pages = 0;
    assert_int_equal(kvarn_cache_create(&ap, &c), KVARN_OK);
    assert_int_equal(kvarn_cache_get_info(c, &ci), KVARN_OK);
    assert_int_equal(ci.n_pages, 10);
    assert_int_equal(ci.n_blocks, 6);
    kvarn_cache_destroy(c);
}

/* Every format: write, commit, read back, and read through the views. */
static void test_roundtrip_every_format(void **state)
{
    (void)state;
    const char *names[] = {"fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4",
                           "kvarn_k4v2_g32", "kvarn_k4v4_g64", "kvarn_k4v2_g128",
                           "kvarn_k8v8_g32", "kvarn_k2v2_g64"};
    test_rng r;
    test_rng_seed(&r, 11);
    for (size_t f = 0; f < sizeof names / sizeof names[0]; f++) {
        kvarn_format fmt = fx_format(names[f]);
        const int G = fx_block_size(&fmt, 16);
        const int n = 3 * G + 5;
        kvarn_cache *c = make(names[f], 16, 1, 8, 6, 2);
        tokens t = tok_new(n, &r, 1.5f);
        int s;
        assert_int_equal(kvarn_cache_seq_create(c, &s), KVARN_OK);
        assert_int_equal(append(c, s, &t, 0, n), KVARN_OK);
        check_contents(c, s, &t); /* before commit: all tail for KVarN */
        assert_int_equal(kvarn_cache_commit(c, s, n), KVARN_OK);
        kvarn_cache_seq_info si;
        assert_int_equal(kvarn_cache_seq_get_info(c, s, &si), KVARN_OK);
        assert_int_equal(si.quantized_tiles, fmt.kind == KVARN_KIND_KVARN ? 2 : 0);
        check_contents(c, s, &t);
        float *gk = malloc((size_t)n * ROW * 4), *gv = malloc((size_t)n * ROW * 4);
        float *ek = malloc((size_t)n * ROW * 4), *ev = malloc((size_t)n * ROW * 4);
        for (int l = 0; l < L; l++) {
            read_via_views(c, s, l, gk, gv);
            assert_int_equal(kvarn_cache_read(c, s, l, 0, n, ek, ev, 0), KVARN_OK);
            for (size_t i = 0; i < (size_t)n * ROW; i++) {
                /* the views decode pages with the rows variant of the
                 * Hadamard: bit-identical by hadamard.h's contract */
                assert_true(gk[i] == ek[i]);
                assert_true(gv[i] == ev[i]);
            }
            /* a sub-range read equals the slice of the full read */
            assert_int_equal(kvarn_cache_read(c, s, l, G - 3, G + 7, gk, NULL, 0), KVARN_OK);
            fx_assert_same(gk, ek + (size_t)(G - 3) * ROW, (size_t)(G + 7) * ROW * 4);
        }
        if (fmt.kind == KVARN_KIND_KVARN) {
            /* rotated read = what attention sees: the fp16 page values */
            assert_int_equal(kvarn_cache_read(c, s, 1, n - 5, 5, gk, gv, KVARN_DECODE_ROTATED), KVARN_OK);
            for (int i = 0; i < 5 * HK; i++) {
                float want[D];
                fx_rot16(t.k[1] + (size_t)(n - 5) * ROW + (size_t)i * D, want, D);
                fx_assert_same(gk + (size_t)i * D, want, sizeof want);
            }
        }
        free(gk);
        free(gv);
        free(ek);
        free(ev);
        tok_free(&t);
        kvarn_cache_destroy(c);
    }
}

/* Decode-style: one token at a time, commit lagging by 2 tokens (tokens
 * being verified); tiles commit exactly when they are full and final. */
static void sink_tail_case(int sink)
{
    const char *name = "kvarn_k4v2_g32";
    const int G = 32, n = 5 * G + 7, lag = 2;
    kvarn_cache *c = make(name, 0, sink, 8, 8, 2);
    test_rng r;
    test_rng_seed(&r, 20 + (uint64_t)sink);
    tokens t = tok_new(n, &r, 1.0f);
    int s;
    assert_int_equal(kvarn_cache_seq_create(c, &s), KVARN_OK);
    for (int len = 1; len <= n; len++) {
        assert_int_equal(append(c, s, &t, len - 1, 1), KVARN_OK);
        const int committed = len > lag ? len - lag : 0;
        assert_int_equal(kvarn_cache_commit(c, s, committed), KVARN_OK);
        kvarn_cache_seq_info si;
        assert_int_equal(kvarn_cache_seq_get_info(c, s, &si), KVARN_OK);
        const int nt = (len + G - 1) / G;
        int want_q = committed / G - sink;
        if (want_q < 0) want_q = 0;
        assert_int_equal(si.seq_len, len);
        assert_int_equal(si.n_tiles, nt);
        assert_int_equal(si.quantized_tiles, want_q);
        assert_int_equal(si.committed_len, committed);
        assert_int_equal(si.committed_tiles, sink + want_q < nt ? sink + want_q : nt);
        assert_int_equal(si.frozen_len, want_q ? (sink + want_q) * G : 0);
        kvarn_cache_stats st;
        assert_int_equal(kvarn_cache_get_stats(c, &st), KVARN_OK);
        /* pages: sink tiles + tail tiles; blocks: every non-sink tile */
        assert_int_equal(st.pages_in_use, nt - want_q);
        assert_int_equal(st.blocks_in_use, nt > sink ? nt - sink : 0);
        kvarn_seq_view sv;
        assert_int_equal(kvarn_cache_seq_view(c, s, &sv), KVARN_OK);
        for (int i = 0; i < nt; i++) {
            int page = i < sink || i >= sv.committed_tiles;
            if (page) assert_int_equal(kvarn_cache_page_refs(c, sv.block_table[i]), 1);
            else assert_int_equal(kvarn_cache_block_refs(c, sv.block_table[i]), 1);
        }
        if (len % 13 == 0 || len == n) check_contents(c, s, &t);
    }
    tok_free(&t);
    kvarn_cache_destroy(c);
}

static void test_kvarn_sink_tail_commit(void **state)
{
    (void)state;
    sink_tail_case(1);
    sink_tail_case(0);
    sink_tail_case(2);
}

/* Tail only (no commit): works without the tile codec. */
static void test_kvarn_tail_exact(void **state)
{
    (void)state;
    kvarn_cache *c = make("kvarn_k4v2_g64", 0, 1, 4, 4, 2);
    test_rng r;
    test_rng_seed(&r, 31);
    tokens t = tok_new(150, &r, 3.0f);
    int s;
    assert_int_equal(kvarn_cache_seq_create(c, &s), KVARN_OK);
    assert_int_equal(append(c, s, &t, 0, 100), KVARN_OK);
    assert_int_equal(append(c, s, &t, 100, 50), KVARN_OK);
    check_contents(c, s, &t);
    float k[ROW];
    assert_int_equal(kvarn_cache_read(c, s, 0, 149, 1, k, NULL, 0), KVARN_OK);
    /* The tail holds H x (rotated in fp32, rounded to fp16) and the read
     * rotates back in fp32. Per head, with r = H x in double, L = log2 D,
     * g = L u (u = 2^-24; each fp32 transform: gamma_L sum|in| / sqrt(D) +
     * 2u |out|, see test_hadamard.c):
     *   e_j = g sum|x| / sqrt(D) + 2u |r_j|      (forward rotation)
     *       + 2^-11 (|r_j| + e_j) + 2^-25        (fp16: half an ulp)
     *   |k_i - x_i| <= sum_j e_j / sqrt(D)       (H is orthonormal)
     *               + g sum|r| / sqrt(D) + 2u |x_i| (back rotation). */
    const double u = ldexp(1.0, -24), g = 6 * u; /* L = log2(64) = 6 */
    for (int h = 0; h < HK; h++) {
        const float *x = t.k[0] + 149 * ROW + (size_t)h * D;
        double rj[D], l1x = 0.0, l1r = 0.0, se = 0.0;
        for (int j = 0; j < D; j++) {
            rj[j] = 0.0;
            for (int i = 0; i < D; i++)
                rj[j] += (__builtin_popcount((unsigned)(i & j)) & 1 ? -x[i] : x[i]) / sqrt((double)D);
            l1x += fabs(x[j]);
        }
        for (int j = 0; j < D; j++) {
            double e = g * l1x / sqrt((double)D) + 2 * u * fabs(rj[j]);
            e += ldexp(fabs(rj[j]) + e, -11) + ldexp(1.0, -25);
            se += e;
            l1r += fabs(rj[j]);
        }
        for (int i = 0; i < D; i++) {
            double bound = se / sqrt((double)D) + g * l1r / sqrt((double)D) + 2 * u * fabs(x[i]);
            assert_true(fabs(k[h * D + i] - x[i]) <= bound);
        }
    }
    tok_free(&t);
    kvarn_cache_destroy(c);
}

/* Rollback of never-committed tokens = never appending them: same contents,
 * same counters. */
static void rollback_case(const char *name)
{
    kvarn_cache *a = make(name, 16, 1, 12, 8, 2), *b = make(name, 16, 1, 12, 8, 2);
    test_rng r;
    test_rng_seed(&r, 41);
    tokens x = tok_new(120, &r, 1.0f), y = tok_new(40, &r, 1.0f);
    int sa, sb;
    assert_int_equal(kvarn_cache_seq_create(a, &sa), KVARN_OK);
    assert_int_equal(kvarn_cache_seq_create(b, &sb), KVARN_OK);
    /* a: X[0:70], commit 70, draft Y (40 tokens, over a tile boundary),
     * reject all but 3 of them... then all of them, then X[70:120] */
    assert_int_equal(append(a, sa, &x, 0, 70), KVARN_OK);
    assert_int_equal(kvarn_cache_commit(a, sa, 70), KVARN_OK);
    assert_int_equal(append(a, sa, &y, 0, 40), KVARN_OK);
    assert_int_equal(kvarn_cache_truncate(a, sa, 73), KVARN_OK);
    assert_int_equal(kvarn_cache_truncate(a, sa, 70), KVARN_OK);
    assert_int_equal(append(a, sa, &x, 70, 50), KVARN_OK);
    assert_int_equal(kvarn_cache_commit(a, sa, 120), KVARN_OK);
    /* b: X straight */
    assert_int_equal(append(b, sb, &x, 0, 70), KVARN_OK);
    assert_int_equal(kvarn_cache_commit(b, sb, 70), KVARN_OK);
    assert_int_equal(append(b, sb, &x, 70, 50), KVARN_OK);
    assert_int_equal(kvarn_cache_commit(b, sb, 120), KVARN_OK);
    check_contents(a, sa, &x);
    check_contents(b, sb, &x);
    float *ka = malloc(120 * ROW * 4), *kb = malloc(120 * ROW * 4);
    for (int l = 0; l < L; l++) {
        assert_int_equal(kvarn_cache_read(a, sa, l, 0, 120, ka, NULL, 0), KVARN_OK);
        assert_int_equal(kvarn_cache_read(b, sb, l, 0, 120, kb, NULL, 0), KVARN_OK);
        fx_assert_same(ka, kb, 120 * ROW * 4);
        assert_int_equal(kvarn_cache_read(a, sa, l, 0, 120, NULL, ka, 0), KVARN_OK);
        assert_int_equal(kvarn_cache_read(b, sb, l, 0, 120, NULL, kb, 0), KVARN_OK);
        fx_assert_same(ka, kb, 120 * ROW * 4);
    }
    kvarn_cache_stats s1, s2;
    kvarn_cache_seq_info i1, i2;
    assert_int_equal(kvarn_cache_get_stats(a, &s1), KVARN_OK);
    assert_int_equal(kvarn_cache_get_stats(b, &s2), KVARN_OK);
    fx_assert_same(&s1, &s2, sizeof s1);
    assert_int_equal(kvarn_cache_seq_get_info(a, sa, &i1), KVARN_OK);
    assert_int_equal(kvarn_cache_seq_get_info(b, sb, &i2), KVARN_OK);
    fx_assert_same(&i1, &i2, sizeof i1);
    free(ka);
    free(kb);
    tok_free(&x);
    tok_free(&y);
    kvarn_cache_destroy(a);
    kvarn_cache_destroy(b);
}

static void test_rollback_exact(void **state)
{
    (void)state;
    rollback_case("kvarn_k4v2_g32");
    rollback_case("int8");
    rollback_case("fp16");
}

/* KVarN refuses to cut into a quantized tile; per-token formats never do. */
static void test_truncate_into_committed(void **state)
{
    (void)state;
    test_rng r;
    test_rng_seed(&r, 51);
    { /* kvarn_k4v2_g32 */
        kvarn_cache *c = make("kvarn_k4v2_g32", 0, 1, 6, 6, 2);
        tokens t = tok_new(100, &r, 1.0f);
        int s;
        assert_int_equal(kvarn_cache_seq_create(c, &s), KVARN_OK);
        assert_int_equal(append(c, s, &t, 0, 100), KVARN_OK);
        assert_int_equal(kvarn_cache_commit(c, s, 100), KVARN_OK);
        kvarn_cache_seq_info before, after;
        kvarn_cache_stats sb, sa;
        assert_int_equal(kvarn_cache_seq_get_info(c, s, &before), KVARN_OK);
        assert_int_equal(before.frozen_len, 96);
        assert_int_equal(kvarn_cache_get_stats(c, &sb), KVARN_OK);
        const int32_t *tab;
        int nt;
        assert_int_equal(kvarn_cache_block_table(c, s, &tab, &nt), KVARN_OK);
        int32_t saved[8];
        memcpy(saved, tab, (size_t)nt * 4);
        for (int len = 0; len < 96; len += 17) {
            assert_int_equal(kvarn_cache_truncate(c, s, len), KVARN_ERR_STATE);
        }
        assert_int_equal(kvarn_cache_truncate(c, s, 95), KVARN_ERR_STATE);
        assert_int_equal(kvarn_cache_seq_get_info(c, s, &after), KVARN_OK);
        fx_assert_same(&before, &after, sizeof before);
        assert_int_equal(kvarn_cache_get_stats(c, &sa), KVARN_OK);
        fx_assert_same(&sb, &sa, sizeof sb);
        fx_assert_same(saved, tab, (size_t)nt * 4);
        check_contents(c, s, &t);
        /* writing into a quantized tile is refused too */
        assert_int_equal(kvarn_cache_write(c, s, 0, 90, 1, t.k[0], t.v[0]), KVARN_ERR_STATE);
        /* up to the end of the last quantized tile is fine */
        assert_int_equal(kvarn_cache_truncate(c, s, 96), KVARN_OK);
        assert_int_equal(kvarn_cache_seq_get_info(c, s, &after), KVARN_OK);
        assert_int_equal(after.seq_len, 96);
        assert_int_equal(after.n_tiles, 3);
        assert_int_equal(after.committed_len, 96);
        check_contents(c, s, &t);
        tok_free(&t);
        kvarn_cache_destroy(c);
    }
    { /* int4 */
        kvarn_cache *c = make("int4", 16, 0, 10, 0, 2);
        tokens t = tok_new(100, &r, 1.0f), u = tok_new(100, &r, 1.0f);
        int s;
        assert_int_equal(kvarn_cache_seq_create(c, &s), KVARN_OK);
        assert_int_equal(append(c, s, &t, 0, 100), KVARN_OK);
        assert_int_equal(kvarn_cache_commit(c, s, 100), KVARN_OK);
        assert_int_equal(kvarn_cache_truncate(c, s, 10), KVARN_OK);
        kvarn_cache_stats st;
        assert_int_equal(kvarn_cache_get_stats(c, &st), KVARN_OK);
        assert_int_equal(st.blocks_in_use, 1);
        /* new tokens after the first 10: expected = t[0:10] + u[10:40] */
        for (int l = 0; l < L; l++) {
            memcpy(u.k[l], t.k[l], 10 * ROW * 4);
            memcpy(u.v[l], t.v[l], 10 * ROW * 4);
        }
        assert_int_equal(append(c, s, &u, 10, 30), KVARN_OK);
        check_contents(c, s, &u);
        tok_free(&t);
        tok_free(&u);
        kvarn_cache_destroy(c);
    }
}

/* Fork, copy-on-write, free: nobody else's contents change; refcounts. */
static void fork_case(const char *name)
{
    kvarn_format fmt = fx_format(name);
    const int is_kv = fmt.kind == KVARN_KIND_KVARN;
    const int G = fx_block_size(&fmt, 32);
    kvarn_cache *c = make(name, 32, 1, 16, 10, 4);
    test_rng r;
    test_rng_seed(&r, 61);
    tokens tp = tok_new(200, &r, 1.0f), tc = tok_new(200, &r, 1.0f), tg = tok_new(200, &r, 1.0f);
    int p, ch, gc;
    assert_int_equal(kvarn_cache_seq_create(c, &p), KVARN_OK);
    assert_int_equal(append(c, p, &tp, 0, 80), KVARN_OK);      /* tiles 0, 1, 2 (partial) */
    assert_int_equal(kvarn_cache_commit(c, p, 80), KVARN_OK);  /* KVarN: tile 1 quantized */
    kvarn_cache_stats s0;
    assert_int_equal(kvarn_cache_get_stats(c, &s0), KVARN_OK);
    assert_int_equal(kvarn_cache_seq_fork(c, p, &ch), KVARN_OK);
    assert_int_not_equal(ch, p);
    kvarn_cache_stats s1;
    assert_int_equal(kvarn_cache_get_stats(c, &s1), KVARN_OK);
    /* fork allocates nothing; everything held is shared */
    assert_int_equal(s1.blocks_in_use, s0.blocks_in_use);
    assert_int_equal(s1.pages_in_use, s0.pages_in_use);
    assert_int_equal(s1.blocks_shared, s0.blocks_in_use);
    assert_int_equal(s1.pages_shared, s0.pages_in_use);
    assert_int_equal(s1.n_seqs, 2);
    assert_int_equal(s1.tokens, 160);
    const int32_t *tab_p, *tab_c;
    int nt;
    assert_int_equal(kvarn_cache_block_table(c, p, &tab_p, &nt), KVARN_OK);
    assert_int_equal(nt, 3);
    assert_int_equal(kvarn_cache_block_table(c, ch, &tab_c, &nt), KVARN_OK);
    fx_assert_same(tab_p, tab_c, 3 * 4);
    kvarn_seq_view sv;
    assert_int_equal(kvarn_cache_seq_view(c, ch, &sv), KVARN_OK);
    for (int i = 0; i < 3; i++) {
        int page = is_kv && (i < 1 || i >= sv.committed_tiles);
        assert_int_equal(page ? kvarn_cache_page_refs(c, tab_c[i]) : kvarn_cache_block_refs(c, tab_c[i]), 2);
    }
    const int32_t shared_tail = tab_p[2];

    /* child diverges: its own tokens from 80 on */
    for (int l = 0; l < L; l++) {
        memcpy(tc.k[l], tp.k[l], 80 * ROW * 4);
        memcpy(tc.v[l], tp.v[l], 80 * ROW * 4);
        memcpy(tg.k[l], tp.k[l], 80 * ROW * 4);
        memcpy(tg.v[l], tp.v[l], 80 * ROW * 4);
    }
    assert_int_equal(append(c, ch, &tc, 80, 30), KVARN_OK);
    assert_int_equal(kvarn_cache_block_table(c, ch, &tab_c, &nt), KVARN_OK);
    assert_int_equal(nt, 4);
    assert_int_not_equal(tab_c[2], shared_tail);          /* copied on write */
    assert_int_equal(tab_p[2], shared_tail);              /* parent keeps its own */
    assert_int_equal(tab_c[0], tab_p[0]);                 /* prefix still shared */
    assert_int_equal(tab_c[1], tab_p[1]);
    assert_int_equal(is_kv ? kvarn_cache_page_refs(c, shared_tail)
                           : kvarn_cache_block_refs(c, shared_tail), 1);
    check_contents(c, p, &tp);
    check_contents(c, ch, &tc);
    assert_int_equal(kvarn_cache_commit(c, ch, 110), KVARN_OK);
    check_contents(c, p, &tp);
    check_contents(c, ch, &tc);

    /* parent appends, grandchild forks the child */
    assert_int_equal(append(c, p, &tp, 80, 50), KVARN_OK);
    assert_int_equal(kvarn_cache_commit(c, p, 130), KVARN_OK);
    assert_int_equal(kvarn_cache_seq_fork(c, ch, &gc), KVARN_OK);
    for (int l = 0; l < L; l++) {
        memcpy(tg.k[l], tc.k[l], 110 * ROW * 4);
        memcpy(tg.v[l], tc.v[l], 110 * ROW * 4);
    }
    assert_int_equal(kvarn_cache_truncate(c, gc, is_kv ? 96 : 100), KVARN_OK);
    const int gstart = is_kv ? 96 : 100;
    assert_int_equal(append(c, gc, &tg, gstart, 40), KVARN_OK);
    assert_int_equal(kvarn_cache_commit(c, gc, gstart + 40), KVARN_OK);
    check_contents(c, p, &tp);
    check_contents(c, ch, &tc);
    check_contents(c, gc, &tg);

    /* every id's refcount equals the number of sequences whose table holds it */
    {
        int seqs[3] = {p, ch, gc};
        kvarn_cache_info ci;
        assert_int_equal(kvarn_cache_get_info(c, &ci), KVARN_OK);
        int *bcount = calloc((size_t)ci.n_blocks, sizeof(int));
        int *pcount = calloc((size_t)ci.n_pages + 1, sizeof(int));
        for (int q = 0; q < 3; q++) {
            assert_int_equal(kvarn_cache_seq_view(c, seqs[q], &sv), KVARN_OK);
            for (int i = 0; i < (sv.seq_len + G - 1) / G; i++) {
                int page = is_kv && (i < 1 || i >= sv.committed_tiles);
                if (page) pcount[sv.block_table[i]]++;
                else bcount[sv.block_table[i]]++;
            }
        }
        for (int i = 0; i < ci.n_blocks; i++)
            if (!is_kv) assert_int_equal(kvarn_cache_block_refs(c, i), bcount[i]);
        for (int i = 0; i < ci.n_pages; i++)
            assert_int_equal(kvarn_cache_page_refs(c, i), pcount[i]);
        free(bcount);
        free(pcount);
    }

    /* free the middle one: the others are unchanged */
    assert_int_equal(kvarn_cache_seq_free(c, ch), KVARN_OK);
    assert_int_equal(kvarn_cache_seq_free(c, ch), KVARN_ERR_INVALID_ARG);
    check_contents(c, p, &tp);
    check_contents(c, gc, &tg);
    assert_int_equal(kvarn_cache_seq_free(c, p), KVARN_OK);
    check_contents(c, gc, &tg);
    kvarn_cache_stats s2;
    assert_int_equal(kvarn_cache_get_stats(c, &s2), KVARN_OK);
    assert_int_equal(s2.blocks_shared, 0);
    assert_int_equal(s2.pages_shared, 0);
    kvarn_cache_seq_info gi;
    assert_int_equal(kvarn_cache_seq_get_info(c, gc, &gi), KVARN_OK);
    /* the grandchild holds one block per non-sink tile, pages for sink + tail */
    assert_int_equal(s2.blocks_in_use, is_kv ? gi.n_tiles - 1 : gi.n_tiles);
    assert_int_equal(s2.pages_in_use, is_kv ? gi.n_tiles - gi.quantized_tiles : 0);
    assert_int_equal(kvarn_cache_seq_free(c, gc), KVARN_OK);
    assert_int_equal(kvarn_cache_get_stats(c, &s2), KVARN_OK);
    assert_int_equal(s2.blocks_in_use, 0);
    assert_int_equal(s2.pages_in_use, 0);
    assert_int_equal(s2.n_seqs, 0);
    assert_int_equal(s2.tokens, 0);
    tok_free(&tp);
    tok_free(&tc);
    tok_free(&tg);
    kvarn_cache_destroy(c);
}

static void test_fork_cow_free(void **state)
{
    (void)state;
    fork_case("kvarn_k4v2_g32");
    fork_case("int8");
    fork_case("fp8_e4m3");
}

/* Exhaustion: a clear error and nothing changed (contents, tables, counters). */
typedef struct snapshot {
    kvarn_cache_stats st;
    kvarn_cache_seq_info si[3];
    int32_t tab[3][16];
} snapshot;

static snapshot snap(kvarn_cache *c, const int *seqs, int n)
{
    snapshot s;
    memset(&s, 0, sizeof s);
    assert_int_equal(kvarn_cache_get_stats(c, &s.st), KVARN_OK);
    for (int i = 0; i < n; i++) {
        const int32_t *t;
        int nt;
        assert_int_equal(kvarn_cache_seq_get_info(c, seqs[i], &s.si[i]), KVARN_OK);
        assert_int_equal(kvarn_cache_block_table(c, seqs[i], &t, &nt), KVARN_OK);
        assert_true(nt <= 16);
        memcpy(s.tab[i], t, (size_t)nt * 4);
    }
    return s;
}

static void test_exhaustion(void **state)
{
    (void)state;
    test_rng r;
    test_rng_seed(&r, 71);
    /* 6 blocks, 4 pages, 3 sequences */
    kvarn_cache *c = make("kvarn_k4v2_g32", 0, 1, 6, 4, 3);
    tokens ta = tok_new(400, &r, 1.0f), tb = tok_new(400, &r, 1.0f);
    int seqs[3];
    assert_int_equal(kvarn_cache_seq_create(c, &seqs[0]), KVARN_OK);
    assert_int_equal(kvarn_cache_seq_create(c, &seqs[1]), KVARN_OK);
    assert_int_equal(append(c, seqs[0], &ta, 0, 100), KVARN_OK);   /* 4 pages, 3 blocks */
    /* page pool is empty now: B cannot start */
    snapshot before = snap(c, seqs, 2);
    assert_int_equal(kvarn_cache_reserve(c, seqs[1], 1), KVARN_ERR_OUT_OF_BLOCKS);
    snapshot after = snap(c, seqs, 2);
    fx_assert_same(&before, &after, sizeof before);
    assert_int_equal(kvarn_cache_commit(c, seqs[0], 100), KVARN_OK); /* frees 2 pages */
    assert_int_equal(append(c, seqs[1], &tb, 0, 40), KVARN_OK);      /* 2 pages, 1 block */
    check_contents(c, seqs[0], &ta);
    check_contents(c, seqs[1], &tb);
    /* blocks: 4 used of 6, pages: 4 of 4 */
    before = snap(c, seqs, 2);
    assert_int_equal(before.st.blocks_free, 2);
    assert_int_equal(before.st.pages_free, 0);
    /* B needs a new tile (page + block): out of pages */
    assert_int_equal(kvarn_cache_reserve(c, seqs[1], 30), KVARN_ERR_OUT_OF_BLOCKS);
    /* A wants 100 more tokens (3 new tiles): out of blocks and pages */
    assert_int_equal(kvarn_cache_reserve(c, seqs[0], 100), KVARN_ERR_OUT_OF_BLOCKS);
    after = snap(c, seqs, 2);
    fx_assert_same(&before, &after, sizeof before);
    check_contents(c, seqs[0], &ta);
    check_contents(c, seqs[1], &tb);
    /* copy-on-write needs a page too: a fork that then writes fails cleanly */
    assert_int_equal(kvarn_cache_seq_fork(c, seqs[1], &seqs[2]), KVARN_OK);
    before = snap(c, seqs, 3);
    assert_int_equal(kvarn_cache_reserve(c, seqs[2], 1), KVARN_ERR_OUT_OF_BLOCKS);
    assert_int_equal(kvarn_cache_reserve(c, seqs[1], 1), KVARN_ERR_OUT_OF_BLOCKS);
    after = snap(c, seqs, 3);
    fx_assert_same(&before, &after, sizeof before);
    /* sequence slots exhausted */
    int x = 12345;
    assert_int_equal(kvarn_cache_seq_create(c, &x), KVARN_ERR_OUT_OF_BLOCKS);
    assert_int_equal(kvarn_cache_seq_fork(c, seqs[0], &x), KVARN_ERR_OUT_OF_BLOCKS);
    assert_int_equal(x, 12345);
    after = snap(c, seqs, 3);
    fx_assert_same(&before, &after, sizeof before);
    /* a freed fork gives the page back and B can go on */
    assert_int_equal(kvarn_cache_seq_free(c, seqs[2]), KVARN_OK);
    assert_int_equal(append(c, seqs[1], &tb, 40, 5), KVARN_OK);
    check_contents(c, seqs[1], &tb);
    check_contents(c, seqs[0], &ta);
    /* max_seq_len bounds a sequence */
    kvarn_cache_info ci;
    assert_int_equal(kvarn_cache_get_info(c, &ci), KVARN_OK);
    assert_int_equal(kvarn_cache_reserve(c, seqs[1], ci.max_seq_len), KVARN_ERR_OUT_OF_BLOCKS);
    tok_free(&ta);
    tok_free(&tb);
    kvarn_cache_destroy(c);

    /* per-token format: blocks only */
    c = make("int8", 16, 0, 5, 0, 2);
    tokens t = tok_new(100, &r, 1.0f);
    assert_int_equal(kvarn_cache_seq_create(c, &seqs[0]), KVARN_OK);
    assert_int_equal(append(c, seqs[0], &t, 0, 70), KVARN_OK); /* 5 blocks */
    before = snap(c, seqs, 1);
    assert_int_equal(kvarn_cache_reserve(c, seqs[0], 11), KVARN_ERR_OUT_OF_BLOCKS);
    after = snap(c, seqs, 1);
    fx_assert_same(&before, &after, sizeof before);
    assert_int_equal(append(c, seqs[0], &t, 70, 10), KVARN_OK); /* fills block 5 */
    check_contents(c, seqs[0], &t);
    tok_free(&t);
    kvarn_cache_destroy(c);
}

/* Scramble the free list so block tables are not contiguous. */
static void scrambled_case(const char *name)
{
    kvarn_format fmt = fx_format(name);
    const int G = fx_block_size(&fmt, 16);
    kvarn_cache *c = make(name, 16, 1, 24, 16, 6);
    test_rng r;
    test_rng_seed(&r, 81);
    tokens t[6];
    int s[6];
    for (int i = 0; i < 6; i++) t[i] = tok_new(8 * G, &r, 1.0f);
    for (int i = 0; i < 4; i++) assert_int_equal(kvarn_cache_seq_create(c, &s[i]), KVARN_OK);
    for (int round = 0; round < 3; round++)
        for (int i = 0; i < 4; i++) {
            assert_int_equal(append(c, s[i], &t[i], round * G, G), KVARN_OK);
            assert_int_equal(kvarn_cache_commit(c, s[i], (round + 1) * G), KVARN_OK);
        }
    assert_int_equal(kvarn_cache_seq_free(c, s[1]), KVARN_OK);
    assert_int_equal(kvarn_cache_seq_free(c, s[3]), KVARN_OK);
    assert_int_equal(kvarn_cache_seq_create(c, &s[4]), KVARN_OK);
    assert_int_equal(append(c, s[4], &t[4], 0, 5 * G + 3), KVARN_OK);
    assert_int_equal(kvarn_cache_commit(c, s[4], 5 * G + 3), KVARN_OK);
    kvarn_seq_view sv;
    assert_int_equal(kvarn_cache_seq_view(c, s[4], &sv), KVARN_OK);
    int jumps = 0;
    for (int i = 1; i < 6; i++) jumps += sv.block_table[i] != sv.block_table[i - 1] + 1;
    assert_true(jumps >= 2);
    check_contents(c, s[0], &t[0]);
    check_contents(c, s[2], &t[2]);
    check_contents(c, s[4], &t[4]);
    float *gk = malloc((size_t)(5 * G + 3) * ROW * 4), *gv = malloc((size_t)(5 * G + 3) * ROW * 4);
    float *ek = malloc((size_t)(5 * G + 3) * ROW * 4), *ev = malloc((size_t)(5 * G + 3) * ROW * 4);
    read_via_views(c, s[4], 1, gk, gv);
    assert_int_equal(kvarn_cache_read(c, s[4], 1, 0, 5 * G + 3, ek, ev, 0), KVARN_OK);
    fx_assert_same(gk, ek, (size_t)(5 * G + 3) * ROW * 4);
    fx_assert_same(gv, ev, (size_t)(5 * G + 3) * ROW * 4);
    free(gk);
    free(gv);
    free(ek);
    free(ev);
    for (int i = 0; i < 6; i++) tok_free(&t[i]);
    kvarn_cache_destroy(c);
}

static void test_scrambled_block_ids(void **state)
{
    (void)state;
    scrambled_case("kvarn_k4v2_g32");
    scrambled_case("int4");
}

static void test_slot_mapping(void **state)
{
    (void)state;
    test_rng r;
    test_rng_seed(&r, 91);
    kvarn_cache *c = make("kvarn_k4v2_g32", 0, 1, 6, 6, 2);
    tokens t = tok_new(100, &r, 1.0f);
    int s;
    assert_int_equal(kvarn_cache_seq_create(c, &s), KVARN_OK);
    assert_int_equal(append(c, s, &t, 0, 70), KVARN_OK);
    int64_t slots[70];
    const int32_t *tab;
    int nt;
    assert_int_equal(kvarn_cache_slot_mapping(c, s, 0, 70, slots), KVARN_OK);
    assert_int_equal(kvarn_cache_block_table(c, s, &tab, &nt), KVARN_OK);
    for (int j = 0; j < 70; j++) assert_int_equal(slots[j], (int64_t)tab[j / 32] * 32 + j % 32);
    /* the slot names the page the token lives in */
    kvarn_paged_kv kv;
    assert_int_equal(kvarn_cache_layer_view(c, 1, &kv), KVARN_OK);
    float want[D];
    fx_rot16(t.v[1] + 45 * ROW + D, want, D); /* token 45, head 1 */
    const uint16_t *pv = kv.fp16_pages + ((size_t)((slots[45] / 32) * HK + 1) * 2 + 1) * 32 * D +
                         (size_t)(slots[45] % 32) * D;
    for (int d = 0; d < D; d++) assert_true(kvarn_fp16_to_fp32(pv[d]) == want[d]);
    { /* kvarn_k4v2_g32 */
        assert_int_equal(kvarn_cache_commit(c, s, 70), KVARN_OK);
        assert_int_equal(kvarn_cache_slot_mapping(c, s, 30, 5, slots), KVARN_ERR_STATE);
        assert_int_equal(kvarn_cache_slot_mapping(c, s, 64, 6, slots), KVARN_OK);
        assert_int_equal(kvarn_cache_slot_mapping(c, s, 0, 32, slots), KVARN_OK); /* sink */
    }
    assert_int_equal(kvarn_cache_slot_mapping(c, s, 60, 11, slots), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_slot_mapping(c, s, -1, 1, slots), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_slot_mapping(c, s, 0, 1, NULL), KVARN_ERR_INVALID_ARG);
    tok_free(&t);
    kvarn_cache_destroy(c);

    c = make("int8", 16, 0, 8, 0, 2);
    t = tok_new(100, &r, 1.0f);
    assert_int_equal(kvarn_cache_seq_create(c, &s), KVARN_OK);
    assert_int_equal(append(c, s, &t, 0, 50), KVARN_OK);
    assert_int_equal(kvarn_cache_slot_mapping(c, s, 0, 50, slots), KVARN_OK);
    assert_int_equal(kvarn_cache_block_table(c, s, &tab, &nt), KVARN_OK);
    assert_int_equal(nt, 4);
    for (int j = 0; j < 50; j++) assert_int_equal(slots[j], (int64_t)tab[j / 16] * 16 + j % 16);
    tok_free(&t);
    kvarn_cache_destroy(c);
}

static void test_hostile_args(void **state)
{
    (void)state;
    test_rng r;
    test_rng_seed(&r, 101);
    kvarn_cache *c = make("kvarn_k4v2_g32", 0, 1, 6, 6, 3);
    tokens t = tok_new(100, &r, 1.0f);
    int s, s2;
    assert_int_equal(kvarn_cache_seq_create(c, &s), KVARN_OK);
    assert_int_equal(kvarn_cache_seq_create(c, &s2), KVARN_OK);
    assert_int_equal(kvarn_cache_seq_free(c, s2), KVARN_OK);
    assert_int_equal(append(c, s, &t, 0, 40), KVARN_OK);
    snapshot before = snap(c, &s, 1);
    float *k0 = t.k[0], *v0 = t.v[0];
    kvarn_cache_seq_info si;
    kvarn_seq_view sv;
    kvarn_paged_kv kv;
    float buf[ROW];
    const int32_t *tab;
    int nt;
    int64_t slot;
    /* NULL cache / bad or freed sequence ids */
    assert_int_equal(kvarn_cache_reserve(NULL, s, 1), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_seq_create(NULL, &s2), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_seq_create(c, NULL), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_seq_fork(c, s, NULL), KVARN_ERR_INVALID_ARG);
    const int bad_ids[] = {-1, 3, 1000, s2};
    for (size_t i = 0; i < 4; i++) {
        const int b = bad_ids[i];
        assert_int_equal(kvarn_cache_reserve(c, b, 1), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_cache_write(c, b, 0, 0, 1, k0, v0), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_cache_commit(c, b, 0), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_cache_truncate(c, b, 0), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_cache_seq_free(c, b), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_cache_seq_fork(c, b, &s2), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_cache_seq_get_info(c, b, &si), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_cache_seq_view(c, b, &sv), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_cache_block_table(c, b, &tab, &nt), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_cache_slot_mapping(c, b, 0, 1, &slot), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_cache_read(c, b, 0, 0, 1, buf, buf, 0), KVARN_ERR_INVALID_ARG);
    }
    /* layers, counts, ranges */
    assert_int_equal(kvarn_cache_reserve(c, s, -1), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_write(c, s, L, 0, 1, k0, v0), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_write(c, s, -1, 0, 1, k0, v0), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_write(c, s, 0, 0, -1, k0, v0), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_write(c, s, 0, 39, 2, k0, v0), KVARN_ERR_INVALID_ARG); /* past seq_len */
    assert_int_equal(kvarn_cache_write(c, s, 0, -1, 1, k0, v0), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_write(c, s, 0, 0, 1, NULL, v0), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_write(c, s, 0, 0, 1, k0, NULL), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_commit(c, s, 41), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_commit(c, s, -1), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_truncate(c, s, 41), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_truncate(c, s, -1), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_read(c, s, 2, 0, 1, buf, buf, 0), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_read(c, s, 0, 40, 1, buf, buf, 0), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_read(c, s, 0, 0, -1, buf, buf, 0), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_read(c, s, 0, 0, 1, buf, buf, 77u), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_layer_view(NULL, 0, &kv), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_layer_view(c, 0, NULL), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_seq_view(c, s, NULL), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_get_stats(c, NULL), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_get_info(NULL, NULL), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_block_refs(c, -1), -1);
    assert_int_equal(kvarn_cache_block_refs(c, 6), -1);
    assert_int_equal(kvarn_cache_page_refs(NULL, 0), -1);
    /* state errors */
    assert_int_equal(kvarn_cache_reserve(c, s, 10), KVARN_OK);
    /* layer 1 has written only 40 tokens: a gap, and commit past it */
    assert_int_equal(kvarn_cache_write(c, s, 1, 45, 1, k0, v0), KVARN_ERR_STATE);
    assert_int_equal(kvarn_cache_commit(c, s, 45), KVARN_ERR_STATE);
    /* non-finite input: refused, nothing written */
    float *kn = malloc(10 * ROW * 4);
    memcpy(kn, t.k[0] + 40 * ROW, 10 * ROW * 4);
    float before_k[10 * ROW], after_k[10 * ROW];
    assert_int_equal(kvarn_cache_read(c, s, 0, 40, 10, before_k, NULL, 0), KVARN_OK);
    kn[7 * ROW + 3] = NAN;
    assert_int_equal(kvarn_cache_write(c, s, 0, 40, 10, kn, t.v[0] + 40 * ROW), KVARN_ERR_NONFINITE);
    kn[7 * ROW + 3] = INFINITY;
    assert_int_equal(kvarn_cache_write(c, s, 0, 40, 10, kn, t.v[0] + 40 * ROW), KVARN_ERR_NONFINITE);
    kn[7 * ROW + 3] = 1e6f; /* finite, but beyond fp16 after rotation (1e6/8) */
    assert_int_equal(kvarn_cache_write(c, s, 0, 40, 10, kn, t.v[0] + 40 * ROW), KVARN_ERR_NONFINITE);
    assert_int_equal(kvarn_cache_read(c, s, 0, 40, 10, after_k, NULL, 0), KVARN_OK);
    fx_assert_same(before_k, after_k, sizeof before_k);
    kn[7 * ROW + 3] = 2e5f; /* 2e5 / 8 = 25000: fits */
    assert_int_equal(kvarn_cache_write(c, s, 0, 40, 10, kn, t.v[0] + 40 * ROW), KVARN_OK);
    free(kn);
    assert_int_equal(kvarn_cache_truncate(c, s, 40), KVARN_OK);
    snapshot after = snap(c, &s, 1);
    fx_assert_same(&before, &after, sizeof before);
    check_contents(c, s, &t);
    /* a fork between reserve and write: the shared tile is refused */
    assert_int_equal(kvarn_cache_reserve(c, s, 5), KVARN_OK);
    assert_int_equal(kvarn_cache_seq_fork(c, s, &s2), KVARN_OK);
    assert_int_equal(kvarn_cache_write(c, s, 0, 40, 5, t.k[0] + 40 * ROW, t.v[0] + 40 * ROW),
                     KVARN_ERR_STATE);
    /* zero-size calls are fine and change nothing */
    assert_int_equal(kvarn_cache_reserve(c, s, 0), KVARN_OK);
    assert_int_equal(kvarn_cache_write(c, s, 0, 45, 0, NULL, NULL), KVARN_OK);
    assert_int_equal(kvarn_cache_read(c, s, 0, 45, 0, NULL, NULL, 0), KVARN_OK);
    tok_free(&t);
    kvarn_cache_destroy(c);
}

/* Size arithmetic at the edges (issue 8): every option at INT32_MAX and
 * budget_bytes at UINT64_MAX either gives a plan whose numbers are the
 * exact products (checked here against sums formed independently) or is
 * refused at creation with a clear status, never wrapped or clamped. No
 * case below allocates more than a few KiB: the huge ones are plans or
 * refusals. */
static void test_size_edges(void **state)
{
    (void)state;
    kvarn_cache_info pi;
    kvarn_cache *c = (kvarn_cache *)&pi; /* sentinel: must stay */
    const kvarn_cache_opts good = fx_opts("int8", L, HK, D, 16, 0, 3, 0, 2);

    /* max_seq_len: up to KVARN_CACHE_MAX_SEQ_LEN is kept exactly, beyond
     * is refused (it was clamped to INT_MAX / 2 before: a sequence shorter
     * than asked for, found out only when reserve failed). */
    kvarn_cache_opts o = good;
    o.max_seq_len = KVARN_CACHE_MAX_SEQ_LEN;
    assert_int_equal(kvarn_cache_plan(&o, &pi), KVARN_OK);
    assert_int_equal(pi.max_seq_len, KVARN_CACHE_MAX_SEQ_LEN);
    const int too_long[] = {KVARN_CACHE_MAX_SEQ_LEN + 1, INT32_MAX};
    for (int i = 0; i < 2; i++) {
        o.max_seq_len = too_long[i];
        assert_int_equal(kvarn_cache_plan(&o, &pi), KVARN_ERR_TOO_LARGE);
        assert_int_equal(kvarn_cache_create(&o, &c), KVARN_ERR_TOO_LARGE);
        assert_ptr_equal(c, (kvarn_cache *)&pi);
    }

    /* every int option at INT32_MAX: refused, nothing created */
    kvarn_cache_opts bad[7];
    for (int i = 0; i < 7; i++) bad[i] = good;
    bad[0].n_layers = INT32_MAX;
    bad[1].n_kv_heads = INT32_MAX;
    bad[2].head_dim = INT32_MAX;
    bad[3].max_seqs = INT32_MAX;
    bad[4].block_size = INT32_MAX;
    bad[5] = fx_opts("kvarn_k4v2_g32", L, HK, D, 0, 1, 3, 4, 2);
    bad[5].n_pages = INT32_MAX;     /* more pages than ids */
    bad[6] = fx_opts("kvarn_k4v2_g32", L, HK, D, 0, 1, 3, 4, 2);
    bad[6].sink_tiles = INT32_MAX;
    const kvarn_status want[7] = {KVARN_ERR_INVALID_ARG, KVARN_ERR_INVALID_ARG,
                                  KVARN_ERR_UNSUPPORTED_HEAD_DIM, KVARN_ERR_INVALID_ARG,
                                  KVARN_ERR_INVALID_ARG, KVARN_ERR_TOO_LARGE,
                                  KVARN_ERR_INVALID_ARG};
    for (int i = 0; i < 7; i++) {
        assert_int_equal(kvarn_cache_plan(&bad[i], &pi), want[i]);
        assert_int_equal(kvarn_cache_create(&bad[i], &c), want[i]);
        assert_ptr_equal(c, (kvarn_cache *)&pi);
    }

    /* budget_bytes = UINT64_MAX buys 2^30 blocks (the id limit); the
     * totals are the exact products, and max_seq_len (auto) stops at the
     * sequence limit instead of wrapping. */
    kvarn_cache_opts k = fx_opts("kvarn_k4v2_g32", L, HK, D, 0, 1, 3, 4, 2);
    k.budget_bytes = UINT64_MAX;
    assert_int_equal(kvarn_cache_plan(&k, &pi), KVARN_OK);
    const uint64_t rec = kvarn_record_bytes(&k.format, D);
    const uint64_t block = (uint64_t)L * HK * rec, page = (uint64_t)L * HK * 2 * 32 * D * 2;
    assert_int_equal(pi.n_blocks, 1 << 30);
    assert_int_equal(pi.block_bytes, block);
    assert_int_equal(pi.page_bytes, page);
    assert_true(pi.arena_bytes == ((uint64_t)1 << 30) * block + 4 * page);
    assert_true(pi.capacity_tokens == ((uint64_t)1 << 30) * 32);
    assert_int_equal(pi.max_seq_len, KVARN_CACHE_MAX_SEQ_LEN);

    /* the largest geometry the option checks let through: 4096 layers x
     * 4096 KV heads x head_dim 256, G = 128: one page is 2^41 bytes; with
     * the auto page count of 10^6 sequences x 1026 tiles (under the id
     * limit) the page pool is ~2^71 bytes: refused, not wrapped. */
    kvarn_cache_opts big = fx_opts("kvarn_k4v2_g128", 1, 1, 256, 0, 1, 1, 1, 2);
    big.n_layers = 4096;
    big.n_kv_heads = 4096;
    big.max_seqs = 1000000;
    big.sink_tiles = 1024;
    big.n_pages = 0;
    big.budget_bytes = UINT64_MAX;
    assert_int_equal(kvarn_cache_plan(&big, &pi), KVARN_ERR_TOO_LARGE);
    assert_int_equal(kvarn_cache_create(&big, &c), KVARN_ERR_TOO_LARGE);
    assert_ptr_equal(c, (kvarn_cache *)&pi);
    /* ... while one page per sequence of it is a valid plan: 2^20 pages
     * would be 2^61 bytes; the sizing plan reports the page bytes exactly */
    big.max_seqs = 1;
    big.sink_tiles = 1;
    big.budget_bytes = 0;
    assert_int_equal(kvarn_cache_plan(&big, &pi), KVARN_OK);
    assert_true(pi.page_bytes == (uint64_t)4096 * 4096 * 2 * 128 * 256 * 2);
    assert_int_equal(pi.n_pages, 3);

    /* per-token formats at the block-size limit: block_bytes exact */
    kvarn_cache_opts pt = fx_opts("int8", 4096, 4096, 1024, 1024, 0, 1, 0, 1);
    pt.budget_bytes = 0;
    assert_int_equal(kvarn_cache_plan(&pt, &pi), KVARN_OK);
    const uint64_t tok = kvarn_record_bytes(&pt.format, 1024);
    assert_true(pi.block_bytes == (uint64_t)4096 * 4096 * 1024 * tok);
    pt.budget_bytes = UINT64_MAX;
    assert_int_equal(kvarn_cache_plan(&pt, &pi), KVARN_OK);
    assert_true((uint64_t)pi.n_blocks == UINT64_MAX / pi.block_bytes);
    assert_true(pi.arena_bytes == (uint64_t)pi.n_blocks * pi.block_bytes);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_create_and_geometry),
        cmocka_unit_test(test_kvarn_tail_exact),
        cmocka_unit_test(test_roundtrip_every_format),
        cmocka_unit_test(test_kvarn_sink_tail_commit),
        cmocka_unit_test(test_rollback_exact),
        cmocka_unit_test(test_truncate_into_committed),
        cmocka_unit_test(test_fork_cow_free),
        cmocka_unit_test(test_exhaustion),
        cmocka_unit_test(test_scrambled_block_ids),
        cmocka_unit_test(test_slot_mapping),
        cmocka_unit_test(test_hostile_args),
        cmocka_unit_test(test_size_edges),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
