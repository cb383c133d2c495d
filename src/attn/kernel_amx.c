/*
 * kernel_amx.c -- the KVarN record kernel of prefill chunks and
 * verification as matrix products on Intel AMX-BF16 tiles (4th generation
 * Xeon and later), for work items of at least ATTN_MATRIX_MIN_ROWS query
 * rows (attn_internal.h); compiled with -mamx-tile -mamx-bf16 and the
 * AVX-512 flags (CMakeLists.txt), and a second time with the tiles
 * emulated in C (kernel_amx_emu.c, amx_tiles.h) so that tests check its
 * logic on any CPU.
 *
 * Per tile (a 128-, 64- or 32-token record, ../shared/spec/KVARN.md
 * "Attention over records"), the codes are unpacked once into bf16 (every
 * code of 2, 4 or 8 bits is exact in bf16), the per-channel key scales a_d
 * folded into the queries and the per-token value scales a_t into the
 * softmax weights, as the spec's per-row algebra does; then, per block of
 * 16 rows:
 *   scores  S = bf16(q' a) . Kcodes            (16 x D) . (D x G)
 *           s_t = s_tok_t (S_t + sum_d q'_d b_d)
 *   sums    O = bf16(p a_t) . Vcodes            (16 x G) . (G x D)
 *           acc_d += s_chan_d (O_d + sum_t p_t b_t)
 with fp32 sums (TDPBF16PS). The rounding this adds, the statement the
 * tests derive their bound from (attn.h KVARN_ATTN_ARITH_BF16X2): each
 * q'_d a_d and each p_t a_t carried as two bf16 values, hi = bf16(x) and
 * lo = bf16(x - hi) (round to nearest even), two products each: relative
 * error <= 2^-16 (one bf16 alone would round to 2^-8, which cost 3-7% of
 * the output on the tests' random data), inputs below 2^-126 read as 0 by
 * the tiles; the zero-point terms, the softmax and acc stay fp32. A tile whose metadata is not
 * finite, or whose rows reach |q'_d a_d| >= 2^80, runs the fallback kernel
 * (the level's own) instead, as the int16 kernels do.
 */
#include <math.h>
#include <string.h>

#include "attn/amx_tiles.h"
#include "attn/attn_internal.h"

#ifdef KVARN_AMX_EMULATE
#define AMX_FN(name) attn_amxemu_##name
#define AMX_SOFTMAX attn_softmax_update_ref
#else
#define AMX_FN(name) attn_amx_##name
#define AMX_SOFTMAX attn_avx512_softmax_update
#endif

static void fp16_array(const uint8_t *src, int n, float *dst)
{
    for (int i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, src + 2 * i, 2);
        dst[i] = kvarn_fp16_to_fp32(h);
    }
}

static int all_finite(const float *x, int n)
{
    int ok = 1;
    for (int i = 0; i < n; i++) ok &= isfinite(x[i]) != 0;
    return ok;
}

/* The bf16 of code values 0..255 (exact). */
static inline uint16_t bf16_code(unsigned c) { return amx_bf16_of((float)c); }

/* K codes (record.h: channel d's row of G tokens, low bits first) into the
 * B layout of the score product: kmat[(d / 2) G + t][d % 2]. */
static void unpack_k(const uint8_t *kc, int D, int G, int kb, uint16_t *kmat)
{
    const size_t krow = (size_t)G * kb / 8;
    const unsigned mask = (1u << kb) - 1u;
    const int per = 8 / kb;
    for (int d = 0; d < D; d++) {
        const uint8_t *row = kc + (size_t)d * krow;
        uint16_t *out = kmat + (size_t)(d >> 1) * G * 2 + (d & 1);
        for (int t = 0; t < G; t++)
            out[(size_t)t * 2] = bf16_code((row[t / per] >> ((t % per) * kb)) & mask);
    }
}

/* V codes (token t's row of D channels) into the B layout of the value
 * product: vmat[(t / 2) D + d][t % 2]. */
static void unpack_v(const uint8_t *vc, int D, int G, int vb, uint16_t *vmat)
{
    const size_t vrow = (size_t)D * vb / 8;
    const unsigned mask = (1u << vb) - 1u;
    const int per = 8 / vb;
    for (int t = 0; t < G; t++) {
        const uint8_t *row = vc + (size_t)t * vrow;
        uint16_t *out = vmat + (size_t)(t >> 1) * D * 2 + (t & 1);
        for (int d = 0; d < D; d++)
            out[(size_t)d * 2] = bf16_code((row[d / per] >> ((d % per) * vb)) & mask);
    }
}

void AMX_FN(kvarn_tile)(attn_rows *r, const kvarn_record_layout *L, const uint8_t *rec, int t0,
                        int nt, attn_record_tile_fn fallback)
{
    const int D = r->D, G = L->tile_tokens, gs = r->gs, n = r->n;
    float *ka = r->meta, *kbias = ka + D, *schan = kbias + D;
    float *stok = schan + D, *va = stok + gs, *vbias = va + gs;
    fp16_array(rec + L->k_a_off, D, ka);
    fp16_array(rec + L->k_b_off, D, kbias);
    fp16_array(rec + L->k_stok_off, G, stok);
    fp16_array(rec + L->v_schan_off, D, schan);
    fp16_array(rec + L->v_a_off, G, va);
    fp16_array(rec + L->v_b_off, G, vbias);
    int ok = all_finite(ka, D) & all_finite(kbias, D) & all_finite(schan, D) &
             all_finite(stok, G) & all_finite(va, G) & all_finite(vbias, G);
    for (int i = 0; ok && i < n; i++) {
        const float *q = r->q + (size_t)i * D;
        for (int d = 0; d < D; d++) ok &= fabsf(q[d] * ka[d]) < 0x1p80f;
    }
    if (!ok) {
        fallback(r, L, rec, t0, nt);
        return;
    }
    attn_prefetch_step(r->pf, attn_prefetch_left(r->pf));
    uint16_t *kmat = r->mat, *vmat = r->mat + (size_t)D * G;
    unpack_k(rec + L->k_codes_off, D, G, L->key_bits, kmat);
    unpack_v(rec + L->v_codes_off, D, G, L->value_bits, vmat);

    amx_tilecfg cfg;
    amx_config_16x64(&cfg);
    AMX_CONFIG(&cfg);
    uint16_t a[16 * ATTN_MATRIX_MAX_D], alo[16 * ATTN_MATRIX_MAX_D];
    float c[16 * ATTN_MATRIX_MAX_D];

    /* scores, 16 rows at a time */
    for (int r0 = 0; r0 < n; r0 += 16) {
        const int rb = n - r0 < 16 ? n - r0 : 16;
        for (int i = 0; i < 16; i++) {
            uint16_t *ai = a + (size_t)i * D, *li = alo + (size_t)i * D;
            if (i >= rb) {
                memset(ai, 0, (size_t)D * sizeof *ai);
                memset(li, 0, (size_t)D * sizeof *li);
                continue;
            }
            const float *q = r->q + (size_t)(r0 + i) * D;
            float cb = 0.0f;
            for (int d = 0; d < D; d++) {
                amx_bf16_split(q[d] * ka[d], &ai[d], &li[d]);
                cb += q[d] * kbias[d];
            }
            r->rc[r0 + i] = cb;
        }
        amx_product16(a, alo, D, kmat, G, c);
        for (int i = 0; i < rb; i++) {
            float *s = r->s + (size_t)(r0 + i) * gs;
            const float *ci = c + (size_t)i * G, cb = r->rc[r0 + i];
            for (int t = 0; t < G; t++) s[t] = stok[t] * (ci[t] + cb);
        }
    }
    AMX_SOFTMAX(r, t0, G);
    /* weights p_t a_t, then the sums, 16 rows at a time */
    for (int r0 = 0; r0 < n; r0 += 16) {
        const int rb = n - r0 < 16 ? n - r0 : 16;
        float pb[16];
        for (int i = 0; i < 16; i++) {
            uint16_t *ai = a + (size_t)i * G, *li = alo + (size_t)i * G;
            if (i >= rb) {
                memset(ai, 0, (size_t)G * sizeof *ai);
                memset(li, 0, (size_t)G * sizeof *li);
                continue;
            }
            const float *p = r->s + (size_t)(r0 + i) * gs;
            float z = 0.0f;
            for (int t = 0; t < G; t++) {
                amx_bf16_split(p[t] * va[t], &ai[t], &li[t]);
                z += p[t] * vbias[t];
            }
            pb[i] = z;
        }
        amx_product16(a, alo, G, vmat, D, c);
        for (int i = 0; i < rb; i++) {
            float *acc = r->acc + (size_t)(r0 + i) * D;
            const float *ci = c + (size_t)i * D;
            for (int d = 0; d < D; d++) acc[d] += schan[d] * (ci[d] + pb[i]);
        }
    }
    AMX_RELEASE();
}
