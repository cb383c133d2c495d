/*
 * hadamard_avx2.c -- AVX2 normalized fast Walsh-Hadamard transform.
 *
 * Same fp32 operations in the same order as kvarn_hadamard_scalar (stage by
 * stage, a + b and a - b per butterfly, then one multiply by 1/sqrt(d)), so
 * the result is bit-identical; only the data movement differs. Stages
 * h = 1, 2, 4 run inside one 8-float register (lane swaps + blend); stages
 * h = 8 .. 64 pair whole registers while a block of up to 128 floats stays
 * in the 16 ymm registers; stages h >= 128 (d >= 256) go through memory.
 * Compiled with -mavx2 -mfma -mf16c by the build; called only after
 * kvarn__cpu_level() >= KVARN_CPU_AVX2 (common/cpu.h).
 */
#include "codec/hadamard.h"

#if defined(KVARN_HADAMARD_HAVE_AVX2) && defined(__AVX2__)
#include <immintrin.h>
#include <stddef.h>

/* One in-register stage h: `partner` holds x[j ^ h] in lane j. Lanes whose
 * mask bit is 0 (the lower element of a pair) take x[j] + x[j+h], lanes
 * whose bit is 1 take x[j-h] - x[j], exactly the scalar a + b and a - b. */
#define KVARN_HSTAGE(v, partner, mask)                                        \
    _mm256_blend_ps(_mm256_add_ps((v), (partner)),                           \
                    _mm256_sub_ps((partner), (v)), (mask))

/* Stages h = 1 .. 8n/2 on n consecutive vectors (8n floats) held in
 * registers: the in-register stages on each vector, then the butterflies
 * between vectors. Inlined with a constant n, so the loops unroll and v[]
 * lives in registers for n <= 16. */
static inline __attribute__((always_inline)) void fwht_block(float *x, int n)
{
    __m256 v[16];
    for (int i = 0; i < n; i++) {
        __m256 t = _mm256_loadu_ps(x + 8 * i);
        t = KVARN_HSTAGE(t, _mm256_permute_ps(t, 0xB1), 0xAA);           /* h = 1 */
        t = KVARN_HSTAGE(t, _mm256_permute_ps(t, 0x4E), 0xCC);           /* h = 2 */
        t = KVARN_HSTAGE(t, _mm256_permute2f128_ps(t, t, 0x01), 0xF0);   /* h = 4 */
        v[i] = t;
    }
    for (int h = 1; h < n; h <<= 1)                                       /* h = 8h' */
        for (int i = 0; i < n; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                __m256 a = v[j], b = v[j + h];
                v[j] = _mm256_add_ps(a, b);
                v[j + h] = _mm256_sub_ps(a, b);
            }
    for (int i = 0; i < n; i++) _mm256_storeu_ps(x + 8 * i, v[i]);
}

static void fwht_block1(float *x) { fwht_block(x, 1); }
static void fwht_block2(float *x) { fwht_block(x, 2); }
static void fwht_block4(float *x) { fwht_block(x, 4); }
static void fwht_block8(float *x) { fwht_block(x, 8); }
static void fwht_block16(float *x) { fwht_block(x, 16); }

void kvarn_hadamard_avx2(float *x, int d)
{
    /* Stages up to h = 64 in registers, 128 floats at a time ... */
    switch (d) {
    case 8: fwht_block1(x); break;
    case 16: fwht_block2(x); break;
    case 32: fwht_block4(x); break;
    case 64: fwht_block8(x); break;
    default:
        for (int i = 0; i < d; i += 128) fwht_block16(x + i);
        break;
    }
    /* ... then the remaining stages (d >= 256) through memory. */
    for (int h = 128; h < d; h <<= 1) {
        for (int i = 0; i < d; i += 2 * h) {
            for (int j = i; j < i + h; j += 8) {
                __m256 a = _mm256_loadu_ps(x + j);
                __m256 b = _mm256_loadu_ps(x + j + h);
                _mm256_storeu_ps(x + j, _mm256_add_ps(a, b));
                _mm256_storeu_ps(x + j + h, _mm256_sub_ps(a, b));
            }
        }
    }
    const __m256 s = _mm256_set1_ps(kvarn_hadamard_scale(d));
    for (int i = 0; i < d; i += 8)
        _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), s));
}

void kvarn_hadamard_rows_avx2(float *x, int rows, int d)
{
    for (int r = 0; r < rows; r++) kvarn_hadamard_avx2(x + (size_t)r * (size_t)d, d);
}

#elif defined(KVARN_HADAMARD_HAVE_AVX2)
/* Built without -mavx2 (should not happen with the project's CMake): fall
 * back to the scalar oracle so the symbols exist and stay correct. */
void kvarn_hadamard_avx2(float *x, int d) { kvarn_hadamard_scalar(x, d); }
void kvarn_hadamard_rows_avx2(float *x, int rows, int d)
{
    for (int r = 0; r < rows; r++) kvarn_hadamard_scalar(x + (size_t)r * (size_t)d, d);
}
#endif
