/*
 * transpose8.h -- the 8 x 8 fp32 transpose (AVX) that the vector kernels
 * use to lay a per-token span's K codes out channel-major (kernel_avx2.c
 * tm_codes_f32, kernel_avx512.h tm_codes_f32). Include it from files
 * compiled with AVX2 or AVX-512 flags only.
 */
#ifndef KVARN_ATTN_TRANSPOSE8_H
#define KVARN_ATTN_TRANSPOSE8_H

#include <immintrin.h>

/* x[8] rows of 8 floats -> x[j] holds element j of every input row, in
 * input order (unpack pairs, then quads, then 128-bit halves). */
static inline __attribute__((always_inline)) void attn_transpose8(__m256 x[8])
{
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(x[2 * i], x[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(x[2 * i], x[2 * i + 1]);
    }
    for (int h = 0; h < 2; h++) {
        u[4 * h + 0] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
        u[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xee);
        u[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
        u[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xee);
    }
    for (int j = 0; j < 4; j++) {
        x[j] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x20);
        x[j + 4] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x31);
    }
}

#endif
