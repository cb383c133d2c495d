/*
 * mla_attn.c -- absorbed-form MLA attention over MLA records and an fp32
 * tail (include/kvarn/mla.h kvarn_mla_attn; docs/mla.md).
 *
 * One sequence, n_rows x n_heads query rows. The latent queries are rotated
 * once by H/sqrt(D) (the records' basis), every tile is read once for all
 * query rows (decoded to dense rows for the reference kernel, or unpacked
 * to one code per byte for the folded kernels, mla_kernels.h, which take
 * the query rows in blocks of ATTN_MLA_QB), the softmax
 * is online across tiles and the tail (running max m, sum l, rescaled
 * accumulator), and each row's accumulator is rotated back at the end:
 * out = (acc / l) H/sqrt(D). The tail rows are rotated into the same basis
 * and always go through the reference kernel (they are dense fp32).
 *
 * Level: the reference at KVARN_CPU_SCALAR, the folded kernel's AVX2 or
 * AVX-512 build above it (kvarn__cpu_level, capped by KVARN_SIMD). Single
 * threaded: the caller runs sequences or layers in parallel.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attn/mla_kernels.h"
#include "codec/fp_convert.h"
#include "codec/hadamard.h"
#include "codec/mla_internal.h"
#include "codec/pack.h"
#include "common/cpu.h"

#if KVARN_MLA_QB != ATTN_MLA_QB
#error "the workspace's block of query rows (mla_internal.h) must be the kernels' (mla_kernels.h)"
#endif

/* The kernels of each SIMD level, indexed by kvarn_cpu_level (as
 * kernel_table.c's rows for the per-head formats): NULL folded kernels
 * mean the reference (mla_ref.c) reads the tile as dense decoded rows. */
typedef void (*mla_scores_fn)(const uint8_t *codes, const float *qa, const float *cb,
                              const float *s_tok, const float *rope, const float *const *q_pe,
                              int nb, int D, int R, int G, float scale, float *sc);
typedef void (*mla_accum_fn)(const uint8_t *codes, const float *a, const float *b, const float *w,
                             const float *sw, int nb, int D, int G, float *const *acc);
typedef struct mla_level_row {
    const char *name;
    mla_scores_fn scores;
    mla_accum_fn accum;
} mla_level_row;

static const mla_level_row k_mla_levels[] = {
    [KVARN_CPU_SCALAR] = {"scalar", NULL, NULL},
#ifdef ATTN_MLA_HAVE_X86
    [KVARN_CPU_AVX2] = {"avx2", attn_mla_folded_scores_avx2, attn_mla_folded_accum_avx2},
    [KVARN_CPU_AVX512] = {"avx512", attn_mla_folded_scores_avx512, attn_mla_folded_accum_avx512},
#endif
};

/* The row this call runs: the CPU's level capped by KVARN_SIMD. */
static const mla_level_row *mla_level(void)
{
    const int n = (int)(sizeof k_mla_levels / sizeof k_mla_levels[0]);
    int level = (int)kvarn__cpu_level();
    level = level < n ? level : n - 1;
    return &k_mla_levels[level];
}

const char *kvarn_mla_attn_kernel_name(const kvarn_mla_format *fmt, int latent_dim)
{
    if (kvarn_mla_check_dims(fmt, latent_dim, 0) != KVARN_OK) return "scalar";
    return mla_level()->name;
}

/* The matrix kernel's three calls (mla_kernels.h). */
typedef struct mla_matrix_row {
    const char *name;
    void (*prep)(const uint8_t *codes, int D, int G, uint16_t *mat);
    void (*scores)(const uint16_t *mat, const float *qa, const float *cb, const float *s_tok,
                   const float *rope, const float *const *q_pe, int nb, int D, int R, int G,
                   float scale, float *sc);
    void (*accum)(const uint16_t *mat, const float *a, const float *b, const float *w,
                  const float *sw, int nb, int D, int G, float *const *acc);
} mla_matrix_row;

/* The matrix kernel calls of at least ATTN_MLA_MATRIX_MIN_ROWS query rows
 * take for tiles of G tokens (NULL: none): where the level's folded
 * kernels run, G % 32 == 0 and G <= 128, the AMX tiles where the CPU
 * grants them (kvarn__cpu_amx), their emulation under
 * KVARN_AMX=emulate. */
static const mla_matrix_row *mla_matrix(const mla_level_row *K, int G)
{
    static const mla_matrix_row emu = {"amx-bf16-emulated", attn_mla_matrix_prep_amxemu,
                                       attn_mla_matrix_scores_amxemu, attn_mla_matrix_accum_amxemu};
#ifdef ATTN_MLA_HAVE_X86
    static const mla_matrix_row amx = {"amx-bf16", attn_mla_matrix_prep_amx,
                                       attn_mla_matrix_scores_amx, attn_mla_matrix_accum_amx};
#endif
    if (K->scores == NULL || G % 32 != 0 || G > 128) return NULL;
    switch (kvarn__cpu_amx()) {
    case KVARN_CPU_AMX_EMULATED: return &emu;
#ifdef ATTN_MLA_HAVE_X86
    case KVARN_CPU_AMX_TILES: return &amx;
#endif
    default: return NULL;
    }
}

const char *kvarn_mla_attn_matrix_name(const kvarn_mla_format *fmt, int latent_dim)
{
    if (kvarn_mla_check_dims(fmt, latent_dim, 0) != KVARN_OK) return NULL;
    const mla_matrix_row *M = mla_matrix(mla_level(), fmt->tile_tokens);
    return M ? M->name : NULL;
}

/* One online-softmax step of one query row over n scores sc (replaced by
 * the weights exp(sc - m_new)): m, l updated, acc [D] rescaled. */
static void softmax_step(float *sc, int n, float *m, float *l, float *acc, int D)
{
    float mx = sc[0];
    for (int t = 1; t < n; t++) mx = sc[t] > mx ? sc[t] : mx;
    const float m_new = mx > *m ? mx : *m;
    if (m_new > *m) {
        const float corr = *m == -INFINITY ? 0.0f : expf(*m - m_new);
        *l *= corr;
        for (int d = 0; d < D; d++) acc[d] *= corr;
        *m = m_new;
    }
    float sum = 0.0f;
    for (int t = 0; t < n; t++) {
        sc[t] = expf(sc[t] - m_new);
        sum += sc[t];
    }
    *l += sum;
}

kvarn_status kvarn_mla_attn(const kvarn_mla_format *fmt, int latent_dim, int rope_dim,
                            const uint8_t *const *records, int n_tiles,
                            const float *tail_latent, const float *tail_rope, int n_tail,
                            const float *q_latent, const float *q_rope, int n_rows, int n_heads,
                            const int *row_len, float scale, float *out, float *lse,
                            void *workspace)
{
    kvarn_mla_layout L;
    kvarn_status st = kvarn__mla_layout(fmt, latent_dim, rope_dim, &L);
    if (st != KVARN_OK) return st;
    const int D = latent_dim, R = rope_dim, G = L.tile_tokens;
    if (n_tiles < 0 || n_tail < 0 || n_rows <= 0 || n_heads <= 0) return KVARN_ERR_INVALID_ARG;
    if (n_rows > KVARN_MLA_MAX_QROWS / n_heads) return KVARN_ERR_INVALID_ARG;
    if ((n_tiles > 0 && records == NULL) || (n_tail > 0 && tail_latent == NULL) ||
        (n_tail > 0 && R > 0 && tail_rope == NULL) || q_latent == NULL ||
        (R > 0 && q_rope == NULL) || out == NULL || workspace == NULL)
        return KVARN_ERR_INVALID_ARG;
    if (!(scale > 0.0f) || !isfinite(scale)) return KVARN_ERR_INVALID_ARG;
    const int64_t total64 = (int64_t)n_tiles * G + n_tail;
    if (total64 < 1 || total64 > INT32_MAX) return KVARN_ERR_INVALID_ARG;
    const int total = (int)total64;
    for (int i = 0; i < n_tiles; i++)
        if (records[i] == NULL) return KVARN_ERR_INVALID_ARG;
    if (row_len != NULL)
        for (int i = 0; i < n_rows; i++)
            if (row_len[i] < 1 || row_len[i] > total) return KVARN_ERR_INVALID_ARG;
    const int nq = n_rows * n_heads;
    if (!kvarn__all_finite(q_latent, (size_t)nq * (size_t)D) ||
        (R > 0 && !kvarn__all_finite(q_rope, (size_t)nq * (size_t)R)) ||
        (n_tail > 0 && !kvarn__all_finite(tail_latent, (size_t)n_tail * (size_t)D)) ||
        (n_tail > 0 && R > 0 && !kvarn__all_finite(tail_rope, (size_t)n_tail * (size_t)R)))
        return KVARN_ERR_NONFINITE;

    kvarn_mla_attn_ws ws;
    kvarn__mla_attn_ws_carve(D, R, G, nq, workspace, &ws);
    const mla_level_row *K = mla_level();
    const int folded = K->scores != NULL;
    /* the matrix kernel: its bf16 codes in ws.lat (G D floats, read only by
     * the reference path and the tail, which follow the records) */
    const mla_matrix_row *M = nq >= ATTN_MLA_MATRIX_MIN_ROWS ? mla_matrix(K, G) : NULL;
    uint16_t *mat = (uint16_t *)(void *)ws.lat;
    memcpy(ws.qr, q_latent, (size_t)nq * (size_t)D * sizeof(float));
    kvarn_hadamard_rows(ws.qr, nq, D);
    memset(ws.acc, 0, (size_t)nq * (size_t)D * sizeof(float));
    for (int q = 0; q < nq; q++) {
        ws.m[q] = -INFINITY;
        ws.l[q] = 0.0f;
    }

    /* Records. */
    float a[512], b[512], s_tok[128];
    const size_t row_bytes = kvarn_packed_bytes((size_t)G, L.latent_bits);
    for (int i = 0; i < n_tiles; i++) {
        const int base = i * G;
        const uint8_t *rec = records[i];
        if (!folded) { /* reference: the tile as dense rotated rows */
            kvarn__mla_decode_rotated(&L, rec, ws.lat, ws.rope);
            for (int q = 0; q < nq; q++) {
                const int len = row_len ? row_len[q / n_heads] : total;
                const int n = len - base < G ? len - base : G;
                if (n <= 0) continue;
                const float *qpe = R > 0 ? q_rope + (size_t)q * (size_t)R : NULL;
                float *acc = ws.acc + (size_t)q * (size_t)D;
                attn_mla_ref_scores(ws.lat, ws.rope, n, D, R, ws.qr + (size_t)q * (size_t)D, qpe, scale, ws.sc);
                softmax_step(ws.sc, n, &ws.m[q], &ws.l[q], acc, D);
                attn_mla_ref_accum(ws.lat, n, D, ws.sc, acc);
            }
            continue;
        }
        /* folded: the codes unpacked once, a_d, b_d, s_tok_t as fp32, then
         * blocks of up to QB query rows that see part of this tile */
        kvarn__mla_decode_rotated(&L, rec, NULL, ws.rope);
        for (int d = 0; d < D; d++)
            (void)kvarn_unpack_codes(rec + L.lat.k_codes_off + (size_t)d * row_bytes, (size_t)G,
                                     L.latent_bits, ws.codes + (size_t)d * (size_t)G);
        if (M) M->prep(ws.codes, D, G, mat);
        kvarn__fp16_load(rec + L.lat.k_a_off, D, a);
        kvarn__fp16_load(rec + L.lat.k_b_off, D, b);
        kvarn__fp16_load(rec + L.lat.k_stok_off, G, s_tok);
        for (int q = 0; q < nq;) {
            int qs[ATTN_MLA_QB], ns[ATTN_MLA_QB], nb = 0;
            for (; q < nq && nb < ATTN_MLA_QB; q++) {
                const int len = row_len ? row_len[q / n_heads] : total;
                const int n = len - base < G ? len - base : G;
                if (n > 0) qs[nb] = q, ns[nb] = n, nb++;
            }
            if (nb == 0) break;
            float cb[ATTN_MLA_QB], sw[ATTN_MLA_QB], *accp[ATTN_MLA_QB];
            const float *qpe[ATTN_MLA_QB];
            for (int k = 0; k < nb; k++) {
                const float *qr = ws.qr + (size_t)qs[k] * (size_t)D;
                float *qa = ws.qa + (size_t)k * (size_t)D;
                cb[k] = 0.0f;
                for (int d = 0; d < D; d++) {
                    qa[d] = qr[d] * a[d];
                    cb[k] += qr[d] * b[d];
                }
                qpe[k] = R > 0 ? q_rope + (size_t)qs[k] * (size_t)R : NULL;
                accp[k] = ws.acc + (size_t)qs[k] * (size_t)D;
            }
            if (M) M->scores(mat, ws.qa, cb, s_tok, ws.rope, qpe, nb, D, R, G, scale, ws.sc);
            else K->scores(ws.codes, ws.qa, cb, s_tok, ws.rope, qpe, nb, D, R, G, scale, ws.sc);
            for (int k = 0; k < nb; k++) {
                float *sc = ws.sc + (size_t)k * (size_t)G, *pw = ws.pw + (size_t)k * (size_t)G;
                softmax_step(sc, ns[k], &ws.m[qs[k]], &ws.l[qs[k]], accp[k], D);
                sw[k] = 0.0f;
                for (int t = 0; t < G; t++) {
                    pw[t] = t < ns[k] ? sc[t] * s_tok[t] : 0.0f;
                    sw[k] += pw[t];
                }
            }
            if (M) M->accum(mat, a, b, ws.pw, sw, nb, D, G, accp);
            else K->accum(ws.codes, a, b, ws.pw, sw, nb, D, G, accp);
        }
    }

    /* Tail: chunks of up to G rows, rotated into the records' basis. */
    for (int c0 = 0; c0 < n_tail; c0 += G) {
        const int base = n_tiles * G + c0;
        const int nc = n_tail - c0 < G ? n_tail - c0 : G;
        memcpy(ws.lat, tail_latent + (size_t)c0 * (size_t)D, (size_t)nc * (size_t)D * sizeof(float));
        kvarn_hadamard_rows(ws.lat, nc, D);
        const float *rope = R > 0 ? tail_rope + (size_t)c0 * (size_t)R : ws.rope;
        for (int q = 0; q < nq; q++) {
            const int len = row_len ? row_len[q / n_heads] : total;
            const int n = len - base < nc ? len - base : nc;
            if (n <= 0) continue;
            const float *qpe = R > 0 ? q_rope + (size_t)q * (size_t)R : NULL;
            float *acc = ws.acc + (size_t)q * (size_t)D;
            attn_mla_ref_scores(ws.lat, rope, n, D, R, ws.qr + (size_t)q * (size_t)D, qpe, scale, ws.sc);
            softmax_step(ws.sc, n, &ws.m[q], &ws.l[q], acc, D);
            attn_mla_ref_accum(ws.lat, n, D, ws.sc, acc);
        }
    }

    /* out = (acc / l) H/sqrt(D); lse = m + log l. */
    for (int q = 0; q < nq; q++) {
        const float inv = 1.0f / ws.l[q];
        float *acc = ws.acc + (size_t)q * (size_t)D;
        for (int d = 0; d < D; d++) acc[d] *= inv;
    }
    kvarn_hadamard_rows(ws.acc, nq, D);
    memcpy(out, ws.acc, (size_t)nq * (size_t)D * sizeof(float));
    if (lse != NULL)
        for (int q = 0; q < nq; q++) lse[q] = ws.m[q] + logf(ws.l[q]);
    return KVARN_OK;
}
