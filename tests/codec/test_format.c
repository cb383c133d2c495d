/* test_format.c -- the format table: names, head_dim checks, record sizes
 * against the formulas of include/kvarn/record.h and the worked sizes of
 * ../shared/spec/KVARN.md, capacity. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include "kvarn/kvarn.h"
#include "kvarn/record.h"

static kvarn_format parse_ok(const char *name)
{
    kvarn_format f;
    assert_int_equal(kvarn_format_parse(name, &f), KVARN_OK);
    return f;
}

static void test_names(void **state)
{
    (void)state;
    kvarn_format f = parse_ok("auto");
    assert_string_equal(f.name, "fp16");
    f = parse_ok("kvarn_k4v2_g128");
    assert_int_equal(f.kind, KVARN_KIND_KVARN);
    assert_int_equal(f.tile_tokens, 128);
    assert_int_equal(f.key_bits, 4);
    assert_int_equal(f.value_bits, 2);
    assert_true(f.per_tile);
    f = parse_ok("kvarn_k8v2_g32");
    assert_int_equal(f.tile_tokens, 32);
    assert_int_equal(f.key_bits, 8);
    f = parse_ok("int4");
    assert_false(f.per_tile);
    assert_int_equal(f.tile_tokens, 1);
    for (int i = 0; i < kvarn_format_count(); i++) {
        kvarn_format g = parse_ok(kvarn_format_name_at(i));
        assert_string_equal(g.name, kvarn_format_name_at(i));
    }
    assert_null(kvarn_format_name_at(kvarn_format_count()));
    assert_null(kvarn_format_name_at(-1));
}

static void test_bad_names(void **state)
{
    (void)state;
    const char *bad[] = {"", "FP16", "fp16 ", "int3", "kvarn", "kvarn_k4v2",
                         "kvarn_k4v2_g96", "kvarn_k3v2_g128", "kvarn_k4v16_g128",
                         "kvarn_k4v2_g1280", "kvarn_k4v2_g128x", "kvarn_k44v2_g128"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvarn_format f;
        memset(&f, 0x5a, sizeof f);
        assert_int_equal(kvarn_format_parse(bad[i], &f), KVARN_ERR_UNKNOWN_FORMAT);
        assert_int_equal(((unsigned char *)&f)[0], 0x5a); /* untouched */
    }
    assert_int_equal(kvarn_format_parse(NULL, NULL), KVARN_ERR_INVALID_ARG);
    char buf[512];
    kvarn_format_explain(KVARN_ERR_UNKNOWN_FORMAT, "int3", 0, buf, sizeof buf);
    assert_non_null(strstr(buf, "int3"));
    assert_non_null(strstr(buf, "kvarn_k4v2_g128"));
    assert_non_null(strstr(buf, "fp8_e4m3"));
}

static void test_head_dim(void **state)
{
    (void)state;
    kvarn_format k = parse_ok("kvarn_k4v2_g128");
    assert_int_equal(kvarn_format_check_head_dim(&k, 64), KVARN_OK);
    assert_int_equal(kvarn_format_check_head_dim(&k, 128), KVARN_OK);
    assert_int_equal(kvarn_format_check_head_dim(&k, 256), KVARN_OK);
    assert_int_equal(kvarn_format_check_head_dim(&k, 96), KVARN_ERR_UNSUPPORTED_HEAD_DIM);
    assert_int_equal(kvarn_format_check_head_dim(&k, 0), KVARN_ERR_UNSUPPORTED_HEAD_DIM);
    assert_int_equal(kvarn_format_check_head_dim(&k, -64), KVARN_ERR_UNSUPPORTED_HEAD_DIM);
    assert_int_equal(kvarn_record_bytes(&k, 96), 0);
    kvarn_format i = parse_ok("int8");
    assert_int_equal(kvarn_format_check_head_dim(&i, 96), KVARN_OK);
    assert_int_equal(kvarn_format_check_head_dim(&i, 7), KVARN_ERR_UNSUPPORTED_HEAD_DIM);
    char buf[512];
    kvarn_format_explain(KVARN_ERR_UNSUPPORTED_HEAD_DIM, "kvarn_k4v2_g128", 96, buf, sizeof buf);
    assert_non_null(strstr(buf, "96"));
    assert_non_null(strstr(buf, "64, 128 or 256"));
}

/* Record bytes by the formula in record.h, written independently here. */
static size_t kvarn_formula(int D, int G, int kb, int vb)
{
    size_t raw = (size_t)D * G * kb / 8 + 4u * D + 2u * G   /* K */
               + (size_t)G * D * vb / 8 + 2u * D + 4u * G;  /* V */
    size_t rec = (raw + 7) / 8 * 8;
    if (D >= 256) {
        size_t p = 1;
        while (p * G < rec) p *= 2;
        rec = p * G;
    }
    return rec;
}

static void test_sizes(void **state)
{
    (void)state;
    kvarn_format f = parse_ok("kvarn_k4v2_g128");
    assert_int_equal(kvarn_record_bytes(&f, 128), 13824);
    assert_true(kvarn_bytes_per_token_head(&f, 128) == 108.0);
    assert_int_equal(kvarn_record_bytes(&f, 64), 7296);
    assert_true(kvarn_bytes_per_token_head(&f, 64) == 57.0);
    f = parse_ok("kvarn_k4v4_g128");
    assert_int_equal(kvarn_record_bytes(&f, 128), 17920);
    const int Ds[] = {64, 128, 256}, Gs[] = {32, 64, 128}, bits[] = {2, 4, 8};
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++)
            for (int c = 0; c < 3; c++)
                for (int d = 0; d < 3; d++) {
                    kvarn_format g = {KVARN_KIND_KVARN, "x", Gs[b], bits[c], bits[d], 1};
                    kvarn_record_layout L;
                    assert_int_equal(kvarn_record_layout_get(&g, Ds[a], &L), KVARN_OK);
                    assert_int_equal(L.record_bytes, kvarn_formula(Ds[a], Gs[b], bits[c], bits[d]));
                    assert_int_equal(L.record_bytes % 8, 0);
                    /* fields are contiguous and in spec order */
                    assert_int_equal(L.k_a_off, L.k_codes_off + L.k_codes_bytes);
                    assert_int_equal(L.k_b_off, L.k_a_off + 2u * Ds[a]);
                    assert_int_equal(L.k_stok_off, L.k_b_off + 2u * Ds[a]);
                    assert_int_equal(L.v_codes_off, L.k_stok_off + 2u * Gs[b]);
                    assert_int_equal(L.v_schan_off, L.v_codes_off + L.v_codes_bytes);
                    assert_int_equal(L.v_a_off, L.v_schan_off + 2u * Ds[a]);
                    assert_int_equal(L.v_b_off, L.v_a_off + 2u * Gs[b]);
                    assert_int_equal(L.payload_bytes, L.v_b_off + 2u * Gs[b]);
                }
    /* per-token formats: record.h's table */
    struct { const char *n; size_t bytes64; } pt[] = {
        {"fp16", 256}, {"bf16", 256}, {"fp8_e4m3", 132}, {"fp8_e5m2", 132},
        {"int8", 136}, {"int4", 72}};
    for (size_t i = 0; i < sizeof pt / sizeof pt[0]; i++) {
        kvarn_format g = parse_ok(pt[i].n);
        assert_int_equal(kvarn_record_bytes(&g, 64), pt[i].bytes64);
        assert_true(kvarn_bytes_per_token_head(&g, 64) == (double)pt[i].bytes64);
    }
}

static void test_capacity(void **state)
{
    (void)state;
    kvarn_format f = parse_ok("kvarn_k4v2_g128");
    /* SmolLM2: 30 layers, 3 KV heads, D=64: one tile of all layers/heads
     * costs 7296*90 bytes. */
    uint64_t tile = 7296ull * 90;
    assert_int_equal(kvarn_capacity_tokens(&f, 64, 30, 3, tile * 10), 1280);
    assert_int_equal(kvarn_capacity_tokens(&f, 64, 30, 3, tile * 10 - 1), 1152);
    kvarn_format h = parse_ok("fp16");
    assert_int_equal(kvarn_capacity_tokens(&h, 64, 30, 3, 256ull * 90 * 1000), 1000);
    assert_int_equal(kvarn_capacity_tokens(&h, 64, 0, 3, 1000000), 0);
    assert_int_equal(kvarn_capacity_tokens(&h, 63, 30, 3, 1000000), 0);
    /* issue 8: 256 bytes x 2^30 layers x 2^26 heads is exactly 2^64: the
     * product wrapped to 0 (a division by zero); a tile beyond 64 bits
     * fits no budget. Just below, the product fits and is exact. */
    assert_int_equal(kvarn_capacity_tokens(&h, 64, 1 << 30, 1 << 26, UINT64_MAX), 0);
    assert_int_equal(kvarn_capacity_tokens(&h, 64, INT32_MAX, INT32_MAX, UINT64_MAX), 0);
    const uint64_t big_tile = 256ull << 54; /* 2^30 layers x 2^24 heads */
    assert_true(kvarn_capacity_tokens(&h, 64, 1 << 30, 1 << 24, UINT64_MAX) ==
                UINT64_MAX / big_tile * h.tile_tokens);
}

static void test_strerror(void **state)
{
    (void)state;
    assert_string_equal(kvarn_strerror(KVARN_OK), "ok");
    assert_string_equal(kvarn_strerror(KVARN_ERR_OUT_OF_BLOCKS), "block pool exhausted");
    assert_string_equal(kvarn_strerror((kvarn_status)-999), "unknown status");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names),   cmocka_unit_test(test_bad_names),
        cmocka_unit_test(test_head_dim), cmocka_unit_test(test_sizes),
        cmocka_unit_test(test_capacity), cmocka_unit_test(test_strerror),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
