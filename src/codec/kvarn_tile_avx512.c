/*
 * kvarn_tile_avx512.c -- the AVX-512 encoder kernels of the KVarN tile codec
 * (../shared/spec/KVARN.md "Store pipeline" steps 1-5), compiled with
 * AVX-512 (F/BW/VL) and FMA by the build. kvarn_tile.c calls them only when
 * kvarn__cpu_level() >= KVARN_CPU_AVX512 (common/cpu.h), D is a power of two
 * in 64..512 and G a multiple of 32; the layouts they share are described
 * in kvarn_tile_stats.h.
 *
 * Same bytes as the scalar oracle (the _base copy of kvarn_tile_stats.h,
 * kvarn_hadamard_scalar, kvarn_pack_codes, kvarn_fp32_to_fp16): every value
 * that reaches a record is produced by the same IEEE fp32 operations on the
 * same operands in the same order. What differs is only which element goes
 * to which lane, which instruction performs an operation, and how often a
 * rounded intermediate is recomputed:
 *
 * - Loading: each token row is rotated in registers (stages h = 1..8
 *   inside a vector, then between vectors, then the scale), checked
 *   against the range bounds and stored into one panel layout; 16 x 16
 *   transposes give the other.
 * - Statistics run on 16 independent lanes with no horizontal sums: column
 *   stds take 16 columns of X per vector from its column panels (each
 *   column's sums still run over i = 0..R-1 in order), row stds 16 rows of
 *   X per vector from its row panels, where the 8 partial sums of each row
 *   (partial l of the scalar code takes j = l, l + 8, ...) are 8
 *   accumulator vectors, added at the end in the scalar code's pairwise
 *   order (stats_panels below).
 * - Some subtractions run as fma(a, 1, -b): a * 1 is exact, so the FMA
 *   returns the rounded a - b, bit for bit, on the multiply pipes (on
 *   Zen 4 additions have two pipes of their own and multiplications two
 *   others). `one` is hidden from the compiler so that it cannot turn the
 *   FMA back into a subtraction.
 * - RTN: all rows of a matrix in three phases; the code quotient
 *   (y - lo) / scale is first formed as (y - lo) * (1 / scale), and where
 *   that is provably on the same side of every rounding boundary as the
 *   true quotient (bound at rtn_codes) its rounding is the code; elsewhere
 *   the division is done.
 */
#if defined(__x86_64__) || defined(__i386__)
#define KVARN_TILE_STATS_DECLS_ONLY
#include "codec/kvarn_tile_stats.h"

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "codec/hadamard.h"

/* 1.0f that the compiler cannot see through (see the header comment). */
static inline __m512 opaque_one(void)
{
    __m512 one = _mm512_set1_ps(1.0f);
    __asm__("" : "+v"(one));
    return one;
}

/* Floats from one panel of N rows to the next (kvarn_tile_stats.h):
 * 16 N and 16 floats (one cache line) more, so that the same row of
 * successive panels falls in successive L1 sets instead of one (panels of
 * 16 N floats are a multiple of 4 KB apart for N >= 64: the 8 or more
 * streams of a token row, written while loading or read by the RTN, then
 * compete for the 8 ways of one set; measured on Zen 4: the load's stores
 * 6.7 -> 4.2 cycles per vector). */
static inline size_t pstride(int N) { return (size_t)N * 16 + 16; }

/* a * (*p) with *p broadcast from memory inside the multiply (the {1to16}
 * operand): one load and no shuffle for the scale of a panel row. GCC
 * folds the vector load instead and issues a separate broadcast, which
 * measured 15-25% slower in the statistics loop on Zen 4. */
static inline __m512 mul_bcast(__m512 a, const float *p)
{
    __m512 r;
    __asm__("vmulps %2%{1to16%}, %1, %0" : "=v"(r) : "v"(a), "m"(*p));
    return r;
}

/* a - b, rounded once, on a multiply pipe: fma(a, 1, -b) (a * 1 is exact). */
static inline __m512 sub_f(__m512 a, __m512 b, __m512 one) { return _mm512_fmsub_ps(a, one, b); }

/* ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)), lane-wise: the scalar
 * code's sum8 of a row's 8 partial sums. */
static inline __m512 sum8_v(const __m512 *p)
{
    return _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3])),
                         _mm512_add_ps(_mm512_add_ps(p[4], p[5]), _mm512_add_ps(p[6], p[7])));
}

/* The statistics of one panel layout. A panel is [N][16] floats (row n of
 * the panel at p + 16 n): for the column stds of X, 16 columns of X over
 * its N = R rows (scale s = w, one per row of X); for the row stds, 16
 * rows of X over its N = C columns, i.e. a panel of XT (s = u, one per
 * column of X). Lane l of panel k gets
 *   out[16 k + l] = std_n(p[n][l] * s[n]),
 * two passes on values shifted by p[0][l] * s[0], with the sums of the
 * scalar code: column sums (nacc = 1) run over n in order; row sums
 * (nacc = 8) have 8 partial sums (n = a, a + 8, ... go to partial a)
 * added pairwise at the end.
 *
 * The shifted products d = p[n][l] * s[n] - shift of the mean pass are
 * kept in dc and read back by the deviation pass. The deviation pass of
 * panel k - 1 runs in the same loop as the mean pass of panel k: the mean
 * pass stores one vector per row (a store every two cycles on Zen 4) and
 * the deviation pass stores nothing, so together they keep the pipes
 * busier than one after the other. dc: [2][N][16] floats. With
 * recompute (used for N > 128, where two 16 N-float blocks of dc and the
 * streaming panels no longer fit in a 32 KB L1 together) nothing is kept:
 * the deviation pass forms d again (the same operations, so the same
 * value) from the previous panel, still in L1. */
static inline __attribute__((always_inline)) void
stats_panels(const float *xp, int N, int NP, const float *s, float *dc, float *out, int nacc,
             int recompute)
{
    const __m512 one = opaque_one();
    const __m512 inv_n = _mm512_set1_ps(1.0f / (float)N), n1 = _mm512_set1_ps((float)(N - 1));
    const size_t n16 = (size_t)N * 16, ps = pstride(N);
    __m512 mean_prev = _mm512_setzero_ps();
    for (int k = 0; k <= NP; k++) {
        const int do_mean = k < NP, do_dev = k > 0;
        const float *x = xp + (size_t)(do_mean ? k : 0) * ps;
        float *dcur = dc + (size_t)(k & 1) * n16;
        const float *dprev = dc + (size_t)((k + 1) & 1) * n16;
        const __m512 sh = _mm512_mul_ps(_mm512_loadu_ps(x), _mm512_set1_ps(s[0]));
        __m512 a[8], q[8];
        for (int l = 0; l < 8; l++) a[l] = q[l] = _mm512_setzero_ps();
        if (do_mean && do_dev && recompute) {
            const float *xprev = xp + (size_t)(k - 1) * ps;
            const __m512 shp = _mm512_mul_ps(_mm512_loadu_ps(xprev), _mm512_set1_ps(s[0]));
            for (int n0 = 0; n0 < N; n0 += 8)
                _Pragma("GCC unroll 8")
                for (int l = 0; l < 8; l++) {
                    const size_t n = (size_t)(n0 + l);
                    const int acc = nacc == 8 ? l : 0;
                    const __m512 d = _mm512_sub_ps(mul_bcast(_mm512_loadu_ps(x + 16 * n), s + n), sh);
                    a[acc] = _mm512_add_ps(a[acc], d);
                    const __m512 dp = sub_f(mul_bcast(_mm512_loadu_ps(xprev + 16 * n), s + n), shp, one);
                    const __m512 e = (l & 1) ? sub_f(dp, mean_prev, one) : _mm512_sub_ps(dp, mean_prev);
                    q[acc] = _mm512_add_ps(q[acc], _mm512_mul_ps(e, e));
                }
        } else if (do_mean && do_dev) {
            for (int n0 = 0; n0 < N; n0 += 8)
                _Pragma("GCC unroll 8")
                for (int l = 0; l < 8; l++) {
                    const size_t n = (size_t)(n0 + l);
                    const int acc = nacc == 8 ? l : 0;
                    const __m512 d = _mm512_sub_ps(
                        mul_bcast(_mm512_loadu_ps(x + 16 * n), s + n), sh);
                    _mm512_storeu_ps(dcur + 16 * n, d);
                    a[acc] = _mm512_add_ps(a[acc], d);
                    const __m512 e = sub_f(_mm512_loadu_ps(dprev + 16 * n), mean_prev, one);
                    q[acc] = _mm512_add_ps(q[acc], _mm512_mul_ps(e, e));
                }
        } else if (do_mean) {
            for (int n0 = 0; n0 < N; n0 += 8)
                _Pragma("GCC unroll 8")
                for (int l = 0; l < 8; l++) {
                    const size_t n = (size_t)(n0 + l);
                    const int acc = nacc == 8 ? l : 0;
                    const __m512 xs = mul_bcast(_mm512_loadu_ps(x + 16 * n), s + n);
                    const __m512 d = (l & 1) ? sub_f(xs, sh, one) : _mm512_sub_ps(xs, sh);
                    if (!recompute) _mm512_storeu_ps(dcur + 16 * n, d);
                    a[acc] = _mm512_add_ps(a[acc], d);
                }
        } else {
            for (int n0 = 0; n0 < N; n0 += 8)
                _Pragma("GCC unroll 8")
                for (int l = 0; l < 8; l++) {
                    const size_t n = (size_t)(n0 + l);
                    const int acc = nacc == 8 ? l : 0;
                    const __m512 dv =
                        recompute ? _mm512_sub_ps(mul_bcast(_mm512_loadu_ps(xp + (size_t)(k - 1) * ps + 16 * n),
                                                            s + n),
                                                  _mm512_mul_ps(_mm512_loadu_ps(xp + (size_t)(k - 1) * ps),
                                                                _mm512_set1_ps(s[0])))
                                  : _mm512_loadu_ps(dprev + 16 * n);
                    const __m512 e = (l & 1) ? sub_f(dv, mean_prev, one) : _mm512_sub_ps(dv, mean_prev);
                    q[acc] = _mm512_add_ps(q[acc], _mm512_mul_ps(e, e));
                }
        }
        if (do_dev) {
            const __m512 qs = nacc == 8 ? sum8_v(q) : q[0];
            _mm512_storeu_ps(out + 16 * (k - 1), _mm512_sqrt_ps(_mm512_div_ps(qs, n1)));
        }
        if (do_mean) mean_prev = _mm512_mul_ps(nacc == 8 ? sum8_v(a) : a[0], inv_n);
    }
}

void kvarn__tile512_col_stds(const float *xp, int R, int C, const float *w, float *dc, float *out)
{
    if (R <= 128) stats_panels(xp, R, C / 16, w, dc, out, 1, 0);
    else stats_panels(xp, R, C / 16, w, dc, out, 1, 1);
}

void kvarn__tile512_row_stds_t(const float *xtp, int R, int C, const float *u, float *dc, float *out)
{
    if (C <= 128) stats_panels(xtp, C, R / 16, u, dc, out, 8, 0);
    else stats_panels(xtp, C, R / 16, u, dc, out, 8, 1);
}

/* One scale update of the balance loop (kvarn_tile.c balance()), 16 lanes:
 * sd = pre ? pre[j] * sd_in[j] : sd_in[j];
 * s[j] = clamp(s[j] * clamp(sd, lim[0], lim[1]), lim[2], lim[3]);
 * inv[j] = 1 / s[j]; if sd_out: sd_out[j] = inv[j] * sd_in[j].
 * clamp(v, lo, hi) = v < lo ? lo : (v > hi ? hi : v) is min(max(v, lo), hi)
 * for the non-NaN stds and scales here (an equal bound gives the same
 * value). inv may be pre (each element is read before it is written). */
void kvarn__tile512_rescale(float *s, float *inv, float *sd_out, const float *sd_in,
                            const float *pre, int n, const float lim[4])
{
    const __m512 l0 = _mm512_set1_ps(lim[0]), l1 = _mm512_set1_ps(lim[1]);
    const __m512 l2 = _mm512_set1_ps(lim[2]), l3 = _mm512_set1_ps(lim[3]);
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int j = 0; j < n; j += 16) {
        const __m512 sdi = _mm512_loadu_ps(sd_in + j);
        const __m512 sd = pre ? _mm512_mul_ps(_mm512_loadu_ps(pre + j), sdi) : sdi;
        const __m512 f = _mm512_min_ps(_mm512_max_ps(sd, l0), l1);
        const __m512 sv = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(s + j), f), l2), l3);
        const __m512 iv = _mm512_div_ps(one, sv);
        _mm512_storeu_ps(s + j, sv);
        _mm512_storeu_ps(inv + j, iv);
        if (sd_out) _mm512_storeu_ps(sd_out + j, _mm512_mul_ps(iv, sdi));
    }
}

/* sd[j] *= u[j], then max/min of sd (the min floored at lo_floor), as
 * kvarn_tile.c's std_ratio: the extremes of non-NaN values do not depend
 * on the order of the comparisons. u may be NULL (no product). */
double kvarn__tile512_std_ratio(float *sd, const float *u, int n, float lo_floor)
{
    __m512 mx = _mm512_set1_ps(-__builtin_inff()), mn = _mm512_set1_ps(__builtin_inff());
    for (int j = 0; j < n; j += 16) {
        __m512 v = _mm512_loadu_ps(sd + j);
        if (u) {
            v = _mm512_mul_ps(v, _mm512_loadu_ps(u + j));
            _mm512_storeu_ps(sd + j, v);
        }
        mx = _mm512_max_ps(mx, v);
        mn = _mm512_min_ps(mn, v);
    }
    float hi = _mm512_reduce_max_ps(mx), lo = _mm512_reduce_min_ps(mn);
    if (lo < lo_floor) lo = lo_floor;
    return (double)hi / (double)lo;
}

/* dst (fp16, n values, host byte order) = src rounded to nearest even by
 * VCVTPS2PH: bit for bit kvarn_fp32_to_fp16 for every finite |x| <= 65504
 * (all 2.4e9 such floats compared once; the record's fields are checked
 * against that bound before they are stored). n: a multiple of 16. */
void kvarn__tile512_store_fp16(unsigned char *dst, const float *src, int n)
{
    for (int j = 0; j < n; j += 16)
        _mm256_storeu_si256((__m256i *)(void *)(dst + 2 * (size_t)j),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* Phase 1 of the RTN of row i: y = x / s_col / sr (the scalar code's two
 * divisions) into yr, and its extremes. The extremes as values are unique
 * except for the sign of a zero, which the scalar code takes from the
 * first zero in j order. */
static inline __attribute__((always_inline)) void
rtn_extremes(const float *xp, int R, int i, const float *s_col, float sr, float *yr, float *lo_out,
             float *hi_out, int NZ)
{
    const __m512 vsr = _mm512_set1_ps(sr);
    __m512 lov = _mm512_set1_ps(__builtin_inff()), hiv = _mm512_set1_ps(-__builtin_inff());
    _Pragma("GCC unroll 32")
    for (int c = 0; c < NZ; c++) {
        const float *xj = xp + (size_t)c * pstride(R) + (size_t)i * 16;
        const __m512 y = _mm512_div_ps(_mm512_div_ps(_mm512_loadu_ps(xj), _mm512_loadu_ps(s_col + 16 * c)), vsr);
        _mm512_storeu_ps(yr + 16 * c, y);
        lov = _mm512_min_ps(lov, y);
        hiv = _mm512_max_ps(hiv, y);
    }
    float lo = _mm512_reduce_min_ps(lov), hi = _mm512_reduce_max_ps(hiv);
    if (lo == 0.0f || hi == 0.0f) {
        const __m512 zero = _mm512_setzero_ps();
        for (int c = 0; c < NZ; c++) {
            const __mmask16 z = _mm512_cmp_ps_mask(_mm512_loadu_ps(yr + 16 * c), zero, _CMP_EQ_OQ);
            if (z) {
                const float first = yr[16 * c + __builtin_ctz(z)];
                if (lo == 0.0f) lo = first;
                if (hi == 0.0f) hi = first;
                break;
            }
        }
    }
    *lo_out = lo;
    *hi_out = hi;
}

/* kvarn_pack_codes (src/codec/pack.h: code i in byte i / (8 / bits), bits
 * (i mod (8 / bits)) * bits up, low bits first) of 16 codes (each < 2^bits,
 * in the int32 lanes of n;
 * bits 2, 4 or 8) into the 2 bits bytes at out, straight from the
 * register: 8 bits, one byte per lane; 4 bits, each 64-bit lane holds
 * codes 2k (low half) and 2k + 1 (high half), and (lane | lane >> 28)
 * has c[2k] | c[2k+1] << 4 in its low byte; 2 bits, as
 * bytes shifted onto the low byte of each 32-bit lane. */
static inline __attribute__((always_inline)) void pack16(__m512i n, int bits, unsigned char *out)
{
    if (bits == 8) {
        _mm_storeu_si128((__m128i *)(void *)out, _mm512_cvtepi32_epi8(n));
    } else if (bits == 4) {
        _mm_storel_epi64((__m128i *)(void *)out,
                         _mm512_cvtepi64_epi8(_mm512_or_si512(n, _mm512_srli_epi64(n, 28))));
    } else { /* lane k: c[4k] | c[4k+1] << 8 | c[4k+2] << 16 | c[4k+3] << 24 */
        const __m128i c = _mm512_cvtepi32_epi8(n);
        __m128i t = _mm_or_si128(c, _mm_srli_epi32(c, 6));
        t = _mm_and_si128(_mm_or_si128(t, _mm_srli_epi32(t, 12)), _mm_set1_epi32(0xFF));
        const int packed = _mm_cvtsi128_si32(_mm_cvtepi32_epi8(t));
        memcpy(out, &packed, 4);
    }
}

/* Phase 3: codes of one row from yr, lo, scale and rcp = 1 / scale.
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
 * bound only by a few 2^-149. RNE(q) by VRNDSCALEPS equals the scalar
 * code's (q + 1.5 * 2^23) - 1.5 * 2^23 for 0 <= q < 2^22. */
static inline __attribute__((always_inline)) void
rtn_codes(const float *yr, float lo, float scale, float rcp, float qmax, int bits, unsigned char *out, int NZ)
{
    const __m512 vlo = _mm512_set1_ps(lo), vscale = _mm512_set1_ps(scale);
    const __m512 vrcp = _mm512_set1_ps(rcp), vq = _mm512_set1_ps(qmax);
    const __m512 near_half = _mm512_set1_ps(0.5f - 0x1p-12f);
    _Pragma("GCC unroll 32")
    for (int c = 0; c < NZ; c++) {
        const __m512 t = _mm512_sub_ps(_mm512_loadu_ps(yr + 16 * c), vlo);
        __m512 q = _mm512_mul_ps(t, vrcp);
        __m512 n = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 dist = _mm512_abs_ps(_mm512_sub_ps(q, n));
        if (__builtin_expect(_mm512_cmp_ps_mask(dist, near_half, _CMP_GE_OQ) != 0, 0)) {
            q = _mm512_div_ps(t, vscale);
            n = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        }
        n = _mm512_min_ps(n, vq);
        pack16(_mm512_cvttps_epi32(n), bits, out + (size_t)c * (size_t)(2 * bits));
    }
}

static inline __attribute__((always_inline)) void
rtn_rows(const float *xp, int R, int C, const float *s_col, const float *s_row, float qmax,
         float scale_min, int bits, float *ybuf, unsigned char *codes_out,
         size_t row_bytes, float *a, float *b, int NZ)
{
    float lo[512], hi[512], sc[512], rc[512];
    for (int i = 0; i < R; i++)
        rtn_extremes(xp, R, i, s_col, s_row[i], ybuf + (size_t)i * (size_t)C, lo + i, hi + i, NZ);
    /* scale = max((hi - lo) / qmax, floor) (the scalar code's test: a NaN
     * cannot occur, the extremes are finite), 1 / scale, and the fold
     * a = s_row * scale, b = s_row * lo, 16 rows at a time */
    const __m512 vq = _mm512_set1_ps(qmax), vmin = _mm512_set1_ps(scale_min), one = _mm512_set1_ps(1.0f);
    for (int i = 0; i < R; i += 16) {
        const __m512 l = _mm512_loadu_ps(lo + i), sr = _mm512_loadu_ps(s_row + i);
        __m512 v = _mm512_div_ps(_mm512_sub_ps(_mm512_loadu_ps(hi + i), l), vq);
        v = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, vmin, _CMP_GE_OQ), vmin, v);
        _mm512_storeu_ps(sc + i, v);
        _mm512_storeu_ps(rc + i, _mm512_div_ps(one, v));
        _mm512_storeu_ps(a + i, _mm512_mul_ps(sr, v));
        _mm512_storeu_ps(b + i, _mm512_mul_ps(sr, l));
    }
    for (int i = 0; i < R; i++) {
        rtn_codes(ybuf + (size_t)i * (size_t)C, lo[i], sc[i], rc[i], qmax, bits,
                  codes_out + (size_t)i * row_bytes, NZ);
    }
}

/* Spec steps 3-4 for every row of X (column panels xp, [R][C]): codes
 * packed into codes_out (row_bytes per row), fp32 a = s_row * scale and
 * b = s_row * lo per row; the same values as the scalar rtn_row and fold
 * of kvarn_tile.c. ybuf: scratch [R][C]. The rows go
 * in three phases (the balanced rows and their extremes; scale, 1 / scale
 * and the fold for 16 rows at a time; the codes) so that no row waits for
 * a scalar chain of its own. R, C <= 512. */
void kvarn__tile512_rtn(const float *xp, int R, int C, const float *s_col, const float *s_row,
                        float qmax, float scale_min, int bits, float *ybuf,
                        unsigned char *codes_out, size_t row_bytes, float *a, float *b)
{
    switch (C) {
    case 32: rtn_rows(xp, R, C, s_col, s_row, qmax, scale_min, bits, ybuf, codes_out, row_bytes, a, b, 2); break;
    case 64: rtn_rows(xp, R, C, s_col, s_row, qmax, scale_min, bits, ybuf, codes_out, row_bytes, a, b, 4); break;
    case 128: rtn_rows(xp, R, C, s_col, s_row, qmax, scale_min, bits, ybuf, codes_out, row_bytes, a, b, 8); break;
    case 256: rtn_rows(xp, R, C, s_col, s_row, qmax, scale_min, bits, ybuf, codes_out, row_bytes, a, b, 16); break;
    default: rtn_rows(xp, R, C, s_col, s_row, qmax, scale_min, bits, ybuf, codes_out, row_bytes, a, b, 32); break;
    }
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

/* One butterfly stage h < 16 inside a vector, as one FMA: `part` holds
 * x[j ^ h] in lane j and sgn is -1 in the lanes with bit h of j set (the
 * upper ones), +1 elsewhere; fma(v, sgn, part) = RN(part - x[j]) =
 * x[j-h] - x[j] in the upper lanes and RN(x[j] + part) = x[j] + x[j+h] in
 * the others: the scalar a - b and a + b rounded once, bit for bit (v * +-1
 * is exact, and an exact zero sum is +0 in both forms: the product
 * carries the sign of -v, as b's sign is flipped by the scalar a - b). */
static inline __m512 hstage(__m512 v, __m512 part, __m512 sgn) { return _mm512_fmadd_ps(v, sgn, part); }

/* The +-1 vector of hstage for stage h: -1 in lanes j with j & h. */
static inline __m512 hsign(int h)
{
    return _mm512_mask_blend_ps((__mmask16)(h == 1 ? 0xAAAA : h == 2 ? 0xCCCC : h == 4 ? 0xF0F0 : 0xFF00),
                                _mm512_set1_ps(1.0f), _mm512_set1_ps(-1.0f));
}

/* Normalized Walsh-Hadamard of one vector of 16 NZ floats held in v[],
 * in the scalar kvarn_hadamard_scalar's order (stages h = 1, 2, 4, ...,
 * then one multiply by the scale), hence the same bits. */
static inline __attribute__((always_inline)) void fwht_regs(__m512 *v, int NZ, __m512 scale)
{
    const __m512 s1 = hsign(1), s2 = hsign(2), s4 = hsign(4), s8 = hsign(8);
    _Pragma("GCC unroll 32")
    for (int c = 0; c < NZ; c++) {
        __m512 t = v[c];
        t = hstage(t, _mm512_permute_ps(t, 0xB1), s1);         /* h = 1 */
        t = hstage(t, _mm512_permute_ps(t, 0x4E), s2);         /* h = 2 */
        t = hstage(t, _mm512_shuffle_f32x4(t, t, 0xB1), s4);   /* h = 4 */
        t = hstage(t, _mm512_shuffle_f32x4(t, t, 0x4E), s8);   /* h = 8 */
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
 * -1 as soon as a row holds a rotated |x| > rot_max or a NaN / Inf.
 *
 * The check, |x| <= rot_max for every x of the row, is done on the bits:
 * for a float, (bits << 1) read as unsigned drops the sign and orders
 * magnitudes as the floats do, with Inf and NaN above every finite value;
 * so the row's largest (bits << 1) against rot_max's is the scalar test
 * !(fabsf(x) <= rot_max) of every element (2 integer operations per
 * vector, one compare per row).
 *
 * The scalar code also rejects a raw |x| > raw_max = 2^44 before the
 * rotation; here that test is left to the rotated one, which gives the
 * same status (KVARN_ERR_NONFINITE) for every such row: the rotation
 * H / sqrt(D) keeps the 2-norm, so a raw |x_k| > 2^44 rotates to a vector
 * whose largest |y| is at least 2^44 / sqrt(D) >= 2^39.5 for D <= 512, and
 * the fp32 butterflies (log2(D) <= 9 roundings per element, a 2-norm
 * error below 1e-5 relative) cannot take that down to 2^39; an overflow
 * on the way gives Inf or NaN, rejected too. Raw NaN / Inf stays NaN /
 * Inf through the butterflies (Inf - Inf is NaN). raw_max is unused. */
static inline __attribute__((always_inline)) int
load_rows(const float *src, int G, int D, int prerotated, int is_key, float rot_max, float *xp,
          float *xtp, int NZ)
{
    const __m512 scale = _mm512_set1_ps(kvarn_hadamard_scale(D));
    uint32_t rot_bits;
    memcpy(&rot_bits, &rot_max, sizeof rot_bits);
    const __m512i vrot2 = _mm512_set1_epi32((int)(rot_bits << 1));
    const size_t g = (size_t)G, d = (size_t)D;
    for (size_t t = 0; t < g; t++) {
        __m512 v[32];
        _Pragma("GCC unroll 32")
        for (int c = 0; c < NZ; c++) v[c] = _mm512_loadu_ps(src + t * (size_t)D + 16 * (size_t)c);
        if (!prerotated) fwht_regs(v, NZ, scale);
        __m512i m = _mm512_slli_epi32(_mm512_castps_si512(v[0]), 1);
        _Pragma("GCC unroll 32")
        for (int c = 1; c < NZ; c++) m = _mm512_max_epu32(m, _mm512_slli_epi32(_mm512_castps_si512(v[c]), 1));
        if (_mm512_cmp_epu32_mask(m, vrot2, _MM_CMPINT_NLE) != 0) return -1;
        _Pragma("GCC unroll 32")
        for (int c = 0; c < NZ; c++) {
            float *dst = (is_key ? xtp : xp) + (size_t)c * pstride(G) + t * 16;
            _mm512_storeu_ps(dst, v[c]);
        }
        if (t % 16 != 15) continue;
        /* The other layout of these 16 tokens (b), while their D x 16
         * floats are still in L1. */
        const size_t b = t / 16;
        if (is_key) { /* X = K [D][G]: column panels = 16 tokens; from XT's row panels */
            for (size_t c = 0; c < d / 16; c++)
                transpose16(xtp + c * pstride(G) + b * 256, 16, xp + b * pstride(D) + c * 256, 16);
        } else { /* XT = V^T [D][G]: row panels = 16 tokens; from X's column panels */
            for (size_t c = 0; c < d / 16; c++)
                transpose16(xp + c * pstride(G) + b * 256, 16, xtp + b * pstride(D) + c * 256, 16);
        }
    }
    return 0;
}

int kvarn__tile512_load(const float *src, int G, int D, int prerotated, int is_key, float raw_max,
                        float rot_max, float *xp, float *xtp)
{
    (void)raw_max; /* see load_rows */
    int rc;
    switch (D) {
    case 64: rc = load_rows(src, G, D, prerotated, is_key, rot_max, xp, xtp, 4); break;
    case 128: rc = load_rows(src, G, D, prerotated, is_key, rot_max, xp, xtp, 8); break;
    case 256: rc = load_rows(src, G, D, prerotated, is_key, rot_max, xp, xtp, 16); break;
    default: rc = load_rows(src, G, D, prerotated, is_key, rot_max, xp, xtp, 32); break;
    }
    return rc;
}
#else
typedef int kvarn_tile_avx512_unused; /* keep the translation unit non-empty */
#endif
