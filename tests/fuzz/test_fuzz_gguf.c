/* test_fuzz_gguf.c -- cmocka driver of the GGUF fuzz target
 * (tests/fuzz/fuzz_gguf.c): thousands of deterministic mutations of the
 * valid synthetic file of tests/gguf/gguf_writer.h (bit flips, interesting
 * values in length and count fields, inserted and deleted bytes,
 * truncations), each opened from an exactly-sized buffer so that ASan sees
 * any read past the end. A mutated file must be either rejected with a
 * message or read back in full; never a crash or a leak. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "fuzz/fuzz_gguf.c"
#include "gguf/gguf_writer.h"
#include "fuzz/corpus_replay.h"

enum { N_MUTANTS = 20000 };

static const uint64_t INTERESTING[] = {
    0, 1, 2, 3, 4, 7, 8, 9, 12, 13, 16, 30, 31, 32, 33, 63, 64, 127, 128, 255, 256,
    0x7fff, 0xffff, 0x7fffffffu, 0xffffffffu, 0x100000000ull, 0x7fffffffffffffffull,
    0x8000000000000000ull, 0xffffffffffffffffull, 0xfffffffffffffff0ull};

/* Apply 1-4 random mutations to buf (len bytes, capacity cap); returns the
 * new length. */
static size_t mutate(test_rng *r, uint8_t *buf, size_t len, size_t cap)
{
    int n = 1 + (int)test_rng_below(r, 4);
    for (int m = 0; m < n && len > 0; m++) {
        size_t at = test_rng_below(r, (uint32_t)len);
        switch (test_rng_below(r, 7)) {
        case 0: /* flip one bit */
            buf[at] ^= (uint8_t)(1u << test_rng_below(r, 8));
            break;
        case 1: /* one random byte */
            buf[at] = (uint8_t)test_rng_u64(r);
            break;
        case 2: /* an interesting 4-byte value (types, n_dims, versions) */
        case 3: { /* an interesting 8-byte value (lengths, counts, offsets) */
            size_t w = test_rng_below(r, 7) < 3 ? 4 : 8;
            uint64_t v = INTERESTING[test_rng_below(r, sizeof INTERESTING / sizeof INTERESTING[0])];
            /* Fields sit at multiples of 4 in this file more often than not. */
            if (test_rng_below(r, 2)) at &= ~(size_t)3;
            for (size_t i = 0; i < w && at + i < len; i++) buf[at + i] = (uint8_t)(v >> (8 * i));
            break;
        }
        case 4: { /* delete a run */
            size_t k = 1 + test_rng_below(r, 16);
            if (at + k > len) k = len - at;
            memmove(buf + at, buf + at + k, len - at - k);
            len -= k;
            break;
        }
        case 5: { /* insert a run of random bytes */
            size_t k = 1 + test_rng_below(r, 16);
            if (len + k > cap) break;
            memmove(buf + at + k, buf + at, len - at);
            for (size_t i = 0; i < k; i++) buf[at + i] = (uint8_t)test_rng_u64(r);
            len += k;
            break;
        }
        default: /* truncate */
            len = at;
            break;
        }
    }
    return len;
}

static void test_fuzz_mutations(void **state)
{
    (void)state;
    gw w = {0};
    gw_sample(&w, 3, 64, 5, NULL);
    double sum = 0.0;
    assert_int_equal(fuzz_gguf_one(w.buf, w.len, &sum), KVARN_OK); /* the seed is valid */

    test_rng r;
    test_rng_seed(&r, 0x66757a7a);
    size_t cap = w.len + 64;
    uint8_t *work = malloc(cap);
    assert_non_null(work);
    int accepted = 0, rejected = 0;
    for (int it = 0; it < N_MUTANTS; it++) {
        memcpy(work, w.buf, w.len);
        size_t len = mutate(&r, work, w.len, cap);
        /* Exactly-sized copy: any over-read is an ASan error. */
        uint8_t *exact = malloc(len ? len : 1);
        assert_non_null(exact);
        memcpy(exact, work, len);
        kvarn_status st = fuzz_gguf_one(exact, len, &sum);
        assert_true(st == KVARN_OK || st == KVARN_ERR_BAD_FILE || st == KVARN_ERR_UNSUPPORTED);
        if (st == KVARN_OK) accepted++;
        else rejected++;
        free(exact);
    }
    print_message("fuzz_gguf: %d mutants, %d accepted, %d rejected\n", N_MUTANTS, accepted,
                  rejected);
    /* The mutations must reach both sides, or the driver tests nothing. */
    assert_true(accepted > N_MUTANTS / 20);
    assert_true(rejected > N_MUTANTS / 20);
    free(work);
    gw_free(&w);
}

static void test_fuzz_random_headers(void **state)
{
    (void)state;
    /* A valid magic and version followed by random bytes. */
    test_rng r;
    test_rng_seed(&r, 77);
    double sum = 0.0;
    for (int it = 0; it < 2000; it++) {
        size_t len = 8 + test_rng_below(&r, 120);
        uint8_t *buf = malloc(len);
        assert_non_null(buf);
        for (size_t i = 0; i < len; i++) buf[i] = (uint8_t)test_rng_u64(&r);
        /* Small counts more often, so parsing goes deeper. */
        memcpy(buf, "GGUF\3\0\0\0", 8);
        if (len >= 24 && test_rng_below(&r, 2)) {
            memset(buf + 8, 0, 16);
            buf[8] = (uint8_t)test_rng_below(&r, 3);
            buf[16] = (uint8_t)test_rng_below(&r, 3);
        }
        kvarn_status st = fuzz_gguf_one(buf, len, &sum);
        assert_true(st == KVARN_OK || st == KVARN_ERR_BAD_FILE || st == KVARN_ERR_UNSUPPORTED);
        free(buf);
    }
}

/* Accepted in full or rejected with a message; never a crash or a leak. */
static int replay_gguf(const uint8_t *data, size_t size, const char *name)
{
    double sum = 0.0;
    kvarn_status st = fuzz_gguf_one(data, size, &sum);
    /* the seeds are valid files and must be read back in full */
    if (strncmp(name, "seed-", 5) == 0) return st != KVARN_OK;
    return !(st == KVARN_OK || st == KVARN_ERR_BAD_FILE || st == KVARN_ERR_UNSUPPORTED);
}

/* The committed corpus (tests/fuzz/corpus/gguf): the seeds of
 * scripts/fuzz.sh and every input a campaign found crashing. */
static void test_corpus_replay(void **state)
{
    (void)state;
    char bad[256] = "";
    int n = corpus_replay("gguf", replay_gguf, bad, sizeof bad);
    if (n == -3) fail_msg("corpus input %s broke an invariant", bad);
    if (n < 0) fail_msg("cannot read tests/fuzz/corpus/gguf (KVARN_SOURCE_DIR unset? run through ctest)");
    assert_true(n >= 2); /* at least the committed seeds */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fuzz_mutations),
        cmocka_unit_test(test_fuzz_random_headers),
        cmocka_unit_test(test_corpus_replay),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
