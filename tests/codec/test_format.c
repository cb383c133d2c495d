/* test_format.c -- the format table: names, head_dim checks, record sizes
 * against the formulas of include/kvarn/record.h and the worked sizes of
 * ../shared/spec/KVARN.md, capacity; and the table of format kinds
 * (src/codec/format_kinds.h) walked row by row. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "codec/format_kinds.h"
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
    assert_int_equal(kvarn_format_check_head_dim(&k, 512), KVARN_OK);
    assert_int_equal(kvarn_format_check_head_dim(&k, 1024), KVARN_ERR_UNSUPPORTED_HEAD_DIM);
    assert_int_equal(kvarn_format_check_head_dim(&k, 384), KVARN_ERR_UNSUPPORTED_HEAD_DIM);
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
    assert_non_null(strstr(buf, "64, 128, 256 or 512"));
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
    /* D >= 256: the per-token share padded to a power of two (spec "Record
     * layout"), worked by hand from the field table. k4v4, D = 512: 32768 +
     * 2048 + 256 + 32768 + 1024 + 512 = 69376 bytes, 542 a token -> 1024. */
    assert_int_equal(kvarn_record_bytes(&f, 512), 1024 * 128);
    f = parse_ok("kvarn_k4v2_g128");
    /* D = 256: 16384 + 1024 + 256 + 8192 + 512 + 512 = 26880, 210 -> 256;
     * D = 512: 32768 + 2048 + 256 + 16384 + 1024 + 512 = 52992, 414 -> 512 */
    assert_int_equal(kvarn_record_bytes(&f, 256), 256 * 128);
    assert_int_equal(kvarn_record_bytes(&f, 512), 512 * 128);
    f = parse_ok("kvarn_k4v2_g64");
    /* D = 512: 16384 + 2048 + 128 + 8192 + 1024 + 256 = 28032, 438 -> 512 */
    assert_int_equal(kvarn_record_bytes(&f, 512), 512 * 64);
    const int Ds[] = {64, 128, 256, 512}, Gs[] = {32, 64, 128}, bits[] = {2, 4, 8};
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 3; b++)
            for (int c = 0; c < 3; c++)
                for (int d = 0; d < 3; d++) {
                    kvarn_format g = {KVARN_KIND_KVARN, "x", Gs[b], bits[c], bits[d], 1, 0};
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


/* A hand-built format whose fixed widths disagree with its kind is refused
 * (regression: an int8 format saying 2-bit keys got a record of D/4 code
 * bytes, and kvarn_encode wrote D code bytes into it, past the record). */
static void test_hand_built_widths(void **state)
{
    (void)state;
    const int D = 64;
    for (int k = 0; k < KVARN_KIND_COUNT; k++) {
        const kvarn_kind_ops *op = kvarn__kind_ops((kvarn_kind)k);
        if (op->per_tile) continue;
        kvarn_format bad[3];
        for (int j = 0; j < 3; j++) {
            memset(&bad[j], 0, sizeof bad[j]);
            bad[j].kind = (kvarn_kind)k;
            snprintf(bad[j].name, sizeof bad[j].name, "%s", op->name);
            bad[j].tile_tokens = 1;
            bad[j].key_bits = op->key_bits;
            bad[j].value_bits = op->value_bits;
        }
        bad[0].key_bits = 2;      /* narrower than the kind's codes */
        bad[1].value_bits = 2;
        bad[2].tile_tokens = 16;  /* a per-token record holds one token */
        for (int j = 0; j < 3; j++) {
            kvarn_record_layout L;
            assert_int_equal(kvarn_format_check_head_dim(&bad[j], D), KVARN_ERR_INVALID_ARG);
            assert_int_equal(kvarn_record_layout_get(&bad[j], D, &L), KVARN_ERR_INVALID_ARG);
            assert_int_equal(kvarn_record_bytes(&bad[j], D), 0);
            float x[16 * 64];
            for (int i = 0; i < 16 * D; i++) x[i] = (float)(i % 7) - 3.0f;
            unsigned char rec[4096]; /* larger than any layout above */
            assert_int_equal(kvarn_encode(&bad[j], D, x, x, rec, sizeof rec, NULL, 0, NULL),
                             KVARN_ERR_INVALID_ARG);
        }
    }
}

/* Every accepted format name: the presets, their aliases and every KVarN
 * name the pattern admits. */
static int accepted_names(char names[][32], int max)
{
    int n = 0;
    for (int i = 0; i < kvarn_format_count() && n < max; i++)
        snprintf(names[n++], 32, "%s", kvarn_format_name_at(i));
    const char *aliases[] = {"auto", "fp8"};
    for (int i = 0; i < 2 && n < max; i++) snprintf(names[n++], 32, "%s", aliases[i]);
    const int bits[] = {2, 4, 8}, Gs[] = {32, 64, 128};
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++)
            for (int c = 0; c < 3 && n < max; c++)
                snprintf(names[n++], 32, "kvarn_k%dv%d_g%d", bits[a], bits[b], Gs[c]);
    return n;
}

/* The table of kinds: every row is at its kind's index and has every
 * mandatory operation; every kind has a named format. */
static void test_kind_rows(void **state)
{
    (void)state;
    assert_null(kvarn__kind_ops(KVARN_KIND_COUNT));
    assert_null(kvarn__kind_ops((kvarn_kind)-1));
    for (int k = 0; k < KVARN_KIND_COUNT; k++) {
        const kvarn_kind_ops *op = kvarn__kind_ops((kvarn_kind)k);
        assert_non_null(op);
        assert_int_equal(op->kind, k);
        assert_non_null(op->name);
        assert_non_null(op->encode);
        assert_non_null(op->decode);
        assert_true(op->min_head_dim >= 1 && op->max_head_dim >= op->min_head_dim);
        assert_true(op->head_dim_step >= 1);
        if (op->per_tile) {
            /* a tile codec needs scratch and takes its geometry from the name */
            assert_non_null(op->workspace_bytes);
            assert_non_null(op->parse_name);
        } else {
            assert_int_equal(op->tile_tokens, 1);
            assert_true(op->key_bits > 0 && op->value_bits > 0);
        }
        int named = 0;
        for (int i = 0; i < kvarn_format_count(); i++)
            named += parse_ok(kvarn_format_name_at(i)).kind == (kvarn_kind)k;
        assert_true(named > 0);
    }
}

/* For every accepted name and head_dim 1..1100: the layout call agrees with
 * the head_dim check and with kvarn_record_bytes, its fields tile the
 * payload, and the kind's encoder writes inside the record (guard bytes
 * after it stay) and decodes back what the layout says. */
static void test_kind_layouts(void **state)
{
    (void)state;
    static char names[64][32];
    const int n = accepted_names(names, 64);
    assert_int_equal(n, 10 + 2 + 27);
    float *x = malloc(sizeof(float) * 128 * 1024), *y = malloc(sizeof(float) * 128 * 1024);
    unsigned char *rec = malloc(1 << 20), *ws = NULL;
    size_t ws_size = 0;
    assert_non_null(x);
    assert_non_null(y);
    assert_non_null(rec);
    uint32_t seed = 12345;
    for (int i = 0; i < 128 * 1024; i++) {
        seed = seed * 1664525u + 1013904223u;
        x[i] = (float)(seed >> 8) / (float)(1u << 24) * 4.0f - 2.0f; /* [-2, 2) */
    }
    int served = 0;
    for (int i = 0; i < n; i++) {
        kvarn_format f = parse_ok(names[i]);
        const kvarn_kind_ops *op = kvarn__kind_ops(f.kind);
        assert_int_equal(f.per_tile, op->per_tile);
        for (int D = 1; D <= 1100; D++) {
            kvarn_record_layout L;
            kvarn_status hd = kvarn_format_check_head_dim(&f, D);
            assert_int_equal(kvarn_record_layout_get(&f, D, &L), hd);
            if (hd != KVARN_OK) {
                assert_int_equal(kvarn_record_bytes(&f, D), 0);
                continue;
            }
            served++;
            assert_int_equal(L.record_bytes, kvarn_record_bytes(&f, D));
            assert_int_equal(L.k_codes_off, 0);
            assert_int_equal(L.k_a_off, L.k_codes_off + L.k_codes_bytes);
            assert_int_equal(L.k_b_off, L.k_a_off + L.k_a_bytes);
            assert_int_equal(L.k_stok_off, L.k_b_off + L.k_b_bytes);
            assert_int_equal(L.v_codes_off, L.k_stok_off + L.k_stok_bytes);
            assert_int_equal(L.v_schan_off, L.v_codes_off + L.v_codes_bytes);
            assert_int_equal(L.v_a_off, L.v_schan_off + L.v_schan_bytes);
            assert_int_equal(L.v_b_off, L.v_a_off + L.v_a_bytes);
            assert_int_equal(L.payload_bytes, L.v_b_off + L.v_b_bytes);
            assert_true(L.record_bytes >= L.payload_bytes);
            /* Encode with guard bytes after the record; the KVarN formats
             * only at the SmolLM2 head_dim and 128 (each encode is a whole
             * tile; the layout checks above cover every D). */
            if (op->per_tile && D != 64 && D != 128) continue;
            size_t need = kvarn_encode_workspace_bytes(&f, D);
            if (need > ws_size) {
                free(ws);
                ws = malloc(need);
                assert_non_null(ws);
                ws_size = need;
            }
            assert_true(L.record_bytes + 64 <= (size_t)1 << 20);
            memset(rec, 0xa5, L.record_bytes + 64);
            assert_int_equal(kvarn_encode(&f, D, x, x + 64 * 1024, rec, L.record_bytes, ws,
                                          ws_size, NULL),
                             KVARN_OK);
            for (int j = 0; j < 64; j++) assert_int_equal(rec[L.record_bytes + j], 0xa5);
            assert_int_equal(kvarn_decode(&f, D, rec, L.record_bytes, y, NULL, 0), KVARN_OK);
            assert_int_equal(kvarn_decode(&f, D, rec, L.record_bytes - 1, y, NULL, 0),
                             KVARN_ERR_BUFFER_TOO_SMALL);
        }
    }
    /* 6 per-token kinds + 2 aliases serve 512 even D each; 31 KVarN names 4 */
    assert_int_equal(served, 8 * 512 + 31 * 4);
    free(x);
    free(y);
    free(rec);
    free(ws);
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
        cmocka_unit_test(test_hand_built_widths), cmocka_unit_test(test_kind_rows),
        cmocka_unit_test(test_kind_layouts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
