/*
 * llama_qgemv_avx512.c -- the gguf-weights GEMV and row dequantization
 * (llama_qgemv.h) with AVX-512 F (compiled with -mavx512f etc.; picked at
 * run time only where the CPU has it, common/cpu.h).
 *
 * A block of 32 weights is two vectors of 16. For the 4-bit types the
 * block's 16 possible values are formed once as a table, T[k] = fma(k, d,
 * m) (Q4_1) or (k - 8) d (Q4_0): k d is exact in fp32 (4-bit k, 11-bit d),
 * so T[k] is dequant.c's q d + m bit for bit. The codes, zero-extended to
 * 32 bits, index the table with vpermps, which reads only the low 4 bits of
 * each index: the low nibbles need no mask, the high ones one shift. Q8_0:
 * codes sign-extended and converted, times d (exact). Then one fp32 FMA
 * per weight into per-row accumulators (16 lanes x 2), summed across lanes
 * at the end of the row: each term is rounded at most in / 32 + 5 <= in
 * times, within the gamma_K bound of llama_qgemv.h.
 *
 * LLAMA_QGEMV_ROWS rows are processed per pass, so each activation load is
 * shared by that many rows (their blocks are streamed side by side).
 */
#include <immintrin.h>

#include "model/llama_qgemv.h"
#include "model/llama_qgemv_x86.h"

/* Block b decoded into the two halves (weights 0-15 in *lo, 16-31 in *hi). */
INLINE void dec_q4_1(const uint8_t *b, __m512 *lo, __m512 *hi)
{
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m128 dm = half2(b);
    __m512 t = _mm512_fmadd_ps(iota, _mm512_broadcastss_ps(dm),
                               _mm512_broadcastss_ps(_mm_movehdup_ps(dm)));
    __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 4)));
    *lo = _mm512_permutexvar_ps(idx, t);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), t);
}

INLINE void dec_q4_0(const uint8_t *b, __m512 *lo, __m512 *hi)
{
    const __m512 iota = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    __m512 t = _mm512_mul_ps(iota, _mm512_broadcastss_ps(half1(b)));
    __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)));
    *lo = _mm512_permutexvar_ps(idx, t);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), t);
}

INLINE void dec_q8_0(const uint8_t *b, __m512 *lo, __m512 *hi)
{
    __m512 d = _mm512_broadcastss_ps(half1(b));
    __m512i q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)));
    __m512i q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)));
    *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(q0), d);
    *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(q1), d);
}

/* R rows (a compile-time constant after inlining) of one type. */
#define GEMV_ROWS(name, bytes)                                                     \
    INLINE void rows_##name(const uint8_t *q, size_t rb, int in, const float *x,  \
                            float *y, const int R)                                 \
    {                                                                              \
        __m512 al[LLAMA_QGEMV_ROWS], ah[LLAMA_QGEMV_ROWS];                         \
        for (int r = 0; r < R; r++) al[r] = ah[r] = _mm512_setzero_ps();           \
        size_t off = 0;                                                            \
        for (int i0 = 0; i0 < in; i0 += LLAMA_QK, off += (bytes)) {                \
            __m512 xl = _mm512_loadu_ps(x + i0), xh = _mm512_loadu_ps(x + i0 + 16); \
            for (int r = 0; r < R; r++) {                                          \
                _mm_prefetch((const char *)(q + (size_t)r * rb + off + LLAMA_QGEMV_AHEAD), \
                             _MM_HINT_T0);                                         \
                __m512 wl, wh;                                                     \
                dec_##name(q + (size_t)r * rb + off, &wl, &wh);                    \
                al[r] = _mm512_fmadd_ps(xl, wl, al[r]);                            \
                ah[r] = _mm512_fmadd_ps(xh, wh, ah[r]);                            \
            }                                                                      \
        }                                                                          \
        for (int r = 0; r < R; r++)                                                \
            y[r] = _mm512_reduce_add_ps(_mm512_add_ps(al[r], ah[r]));              \
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
                __m512 wl, wh;                                                     \
                dec_##name(b, &wl, &wh);                                           \
                _mm512_storeu_ps(o + i0, wl);                                      \
                _mm512_storeu_ps(o + i0 + 16, wh);                                 \
            }                                                                      \
        }                                                                          \
    }

GEMV_ROWS(q4_0, 2 + LLAMA_QK / 2)
GEMV_ROWS(q4_1, 4 + LLAMA_QK / 2)
GEMV_ROWS(q8_0, 2 + LLAMA_QK)

const llama_qkernels llama_qkernels_avx512[LLAMA_QTYPES] = {
    [LLAMA_QTYPE_Q4_0] = {gemv_q4_0, dequant_q4_0},
    [LLAMA_QTYPE_Q4_1] = {gemv_q4_1, dequant_q4_1},
    [LLAMA_QTYPE_Q8_0] = {gemv_q8_0, dequant_q8_0},
};
