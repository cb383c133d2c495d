/*
 * llama_qgemv_avx2.c -- the gguf-weights GEMV and row dequantization
 * (llama_qgemv.h) with AVX2 + FMA + F16C (compiled with -mavx2 -mfma
 * -mf16c; picked at run time only where the CPU has them, common/cpu.h).
 *
 * A block of 32 weights is four vectors of 8. The codes are widened to 32
 * bits and converted to float (exact), then decoded as dequant.c does:
 * fma(q, d, m) for Q4_1 (q d exact, so one rounding, the same as q d + m),
 * (q - 8) d for Q4_0, q d for Q8_0 (exact). One fp32 FMA per weight into
 * two accumulators per row, summed across lanes at the end of the row:
 * each term is rounded at most in / 16 + 4 <= in times, within the gamma_K
 * bound of llama_qgemv.h. LLAMA_QGEMV_ROWS rows per pass share each
 * activation load.
 */
#include <immintrin.h>

#include "model/llama_qgemv.h"
#include "model/llama_qgemv_x86.h"

/* Block b decoded into w[0..3] = weights 0-7, 8-15, 16-23, 24-31. */
INLINE void dec_nibbles(const uint8_t *qs, __m256 *w, __m256 d, __m256 m, int offset8)
{
    const __m256i mask = _mm256_set1_epi32(0x0F);
    __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    __m256i i0 = _mm256_cvtepu8_epi32(raw);                    /* bytes 0-7 */
    __m256i i1 = _mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8)); /* bytes 8-15 */
    __m256i c[4] = {_mm256_and_si256(i0, mask), _mm256_and_si256(i1, mask),
                    _mm256_srli_epi32(i0, 4), _mm256_srli_epi32(i1, 4)};
    for (int k = 0; k < 4; k++) {
        if (offset8) c[k] = _mm256_sub_epi32(c[k], _mm256_set1_epi32(8));
        __m256 qf = _mm256_cvtepi32_ps(c[k]);
        w[k] = offset8 ? _mm256_mul_ps(qf, d) : _mm256_fmadd_ps(qf, d, m);
    }
}

INLINE void dec_q4_1(const uint8_t *b, __m256 *w)
{
    __m128 dm = half2(b);
    dec_nibbles(b + 4, w, _mm256_broadcastss_ps(dm), _mm256_broadcastss_ps(_mm_movehdup_ps(dm)), 0);
}

INLINE void dec_q4_0(const uint8_t *b, __m256 *w)
{
    dec_nibbles(b + 2, w, _mm256_broadcastss_ps(half1(b)), _mm256_setzero_ps(), 1);
}

INLINE void dec_q8_0(const uint8_t *b, __m256 *w)
{
    __m256 d = _mm256_broadcastss_ps(half1(b));
    for (int k = 0; k < 4; k++) {
        __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * k)));
        w[k] = _mm256_mul_ps(_mm256_cvtepi32_ps(q), d);
    }
}

static inline float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define GEMV_ROWS(name, bytes)                                                     \
    INLINE void rows_##name(const uint8_t *q, size_t rb, int in, const float *x,  \
                            float *y, const int R)                                 \
    {                                                                              \
        __m256 a0[LLAMA_QGEMV_ROWS], a1[LLAMA_QGEMV_ROWS];                         \
        for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();           \
        size_t off = 0;                                                            \
        for (int i0 = 0; i0 < in; i0 += LLAMA_QK, off += (bytes)) {                \
            __m256 x0 = _mm256_loadu_ps(x + i0), x1 = _mm256_loadu_ps(x + i0 + 8);  \
            __m256 x2 = _mm256_loadu_ps(x + i0 + 16), x3 = _mm256_loadu_ps(x + i0 + 24); \
            for (int r = 0; r < R; r++) {                                          \
                _mm_prefetch((const char *)(q + (size_t)r * rb + off + LLAMA_QGEMV_AHEAD), \
                             _MM_HINT_T0);                                         \
                __m256 w[4];                                                       \
                dec_##name(q + (size_t)r * rb + off, w);                           \
                a0[r] = _mm256_fmadd_ps(x0, w[0], a0[r]);                          \
                a1[r] = _mm256_fmadd_ps(x1, w[1], a1[r]);                          \
                a0[r] = _mm256_fmadd_ps(x2, w[2], a0[r]);                          \
                a1[r] = _mm256_fmadd_ps(x3, w[3], a1[r]);                          \
            }                                                                      \
        }                                                                          \
        for (int r = 0; r < R; r++) y[r] = hsum8(_mm256_add_ps(a0[r], a1[r]));     \
    }                                                                              \
    static void gemv_##name(const uint8_t *q, size_t rb, int in, const float *x,  \
                            float *y, int rows)                                    \
    {                                                                              \
        int r = 0;                                                                 \
        for (; r + LLAMA_QGEMV_ROWS <= rows; r += LLAMA_QGEMV_ROWS)                \
            rows_##name(q + (size_t)r * rb, rb, in, x, y + r, LLAMA_QGEMV_ROWS);   \
        for (; r < rows; r++) rows_##name(q + (size_t)r * rb, rb, in, x, y + r, 1); \
    }                                                                              \
    static void dequant_##name(const uint8_t *q, size_t rb, int in, float *dst,   \
                               int rows)                                           \
    {                                                                              \
        for (int r = 0; r < rows; r++) {                                           \
            const uint8_t *b = q + (size_t)r * rb;                                 \
            float *o = dst + (size_t)r * (size_t)in;                               \
            for (int i0 = 0; i0 < in; i0 += LLAMA_QK, b += (bytes)) {              \
                __m256 w[4];                                                       \
                dec_##name(b, w);                                                  \
                _mm256_storeu_ps(o + i0, w[0]);                                    \
                _mm256_storeu_ps(o + i0 + 8, w[1]);                                \
                _mm256_storeu_ps(o + i0 + 16, w[2]);                               \
                _mm256_storeu_ps(o + i0 + 24, w[3]);                               \
            }                                                                      \
        }                                                                          \
    }

GEMV_ROWS(q4_0, 2 + LLAMA_QK / 2)
GEMV_ROWS(q4_1, 4 + LLAMA_QK / 2)
GEMV_ROWS(q8_0, 2 + LLAMA_QK)

const llama_qkernels llama_qkernels_avx2[LLAMA_QTYPES] = {
    [LLAMA_QTYPE_Q4_0] = {gemv_q4_0, dequant_q4_0},
    [LLAMA_QTYPE_Q4_1] = {gemv_q4_1, dequant_q4_1},
    [LLAMA_QTYPE_Q8_0] = {gemv_q8_0, dequant_q8_0},
};
