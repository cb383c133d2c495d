/*
 * mla_amx.c -- the absorbed MLA attention's tile products on AMX-BF16
 * tiles, for calls of ATTN_MLA_MATRIX_MIN_ROWS query rows or more
 * (prefill chunks, verification; mla_attn.c picks it, mla_kernels.h
 * declares it). Compiled with -mamx-tile -mamx-bf16 and the AVX-512 flags,
 * and a second time with the tiles emulated in C (mla_amx_emu.c,
 * amx_tiles.h) so that tests check its logic on any CPU.
 *
 * The same algebra as the folded kernels (mla_kernels.h,
 * ../shared/spec/KVARN.md "Attention over records"), with the two
 * products of a tile on tiles: the codes (one per byte) are laid out once
 * per tile as bf16 (exact) in the two B layouts, then per block of up to
 * ATTN_MLA_QB rows
 *   scores  S = (q a) . codes     (nb x D) . (D x G)
 *   accum   O = w . codes^T       (nb x G) . (G x D)
 * with q a and w = p s_tok carried as two bf16 values each, hi = bf16(x)
 * and lo = bf16(x - hi): relative error at most 2^-16 (values below
 * 2^-126 read as 0), fp32 sums; the rope scores, the zero-point terms and
 * the softmax stay fp32 (kernel_amx.c has the same statement,
 * docs/attention-matrix.md).
 */
#include <string.h>

#include "attn/amx_tiles.h"
#include "attn/mla_kernels.h"

#ifdef KVARN_AMX_EMULATE
#define MLA_AMX_FN(name) name##_amxemu
#else
#define MLA_AMX_FN(name) name##_amx
#endif

void MLA_AMX_FN(attn_mla_matrix_prep)(const uint8_t *codes, int D, int G, uint16_t *mat)
{
    uint16_t *kmat = mat, *vmat = mat + (size_t)D * (size_t)G;
    for (int d = 0; d < D; d += 2)
        amx_pair_codes(codes + (size_t)d * (size_t)G, codes + (size_t)(d + 1) * (size_t)G, G,
                       kmat + (size_t)d * (size_t)G);
    for (int d = 0; d < D; d++) {
        const uint8_t *row = codes + (size_t)d * (size_t)G;
        for (int t = 0; t < G; t++)
            vmat[((size_t)(t >> 1) * (size_t)D + (size_t)d) * 2 + (t & 1)] = amx_bf16_of((float)row[t]);
    }
}

/* Rows [0, nb) of x [nb][n] (stride n) as hi and lo halves of 16 rows,
 * rows nb..15 zero. */
static void split_rows(const float *x, int nb, int n, uint16_t *hi, uint16_t *lo)
{
    for (int k = 0; k < 16; k++) {
        uint16_t *h = hi + (size_t)k * (size_t)n, *l = lo + (size_t)k * (size_t)n;
        if (k >= nb) {
            memset(h, 0, (size_t)n * sizeof *h);
            memset(l, 0, (size_t)n * sizeof *l);
            continue;
        }
        (void)amx_split_scaled(x + (size_t)k * (size_t)n, NULL, NULL, n, h, l, NULL);
    }
}

void MLA_AMX_FN(attn_mla_matrix_scores)(const uint16_t *mat, const float *qa, const float *cb,
                                        const float *s_tok, const float *rope,
                                        const float *const *q_pe, int nb, int D, int R, int G,
                                        float scale, float *sc)
{
    uint16_t hi[16 * 512], lo[16 * 512];
    float c[16 * 128];
    amx_tilecfg cfg;
    amx_config_16x64(&cfg);
    split_rows(qa, nb, D, hi, lo);
    AMX_CONFIG(&cfg);
    amx_product16(hi, lo, D, D, mat, G, c, G);
    AMX_RELEASE();
    for (int k = 0; k < nb; k++)
        for (int t = 0; t < G; t++) {
            float r = 0.0f;
            const float *kp = rope + (size_t)t * (size_t)R;
            for (int j = 0; j < R; j++) r += q_pe[k][j] * kp[j];
            sc[(size_t)k * (size_t)G + t] =
                scale * ((c[(size_t)k * (size_t)G + t] + cb[k]) * s_tok[t] + r);
        }
}

void MLA_AMX_FN(attn_mla_matrix_accum)(const uint16_t *mat, const float *a, const float *b,
                                       const float *w, const float *sw, int nb, int D, int G,
                                       float *const *acc)
{
    uint16_t hi[16 * 128], lo[16 * 128];
    float c[16 * 512];
    amx_tilecfg cfg;
    amx_config_16x64(&cfg);
    split_rows(w, nb, G, hi, lo);
    AMX_CONFIG(&cfg);
    amx_product16(hi, lo, G, G, mat + (size_t)D * (size_t)G, D, c, D);
    AMX_RELEASE();
    for (int k = 0; k < nb; k++)
        for (int d = 0; d < D; d++) acc[k][d] += a[d] * c[(size_t)k * (size_t)D + d] + b[d] * sw[k];
}
