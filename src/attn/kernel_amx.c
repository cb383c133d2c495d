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
#include "codec/fp_convert.h"
#include "codec/pack.h"

#ifdef KVARN_AMX_EMULATE
#define AMX_FN(name) attn_amxemu_##name
#define AMX_SOFTMAX attn_softmax_update_ref
#else
#define AMX_FN(name) attn_amx_##name
#define AMX_SOFTMAX attn_avx512_softmax_update
#endif

/* K codes (record.h: channel d's row of G tokens) into the B layout of
 * the score product: kmat[(d / 2) G + t][d % 2], bf16 (exact). */
static void unpack_k(const uint8_t *kc, int D, int G, int kb, uint16_t *kmat)
{
    const size_t krow = (size_t)G * kb / 8;
    uint8_t c[ATTN_MATRIX_MAX_D];
    for (int d = 0; d < D; d++) {
        (void)kvarn_unpack_codes(kc + (size_t)d * krow, (size_t)G, kb, c);
        uint16_t *out = kmat + (size_t)(d >> 1) * G * 2 + (d & 1);
        for (int t = 0; t < G; t++) out[(size_t)t * 2] = amx_bf16_of((float)c[t]);
    }
}

/* V codes (token t's row of D channels) into the B layout of the value
 * product: vmat[(t / 2) D + d][t % 2]. */
static void unpack_v(const uint8_t *vc, int D, int G, int vb, uint16_t *vmat)
{
    const size_t vrow = (size_t)D * vb / 8;
    uint8_t c[ATTN_MATRIX_MAX_D];
    for (int t = 0; t < G; t++) {
        (void)kvarn_unpack_codes(vc + (size_t)t * vrow, (size_t)D, vb, c);
        uint16_t *out = vmat + (size_t)(t >> 1) * D * 2 + (t & 1);
        for (int d = 0; d < D; d++) out[(size_t)d * 2] = amx_bf16_of((float)c[d]);
    }
}

void AMX_FN(kvarn_tile)(attn_rows *r, const kvarn_record_layout *L, const uint8_t *rec, int t0,
                        int nt, attn_record_tile_fn fallback)
{
    const int D = r->D, G = L->tile_tokens, gs = r->gs, n = r->n;
    float *ka = r->meta, *kbias = ka + D, *schan = kbias + D;
    float *stok = schan + D, *va = stok + gs, *vbias = va + gs;
    kvarn__fp16_load(rec + L->k_a_off, D, ka);
    kvarn__fp16_load(rec + L->k_b_off, D, kbias);
    kvarn__fp16_load(rec + L->k_stok_off, G, stok);
    kvarn__fp16_load(rec + L->v_schan_off, D, schan);
    kvarn__fp16_load(rec + L->v_a_off, G, va);
    kvarn__fp16_load(rec + L->v_b_off, G, vbias);
    int ok = kvarn__all_finite(ka, (size_t)D) && kvarn__all_finite(kbias, (size_t)D) &&
             kvarn__all_finite(schan, (size_t)D) && kvarn__all_finite(stok, (size_t)G) &&
             kvarn__all_finite(va, (size_t)G) && kvarn__all_finite(vbias, (size_t)G);
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
