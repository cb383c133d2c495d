/*
 * kvarn_tile.c -- the KVarN tile codec: one tile (K and V of G tokens of one
 * KV head) <-> one record.
 *
 * Source: ../shared/spec/KVARN.md "Store pipeline" (rotate, variance
 * normalization, asymmetric RTN per row, fold, pack) and "Record layout";
 * the byte layout is read from kvarn_record_layout (include/kvarn/record.h).
 * Choices the spec leaves open are in docs/kvarn-codec.md.
 *
 * Both halves of a tile go through the same routine on a row-major
 * [R rows x C cols] matrix:
 *   K: R = D channels, C = G tokens  (rows = channels; the tile transposed)
 *   V: R = G tokens,   C = D channels (rows = tokens; token-major as given)
 * and produce per-row a (scale), b (offset), per-column s (balance scale)
 * and R packed rows of C codes.
 *
 * Nothing is allocated: all scratch, including a staged image of the whole
 * record, lives in the caller's workspace. The record is written only once
 * every field is known to fit in fp16, so on any error it is untouched.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "codec/codec_internal.h"
#include "codec/fp_convert.h"
#include "codec/hadamard.h"
#include "codec/pack.h"
#include "common/cpu.h"

/* Spec step 2 constants. The log-space update c += log(std), clip c to
 * [-0.3, 10] is carried out on s = exp(c) directly: s *= std, clip s to
 * [exp(-0.3), exp(10)]. Same math, no exp/log per row or column. */
#define STD_MIN 1e-3f
#define STD_MAX 1e3f
#define SCALE_MIN 0.74081822068171788f  /* exp(-0.3) */
#define SCALE_MAX 22026.465794806718f   /* exp(10)   */
#define SCORE_STD_FLOOR 1e-8f
/* Two scores within this relative distance are a tie. Exact ties are common
 * (a uniform rescaling, scales pinned at a clip bound, constant rows leave
 * the score unchanged in exact arithmetic) and fp32 rounding (~1e-6 on a
 * score) must not decide them; the best score kept is the minimum seen, so
 * accepting a tie never lets the score drift upwards. */
#define SCORE_TIE_RTOL 1e-5
/* Spec step 3: floor of the RTN scale. */
#define RTN_SCALE_MIN 1e-10f
#define FP16_MAX 65504.0f

/* Largest |x| a record can hold. Dequantized, |x| = |code*a + b| * s_col
 * <= (|b| + (2^bits - 1)|a|) * exp(10) <= 65504 * 256 * 22026.5 ~ 3.7e11 in
 * the rotated basis, so a rotated |x| above 2^39 (5.5e11) can never be
 * stored and is rejected before any arithmetic; a raw |x| above 2^44 >=
 * sqrt(512) * 2^39 rotates to at least 2^39 somewhere, and is rejected
 * before the rotation. Below these bounds every fp32 intermediate (sums of
 * squares included) stays far from overflow. */
#define RAW_ABS_MAX 0x1p44f
#define ROT_ABS_MAX 0x1p39f

/* Round-half-even of 0 <= q < 2^22 in the default rounding mode, like
 * rintf, but vectorizable without SSE4.1: adding 1.5 * 2^23 moves q to a
 * binade whose spacing is 1, so the addition itself rounds to an integer. */
#define RNE_MAGIC 0x1.8p23f

enum { TILE_MAX_DIM = 512 };

/* Per-row / per-column vectors of the workspace, max(D, G) floats each. */
enum {
    V_S_COL, V_S_ROW,       /* balance scales of the current iteration */
    V_BEST_COL, V_BEST_ROW, /* best scales so far */
    V_INV_COL, V_INV_ROW,   /* 1 / scale */
    V_SD_COL, V_SD_ROW,     /* std of the columns / rows of the normalized tile */
    V_SD_ROW_U,             /* std of the rows of x * inv_col (no row scale) */
    V_AUX0, V_AUX1,         /* column shifts and means; one balanced row;
                               the V means of centring (centre_values) */
    V_A, V_B,               /* fp32 folded a and b of each row */
    V_COUNT
};

typedef struct tile_ws {
    uint8_t *rec;     /* staged record image (worst-case record bytes) */
    float *x;         /* [R][C] matrix being encoded (AVX-512: its column panels) */
    float *tmp;       /* [G][D] rotated K before its transpose (AVX-512: the row
                         panels of x, then the balanced rows of the RTN) */
    float *dc;        /* AVX-512 statistics scratch, 32 * max(D, G) floats */
    float *vec[V_COUNT];
    uint8_t *codes;   /* one row of unpacked codes, max(D, G) bytes */
    kvarn_cpu_level level; /* SIMD copy of the statistics and RTN kernels */
} tile_ws;

static size_t round64(size_t n) { return (n + 63) & ~(size_t)63; }

/* Bytes of the largest KVarN record for D and G (8-bit keys and values,
 * mean-centred). */
static size_t max_record_bytes(int head_dim, int tile_tokens)
{
    kvarn_format f;
    memset(&f, 0, sizeof f);
    f.kind = KVARN_KIND_KVARN;
    f.tile_tokens = tile_tokens;
    f.key_bits = 8;
    f.value_bits = 8;
    f.per_tile = 1;
    f.centred = 1;
    kvarn_record_layout L;
    return kvarn_record_layout_get(&f, head_dim, &L) == KVARN_OK ? L.record_bytes : 0;
}

/* Carve the workspace; returns its size in bytes (0 if D/G unsupported).
 * With base == NULL only the size is computed. */
static size_t ws_layout(int head_dim, int tile_tokens, void *base, tile_ws *ws)
{
    const size_t rec = max_record_bytes(head_dim, tile_tokens);
    if (rec == 0 || head_dim > TILE_MAX_DIM || tile_tokens > TILE_MAX_DIM) return 0;
    const size_t D = (size_t)head_dim, G = (size_t)tile_tokens, M = D > G ? D : G;
    size_t off = 0, rec_off, x_off, tmp_off, dc_off, vec_off[V_COUNT], codes_off;
    rec_off = off; off += round64(rec);
    /* x and tmp: D G floats, and for the AVX-512 panels one cache line
     * more per panel (kvarn_tile_avx512.c pstride): D G + max(D, G) */
    x_off = off; off += round64((D * G + M) * sizeof(float));
    tmp_off = off; off += round64((D * G + M) * sizeof(float));
    dc_off = off; off += round64(32 * M * sizeof(float));
    for (int i = 0; i < V_COUNT; i++) { vec_off[i] = off; off += round64(M * sizeof(float)); }
    codes_off = off; off += round64(M);
    /* The caller's workspace may be only as aligned as malloc makes it (16
     * bytes); the carve starts at its first 64-byte boundary, so that no
     * 64-byte vector of the scratch straddles two cache lines (a 16-byte
     * offset made the AVX-512 encode ~30% slower). */
    off += 64;
    if (base != NULL) {
        uint8_t *b = (uint8_t *)base + ((64 - (uintptr_t)base % 64) % 64);
        ws->rec = b + rec_off;
        ws->x = (float *)(void *)(b + x_off);
        ws->tmp = (float *)(void *)(b + tmp_off);
        ws->dc = (float *)(void *)(b + dc_off);
        for (int i = 0; i < V_COUNT; i++) ws->vec[i] = (float *)(void *)(b + vec_off[i]);
        ws->codes = b + codes_off;
    }
    return off;
}

size_t kvarn__tile_workspace_bytes(int head_dim, int tile_tokens)
{
    return ws_layout(head_dim, tile_tokens, NULL, NULL);
}

/* ---------------------------------------------------------------------- */
/* Statistics                                                              */
/* ---------------------------------------------------------------------- */

/* col_stds / row_stds: the statistics kernels, one copy compiled for the
 * baseline ISA here and one with AVX2 in kvarn_tile_avx2.c; the same C, so
 * bit-identical results (ISO C mode: no FMA contraction, no reassociation). */
#define KVARN_TILE_STATS_SUFFIX _base
#include "codec/kvarn_tile_stats.h"

/* The copy to run: the _avx2 copy is the same C as _base, compiled for
 * wider vectors (kvarn_tile_avx2.c); the AVX-512 kernels
 * (kvarn_tile_avx512.c) read x and xt as panels (kvarn_tile_stats.h) and
 * perform the same operations on every element, so every level gives the
 * same bytes; the level is read once per encode. */
static void col_stds(const tile_ws *ws, const float *x, int R, int C, const float *w,
                     float *shift, float *mean, float *out)
{
#ifdef KVARN_TILE_HAVE_AVX2
    if (ws->level >= KVARN_CPU_AVX512) {
        kvarn__tile512_col_stds(x, R, C, w, ws->dc, out);
        return;
    }
    if (ws->level >= KVARN_CPU_AVX2) {
        kvarn__tile_col_stds_avx2(x, R, C, w, shift, mean, out);
        return;
    }
#endif
    kvarn__tile_col_stds_base(x, R, C, w, shift, mean, out);
}

/* xt: the row panels of x, read by the AVX-512 kernel. */
static void row_stds(const tile_ws *ws, const float *x, const float *xt, int R, int C,
                     const float *u, float *out)
{
#ifdef KVARN_TILE_HAVE_AVX2
    if (ws->level >= KVARN_CPU_AVX512) {
        kvarn__tile512_row_stds_t(xt, R, C, u, ws->dc, out);
        return;
    }
    if (ws->level >= KVARN_CPU_AVX2) {
        kvarn__tile_row_stds_avx2(x, R, C, u, out);
        return;
    }
#endif
    kvarn__tile_row_stds_base(x, R, C, u, out);
}

/* RTN of row i of x [R][C] (the AVX-512 path does all rows at once). */
static void rtn_row(const tile_ws *ws, const float *x, int i, int C, const float *s_col, float sr,
                    float qmax, float *y, uint8_t *codes, float *lo, float *scale)
{
    const float *xr = x + (size_t)i * (size_t)C;
#ifdef KVARN_TILE_HAVE_AVX2
    if (ws->level >= KVARN_CPU_AVX2) {
        kvarn__tile_rtn_row_avx2(xr, C, s_col, sr, qmax, RTN_SCALE_MIN, RNE_MAGIC, y, codes, lo, scale);
        return;
    }
#endif
    kvarn__tile_rtn_row_base(xr, C, s_col, sr, qmax, RTN_SCALE_MIN, RNE_MAGIC, y, codes, lo, scale);
}

/* max/min of n stds, the min floored at 1e-8 (spec step 2). */
static double std_ratio(const float *sd, int n)
{
    float mx = sd[0], mn = sd[0];
    for (int i = 1; i < n; i++) {
        mx = sd[i] > mx ? sd[i] : mx;
        mn = sd[i] < mn ? sd[i] : mn;
    }
    if (mn < SCORE_STD_FLOOR) mn = SCORE_STD_FLOOR;
    return (double)mx / (double)mn;
}

static float clampf(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

/* std_ratio of sd after sd[j] *= u[j] (u NULL: no product). */
static double scaled_std_ratio(const tile_ws *ws, float *sd, const float *u, int n)
{
#ifdef KVARN_TILE_HAVE_AVX2
    if (ws->level >= KVARN_CPU_AVX512) return kvarn__tile512_std_ratio(sd, u, n, SCORE_STD_FLOOR);
#endif
    if (u)
        for (int j = 0; j < n; j++) sd[j] *= u[j];
    return std_ratio(sd, n);
}

/* The scale update of a column or row pass (spec step 2 in scale form):
 * sd = pre ? pre[j] * sd_in[j] : sd_in[j], s[j] = clamp(s[j] *
 * clamp(sd, STD_MIN, STD_MAX), SCALE_MIN, SCALE_MAX), inv[j] = 1 / s[j],
 * and if sd_out: sd_out[j] = inv[j] * sd_in[j]. inv may be pre. */
static void rescale(const tile_ws *ws, float *s, float *inv, float *sd_out, const float *sd_in,
                    const float *pre, int n)
{
#ifdef KVARN_TILE_HAVE_AVX2
    if (ws->level >= KVARN_CPU_AVX512) {
        static const float lim[4] = {STD_MIN, STD_MAX, SCALE_MIN, SCALE_MAX};
        kvarn__tile512_rescale(s, inv, sd_out, sd_in, pre, n, lim);
        return;
    }
#endif
    for (int j = 0; j < n; j++) {
        const float sd = pre ? pre[j] * sd_in[j] : sd_in[j];
        s[j] = clampf(s[j] * clampf(sd, STD_MIN, STD_MAX), SCALE_MIN, SCALE_MAX);
        inv[j] = 1.0f / s[j];
        if (sd_out) sd_out[j] = inv[j] * sd_in[j];
    }
}

/* ---------------------------------------------------------------------- */
/* Variance normalization (spec step 2)                                   */
/* ---------------------------------------------------------------------- */

/* Find the balance scales of x [R][C]: best_col [C], best_row [R] (the
 * vectors V_BEST_COL / V_BEST_ROW of ws). The normalized tile is
 * y = x / s_col / s_row. Its column stds are inv_col[j] * std_i(x * inv_row)
 * and its row stds inv_row[i] * std_j(x * inv_col), so each half-iteration
 * needs one statistics pass over the original x and nothing is
 * accumulated from one iteration's rounded tile into the next. */
static void balance(const tile_ws *ws, const float *x, const float *xt, int R, int C, int iters)
{
    float *s_col = ws->vec[V_S_COL], *s_row = ws->vec[V_S_ROW];
    float *best_col = ws->vec[V_BEST_COL], *best_row = ws->vec[V_BEST_ROW];
    float *u = ws->vec[V_INV_COL], *w = ws->vec[V_INV_ROW];
    float *sd_col = ws->vec[V_SD_COL], *sd_row = ws->vec[V_SD_ROW];
    float *sd_row_u = ws->vec[V_SD_ROW_U];
    float *aux0 = ws->vec[V_AUX0], *aux1 = ws->vec[V_AUX1];

    for (int j = 0; j < C; j++) s_col[j] = best_col[j] = u[j] = 1.0f;
    for (int i = 0; i < R; i++) s_row[i] = best_row[i] = w[i] = 1.0f;

    /* The identity scaling, scored on the raw tile, is the starting best. */
    col_stds(ws, x, R, C, w, aux0, aux1, sd_col);
    row_stds(ws, x, xt, R, C, u, sd_row);
    double best = scaled_std_ratio(ws, sd_col, NULL, C) + scaled_std_ratio(ws, sd_row, NULL, R);

    for (int it = 0; it < iters; it++) {
        /* Column pass: sd_col holds the column stds of the current tile. */
        rescale(ws, s_col, u, NULL, sd_col, NULL, C);
        /* Row pass on the tile renormalized with the new column scales
         * (the row stds of x * u, times the old 1 / s_row). */
        row_stds(ws, x, xt, R, C, u, sd_row_u);
        rescale(ws, s_row, w, sd_row, sd_row_u, w, R);
        /* Score the renormalized tile; its column stds feed the next pass. */
        col_stds(ws, x, R, C, w, aux0, aux1, sd_col);
        double score = scaled_std_ratio(ws, sd_col, u, C) + scaled_std_ratio(ws, sd_row, NULL, R);
        if (score <= best * (1.0 + SCORE_TIE_RTOL)) { /* ties go to the later iteration */
            best = score < best ? score : best;
            memcpy(best_col, s_col, (size_t)C * sizeof(float));
            memcpy(best_row, s_row, (size_t)R * sizeof(float));
        }
    }
}

/* ---------------------------------------------------------------------- */
/* RTN, fold, pack (spec steps 3-5)                                       */
/* ---------------------------------------------------------------------- */

static void store_fp16(uint8_t *dst, const float *src, int n)
{
    for (int i = 0; i < n; i++) {
        uint16_t h = kvarn_fp32_to_fp16(src[i]);
        memcpy(dst + 2 * (size_t)i, &h, 2);
    }
}

/* ---------------------------------------------------------------------- */
/* Error-minimizing range (KVARN_RTN_MSE)                                  */
/* ---------------------------------------------------------------------- */

/* Candidate ranges of the search: the row's [min, max] shrunk towards its
 * weighted mean by 1 - k / MSE_STEPS_DEN for k = 0 .. MSE_STEPS - 1 (down
 * to 0.4 of the span: the best uniform 2-bit quantizer of a Gaussian spans
 * 3.0 sigma, the min/max of 64 Gaussian values about 4.8 sigma), then up to
 * MSE_REFITS least-squares refits of (scale, lo) on the codes found. */
#define MSE_STEPS 13
#define MSE_STEPS_DEN 20.0f
#define MSE_REFITS 4

/* code of y with range (lo, scale): clamp((y - lo) / scale) to [0, qmax],
 * then round half to even (the clamp first keeps the RNE trick's operand
 * in [0, 2^22)). */
static inline float mse_code(float y, float lo, float scale, float qmax)
{
    float q = (y - lo) / scale;
    q = q > 0.0f ? q : 0.0f; /* a NaN quotient cannot occur: scale >= 1e-10 */
    q = q < qmax ? q : qmax;
    return (q + RNE_MAGIC) - RNE_MAGIC;
}

/* Weighted squared error sum_j w_j (code_j scale + lo - y_j)^2 of one row. */
static double mse_row_error(const float *y, const float *w, int C, float lo, float scale,
                            float qmax)
{
    double e2 = 0.0;
    for (int j = 0; j < C; j++) {
        const float e = mse_code(y[j], lo, scale, qmax) * scale + lo - y[j];
        e2 += (double)w[j] * (double)e * (double)e;
    }
    return e2;
}

/* RTN of one balanced row y [C] with the (lo, scale) of least weighted
 * squared reconstruction error sum_j w_j (y'_j - y_j)^2 among the
 * candidates above, w_j = s_col_j^2 (the error of the stored value x =
 * y s_col s_row, up to the row's common s_row^2). Writes codes [C],
 * *lo_out, *scale_out; scale >= RTN_SCALE_MIN. Plain C in a fixed order,
 * the same copy at every SIMD level, so every level gives the same bytes.
 * A row whose span is below qmax * RTN_SCALE_MIN gets the spec's min/max
 * range. The refits only lower the error (the codes are the nearest level
 * of the new range, the least-squares fit the best range for those codes),
 * and each candidate is kept only if it lowers the error, so the result is
 * never worse than min/max on this objective. */
static void rtn_row_mse(const float *y, const float *w, int C, float qmax, uint8_t *codes,
                        float *lo_out, float *scale_out)
{
    float lo0 = y[0], hi0 = y[0];
    double sw = 0.0, swy = 0.0;
    for (int j = 0; j < C; j++) {
        lo0 = y[j] < lo0 ? y[j] : lo0;
        hi0 = y[j] > hi0 ? y[j] : hi0;
        sw += (double)w[j];
        swy += (double)w[j] * (double)y[j];
    }
    float best_lo = lo0, best_scale = (hi0 - lo0) / qmax;
    if (!(best_scale >= RTN_SCALE_MIN)) best_scale = RTN_SCALE_MIN;
    if ((hi0 - lo0) / qmax > RTN_SCALE_MIN && sw > 0.0) {
        float m = (float)(swy / sw);
        m = m < lo0 ? lo0 : (m > hi0 ? hi0 : m);
        double best = mse_row_error(y, w, C, best_lo, best_scale, qmax);
        for (int k = 1; k < MSE_STEPS; k++) {
            const float r = 1.0f - (float)k / MSE_STEPS_DEN;
            const float lo = m - r * (m - lo0), hi = m + r * (hi0 - m);
            const float scale = (hi - lo) / qmax;
            if (!(scale >= RTN_SCALE_MIN)) break;
            const double e = mse_row_error(y, w, C, lo, scale, qmax);
            if (e < best) best = e, best_lo = lo, best_scale = scale;
        }
        for (int it = 0; it < MSE_REFITS; it++) {
            /* weighted least squares of y on the codes: y ~ c * scale + lo */
            double s1 = 0.0, sc = 0.0, sy = 0.0, scc = 0.0, scy = 0.0;
            for (int j = 0; j < C; j++) {
                const double c = (double)mse_code(y[j], best_lo, best_scale, qmax);
                const double wj = (double)w[j];
                s1 += wj;
                sc += wj * c;
                sy += wj * (double)y[j];
                scc += wj * c * c;
                scy += wj * c * (double)y[j];
            }
            const double det = s1 * scc - sc * sc;
            if (!(det > 0.0)) break; /* one code for the whole row */
            const float scale = (float)((s1 * scy - sc * sy) / det);
            if (!(scale >= RTN_SCALE_MIN) || !(scale <= FP16_MAX)) break;
            const float lo = (float)((sy - (double)scale * sc) / s1);
            const double e = mse_row_error(y, w, C, lo, scale, qmax);
            if (!(e < best)) break;
            best = e, best_lo = lo, best_scale = scale;
        }
    }
    for (int j = 0; j < C; j++) codes[j] = (uint8_t)mse_code(y[j], best_lo, best_scale, qmax);
    *lo_out = best_lo;
    *scale_out = best_scale;
}

/* Row i of the matrix into xr [C]: from x [R][C] (row-major), or, at the
 * AVX-512 level, from its row panels xt (kvarn_tile_stats.h). */
static const float *matrix_row(const tile_ws *ws, const float *x, const float *xt, int i, int C,
                               float *xr)
{
    if (ws->level < KVARN_CPU_AVX512) return x + (size_t)i * (size_t)C;
    const float *p = xt + (size_t)(i / 16) * (16 * (size_t)C + 16) + (size_t)(i % 16);
    for (int j = 0; j < C; j++) xr[j] = p[16 * (size_t)j];
    return xr;
}

/* Encode x [R][C] into the staged record: packed codes (R rows of C codes),
 * a [R], b [R], s_col [C] (fp16). rtn_range: KVARN_RTN_MINMAX (spec step 3)
 * or KVARN_RTN_MSE (rtn_row_mse). Returns KVARN_ERR_NONFINITE if a folded
 * parameter falls outside the fp16 range. */
static kvarn_status encode_matrix(const tile_ws *ws, const float *x, const float *xt, int R,
                                  int C, int bits, int iters, int rtn_range, uint8_t *codes_out,
                                  uint8_t *a16, uint8_t *b16, uint8_t *col16)
{
    balance(ws, x, xt, R, C, iters);
    const float *s_col = ws->vec[V_BEST_COL], *s_row = ws->vec[V_BEST_ROW];
    float *a = ws->vec[V_A], *b = ws->vec[V_B], *y = ws->vec[V_AUX0];
    uint8_t *codes = ws->codes;
    const float qmax = (float)((1 << bits) - 1);
    const size_t row_bytes = kvarn_packed_bytes((size_t)C, bits);

    const int mse = rtn_range == KVARN_RTN_MSE;
    /* MSE: V_SD_COL holds the weights s_col^2, V_AUX1 one row of x */
    float *w = ws->vec[V_SD_COL], *xr = ws->vec[V_AUX1];
    if (mse)
        for (int j = 0; j < C; j++) w[j] = s_col[j] * s_col[j];

#ifdef KVARN_TILE_HAVE_AVX2
    if (!mse && ws->level >= KVARN_CPU_AVX512) { /* xt is free again: the balanced rows */
        kvarn__tile512_rtn(x, R, C, s_col, s_row, qmax, RTN_SCALE_MIN, bits, ws->tmp, codes_out, row_bytes,
                           a, b);
        for (int i = 0; i < R; i++)
            if (!(fabsf(a[i]) <= FP16_MAX) || !(fabsf(b[i]) <= FP16_MAX)) return KVARN_ERR_NONFINITE;
        kvarn__tile512_store_fp16(a16, a, R);
        kvarn__tile512_store_fp16(b16, b, R);
        kvarn__tile512_store_fp16(col16, s_col, C);
        return KVARN_OK;
    }
#endif
    for (int i = 0; i < R; i++) {
        const float sr = s_row[i];
        float lo, scale;
        if (mse) {
            const float *row = matrix_row(ws, x, xt, i, C, xr);
            for (int j = 0; j < C; j++) y[j] = row[j] / s_col[j] / sr;
            rtn_row_mse(y, w, C, qmax, codes, &lo, &scale);
        } else {
            rtn_row(ws, x, i, C, s_col, sr, qmax, y, codes, &lo, &scale);
        }
        kvarn_pack_codes(codes, (size_t)C, bits, codes_out + (size_t)i * row_bytes);
        a[i] = sr * scale;
        b[i] = sr * lo;
        if (!(fabsf(a[i]) <= FP16_MAX) || !(fabsf(b[i]) <= FP16_MAX)) return KVARN_ERR_NONFINITE;
    }
    store_fp16(a16, a, R);
    store_fp16(b16, b, R);
    store_fp16(col16, s_col, C); /* in [exp(-0.3), exp(10)]: always fits */
    return KVARN_OK;
}

/* 1 if every |x[i]| <= lim (n a multiple of 8); a NaN fails. Lane flags
 * instead of an early exit, so that it vectorizes. */
static int all_within(const float *x, size_t n, float lim)
{
    int bad[8] = {0};
    for (size_t i = 0; i < n; i += 8)
        for (int l = 0; l < 8; l++) bad[l] |= !(fabsf(x[i + (size_t)l]) <= lim);
    return !(bad[0] | bad[1] | bad[2] | bad[3] | bad[4] | bad[5] | bad[6] | bad[7]);
}

/* Copy one token-major [G][D] input into dst, rotated by H/sqrt(D) unless
 * it is already, and check it is storable (see ROT_ABS_MAX). */
static kvarn_status load_rotated(const float *src, int G, int D, int prerotated, float *dst)
{
    const size_t n = (size_t)G * (size_t)D;
    if (!prerotated && !all_within(src, n, RAW_ABS_MAX)) return KVARN_ERR_NONFINITE;
    memcpy(dst, src, n * sizeof(float));
    if (!prerotated) kvarn_hadamard_rows(dst, G, D);
    if (!all_within(dst, n, ROT_ABS_MAX)) return KVARN_ERR_NONFINITE;
    return KVARN_OK;
}

/* dst [C][R] = src [R][C] transposed, in 8 x 8 blocks (R, C multiples of
 * 8) so that neither side is walked with a large stride. */
static void transpose(const float *src, int R, int C, float *dst)
{
    for (int i0 = 0; i0 < R; i0 += 8)
        for (int j0 = 0; j0 < C; j0 += 8)
            for (int j = j0; j < j0 + 8; j++)
                for (int i = i0; i < i0 + 8; i++)
                    dst[(size_t)j * (size_t)R + (size_t)i] = src[(size_t)i * (size_t)C + (size_t)j];
}

/* Mean-centring of a rotated V tile (centred formats, record.h V mu_d):
 * mu_d = (sum over the G tokens in order of V[t,d]) / G in fp32, rounded
 * to fp16, and V[t,d] -= mu_d (the fp16 value, so that decode and
 * attention add back exactly what was taken). V is the [G rows x D cols]
 * matrix X of encode_matrix; at the AVX-512 level it is held as column
 * panels xp and row panels xtp (kvarn_tile_stats.h), else row-major in xp
 * (xtp NULL). Every loop runs with the channels innermost over contiguous
 * memory (the compiler vectorizes across channels; each channel's sum
 * still runs over t = 0..G-1 in order), and both layouts hold the same
 * values, so the sums, hence the bytes, are the same at every level.
 * mu: scratch [D]; mu16: fp16 [D] out. Returns KVARN_ERR_NONFINITE if a
 * mean is beyond fp16 (|mu| >= 65520). */
static kvarn_status centre_values(float *xp, float *xtp, int G, int D, float *mu, uint8_t *mu16)
{
    const float inv_g = 1.0f / (float)G; /* G a power of two: exact */
    const size_t cps = 16 * (size_t)G + 16, rps = 16 * (size_t)D + 16; /* panel strides */
    for (int j = 0; j < D; j++) mu[j] = 0.0f;
    if (xtp) { /* column panel p: channels 16p..16p+15 of token t at 16 t */
        for (int p = 0; p < D / 16; p++)
            for (int t = 0; t < G; t++) {
                const float *r = xp + (size_t)p * cps + 16 * (size_t)t;
                float *m = mu + 16 * p;
                for (int l = 0; l < 16; l++) m[l] += r[l];
            }
    } else {
        for (int t = 0; t < G; t++) {
            const float *r = xp + (size_t)t * (size_t)D;
            for (int j = 0; j < D; j++) mu[j] += r[j];
        }
    }
    for (int j = 0; j < D; j++) {
        const uint16_t h = kvarn_fp32_to_fp16(mu[j] * inv_g);
        if ((h & 0x7c00u) == 0x7c00u) return KVARN_ERR_NONFINITE;
        memcpy(mu16 + 2 * (size_t)j, &h, 2);
        mu[j] = kvarn_fp16_to_fp32(h);
    }
    if (xtp) {
        for (int p = 0; p < D / 16; p++)
            for (int t = 0; t < G; t++) {
                float *r = xp + (size_t)p * cps + 16 * (size_t)t;
                const float *m = mu + 16 * p;
                for (int l = 0; l < 16; l++) r[l] -= m[l];
            }
        /* row panel q: tokens 16q..16q+15 of channel j at 16 j */
        for (int q = 0; q < G / 16; q++)
            for (int j = 0; j < D; j++) {
                float *r = xtp + (size_t)q * rps + 16 * (size_t)j;
                const float m = mu[j];
                for (int l = 0; l < 16; l++) r[l] -= m;
            }
    } else {
        for (int t = 0; t < G; t++) {
            float *r = xp + (size_t)t * (size_t)D;
            for (int j = 0; j < D; j++) r[j] -= mu[j];
        }
    }
    return KVARN_OK;
}

kvarn_status kvarn__tile_encode(const kvarn_record_layout *L, const float *k,
                                const float *v, void *record, void *workspace,
                                const kvarn_codec_opts *opts)
{
    const int D = L->head_dim, G = L->tile_tokens;
    const int iters = opts ? opts->balance_iters : 8;
    const int prerotated = opts ? opts->prerotated != 0 : 0;
    const int rtn_v = opts && opts->rtn_range != KVARN_RTN_MINMAX ? KVARN_RTN_MSE : KVARN_RTN_MINMAX;
    const int rtn = opts && opts->rtn_range == KVARN_RTN_MSE ? KVARN_RTN_MSE : KVARN_RTN_MINMAX;
    const int centred = L->v_mu_bytes != 0;
    tile_ws ws;
    if (ws_layout(D, G, workspace, &ws) == 0) return KVARN_ERR_UNSUPPORTED_HEAD_DIM;
    ws.level = kvarn__cpu_level();
    /* The AVX-512 layouts need D in 64..512 and G a multiple of 32 (every
     * KVarN preset); anything else runs the AVX2 copy. */
    if (ws.level >= KVARN_CPU_AVX512 && !(D >= 64 && (D & (D - 1)) == 0 && G >= 32 && G % 32 == 0))
        ws.level = KVARN_CPU_AVX2;
    uint8_t *rec = ws.rec;
    memset(rec, 0, L->record_bytes); /* padding included */

#ifdef KVARN_TILE_HAVE_AVX2
    if (ws.level >= KVARN_CPU_AVX512) { /* both layouts of each matrix at once */
        if (kvarn__tile512_load(k, G, D, prerotated, 1, RAW_ABS_MAX, ROT_ABS_MAX, ws.x, ws.tmp) != 0)
            return KVARN_ERR_NONFINITE;
        kvarn_status st = encode_matrix(&ws, ws.x, ws.tmp, D, G, L->key_bits, iters, rtn,
                                        rec + L->k_codes_off, rec + L->k_a_off, rec + L->k_b_off,
                                        rec + L->k_stok_off);
        if (st != KVARN_OK) return st;
        if (v == NULL) goto done; /* K half only (MLA latent) */
        if (kvarn__tile512_load(v, G, D, prerotated, 0, RAW_ABS_MAX, ROT_ABS_MAX, ws.x, ws.tmp) != 0)
            return KVARN_ERR_NONFINITE;
        if (centred && (st = centre_values(ws.x, ws.tmp, G, D, ws.vec[V_AUX1], rec + L->v_mu_off)) != KVARN_OK)
            return st;
        st = encode_matrix(&ws, ws.x, ws.tmp, G, D, L->value_bits, iters, rtn_v, rec + L->v_codes_off,
                           rec + L->v_a_off, rec + L->v_b_off, rec + L->v_schan_off);
        if (st != KVARN_OK) return st;
        goto done;
    }
#endif
    /* K: rows = channels, so transpose the rotated [G][D] to [D][G]. */
    kvarn_status st = load_rotated(k, G, D, prerotated, ws.tmp);
    if (st != KVARN_OK) return st;
    transpose(ws.tmp, G, D, ws.x);
    st = encode_matrix(&ws, ws.x, ws.tmp, D, G, L->key_bits, iters, rtn, rec + L->k_codes_off,
                       rec + L->k_a_off, rec + L->k_b_off, rec + L->k_stok_off);
    if (st != KVARN_OK) return st;
    if (v == NULL) goto done; /* K half only (MLA latent) */

    /* V: rows = tokens, already the token-major layout. */
    st = load_rotated(v, G, D, prerotated, ws.x);
    if (st != KVARN_OK) return st;
    if (centred && (st = centre_values(ws.x, NULL, G, D, ws.vec[V_AUX1], rec + L->v_mu_off)) != KVARN_OK) return st;
    st = encode_matrix(&ws, ws.x, ws.tmp, G, D, L->value_bits, iters, rtn_v, rec + L->v_codes_off,
                       rec + L->v_a_off, rec + L->v_b_off, rec + L->v_schan_off);
    if (st != KVARN_OK) return st;

done:
    memcpy(record, rec, L->record_bytes);
    return KVARN_OK;
}

/* ---------------------------------------------------------------------- */
/* Decode                                                                  */
/* ---------------------------------------------------------------------- */

kvarn_status kvarn__tile_decode(const kvarn_record_layout *L, const void *record,
                                float *k_out, float *v_out, unsigned flags)
{
    const int D = L->head_dim, G = L->tile_tokens;
    if (D > TILE_MAX_DIM || G > TILE_MAX_DIM) return KVARN_ERR_UNSUPPORTED_HEAD_DIM;
    const uint8_t *rec = (const uint8_t *)record;
    float a[TILE_MAX_DIM], b[TILE_MAX_DIM], s[TILE_MAX_DIM];
    uint8_t codes[8][TILE_MAX_DIM];

    if (k_out != NULL) { /* K[d,t] = (code*a_d + b_d) * s_tok_t */
        const int bits = L->key_bits;
        const size_t row_bytes = kvarn_packed_bytes((size_t)G, bits);
        kvarn__fp16_load(rec + L->k_a_off, D, a);
        kvarn__fp16_load(rec + L->k_b_off, D, b);
        kvarn__fp16_load(rec + L->k_stok_off, G, s);
        /* 8 channel rows at a time, so each token gets 8 adjacent floats */
        for (int d0 = 0; d0 < D; d0 += 8) {
            for (int l = 0; l < 8; l++)
                kvarn_unpack_codes(rec + L->k_codes_off + (size_t)(d0 + l) * row_bytes, (size_t)G,
                                   bits, codes[l]);
            for (int t = 0; t < G; t++) {
                float *out = k_out + (size_t)t * (size_t)D + (size_t)d0;
                for (int l = 0; l < 8; l++) out[l] = ((float)codes[l][t] * a[d0 + l] + b[d0 + l]) * s[t];
            }
        }
        if (!(flags & KVARN_DECODE_ROTATED)) kvarn_hadamard_rows(k_out, G, D);
    }
    if (v_out != NULL) { /* V[t,d] = (code*a_t + b_t) * s_chan_d (+ mu_d) */
        const int bits = L->value_bits;
        const size_t row_bytes = kvarn_packed_bytes((size_t)D, bits);
        kvarn__fp16_load(rec + L->v_a_off, G, a);
        kvarn__fp16_load(rec + L->v_b_off, G, b);
        kvarn__fp16_load(rec + L->v_schan_off, D, s);
        for (int t = 0; t < G; t++) {
            kvarn_unpack_codes(rec + L->v_codes_off + (size_t)t * row_bytes, (size_t)D, bits, codes[0]);
            float *out = v_out + (size_t)t * (size_t)D;
            for (int d = 0; d < D; d++) out[d] = ((float)codes[0][d] * a[t] + b[t]) * s[d];
        }
        if (L->v_mu_bytes) { /* centred: + mu_d (record.h) */
            kvarn__fp16_load(rec + L->v_mu_off, D, s);
            for (int t = 0; t < G; t++)
                for (int d = 0; d < D; d++) v_out[(size_t)t * (size_t)D + (size_t)d] += s[d];
        }
        if (!(flags & KVARN_DECODE_ROTATED)) kvarn_hadamard_rows(v_out, G, D);
    }
    return KVARN_OK;
}
