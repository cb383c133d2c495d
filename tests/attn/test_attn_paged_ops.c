/* test_attn_paged_ops.c -- attention through a caller-owned arena filled
 * by kvarn_paged_store / kvarn_paged_commit (include/kvarn/paged_ops.h),
 * as a vLLM plug-in drives them: one sequence of 2.5 tiles is stored in
 * chunks into the padded, vLLM-shaped arena of tests/common/paged_arena.h,
 * tile 1 is committed into a block and its page is then scrubbed (freed by
 * the engine), and kvarn_attn_decode over a block table {sink page, block,
 * tail page} must equal double-precision attention over what the codec says
 * those tiles hold: the fp16 rounding of the rotated K/V for the sink and
 * tail pages, kvarn_decode(KVARN_DECODE_ROTATED) of the codec's own record
 * for the block. Per-token formats (int8, fp8_e4m3; padded token records)
 * the same way without pages: attention over kvarn_decode of each token's
 * kvarn_encode. The store/commit bytes themselves are
 * tests/cache/test_paged_ops.c. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "codec/cpu.h"
#include "common/int_dot_bound.h"
#include "common/paged_arena.h"
#include "common/paged_fixture.h"
#include "kvarn/attn.h"

enum { HK = 2, GROUP = 3, HQ = HK * GROUP };

static void check_format(const char *name, int D, uint64_t seed)
{
    pa_arena a;
    assert_int_equal(pa_make(&a, name, D, HK, 16, 4, 5), 0);
    const kvarn_paged_kv *kv = &a.kv;
    const int is_kvarn = kv->fmt.kind == KVARN_KIND_KVARN;
    const int G = kv->block_size, len = 2 * G + G / 2;
    assert_int_equal(kv->sink_tiles, is_kvarn ? 1 : 0);
    const size_t row = (size_t)HK * D;
    test_rng rng;
    test_rng_seed(&rng, seed);
    float *k = malloc(sizeof(float) * len * row), *v = malloc(sizeof(float) * len * row);
    for (size_t i = 0; i < (size_t)len * row; i++) {
        double chan = 1.0 + 2.0 * (double)((i % (size_t)D) % 9 == 0); /* outlier key channels */
        k[i] = (float)(chan * test_rng_normal(&rng));
        v[i] = (float)test_rng_normal(&rng);
    }
    /* KVarN: tile 0 -> page 3 (sink), tile 1 -> page 1 (committed into
     * block 2 below), tile 2 -> page 4 (tail, half full). Per-token
     * formats: the tiles go to blocks 3, 1, 2 directly. */
    const int32_t page_of[3] = {3, 1, is_kvarn ? 4 : 2};
    int64_t *slots = malloc(sizeof(int64_t) * (size_t)len);
    for (int t = 0; t < len; t++) slots[t] = kvarn_paged_slot(page_of[t / G], G, t % G);
    /* a prefill chunk ending inside tile 1, the rest of the prompt, then
     * two decode steps */
    const int cuts[5] = {0, G + 7, len - 2, len - 1, len};
    for (int c = 0; c < 4; c++)
        assert_int_equal(kvarn_paged_store(kv, k + (size_t)cuts[c] * row, v + (size_t)cuts[c] * row,
                                           slots + cuts[c], cuts[c + 1] - cuts[c]),
                         KVARN_OK);
    const int32_t src = 1, dst = 2;
    size_t cw = kvarn_paged_commit_workspace_bytes(kv);
    void *cws = malloc(cw + 1);
    if (is_kvarn) {
        assert_int_equal(kvarn_paged_commit(kv, &src, &dst, 1, NULL, cws, cw), KVARN_OK);
        /* the engine frees page 1: NaN there would show if attention read it */
        for (int h = 0; h < HK; h++)
            memset(kvarn_paged_page_k(kv, 1, h), 0xff, kvarn_paged_fp16_tile_bytes(G, D));
    }

    /* What attention must see, [len][Hk][D] (rotated basis for KVarN),
     * from the codec (paged_arena.h's oracles), not from the arena. */
    float *kd = malloc(sizeof(float) * len * row), *vd = malloc(sizeof(float) * len * row);
    size_t rb = a.L.record_bytes;
    uint8_t *rec = malloc(rb);
    uint16_t rk[512];
    for (int t = 0; t < len; t++) {
        if (is_kvarn && t / G == 1) continue;
        for (int h = 0; h < HK; h++) {
            const size_t at = (size_t)t * row + (size_t)h * D;
            if (!is_kvarn) {
                assert_int_equal(kvarn_encode(&kv->fmt, D, k + at, v + at, rec, rb, NULL, 0, NULL), KVARN_OK);
                assert_int_equal(kvarn_decode(&kv->fmt, D, rec, rb, kd + at, vd + at, 0), KVARN_OK);
                continue;
            }
            for (int which = 0; which < 2; which++) {
                pa_expect_page_row(rk, (which ? v : k) + at, D);
                for (int d = 0; d < D; d++) (which ? vd : kd)[at + d] = kvarn_fp16_to_fp32(rk[d]);
            }
        }
    }
    float *tk = malloc(sizeof(float) * (size_t)G * D), *tv = malloc(sizeof(float) * (size_t)G * D);
    for (int h = 0; is_kvarn && h < HK; h++) {
        pa_gather_tile(k, v, HK, D, h, G, G, tk, tv);
        assert_int_equal(pa_oracle_record(&kv->fmt, D, tk, tv, rec, rb, NULL), KVARN_OK);
        assert_int_equal(kvarn_decode(&kv->fmt, D, rec, rb, tk, tv, KVARN_DECODE_ROTATED), KVARN_OK);
        for (int t = 0; t < G; t++) {
            memcpy(kd + (size_t)(G + t) * row + (size_t)h * D, tk + (size_t)t * D, sizeof(float) * D);
            memcpy(vd + (size_t)(G + t) * row + (size_t)h * D, tv + (size_t)t * D, sizeof(float) * D);
        }
    }

    const int32_t table[3] = {3, 2, 4};
    const int32_t table_pt[3] = {3, 1, 2};
    kvarn_seq_view view = {is_kvarn ? table : table_pt, len, is_kvarn ? 2 : 3, 0, NULL};
    float *q = malloc(sizeof(float) * HQ * D), *out = malloc(sizeof(float) * HQ * D);
    for (int i = 0; i < HQ * D; i++) q[i] = (float)test_rng_normal(&rng);
    const double scale = 1.0 / sqrt((double)D);
    kvarn_attn_opts o = KVARN_ATTN_OPTS_DEFAULT((float)scale);
    kvarn_thread_pool *pool = NULL;
    if (test_threads(1) > 1) assert_int_equal(kvarn_thread_pool_create(test_threads(1), &pool), KVARN_OK);
    size_t wsz = kvarn_attn_workspace_bytes(kv, HQ, 1, 1, kvarn_thread_pool_size(pool), &o);
    assert_true(wsz > 0);
    void *ws = malloc(wsz);
    assert_int_equal(kvarn_attn_decode(kv, &view, 1, HQ, q, out, &o, pool, ws, wsz), KVARN_OK);
    kvarn_thread_pool_destroy(pool);

    paged_fixture ref; /* only the fields pf_ref_attention reads */
    memset(&ref, 0, sizeof ref);
    ref.fmt = kv->fmt;
    ref.D = D;
    ref.Hk = HK;
    ref.k_deq = &kd;
    ref.v_deq = &vd;
    double worst = 0.0;
    for (int h = 0; h < HQ; h++) {
        double r[512], mx = 0.0, err = 0.0;
        pf_ref_attention(&ref, 0, h, HQ, q + (size_t)h * D, scale, 0, len - 1, 1, r);
        for (int d = 0; d < D; d++) {
            mx = fmax(mx, fabs(r[d]));
            err = fmax(err, fabs(out[(size_t)h * D + d] - r[d]));
        }
        /* The bound of tests/attn/test_attn.c and test_attn_cache.c
         * (docs/attention.md "Tests"): relative error < 1e-4 against
         * double-precision attention over the format's own dequantized K/V.
         * A kernel reading the wrong tile (the scrubbed page, a canary row
         * of the tail page, tile 1 unquantized) is off by O(1) relative. */
        /* plus the integer dot products' derived error where the library
         * says a kernel multiplies in integers (tests/common/int_dot_bound.h;
         * vmax as in test_attn_cache.c) */
        const int kvh = h / (HQ / HK);
        double vmax = 0.0;
        for (int t = 0; t < len; t++) {
            double l1 = 0.0;
            for (int d = 0; d < D; d++) l1 += fabs(vd[(size_t)t * HK * D + (size_t)kvh * D + d]);
            vmax = fmax(vmax, l1 / sqrt((double)D));
        }
        const double ib = attn_int_dot_bound(kv, &view, kvh, q + (size_t)h * D, scale, 0, len - 1, vmax);
        worst = fmax(worst, err / fmax(mx, 1e-6));
        assert_true(err < 1e-4 * mx + ib);
    }
    print_message("  %-16s D=%3d  rel err vs dequantized %.2e\n", name, D, worst);

    free(ws); free(q); free(out); free(rec); free(tk); free(tv); free(kd); free(vd);
    free(cws); free(slots); free(k); free(v);
    pa_free(&a);
}

static void test_attention_through_arena(void **state)
{
    (void)state;
    const char *fmts[4] = {"kvarn_k4v2_g128", "kvarn_k4v4_g64", "int8", "fp8_e4m3"};
    for (int f = 0; f < 4; f++)
        for (int di = 0; di < 2; di++)
            check_format(fmts[f], di ? 128 : 64, 1300 + (uint64_t)(f * 2 + di));
    /* the largest KVarN head_dim (Gemma-4's global layers) */
    check_format("kvarn_k4v2_g128", 512, 1310);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_attention_through_arena),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
