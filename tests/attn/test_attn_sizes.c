/* test_attn_sizes.c -- the attention workspace size at the edges of its
 * int arguments (issue 8): kvarn_attn_workspace_bytes forms every count in
 * 64 bits with checked products, so a geometry whose workspace does not fit
 * size_t gives 0 (and the calls KVARN_ERR_TOO_LARGE, before reading any
 * sequence), never a wrapped small size; a geometry that fits gives a size
 * that grows with its arguments. Views only: nothing here reads an arena. */
#define KVARN_EXPERIMENTAL_API /* the testing knobs (attn.h, cache.h) */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include "kvarn/attn.h"

/* A layer view with this geometry and no arenas (the workspace depends on
 * the geometry only). */
static kvarn_paged_kv view(const char *format, int n_kv_heads)
{
    kvarn_paged_kv kv;
    memset(&kv, 0, sizeof kv);
    assert_int_equal(kvarn_format_parse(format, &kv.fmt), KVARN_OK);
    kv.head_dim = 64;
    kv.n_kv_heads = n_kv_heads;
    kv.block_size = kv.fmt.kind == KVARN_KIND_KVARN ? kv.fmt.tile_tokens : 16;
    kv.sink_tiles = kv.fmt.kind == KVARN_KIND_KVARN ? 1 : 0;
    return kv;
}

static void test_workspace_overflow_is_refused(void **state)
{
    (void)state;
    kvarn_attn_opts split = KVARN_ATTN_OPTS_DEFAULT(0.125f);
    kvarn_attn_testing knobs = {1024, 0, 0, 0, 0};
    split.testing = &knobs;
    const int H = 1 << 30;
    /* work items: 2^30 KV heads x (2^31 sequences + 2^31 / 256 query
     * blocks) ~ 2^61, times 1024 split chunks: beyond 64 bits */
    kvarn_paged_kv kv = view("int8", H);
    assert_int_equal(kvarn_attn_workspace_bytes(&kv, H, INT32_MAX, INT32_MAX, 1, &split), 0);
    /* per-worker scratch: GQA group 2^30 rows x 64 channels x 3 arrays ~
     * 2^38 floats per worker, times INT32_MAX workers: beyond 64 bits */
    kvarn_paged_kv one = view("kvarn_k4v2_g128", 1);
    assert_int_equal(kvarn_attn_workspace_bytes(&one, H, 1, 1, INT32_MAX, NULL), 0);
    /* the query array itself (2^31 queries x 2^30 heads x 64 floats)
     * cannot exist: 0 */
    assert_int_equal(kvarn_attn_workspace_bytes(&kv, H, 1, INT32_MAX, 1, NULL), 0);

    /* the calls say so, before reading any sequence or query (the
     * sequence array here has one element, the count says INT32_MAX) */
    kvarn_seq_view sv;
    memset(&sv, 0, sizeof sv);
    float q[64] = {0}, out[64], sentinel[64];
    for (int i = 0; i < 64; i++) out[i] = sentinel[i] = -7.0f;
    char ws[256];
    assert_int_equal(kvarn_attn_decode(&kv, &sv, INT32_MAX, H, q, out, &split, NULL, ws,
                                       sizeof ws),
                     KVARN_ERR_TOO_LARGE);
    assert_memory_equal(out, sentinel, sizeof out);
    int32_t qsl[2] = {0, INT32_MAX};
    assert_int_equal(kvarn_attn_multi(&kv, &sv, 1, qsl, H, q, out, NULL, NULL, ws, sizeof ws),
                     KVARN_ERR_TOO_LARGE);
    assert_memory_equal(out, sentinel, sizeof out);
}

/* Record and block strides whose products wrap: Hk x record_stride and
 * block_size x token_record_bytes are checked products in check_kv, so a
 * view whose heads would overlap (or reach outside the block) through a
 * wrapped product is refused, not read. Hk = 3 and record_stride =
 * SIZE_MAX / 3 + 2: 3 x record_stride wraps to 5 bytes. */
static void test_stride_products_do_not_wrap(void **state)
{
    (void)state;
    static uint8_t arena[4096];
    kvarn_attn_opts o = KVARN_ATTN_OPTS_DEFAULT(0.125f);
    for (int f = 0; f < 2; f++) {
        kvarn_paged_kv kv = view(f ? "kvarn_k4v2_g128" : "int8", 3);
        kv.blocks = arena;
        kv.n_blocks = 1;
        kv.token_record_bytes = kv.fmt.kind == KVARN_KIND_KVARN ? 0 : kvarn_record_bytes(&kv.fmt, 64);
        kv.record_stride = SIZE_MAX / 3 + 2;
        kv.block_stride = 64;
        size_t ws_bytes = kvarn_attn_workspace_bytes(&kv, 3, 1, 1, 1, &o);
        assert_true(ws_bytes > 0 && ws_bytes <= 1 << 20);
        static char ws[1 << 20];
        int32_t table[1] = {0};
        kvarn_seq_view sv = {table, 1, 0, 0, NULL};
        float q[3 * 64] = {0}, out[3 * 64], sentinel[3 * 64];
        for (int i = 0; i < 3 * 64; i++) out[i] = sentinel[i] = -7.0f;
        assert_int_equal(kvarn_attn_decode(&kv, &sv, 1, 3, q, out, &o, NULL, ws, ws_bytes),
                         KVARN_ERR_INVALID_ARG);
        assert_memory_equal(out, sentinel, sizeof out);
    }
}

static void test_workspace_large_but_valid(void **state)
{
    (void)state;
    /* 2^31 - 1 decode sequences of one KV head: fits. The workspace holds
     * at least one work item and one group entry per sequence, each at
     * least 4 bytes (an int), so it is at least 8 * INT32_MAX bytes: a
     * wrapped or truncated size would be below that. */
    kvarn_paged_kv kv = view("int8", 1);
    kvarn_attn_opts o = KVARN_ATTN_OPTS_DEFAULT(0.125f);
    kvarn_attn_testing no_split = {1, 0, 0, 0, 0};
    o.testing = &no_split;
    size_t big = kvarn_attn_workspace_bytes(&kv, 1, INT32_MAX, INT32_MAX, 1, &o);
    size_t half = kvarn_attn_workspace_bytes(&kv, 1, INT32_MAX / 2, INT32_MAX / 2, 1, &o);
    assert_true(big >= (size_t)8 * INT32_MAX);
    assert_true(half > 0 && half < big);
    /* INT32_MAX workers of a small geometry: fits too (~64 KiB each) */
    size_t many = kvarn_attn_workspace_bytes(&kv, 1, 1, 1, INT32_MAX, &o);
    size_t one = kvarn_attn_workspace_bytes(&kv, 1, 1, 1, 1, &o);
    assert_true(one > 0);
    /* each worker adds its scratch (> 0 bytes): the total is at least
     * the single-worker size plus one byte per further worker */
    assert_true(many >= one + (size_t)(INT32_MAX - 1));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_workspace_overflow_is_refused),
        cmocka_unit_test(test_workspace_large_but_valid),
        cmocka_unit_test(test_stride_products_do_not_wrap),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
