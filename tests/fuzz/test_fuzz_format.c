/* test_fuzz_format.c -- drives the fuzz target of tests/fuzz/fuzz_format.c
 * (included here; CMake builds only test_*.c) with a few thousand inputs:
 * every accepted name (table rows, aliases, every kvarn_k{kb}v{vb}_g{G})
 * at served and unserved head_dims with hostile record bytes, mutations of
 * those names (byte flips, truncation, insertion, duplication, case), and
 * random bytes. Runs in ctest, and under ASan+UBSan in CI. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include "fuzz_format.c"
#include "common/testutil.h"
#include "fuzz/corpus_replay.h"

#define MAX_IN 256

typedef struct names { char s[64][32]; int n; } names;

static void accepted_names(names *N)
{
    N->n = 0;
    for (int i = 0; i < kvarn_format_count(); i++)
        snprintf(N->s[N->n++], 32, "%s", kvarn_format_name_at(i));
    snprintf(N->s[N->n++], 32, "auto");
    snprintf(N->s[N->n++], 32, "fp8");
    const int bits[3] = {2, 4, 8}, gs[3] = {32, 64, 128};
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++)
            for (int g = 0; g < 3; g++)
                snprintf(N->s[N->n++], 32, "kvarn_k%dv%d_g%d", bits[a], bits[b], gs[g]);
}

/* name, 0x00, head_dim (int16 LE), flags, n_rest random bytes */
static size_t make_input(uint8_t *buf, const char *name, size_t name_len, int hd,
                         unsigned flags, size_t n_rest, test_rng *r)
{
    size_t n = 0;
    memcpy(buf, name, name_len);
    n = name_len;
    buf[n++] = 0;
    buf[n++] = (uint8_t)(hd & 0xff);
    buf[n++] = (uint8_t)((hd >> 8) & 0xff);
    buf[n++] = (uint8_t)flags;
    for (size_t i = 0; i < n_rest && n < MAX_IN; i++) buf[n++] = (uint8_t)test_rng_u64(r);
    return n;
}

static void run_one(const uint8_t *buf, size_t n)
{
    int rc = kvarn_fuzz_format(buf, n);
    if (rc != 0) {
        char show[80];
        size_t m = n < 40 ? n : 40;
        for (size_t i = 0; i < m; i++) show[i] = (buf[i] >= 32 && buf[i] < 127) ? (char)buf[i] : '.';
        show[m] = '\0';
        fail_msg("fuzz invariant %d broken on input '%s' (%zu bytes)", rc, show, n);
    }
}

static void test_accepted_names(void **state)
{
    (void)state;
    names N;
    accepted_names(&N);
    test_rng r;
    test_rng_seed(&r, 0xf022);
    const int dims[] = {64, 128, 256, 2, 1024, 96, 0, -64, 7, 32767};
    uint8_t buf[MAX_IN];
    int ran = 0;
    for (int i = 0; i < N.n; i++) {
        kvarn_format f;
        assert_int_equal(kvarn_format_parse(N.s[i], &f), KVARN_OK);
        for (size_t d = 0; d < sizeof dims / sizeof dims[0]; d++)
            for (unsigned flags = 0; flags < 4; flags++) {
                size_t n = make_input(buf, N.s[i], strlen(N.s[i]), dims[d], flags,
                                      test_rng_below(&r, 200), &r);
                run_one(buf, n);
                ran++;
            }
    }
    assert_true(ran > 1000);
}

static void test_mutations(void **state)
{
    (void)state;
    names N;
    accepted_names(&N);
    test_rng r;
    test_rng_seed(&r, 0x307a);
    const char alphabet[] = "kvarn_gfpitbe0123456789v_ KVG\x01\xff";
    uint8_t buf[MAX_IN];
    char name[64];
    for (int i = 0; i < N.n; i++) {
        for (int m = 0; m < 40; m++) {
            size_t len = strlen(N.s[i]);
            memcpy(name, N.s[i], len);
            size_t pos = len ? test_rng_below(&r, (uint32_t)len) : 0;
            switch (m % 6) {
            case 0: name[pos] = alphabet[test_rng_below(&r, sizeof alphabet - 1)]; break;
            case 1: len = pos; break; /* truncate */
            case 2: /* insert */
                memmove(name + pos + 1, name + pos, len - pos);
                name[pos] = alphabet[test_rng_below(&r, sizeof alphabet - 1)];
                len++;
                break;
            case 3: /* duplicate a tail */
                if (len + (len - pos) < sizeof name) { memcpy(name + len, name + pos, len - pos); len += len - pos; }
                break;
            case 4: name[pos] = (char)(name[pos] ^ 0x20); break; /* case / bit flip */
            default: name[pos] = (char)(name[pos] ^ (1 << test_rng_below(&r, 8))); break;
            }
            /* a mutated name may contain 0x00: then it is the separator */
            int hd = (m & 1) ? 64 : 128;
            size_t n = make_input(buf, name, len, hd, (unsigned)m & 3u, test_rng_below(&r, 64), &r);
            run_one(buf, n);
        }
    }
}

static void test_random_bytes(void **state)
{
    (void)state;
    test_rng r;
    test_rng_seed(&r, 0xbad);
    uint8_t buf[MAX_IN];
    for (int i = 0; i < 2000; i++) {
        size_t n = test_rng_below(&r, MAX_IN);
        for (size_t j = 0; j < n; j++) buf[j] = (uint8_t)test_rng_u64(&r);
        run_one(buf, n);
    }
    run_one(buf, 0);
    /* no separator: the whole input is the name, head_dim 128 */
    run_one((const uint8_t *)"int4", 4);
    run_one((const uint8_t *)"kvarn_k4v2_g128", 15);
}

/* The harness itself must be able to fail: a canonical-name round trip and
 * the untouched-on-rejection check are observable through it. */
static void test_harness_sees_parse(void **state)
{
    (void)state;
    kvarn_format f;
    memset(&f, 0x6b, sizeof f);
    assert_int_equal(kvarn_format_parse("int3", &f), KVARN_ERR_UNKNOWN_FORMAT);
    assert_int_equal(((unsigned char *)&f)[0], 0x6b);
    assert_int_equal(kvarn_fuzz_format((const uint8_t *)"int8\0\x40\x00\x00", 8), 0);
}

static int replay_format(const uint8_t *data, size_t size, const char *name)
{
    (void)name;
    return kvarn_fuzz_format(data, size);
}

/* The committed corpus (tests/fuzz/corpus/format): the seeds of
 * scripts/fuzz.sh and every input a campaign found crashing. */
static void test_corpus_replay(void **state)
{
    (void)state;
    char bad[256] = "";
    int n = corpus_replay("format", replay_format, bad, sizeof bad);
    if (n == -3) fail_msg("corpus input %s broke an invariant", bad);
    if (n < 0) fail_msg("cannot read tests/fuzz/corpus/format (KVARN_SOURCE_DIR unset? run through ctest)");
    assert_true(n >= 11); /* at least the committed seeds */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_accepted_names),
        cmocka_unit_test(test_mutations),
        cmocka_unit_test(test_random_bytes),
        cmocka_unit_test(test_harness_sees_parse),
        cmocka_unit_test(test_corpus_replay),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
