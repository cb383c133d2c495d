/*
 * kvarn_tile_stats.h -- the statistics kernels of the KVarN variance
 * normalization (../shared/spec/KVARN.md "Store pipeline" step 2), written
 * once and compiled twice: by kvarn_tile.c for the baseline ISA (suffix
 * _base) and by kvarn_tile_avx2.c with AVX2 (suffix _avx2). Include it after
 * defining KVARN_TILE_STATS_SUFFIX. The loops are plain C in a fixed
 * operation order (8 explicit lanes for row sums, element-wise column sums),
 * so both copies give bit-identical results.
 *
 * Shapes: x is a row-major [R rows x C cols] fp32 matrix; R and C are powers
 * of two in [32, 512]. Outputs are unbiased (N-1) standard deviations.
 */
#include <math.h>
#include <stddef.h>

#ifndef KVARN_TILE_STATS_DECLS
#define KVARN_TILE_STATS_DECLS
#if defined(__x86_64__) || defined(__i386__)
#define KVARN_TILE_HAVE_AVX2 1
void kvarn__tile_col_stds_avx2(const float *x, int R, int C, const float *w,
                               float *shift, float *mean, float *out);
void kvarn__tile_row_stds_avx2(const float *x, int R, int C, const float *u, float *out);
#endif
#endif

#define KVARN_TILE_STATS_CAT2(a, b) a##b
#define KVARN_TILE_STATS_CAT(a, b) KVARN_TILE_STATS_CAT2(a, b)
#define KVARN_TILE_STATS_FN(name) KVARN_TILE_STATS_CAT(kvarn__tile_##name, KVARN_TILE_STATS_SUFFIX)

/* The _base copy is private to kvarn_tile.c; the _avx2 copy is exported. */
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

/* Unbiased std (N-1) of each column of y = x[i][j] * w[i]:
 * out[j] = std_i(y). Two passes (mean, then squared deviations), on data
 * shifted by the column's first element so that a constant column gives
 * exactly 0. shift, mean: scratch [C]. */
KVARN_TILE_STATS_LINKAGE void
KVARN_TILE_STATS_FN(col_stds)(const float *x, int R, int C, const float *w,
                              float *shift, float *mean, float *out)
{
    for (int j = 0; j < C; j++) {
        shift[j] = x[j] * w[0];
        mean[j] = 0.0f;
        out[j] = 0.0f;
    }
    for (int i = 0; i < R; i++) {
        const float *xr = x + (size_t)i * (size_t)C, wi = w[i];
        for (int j = 0; j < C; j++) mean[j] += xr[j] * wi - shift[j];
    }
    const float inv_n = 1.0f / (float)R; /* R is a power of two: exact */
    for (int j = 0; j < C; j++) mean[j] *= inv_n;
    for (int i = 0; i < R; i++) {
        const float *xr = x + (size_t)i * (size_t)C, wi = w[i];
        for (int j = 0; j < C; j++) {
            float dv = xr[j] * wi - shift[j] - mean[j];
            out[j] += dv * dv;
        }
    }
    const float n1 = (float)(R - 1);
    for (int j = 0; j < C; j++) out[j] = sqrtf(out[j] / n1);
}

/* Unbiased std (N-1) of each row of y = x[i][j] * u[j]: out[i] = std_j(y).
 * Same method as col_stds; C must be a multiple of 8 (it is 32..512). */
KVARN_TILE_STATS_LINKAGE void
KVARN_TILE_STATS_FN(row_stds)(const float *x, int R, int C, const float *u, float *out)
{
    const float inv_n = 1.0f / (float)C, n1 = (float)(C - 1);
    for (int i = 0; i < R; i++) {
        const float *xr = x + (size_t)i * (size_t)C;
        const float p0 = xr[0] * u[0];
        float acc[8] = {0}, sq[8] = {0};
        for (int j = 0; j < C; j += 8)
            for (int l = 0; l < 8; l++) acc[l] += xr[j + l] * u[j + l] - p0;
        const float mean = KVARN_TILE_STATS_FN(sum8)(acc) * inv_n;
        for (int j = 0; j < C; j += 8)
            for (int l = 0; l < 8; l++) {
                float dv = xr[j + l] * u[j + l] - p0 - mean;
                sq[l] += dv * dv;
            }
        out[i] = sqrtf(KVARN_TILE_STATS_FN(sum8)(sq) / n1);
    }
}

