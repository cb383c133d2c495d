/* test_fuzz_tokenizer.c -- drives the fuzz target of
 * tests/fuzz/fuzz_tokenizer.c (included here; CMake builds only test_*.c)
 * with a few thousand inputs: random bytes under every flag combination,
 * random mixtures of text fragments that stress the pre-tokenizer and the
 * special-token matcher (control texts, broken control texts, digits,
 * whitespace runs, contractions, multi-byte and cut UTF-8), and long runs.
 * Runs in ctest, and under ASan+UBSan in CI. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include "fuzz_tokenizer.c"
#include "common/testutil.h"
#include "fuzz/corpus_replay.h"

#define MAX_IN 1024

static void run_one(const uint8_t *buf, size_t n)
{
    int rc = kvarn_fuzz_tokenizer(buf, n);
    if (rc != 0) {
        char show[80];
        size_t m = n < 40 ? n : 40;
        for (size_t i = 0; i < m; i++) show[i] = (buf[i] >= 32 && buf[i] < 127) ? (char)buf[i] : '.';
        show[m] = '\0';
        fail_msg("fuzz invariant %d broken on input '%s' (%zu bytes, flags 0x%02x)", rc, show,
                 n, n ? buf[0] : 0);
    }
}

static void test_random_bytes(void **state)
{
    (void)state;
    test_rng r;
    test_rng_seed(&r, 0x70c);
    uint8_t buf[MAX_IN];
    for (int i = 0; i < 1500; i++) {
        size_t n = 1 + test_rng_below(&r, 300);
        for (size_t j = 0; j < n; j++) buf[j] = (uint8_t)test_rng_u64(&r);
        buf[0] = (uint8_t)(i & 15);   /* every flag combination in turn */
        run_one(buf, n);
    }
    run_one(buf, 0);
    run_one(buf, 1);
}

static void test_fragments(void **state)
{
    (void)state;
    static const char *const frag[] = {
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_", "|>", "<", "@@", "@",
        " the", "he", "in", "aaaa", "a", " ", "  ", "    ", "\n", "\n\n", "\t", "\r\n",
        "'s", "'", "'ll", "12", "1811", " 2,500", "\xC2\xBD", "\xD9\xA3", "\xE2\x80\x99",
        "\xE2\x80\x94", "\xE6\x97\xA5", "\xF0\x9F\x8E\x89", "\xC2\xA0", "\xE3\x80\x80",
        "\xC2\x85", "\xE1\xA0\x8E", "\xE2\x80\xA8", "\xC3", "\xE2\x82", "\xFF", "\xC0\xAF",
        "\xED\xA0\x80", "\x00", "\x04", "!!", "...", "caf\xC3\xA9"};
    enum { NF = sizeof frag / sizeof frag[0] };
    test_rng r;
    test_rng_seed(&r, 0xf7a6);
    uint8_t buf[MAX_IN];
    for (int i = 0; i < 1500; i++) {
        size_t n = 0;
        buf[n++] = (uint8_t)test_rng_below(&r, 16);
        size_t k = test_rng_below(&r, 40);
        for (size_t j = 0; j < k; j++) {
            uint32_t f = test_rng_below(&r, NF);
            size_t l = frag[f][0] ? strlen(frag[f]) : 1;   /* "\x00": one NUL byte */
            if (n + l > MAX_IN) break;
            memcpy(buf + n, frag[f], l);
            n += l;
        }
        run_one(buf, n);
    }
}

static void test_long_runs(void **state)
{
    (void)state;
    static uint8_t buf[20001];
    const uint8_t fill[] = {' ', 'a', '1', '\n', 0xFF};
    for (size_t f = 0; f < sizeof fill; f++)
        for (unsigned flags = 0; flags < 16; flags += 5) {
            buf[0] = (uint8_t)flags;
            memset(buf + 1, fill[f], sizeof buf - 1);
            run_one(buf, sizeof buf);
        }
}

/* The harness must be able to fail: a known input passes, and its checks
 * see what the tokenizer does. */
static void test_harness(void **state)
{
    (void)state;
    assert_int_equal(kvarn_fuzz_tokenizer((const uint8_t *)"\x02<|im_start|>hi", 15), 0);
    kvarn_tokenizer *t = fuzz_build("gpt2", 0);
    assert_non_null(t);
    int32_t ids[4];
    size_t n = 0;
    assert_int_equal(kvarn_tokenizer_encode(t, "<|im_start|>", 12, KVARN_TOKENIZE_SPECIAL,
                                            ids, 4, &n), KVARN_OK);
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], 1);
    /* A wrong expectation is caught: decoding must be exact. */
    assert_int_equal(fuzz_check(t, 0, 1, "\xFF", 1), -7);
    kvarn_tokenizer_free(t);
}

static int replay_tokenizer(const uint8_t *data, size_t size, const char *name)
{
    (void)name;
    return kvarn_fuzz_tokenizer(data, size);
}

/* The committed corpus (tests/fuzz/corpus/tokenizer): the seeds of
 * scripts/fuzz.sh and every input a campaign found crashing. */
static void test_corpus_replay(void **state)
{
    (void)state;
    char bad[256] = "";
    int n = corpus_replay("tokenizer", replay_tokenizer, bad, sizeof bad);
    if (n == -3) fail_msg("corpus input %s broke an invariant", bad);
    if (n < 0) fail_msg("cannot read tests/fuzz/corpus/tokenizer (KVARN_SOURCE_DIR unset? run through ctest)");
    assert_true(n >= 4); /* at least the committed seeds */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_bytes),
        cmocka_unit_test(test_fragments),
        cmocka_unit_test(test_long_runs),
        cmocka_unit_test(test_harness),
        cmocka_unit_test(test_corpus_replay),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
