/* test_fuzz_mla.c -- drives the fuzz target of tests/fuzz/fuzz_mla.c
 * (included here; CMake builds only test_*.c): every accepted MLA name at
 * served and unserved dims with hostile record bytes, mutations of those
 * names, random bytes. Runs in ctest, and under ASan+UBSan in CI. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include "fuzz_mla.c"
#include "common/testutil.h"

#define MAX_IN 256

/* name, 0x00, latent_dim, rope_dim (int16 LE), flags, n_rest random bytes */
static size_t make_input(uint8_t *buf, const char *name, size_t name_len, int D, int R,
                         unsigned flags, size_t n_rest, test_rng *r)
{
    size_t n = name_len;
    memcpy(buf, name, name_len);
    buf[n++] = 0;
    buf[n++] = (uint8_t)(D & 0xff);
    buf[n++] = (uint8_t)((D >> 8) & 0xff);
    buf[n++] = (uint8_t)(R & 0xff);
    buf[n++] = (uint8_t)((R >> 8) & 0xff);
    buf[n++] = (uint8_t)flags;
    for (size_t i = 0; i < n_rest && n < MAX_IN; i++) buf[n++] = (uint8_t)test_rng_u64(r);
    return n;
}

static void run_one(const uint8_t *buf, size_t n)
{
    const int rc = kvarn_fuzz_mla(buf, n);
    if (rc != 0) {
        char show[80];
        const size_t m = n < 40 ? n : 40;
        for (size_t i = 0; i < m; i++) show[i] = (buf[i] >= 32 && buf[i] < 127) ? (char)buf[i] : '.';
        show[m] = '\0';
        fail_msg("fuzz invariant %d broken on input '%s' (%zu bytes)", rc, show, n);
    }
}

static int accepted_names(char names[][32])
{
    static const int bits[] = {2, 4, 8}, gs[] = {64, 128};
    static const char *ropes[] = {"", "r8", "r16"};
    int n = 0;
    for (int a = 0; a < 3; a++)
        for (int r = 0; r < 3; r++)
            for (int g = 0; g < 2; g++) snprintf(names[n++], 32, "kvarn_mla_k%d%s_g%d", bits[a], ropes[r], gs[g]);
    return n;
}

static void test_accepted_names(void **state)
{
    (void)state;
    char names[18][32];
    const int nn = accepted_names(names);
    test_rng r;
    test_rng_seed(&r, 0x3a1a);
    static const int dims[][2] = {{512, 64}, {64, 0}, {128, 16}, {256, 128}, {1024, 64}, {96, 64},
                                  {512, 8}, {512, -16}, {0, 0}, {-512, 64}, {32767, 32767}};
    uint8_t buf[MAX_IN];
    for (int i = 0; i < nn; i++)
        for (size_t d = 0; d < sizeof dims / sizeof dims[0]; d++) {
            /* raw float bits (flags bit 1) on half the inputs; tails 0..3 */
            const unsigned flags = (unsigned)(i + (int)d) % 16u;
            run_one(buf, make_input(buf, names[i], strlen(names[i]), dims[d][0], dims[d][1], flags,
                                    test_rng_below(&r, 200), &r));
        }
}

static void test_mutations(void **state)
{
    (void)state;
    char names[18][32], name[64];
    const int nn = accepted_names(names);
    test_rng r;
    test_rng_seed(&r, 0x3a1b);
    const char alphabet[] = "kvarn_mlgr0123456789_ \x01\xff";
    uint8_t buf[MAX_IN];
    for (int i = 0; i < nn; i++)
        for (int m = 0; m < 60; m++) {
            size_t len = strlen(names[i]);
            memcpy(name, names[i], len);
            const size_t pos = test_rng_below(&r, (uint32_t)len);
            switch (m % 4) {
            case 0: name[pos] = alphabet[test_rng_below(&r, sizeof alphabet - 1)]; break;
            case 1: len = pos; break;
            case 2:
                memmove(name + pos + 1, name + pos, len - pos);
                name[pos] = alphabet[test_rng_below(&r, sizeof alphabet - 1)];
                len++;
                break;
            default: name[pos] = (char)(name[pos] ^ (1 << test_rng_below(&r, 8))); break;
            }
            /* small dims: a mutation that still parses runs the record checks fast */
            run_one(buf, make_input(buf, name, len, 64, 16, (unsigned)m & 15u, test_rng_below(&r, 64), &r));
        }
}

static void test_random_bytes(void **state)
{
    (void)state;
    test_rng r;
    test_rng_seed(&r, 0x3a1c);
    uint8_t buf[MAX_IN];
    for (int i = 0; i < 3000; i++) {
        const size_t n = test_rng_below(&r, MAX_IN);
        for (size_t j = 0; j < n; j++) buf[j] = (uint8_t)test_rng_u64(&r);
        run_one(buf, n);
    }
    /* the bare name (no 0x00): dims 512 + 64 */
    run_one((const uint8_t *)"kvarn_mla_k4_g128", strlen("kvarn_mla_k4_g128"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_accepted_names),
        cmocka_unit_test(test_mutations),
        cmocka_unit_test(test_random_bytes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
