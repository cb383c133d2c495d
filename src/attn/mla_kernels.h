/*
 * mla_kernels.h -- the per-tile kernels of the absorbed MLA attention
 * (src/attn/mla_attn.c drives them; include/kvarn/mla.h, docs/mla.md).
 * Not part of the public contract.
 *
 * Two kinds:
 *  - the reference (mla_ref.c, the oracle): reads a tile as dense fp32
 *    rows in the rotated basis (a record decoded by the codec, or tail rows
 *    rotated), scores q_rot . c_rot + q_pe . k_pe, sums p_t c_rot_t.
 *  - the folded kernel (this header's body, compiled once per SIMD level
 *    by mla_avx2.c and mla_avx512.c with that level's flags and vector
 *    width): reads the record's integer codes, unpacked once per tile for
 *    every query row and head, with a_d folded into the rotated query
 *    (../shared/spec/KVARN.md "Attention over records"):
 *      score_t = s_tok_t (sum_d (q_d a_d) code[d,t] + sum_d q_d b_d)
 *      o_rot[d] += a_d sum_t (p_t s_tok_t) code[d,t] + b_d sum_t p_t s_tok_t
 *    fp32 arithmetic throughout, in another order than the reference's
 *    (tests/attn/test_mla_attn.c bounds the difference).
 * Shapes: codes [D][G] one code per byte (row d = channel d, as the
 * record's packed rows); G a multiple of 16; D a power of two 64..512.
 */
#ifndef KVARN_ATTN_MLA_KERNELS_H
#define KVARN_ATTN_MLA_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* Reference. sc[t] (t < n) = scale (q_rot . lat[t] + q_pe . rope[t]);
 * lat [n][D] rotated, rope [n][R] (R may be 0). */
void attn_mla_ref_scores(const float *lat, const float *rope, int n, int D, int R,
                         const float *q_rot, const float *q_pe, float scale, float *sc);
/* Reference. acc[d] += sum_{t < n} p[t] lat[t][d]. */
void attn_mla_ref_accum(const float *lat, int n, int D, const float *p, float *acc);

/* Query rows per block of the folded kernels: each code is converted to
 * fp32 once per block and used by its rows (8 accumulators, one code
 * vector and one broadcast: 10 of AVX2's 16 vector registers). */
#define ATTN_MLA_QB 8

/* Folded kernel, one copy per level (suffix _avx2, _avx512), on a block of
 * nb <= ATTN_MLA_QB query rows k:
 * scores: sc[k][t] for every t < G (the caller reads the visible ones) =
 *   scale (s_tok[t] (sum_d qa[k][d] codes[d][t] + cb[k]) + q_pe[k] . rope[t]),
 *   qa[k] = q_rot * a (per channel), cb[k] = q_rot . b; each row's sums
 *   in the same order whatever the block (rows are independent, bit for
 *   bit). qa [nb][D], sc [nb][G]; q_pe[k] unread when R is 0.
 * accum: w [nb][G] (zero past a row's visible tokens: p_t s_tok_t), sw[k]
 *   = sum_t w[k][t]; acc[k][d] += a[d] (sum_t w[k][t] codes[d][t]) + b[d] sw[k]. */
#define ATTN_MLA_FOLDED_DECL(SFX)                                                          \
    void attn_mla_folded_scores##SFX(const uint8_t *codes, const float *qa, const float *cb, \
                                     const float *s_tok, const float *rope,                 \
                                     const float *const *q_pe, int nb, int D, int R, int G, \
                                     float scale, float *sc);                               \
    void attn_mla_folded_accum##SFX(const uint8_t *codes, const float *a, const float *b,   \
                                    const float *w, const float *sw, int nb, int D, int G,  \
                                    float *const *acc);
#if defined(__x86_64__) || defined(__i386__)
#define ATTN_MLA_HAVE_X86 1
ATTN_MLA_FOLDED_DECL(_avx2)
ATTN_MLA_FOLDED_DECL(_avx512)
#endif

/* The matrix kernel (mla_amx.c: AMX-BF16 tiles; _amxemu: the tiles
 * emulated in C), for calls of ATTN_MLA_MATRIX_MIN_ROWS query rows or more
 * with G % 32 == 0, G <= 128 (D is a power of two 64..512):
 * prep: the tile's codes [D][G] (one per byte) into mat, bf16 [2][D][G]
 *   (the scores' B layout [D / 2][G][2], then the sums' [G / 2][D][2]);
 * scores, accum: the folded kernels' results (above, nb <= ATTN_MLA_QB)
 *   from mat, with q a and w carried as two bf16 values each (relative
 *   error 2^-16, docs/attention-matrix.md). */
#define ATTN_MLA_MATRIX_MIN_ROWS 16
#define ATTN_MLA_MATRIX_DECL(SFX)                                                          \
    void attn_mla_matrix_prep##SFX(const uint8_t *codes, int D, int G, uint16_t *mat);     \
    void attn_mla_matrix_scores##SFX(const uint16_t *mat, const float *qa, const float *cb, \
                                     const float *s_tok, const float *rope,                 \
                                     const float *const *q_pe, int nb, int D, int R, int G, \
                                     float scale, float *sc);                               \
    void attn_mla_matrix_accum##SFX(const uint16_t *mat, const float *a, const float *b,    \
                                    const float *w, const float *sw, int nb, int D, int G,  \
                                    float *const *acc);
ATTN_MLA_MATRIX_DECL(_amxemu)
#ifdef ATTN_MLA_HAVE_X86
ATTN_MLA_MATRIX_DECL(_amx)
#endif

#endif /* KVARN_ATTN_MLA_KERNELS_H */

/* The folded kernels' body: included by mla_avx2.c / mla_avx512.c after
 * defining ATTN_MLA_SFX (name suffix) and ATTN_MLA_LANES (8 or 16). */
#ifdef ATTN_MLA_SFX
#include <string.h>
#define ATTN_MLA_CAT2(a, b) a##b
#define ATTN_MLA_CAT(a, b) ATTN_MLA_CAT2(a, b)
#define ATTN_MLA_FN(name) ATTN_MLA_CAT(name, ATTN_MLA_SFX)

typedef float mla_vf __attribute__((vector_size(4 * ATTN_MLA_LANES)));
typedef uint8_t mla_vb __attribute__((vector_size(ATTN_MLA_LANES)));
enum { MLA_L = ATTN_MLA_LANES };

static inline mla_vf mla_load_codes(const uint8_t *p)
{
    mla_vb b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, mla_vf);
}

static inline float mla_hsum(mla_vf v)
{
    float l[MLA_L], s = 0.0f;
    memcpy(l, &v, sizeof l);
    for (int i = 0; i < MLA_L; i++) s += l[i];
    return s;
}

void ATTN_MLA_FN(attn_mla_folded_scores)(const uint8_t *codes, const float *qa, const float *cb,
                                         const float *s_tok, const float *rope,
                                         const float *const *q_pe, int nb, int D, int R, int G,
                                         float scale, float *sc)
{
    /* One vector of tokens at a time; the channel loop inside, so each
     * token's sum runs over d in order; each code vector converted once
     * for the block's rows. */
    for (int t0 = 0; t0 < G; t0 += MLA_L) {
        mla_vf acc[ATTN_MLA_QB];
        for (int k = 0; k < nb; k++) acc[k] = (mla_vf){0};
        const uint8_t *col = codes + t0;
        for (int d = 0; d < D; d++) {
            const mla_vf cv = mla_load_codes(col + (size_t)d * (size_t)G);
            for (int k = 0; k < nb; k++) acc[k] += qa[(size_t)k * (size_t)D + d] * cv;
        }
        mla_vf s;
        memcpy(&s, s_tok + t0, sizeof s);
        for (int k = 0; k < nb; k++) {
            acc[k] = (acc[k] + cb[k]) * s;
            memcpy(sc + (size_t)k * (size_t)G + t0, &acc[k], sizeof acc[k]);
        }
    }
    for (int k = 0; k < nb; k++)
        for (int t = 0; t < G; t++) {
            float r = 0.0f;
            const float *kp = rope + (size_t)t * (size_t)R;
            for (int j = 0; j < R; j++) r += q_pe[k][j] * kp[j];
            float *o = sc + (size_t)k * (size_t)G + t;
            *o = scale * (*o + r);
        }
}

void ATTN_MLA_FN(attn_mla_folded_accum)(const uint8_t *codes, const float *a, const float *b,
                                        const float *w, const float *sw, int nb, int D, int G,
                                        float *const *acc)
{
    for (int d = 0; d < D; d++) {
        const uint8_t *row = codes + (size_t)d * (size_t)G;
        mla_vf s[ATTN_MLA_QB];
        for (int k = 0; k < nb; k++) s[k] = (mla_vf){0};
        for (int t = 0; t < G; t += MLA_L) {
            const mla_vf cv = mla_load_codes(row + t);
            for (int k = 0; k < nb; k++) {
                mla_vf wv;
                memcpy(&wv, w + (size_t)k * (size_t)G + t, sizeof wv);
                s[k] += wv * cv;
            }
        }
        for (int k = 0; k < nb; k++) acc[k][d] += a[d] * mla_hsum(s[k]) + b[d] * sw[k];
    }
}
#endif /* ATTN_MLA_SFX */
