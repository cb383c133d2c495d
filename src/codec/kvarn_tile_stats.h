/*
 * kvarn_tile_stats.h -- the statistics kernels of the KVarN variance
 * normalization (../shared/spec/KVARN.md "Store pipeline" step 2) and of the
 * RTN of one row (step 3), written once and compiled twice: by
 * kvarn_tile.c for the baseline ISA (suffix _base) and by
 * kvarn_tile_avx2.c with AVX2 (suffix _avx2). Include it after defining
 * KVARN_TILE_STATS_SUFFIX (or KVARN_TILE_STATS_DECLS_ONLY, as
 * kvarn_tile_avx512.c does, for the declarations alone). The loops are
 * plain C in a fixed operation order (8 explicit lanes for row sums,
 * element-wise column sums), so both copies give bit-identical results.
 *
 * Shapes: x is a row-major [R rows x C cols] fp32 matrix; R and C are powers
 * of two in [32, 512]. Outputs are unbiased (N-1) standard deviations.
 */
#include <math.h>
#include <stddef.h>
#include <string.h>

#ifndef KVARN_TILE_STATS_DECLS
#define KVARN_TILE_STATS_DECLS
#if defined(__x86_64__) || defined(__i386__)
#define KVARN_TILE_HAVE_AVX2 1
void kvarn__tile_col_stds_avx2(const float *x, int R, int C, const float *w,
                               float *shift, float *mean, float *out);
void kvarn__tile_row_stds_avx2(const float *x, int R, int C, const float *u, float *out);
void kvarn__tile_rtn_row_avx2(const float *xr, int C, const float *s_col, float sr, float qmax,
                              float scale_min, float rne_magic, float *y, unsigned char *codes,
                              float *lo_out, float *scale_out);
/* AVX-512 kernels of kvarn_tile_avx512.c (same results as the _base copies;
 * see that file). They read the [R][C] matrix X of kvarn_tile.c in two
 * panel layouts of 16 lanes: xp, column panels (panel p is X's columns
 * 16p..16p+15 as [R][16], at xp + p (16 R + 16): element (i, j) at
 * xp + (j / 16) (16 R + 16) + 16 i + j % 16), and xtp, row panels (panel
 * q is X's rows 16q..16q+15 as [C][16], at xtp + q (16 C + 16): element
 * (i, j) at xtp + (i / 16) (16 C + 16) + 16 j + i % 16); the 16 floats
 * after each panel are padding (R C + C and R C + R floats in all). dc:
 * scratch of 32 * max(R, C) floats. R, C: multiples of 16.
 * kvarn__tile512_load fills both layouts from a token-major [G][D] tile
 * (rotated unless prerotated; keys are X^T, values X) and returns -1 if a
 * value is out of range (raw_max before, rot_max after the rotation; NaN
 * included), else 0. D: 64..512, a power of two. */
int kvarn__tile512_load(const float *src, int G, int D, int prerotated, int is_key, float raw_max,
                        float rot_max, float *xp, float *xtp);
void kvarn__tile512_rescale(float *s, float *inv, float *sd_out, const float *sd_in,
                            const float *pre, int n, const float lim[4]);
double kvarn__tile512_std_ratio(float *sd, const float *u, int n, float lo_floor);
void kvarn__tile512_store_fp16(unsigned char *dst, const float *src, int n);
void kvarn__tile512_col_stds(const float *xp, int R, int C, const float *w, float *dc, float *out);
void kvarn__tile512_row_stds_t(const float *xtp, int R, int C, const float *u, float *dc, float *out);
void kvarn__tile512_rtn(const float *xp, int R, int C, const float *s_col, const float *s_row,
                        float qmax, float scale_min, int bits, float *ybuf,
                        unsigned char *codes_out, size_t row_bytes, float *a, float *b);
#endif
#endif

/* kvarn_tile_avx512.c needs only the declarations above. */
#ifndef KVARN_TILE_STATS_DECLS_ONLY
#define KVARN_TILE_STATS_CAT2(a, b) a##b
#define KVARN_TILE_STATS_CAT(a, b) KVARN_TILE_STATS_CAT2(a, b)
#define KVARN_TILE_STATS_FN(name) KVARN_TILE_STATS_CAT(kvarn__tile_##name, KVARN_TILE_STATS_SUFFIX)

/* The _base copy is private to kvarn_tile.c; the others are exported. */
#ifdef KVARN_TILE_STATS_EXPORT
#define KVARN_TILE_STATS_LINKAGE
#else
#define KVARN_TILE_STATS_LINKAGE static
#endif

/* Sum of 8 partial sums in a fixed order (deterministic everywhere). */
static inline float KVARN_TILE_STATS_FN(sum8)(const float *p)
{
    return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

/* Columns per block of col_stds: the block's sums stay in registers while
 * the rows stream past (4 ymm / 2 zmm), so the loop is bound by throughput,
 * not by a load-add-store chain through memory. */
#define KVARN_TILE_STATS_CB 32

/* Unbiased std (N-1) of each column of y = x[i][j] * w[i]:
 * out[j] = std_i(y). Two passes (mean, then squared deviations), on data
 * shifted by the column's first element so that a constant column gives
 * exactly 0. Each column's sums run over i = 0..R-1 in order (the blocking
 * over columns changes no sum). shift, mean: scratch [C]. C is a multiple
 * of KVARN_TILE_STATS_CB (it is 32..512). */
KVARN_TILE_STATS_LINKAGE void
KVARN_TILE_STATS_FN(col_stds)(const float *x, int R, int C, const float *w,
                              float *shift, float *mean, float *out)
{
    enum { CB = KVARN_TILE_STATS_CB };
    const float inv_n = 1.0f / (float)R; /* R is a power of two: exact */
    const float n1 = (float)(R - 1);
    (void)shift;
    (void)mean;
    for (int j0 = 0; j0 < C; j0 += CB) {
        float sh[CB], m[CB], q[CB];
        for (int l = 0; l < CB; l++) {
            sh[l] = x[j0 + l] * w[0];
            m[l] = 0.0f;
            q[l] = 0.0f;
        }
        for (int i = 0; i < R; i++) {
            const float *xr = x + (size_t)i * (size_t)C + (size_t)j0, wi = w[i];
            for (int l = 0; l < CB; l++) m[l] += xr[l] * wi - sh[l];
        }
        for (int l = 0; l < CB; l++) m[l] *= inv_n;
        for (int i = 0; i < R; i++) {
            const float *xr = x + (size_t)i * (size_t)C + (size_t)j0, wi = w[i];
            for (int l = 0; l < CB; l++) {
                float dv = xr[l] * wi - sh[l] - m[l];
                q[l] += dv * dv;
            }
        }
        for (int l = 0; l < CB; l++) out[j0 + l] = sqrtf(q[l] / n1);
    }
}

/* 8 fp32 lanes (GCC vector extension): element-wise IEEE operations, one
 * instruction per operator on AVX2 / AVX-512, two SSE instructions on the
 * baseline ISA; no contraction (ISO C mode), so every copy rounds alike. */
#ifndef KVARN_TILE_STATS_V8F
#define KVARN_TILE_STATS_V8F
typedef float kvarn_tile_v8f __attribute__((vector_size(32)));
#endif

/* Unbiased std (N-1) of each row of y = x[i][j] * u[j]: out[i] = std_j(y).
 * Same method as col_stds; each row's sums are 8 lanes (lane l takes
 * j = l, l + 8, ...) added in a fixed order. Four rows go side by side
 * (independent chains, so the adds pipeline); no row's order changes.
 * C must be a multiple of 8 (it is 32..512) and R of 4 (32..512). */
KVARN_TILE_STATS_LINKAGE void
KVARN_TILE_STATS_FN(row_stds)(const float *x, int R, int C, const float *u, float *out)
{
    enum { RB = 4 };
    const float inv_n = 1.0f / (float)C, n1 = (float)(C - 1);
    const size_t c = (size_t)C;
    for (int i0 = 0; i0 < R; i0 += RB) {
        const float *x0 = x + (size_t)i0 * c, *x1 = x0 + c, *x2 = x1 + c, *x3 = x2 + c;
        const float p0 = x0[0] * u[0], p1 = x1[0] * u[0], p2 = x2[0] * u[0], p3 = x3[0] * u[0];
        kvarn_tile_v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (size_t j = 0; j < c; j += 8) {
            kvarn_tile_v8f uj, y0, y1, y2, y3;
            memcpy(&uj, u + j, sizeof uj);
            memcpy(&y0, x0 + j, sizeof y0);
            memcpy(&y1, x1 + j, sizeof y1);
            memcpy(&y2, x2 + j, sizeof y2);
            memcpy(&y3, x3 + j, sizeof y3);
            a0 += y0 * uj - p0;
            a1 += y1 * uj - p1;
            a2 += y2 * uj - p2;
            a3 += y3 * uj - p3;
        }
        float l0[8], l1[8], l2[8], l3[8];
        memcpy(l0, &a0, sizeof l0);
        memcpy(l1, &a1, sizeof l1);
        memcpy(l2, &a2, sizeof l2);
        memcpy(l3, &a3, sizeof l3);
        const float m0 = KVARN_TILE_STATS_FN(sum8)(l0) * inv_n, m1 = KVARN_TILE_STATS_FN(sum8)(l1) * inv_n;
        const float m2 = KVARN_TILE_STATS_FN(sum8)(l2) * inv_n, m3 = KVARN_TILE_STATS_FN(sum8)(l3) * inv_n;
        kvarn_tile_v8f q0 = {0}, q1 = {0}, q2 = {0}, q3 = {0};
        for (size_t j = 0; j < c; j += 8) {
            kvarn_tile_v8f uj, d0, d1, d2, d3;
            memcpy(&uj, u + j, sizeof uj);
            memcpy(&d0, x0 + j, sizeof d0);
            memcpy(&d1, x1 + j, sizeof d1);
            memcpy(&d2, x2 + j, sizeof d2);
            memcpy(&d3, x3 + j, sizeof d3);
            d0 = d0 * uj - p0 - m0;
            d1 = d1 * uj - p1 - m1;
            d2 = d2 * uj - p2 - m2;
            d3 = d3 * uj - p3 - m3;
            q0 += d0 * d0;
            q1 += d1 * d1;
            q2 += d2 * d2;
            q3 += d3 * d3;
        }
        memcpy(l0, &q0, sizeof l0);
        memcpy(l1, &q1, sizeof l1);
        memcpy(l2, &q2, sizeof l2);
        memcpy(l3, &q3, sizeof l3);
        out[i0] = sqrtf(KVARN_TILE_STATS_FN(sum8)(l0) / n1);
        out[i0 + 1] = sqrtf(KVARN_TILE_STATS_FN(sum8)(l1) / n1);
        out[i0 + 2] = sqrtf(KVARN_TILE_STATS_FN(sum8)(l2) / n1);
        out[i0 + 3] = sqrtf(KVARN_TILE_STATS_FN(sum8)(l3) / n1);
    }
}

/* Spec step 3 on one row: y[j] = x[j] / s_col[j] / sr, lo = min y,
 * hi = max y, scale = max((hi - lo) / qmax, floor), codes[j] =
 * round-half-even((y[j] - lo) / scale) capped at qmax. lo and hi are the
 * first minimum / maximum in j order (the strict comparison of a scalar
 * scan); lane-wise scans agree except between -0 and +0, so a zero extreme
 * is looked up again in order. rne_magic: 1.5 * 2^23 (see kvarn_tile.c).
 * Outputs lo and scale; y: scratch [C]. */
KVARN_TILE_STATS_LINKAGE void
KVARN_TILE_STATS_FN(rtn_row)(const float *xr, int C, const float *s_col, float sr, float qmax,
                             float scale_min, float rne_magic, float *y, unsigned char *codes,
                             float *lo_out, float *scale_out)
{
    for (int j = 0; j < C; j++) y[j] = xr[j] / s_col[j] / sr;
    float lo8[8], hi8[8];
    for (int l = 0; l < 8; l++) lo8[l] = hi8[l] = y[l];
    for (int j = 8; j < C; j += 8)
        for (int l = 0; l < 8; l++) {
            lo8[l] = y[j + l] < lo8[l] ? y[j + l] : lo8[l];
            hi8[l] = y[j + l] > hi8[l] ? y[j + l] : hi8[l];
        }
    float lo = lo8[0], hi = hi8[0];
    for (int l = 1; l < 8; l++) {
        lo = lo8[l] < lo ? lo8[l] : lo;
        hi = hi8[l] > hi ? hi8[l] : hi;
    }
    if (lo == 0.0f)
        for (int j = 0; j < C; j++)
            if (y[j] == 0.0f) { lo = y[j]; break; }
    if (hi == 0.0f)
        for (int j = 0; j < C; j++)
            if (y[j] == 0.0f) { hi = y[j]; break; }
    float scale = (hi - lo) / qmax;
    if (!(scale >= scale_min)) scale = scale_min;
    for (int j = 0; j < C; j++) {
        float q = (y[j] - lo) / scale; /* >= 0 and <= qmax (1 + eps) */
        q = (q + rne_magic) - rne_magic;
        q = q > qmax ? qmax : q;
        codes[j] = (unsigned char)q;
    }
    *lo_out = lo;
    *scale_out = scale;
}
#endif /* KVARN_TILE_STATS_DECLS_ONLY */
