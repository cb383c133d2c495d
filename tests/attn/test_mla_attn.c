/* test_mla_attn.c -- absorbed MLA attention over MLA records and an fp32
 * tail (kvarn_mla_attn, src/attn/mla_attn.c): every SIMD level this CPU
 * runs (the walk of tests/common/levels.h: KVARN_SIMD set per pass;
 * kvarn_mla_attn_kernel_name says which ran)
 * against a double-precision softmax over the decoded records
 * (kvarn_mla_decode) and the tail, with a derived bound; levels against
 * each other; rows seeing different lengths (causal drafts, a row that
 * sees one token); rows computed together equal rows computed alone, bit
 * for bit; hostile inputs (clear error, out and lse untouched). */
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

#define U 0x1p-24 /* fp32 unit roundoff */

/* One sequence: records + tail, the decoded tokens (original basis), the
 * bound's per-token magnitudes, queries. */
typedef struct seq {
    kvarn_mla_format f;
    int D, R, G, n_tiles, n_tail, total, n_rows, n_heads;
    uint8_t **rec;
    const uint8_t **recp;
    float *tail_lat, *tail_rope;   /* [n_tail][D], [n_tail][R] */
    double *c, *kpe;               /* [total][D], [total][R] as attention sees them */
    double *amag;                  /* [total]: ||A_t||, see bound() */
    float *q, *qpe;                /* [n_rows][n_heads][D], [..][R] */
    int *row_len;
    float scale;
    void *ws;
} seq;

static float f16_at(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return kvarn_fp16_to_fp32(h);
}

/* Latent-like rows (unit RMS, 8 outlier channels) and RoPE'd key rows. */
static void rows(test_rng *r, int n, int t0, int D, int R, float *lat, float *rope)
{
    for (int t = 0; t < n; t++) {
        for (int d = 0; d < D; d++)
            lat[t * D + d] = (float)(test_rng_normal(r) * (d % (D / 8) == 3 ? 8.0 : 1.0));
        for (int i = 0; i < R / 2; i++) {
            const double th = (t0 + t) * pow(10000.0, -2.0 * i / R);
            const double x = 2.0 * test_rng_normal(r) + 1.0, y = 2.0 * test_rng_normal(r);
            rope[t * R + 2 * i] = (float)(x * cos(th) - y * sin(th));
            rope[t * R + 2 * i + 1] = (float)(x * sin(th) + y * cos(th));
        }
    }
}

static void seq_make(seq *s, const kvarn_mla_format *f, int D, int R, int n_tiles, int n_tail,
                     int n_rows, int n_heads, double qscale, uint64_t seed)
{
    test_rng r;
    test_rng_seed(&r, seed);
    memset(s, 0, sizeof *s);
    s->f = *f, s->D = D, s->R = R, s->G = f->tile_tokens, s->n_tiles = n_tiles, s->n_tail = n_tail;
    s->total = n_tiles * s->G + n_tail, s->n_rows = n_rows, s->n_heads = n_heads;
    const int G = s->G, T = s->total;
    s->rec = calloc((size_t)n_tiles + 1, sizeof *s->rec);
    s->recp = calloc((size_t)n_tiles + 1, sizeof *s->recp);
    s->tail_lat = malloc(sizeof(float) * ((size_t)n_tail * D + 1));
    s->tail_rope = malloc(sizeof(float) * ((size_t)n_tail * R + 1));
    s->c = malloc(sizeof(double) * (size_t)T * D);
    s->kpe = malloc(sizeof(double) * ((size_t)T * R + 1));
    s->amag = malloc(sizeof(double) * (size_t)T);
    s->ws = malloc(kvarn_mla_workspace_bytes(f, D, R, n_rows, n_heads));
    float *lat = malloc(sizeof(float) * (size_t)G * D), *rope = malloc(sizeof(float) * ((size_t)G * R + 1));
    const size_t a_off = (size_t)D * G * f->latent_bits / 8, b_off = a_off + 2 * (size_t)D;
    const size_t s_off = b_off + 2 * (size_t)D;
    const double qmax = (double)((1 << f->latent_bits) - 1);
    for (int i = 0; i < n_tiles; i++) {
        rows(&r, G, i * G, D, R, lat, rope);
        s->rec[i] = malloc(kvarn_mla_record_bytes(f, D, R));
        s->recp[i] = s->rec[i];
        assert_int_equal(kvarn_mla_encode(f, D, R, lat, rope, s->ws, s->rec[i]), KVARN_OK);
        assert_int_equal(kvarn_mla_decode(f, D, R, s->rec[i], lat, rope), KVARN_OK);
        for (int t = 0; t < G; t++) {
            const size_t g = (size_t)i * G + t;
            for (int d = 0; d < D; d++) s->c[g * D + d] = lat[t * D + d];
            for (int j = 0; j < R; j++) s->kpe[g * R + j] = rope[t * R + j];
            /* ||A_t||: A_t[d] = (qmax |a_d| + |b_d|) s_tok_t bounds every
             * term the kernels form for channel d of token t */
            const double st = f16_at(s->rec[i] + s_off + 2 * (size_t)t);
            double a2 = 0.0;
            for (int d = 0; d < D; d++) {
                const double A = (qmax * fabs(f16_at(s->rec[i] + a_off + 2 * (size_t)d)) +
                                  fabs(f16_at(s->rec[i] + b_off + 2 * (size_t)d))) * st;
                a2 += A * A;
            }
            s->amag[g] = sqrt(a2);
        }
    }
    rows(&r, n_tail, n_tiles * G, D, R, s->tail_lat, s->tail_rope);
    for (int t = 0; t < n_tail; t++) {
        const size_t g = (size_t)n_tiles * G + t;
        double c2 = 0.0;
        for (int d = 0; d < D; d++) {
            s->c[g * D + d] = s->tail_lat[t * D + d];
            c2 += s->c[g * D + d] * s->c[g * D + d];
        }
        for (int j = 0; j < R; j++) s->kpe[g * R + j] = s->tail_rope[t * R + j];
        s->amag[g] = sqrt(c2);
    }
    const size_t nq = (size_t)n_rows * n_heads;
    s->q = malloc(sizeof(float) * nq * D);
    s->qpe = malloc(sizeof(float) * (nq * R + 1));
    for (size_t i = 0; i < nq * D; i++) s->q[i] = (float)(qscale * test_rng_normal(&r));
    for (size_t i = 0; i < nq * R; i++) s->qpe[i] = (float)(qscale * test_rng_normal(&r));
    s->row_len = malloc(sizeof(int) * (size_t)n_rows);
    for (int i = 0; i < n_rows; i++) s->row_len[i] = T - (n_rows - 1 - i); /* 1 + k drafts */
    s->scale = (float)(1.0 / sqrt((double)(D + R)));
    free(lat), free(rope);
}

static void seq_free(seq *s)
{
    for (int i = 0; i < s->n_tiles; i++) free(s->rec[i]);
    free(s->rec), free(s->recp), free(s->tail_lat), free(s->tail_rope), free(s->c), free(s->kpe);
    free(s->amag), free(s->q), free(s->qpe), free(s->row_len), free(s->ws);
}

static kvarn_status seq_attn(seq *s, float *out, float *lse)
{
    return kvarn_mla_attn(&s->f, s->D, s->R, s->recp, s->n_tiles, s->tail_lat, s->tail_rope, s->n_tail,
                          s->q, s->qpe, s->n_rows, s->n_heads, s->row_len, s->scale, out, lse, s->ws);
}

/* Double reference of query row (i, h): out [D], *lse; and the bound of
 * the library's fp32 result around it: *eo on the L2 norm of out, *el on
 * lse. The kernels form every score from products bounded by ||q||
 * ||A_t|| (latent: the decode (code a_d + b_d) s_tok_t or the folded
 * (q_d a_d) code + q_d b_d, then * s_tok_t, in the rotated basis; the
 * query's and the output's rotations, the library's decode rotation) and
 * ||q_pe|| ||k_pe_t||, each sum of D (R) terms off by at most D (R) unit
 * roundoffs of it, the rotations by log2(D) each (3 in all), the scale,
 * the addition and expf's 2 ulp a few more:
 *   delta_t = scale u ((D + 3 log2 D + 16) ||q|| ||A_t|| + (R + 4) ||q_pe|| ||k_pe_t||).
 * Scores off by at most delta perturb each softmax weight by a factor
 * within exp(+-2 delta_max), so the output by (exp(2 delta_max) - 1)
 * sum_t p_t ||c_t||; the weighted sums (n terms, the online rescaling once
 * per tile, the fold's a_d and b_d terms, the normalization, the output's
 * rotation) add u (n + D + 3 log2 D + 4 chunks + 16) sum_t p_t ||A_t||.
 * Products of these first-order terms are below 1e-3 of them here: x 1.001.
 * lse: delta_max + u (n + 8) (1 + |lse|).
 * Where the library names a matrix kernel for this call (16 or more query
 * rows, kvarn_mla_attn_matrix_name), its statement adds: q a carried to
 * relative 2^-16, so a score moves by at most scale 2^-16 ||q|| ||A_t||
 * more, and the weights likewise, the output by 2^-16 sum_t p_t ||A_t||. */
static void reference(const seq *s, int i, int h, double *out, double *lse, double *eo, double *el)
{
    const int D = s->D, R = s->R, n = s->row_len[i];
    const float *q = s->q + ((size_t)i * s->n_heads + h) * D;
    const float *qp = s->qpe + ((size_t)i * s->n_heads + h) * R;
    double qn = 0.0, qpn = 0.0;
    for (int d = 0; d < D; d++) qn += (double)q[d] * q[d];
    for (int j = 0; j < R; j++) qpn += (double)qp[j] * qp[j];
    qn = sqrt(qn), qpn = sqrt(qpn);
    const double um = (size_t)s->n_rows * s->n_heads >= 16 && kvarn_mla_attn_matrix_name(&s->f, D)
                          ? 0x1p-16 : 0.0;
    double *sc = malloc(sizeof(double) * (size_t)n), m = -INFINITY, dmax = 0.0;
    const double lg = log2((double)D);
    for (int t = 0; t < n; t++) {
        double dot = 0.0, kn = 0.0;
        for (int d = 0; d < D; d++) dot += q[d] * s->c[(size_t)t * D + d];
        for (int j = 0; j < R; j++) {
            dot += qp[j] * s->kpe[(size_t)t * R + j];
            kn += s->kpe[(size_t)t * R + j] * s->kpe[(size_t)t * R + j];
        }
        sc[t] = dot * s->scale;
        m = fmax(m, sc[t]);
        const double delta = s->scale * U * ((D + 3 * lg + 16) * qn * s->amag[t] + (R + 4) * qpn * sqrt(kn)) +
                             s->scale * um * qn * s->amag[t];
        dmax = fmax(dmax, delta);
    }
    double l = 0.0, pc = 0.0, pa = 0.0;
    for (int d = 0; d < D; d++) out[d] = 0.0;
    for (int t = 0; t < n; t++) {
        const double p = exp(sc[t] - m);
        l += p;
        double cn = 0.0;
        for (int d = 0; d < D; d++) {
            out[d] += p * s->c[(size_t)t * D + d];
            cn += s->c[(size_t)t * D + d] * s->c[(size_t)t * D + d];
        }
        pc += p * sqrt(cn);
        pa += p * s->amag[t];
    }
    for (int d = 0; d < D; d++) out[d] /= l;
    pc /= l, pa /= l;
    *lse = m + log(l);
    const int chunks = (n + s->G - 1) / s->G + 1;
    *eo = 1.001 * ((exp(2.0 * dmax) - 1.0) * pc + (U * (n + D + 3 * lg + 4 * chunks + 16) + um) * pa);
    *el = 1.001 * (dmax + U * (n + 8) * (1.0 + fabs(*lse)));
    free(sc);
}

/* Check out/lse of every query row against the reference; returns the
 * worst error over bound seen (<= 1 passes). */
static double check_against_reference(const seq *s, const float *out, const float *lse, const char *what,
                                      int strict)
{
    const int D = s->D;
    double *ref = malloc(sizeof(double) * (size_t)D), worst = 0.0;
    for (int i = 0; i < s->n_rows; i++)
        for (int h = 0; h < s->n_heads; h++) {
            double rl, eo, el;
            reference(s, i, h, ref, &rl, &eo, &el);
            const float *o = out + ((size_t)i * s->n_heads + h) * D;
            double e2 = 0.0;
            for (int d = 0; d < D; d++) e2 += (o[d] - ref[d]) * (o[d] - ref[d]);
            const double le = fabs(lse[i * s->n_heads + h] - rl);
            if (strict && (!(sqrt(e2) <= eo) || !(le <= el)))
                fail_msg("%s k%d r%d g%d D%d R%d tiles %d tail %d row %d head %d: |out err| %g (bound %g), "
                         "lse err %g (bound %g)", what, s->f.latent_bits, s->f.rope_bits, s->G, D, s->R,
                         s->n_tiles, s->n_tail, i, h, sqrt(e2), eo, le, el);
            worst = fmax(worst, fmax(sqrt(e2) / eo, le / el));
        }
    free(ref);
    return worst;
}

/* The pass of a level walk runs the MLA kernel of its level, as the
 * library names it. */
static void assert_mla_level(const levels_iter *it, const kvarn_mla_format *f, int D)
{
    assert_string_equal(kvarn_mla_attn_kernel_name(f, D), it->name);
}

typedef struct shape { kvarn_mla_format f; int D, R, n_tiles, n_tail, n_rows, n_heads; double qscale; } shape;

static const shape k_shapes[] = {
    {{4, 128, 16}, 512, 64, 3, 5, 3, 4, 1.0},    /* DeepSeek's dims, 1 + 2 drafts */
    {{4, 128, 8}, 512, 64, 2, 127, 1, 16, 1.0},  /* a tail one short of a tile */
    {{2, 64, 8}, 256, 32, 4, 0, 2, 3, 2.0},      /* no tail; peaky softmax */
    {{8, 64, 16}, 128, 0, 1, 70, 4, 2, 1.0},     /* no rope; a tail longer than G */
    {{4, 64, 16}, 64, 16, 0, 9, 2, 2, 1.0},      /* tail only */
    {{4, 128, 16}, 512, 128, 1, 0, 1, 1, 4.0},   /* one tile, one row, very peaky */
};

/* Every level against the double reference; levels against each other. */
static void test_levels_vs_reference(void **state)
{
    (void)state;
    for (size_t k = 0; k < sizeof k_shapes / sizeof k_shapes[0]; k++) {
        const shape *sh = &k_shapes[k];
        seq s;
        seq_make(&s, &sh->f, sh->D, sh->R, sh->n_tiles, sh->n_tail, sh->n_rows, sh->n_heads, sh->qscale, 100 + k);
        if (k == 0) { /* rows that see: one token, the middle of tile 1, a tile's end */
            s.row_len[0] = 1;
            s.row_len[1] = s.G + 17;
            s.row_len[2] = 2 * s.G;
        }
        const size_t nq = (size_t)sh->n_rows * sh->n_heads;
        float *out[LEVELS_MAX], *lse[LEVELS_MAX];
        int nl = 0;
        LEVELS_FOR(it) { /* scalar first: out[0] */
            const int l = it.index;
            assert_mla_level(&it, &sh->f, sh->D);
            out[l] = malloc(sizeof(float) * nq * sh->D);
            lse[l] = malloc(sizeof(float) * nq);
            nl = l + 1;
            assert_int_equal(seq_attn(&s, out[l], lse[l]), KVARN_OK);
            const double w = check_against_reference(&s, out[l], lse[l], it.name, 1);
            printf("  shape %zu %-6s: worst error / bound %.3f\n", k, it.name, w);
        }
        assert_true(nl >= 1);
        /* levels against the scalar one: each is within its bound eo of
         * the same reference, so two differ by at most 2 eo */
        double *ref = malloc(sizeof(double) * (size_t)sh->D);
        for (int l = 1; l < nl; l++)
            for (int i = 0; i < sh->n_rows; i++)
                for (int h = 0; h < sh->n_heads; h++) {
                    double rl, eo, el, e2 = 0.0;
                    reference(&s, i, h, ref, &rl, &eo, &el);
                    const size_t o = ((size_t)i * sh->n_heads + h) * sh->D;
                    for (int d = 0; d < sh->D; d++)
                        e2 += ((double)out[l][o + d] - out[0][o + d]) * ((double)out[l][o + d] - out[0][o + d]);
                    assert_true(sqrt(e2) <= 2.0 * eo);
                }
        free(ref);
        for (int l = 0; l < nl; l++) free(out[l]), free(lse[l]);
        seq_free(&s);
    }
}

/* The matrix kernel (mla_amx.c) with its tiles emulated in C
 * (KVARN_AMX=emulate), at every level whose folded kernels it replaces:
 * calls of 16 or more query rows, tiles of 128 and 64 tokens, with and
 * without rope and tail, against the double reference with its statement's
 * bound (reference()); then KVARN_AMX=0 must give other bits: it ran.
 * Where the CPU grants AMX, the hardware tiles run the same cases. */
static void test_matrix_kernel(void **state)
{
    (void)state;
    static const shape mshapes[] = {
        {{4, 128, 16}, 512, 64, 3, 5, 4, 8, 1.0},  /* DeepSeek's dims, 32 rows */
        {{2, 64, 8}, 256, 32, 4, 0, 6, 3, 2.0},    /* 18 rows, peaky */
        {{8, 64, 16}, 128, 0, 1, 70, 8, 2, 1.0},   /* 16 rows, no rope, a long tail */
    };
    for (size_t k = 0; k < sizeof mshapes / sizeof mshapes[0]; k++) {
        const shape *sh = &mshapes[k];
        seq s;
        seq_make(&s, &sh->f, sh->D, sh->R, sh->n_tiles, sh->n_tail, sh->n_rows, sh->n_heads, sh->qscale,
                 700 + k);
        const size_t nq = (size_t)sh->n_rows * sh->n_heads;
        float *o1 = malloc(sizeof(float) * nq * sh->D), *o2 = malloc(sizeof(float) * nq * sh->D);
        float *l1 = malloc(sizeof(float) * nq), *l2 = malloc(sizeof(float) * nq);
        LEVELS_FOR(it) {
            if (it.index == 0) continue; /* the folded levels */
            assert_mla_level(&it, &sh->f, sh->D);
            setenv("KVARN_AMX", "emulate", 1);
            assert_string_equal(kvarn_mla_attn_matrix_name(&sh->f, sh->D), "amx-bf16-emulated");
            assert_int_equal(seq_attn(&s, o1, l1), KVARN_OK);
            const double w = check_against_reference(&s, o1, l1, "emulated tiles", 1);
            printf("  matrix shape %zu %-6s emulated: worst error / bound %.3f\n", k, it.name, w);
            setenv("KVARN_AMX", "0", 1);
            assert_null(kvarn_mla_attn_matrix_name(&sh->f, sh->D));
            assert_int_equal(seq_attn(&s, o2, l2), KVARN_OK);
            size_t differ = 0;
            for (size_t i = 0; i < nq * sh->D; i++) differ += o1[i] != o2[i];
            assert_true(differ > nq * sh->D / 4);
            unsetenv("KVARN_AMX");
            const char *hw = kvarn_mla_attn_matrix_name(&sh->f, sh->D);
            if (hw != NULL) {
                assert_string_equal(hw, "amx-bf16");
                assert_int_equal(seq_attn(&s, o1, l1), KVARN_OK);
                printf("  matrix shape %zu %-6s AMX tiles: worst error / bound %.3f\n", k, it.name,
                       check_against_reference(&s, o1, l1, "AMX tiles", 1));
            } else if (k == 0 && it.index == it.count - 1) {
                printf("  AMX tiles: skipped: no AMX (emulated only)\n");
            }
        }
        free(o1), free(o2), free(l1), free(l2);
        seq_free(&s);
    }
    /* tiles of 16 tokens: none */
    const kvarn_mla_format g16 = {4, 16, 16};
    setenv("KVARN_AMX", "emulate", 1);
    assert_null(kvarn_mla_attn_matrix_name(&g16, 512));
    unsetenv("KVARN_AMX");
}

/* The bound can fail: one latent code of the record (of 65536) moved by
 * half its range (channel 0 of the token with the largest weight) puts
 * every level's result outside it, judged against the reference of the
 * unchanged record. (The bound is a worst case: D roundings of a sum of D
 * terms, where random roundings reach about sqrt(D); the levels' errors
 * print at 0.1-1% of it.) */
static void test_bound_sees_one_code(void **state)
{
    (void)state;
    const shape *sh = &k_shapes[5]; /* one tile, one row, one head, peaky */
    seq s;
    seq_make(&s, &sh->f, sh->D, sh->R, sh->n_tiles, sh->n_tail, sh->n_rows, sh->n_heads, sh->qscale, 105);
    int best = 0;
    double bs = -INFINITY;
    for (int t = 0; t < s.total; t++) {
        double dot = 0.0;
        for (int d = 0; d < s.D; d++) dot += s.q[d] * s.c[(size_t)t * s.D + d];
        for (int j = 0; j < s.R; j++) dot += s.qpe[j] * s.kpe[(size_t)t * s.R + j];
        if (dot > bs) bs = dot, best = t;
    }
    /* 4-bit codes: channel 0's row is the first G/2 bytes, token t in byte
     * t/2 (even t: low nibble); the code goes to the far end of its range
     * (0 <-> 15 side), at least 8 steps away */
    uint8_t *byte = &s.rec[0][best / 2];
    const int shift = best % 2 ? 4 : 0, code = (*byte >> shift) & 15;
    *byte = (uint8_t)((*byte & ~(15 << shift)) | ((code < 8 ? 15 : 0) << shift));
    float out[512], lse[1];
    LEVELS_FOR(it) {
        assert_mla_level(&it, &sh->f, sh->D);
        assert_int_equal(seq_attn(&s, out, lse), KVARN_OK);
        const double w = check_against_reference(&s, out, lse, it.name, 0);
        printf("  one code off, %-6s: error / bound %.1f\n", it.name, w);
        assert_true(w > 1.0);
    }
    seq_free(&s);
}

/* Rows computed together equal each row computed alone (n_rows = 1 with
 * its own row_len), bit for bit, at every level: no row's result depends
 * on another's. */
static void test_rows_independent(void **state)
{
    (void)state;
    const shape *sh = &k_shapes[0];
    seq s;
    seq_make(&s, &sh->f, sh->D, sh->R, sh->n_tiles, sh->n_tail, sh->n_rows, sh->n_heads, 1.0, 7);
    s.row_len[0] = 200, s.row_len[1] = 1, s.row_len[2] = s.total;
    const int D = sh->D, H = sh->n_heads;
    float *all = malloc(sizeof(float) * (size_t)sh->n_rows * H * D), *one = malloc(sizeof(float) * (size_t)H * D);
    float lse_all[16], lse_one[16];
    LEVELS_FOR(it) {
        assert_mla_level(&it, &sh->f, sh->D);
        assert_int_equal(seq_attn(&s, all, lse_all), KVARN_OK);
        for (int i = 0; i < sh->n_rows; i++) {
            assert_int_equal(kvarn_mla_attn(&s.f, D, s.R, s.recp, s.n_tiles, s.tail_lat, s.tail_rope, s.n_tail,
                                            s.q + (size_t)i * H * D, s.qpe + (size_t)i * H * s.R, 1, H,
                                            &s.row_len[i], s.scale, one, lse_one, s.ws),
                             KVARN_OK);
            assert_memory_equal(one, all + (size_t)i * H * D, sizeof(float) * (size_t)H * D);
            assert_memory_equal(lse_one, lse_all + i * H, sizeof(float) * (size_t)H);
        }
    }
    /* row_len NULL: every row sees every token */
    int full[3] = {s.total, s.total, s.total};
    memcpy(s.row_len, full, sizeof full);
    assert_int_equal(seq_attn(&s, all, lse_all), KVARN_OK);
    float *all2 = malloc(sizeof(float) * (size_t)sh->n_rows * H * D);
    assert_int_equal(kvarn_mla_attn(&s.f, D, s.R, s.recp, s.n_tiles, s.tail_lat, s.tail_rope, s.n_tail, s.q,
                                    s.qpe, s.n_rows, H, NULL, s.scale, all2, NULL, s.ws),
                     KVARN_OK);
    assert_memory_equal(all, all2, sizeof(float) * (size_t)sh->n_rows * H * D);
    free(all), free(all2), free(one);
    seq_free(&s);
}

/* Hostile inputs: the reason as a status, out and lse untouched. */
static void test_hostile(void **state)
{
    (void)state;
    const shape *sh = &k_shapes[0];
    seq s;
    seq_make(&s, &sh->f, sh->D, sh->R, sh->n_tiles, sh->n_tail, sh->n_rows, sh->n_heads, 1.0, 9);
    const size_t nq = (size_t)sh->n_rows * sh->n_heads, D = (size_t)sh->D;
    float *out = malloc(sizeof(float) * nq * D), *keep = malloc(sizeof(float) * nq * D);
    float lse[16], lkeep[16];
    memset(keep, 0x5a, sizeof(float) * nq * D);
    memset(lkeep, 0x5a, sizeof lkeep);
#define EXPECT(st, call)                                                                   \
    do {                                                                                   \
        memcpy(out, keep, sizeof(float) * nq * D);                                         \
        memcpy(lse, lkeep, sizeof lse);                                                    \
        assert_int_equal((call), (st));                                                    \
        assert_memory_equal(out, keep, sizeof(float) * nq * D);                            \
        assert_memory_equal(lse, lkeep, sizeof lse);                                       \
    } while (0)
    const kvarn_mla_format bad_f = {3, 128, 16};
    const int T = s.total;
#define CALL(F, DD, RR, RECS, NT, TL, TR, NTL, Q, QP, NR, NH, RL, SC, O, WS) \
    kvarn_mla_attn(F, DD, RR, RECS, NT, TL, TR, NTL, Q, QP, NR, NH, RL, SC, O, lse, WS)
    const kvarn_mla_format *f = &s.f;
    const int R = s.R, nt = s.n_tiles, ntl = s.n_tail, NR = s.n_rows, NH = s.n_heads;
    /* a good call first: the hostile ones must leave its results as they are */
    assert_int_equal(CALL(f, sh->D, R, s.recp, nt, s.tail_lat, s.tail_rope, ntl, s.q, s.qpe, NR, NH, s.row_len, s.scale, out, s.ws), KVARN_OK);
    memcpy(keep, out, sizeof(float) * nq * D);
    memcpy(lkeep, lse, sizeof lkeep);
    EXPECT(KVARN_ERR_INVALID_ARG, CALL(NULL, sh->D, R, s.recp, nt, s.tail_lat, s.tail_rope, ntl, s.q, s.qpe, NR, NH, s.row_len, s.scale, out, s.ws));
    EXPECT(KVARN_ERR_INVALID_ARG, CALL(&bad_f, sh->D, R, s.recp, nt, s.tail_lat, s.tail_rope, ntl, s.q, s.qpe, NR, NH, s.row_len, s.scale, out, s.ws));
    EXPECT(KVARN_ERR_UNSUPPORTED_HEAD_DIM, CALL(f, 1024, R, s.recp, nt, s.tail_lat, s.tail_rope, ntl, s.q, s.qpe, NR, NH, s.row_len, s.scale, out, s.ws));
    EXPECT(KVARN_ERR_UNSUPPORTED_HEAD_DIM, CALL(f, sh->D, 63, s.recp, nt, s.tail_lat, s.tail_rope, ntl, s.q, s.qpe, NR, NH, s.row_len, s.scale, out, s.ws));
    EXPECT(KVARN_ERR_INVALID_ARG, CALL(f, sh->D, R, NULL, nt, s.tail_lat, s.tail_rope, ntl, s.q, s.qpe, NR, NH, s.row_len, s.scale, out, s.ws));
    const uint8_t *holed[3] = {s.recp[0], NULL, s.recp[2]};
    EXPECT(KVARN_ERR_INVALID_ARG, CALL(f, sh->D, R, holed, nt, s.tail_lat, s.tail_rope, ntl, s.q, s.qpe, NR, NH, s.row_len, s.scale, out, s.ws));
    EXPECT(KVARN_ERR_INVALID_ARG, CALL(f, sh->D, R, s.recp, nt, NULL, s.tail_rope, ntl, s.q, s.qpe, NR, NH, s.row_len, s.scale, out, s.ws));
    EXPECT(KVARN_ERR_INVALID_ARG, CALL(f, sh->D, R, s.recp, nt, s.tail_lat, NULL, ntl, s.q, s.qpe, NR, NH, s.row_len, s.scale, out, s.ws));
    EXPECT(KVARN_ERR_INVALID_ARG, CALL(f, sh->D, R, s.recp, nt, s.tail_lat, s.tail_rope, ntl, NULL, s.qpe, NR, NH, s.row_len, s.scale, out, s.ws));
    EXPECT(KVARN_ERR_INVALID_ARG, CALL(f, sh->D, R, s.recp, nt, s.tail_lat, s.tail_rope, ntl, s.q, NULL, NR, NH, s.row_len, s.scale, out, s.ws));
    EXPECT(KVARN_ERR_INVALID_ARG, CALL(f, sh->D, R, s.recp, nt, s.tail_lat, s.tail_rope, ntl, s.q, s.qpe, NR, NH, s.row_len, s.scale, NULL, s.ws));
    EXPECT(KVARN_ERR_INVALID_ARG, CALL(f, sh->D, R, s.recp, nt, s.tail_lat, s.tail_rope, ntl, s.q, s.qpe, NR, NH, s.row_len, s.scale, out, NULL));
    EXPECT(KVARN_ERR_INVALID_ARG, CALL(f, sh->D, R, s.recp, -1, s.tail_lat, s.tail_rope, ntl, s.q, s.qpe, NR, NH, s.row_len, s.scale, out, s.ws));
    EXPECT(KVARN_ERR_INVALID_ARG, CALL(f, sh->D, R, s.recp, nt, s.tail_lat, s.tail_rope, -1, s.q, s.qpe, NR, NH, s.row_len, s.scale, out, s.ws));
    EXPECT(KVARN_ERR_INVALID_ARG, CALL(f, sh->D, R, s.recp, 0, s.tail_lat, s.tail_rope, 0, s.q, s.qpe, NR, NH, NULL, s.scale, out, s.ws)); /* no token */
    EXPECT(KVARN_ERR_INVALID_ARG, CALL(f, sh->D, R, s.recp, nt, s.tail_lat, s.tail_rope, ntl, s.q, s.qpe, 0, NH, s.row_len, s.scale, out, s.ws));
    EXPECT(KVARN_ERR_INVALID_ARG, CALL(f, sh->D, R, s.recp, nt, s.tail_lat, s.tail_rope, ntl, s.q, s.qpe, NR, 0, s.row_len, s.scale, out, s.ws));
    EXPECT(KVARN_ERR_INVALID_ARG, CALL(f, sh->D, R, s.recp, nt, s.tail_lat, s.tail_rope, ntl, s.q, s.qpe, NR, -2, s.row_len, s.scale, out, s.ws));
    EXPECT(KVARN_ERR_INVALID_ARG, CALL(f, sh->D, R, s.recp, nt, s.tail_lat, s.tail_rope, ntl, s.q, s.qpe, 1 << 11, 1 << 10, s.row_len, s.scale, out, s.ws));
    const float bad_scales[] = {0.0f, -1.0f, NAN, INFINITY};
    for (int i = 0; i < 4; i++)
        EXPECT(KVARN_ERR_INVALID_ARG, CALL(f, sh->D, R, s.recp, nt, s.tail_lat, s.tail_rope, ntl, s.q, s.qpe, NR, NH, s.row_len, bad_scales[i], out, s.ws));
    const int bad_len[][3] = {{0, T, T}, {T, T + 1, T}, {T, T, -5}};
    for (int i = 0; i < 3; i++)
        EXPECT(KVARN_ERR_INVALID_ARG, CALL(f, sh->D, R, s.recp, nt, s.tail_lat, s.tail_rope, ntl, s.q, s.qpe, NR, NH, bad_len[i], s.scale, out, s.ws));
    /* NaN / Inf in q, q_rope, the tail */
    float *bufs[4] = {s.q, s.qpe, s.tail_lat, s.tail_rope};
    const size_t at[4] = {nq * D - 1, 3, 0, (size_t)ntl * R - 1};
    const float vals[2] = {NAN, -INFINITY};
    for (int b = 0; b < 4; b++)
        for (int v = 0; v < 2; v++) {
            const float old = bufs[b][at[b]];
            bufs[b][at[b]] = vals[v];
            EXPECT(KVARN_ERR_NONFINITE, CALL(f, sh->D, R, s.recp, nt, s.tail_lat, s.tail_rope, ntl, s.q, s.qpe, NR, NH, s.row_len, s.scale, out, s.ws));
            bufs[b][at[b]] = old;
        }
    /* rope_dim 0: q_rope and the tail's rope may be NULL */
    seq z;
    seq_make(&z, &sh->f, 128, 0, 1, 3, 1, 2, 1.0, 10);
    float oz[256];
    assert_int_equal(kvarn_mla_attn(&z.f, 128, 0, z.recp, 1, z.tail_lat, NULL, 3, z.q, NULL, 1, 2, NULL, z.scale, oz, NULL, z.ws),
                     KVARN_OK);
    seq_free(&z);
#undef CALL
#undef EXPECT
    free(out), free(keep);
    seq_free(&s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_levels_vs_reference, levels_teardown),
        cmocka_unit_test_teardown(test_bound_sees_one_code, levels_teardown),
        cmocka_unit_test_teardown(test_matrix_kernel, levels_teardown),
        cmocka_unit_test_teardown(test_rows_independent, levels_teardown),
        cmocka_unit_test(test_hostile),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
