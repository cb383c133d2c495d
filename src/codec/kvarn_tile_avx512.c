/*
 * kvarn_tile_avx512.c -- the AVX-512 encoder kernels of the KVarN tile codec
 * (../shared/spec/KVARN.md "Store pipeline" steps 2-3), compiled with
 * AVX-512 (F/BW/VL) and FMA by the build. kvarn_tile.c calls them only when
 * kvarn__cpu_level() >= KVARN_CPU_AVX512 (codec/cpu.h).
 *
 * Same bytes as the scalar oracle (the _base copy of kvarn_tile_stats.h):
 * every value that reaches a record is produced by the same IEEE fp32
 * operations on the same operands in the same order. What differs is only
 * which element goes to which lane, which instruction performs an
 * operation, and how often a rounded intermediate is recomputed:
 *
 * - Statistics run on 16 independent lanes with no horizontal sums: column
 *   stds of X [R][C] take 16 columns per vector (each column's sums still
 *   run over i = 0..R-1 in order), row stds take 16 rows per vector from
 *   the transposed matrix XT [C][R], where the 8 partial sums of each row
 *   (lane l of the scalar code takes j = l, l + 8, ...) are 8 accumulator
 *   vectors, added at the end in the scalar code's pairwise order.
 * - The shifted product d = x * scale - shift of the mean pass is kept in a
 *   scratch block and read back by the deviation pass instead of being
 *   recomputed (the same rounded value; two fewer operations per element).
 * - Some additions run as fma(a, 1, b): a * 1 is exact, so the FMA returns
 *   the rounded a + b, bit for bit; it runs on the multiply pipes, which
 *   the statistics leave half idle (on Zen 4 additions have two pipes of
 *   their own and multiplications two others). `one` is hidden from the
 *   compiler so that it cannot turn the FMA back into an addition.
 * - RTN codes: the quotient (y - lo) / scale is first formed as
 *   (y - lo) * (1 / scale); where that is provably on the same side of
 *   every rounding boundary as the true quotient (bound below), its
 *   rounding is the code; elsewhere the division is done.
 */
#if defined(__x86_64__) || defined(__i386__)
#define KVARN_TILE_STATS_SUFFIX _avx512
#define KVARN_TILE_STATS_EXPORT
#include "codec/kvarn_tile_stats.h"

#include <immintrin.h>
#include <stdint.h>

#include "codec/hadamard.h"

/* 1.0f that the compiler cannot see through (see the header comment). */
static inline __m512 opaque_one(void)
{
    __m512 one = _mm512_set1_ps(1.0f);
    __asm__("" : "+v"(one));
    return one;
}

/* a + b, rounded once, on a multiply pipe: fma(a, 1, b) (a * 1 is exact). */
static inline __m512 add_f(__m512 a, __m512 b, __m512 one) { return _mm512_fmadd_ps(a, one, b); }
/* a - b, rounded once, on a multiply pipe. */
static inline __m512 sub_f(__m512 a, __m512 b, __m512 one) { return _mm512_fmsub_ps(a, one, b); }

/* ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)), lane-wise: the scalar
 * code's sum8 of a row's 8 partial sums. */
static inline __m512 sum8_v(const __m512 *p)
{
    return _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3])),
                         _mm512_add_ps(_mm512_add_ps(p[4], p[5]), _mm512_add_ps(p[6], p[7])));
}

/* Column stds of y = x[i][j] * w[i] of one panel (32 columns, [R][32]
 * contiguous): out[l] = std_i(y[i][l]). dc: scratch [R][32]. Two column
 * vectors side by side; the additions of the second run on the multiply
 * pipes, so that the mean pass issues 3 operations to each pair of pipes. */
static void col_panel(const float *x, int R, const float *w, float *dc, float *out)
{
    const __m512 one = opaque_one();
    const __m512 inv_n = _mm512_set1_ps(1.0f / (float)R), n1 = _mm512_set1_ps((float)(R - 1));
    const __m512 w0 = _mm512_set1_ps(w[0]);
    const __m512 sh0 = _mm512_mul_ps(_mm512_loadu_ps(x), w0);
    const __m512 sh1 = _mm512_mul_ps(_mm512_loadu_ps(x + 16), w0);
    __m512 m0 = _mm512_setzero_ps(), m1 = m0, q0 = m0, q1 = m0;
    for (int i = 0; i < R; i++) {
        const float *xr = x + (size_t)i * KVARN_TILE512_PW;
        float *dr = dc + (size_t)i * KVARN_TILE512_PW;
        const __m512 wi = _mm512_set1_ps(w[i]);
        const __m512 d0 = _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(xr), wi), sh0);
        const __m512 d1 = sub_f(_mm512_mul_ps(_mm512_loadu_ps(xr + 16), wi), sh1, one);
        _mm512_storeu_ps(dr, d0);
        _mm512_storeu_ps(dr + 16, d1);
        m0 = _mm512_add_ps(m0, d0);
        m1 = _mm512_add_ps(m1, d1);
    }
    m0 = _mm512_mul_ps(m0, inv_n);
    m1 = _mm512_mul_ps(m1, inv_n);
    for (int i = 0; i < R; i++) {
        const float *dr = dc + (size_t)i * KVARN_TILE512_PW;
        const __m512 e0 = _mm512_sub_ps(_mm512_loadu_ps(dr), m0);
        const __m512 e1 = sub_f(_mm512_loadu_ps(dr + 16), m1, one);
        q0 = _mm512_add_ps(q0, _mm512_mul_ps(e0, e0));
        q1 = _mm512_add_ps(q1, _mm512_mul_ps(e1, e1));
    }
    _mm512_storeu_ps(out, _mm512_sqrt_ps(_mm512_div_ps(q0, n1)));
    _mm512_storeu_ps(out + 16, _mm512_sqrt_ps(_mm512_div_ps(q1, n1)));
}

void kvarn__tile512_col_stds(const float *xp, int R, int C, const float *w, float *dc, float *out)
{
    for (int p = 0; p < C / KVARN_TILE512_PW; p++)
        col_panel(xp + (size_t)p * (size_t)R * KVARN_TILE512_PW, R, w, dc, out + p * KVARN_TILE512_PW);
}

void kvarn__tile512_row_stds_t(const float *xtp, int R, int C, const float *u, float *dc, float *out)
{
    const __m512 one = opaque_one();
    const __m512 inv_n = _mm512_set1_ps(1.0f / (float)C), n1 = _mm512_set1_ps((float)(C - 1));
    for (int i0 = 0; i0 < R; i0 += 16) {
        const float *xc = xtp + (size_t)i0 * (size_t)C; /* panel [C][16] */
        const __m512 p = _mm512_mul_ps(_mm512_loadu_ps(xc), _mm512_set1_ps(u[0]));
        __m512 a[8], q[8];
        for (int l = 0; l < 8; l++) a[l] = q[l] = _mm512_setzero_ps();
        for (int j0 = 0; j0 < C; j0 += 8)
            for (int l = 0; l < 8; l++) {
                const int j = j0 + l;
                const __m512 xu = _mm512_mul_ps(_mm512_loadu_ps(xc + (size_t)j * 16), _mm512_set1_ps(u[j]));
                const __m512 d = (l & 1) ? sub_f(xu, p, one) : _mm512_sub_ps(xu, p);
                _mm512_storeu_ps(dc + (size_t)j * 16, d);
                a[l] = _mm512_add_ps(a[l], d);
            }
        const __m512 mean = _mm512_mul_ps(sum8_v(a), inv_n);
        for (int j0 = 0; j0 < C; j0 += 8)
            for (int l = 0; l < 8; l++) {
                const __m512 d = _mm512_loadu_ps(dc + (size_t)(j0 + l) * 16);
                const __m512 e = (l & 1) ? sub_f(d, mean, one) : _mm512_sub_ps(d, mean);
                q[l] = _mm512_add_ps(q[l], _mm512_mul_ps(e, e));
            }
        _mm512_storeu_ps(out + i0, _mm512_sqrt_ps(_mm512_div_ps(sum8_v(q), n1)));
    }
}

/* RTN of one row (the scalar rtn_row of kvarn_tile_stats.h, same results).
 *
 * Codes without the division where it cannot matter. With t = y - lo
 * (rounded, as in the scalar code), Q = t / scale exactly, q = RN(Q) the
 * scalar code's quotient and qa = RN(t * RN(1 / scale)):
 * qa = Q (1 + e1)(1 + e2), q = Q (1 + e3), |e_k| <= u = 2^-24, so
 * |qa - q| <= 3.0001 u Q <= 3.0001 * 2^-24 * 256 < 2^-14 (Q <= qmax (1 + u)^2
 * <= 256, since t <= RN(hi - lo) and scale >= RN((hi - lo) / qmax)).
 * If |qa - n| < 1/2 - 2^-12 for n = RNE(qa), then |q - n| < 1/2 and
 * RNE(q) = n: the code is the same. Lanes nearer a half-way point (about
 * 1 in 2000) make their vector take the division. Subnormal t changes the
 * bound only by a few 2^-149. */
void kvarn__tile512_rtn_row(const float *xp, int R, int i, int C, const float *s_col, float sr,
                            float qmax, float scale_min, float *y, unsigned char *codes,
                            float *lo_out, float *scale_out)
{
    const __m512 vsr = _mm512_set1_ps(sr);
    __m512 lov = _mm512_set1_ps(__builtin_inff()), hiv = _mm512_set1_ps(-__builtin_inff());
    for (int j = 0; j < C; j += 16) {
        const float *xj = xp + (size_t)(j / KVARN_TILE512_PW) * (size_t)R * KVARN_TILE512_PW +
                          (size_t)i * KVARN_TILE512_PW + (size_t)(j % KVARN_TILE512_PW);
        const __m512 yv = _mm512_div_ps(_mm512_div_ps(_mm512_loadu_ps(xj), _mm512_loadu_ps(s_col + j)), vsr);
        _mm512_storeu_ps(y + j, yv);
        lov = _mm512_min_ps(lov, yv);
        hiv = _mm512_max_ps(hiv, yv);
    }
    /* The extremes as values are unique except for the sign of a zero,
     * which the scalar code takes from the first zero in j order. */
    float lo = _mm512_reduce_min_ps(lov), hi = _mm512_reduce_max_ps(hiv);
    if (lo == 0.0f)
        for (int j = 0; j < C; j++)
            if (y[j] == 0.0f) { lo = y[j]; break; }
    if (hi == 0.0f)
        for (int j = 0; j < C; j++)
            if (y[j] == 0.0f) { hi = y[j]; break; }
    float scale = (hi - lo) / qmax;
    if (!(scale >= scale_min)) scale = scale_min;
    const __m512 vlo = _mm512_set1_ps(lo), vscale = _mm512_set1_ps(scale);
    const __m512 vrcp = _mm512_set1_ps(1.0f / scale), vq = _mm512_set1_ps(qmax);
    const __m512 near_half = _mm512_set1_ps(0.5f - 0x1p-12f);
    for (int j = 0; j < C; j += 16) {
        const __m512 t = _mm512_sub_ps(_mm512_loadu_ps(y + j), vlo);
        __m512 q = _mm512_mul_ps(t, vrcp);
        __m512 n = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 dist = _mm512_abs_ps(_mm512_sub_ps(q, n));
        if (_mm512_cmp_ps_mask(dist, near_half, _CMP_GE_OQ) != 0) {
            q = _mm512_div_ps(t, vscale);
            n = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        }
        n = _mm512_min_ps(n, vq);
        _mm_storeu_si128((__m128i *)(void *)(codes + j), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(n)));
    }
    *lo_out = lo;
    *scale_out = scale;
}

/* ---------------------------------------------------------------------- */
/* Loading a tile: rotation (spec step 1), range checks, the two layouts   */
/* ---------------------------------------------------------------------- */

/* dst row r (16 floats at dst + r * ds) = column r of the 16 x 16 block
 * whose row k is the 16 floats at src + k * ss. */
static inline void transpose16(const float *src, size_t ss, float *dst, size_t ds)
{
    __m512 r[16], t[16], u[16];
    _Pragma("GCC unroll 32")
    for (int k = 0; k < 16; k++) r[k] = _mm512_loadu_ps(src + (size_t)k * ss);
    _Pragma("GCC unroll 32")
    for (int k = 0; k < 8; k++) {
        t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
    }
    /* u[4i + k], 128-bit lane L: rows 4i..4i+3 of column 4L + k */
    _Pragma("GCC unroll 32")
    for (int i = 0; i < 4; i++) {
        u[4 * i + 0] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    _Pragma("GCC unroll 32")
    for (int k = 0; k < 4; k++) {
        const __m512 v0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88);
        const __m512 v1 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);
        const __m512 w0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD);
        const __m512 w1 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
        _mm512_storeu_ps(dst + (size_t)k * ds, _mm512_shuffle_f32x4(v0, v1, 0x88));
        _mm512_storeu_ps(dst + (size_t)(8 + k) * ds, _mm512_shuffle_f32x4(v0, v1, 0xDD));
        _mm512_storeu_ps(dst + (size_t)(4 + k) * ds, _mm512_shuffle_f32x4(w0, w1, 0x88));
        _mm512_storeu_ps(dst + (size_t)(12 + k) * ds, _mm512_shuffle_f32x4(w0, w1, 0xDD));
    }
}

/* One butterfly stage h < 16 inside a vector: `part` holds x[j ^ h] in lane
 * j; lanes of `upper` (bit h of j set) take x[j-h] - x[j], the others
 * x[j] + x[j+h]: the scalar a + b and a - b. */
static inline __m512 hstage(__m512 v, __m512 part, __mmask16 upper)
{
    return _mm512_mask_sub_ps(_mm512_add_ps(v, part), upper, part, v);
}

/* Normalized Walsh-Hadamard of one vector of 16 NZ floats held in v[],
 * in the scalar kvarn_hadamard_scalar's order (stages h = 1, 2, 4, ...,
 * then one multiply by the scale), hence the same bits. */
static inline __attribute__((always_inline)) void fwht_regs(__m512 *v, int NZ, __m512 scale)
{
    _Pragma("GCC unroll 32")
    for (int c = 0; c < NZ; c++) {
        __m512 t = v[c];
        t = hstage(t, _mm512_permute_ps(t, 0xB1), 0xAAAA);         /* h = 1 */
        t = hstage(t, _mm512_permute_ps(t, 0x4E), 0xCCCC);         /* h = 2 */
        t = hstage(t, _mm512_shuffle_f32x4(t, t, 0xB1), 0xF0F0);   /* h = 4 */
        t = hstage(t, _mm512_shuffle_f32x4(t, t, 0x4E), 0xFF00);   /* h = 8 */
        v[c] = t;
    }
    _Pragma("GCC unroll 32")
    for (int h = 1; h < NZ; h <<= 1) /* h = 16 h' */
        _Pragma("GCC unroll 32")
        for (int i = 0; i < NZ; i += 2 * h)
            _Pragma("GCC unroll 32")
            for (int j = i; j < i + h; j++) {
                const __m512 a = v[j], b = v[j + h];
                v[j] = _mm512_add_ps(a, b);
                v[j + h] = _mm512_sub_ps(a, b);
            }
    _Pragma("GCC unroll 32")
    for (int c = 0; c < NZ; c++) v[c] = _mm512_mul_ps(v[c], scale);
}

/* Rotate (unless prerotated) and check every token row of src [G][D], and
 * store it in the layout that keeps a token's channels together: for keys
 * the row panels of XT, for values the column panels of X. Returns 0, or
 * -1 as soon as a row holds a raw |x| > raw_max or a rotated |x| > rot_max
 * (NaN included). */
static inline __attribute__((always_inline)) int
load_rows(const float *src, int G, int D, int prerotated, int is_key, float raw_max,
          float rot_max, float *xp, float *xtp, int NZ)
{
    const __m512 scale = _mm512_set1_ps(kvarn_hadamard_scale(D));
    const __m512 vraw = _mm512_set1_ps(raw_max), vrot = _mm512_set1_ps(rot_max);
    const size_t g = (size_t)G;
    for (size_t t = 0; t < g; t++) {
        __m512 v[32];
        __mmask16 ok = 0xFFFF;
        _Pragma("GCC unroll 32")
        for (int c = 0; c < NZ; c++) v[c] = _mm512_loadu_ps(src + t * (size_t)D + 16 * (size_t)c);
        if (!prerotated) {
            _Pragma("GCC unroll 32")
            for (int c = 0; c < NZ; c++) ok &= _mm512_cmp_ps_mask(_mm512_abs_ps(v[c]), vraw, _CMP_LE_OQ);
            if (ok != 0xFFFF) return -1;
            fwht_regs(v, NZ, scale);
        }
        _Pragma("GCC unroll 32")
        for (int c = 0; c < NZ; c++) ok &= _mm512_cmp_ps_mask(_mm512_abs_ps(v[c]), vrot, _CMP_LE_OQ);
        if (ok != 0xFFFF) return -1;
        _Pragma("GCC unroll 32")
        for (int c = 0; c < NZ; c++) {
            float *dst = is_key ? xtp + (size_t)c * g * 16 + t * 16
                                : xp + (size_t)(c / 2) * g * KVARN_TILE512_PW + t * KVARN_TILE512_PW +
                                      (size_t)(c % 2) * 16;
            _mm512_storeu_ps(dst, v[c]);
        }
    }
    return 0;
}

int kvarn__tile512_load(const float *src, int G, int D, int prerotated, int is_key, float raw_max,
                        float rot_max, float *xp, float *xtp)
{
    int rc;
    switch (D) {
    case 64: rc = load_rows(src, G, D, prerotated, is_key, raw_max, rot_max, xp, xtp, 4); break;
    case 128: rc = load_rows(src, G, D, prerotated, is_key, raw_max, rot_max, xp, xtp, 8); break;
    case 256: rc = load_rows(src, G, D, prerotated, is_key, raw_max, rot_max, xp, xtp, 16); break;
    default: rc = load_rows(src, G, D, prerotated, is_key, raw_max, rot_max, xp, xtp, 32); break;
    }
    if (rc != 0) return rc;
    const size_t g = (size_t)G, d = (size_t)D;
    if (is_key) { /* X = K [D][G]: column panels = 32 tokens; from XT's row panels */
        for (size_t b = 0; b < g / 16; b++)
            for (size_t c = 0; c < d / 16; c++)
                transpose16(xtp + c * g * 16 + b * 256, 16,
                            xp + (b / 2) * d * KVARN_TILE512_PW + 16 * c * KVARN_TILE512_PW + (b % 2) * 16,
                            KVARN_TILE512_PW);
    } else { /* XT = V^T [D][G]: row panels = 16 tokens; from X's column panels */
        for (size_t b = 0; b < g / 16; b++)
            for (size_t c = 0; c < d / 16; c++)
                transpose16(xp + (c / 2) * g * KVARN_TILE512_PW + 16 * b * KVARN_TILE512_PW + (c % 2) * 16,
                            KVARN_TILE512_PW, xtp + 16 * b * d + 16 * c * 16, 16);
    }
    return 0;
}
#else
typedef int kvarn_tile_avx512_unused; /* keep the translation unit non-empty */
#endif
