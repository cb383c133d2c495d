/* test_cache_state.c -- saving and restoring a sequence (include/kvarn/
 * state.h, docs/state.md) for the cases of state_fixture.h (KVarN with a
 * partial sink, small tail pages, exact records not yet committed, fp8
 * staging, per-token formats, forks): the restored sequence reads back bit
 * for bit and saves to the same stream, in the same cache and in a fresh
 * one, and stays identical as both grow; then every refusal: truncation,
 * magic, version, checksum, each header field mismatched, hostile lengths,
 * NaN/Inf in the payload, an exhausted pool, a full sequence table, each
 * with its status and the cache unchanged. Attention over restored
 * sequences: tests/attn/test_attn_state.c. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>
#include <cmocka.h>

#include "cache/state_fixture.h"
#include "kvarn/record.h"

/* Header offsets of docs/state.md "Byte layout", as the test reads them. */
enum { O_VERSION = 8, O_HEADER_BYTES = 12, O_FORMAT = 16, O_FIELDS = 48, O_SEQ_LEN = 84,
       O_COMMITTED = 88, O_QUANT = 92, O_PAYLOAD = 96, O_CRC = 104, O_RESERVED = 108, HDR = 128 };

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Recompute the CRC of a stream after a change, as a writer would. */
static void fix_crc(uint8_t *b, size_t n)
{
    put32(b + O_CRC, 0);
    put32(b + O_CRC, (uint32_t)crc32_z(crc32_z(0L, Z_NULL, 0), b, n));
}

/* restore of (b, n) into c gives want, and leaves c as it was */
static void refused(kvarn_cache *c, const uint8_t *b, size_t n, kvarn_status want)
{
    size_t n0, n1;
    uint8_t *before = st_snapshot(c, &n0);
    uint8_t *copy = malloc(n ? n : 1); /* exactly n bytes: ASan sees overreads */
    if (n) memcpy(copy, b, n);
    int seq = -77;
    assert_int_equal(kvarn_cache_seq_restore(c, copy, n, &seq), want);
    assert_int_equal(seq, -77);
    uint8_t *after = st_snapshot(c, &n1);
    assert_int_equal(n0, n1);
    assert_memory_equal(before, after, n0);
    free(before);
    free(after);
    free(copy);
}

/* Save, restore into the same cache and into a fresh one of the same
 * options: the same reads and stream; then grow all three by the same
 * tokens (a partial tile, then past a tile boundary with commits) and
 * compare again. */
static void test_round_trip(void **state)
{
    (void)state;
    for (int i = 0; i < ST_N_CASES; i++) {
        const st_case *k = &st_cases[i];
        int seq = -1;
        kvarn_cache *c = st_build(k, &seq);
        assert_non_null(c);
        size_t n = 0;
        uint8_t *b = st_save(c, seq, &n);
        assert_non_null(b);

        kvarn_cache_opts o = st_opts(k);
        kvarn_cache *fresh = NULL;
        assert_int_equal(kvarn_cache_create(&o, &fresh), KVARN_OK);
        int r1 = -1, r2 = -1;
        assert_int_equal(kvarn_cache_seq_restore(fresh, b, n, &r1), KVARN_OK);
        assert_int_equal(kvarn_cache_seq_restore(c, b, n, &r2), KVARN_OK);
        assert_true(r2 != seq);
        if (!st_same(c, seq, fresh, r1) || !st_same(c, seq, c, r2))
            fail_msg("case '%s': the restored sequence differs", k->name);

        /* a restored fork owns its tiles: nothing of it is shared */
        const int32_t *table;
        int nt;
        assert_int_equal(kvarn_cache_block_table(fresh, r1, &table, &nt), KVARN_OK);
        kvarn_cache_stats s;
        assert_int_equal(kvarn_cache_get_stats(fresh, &s), KVARN_OK);
        assert_int_equal(s.blocks_shared + s.pages_shared + s.tail_pages_shared, 0);

        kvarn_cache_seq_info si;
        assert_int_equal(kvarn_cache_seq_get_info(c, seq, &si), KVARN_OK);
        const int grow[2] = {5, 150};
        for (int g = 0; g < 2; g++) {
            const int to = si.seq_len + grow[0] + (g ? grow[1] : 0);
            const int n_new = g ? grow[1] : grow[0];
            assert_int_equal(st_append(c, seq, n_new, to, 0), KVARN_OK);
            assert_int_equal(st_append(fresh, r1, n_new, to, 0), KVARN_OK);
            assert_int_equal(st_append(c, r2, n_new, to, 0), KVARN_OK);
            if (!st_same(c, seq, fresh, r1) || !st_same(c, seq, c, r2))
                fail_msg("case '%s': the restored sequence differs after %d more tokens", k->name,
                         to - si.seq_len);
        }
        free(b);
        kvarn_cache_destroy(fresh);
        kvarn_cache_destroy(c);
    }
}

/* An empty sequence saves and restores too. */
static void test_empty(void **state)
{
    (void)state;
    kvarn_cache_opts o = st_opts(&st_cases[0]);
    kvarn_cache *c = NULL;
    assert_int_equal(kvarn_cache_create(&o, &c), KVARN_OK);
    int s = -1, r = -1;
    assert_int_equal(kvarn_cache_seq_create(c, &s), KVARN_OK);
    size_t n = 0;
    uint8_t *b = st_save(c, s, &n);
    assert_non_null(b);
    assert_int_equal(n, HDR);
    assert_int_equal(kvarn_cache_seq_restore(c, b, n, &r), KVARN_OK);
    assert_true(st_same(c, s, c, r));
    free(b);
    kvarn_cache_destroy(c);
}

/* Save refuses what it cannot save, and a short buffer. */
static void test_save_errors(void **state)
{
    (void)state;
    int seq = -1;
    kvarn_cache *c = st_build(&st_cases[0], &seq);
    assert_non_null(c);
    size_t need = 0, w = 0;
    assert_int_equal(kvarn_cache_seq_state_size(c, seq, &need), KVARN_OK);
    uint8_t *b = malloc(need);
    assert_int_equal(kvarn_cache_seq_save(c, seq, b, need - 1, &w), KVARN_ERR_BUFFER_TOO_SMALL);
    assert_int_equal(w, need);
    assert_int_equal(kvarn_cache_seq_save(c, 3, b, need, &w), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_seq_save(NULL, seq, b, need, &w), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_seq_save(c, seq, b, need, NULL), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_seq_state_size(c, -1, &need), KVARN_ERR_INVALID_ARG);
    /* reserved but not written in every layer: no state to save */
    assert_int_equal(kvarn_cache_reserve(c, seq, 2), KVARN_OK);
    assert_int_equal(kvarn_cache_seq_state_size(c, seq, &need), KVARN_ERR_STATE);
    assert_int_equal(kvarn_cache_seq_save(c, seq, b, need, &w), KVARN_ERR_STATE);
    free(b);
    kvarn_cache_destroy(c);
}

/* Every prefix of a stream is refused as truncated (all short ones, then a
 * dense sample, then the last bytes), the cache unchanged. */
static void test_truncated(void **state)
{
    (void)state;
    for (int i = 0; i < ST_N_CASES; i += 3) {
        int seq = -1;
        kvarn_cache *c = st_build(&st_cases[i], &seq);
        size_t n = 0;
        uint8_t *b = st_save(c, seq, &n);
        assert_non_null(b);
        for (size_t len = 0; len < n; len += len < 300 || len > n - 300 ? 1 : 61)
            refused(c, b, len, KVARN_ERR_TRUNCATED);
        kvarn_seq_state_info info;
        assert_int_equal(kvarn_cache_seq_state_peek(c, b, n - 1, &info), KVARN_ERR_TRUNCATED);
        assert_int_equal(info.total_bytes, n); /* the header says how much is missing */
        free(b);
        kvarn_cache_destroy(c);
    }
}

/* Magic, version, header size, reserved bytes, trailing bytes, a flipped
 * byte anywhere (checksum). */
static void test_corrupt(void **state)
{
    (void)state;
    int seq = -1;
    kvarn_cache *c = st_build(&st_cases[0], &seq);
    size_t n = 0;
    uint8_t *b = st_save(c, seq, &n), *m = malloc(n + 1);
    assert_non_null(b);

    memcpy(m, b, n);
    m[0] = 'X';
    refused(c, m, n, KVARN_ERR_BAD_FILE);
    refused(c, m, 3, KVARN_ERR_BAD_FILE);
    memcpy(m, b, n);
    put32(m + O_VERSION, 2);
    refused(c, m, n, KVARN_ERR_BAD_VERSION);
    refused(c, m, 20, KVARN_ERR_BAD_VERSION);
    memcpy(m, b, n);
    put32(m + O_HEADER_BYTES, 64);
    refused(c, m, n, KVARN_ERR_BAD_FILE);
    memcpy(m, b, n);
    m[O_RESERVED + 3] = 1;
    refused(c, m, n, KVARN_ERR_BAD_FILE);
    memcpy(m, b, n);
    m[n] = 0;
    refused(c, m, n + 1, KVARN_ERR_BAD_FILE);
    test_rng r;
    test_rng_seed(&r, 0xc4c);
    for (int t = 0; t < 200; t++) {
        memcpy(m, b, n);
        /* anywhere but the magic, version, header size and payload size,
         * which are checked before the checksum */
        size_t at = O_FORMAT + test_rng_below(&r, (uint32_t)(n - O_FORMAT));
        if (at >= O_PAYLOAD && at < O_PAYLOAD + 8) continue;
        if (at >= O_RESERVED && at < HDR) continue;
        m[at] ^= (uint8_t)(1u << test_rng_below(&r, 8));
        refused(c, m, n, KVARN_ERR_CHECKSUM);
    }
    free(b);
    free(m);
    kvarn_cache_destroy(c);
}

/* Each header field that must match the cache, changed (checksum made
 * right again): KVARN_ERR_MISMATCH naming that field. And caches that
 * really differ. */
static void test_mismatch(void **state)
{
    (void)state;
    int seq = -1;
    kvarn_cache *c = st_build(&st_cases[0], &seq);
    size_t n = 0;
    uint8_t *b = st_save(c, seq, &n), *m = malloc(n);
    assert_non_null(b);
    const char *names[] = {"head_dim", "n_kv_heads", "n_layers", "block_size", "sink_tiles",
                           "sink_partial", "staging", "rtn_range", "balance_iters"};
    for (int f = 0; f < 9; f++) {
        memcpy(m, b, n);
        put32(m + O_FIELDS + 4 * f, get32(m + O_FIELDS + 4 * f) + 1);
        fix_crc(m, n);
        refused(c, m, n, KVARN_ERR_MISMATCH);
        kvarn_seq_state_info info;
        assert_int_equal(kvarn_cache_seq_state_peek(c, m, n, &info), KVARN_ERR_MISMATCH);
        assert_string_equal(info.mismatch, names[f]);
        /* without a cache the header alone is fine */
        assert_int_equal(kvarn_cache_seq_state_peek(NULL, m, n, &info), KVARN_OK);
        assert_null(info.mismatch);
    }
    memcpy(m, b, n);
    memcpy(m + O_FORMAT, "kvarn_k4v4_g64", 15);
    fix_crc(m, n);
    refused(c, m, n, KVARN_ERR_MISMATCH);

    /* real caches of other settings */
    const struct { const char *fmt; int staging, sink, D; const char *field; } other[] = {
        {"kvarn_k4v4_g64", KVARN_STAGING_FP16, 84, ST_D, "format"},
        {"kvarn_k4v2_g64", KVARN_STAGING_INT8, 84, ST_D, "staging"},
        {"kvarn_k4v2_g64", KVARN_STAGING_FP16, 64, ST_D, "sink_partial"},
        {"kvarn_k4v2_g64", KVARN_STAGING_FP16, 84, 128, "head_dim"},
    };
    for (int i = 0; i < 4; i++) {
        kvarn_cache_opts o = st_opts(&st_cases[0]);
        kvarn_format_parse(other[i].fmt, &o.format);
        o.staging = other[i].staging;
        o.sink_tokens = other[i].sink;
        o.head_dim = other[i].D;
        kvarn_cache *d = NULL;
        assert_int_equal(kvarn_cache_create(&o, &d), KVARN_OK);
        refused(d, b, n, KVARN_ERR_MISMATCH);
        kvarn_seq_state_info info;
        assert_int_equal(kvarn_cache_seq_state_peek(d, b, n, &info), KVARN_ERR_MISMATCH);
        assert_string_equal(info.mismatch, other[i].field);
        kvarn_cache_destroy(d);
    }
    /* a cache differing only in its tail pages and pool sizes restores it */
    kvarn_cache_opts o = st_opts(&st_cases[0]);
    o.tail_page_tokens = 16;
    o.max_seqs = 2;
    kvarn_cache *d = NULL;
    int r = -1;
    assert_int_equal(kvarn_cache_create(&o, &d), KVARN_OK);
    assert_int_equal(kvarn_cache_seq_restore(d, b, n, &r), KVARN_OK);
    assert_true(st_same(c, seq, d, r));
    kvarn_cache_destroy(d);
    free(b);
    free(m);
    kvarn_cache_destroy(c);
}

/* Hostile lengths and values with a right checksum: refused, never
 * followed. */
static void test_hostile(void **state)
{
    (void)state;
    int seq = -1;
    kvarn_cache *c = st_build(&st_cases[0], &seq);
    size_t n = 0;
    uint8_t *b = st_save(c, seq, &n), *m = malloc(n);
    assert_non_null(b);
    const struct { int off; uint32_t v; kvarn_status want; } bad[] = {
        {O_SEQ_LEN, 0x7fffffffu, KVARN_ERR_BAD_FILE},    /* beyond the sequence limit */
        {O_SEQ_LEN, 0x80000000u, KVARN_ERR_BAD_FILE},    /* negative */
        {O_SEQ_LEN, 4097, KVARN_ERR_OUT_OF_BLOCKS},      /* beyond max_seq_len */
        {O_SEQ_LEN, 301, KVARN_ERR_BAD_FILE},            /* more tokens than the payload */
        {O_SEQ_LEN, 299, KVARN_ERR_BAD_FILE},            /* fewer */
        {O_SEQ_LEN, 200, KVARN_ERR_BAD_FILE},            /* committed_len above it */
        {O_COMMITTED, 301, KVARN_ERR_BAD_FILE},
        {O_COMMITTED, 100, KVARN_ERR_BAD_FILE},          /* below the quantized tiles */
        {O_COMMITTED, 0xffffffffu, KVARN_ERR_BAD_FILE},
        {O_QUANT, 4, KVARN_ERR_BAD_FILE},                /* a quantized tile past seq_len */
        {O_QUANT, 2, KVARN_ERR_BAD_FILE},                /* a full committed tile not quantized */
        {O_QUANT, 0x40000000u, KVARN_ERR_BAD_FILE},
        {O_QUANT, 0xffffffffu, KVARN_ERR_BAD_FILE},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        memcpy(m, b, n);
        put32(m + bad[i].off, bad[i].v);
        fix_crc(m, n);
        refused(c, m, n, bad[i].want);
    }
    /* a payload size beyond the bytes given: truncated, whatever it says */
    memcpy(m, b, n);
    for (int j = 0; j < 8; j++) m[O_PAYLOAD + j] = 0xff;
    refused(c, m, n, KVARN_ERR_BAD_FILE); /* 2^64 - 1 + header overflows */
    m[O_PAYLOAD + 7] = 0x7f;
    refused(c, m, n, KVARN_ERR_TRUNCATED);

    /* NaN and Inf in staged fp16 K/V (near the payload's end: the sink
     * slot of the last layer, before the two mark bytes of tile 4) */
    for (int j = 0; j < 2; j++) {
        memcpy(m, b, n);
        const uint16_t bad16 = j ? 0x7c00 : 0x7e01;
        memcpy(m + n - 2 * ST_D, &bad16, 2);
        fix_crc(m, n);
        refused(c, m, n, KVARN_ERR_NONFINITE);
    }
    /* Inf in a quantized record's fp16 field (the first record's a_d) */
    kvarn_format f;
    kvarn_format_parse("kvarn_k4v2_g64", &f);
    kvarn_record_layout lay;
    assert_int_equal(kvarn_record_layout_get(&f, ST_D, &lay), KVARN_OK);
    memcpy(m, b, n);
    const uint16_t inf = 0xfc00;
    memcpy(m + HDR + lay.k_a_off + 6, &inf, 2);
    fix_crc(m, n);
    refused(c, m, n, KVARN_ERR_NONFINITE);
    free(b);
    free(m);
    kvarn_cache_destroy(c);

    /* a mark byte other than 0 or 1 (case 1: the stream ends with its
     * marks and exact records; the first mark is the full exact tile's) */
    c = st_build(&st_cases[1], &seq);
    b = st_save(c, seq, &n);
    m = malloc(n);
    assert_non_null(b);
    kvarn_format_parse("kvarn_k4v2_g128", &f);
    const size_t rec = kvarn_record_bytes(&f, ST_D);
    /* marks: tile 2 (set, both layers, each with Hk records), tile 3 (0, 0) */
    const size_t first_mark = n - 2 - 2 * (1 + ST_HK * rec);
    assert_int_equal(b[first_mark], 1);
    assert_int_equal(b[n - 1], 0);
    memcpy(m, b, n);
    m[n - 1] = 2;
    fix_crc(m, n);
    refused(c, m, n, KVARN_ERR_BAD_FILE);
    memcpy(m, b, n);
    m[n - 1] = 1; /* an exact record of the partial tile, and no bytes for it */
    fix_crc(m, n);
    refused(c, m, n, KVARN_ERR_BAD_FILE);
    free(b);
    free(m);
    kvarn_cache_destroy(c);
}

/* An exhausted pool, and max_seqs sequences live: KVARN_ERR_OUT_OF_BLOCKS,
 * the cache unchanged; a free makes room. */
static void test_out_of_blocks(void **state)
{
    (void)state;
    for (int i = 0; i < ST_N_CASES; i++) {
        int seq = -1;
        kvarn_cache *c = st_build(&st_cases[i], &seq);
        size_t n = 0;
        uint8_t *b = st_save(c, seq, &n);
        assert_non_null(b);
        /* fill the cache with copies until one is refused */
        int ids[8], k = 0, r = -1;
        kvarn_status st;
        while ((st = kvarn_cache_seq_restore(c, b, n, &r)) == KVARN_OK && k < 8) ids[k++] = r;
        assert_int_equal(st, KVARN_ERR_OUT_OF_BLOCKS);
        refused(c, b, n, KVARN_ERR_OUT_OF_BLOCKS);
        assert_true(k >= 1);
        /* one freed, one restored again */
        assert_int_equal(kvarn_cache_seq_free(c, ids[k - 1]), KVARN_OK);
        assert_int_equal(kvarn_cache_seq_restore(c, b, n, &r), KVARN_OK);
        assert_true(st_same(c, seq, c, r));
        free(b);
        kvarn_cache_destroy(c);
    }
    /* blocks, not sequence slots, run out: a cache of few blocks */
    kvarn_cache_opts o = st_opts(&st_cases[0]);
    int seq = -1;
    kvarn_cache *c = st_build(&st_cases[0], &seq);
    size_t n = 0;
    uint8_t *b = st_save(c, seq, &n);
    kvarn_cache_info info;
    kvarn_cache_get_info(c, &info);
    o.budget_bytes = (uint64_t)info.n_pages * info.page_bytes + (uint64_t)info.max_seqs * info.sink_bytes +
                     3 * (uint64_t)info.block_bytes; /* the sequence holds 4 */
    kvarn_cache *d = NULL;
    assert_int_equal(kvarn_cache_create(&o, &d), KVARN_OK);
    kvarn_cache_get_info(d, &info);
    assert_int_equal(info.n_blocks, 3);
    refused(d, b, n, KVARN_ERR_OUT_OF_BLOCKS);
    kvarn_cache_destroy(d);
    free(b);
    kvarn_cache_destroy(c);
}

static void test_args(void **state)
{
    (void)state;
    int seq = -1, r = -1;
    kvarn_cache *c = st_build(&st_cases[3], &seq);
    size_t n = 0;
    uint8_t *b = st_save(c, seq, &n);
    kvarn_seq_state_info info;
    assert_int_equal(kvarn_cache_seq_restore(NULL, b, n, &r), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_seq_restore(c, b, n, NULL), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_seq_restore(c, NULL, n, &r), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_seq_restore(c, NULL, 0, &r), KVARN_ERR_TRUNCATED);
    assert_int_equal(kvarn_cache_seq_state_peek(c, b, n, NULL), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cache_seq_state_peek(c, b, n, &info), KVARN_OK);
    assert_string_equal(info.format, "int8");
    assert_int_equal(info.seq_len, st_cases[3].len);
    assert_int_equal(info.total_bytes, n);
    assert_int_equal(info.version, KVARN_SEQ_STATE_VERSION);
    assert_string_equal(kvarn_strerror(KVARN_ERR_CHECKSUM), "checksum mismatch");
    assert_string_equal(kvarn_strerror(KVARN_ERR_TRUNCATED), "truncated stream");
    free(b);
    kvarn_cache_destroy(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip), cmocka_unit_test(test_empty),
        cmocka_unit_test(test_save_errors), cmocka_unit_test(test_truncated),
        cmocka_unit_test(test_corrupt),     cmocka_unit_test(test_mismatch),
        cmocka_unit_test(test_hostile),     cmocka_unit_test(test_out_of_blocks),
        cmocka_unit_test(test_args),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
