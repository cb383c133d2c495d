/*
 * hadamard.h -- the normalized fast Walsh-Hadamard transform that KVarN
 * rotates keys, values, queries and attention outputs with.
 *
 * Source: ../shared/spec/KVARN.md "Store pipeline" step 1. The matrix is the
 * Sylvester Hadamard matrix in natural order, H[i][j] = (-1)^popcount(i & j),
 * scaled by 1/sqrt(D). Scaled that way it is symmetric and orthonormal, so it
 * is its own inverse: applying it twice gives the input back (up to fp32
 * rounding). The transform is the in-place butterfly (stage h = 1, 2, 4, ...
 * D/2; x[j], x[j+h] <- x[j] + x[j+h], x[j] - x[j+h]) followed by one multiply
 * by kvarn_hadamard_scale(D).
 *
 * Every variant (scalar, AVX2, AVX-512) performs the same fp32 operations in the same
 * order, so they give bit-identical results; the scalar one is the oracle
 * the tests hold the others to. kvarn_hadamard and kvarn_hadamard_rows pick
 * the fastest variant the CPU supports at run time.
 *
 * d must be a power of two (KVarN uses 64..512); for any other d (zero and
 * negative included) the calls leave x unchanged. That is the only check on
 * these hot-path calls.
 */
#ifndef KVARN_CODEC_HADAMARD_H
#define KVARN_CODEC_HADAMARD_H

#include <math.h>
#include <stddef.h>

/* 1/sqrt(d) rounded once to fp32 (exact when d is a power of 4). */
static inline float kvarn_hadamard_scale(int d)
{
    return (float)(1.0 / sqrt((double)d));
}

/* Rotate one vector in place: x (fp32 [d]) <- x * H / sqrt(d). */
void kvarn_hadamard(float *x, int d);

/* Rotate `rows` consecutive vectors of length d in place: x is fp32
 * [rows][d] (row r at x + r*d), e.g. the token-major [G][D] K or V of a
 * tile. rows <= 0 does nothing. */
void kvarn_hadamard_rows(float *x, int rows, int d);

/* kvarn_hadamard's choice for vectors of length d, made once: the
 * function it would call now (the CPU level, KVARN_SIMD read once), for a
 * caller that rotates many vectors (attention's query and output rows, a
 * store's token-heads) and would otherwise ask the level, and read the
 * environment, for every one. Never NULL. */
typedef void (*kvarn_hadamard_fn)(float *x, int d);
kvarn_hadamard_fn kvarn__hadamard_pick(int d);

/* The portable reference (oracle) version of kvarn_hadamard. */
void kvarn_hadamard_scalar(float *x, int d);

#if defined(__x86_64__) || defined(__i386__)
#define KVARN_HADAMARD_HAVE_AVX2 1
/* AVX2 version (src/codec/hadamard_avx2.c). Only call it when
 * kvarn__cpu_level() >= KVARN_CPU_AVX2 (common/cpu.h); d must be a power of two >= 8 (not
 * checked). */
void kvarn_hadamard_avx2(float *x, int d);
void kvarn_hadamard_rows_avx2(float *x, int rows, int d);
/* AVX-512 version (src/codec/hadamard_avx512.c). Only call it when
 * kvarn__cpu_level() >= KVARN_CPU_AVX512; d must be a power of two >= 16
 * (not checked). */
void kvarn_hadamard_avx512(float *x, int d);
void kvarn_hadamard_rows_avx512(float *x, int rows, int d);
#endif

#endif /* KVARN_CODEC_HADAMARD_H */
