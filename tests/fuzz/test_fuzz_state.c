/* test_fuzz_state.c -- drives the fuzz target of tests/fuzz/fuzz_state.c
 * (included here; CMake builds only test_*.c): the valid streams of every
 * case of tests/cache/state_fixture.h, thousands of deterministic
 * mutations of them (bit flips, interesting values in the header's fields
 * and anywhere, truncations, inserted and deleted bytes), half of them
 * with the checksum made right again so that the checks behind it are
 * reached, random bytes; then the committed corpus
 * tests/fuzz/corpus/state/. Runs in ctest, and under ASan+UBSan in CI.
 *
 * The seeds: KVARN_FUZZ_WRITE_SEEDS=DIR build/test_fuzz_state writes the
 * seed-* files (a flags byte 0, then the stream of a short sequence in
 * each cache of the target, at most 4 KiB each for scripts/fuzz.sh's
 * -max_len) into DIR; tests/fuzz/corpus/state/ holds them. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "fuzz/fuzz_state.c"
#include "fuzz/corpus_replay.h"

enum { N_MUTANTS = 3000 };

static const uint32_t INTERESTING[] = {0, 1, 2, 3, 63, 64, 65, 127, 128, 129, 4096, 4097,
                                       0x3fffffffu, 0x40000000u, 0x7fffffffu, 0x80000000u,
                                       0xfffffffeu, 0xffffffffu};

static void run_one(const uint8_t *buf, size_t n, const char *what)
{
    int rc = kvarn_fuzz_state(buf, n);
    if (rc != 0) fail_msg("fuzz invariant %d broken on %s (%zu bytes)", rc, what, n);
}

/* flags byte, then the stream of case i's sequence: malloc'ed, *n bytes */
static uint8_t *case_input(const st_case *k, size_t *n)
{
    int seq = -1;
    kvarn_cache *c = st_build(k, &seq);
    assert_non_null(c);
    size_t m = 0;
    uint8_t *s = st_save(c, seq, &m);
    assert_non_null(s);
    uint8_t *b = malloc(m + 1);
    b[0] = 0;
    memcpy(b + 1, s, m);
    free(s);
    kvarn_cache_destroy(c);
    *n = m + 1;
    return b;
}

static void test_valid_streams(void **state)
{
    (void)state;
    for (int i = 0; i < ST_N_CASES; i++) {
        size_t n = 0;
        uint8_t *b = case_input(&st_cases[i], &n);
        run_one(b, n, st_cases[i].name);
        free(b);
    }
}

/* Apply 1-3 mutations to buf (len bytes, capacity cap); returns the new
 * length. Header fields are hit more often than their share of bytes. */
static size_t mutate(test_rng *r, uint8_t *buf, size_t len, size_t cap)
{
    int n = 1 + (int)test_rng_below(r, 3);
    for (int m = 0; m < n && len > 1; m++) {
        size_t at = 1 + test_rng_below(r, (uint32_t)(len - 1));
        if (test_rng_below(r, 2)) at = 1 + 4 * test_rng_below(r, 32); /* a header field */
        if (at >= len) at = len - 1;
        switch (test_rng_below(r, 6)) {
        case 0: buf[at] ^= (uint8_t)(1u << test_rng_below(r, 8)); break;
        case 1: buf[at] = (uint8_t)test_rng_u64(r); break;
        case 2: {
            uint32_t v = INTERESTING[test_rng_below(r, sizeof INTERESTING / sizeof INTERESTING[0])];
            for (size_t i = 0; i < 4 && at + i < len; i++) buf[at + i] = (uint8_t)(v >> (8 * i));
            break;
        }
        case 3: len = at; break; /* truncate */
        case 4: { /* delete a run */
            size_t k = 1 + test_rng_below(r, 64);
            if (at + k > len) k = len - at;
            memmove(buf + at, buf + at + k, len - at - k);
            len -= k;
            break;
        }
        default: { /* insert a run */
            size_t k = 1 + test_rng_below(r, 64);
            if (len + k > cap) break;
            memmove(buf + at + k, buf + at, len - at);
            for (size_t i = 0; i < k; i++) buf[at + i] = (uint8_t)test_rng_u64(r);
            len += k;
            break;
        }
        }
    }
    return len;
}

static void test_mutations(void **state)
{
    (void)state;
    test_rng r;
    test_rng_seed(&r, 0x57a7e);
    uint8_t *in[ST_N_CASES];
    size_t n[ST_N_CASES], cap = 0;
    for (int i = 0; i < ST_N_CASES; i++) {
        in[i] = case_input(&st_cases[i], &n[i]);
        if (n[i] + 256 > cap) cap = n[i] + 256;
    }
    uint8_t *m = malloc(cap);
    for (int t = 0; t < N_MUTANTS; t++) {
        const int i = (int)test_rng_below(&r, ST_N_CASES);
        memcpy(m, in[i], n[i]);
        size_t len = mutate(&r, m, n[i], cap);
        m[0] = (uint8_t)(t & 1); /* every other one with the right CRC */
        /* exactly len bytes, so that ASan sees a read past the end */
        uint8_t *x = malloc(len ? len : 1);
        memcpy(x, m, len);
        run_one(x, len, st_cases[i].name);
        free(x);
    }
    for (int i = 0; i < ST_N_CASES; i++) free(in[i]);
    free(m);
}

static void test_random_bytes(void **state)
{
    (void)state;
    test_rng r;
    test_rng_seed(&r, 0xbad5);
    uint8_t buf[600];
    memcpy(buf + 1, "KVARNSEQ\x01\0\0\0\x80\0\0\0", 16); /* past the magic */
    for (int i = 0; i < 1000; i++) {
        size_t n = test_rng_below(&r, sizeof buf);
        for (size_t j = (i & 1) ? 17 : 0; j < n; j++) buf[j] = (uint8_t)test_rng_u64(&r);
        run_one(buf, n, "random bytes");
    }
    run_one(buf, 0, "an empty input");
}

/* The target must be able to fail: an accepted stream that saves back
 * to other bytes breaks invariant -4. The format name's padding bytes are
 * part of the field, so a stream with garbage there is refused (with the
 * right CRC: KVARN_ERR_MISMATCH), not accepted and re-saved differently. */
static void test_harness_sees(void **state)
{
    (void)state;
    size_t n = 0;
    uint8_t *b = case_input(&st_cases[3], &n);
    assert_int_equal(kvarn_fuzz_state(b, n), 0);
    b[1 + 16 + 30] = 'x';
    b[0] = 1;
    assert_int_equal(kvarn_fuzz_state(b, n), 0);
    memset(b + 1 + 104, 0, 4);
    const uint32_t crc = (uint32_t)crc32_z(crc32_z(0L, Z_NULL, 0), b + 1, n - 1);
    for (int i = 0; i < 4; i++) b[1 + 104 + i] = (uint8_t)(crc >> (8 * i));
    kvarn_seq_state_info info;
    assert_int_equal(kvarn_cache_seq_state_peek(g_fuzz_caches[3], b + 1, n - 1, &info),
                     KVARN_ERR_MISMATCH);
    assert_string_equal(info.mismatch, "format");
    free(b);
}

/* Short sequences in each cache of the target: the committed seeds. */
static void write_seeds(const char *dir)
{
    const struct { int c, len, committed; const char *name; } s[] = {
        {0, 3, 3, "seed-kvarn-fp16-staging"}, {1, 6, 6, "seed-kvarn-int8-staging"},
        {2, 6, 4, "seed-kvarn-fp8-staging-drafts"}, {3, 6, 6, "seed-int8"},
        {4, 3, 2, "seed-fp16"}, {6, 10, 10, "seed-int4"},
    };
    for (size_t i = 0; i < sizeof s / sizeof s[0]; i++) {
        st_case k = st_cases[s[i].c];
        k.len = s[i].len;
        k.committed = s[i].committed;
        k.fork = 0;
        size_t n = 0;
        uint8_t *b = case_input(&k, &n);
        assert_true(n <= 4096);
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, s[i].name);
        FILE *f = fopen(path, "wb");
        assert_non_null(f);
        assert_int_equal(fwrite(b, 1, n, f), n);
        fclose(f);
        free(b);
    }
}

static int replay_state(const uint8_t *data, size_t size, const char *name)
{
    (void)name;
    return kvarn_fuzz_state(data, size);
}

static void test_corpus_replay(void **state)
{
    (void)state;
    const char *dir = getenv("KVARN_FUZZ_WRITE_SEEDS");
    if (dir != NULL && dir[0] != '\0') write_seeds(dir);
    char bad[256] = "";
    int n = corpus_replay("state", replay_state, bad, sizeof bad);
    if (n == -3) fail_msg("corpus input %s broke an invariant", bad);
    if (n < 0) fail_msg("cannot read tests/fuzz/corpus/state (KVARN_SOURCE_DIR unset? run through ctest)");
    assert_true(n >= 6); /* at least the committed seeds */
}

static int teardown(void **state)
{
    (void)state;
    fuzz_state_teardown();
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid_streams), cmocka_unit_test(test_mutations),
        cmocka_unit_test(test_random_bytes),  cmocka_unit_test(test_harness_sees),
        cmocka_unit_test(test_corpus_replay),
    };
    return cmocka_run_group_tests(tests, NULL, teardown);
}
