/*
 * hadamard_avx512.c -- AVX-512 normalized fast Walsh-Hadamard transform.
 *
 * Same fp32 operations in the same order as kvarn_hadamard_scalar (stage by
 * stage, a + b and a - b per butterfly, then one multiply by 1/sqrt(d)), so
 * the result is bit-identical; only the data movement differs, as in
 * hadamard_avx2.c. Stages h = 1, 2, 4, 8 run inside one 16-float register
 * (a lane permute, an add, and a subtract on the upper lanes of each pair);
 * stages h = 16 .. 128 pair whole registers while a block of up to 256
 * floats stays in 16 zmm registers; stages h >= 256 (d >= 512) go through
 * memory. Compiled with the AVX-512 flags by the build; called only after
 * kvarn__cpu_level() >= KVARN_CPU_AVX512 (common/cpu.h), for d >= 16.
 */
#include "codec/hadamard.h"

#if defined(KVARN_HADAMARD_HAVE_AVX2) && defined(__AVX512F__)
#include <immintrin.h>
#include <stddef.h>

/* One in-register stage h: `partner` holds x[j ^ h] in lane j. Lanes whose
 * mask bit is 0 (the lower element of a pair) take x[j] + x[j+h], lanes
 * whose bit is 1 take x[j-h] - x[j]: the scalar a + b and a - b. */
#define KVARN_HSTAGE512(v, partner, mask) \
    _mm512_mask_sub_ps(_mm512_add_ps((v), (partner)), (mask), (partner), (v))

/* Stages h = 1 .. 16n/2 on n consecutive vectors (16n floats) held in
 * registers; inlined with a constant n. */
static inline __attribute__((always_inline)) void fwht512_block(float *x, int n)
{
    __m512 v[16];
    for (int i = 0; i < n; i++) {
        __m512 t = _mm512_loadu_ps(x + 16 * i);
        t = KVARN_HSTAGE512(t, _mm512_permute_ps(t, 0xB1), 0xAAAA);          /* h = 1 */
        t = KVARN_HSTAGE512(t, _mm512_permute_ps(t, 0x4E), 0xCCCC);          /* h = 2 */
        t = KVARN_HSTAGE512(t, _mm512_shuffle_f32x4(t, t, 0xB1), 0xF0F0);    /* h = 4 */
        t = KVARN_HSTAGE512(t, _mm512_shuffle_f32x4(t, t, 0x4E), 0xFF00);    /* h = 8 */
        v[i] = t;
    }
    for (int h = 1; h < n; h <<= 1)                                          /* h = 16h' */
        for (int i = 0; i < n; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const __m512 a = v[j], b = v[j + h];
                v[j] = _mm512_add_ps(a, b);
                v[j + h] = _mm512_sub_ps(a, b);
            }
    for (int i = 0; i < n; i++) _mm512_storeu_ps(x + 16 * i, v[i]);
}

static void fwht512_block1(float *x) { fwht512_block(x, 1); }
static void fwht512_block2(float *x) { fwht512_block(x, 2); }
static void fwht512_block4(float *x) { fwht512_block(x, 4); }
static void fwht512_block8(float *x) { fwht512_block(x, 8); }
static void fwht512_block16(float *x) { fwht512_block(x, 16); }

void kvarn_hadamard_avx512(float *x, int d)
{
    /* Stages up to h = 128 in registers, 256 floats at a time ... */
    switch (d) {
    case 16: fwht512_block1(x); break;
    case 32: fwht512_block2(x); break;
    case 64: fwht512_block4(x); break;
    case 128: fwht512_block8(x); break;
    default:
        for (int i = 0; i < d; i += 256) fwht512_block16(x + i);
        break;
    }
    /* ... then the remaining stages (d >= 512) through memory. */
    for (int h = 256; h < d; h <<= 1)
        for (int i = 0; i < d; i += 2 * h)
            for (int j = i; j < i + h; j += 16) {
                const __m512 a = _mm512_loadu_ps(x + j), b = _mm512_loadu_ps(x + j + h);
                _mm512_storeu_ps(x + j, _mm512_add_ps(a, b));
                _mm512_storeu_ps(x + j + h, _mm512_sub_ps(a, b));
            }
    const __m512 s = _mm512_set1_ps(kvarn_hadamard_scale(d));
    for (int i = 0; i < d; i += 16) _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), s));
}

void kvarn_hadamard_rows_avx512(float *x, int rows, int d)
{
    for (int r = 0; r < rows; r++) kvarn_hadamard_avx512(x + (size_t)r * (size_t)d, d);
}

#elif defined(KVARN_HADAMARD_HAVE_AVX2)
/* Built without AVX-512 flags (should not happen with the project's
 * CMake): the scalar oracle, so the symbols exist and stay correct. */
void kvarn_hadamard_avx512(float *x, int d) { kvarn_hadamard_scalar(x, d); }
void kvarn_hadamard_rows_avx512(float *x, int rows, int d)
{
    for (int r = 0; r < rows; r++) kvarn_hadamard_scalar(x + (size_t)r * (size_t)d, d);
}
#endif
