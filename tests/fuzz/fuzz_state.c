/* fuzz_state.c -- fuzz target for restoring a saved sequence
 * (kvarn_cache_seq_restore, include/kvarn/state.h; the stream:
 * docs/state.md).
 *
 * Input layout (any bytes are valid input):
 *   flags   1 byte: bit 0 = write the right CRC-32 into the stream before
 *           restoring it, so that mutations reach the checks after the
 *           checksum (lengths, marks, NaN/Inf, the pools); other bits unused
 *   stream  the rest: the bytes given to kvarn_cache_seq_restore, in a
 *           buffer of exactly their size (ASan sees any read past the end)
 * An empty input is an empty stream.
 *
 * The stream is restored into one cache of each settings of
 * tests/cache/state_fixture.h (KVarN with fp16, int8 and fp8 staging, a
 * partial sink, small tail pages; int8, fp16 and int4 per-token), made
 * once. Checked on every input and cache: the status is one restore
 * documents; a refused stream leaves the cache unchanged (counters and
 * every reference count); an accepted one reads back in full
 * (kvarn_cache_read of every layer), saves again to exactly the bytes
 * given, and once freed leaves the cache as before.
 *
 * kvarn_fuzz_state returns 0, or a negative number naming the broken
 * invariant. Built by tests/fuzz/test_fuzz_state.c (cmocka, ctest) and,
 * with -DKVARN_LIBFUZZER, as a libFuzzer target (tests/fuzz/README.md). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "cache/state_fixture.h"

/* One cache per distinct settings of st_cases (case 5 shares case 0's). */
static const int k_fuzz_cases[] = {0, 1, 2, 3, 4, 6};
#define FUZZ_N_CACHES (int)(sizeof k_fuzz_cases / sizeof k_fuzz_cases[0])
static kvarn_cache *g_fuzz_caches[FUZZ_N_CACHES];

/* Destroy the caches (the ctest driver calls it at the end). */
static void fuzz_state_teardown(void)
{
    for (int i = 0; i < FUZZ_N_CACHES; i++) {
        kvarn_cache_destroy(g_fuzz_caches[i]);
        g_fuzz_caches[i] = NULL;
    }
}

static int fuzz_state_is_documented(kvarn_status st)
{
    switch (st) {
    case KVARN_OK: case KVARN_ERR_BAD_FILE: case KVARN_ERR_TRUNCATED:
    case KVARN_ERR_BAD_VERSION: case KVARN_ERR_CHECKSUM: case KVARN_ERR_MISMATCH:
    case KVARN_ERR_NONFINITE: case KVARN_ERR_OUT_OF_BLOCKS:
        return 1;
    default:
        return 0;
    }
}

/* The stream into one cache, and the invariants. */
static int fuzz_state_one(kvarn_cache *c, const uint8_t *b, size_t n)
{
    size_t n0 = 0, n1 = 0;
    uint8_t *before = st_snapshot(c, &n0), *after = NULL;
    int seq = -1, rc = 0;
    kvarn_status st = kvarn_cache_seq_restore(c, b, n, &seq);
    if (!fuzz_state_is_documented(st)) { rc = -1; goto out; }
    if (st == KVARN_OK) {
        kvarn_cache_seq_info si;
        if (kvarn_cache_seq_get_info(c, seq, &si) != KVARN_OK) { rc = -2; goto out; }
        const size_t row = (size_t)ST_HK * ST_D * (size_t)(si.seq_len ? si.seq_len : 1);
        float *k = malloc(row * sizeof(float)), *v = malloc(row * sizeof(float));
        for (int l = 0; l < ST_L && rc == 0; l++)
            if (kvarn_cache_read(c, seq, l, 0, si.seq_len, k, v, 0) != KVARN_OK) rc = -3;
        free(k);
        free(v);
        size_t m = 0;
        uint8_t *again = st_save(c, seq, &m);
        if (rc == 0 && (again == NULL || m != n || memcmp(again, b, n) != 0)) rc = -4;
        free(again);
        if (kvarn_cache_seq_free(c, seq) != KVARN_OK && rc == 0) rc = -5;
    }
    after = st_snapshot(c, &n1);
    if (rc == 0 && (n0 != n1 || memcmp(before, after, n0) != 0)) rc = -6;
out:
    free(before);
    free(after);
    return rc;
}

int kvarn_fuzz_state(const uint8_t *data, size_t size);

int kvarn_fuzz_state(const uint8_t *data, size_t size)
{
    for (int i = 0; i < FUZZ_N_CACHES; i++) {
        if (g_fuzz_caches[i] != NULL) continue;
        kvarn_cache_opts o = st_opts(&st_cases[k_fuzz_cases[i]]);
        if (kvarn_cache_create(&o, &g_fuzz_caches[i]) != KVARN_OK) return -10;
    }
    const unsigned flags = size ? data[0] : 0u;
    const size_t n = size ? size - 1 : 0;
    uint8_t *b = malloc(n ? n : 1);
    if (b == NULL) return 0; /* OOM: not a bug */
    if (n) memcpy(b, data + 1, n);
    if ((flags & 1u) && n >= KVARN_SEQ_STATE_HEADER_BYTES) {
        memset(b + 104, 0, 4); /* the CRC field (docs/state.md) */
        const uint32_t crc = (uint32_t)crc32_z(crc32_z(0L, Z_NULL, 0), b, n);
        for (int i = 0; i < 4; i++) b[104 + i] = (uint8_t)(crc >> (8 * i));
    }
    int rc = 0;
    for (int i = 0; i < FUZZ_N_CACHES && rc == 0; i++) rc = fuzz_state_one(g_fuzz_caches[i], b, n);
    free(b);
    return rc;
}

#ifdef KVARN_LIBFUZZER
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (kvarn_fuzz_state(data, size) != 0) __builtin_trap();
    return 0;
}
#endif
