/* test_paged_ops.c -- store and commit into caller-owned paged arenas
 * (include/kvarn/paged_ops.h, src/cache/paged_ops.c) with the padded,
 * vLLM-shaped views of tests/common/paged_arena.h:
 *   - KVarN (kvarn_k4v2_g128, kvarn_k4v4_g64; D = 64, 128; and
 *     kvarn_k4v2_g128 at D = 512): the fp16 page
 *     rows kvarn_paged_store writes and the records kvarn_paged_commit
 *     writes equal, byte for byte, what the codec gives (oracle below), at
 *     the view's addresses, and every other byte (padding, other heads,
 *     pages and blocks not named) keeps its canary;
 *   - per-token formats (int8, int4, fp8_e4m3): the token record is
 *     kvarn_encode of that token at block * G + offset;
 *   - negative slots and negative commit entries write nothing;
 *   - every error leaves both arenas byte for byte as they were.
 * Attention through such an arena is tests/attn/test_attn_paged_ops.c (the
 * cache stage's tests do not link the attention stage). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <cmocka.h>

#include "common/paged_arena.h"

enum { HK = 2 };

/* K with per-channel offsets and spread (post-RoPE keys have outlier
 * channels), V plain Gaussian; n tokens of [Hk][D]. */
static void fill_kv(test_rng *r, float *k, float *v, int n, int D)
{
    for (int t = 0; t < n; t++)
        for (int h = 0; h < HK; h++)
            for (int d = 0; d < D; d++) {
                size_t i = ((size_t)t * HK + h) * D + d;
                double chan = 1.0 + 3.0 * (double)((d * 5 + h) % 7 == 0);
                k[i] = (float)(chan * test_rng_normal(r) + 0.25 * ((d % 3) - 1));
                v[i] = (float)test_rng_normal(r);
            }
}

static void *ws_alloc(size_t n)
{
    void *p = malloc(n ? n : 1); /* malloc: 16-byte aligned on this ABI */
    assert_non_null(p);
    return p;
}

/* Store 2 tiles of one KV layer through a shuffled slot mapping with
 * padding entries, then commit them into blocks, for one KVarN format. */
static void check_kvarn_store_commit(const char *name, int D, uint64_t seed)
{
    pa_arena a;
    assert_int_equal(pa_make(&a, name, D, HK, 0, 3, 4), 0);
    const kvarn_paged_kv *kv = &a.kv;
    const int G = kv->block_size;
    assert_int_equal(kvarn_paged_check(kv), KVARN_OK);

    /* Tokens 0..2G-1 of a sequence: tile A (tokens [0, G)) goes to page 2,
     * tile B ([G, 2G)) to page 0. The engine's batch lists them in a
     * shuffled order with 3 padding entries (slot -1) whose K/V are NaN:
     * skipped, so neither checked nor written. */
    const int n_real = 2 * G, n = n_real + 3;
    test_rng rng;
    test_rng_seed(&rng, seed);
    float *k = malloc(sizeof(float) * (size_t)n_real * HK * D);
    float *v = malloc(sizeof(float) * (size_t)n_real * HK * D);
    fill_kv(&rng, k, v, n_real, D);
    int *order = malloc(sizeof(int) * (size_t)n);
    for (int j = 0; j < n; j++) order[j] = j < n_real ? j : -1;
    for (int i = n - 1; i > 0; i--) {
        int j = (int)test_rng_below(&rng, (uint32_t)(i + 1)), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    float *bk = malloc(sizeof(float) * (size_t)n * HK * D);
    float *bv = malloc(sizeof(float) * (size_t)n * HK * D);
    int64_t *slots = malloc(sizeof(int64_t) * (size_t)n);
    const size_t row = (size_t)HK * D;
    for (int j = 0; j < n; j++) {
        int t = order[j];
        if (t < 0) {
            slots[j] = -1;
            for (size_t e = 0; e < row; e++) bk[j * row + e] = bv[j * row + e] = NAN;
        } else {
            slots[j] = kvarn_paged_slot(t < G ? 2 : 0, G, t % G);
            memcpy(bk + j * row, k + (size_t)t * row, row * sizeof(float));
            memcpy(bv + j * row, v + (size_t)t * row, row * sizeof(float));
        }
    }
    uint8_t *want = pa_snapshot(&a);
    kvarn_paged_kv ev = pa_view_of(&a, want);
    assert_int_equal(pa_expect_store(&ev, bk, bv, slots, n), 0);
    /* two calls (a prefill chunk boundary inside a tile) */
    const int n1 = n / 3;
    assert_int_equal(kvarn_paged_store(kv, bk, bv, slots, n1), KVARN_OK);
    assert_int_equal(kvarn_paged_store(kv, bk + n1 * row, bv + n1 * row, slots + n1, n - n1),
                     KVARN_OK);
    assert_true(pa_equals(&a, want));

    /* Commit: (page 2 -> block 1), two skipped entries (a negative page,
     * a negative block; block 0 and the entry's page must stay as they
     * are), (page 0 -> block 2). opts with prerotated = 0: ignored. The
     * pages stay as they are. */
    const int32_t src[4] = {2, -1, 0, 0}, dst[4] = {1, 0, -1, 2};
    const size_t wsz = kvarn_paged_commit_workspace_bytes(kv);
    assert_true(wsz >= 2 * (size_t)G * D * sizeof(float));
    void *ws = ws_alloc(wsz);
    const kvarn_codec_opts opts = {8, 0, KVARN_RTN_MINMAX};
    assert_int_equal(kvarn_paged_commit(kv, src, dst, 4, &opts, ws, wsz), KVARN_OK);

    /* Oracle. kvarn_paged_store rounds the rotated K/V to fp16 and commit
     * encodes those fp16 values widened back (exact) with prerotated = 1.
     * kvarn_encode(prerotated = 0) would rotate the fp32 tile itself
     * (kvarn_hadamard_rows, the same operations as kvarn_hadamard row by
     * row) and encode it unrounded; the paged path differs from that by the
     * fp16 rounding only, so the oracle is: rotate with kvarn_hadamard, round
     * to fp16, encode with prerotated = 1 (pa_oracle_record).
     * test_commit_is_unrotated_encode checks the one case where that
     * rounding is exact: then it is kvarn_encode(prerotated = 0) itself. */
    const size_t rb = a.L.record_bytes;
    float *tk = malloc(sizeof(float) * (size_t)G * D), *tv = malloc(sizeof(float) * (size_t)G * D);
    uint8_t *rec = malloc(rb);
    for (int tile = 0; tile < 2; tile++)
        for (int h = 0; h < HK; h++) {
            pa_gather_tile(k, v, HK, D, h, tile * G, G, tk, tv);
            assert_int_equal(pa_oracle_record(&kv->fmt, D, tk, tv, rec, rb, NULL), KVARN_OK);
            memcpy(kvarn_paged_record(&ev, tile == 0 ? 1 : 2, h), rec, rb);
        }
    assert_true(pa_equals(&a, want));

    free(rec); free(tk); free(tv); free(ws);
    free(want); free(slots); free(bk); free(bv); free(order); free(k); free(v);
    pa_free(&a);
}

static void test_kvarn_store_commit(void **state)
{
    (void)state;
    const char *fmts[2] = {"kvarn_k4v2_g128", "kvarn_k4v4_g64"};
    for (int f = 0; f < 2; f++)
        for (int di = 0; di < 2; di++)
            check_kvarn_store_commit(fmts[f], di ? 128 : 64, 700 + (uint64_t)(f * 2 + di));
    /* the largest KVarN head_dim (Gemma-4's global layers) */
    check_kvarn_store_commit("kvarn_k4v2_g128", 512, 710);
}

/* D = 64, where the fp16 rounding of the paged path can be made exact: y
 * on the grid k/64, |y| <= 4 (fp16 holds it: 2^-6 steps need 9 bits below
 * 4 = 2^2), x = H y / 8 (butterfly sums of 64 multiples of 2^-6 below 256:
 * 14 bits, exact in fp32; 1/sqrt(64) = 1/8 exact). Then kvarn_hadamard(x) =
 * H H y / 64 = y exactly (sums of multiples of 2^-9 below 2048: 20 bits),
 * the store writes fp16(y) = y, and the committed record must equal
 * kvarn_encode(prerotated = 0) of the fp32 tile x. */
static void test_commit_is_unrotated_encode(void **state)
{
    (void)state;
    const int D = 64;
    const char *fmts[2] = {"kvarn_k4v2_g128", "kvarn_k4v4_g64"};
    for (int f = 0; f < 2; f++) {
        pa_arena a;
        assert_int_equal(pa_make(&a, fmts[f], D, HK, 0, 2, 2), 0);
        const int G = a.kv.block_size;
        const size_t row = (size_t)HK * D;
        test_rng rng;
        test_rng_seed(&rng, 31 + (uint64_t)f);
        float *k = malloc(sizeof(float) * G * row), *v = malloc(sizeof(float) * G * row);
        int64_t *slots = malloc(sizeof(int64_t) * (size_t)G);
        for (int t = 0; t < G; t++) {
            slots[t] = kvarn_paged_slot(1, G, t);
            for (int h = 0; h < HK; h++) {
                float *xk = k + t * row + (size_t)h * D, *xv = v + t * row + (size_t)h * D;
                float yk[64], yv[64];
                for (int d = 0; d < D; d++) {
                    xk[d] = yk[d] = (float)((int)test_rng_below(&rng, 513) - 256) / 64.0f;
                    xv[d] = yv[d] = (float)((int)test_rng_below(&rng, 513) - 256) / 64.0f;
                }
                kvarn_hadamard(xk, D);
                kvarn_hadamard(xv, D);
                /* the derivation above, checked */
                float zk[64], zv[64];
                memcpy(zk, xk, sizeof zk);
                memcpy(zv, xv, sizeof zv);
                kvarn_hadamard(zk, D);
                kvarn_hadamard(zv, D);
                assert_memory_equal(zk, yk, sizeof zk);
                assert_memory_equal(zv, yv, sizeof zv);
            }
        }
        assert_int_equal(kvarn_paged_store(&a.kv, k, v, slots, G), KVARN_OK);
        const int32_t src = 1, dst = 0;
        size_t wsz = kvarn_paged_commit_workspace_bytes(&a.kv);
        void *ws = ws_alloc(wsz);
        assert_int_equal(kvarn_paged_commit(&a.kv, &src, &dst, 1, NULL, ws, wsz), KVARN_OK);
        size_t rb = a.L.record_bytes, ew = kvarn_encode_workspace_bytes(&a.kv.fmt, D);
        uint8_t *rec = malloc(rb);
        void *ews = ws_alloc(ew);
        float *tk = malloc(sizeof(float) * (size_t)G * D), *tv = malloc(sizeof(float) * (size_t)G * D);
        for (int h = 0; h < HK; h++) {
            pa_gather_tile(k, v, HK, D, h, 0, G, tk, tv);
            assert_int_equal(kvarn_encode(&a.kv.fmt, D, tk, tv, rec, rb, ews, ew, NULL), KVARN_OK);
            assert_memory_equal(kvarn_paged_record(&a.kv, 0, h), rec, rb);
        }
        free(tk); free(tv); free(ews); free(rec); free(ws); free(slots); free(k); free(v);
        pa_free(&a);
    }
}

/* Per-token formats: each token record is kvarn_encode of that token, at
 * block * G + offset of the slot mapping; padding entries skipped. */
static void test_per_token_store(void **state)
{
    (void)state;
    const char *fmts[3] = {"int8", "int4", "fp8_e4m3"};
    const int G = 16, NB = 4, n_real = 40, n = n_real + 4;
    for (int f = 0; f < 3; f++)
        for (int di = 0; di < 2; di++) {
            const int D = di ? 128 : 64;
            const size_t row = (size_t)HK * D;
            pa_arena a;
            assert_int_equal(pa_make(&a, fmts[f], D, HK, G, NB, 0), 0);
            assert_null(a.kv.fp16_pages);
            assert_int_equal(kvarn_paged_check(&a.kv), KVARN_OK);
            assert_int_equal(kvarn_paged_commit_workspace_bytes(&a.kv), 0);
            test_rng rng;
            test_rng_seed(&rng, 900 + (uint64_t)(f * 2 + di));
            /* distinct random slots out of all NB * G; 4 padding entries */
            int64_t perm[NB * 16];
            for (int i = 0; i < NB * G; i++) perm[i] = i;
            for (int i = NB * G - 1; i > 0; i--) {
                int j = (int)test_rng_below(&rng, (uint32_t)(i + 1));
                int64_t t = perm[i];
                perm[i] = perm[j];
                perm[j] = t;
            }
            int64_t slots[44];
            float *k = malloc(sizeof(float) * n * row), *v = malloc(sizeof(float) * n * row);
            fill_kv(&rng, k, v, n, D);
            for (int j = 0, r = 0; j < n; j++) {
                if (j % 11 == 5) { /* padding: NaN data, skipped */
                    slots[j] = -1 - j;
                    for (size_t e = 0; e < row; e++) k[j * row + e] = v[j * row + e] = NAN;
                } else {
                    slots[j] = perm[r++];
                }
            }
            uint8_t *want = pa_snapshot(&a);
            kvarn_paged_kv ev = pa_view_of(&a, want);
            assert_int_equal(pa_expect_store(&ev, k, v, slots, n), 0);
            assert_int_equal(kvarn_paged_store(&a.kv, k, v, slots, n), KVARN_OK);
            assert_true(pa_equals(&a, want));
            /* commit is a KVarN operation */
            const int32_t src = 0, dst = 0;
            uint8_t ws[64];
            assert_int_equal(kvarn_paged_commit(&a.kv, &src, &dst, 1, NULL, ws, sizeof ws),
                             KVARN_ERR_INVALID_ARG);
            assert_true(pa_equals(&a, want));
            free(want); free(k); free(v);
            pa_free(&a);
        }
}

/* A view mutation and the status kvarn_paged_check must give for it. */
typedef struct bad_view {
    const char *what;
    int kvarn_only, token_only;
    kvarn_status want;
} bad_view;

static void mutate(kvarn_paged_kv *kv, int i, const pa_arena *a)
{
    const size_t tile16 = kvarn_paged_fp16_tile_bytes(kv->block_size, kv->head_dim);
    switch (i) {
    case 0: kv->n_kv_heads = 0; break;
    case 1: kv->n_blocks = -1; break;
    case 2: kv->sink_tiles = -1; break;
    case 3: kv->blocks = NULL; break;
    case 4: kv->head_dim = 96; break; /* not a power of two: no KVarN */
    case 5: kv->head_dim = 63; break; /* odd: no per-token format */
    case 6: kv->block_size = kv->fmt.tile_tokens / 2; break; /* KVarN: != tile */
    case 7: kv->block_size = 0; break;
    case 8: kv->block_size = 1025; break;
    case 9: kv->record_stride = a->L.record_bytes - 1; break;                 /* KVarN */
    case 10: kv->record_stride = (size_t)kv->block_size * kv->token_record_bytes - 1; break;
    case 11: kv->token_record_bytes = a->L.record_bytes - 1; break;
    case 12: kv->block_stride = (size_t)kv->n_kv_heads * kv->record_stride - 1; break;
    case 13: kv->record_stride = SIZE_MAX / 2 + 1; break; /* Hk * stride wraps */
    case 14: kv->fp16_pages = NULL; break;
    case 15: kv->n_fp16_pages = -1; break;
    case 16: kv->fp16_pages = (uint16_t *)(void *)((uint8_t *)kv->fp16_pages + 1); break;
    case 17: kv->page_head_stride = tile16 + 1; kv->page_stride = 4 * tile16; break;
    case 18: kv->page_stride = (size_t)kv->n_kv_heads * kv->page_head_stride + 1; break;
    case 19: kv->page_head_stride = tile16 - 2; break;
    case 20: kv->page_stride = (size_t)kv->n_kv_heads * kv->page_head_stride - 2; break;
    case 21: kv->page_head_stride = SIZE_MAX / 2 + 1; break; /* Hk * stride wraps */
    default: break;
    }
}

static const bad_view bad_views[] = {
    {"n_kv_heads 0", 0, 0, KVARN_ERR_INVALID_ARG},
    {"n_blocks -1", 0, 0, KVARN_ERR_INVALID_ARG},
    {"sink_tiles -1", 0, 0, KVARN_ERR_INVALID_ARG},
    {"blocks NULL", 0, 0, KVARN_ERR_INVALID_ARG},
    {"head_dim 96", 1, 0, KVARN_ERR_UNSUPPORTED_HEAD_DIM},
    {"head_dim 63", 0, 1, KVARN_ERR_UNSUPPORTED_HEAD_DIM},
    {"block_size != tile", 1, 0, KVARN_ERR_INVALID_ARG},
    {"block_size 0", 0, 1, KVARN_ERR_INVALID_ARG},
    {"block_size 1025", 0, 1, KVARN_ERR_INVALID_ARG},
    {"record_stride < record", 1, 0, KVARN_ERR_INVALID_ARG},
    {"record_stride < G token records", 0, 1, KVARN_ERR_INVALID_ARG},
    {"token_record_bytes < record", 0, 1, KVARN_ERR_INVALID_ARG},
    {"block_stride < Hk * record_stride", 0, 0, KVARN_ERR_INVALID_ARG},
    {"Hk * record_stride wraps", 0, 0, KVARN_ERR_INVALID_ARG},
    {"fp16_pages NULL", 1, 0, KVARN_ERR_INVALID_ARG},
    {"n_fp16_pages -1", 1, 0, KVARN_ERR_INVALID_ARG},
    {"fp16_pages odd address", 1, 0, KVARN_ERR_INVALID_ARG},
    {"page_head_stride odd", 1, 0, KVARN_ERR_INVALID_ARG},
    {"page_stride odd", 1, 0, KVARN_ERR_INVALID_ARG},
    {"page_head_stride < tile", 1, 0, KVARN_ERR_INVALID_ARG},
    {"page_stride < Hk * page_head_stride", 1, 0, KVARN_ERR_INVALID_ARG},
    {"Hk * page_head_stride wraps", 1, 0, KVARN_ERR_INVALID_ARG},
};

/* Every failing call returns its status and leaves both arenas as they
 * were: a KVarN arena with two stored pages (one full) and a committed
 * block, and an int8 arena with stored tokens. */
static void check_errors(const char *name, int D)
{
    pa_arena a;
    assert_int_equal(pa_make(&a, name, D, HK, 8, 3, 3), 0);
    const kvarn_paged_kv *kv = &a.kv;
    const int is_kvarn = kv->fmt.kind == KVARN_KIND_KVARN;
    const int G = kv->block_size;
    const int n_ids = is_kvarn ? kv->n_fp16_pages : kv->n_blocks;
    const size_t row = (size_t)HK * D;
    const int n = G + 3;
    test_rng rng;
    test_rng_seed(&rng, 4242);
    float *k = malloc(sizeof(float) * n * row), *v = malloc(sizeof(float) * n * row);
    fill_kv(&rng, k, v, n, D);
    int64_t *slots = malloc(sizeof(int64_t) * (size_t)n);
    for (int j = 0; j < n; j++) slots[j] = j < G ? kvarn_paged_slot(1, G, j) : kvarn_paged_slot(0, G, j - G);
    assert_int_equal(kvarn_paged_store(kv, k, v, slots, n), KVARN_OK);
    size_t wsz = kvarn_paged_commit_workspace_bytes(kv);
    void *ws = ws_alloc(wsz);
    const int32_t ok_src[1] = {1}, ok_dst[1] = {2};
    if (is_kvarn) assert_int_equal(kvarn_paged_commit(kv, ok_src, ok_dst, 1, NULL, ws, wsz), KVARN_OK);
    uint8_t *snap = pa_snapshot(&a);

    /* slot ids: the first tokens are valid, the last is not; nothing of
     * the valid ones may be written either (checked before writing) */
    const int64_t bad_slots[] = {kvarn_paged_slot(n_ids, G, 0), kvarn_paged_slot(n_ids, G, G - 1),
                                 (int64_t)n_ids * G + 100000, INT64_MAX};
    for (size_t i = 0; i < sizeof bad_slots / sizeof bad_slots[0]; i++) {
        int64_t s2[3] = {kvarn_paged_slot(2, G, 0), kvarn_paged_slot(0, G, 4), bad_slots[i]};
        assert_int_equal(kvarn_paged_store(kv, k, v, s2, 3), KVARN_ERR_INVALID_ARG);
        assert_true(pa_equals(&a, snap));
    }
    /* a KVarN view whose tail lives in small pages (0 < T < G): slots
     * number whole pages only, so the store refuses it, n_tokens == 0
     * included (regression: the small pages were ignored and the tokens
     * written to whole pages the attention then does not read) */
    if (is_kvarn) {
        kvarn_paged_kv small = *kv;
        small.tail_page_tokens = G / 2;
        assert_int_equal(kvarn_paged_store(&small, k, v, slots, n), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_paged_store(&small, k, v, slots, 0), KVARN_ERR_INVALID_ARG);
        assert_true(pa_equals(&a, snap));
        small.tail_page_tokens = G; /* whole pages: accepted, and a no-op here */
        assert_int_equal(kvarn_paged_store(&small, k, v, slots, 0), KVARN_OK);
    }
    /* NaN / Inf in k or v of the last token of a batch (KVARN_ERR_NONFINITE) */
    const float bad_vals[3] = {NAN, INFINITY, -INFINITY};
    for (int which = 0; which < 2; which++)
        for (int bi = 0; bi < 3; bi++) {
            float *x = which ? v : k;
            size_t at = 2 * row + (size_t)(HK - 1) * D + (size_t)(D - 1);
            float keep = x[at];
            x[at] = bad_vals[bi];
            int64_t s2[3] = {kvarn_paged_slot(2, G, 0), kvarn_paged_slot(0, G, 4), kvarn_paged_slot(2, G, 1)};
            assert_int_equal(kvarn_paged_store(kv, k, v, s2, 3), KVARN_ERR_NONFINITE);
            assert_true(pa_equals(&a, snap));
            x[at] = keep;
        }
    if (is_kvarn) {
        /* A vector whose rotation leaves fp16's range: x = c e_0 has every
         * rotated component c / sqrt(D); fp16 rounds |y| >= 65520 (the tie
         * above its largest finite value, 65504) to Inf. c / sqrt(D) =
         * 1.01 * 65520 must be refused; c / sqrt(D) = 60000 (norm c beyond
         * 65504, so the store's exact check runs, components finite in fp16)
         * must be stored. */
        float *x1 = calloc(row, sizeof(float)), *y1 = calloc(row, sizeof(float));
        x1[(size_t)(HK - 1) * D] = (float)(1.01 * 65520.0 * sqrt((double)D));
        int64_t s1 = kvarn_paged_slot(2, G, 3);
        assert_int_equal(kvarn_paged_store(kv, x1, y1, &s1, 1), KVARN_ERR_NONFINITE);
        assert_true(pa_equals(&a, snap));
        assert_int_equal(kvarn_paged_store(kv, y1, x1, &s1, 1), KVARN_ERR_NONFINITE);
        assert_true(pa_equals(&a, snap));
        x1[(size_t)(HK - 1) * D] = (float)(60000.0 * sqrt((double)D));
        uint8_t *want = pa_snapshot(&a);
        kvarn_paged_kv ev = pa_view_of(&a, want);
        assert_int_equal(pa_expect_store(&ev, x1, y1, &s1, 1), 0);
        assert_int_equal(kvarn_paged_store(kv, x1, y1, &s1, 1), KVARN_OK);
        assert_true(pa_equals(&a, want));
        uint16_t top = kvarn_paged_page_k(kv, 2, HK - 1)[(size_t)3 * D];
        assert_true(kvarn_fp16_to_fp32(top) > 59000.0f && kvarn_fp16_to_fp32(top) < 65505.0f);
        free(snap);
        snap = want;
        free(x1); free(y1);
    }

    /* bad views: check, store, commit, workspace size */
    for (int i = 0; i < (int)(sizeof bad_views / sizeof bad_views[0]); i++) {
        if ((bad_views[i].kvarn_only && !is_kvarn) || (bad_views[i].token_only && is_kvarn)) continue;
        kvarn_paged_kv bv = *kv;
        mutate(&bv, i, &a);
        if (kvarn_paged_check(&bv) != bad_views[i].want)
            print_error("%s D=%d: %s: check gave %d\n", name, D, bad_views[i].what,
                        (int)kvarn_paged_check(&bv));
        assert_int_equal(kvarn_paged_check(&bv), bad_views[i].want);
        assert_int_equal(kvarn_paged_store(&bv, k, v, slots, 2), bad_views[i].want);
        assert_int_equal(kvarn_paged_commit_workspace_bytes(&bv), 0);
        if (is_kvarn)
            assert_int_equal(kvarn_paged_commit(&bv, ok_src, ok_dst, 1, NULL, ws, wsz),
                             bad_views[i].want);
        assert_true(pa_equals(&a, snap));
    }
    assert_int_equal(kvarn_paged_check(NULL), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_paged_store(NULL, k, v, slots, 1), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_paged_commit_workspace_bytes(NULL), 0);
    assert_int_equal(kvarn_paged_commit(NULL, ok_src, ok_dst, 1, NULL, ws, wsz), KVARN_ERR_INVALID_ARG);

    /* NULL with n > 0, n < 0; n = 0 is a no-op even with NULL arrays */
    assert_int_equal(kvarn_paged_store(kv, NULL, v, slots, 1), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_paged_store(kv, k, NULL, slots, 1), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_paged_store(kv, k, v, NULL, 1), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_paged_store(kv, k, v, slots, -1), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_paged_store(kv, NULL, NULL, NULL, 0), KVARN_OK);
    assert_true(pa_equals(&a, snap));

    if (is_kvarn) {
        assert_int_equal(kvarn_paged_commit(kv, NULL, ok_dst, 1, NULL, ws, wsz), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_paged_commit(kv, ok_src, NULL, 1, NULL, ws, wsz), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_paged_commit(kv, ok_src, ok_dst, -1, NULL, ws, wsz), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_paged_commit(kv, NULL, NULL, 0, NULL, NULL, 0), KVARN_OK);
        /* workspace */
        assert_int_equal(kvarn_paged_commit(kv, ok_src, ok_dst, 1, NULL, ws, wsz - 1),
                         KVARN_ERR_BUFFER_TOO_SMALL);
        assert_int_equal(kvarn_paged_commit(kv, ok_src, ok_dst, 1, NULL, NULL, wsz),
                         KVARN_ERR_BUFFER_TOO_SMALL);
        assert_true(pa_equals(&a, snap));
        /* ids beyond the arenas, after a valid entry: nothing written */
        const int32_t bsrc[3][2] = {{1, kv->n_fp16_pages}, {1, 0}, {1, INT32_MAX}};
        const int32_t bdst[3][2] = {{0, 0}, {0, kv->n_blocks}, {0, 1}};
        for (int i = 0; i < 3; i++) {
            assert_int_equal(kvarn_paged_commit(kv, bsrc[i], bdst[i], 2, NULL, ws, wsz),
                             KVARN_ERR_INVALID_ARG);
            assert_true(pa_equals(&a, snap));
        }
        /* bad codec options (balance_iters outside [0, 64]): refused
         * whether or not any entry is committed (regression: with every
         * entry skipped they were accepted) */
        const kvarn_codec_opts bo[2] = {{65, 1, KVARN_RTN_MINMAX}, {-1, 1, KVARN_RTN_MINMAX}};
        const int32_t skip[1] = {-1};
        for (int i = 0; i < 2; i++) {
            assert_int_equal(kvarn_paged_commit(kv, ok_src, ok_dst, 1, &bo[i], ws, wsz),
                             KVARN_ERR_INVALID_ARG);
            assert_int_equal(kvarn_paged_commit(kv, skip, skip, 1, &bo[i], ws, wsz),
                             KVARN_ERR_INVALID_ARG);
            assert_true(pa_equals(&a, snap));
        }
        /* a workspace that is not 16-byte aligned (paged_ops.h) is refused,
         * not used (regression: the encoder's fp32 scratch was laid on it,
         * a misaligned access UBSan stops at) */
        uint8_t *wbig = ws_alloc(wsz + 16);
        for (int mis = 1; mis < 16; mis += 7) {
            assert_int_equal(kvarn_paged_commit(kv, ok_src, ok_dst, 1, NULL, wbig + mis, wsz),
                             KVARN_ERR_INVALID_ARG);
            assert_true(pa_equals(&a, snap));
        }
        free(wbig);
    } else {
        assert_int_equal(kvarn_paged_commit(kv, ok_src, ok_dst, 1, NULL, ws, 0), KVARN_ERR_INVALID_ARG);
        assert_true(pa_equals(&a, snap));
    }
    free(snap); free(ws); free(slots); free(k); free(v);
    pa_free(&a);
}

static void test_errors_leave_arenas_intact(void **state)
{
    (void)state;
    check_errors("kvarn_k4v4_g64", 64);
    check_errors("kvarn_k4v2_g128", 128);
    check_errors("int8", 64);
    check_errors("fp8_e4m3", 128);
}

/* Per-token formats: a finite value the format cannot hold (its fp16 field
 * would overflow: fp16 values beyond 65504, an int8/int4 zero-point below
 * -65504, an fp8 scale amax / fp8_max beyond 65504; -1e8 is all of these)
 * is refused by kvarn_encode with KVARN_ERR_NONFINITE. kvarn_paged_store
 * must refuse the whole batch the same way before writing any token: here
 * the bad token comes after two good ones. (Regression: the store checked
 * only isfinite for per-token formats, so it wrote the good tokens and then
 * failed in kvarn_encode, leaving a partly stored batch.) */
static void test_per_token_unstorable_finite(void **state)
{
    (void)state;
    const char *fmts[4] = {"int8", "int4", "fp8_e4m3", "fp16"};
    const int D = 64, G = 8;
    const size_t row = (size_t)HK * D;
    for (int f = 0; f < 4; f++) {
        pa_arena a;
        assert_int_equal(pa_make(&a, fmts[f], D, HK, G, 2, 0), 0);
        test_rng rng;
        test_rng_seed(&rng, 55 + (uint64_t)f);
        float *k = malloc(sizeof(float) * 3 * row), *v = malloc(sizeof(float) * 3 * row);
        fill_kv(&rng, k, v, 3, D);
        for (int which = 0; which < 2; which++) {
            float *x = (which ? v : k) + 2 * row + (size_t)(HK - 1) * D + 7;
            const float keep = *x;
            *x = -1e8f;
            /* the codec's own verdict on that token-head */
            uint8_t rec[1024];
            const float *kk = k + 2 * row + (size_t)(HK - 1) * D, *vv = v + 2 * row + (size_t)(HK - 1) * D;
            assert_int_equal(kvarn_encode(&a.kv.fmt, D, kk, vv, rec, sizeof rec, NULL, 0, NULL),
                             KVARN_ERR_NONFINITE);
            uint8_t *snap = pa_snapshot(&a);
            const int64_t slots[3] = {kvarn_paged_slot(1, G, 0), kvarn_paged_slot(0, G, 3),
                                      kvarn_paged_slot(1, G, 1)};
            assert_int_equal(kvarn_paged_store(&a.kv, k, v, slots, 3), KVARN_ERR_NONFINITE);
            assert_true(pa_equals(&a, snap));
            free(snap);
            *x = keep;
        }
        free(k); free(v);
        pa_free(&a);
    }
}

/* A NaN in an fp16 page (a caller writing pages by hand) stops the commit
 * at that tile with KVARN_ERR_NONFINITE; the tiles before it are written,
 * the one with the NaN and the ones after it are not. */
static void test_commit_nonfinite_page(void **state)
{
    (void)state;
    const int D = 64;
    pa_arena a;
    assert_int_equal(pa_make(&a, "kvarn_k4v2_g64", D, HK, 0, 3, 3), 0);
    const kvarn_paged_kv *kv = &a.kv;
    const int G = kv->block_size;
    const size_t row = (size_t)HK * D;
    test_rng rng;
    test_rng_seed(&rng, 77);
    float *k = malloc(sizeof(float) * 3 * G * row), *v = malloc(sizeof(float) * 3 * G * row);
    fill_kv(&rng, k, v, 3 * G, D);
    int64_t *slots = malloc(sizeof(int64_t) * 3 * (size_t)G);
    for (int t = 0; t < 3 * G; t++) slots[t] = t; /* pages 0, 1, 2 in order */
    assert_int_equal(kvarn_paged_store(kv, k, v, slots, 3 * G), KVARN_OK);
    kvarn_paged_page_v(kv, 1, 0)[5] = 0x7e00; /* fp16 quiet NaN, head 0 of page 1 */
    uint8_t *want = pa_snapshot(&a);
    kvarn_paged_kv ev = pa_view_of(&a, want);
    size_t rb = a.L.record_bytes;
    uint8_t *rec = malloc(rb);
    float *tk = malloc(sizeof(float) * (size_t)G * D), *tv = malloc(sizeof(float) * (size_t)G * D);
    for (int h = 0; h < HK; h++) {
        pa_gather_tile(k, v, HK, D, h, 0, G, tk, tv);
        assert_int_equal(pa_oracle_record(&kv->fmt, D, tk, tv, rec, rb, NULL), KVARN_OK);
        memcpy(kvarn_paged_record(&ev, 2, h), rec, rb);
    }
    const int32_t src[3] = {0, 1, 2}, dst[3] = {2, 0, 1};
    size_t wsz = kvarn_paged_commit_workspace_bytes(kv);
    void *ws = ws_alloc(wsz);
    assert_int_equal(kvarn_paged_commit(kv, src, dst, 3, NULL, ws, wsz), KVARN_ERR_NONFINITE);
    assert_true(pa_equals(&a, want));
    free(ws); free(tk); free(tv); free(rec); free(want); free(slots); free(k); free(v);
    pa_free(&a);
}

/* Staging below fp16 on a caller's arena (the vLLM plug-in's pool): with a
 * record staging (int8, fp8_e4m3, int4: format `fmt`) and padded token
 * records, the store writes kvarn_encode(fmt) of each rotated token at
 * kvarn_paged_page_rec (every other page byte keeps its canary) and the
 * commit writes kvarn_encode(prerotated = 1) of those records decoded
 * (kvarn_decode of fmt): the same rule as kvarn_cache's own record staging
 * (test_cache_staging.c). */
static void check_staging_store_commit(int staging, const char *fmt)
{
    const int D = 64;
    pa_arena a;
    assert_int_equal(pa_make(&a, "kvarn_k4v2_g128", D, HK, 0, 2, 3), 0);
    kvarn_paged_kv *kv = &a.kv;
    const int G = kv->block_size;
    kvarn_format i8; /* the staging's per-token format */
    assert_int_equal(kvarn_format_parse(fmt, &i8), KVARN_OK);
    const size_t r8 = kvarn_record_bytes(&i8, D);
    /* a staging page: G token records of r8 + 3 bytes per KV head, padded */
    free(a.pages);
    kv->staging = staging;
    kv->staging_record_bytes = r8 + 3;
    kv->page_head_stride = (size_t)G * kv->staging_record_bytes + PA_PHEAD_PAD;
    kv->page_stride = (size_t)HK * kv->page_head_stride + PA_PAGE_PAD;
    a.pages_bytes = (size_t)kv->n_fp16_pages * kv->page_stride;
    a.pages = malloc(a.pages_bytes + 2);
    assert_non_null(a.pages);
    pa_fill_canary((uint8_t *)a.pages, a.pages_bytes);
    kv->fp16_pages = a.pages;
    assert_int_equal(kvarn_paged_check(kv), KVARN_OK);
    /* a record shorter than the format's is refused */
    kvarn_paged_kv bad = *kv;
    bad.staging_record_bytes = r8 - 1;
    assert_int_not_equal(kvarn_paged_check(&bad), KVARN_OK);

    /* one tile (page 1), stored in two calls with a padding entry */
    const size_t row = (size_t)HK * D;
    test_rng rng;
    test_rng_seed(&rng, 4242);
    float *k = malloc(sizeof(float) * (G + 1) * row), *v = malloc(sizeof(float) * (G + 1) * row);
    fill_kv(&rng, k, v, G + 1, D);
    int64_t *slots = malloc(sizeof(int64_t) * (size_t)(G + 1));
    for (int t = 0; t < G; t++) slots[t] = kvarn_paged_slot(1, G, t);
    slots[G] = -1;
    uint8_t *want = pa_snapshot(&a);
    kvarn_paged_kv ev = pa_view_of(&a, want);
    float rk[64], rv[64];
    for (int t = 0; t < G; t++)
        for (int h = 0; h < HK; h++) {
            memcpy(rk, k + t * row + (size_t)h * D, sizeof rk);
            memcpy(rv, v + t * row + (size_t)h * D, sizeof rv);
            kvarn_hadamard(rk, D);
            kvarn_hadamard(rv, D);
            uint8_t rec[512];
            assert_true(r8 <= sizeof rec);
            assert_int_equal(kvarn_encode(&i8, D, rk, rv, rec, r8, NULL, 0, NULL), KVARN_OK);
            memcpy(kvarn_paged_page_rec(&ev, 1, h, t), rec, r8);
        }
    assert_int_equal(kvarn_paged_store(kv, k, v, slots, 50), KVARN_OK);
    assert_int_equal(kvarn_paged_store(kv, k + 50 * row, v + 50 * row, slots + 50, G + 1 - 50),
                     KVARN_OK);
    assert_true(pa_equals(&a, want));

    /* commit page 1 -> block 0 */
    const int32_t src = 1, dst = 0;
    const size_t wsz = kvarn_paged_commit_workspace_bytes(kv);
    void *ws = ws_alloc(wsz);
    assert_int_equal(kvarn_paged_commit(kv, &src, &dst, 1, NULL, ws, wsz), KVARN_OK);
    const size_t rb = a.L.record_bytes, ew = kvarn_encode_workspace_bytes(&kv->fmt, D);
    float *tk = malloc(sizeof(float) * (size_t)G * D), *tv = malloc(sizeof(float) * (size_t)G * D);
    uint8_t *rec = malloc(rb);
    void *ews = ws_alloc(ew);
    kvarn_codec_opts co = KVARN_CODEC_OPTS_DEFAULT;
    co.prerotated = 1;
    for (int h = 0; h < HK; h++) {
        for (int t = 0; t < G; t++)
            assert_int_equal(kvarn_decode(&i8, D, kvarn_paged_page_rec(&ev, 1, h, t), r8,
                                          tk + (size_t)t * D, tv + (size_t)t * D, 0), KVARN_OK);
        assert_int_equal(kvarn_encode(&kv->fmt, D, tk, tv, rec, rb, ews, ew, &co), KVARN_OK);
        memcpy(kvarn_paged_record(&ev, 0, h), rec, rb);
    }
    assert_true(pa_equals(&a, want));
    free(ews); free(rec); free(tk); free(tv); free(ws); free(want); free(slots); free(k); free(v);
    pa_free(&a);
}

static void test_staging_store_commit(void **state)
{
    (void)state;
    check_staging_store_commit(KVARN_STAGING_INT8, "int8");
    check_staging_store_commit(KVARN_STAGING_FP8_E4M3, "fp8_e4m3");
    check_staging_store_commit(KVARN_STAGING_INT4, "int4");
}

/* kvarn_paged_commit_exact (the direct path of a prefill chunk's whole
 * tiles): the record of each tile is kvarn_encode(prerotated = 0) of the
 * chunk's exact fp32 K/V of its G rows, bit for bit (the codec's own
 * record of that tile, no staging rounding), at the view's address; every
 * other byte (pages, padding, blocks not named, skipped entries) keeps its
 * canary. opts' prerotated is ignored. And it is not what the staged path
 * writes: kvarn_paged_commit of the same tokens' fp16 page differs. */
static void check_commit_exact(const char *name, int D, uint64_t seed)
{
    pa_arena a;
    assert_int_equal(pa_make(&a, name, D, HK, 0, 4, 2), 0);
    const kvarn_paged_kv *kv = &a.kv;
    const int G = kv->block_size;
    /* a chunk of 2G + 9 rows: tile A = rows [3, 3 + G) -> block 2, tile B
     * = rows [G + 5, 2G + 5) -> block 0 (the tiles may overlap in rows:
     * the call takes rows, not positions); two skipped entries */
    const int n = 2 * G + 9;
    const size_t row = (size_t)HK * D;
    test_rng rng;
    test_rng_seed(&rng, seed);
    float *k = malloc(sizeof(float) * (size_t)n * row), *v = malloc(sizeof(float) * (size_t)n * row);
    fill_kv(&rng, k, v, n, D);
    const int32_t rows[4] = {3, -1, G + 5, 0}, dst[4] = {2, 1, 0, -1};
    uint8_t *want = pa_snapshot(&a);
    kvarn_paged_kv ev = pa_view_of(&a, want);
    const size_t rb = a.L.record_bytes, ew = kvarn_encode_workspace_bytes(&kv->fmt, D);
    float *tk = malloc(sizeof(float) * (size_t)G * D), *tv = malloc(sizeof(float) * (size_t)G * D);
    uint8_t *rec = malloc(rb);
    void *ews = ws_alloc(ew);
    for (int i = 0; i < 4; i += 2)
        for (int h = 0; h < HK; h++) {
            pa_gather_tile(k, v, HK, D, h, rows[i], G, tk, tv);
            assert_int_equal(kvarn_encode(&kv->fmt, D, tk, tv, rec, rb, ews, ew, NULL), KVARN_OK);
            memcpy(kvarn_paged_record(&ev, dst[i], h), rec, rb);
        }
    const size_t wsz = kvarn_paged_commit_workspace_bytes(kv);
    void *ws = ws_alloc(wsz);
    const kvarn_codec_opts opts = {8, 1, KVARN_RTN_MINMAX}; /* prerotated 1: ignored */
    assert_int_equal(kvarn_paged_commit_exact(kv, k, v, n, rows, dst, 4, &opts, ws, wsz), KVARN_OK);
    assert_true(pa_equals(&a, want));
    /* NULL opts: the defaults, the same bytes */
    assert_int_equal(kvarn_paged_commit_exact(kv, k, v, n, rows, dst, 4, NULL, ws, wsz), KVARN_OK);
    assert_true(pa_equals(&a, want));

    /* the staged path of tile A: its rows stored into page 1 (fp16) and
     * committed into block 3 differ from the direct record */
    int64_t *slots = malloc(sizeof(int64_t) * (size_t)G);
    for (int t = 0; t < G; t++) slots[t] = kvarn_paged_slot(1, G, t);
    assert_int_equal(kvarn_paged_store(kv, k + 3 * row, v + 3 * row, slots, G), KVARN_OK);
    const int32_t src = 1, b3 = 3;
    assert_int_equal(kvarn_paged_commit(kv, &src, &b3, 1, NULL, ws, wsz), KVARN_OK);
    int differ = 0;
    for (int h = 0; h < HK; h++)
        differ |= memcmp(kvarn_paged_record(kv, 3, h), kvarn_paged_record(kv, 2, h), rb) != 0;
    assert_true(differ);

    free(slots); free(ws); free(ews); free(rec); free(tk); free(tv); free(want); free(k); free(v);
    pa_free(&a);
}

static void test_commit_exact(void **state)
{
    (void)state;
    const char *fmts[2] = {"kvarn_k4v2_g128", "kvarn_k4v4_g64"};
    for (int f = 0; f < 2; f++)
        for (int di = 0; di < 2; di++)
            check_commit_exact(fmts[f], di ? 128 : 64, 1700 + (uint64_t)(f * 2 + di));
    check_commit_exact("kvarn_k4v2_g128", 512, 1710);
}

/* kvarn_paged_commit_exact's refusals: each returns its status and leaves
 * the arena byte for byte as it was, including when a valid tile comes
 * before the bad one (everything is checked before anything is written). */
static void test_commit_exact_errors(void **state)
{
    (void)state;
    const int D = 64;
    pa_arena a;
    assert_int_equal(pa_make(&a, "kvarn_k4v2_g64", D, HK, 0, 3, 2), 0);
    const kvarn_paged_kv *kv = &a.kv;
    const int G = kv->block_size, n = 2 * G;
    const size_t row = (size_t)HK * D;
    test_rng rng;
    test_rng_seed(&rng, 4343);
    float *k = malloc(sizeof(float) * (size_t)n * row), *v = malloc(sizeof(float) * (size_t)n * row);
    fill_kv(&rng, k, v, n, D);
    const size_t wsz = kvarn_paged_commit_workspace_bytes(kv);
    uint8_t *wbig = ws_alloc(wsz + 16);
    void *ws = wbig;
    const int32_t rows[2] = {0, G}, dst[2] = {1, 2};
    uint8_t *snap = pa_snapshot(&a);
    /* NULLs with n_tiles > 0, negative counts; n_tiles 0 is a no-op */
    assert_int_equal(kvarn_paged_commit_exact(NULL, k, v, n, rows, dst, 2, NULL, ws, wsz),
                     KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_paged_commit_exact(kv, NULL, v, n, rows, dst, 2, NULL, ws, wsz),
                     KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_paged_commit_exact(kv, k, NULL, n, rows, dst, 2, NULL, ws, wsz),
                     KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_paged_commit_exact(kv, k, v, n, NULL, dst, 2, NULL, ws, wsz),
                     KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_paged_commit_exact(kv, k, v, n, rows, NULL, 2, NULL, ws, wsz),
                     KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_paged_commit_exact(kv, k, v, n, rows, dst, -1, NULL, ws, wsz),
                     KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_paged_commit_exact(kv, k, v, -1, rows, dst, 2, NULL, ws, wsz),
                     KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_paged_commit_exact(kv, NULL, NULL, 0, NULL, NULL, 0, NULL, NULL, 0),
                     KVARN_OK);
    assert_true(pa_equals(&a, snap));
    /* rows or blocks beyond the arrays, after a valid entry */
    const int32_t brows[4][2] = {{0, G + 1}, {0, n}, {0, INT32_MAX}, {0, G}};
    const int32_t bdst[4][2] = {{1, 2}, {1, 2}, {1, 2}, {1, kv->n_blocks}};
    for (int i = 0; i < 4; i++) {
        assert_int_equal(kvarn_paged_commit_exact(kv, k, v, n, brows[i], bdst[i], 2, NULL, ws, wsz),
                         KVARN_ERR_INVALID_ARG);
        assert_true(pa_equals(&a, snap));
    }
    /* fewer rows than the tiles need */
    assert_int_equal(kvarn_paged_commit_exact(kv, k, v, 2 * G - 1, rows, dst, 2, NULL, ws, wsz),
                     KVARN_ERR_INVALID_ARG);
    /* workspace: too small, NULL, misaligned */
    assert_int_equal(kvarn_paged_commit_exact(kv, k, v, n, rows, dst, 2, NULL, ws, wsz - 1),
                     KVARN_ERR_BUFFER_TOO_SMALL);
    assert_int_equal(kvarn_paged_commit_exact(kv, k, v, n, rows, dst, 2, NULL, NULL, wsz),
                     KVARN_ERR_BUFFER_TOO_SMALL);
    assert_int_equal(kvarn_paged_commit_exact(kv, k, v, n, rows, dst, 2, NULL, wbig + 4, wsz),
                     KVARN_ERR_INVALID_ARG);
    /* bad codec options, refused even when every entry is skipped */
    const kvarn_codec_opts bo = {65, 0, KVARN_RTN_MINMAX}, br = {8, 0, 7};
    const int32_t skip[2] = {-1, -1};
    assert_int_equal(kvarn_paged_commit_exact(kv, k, v, n, rows, dst, 2, &bo, ws, wsz),
                     KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_paged_commit_exact(kv, k, v, n, skip, dst, 2, &bo, ws, wsz),
                     KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_paged_commit_exact(kv, k, v, n, rows, dst, 2, &br, ws, wsz),
                     KVARN_ERR_INVALID_ARG);
    assert_true(pa_equals(&a, snap));
    /* NaN / Inf in the second tile, a value whose rotation leaves fp16:
     * KVARN_ERR_NONFINITE, the first tile not written either */
    const float bad_vals[4] = {NAN, INFINITY, -INFINITY, 0.0f};
    for (int which = 0; which < 2; which++)
        for (int bi = 0; bi < 4; bi++) {
            /* the last token-head of the second tile */
            float *x = (which ? v : k) + (size_t)(2 * G - 1) * row + (size_t)(HK - 1) * D;
            float keep[64];
            memcpy(keep, x, sizeof keep);
            if (bi < 3) {
                x[5] = bad_vals[bi];
            } else { /* x = c e_5: every rotated component is c / sqrt(D) */
                for (int d = 0; d < D; d++) x[d] = 0.0f;
                x[5] = (float)(1.01 * 65520.0 * sqrt((double)D));
            }
            assert_int_equal(kvarn_paged_commit_exact(kv, k, v, n, rows, dst, 2, NULL, ws, wsz),
                             KVARN_ERR_NONFINITE);
            assert_true(pa_equals(&a, snap));
            memcpy(x, keep, sizeof keep);
        }
    /* bad views: kvarn_paged_check's status */
    for (int i = 0; i < (int)(sizeof bad_views / sizeof bad_views[0]); i++) {
        if (bad_views[i].token_only) continue;
        kvarn_paged_kv bv = *kv;
        mutate(&bv, i, &a);
        assert_int_equal(kvarn_paged_commit_exact(&bv, k, v, n, rows, dst, 2, NULL, ws, wsz),
                         bad_views[i].want);
        assert_true(pa_equals(&a, snap));
    }
    free(snap); free(wbig); free(k); free(v);
    pa_free(&a);

    /* a per-token format has no tiles to commit */
    assert_int_equal(pa_make(&a, "int8", D, HK, 8, 2, 0), 0);
    float z[8 * HK * 64] = {0};
    const int32_t r0 = 0, b0 = 0;
    uint8_t w[64];
    assert_int_equal(kvarn_paged_commit_exact(&a.kv, z, z, 8, &r0, &b0, 1, NULL, w, sizeof w),
                     KVARN_ERR_INVALID_ARG);
    pa_free(&a);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kvarn_store_commit),
        cmocka_unit_test(test_commit_is_unrotated_encode),
        cmocka_unit_test(test_per_token_store),
        cmocka_unit_test(test_errors_leave_arenas_intact),
        cmocka_unit_test(test_per_token_unstorable_finite),
        cmocka_unit_test(test_commit_nonfinite_page),
        cmocka_unit_test(test_staging_store_commit),
        cmocka_unit_test(test_commit_exact),
        cmocka_unit_test(test_commit_exact_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
