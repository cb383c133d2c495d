/* test_mla_record.c -- MLA records (include/kvarn/mla.h,
 * src/codec/mla_record.c): format names, record sizes against the layout
 * table's arithmetic, the latent part being exactly the KVarN K half of a
 * kvarn_encode record, encode -> decode error within the bound derived from
 * each channel's RTN step, and hostile inputs (clear error, record
 * untouched).
 *
 * Latent-like data: c_kv after its RMSNorm is about unit RMS per token
 * with a few outlier channels (here 8 channels of 8x scale); k_pe is a
 * RoPE'd key: pairs (x_2i, x_2i+1) rotated by angle t theta_i. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "kvarn/kvarn.h"
#include "kvarn/mla.h"
#include "common/levels.h"
#include "common/testutil.h"

enum { MAXD = 512, MAXG = 128, MAXR = 128 };

/* Latent-like rows [G][D] and RoPE'd rope rows [G][R] (see above). */
static void latent_like(test_rng *r, int G, int D, int R, float *lat, float *rope)
{
    for (int t = 0; t < G; t++)
        for (int d = 0; d < D; d++)
            lat[t * D + d] = (float)(test_rng_normal(r) * (d % (D / 8) == 3 ? 8.0 : 1.0));
    for (int t = 0; t < G; t++)
        for (int i = 0; i < R / 2; i++) {
            const double th = t * pow(10000.0, -2.0 * i / R);
            const double x = 2.0 * test_rng_normal(r) + 1.0, y = 2.0 * test_rng_normal(r);
            rope[t * R + 2 * i] = (float)(x * cos(th) - y * sin(th));
            rope[t * R + 2 * i + 1] = (float)(x * sin(th) + y * cos(th));
        }
}

static void test_parse(void **state)
{
    (void)state;
    static const struct { const char *name; int kb, g, rb; } ok[] = {
        {"kvarn_mla_k4_g128", 4, 128, KVARN_MLA_DEFAULT_ROPE_BITS},
        {"kvarn_mla_k4r8_g128", 4, 128, 8},   {"kvarn_mla_k4r16_g128", 4, 128, 16},
        {"kvarn_mla_k2_g64", 2, 64, KVARN_MLA_DEFAULT_ROPE_BITS},
        {"kvarn_mla_k8r8_g64", 8, 64, 8},     {"kvarn_mla_k2r16_g128", 2, 128, 16},
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        kvarn_mla_format f = {0, 0, 0};
        assert_int_equal(kvarn_mla_format_parse(ok[i].name, &f), KVARN_OK);
        assert_int_equal(f.latent_bits, ok[i].kb);
        assert_int_equal(f.tile_tokens, ok[i].g);
        assert_int_equal(f.rope_bits, ok[i].rb);
        assert_int_equal(kvarn_mla_check_dims(&f, 512, 64), KVARN_OK);
    }
    static const char *bad[] = {"kvarn_mla_k3_g128", "kvarn_mla_k4_g32", "kvarn_mla_k4_g256",
                                "kvarn_mla_k4r4_g128", "kvarn_mla_k4r_g128", "kvarn_mla_k4_g128x",
                                "kvarn_mla_k4_g", "kvarn_mla_k_g128", "kvarn_k4v2_g128",
                                "kvarn_mla_k04_g0128x", "kvarn_mla_k4444_g128", "", "KVARN_MLA_K4_G128",
                                /* one spelling per format: no leading zeros */
                                "kvarn_mla_k04_g128", "kvarn_mla_k4_g064", "kvarn_mla_k4r08_g128",
                                "kvarn_mla_k4r016_g128", "kvarn_mla_k0_g128"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvarn_mla_format f = {7, 7, 7};
        assert_int_equal(kvarn_mla_format_parse(bad[i], &f), KVARN_ERR_UNKNOWN_FORMAT);
        assert_int_equal(f.latent_bits, 7); /* untouched */
        char buf[256];
        kvarn_mla_format_explain(KVARN_ERR_UNKNOWN_FORMAT, bad[i], 0, 0, buf, sizeof buf);
        assert_non_null(strstr(buf, "kvarn_mla_k{2,4,8}"));
    }
    kvarn_mla_format f;
    assert_int_equal(kvarn_mla_format_parse(NULL, &f), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_mla_format_parse("kvarn_mla_k4_g128", NULL), KVARN_ERR_INVALID_ARG);
    /* the MLA names are not cache formats of the per-head path */
    kvarn_format kf;
    assert_int_equal(kvarn_format_parse("kvarn_mla_k4_g128", &kf), KVARN_ERR_UNKNOWN_FORMAT);
}

static void test_check_dims(void **state)
{
    (void)state;
    kvarn_mla_format f = {4, 128, 16};
    static const int bad_d[] = {0, 32, 96, 1024, 2048, -512};
    for (size_t i = 0; i < sizeof bad_d / sizeof bad_d[0]; i++) {
        assert_int_equal(kvarn_mla_check_dims(&f, bad_d[i], 64), KVARN_ERR_UNSUPPORTED_HEAD_DIM);
        assert_int_equal(kvarn_mla_record_bytes(&f, bad_d[i], 64), 0);
        assert_int_equal(kvarn_mla_workspace_bytes(&f, bad_d[i], 64, 1, 1), 0);
    }
    static const int bad_r[] = {-16, 8, 24 + 1, 144, 256};
    for (size_t i = 0; i < sizeof bad_r / sizeof bad_r[0]; i++)
        assert_int_equal(kvarn_mla_check_dims(&f, 512, bad_r[i]), KVARN_ERR_UNSUPPORTED_HEAD_DIM);
    char buf[256];
    kvarn_mla_format_explain(KVARN_ERR_UNSUPPORTED_HEAD_DIM, "kvarn_mla_k4_g128", 1024, 64, buf, sizeof buf);
    assert_non_null(strstr(buf, "1024"));
    static const kvarn_mla_format malformed[] = {{3, 128, 16}, {4, 32, 16}, {4, 128, 4}, {0, 0, 0}};
    for (size_t i = 0; i < sizeof malformed / sizeof malformed[0]; i++) {
        assert_int_equal(kvarn_mla_check_dims(&malformed[i], 512, 64), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_mla_record_bytes(&malformed[i], 512, 64), 0);
    }
    assert_int_equal(kvarn_mla_check_dims(NULL, 512, 64), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_mla_workspace_bytes(&f, 512, 64, -1, 1), 0);
    assert_int_equal(kvarn_mla_workspace_bytes(&f, 512, 64, 1 << 11, 1 << 10), 0); /* 2^21 rows */
    assert_true(kvarn_mla_workspace_bytes(&f, 512, 64, 1 << 10, 1 << 10) > 0);
}

/* Record bytes against the table of mla.h, field by field; and the
 * capacity against vLLM's MLA cache (576 channels per token in bf16 or
 * fp32), printed. */
static void test_record_bytes(void **state)
{
    (void)state;
    static const int bits[] = {2, 4, 8}, gs[] = {64, 128}, rbs[] = {8, 16};
    static const int ds[] = {64, 128, 256, 512}, rs[] = {0, 16, 64, 128};
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 2; b++)
            for (int c = 0; c < 2; c++)
                for (int i = 0; i < 4; i++)
                    for (int j = 0; j < 4; j++) {
                        const kvarn_mla_format f = {bits[a], gs[b], rbs[c]};
                        const size_t D = (size_t)ds[i], R = (size_t)rs[j], G = (size_t)gs[b];
                        size_t want = D * G * (size_t)bits[a] / 8 + 2 * D + 2 * D + 2 * G;
                        want += rbs[c] == 16 ? 2 * G * R : (R ? G * R + 2 * G + 2 * G : 0);
                        want = (want + 7) / 8 * 8;
                        assert_int_equal(kvarn_mla_record_bytes(&f, ds[i], rs[j]), want);
                    }
    /* DeepSeek-V3's 512 + 64, G = 128, by hand: codes 512*128/2 = 32768,
     * a_d b_d 2048, s_tok 256; rope fp16 128*64*2 = 16384, or int8 8192 +
     * scale/zero 512. */
    const kvarn_mla_format k4r16 = {4, 128, 16}, k4r8 = {4, 128, 8}, k2r8 = {2, 128, 8};
    assert_int_equal(kvarn_mla_record_bytes(&k4r16, 512, 64), 51456);
    assert_int_equal(kvarn_mla_record_bytes(&k4r8, 512, 64), 43776);
    /* the name without r: the rope at 8 bits (docs/mla.md's measurement) */
    kvarn_mla_format dflt;
    assert_int_equal(kvarn_mla_format_parse("kvarn_mla_k4_g128", &dflt), KVARN_OK);
    assert_int_equal(kvarn_mla_record_bytes(&dflt, 512, 64), 43776);
    const struct { const char *name; const kvarn_mla_format *f; } rows[] = {
        {"kvarn_mla_k4r16_g128", &k4r16}, {"kvarn_mla_k4r8_g128", &k4r8}, {"kvarn_mla_k2r8_g128", &k2r8}};
    printf("MLA cache per token and layer, latent 512 + rope 64 (vLLM: 576 channels):\n");
    printf("  %-22s %8s %10s %10s\n", "format", "bytes", "x bf16", "x fp32");
    printf("  %-22s %8d %10s %10s\n", "vLLM bf16", 576 * 2, "1.00x", "");
    printf("  %-22s %8d %10s %10s\n", "vLLM fp32", 576 * 4, "0.50x", "1.00x");
    for (int i = 0; i < 3; i++) {
        const double per_tok = (double)kvarn_mla_record_bytes(rows[i].f, 512, 64) / 128.0;
        printf("  %-22s %8.1f %9.2fx %9.2fx\n", rows[i].name, per_tok, 1152.0 / per_tok, 2304.0 / per_tok);
        assert_true(per_tok < 1152.0 / 2.5); /* the point of the format: > 2.5x bf16 */
    }
}

/* The latent part is the K half of a KVarN record with the latent as K:
 * kvarn_encode(kvarn_k{b}v{b}_g{G}, D, k = latent) writes the same bytes
 * first (record.h: K codes, a_d, b_d, s_tok_t), so the MLA record reuses
 * the tile codec and its layout exactly. */
static void test_latent_is_kvarn_k_tile(void **state)
{
    (void)state;
    static float lat[MAXG * MAXD], rope[MAXG * MAXR];
    test_rng r;
    test_rng_seed(&r, 11);
    static const char *names[] = {"kvarn_k4v4_g128", "kvarn_k2v2_g64", "kvarn_k8v8_g128"};
    static const kvarn_mla_format mf[] = {{4, 128, 8}, {2, 64, 16}, {8, 128, 16}};
    for (int i = 0; i < 3; i++)
        for (int D = 64; D <= 512; D *= 2) {
            const int G = mf[i].tile_tokens, R = 64;
            latent_like(&r, G, D, R, lat, rope);
            kvarn_format kf;
            assert_int_equal(kvarn_format_parse(names[i], &kf), KVARN_OK);
            const size_t kb = kvarn_record_bytes(&kf, D), kw = kvarn_encode_workspace_bytes(&kf, D);
            const size_t mb = kvarn_mla_record_bytes(&mf[i], D, R), mw = kvarn_mla_workspace_bytes(&mf[i], D, R, 0, 0);
            uint8_t *krec = malloc(kb), *mrec = malloc(mb);
            void *kws = malloc(kw), *mws = malloc(mw);
            assert_int_equal(kvarn_encode(&kf, D, lat, lat, krec, kb, kws, kw, NULL), KVARN_OK);
            assert_int_equal(kvarn_mla_encode(&mf[i], D, R, lat, rope, mws, mrec), KVARN_OK);
            const size_t latent_bytes = (size_t)D * G * mf[i].latent_bits / 8 + 4 * (size_t)D + 2 * (size_t)G;
            assert_memory_equal(krec, mrec, latent_bytes);
            free(krec), free(mrec), free(kws), free(mws);
        }
}

static float f16_at(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return kvarn_fp16_to_fp32(h);
}

/* Encode -> decode error, per token, against the bound of each element:
 * in the rotated basis c_rot[d,t] = (code a_d + b_d) s_tok_t, and the RTN
 * of the balanced value y (spec step 3) is off by at most scale / 2, which
 * the fold turns into s_tok_t |a_d| / 2; the fp16 roundings of a_d, b_d
 * (folded in fp32 then rounded) and s_tok_t add at most 2^-11 each of
 * (code |a_d| + |b_d|) s_tok_t, and the fp32 steps a few 2^-24 of it:
 *   e[d,t] <= s_tok_t (|a_d| / 2 + 2^-9 (qmax |a_d| + |b_d|)).
 * The Hadamard rotation is orthonormal, so the token's L2 error is
 * sqrt(sum_d e^2) in either basis, plus the two fp32 rotations' rounding
 * (log2(D) + 2) 2^-24 each of the token's norm.
 * Rope: fp16 within half an fp16 ulp (2^-11 |x|, 2^-25 below 2^-14); int8
 * within scale_t / 2 (per_token.c's rule) plus the fp32 of code scale +
 * zero (2^-23 (|x| + scale)). The latent error is also checked to be an
 * RTN error at all (see the last check). */
static void test_roundtrip_bound(void **state)
{
    (void)state;
    static float lat[MAXG * MAXD], rope[MAXG * MAXR], dl[MAXG * MAXD], dr[MAXG * MAXR];
    test_rng r;
    test_rng_seed(&r, 5);
    static const int bits[] = {2, 4, 8}, gs[] = {64, 128}, rbs[] = {8, 16}, rs[] = {0, 64, 128};
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 2; b++)
            for (int c = 0; c < 2; c++)
                for (int D = 64; D <= 512; D *= 2)
                    for (int j = 0; j < 3; j++) {
                        const kvarn_mla_format f = {bits[a], gs[b], rbs[c]};
                        const int G = gs[b], R = rs[j];
                        latent_like(&r, G, D, R, lat, rope);
                        const size_t nb = kvarn_mla_record_bytes(&f, D, R);
                        uint8_t *rec = malloc(nb);
                        void *ws = malloc(kvarn_mla_workspace_bytes(&f, D, R, 0, 0));
                        assert_int_equal(kvarn_mla_encode(&f, D, R, lat, R ? rope : NULL, ws, rec), KVARN_OK);
                        assert_int_equal(kvarn_mla_decode(&f, D, R, rec, dl, dr), KVARN_OK);
                        const size_t a_off = (size_t)D * G * f.latent_bits / 8, b_off = a_off + 2 * (size_t)D;
                        const size_t s_off = b_off + 2 * (size_t)D, rope_off = s_off + 2 * (size_t)G;
                        const double qmax = (double)((1 << f.latent_bits) - 1);
                        const double hs = (log2((double)D) + 2.0) * 0x1p-24;
                        double worst_rtn = 0.0;
                        for (int t = 0; t < G; t++) {
                            const double s = f16_at(rec + s_off + 2 * (size_t)t);
                            double b2 = 0.0, e2 = 0.0, x2 = 0.0, h2 = 0.0;
                            for (int d = 0; d < D; d++) {
                                const double ad = fabs(f16_at(rec + a_off + 2 * (size_t)d));
                                const double bd = fabs(f16_at(rec + b_off + 2 * (size_t)d));
                                const double e = s * (ad / 2.0 + 0x1p-9 * (qmax * ad + bd));
                                b2 += e * e;
                                h2 += s * ad / 2.0 * (s * ad / 2.0);
                                const double err = (double)dl[t * D + d] - lat[t * D + d];
                                e2 += err * err;
                                x2 += (double)lat[t * D + d] * lat[t * D + d];
                            }
                            const double bound = sqrt(b2) + 2.0 * hs * sqrt(x2) * 1.01;
                            if (!(sqrt(e2) <= bound))
                                fail_msg("k%d g%d r%d D%d R%d token %d: |err| %g > bound %g", f.latent_bits, G,
                                         f.rope_bits, D, R, t, sqrt(e2), bound);
                            worst_rtn = fmax(worst_rtn, sqrt(e2 / h2));
                            for (int k = 0; k < R; k++) {
                                const double x = rope[t * R + k], y = dr[t * R + k];
                                double rb;
                                if (f.rope_bits == 16) {
                                    rb = fmax(fabs(x) * 0x1p-11, 0x1p-25);
                                } else {
                                    const size_t so = rope_off + (size_t)G * R + 2 * (size_t)t;
                                    const double sc = f16_at(rec + so);
                                    rb = sc / 2.0 + 0x1p-23 * (fabs(x) + sc);
                                }
                                if (!(fabs(x - y) <= rb))
                                    fail_msg("rope r%d token %d ch %d: %g vs %g (bound %g)", f.rope_bits, t, k, x, y, rb);
                            }
                        }
                        /* not loose: an RTN error spread evenly over its step
                         * has an RMS of 1/sqrt(3) of the half step, so the
                         * tile's worst token must reach half of that (a
                         * decode that lost the codes would be far above the
                         * bound; one that kept the input would be 0 here) */
                        if (!(worst_rtn > 0.5 / sqrt(3.0)))
                            fail_msg("k%d g%d r%d D%d R%d: worst error %g of the half steps", f.latent_bits, G,
                                     f.rope_bits, D, R, worst_rtn);
                        free(rec), free(ws);
                    }
}

/* Every SIMD level of the codec writes the same bytes (the tile codec's
 * promise, kvarn_tile.c), so a record means the same whichever CPU wrote
 * it: encode at each level this process runs (the walk of
 * tests/common/levels.h: KVARN_SIMD set per pass) and compare. */
static void test_levels_same_bytes(void **state)
{
    (void)state;
    static float lat[MAXG * MAXD], rope[MAXG * MAXR];
    test_rng r;
    test_rng_seed(&r, 21);
    static const kvarn_mla_format fs[] = {{4, 128, 8}, {2, 64, 16}, {8, 128, 8}};
    for (int i = 0; i < 3; i++)
        for (int D = 64; D <= 512; D *= 4) {
            const int G = fs[i].tile_tokens, R = 64;
            latent_like(&r, G, D, R, lat, rope);
            const size_t nb = kvarn_mla_record_bytes(&fs[i], D, R);
            uint8_t *rec[LEVELS_MAX];
            int nl = 0;
            void *ws = malloc(kvarn_mla_workspace_bytes(&fs[i], D, R, 0, 0));
            LEVELS_FOR(it) { /* scalar first: rec[0] */
                const int l = it.index;
                rec[l] = malloc(nb);
                nl = l + 1;
                assert_int_equal(kvarn_mla_encode(&fs[i], D, R, lat, rope, ws, rec[l]), KVARN_OK);
                if (l > 0) assert_memory_equal(rec[l], rec[0], nb);
            }
            for (int l = 0; l < nl; l++) free(rec[l]);
            free(ws);
        }
}

/* NaN / Inf / out-of-range inputs and NULLs: a clear error, the record
 * untouched. */
static void test_hostile(void **state)
{
    (void)state;
    static float lat[MAXG * MAXD], rope[MAXG * MAXR];
    test_rng r;
    test_rng_seed(&r, 3);
    const int D = 512, R = 64;
    for (int rb = 8; rb <= 16; rb += 8) {
        const kvarn_mla_format f = {4, 128, rb};
        const int G = f.tile_tokens;
        const size_t nb = kvarn_mla_record_bytes(&f, D, R);
        uint8_t *rec = malloc(nb), *ref = malloc(nb);
        void *ws = malloc(kvarn_mla_workspace_bytes(&f, D, R, 0, 0));
        memset(ref, 0xa5, nb);
        struct { float *buf; size_t at; float v; } cases[] = {
            {lat, 77, NAN}, {lat, (size_t)G * D - 1, INFINITY}, {lat, 5, -INFINITY},
            {lat, 9, 0x1p45f}, /* beyond what a record can hold */
            {rope, 0, NAN}, {rope, (size_t)G * R - 1, -INFINITY},
            {rope, 100, rb == 16 ? 70000.0f : 1e38f}, /* beyond fp16 (r16), scale overflow (r8) */
        };
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            latent_like(&r, G, D, R, lat, rope);
            cases[i].buf[cases[i].at] = cases[i].v;
            if (rb == 8 && cases[i].buf == rope && i == 6) rope[101] = -1e38f;
            memcpy(rec, ref, nb);
            assert_int_equal(kvarn_mla_encode(&f, D, R, lat, rope, ws, rec), KVARN_ERR_NONFINITE);
            assert_memory_equal(rec, ref, nb);
        }
        latent_like(&r, G, D, R, lat, rope);
        memcpy(rec, ref, nb);
        assert_int_equal(kvarn_mla_encode(&f, D, R, NULL, rope, ws, rec), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_mla_encode(&f, D, R, lat, NULL, ws, rec), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_mla_encode(&f, D, R, lat, rope, NULL, rec), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_mla_encode(&f, D, R, lat, rope, ws, NULL), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_mla_encode(NULL, D, R, lat, rope, ws, rec), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_mla_encode(&f, 1024, R, lat, rope, ws, rec), KVARN_ERR_UNSUPPORTED_HEAD_DIM);
        assert_int_equal(kvarn_mla_encode(&f, D, 72, lat, rope, ws, rec), KVARN_ERR_UNSUPPORTED_HEAD_DIM);
        assert_memory_equal(rec, ref, nb);
        assert_int_equal(kvarn_mla_decode(&f, D, R, NULL, lat, rope), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_mla_decode(&f, 96, R, rec, lat, rope), KVARN_ERR_UNSUPPORTED_HEAD_DIM);
        /* rope_dim 0: rope may be NULL */
        assert_int_equal(kvarn_mla_encode(&f, D, 0, lat, NULL, ws, rec), KVARN_OK);
        assert_int_equal(kvarn_mla_decode(&f, D, 0, rec, lat, NULL), KVARN_OK);
        free(rec), free(ref), free(ws);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse),
        cmocka_unit_test(test_check_dims),
        cmocka_unit_test(test_record_bytes),
        cmocka_unit_test(test_latent_is_kvarn_k_tile),
        cmocka_unit_test(test_roundtrip_bound),
        cmocka_unit_test_teardown(test_levels_same_bytes, levels_teardown),
        cmocka_unit_test(test_hostile),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
