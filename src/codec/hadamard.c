/*
 * hadamard.c -- normalized fast Walsh-Hadamard transform, scalar reference
 * and run-time dispatch. Source: ../shared/spec/KVARN.md "Store pipeline"
 * step 1; see hadamard.h for the exact operation order all variants share.
 */
#include "codec/hadamard.h"
#include "common/cpu.h"

static int is_pow2(int d) { return d > 0 && (d & (d - 1)) == 0; }

void kvarn_hadamard_scalar(float *x, int d)
{
    if (!is_pow2(d)) return;
    for (int h = 1; h < d; h <<= 1) {
        for (int i = 0; i < d; i += 2 * h) {
            for (int j = i; j < i + h; j++) {
                float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
    }
    const float s = kvarn_hadamard_scale(d);
    for (int i = 0; i < d; i++) x[i] *= s;
}

#ifdef KVARN_HADAMARD_HAVE_AVX2
/* The AVX2 path works on whole 8-float vectors, so it needs d >= 8; the
 * AVX-512 path on 16-float ones, d >= 16. level: kvarn__cpu_level(). */
static int use_avx2(int d, int level) { return d >= 8 && is_pow2(d) && level >= KVARN_CPU_AVX2; }
static int use_avx512(int d, int level) { return d >= 16 && is_pow2(d) && level >= KVARN_CPU_AVX512; }
#endif

void kvarn_hadamard(float *x, int d)
{
    kvarn__hadamard_pick(d)(x, d);
}

void kvarn_hadamard_rows(float *x, int rows, int d)
{
#ifdef KVARN_HADAMARD_HAVE_AVX2
    const int level = (int)kvarn__cpu_level();
    if (use_avx512(d, level)) {
        kvarn_hadamard_rows_avx512(x, rows, d);
        return;
    }
    if (use_avx2(d, level)) {
        kvarn_hadamard_rows_avx2(x, rows, d);
        return;
    }
#endif
    for (int r = 0; r < rows; r++) kvarn_hadamard_scalar(x + (size_t)r * (size_t)d, d);
}

kvarn_hadamard_fn kvarn__hadamard_pick(int d)
{
#ifdef KVARN_HADAMARD_HAVE_AVX2
    const int level = (int)kvarn__cpu_level();
    if (use_avx512(d, level)) return kvarn_hadamard_avx512;
    if (use_avx2(d, level)) return kvarn_hadamard_avx2;
#endif
    return kvarn_hadamard_scalar;
}
