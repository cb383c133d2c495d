/* test_pack.c -- bit packing of codes (src/codec/pack.c) and where the codes
 * of a KVarN record sit (../shared/spec/KVARN.md step 5, record.h).
 *
 * Oracles: hand-computed bytes; a bit-by-bit reader written here from the
 * spec's sentence "code i of the row in byte i/(8/bits) at bit offset
 * (i mod (8/bits))*bits, low bits first"; and, through a full record, a tile
 * crafted so that RTN gives codes known in advance (identity balance, every
 * row spanning exactly [0, 2^bits - 1]). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "kvarn/kvarn.h"
#include "kvarn/record.h"
#include "codec/pack.h"
#include "common/testutil.h"

/* Code i of a packed row, read straight from the spec's sentence. */
static unsigned spec_code(const uint8_t *row, size_t i, int bits)
{
    size_t per = 8 / (size_t)bits;
    unsigned v = 0;
    for (int bit = 0; bit < bits; bit++) {
        size_t pos = (i % per) * (size_t)bits + (size_t)bit;
        v |= (unsigned)((row[i / per] >> pos) & 1u) << bit;
    }
    return v;
}

static void test_hand_vectors(void **state)
{
    (void)state;
    uint8_t out[8];
    const uint8_t c4[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    assert_int_equal(kvarn_pack_codes(c4, 8, 4, out), KVARN_OK);
    const uint8_t e4[4] = {16, 50, 84, 118}; /* 0x10 0x32 0x54 0x76 */
    assert_memory_equal(out, e4, 4);

    const uint8_t c2[4] = {0, 1, 2, 3};
    assert_int_equal(kvarn_pack_codes(c2, 4, 2, out), KVARN_OK);
    assert_int_equal(out[0], 228); /* 0b11100100 */

    const uint8_t c8[5] = {0, 1, 127, 128, 255};
    memset(out, 0xAA, sizeof out);
    assert_int_equal(kvarn_pack_codes(c8, 5, 8, out), KVARN_OK);
    assert_memory_equal(out, c8, 5);
    assert_int_equal(out[5], 0xAA); /* nothing written past the row */

    /* Partial last byte: the unused high bits are 0. */
    const uint8_t c3[3] = {3, 2, 1};
    memset(out, 0xFF, sizeof out);
    assert_int_equal(kvarn_pack_codes(c3, 3, 2, out), KVARN_OK);
    assert_int_equal(out[0], 3 | 2 << 2 | 1 << 4);
    assert_int_equal(out[1], 0xFF);
    const uint8_t c1[1] = {9};
    assert_int_equal(kvarn_pack_codes(c1, 1, 4, out), KVARN_OK);
    assert_int_equal(out[0], 9);

    /* Only the low bits of an out-of-range code are kept. */
    const uint8_t big[2] = {0x1F, 0xF2};
    assert_int_equal(kvarn_pack_codes(big, 2, 4, out), KVARN_OK);
    assert_int_equal(out[0], 0x2F);

    assert_int_equal(kvarn_packed_bytes(128, 4), 64);
    assert_int_equal(kvarn_packed_bytes(5, 2), 2);
    assert_int_equal(kvarn_packed_bytes(3, 8), 3);
}

static void test_bad_args(void **state)
{
    (void)state;
    uint8_t c[4] = {1, 2, 3, 0}, out[4] = {0x5a, 0x5a, 0x5a, 0x5a};
    const int bad_bits[] = {0, 1, 3, 5, 16, -4};
    for (size_t i = 0; i < sizeof bad_bits / sizeof bad_bits[0]; i++) {
        assert_int_equal(kvarn_pack_codes(c, 4, bad_bits[i], out), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_unpack_codes(c, 4, bad_bits[i], out), KVARN_ERR_INVALID_ARG);
    }
    assert_int_equal(out[0], 0x5a);
    assert_int_equal(kvarn_pack_codes(NULL, 4, 4, out), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_pack_codes(c, 4, 4, NULL), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_unpack_codes(NULL, 4, 4, out), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_unpack_codes(c, 4, 4, NULL), KVARN_ERR_INVALID_ARG);
}

/* Random codes of every width and many lengths (partial bytes included):
 * pack, read back bit by bit, unpack, compare. */
static void test_round_trip(void **state)
{
    (void)state;
    test_rng r;
    test_rng_seed(&r, 0x9ac4ull);
    uint8_t codes[600], packed[600], back[600];
    const int widths[] = {2, 4, 8};
    for (int w = 0; w < 3; w++) {
        const int bits = widths[w];
        for (int rep = 0; rep < 200; rep++) {
            size_t n = rep < 100 ? (size_t)(rep + 1) : 512;
            for (size_t i = 0; i < n; i++) codes[i] = (uint8_t)test_rng_below(&r, 1u << bits);
            memset(packed, 0xC3, sizeof packed);
            assert_int_equal(kvarn_pack_codes(codes, n, bits, packed), KVARN_OK);
            size_t nb = kvarn_packed_bytes(n, bits);
            assert_int_equal(packed[nb], 0xC3); /* nothing past the row */
            for (size_t i = 0; i < n; i++) {
                assert_int_equal(spec_code(packed, i, bits), codes[i]);
                assert_int_equal(kvarn_packed_code_at(packed, i, bits), codes[i]);
            }
            memset(back, 0xEE, sizeof back);
            assert_int_equal(kvarn_unpack_codes(packed, n, bits, back), KVARN_OK);
            assert_memory_equal(back, codes, n);
            assert_int_equal(back[n], 0xEE);
        }
    }
}

/* The code the crafted tile must produce at (row, i): row spans exactly
 * [0, qmax] (i = 0 -> 0, i = 1 -> qmax), the rest is a pattern that differs
 * between rows so a transposed layout would be caught. */
static unsigned crafted(int row, int i, int bits)
{
    const unsigned qmax = (1u << bits) - 1u;
    if (i == 0) return 0;
    if (i == 1) return qmax;
    return (unsigned)(row * 7 + i * 3 + row * i) % (qmax + 1u);
}

static uint16_t rd16(const uint8_t *p, size_t i)
{
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    return h;
}

/* Through a full record: K codes are D rows (channels) of G codes, V codes G
 * rows (tokens) of D codes. With the input already rotated and balance off,
 * each row's RTN has lo = 0, scale = 1, so code = value. */
static void test_record_orientation(void **state)
{
    (void)state;
    const char *names[] = {"kvarn_k4v2_g64", "kvarn_k2v4_g128", "kvarn_k8v8_g64",
                           "kvarn_k2v8_g32", "kvarn_k8v2_g128"};
    const int dims[] = {64, 128, 256, 512};
    for (size_t f = 0; f < sizeof names / sizeof names[0]; f++) {
        for (int di = 0; di < 4; di++) {
            kvarn_format fmt;
            assert_int_equal(kvarn_format_parse(names[f], &fmt), KVARN_OK);
            const int D = dims[di], G = fmt.tile_tokens, kb = fmt.key_bits, vb = fmt.value_bits;
            kvarn_record_layout L;
            assert_int_equal(kvarn_record_layout_get(&fmt, D, &L), KVARN_OK);
            float *k = malloc(sizeof(float) * (size_t)(D * G));
            float *v = malloc(sizeof(float) * (size_t)(D * G));
            uint8_t *rec = malloc(L.record_bytes);
            size_t wsb = kvarn_encode_workspace_bytes(&fmt, D);
            void *ws = aligned_alloc(64, (wsb + 63) / 64 * 64);
            assert_non_null(k);
            assert_non_null(v);
            assert_non_null(rec);
            assert_non_null(ws);
            for (int t = 0; t < G; t++)
                for (int d = 0; d < D; d++) {
                    k[t * D + d] = (float)crafted(d, t, kb); /* K row = channel d */
                    v[t * D + d] = (float)crafted(t, d, vb); /* V row = token t */
                }
            kvarn_codec_opts o = {0, 1, KVARN_RTN_MINMAX}; /* identity balance, prerotated */
            assert_int_equal(kvarn_encode(&fmt, D, k, v, rec, L.record_bytes, ws, wsb, &o), KVARN_OK);
            const size_t krow = (size_t)G * (size_t)kb / 8, vrow = (size_t)D * (size_t)vb / 8;
            for (int d = 0; d < D; d++)
                for (int t = 0; t < G; t++)
                    assert_int_equal(spec_code(rec + L.k_codes_off + (size_t)d * krow, (size_t)t, kb),
                                     crafted(d, t, kb));
            for (int t = 0; t < G; t++)
                for (int d = 0; d < D; d++)
                    assert_int_equal(spec_code(rec + L.v_codes_off + (size_t)t * vrow, (size_t)d, vb),
                                     crafted(t, d, vb));
            /* a = 1 (fp16 0x3C00), b = 0, s = 1 everywhere */
            for (int d = 0; d < D; d++) {
                assert_int_equal(rd16(rec + L.k_a_off, (size_t)d), 0x3C00);
                assert_int_equal(rd16(rec + L.k_b_off, (size_t)d), 0x0000);
                assert_int_equal(rd16(rec + L.v_schan_off, (size_t)d), 0x3C00);
            }
            for (int t = 0; t < G; t++) {
                assert_int_equal(rd16(rec + L.k_stok_off, (size_t)t), 0x3C00);
                assert_int_equal(rd16(rec + L.v_a_off, (size_t)t), 0x3C00);
                assert_int_equal(rd16(rec + L.v_b_off, (size_t)t), 0x0000);
            }
            for (size_t i = L.payload_bytes; i < L.record_bytes; i++) assert_int_equal(rec[i], 0);
            free(k);
            free(v);
            free(rec);
            free(ws);
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hand_vectors),
        cmocka_unit_test(test_bad_args),
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_record_orientation),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
