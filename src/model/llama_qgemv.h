/*
 * llama_qgemv.h -- the GEMV of the llama runner's "gguf" weights: a weight
 * matrix kept as the GGUF file's own blocks (Q4_0, Q4_1, Q8_0; layouts in
 * include/kvarn/gguf.h and src/gguf/dequant.c), multiplied by one fp32
 * activation row without quantizing the activations.
 *
 * Each weight is dequantized exactly as src/gguf/dequant.c does it: a
 * 4- or 8-bit code q times the block's fp16 scale d is exact in fp32
 * (|q| <= 128 takes 8 bits, d 11 significant bits), so q d + m (Q4_1: one
 * rounding of an exact product) equals fma(q, d, m) bit for bit, and the
 * SIMD kernels may form it either way. The products x w are then summed
 * in fp32 with FMAs: the model is exactly the fp32 weights' model, and one
 * output differs from the exact dot product by at most
 * gamma_K sum_i |x_i w_i| (K = in, u = 2^-24, gamma_K = K u / (1 - K u);
 * any order of summation, each term rounded at most K times: Higham,
 * "Accuracy and Stability of Numerical Algorithms", eq. 3.5).
 *
 * Kernels: a scalar reference (the oracle: row order, one rounding per
 * product and per addition), AVX2 and AVX-512 (llama_qgemv_avx2.c,
 * llama_qgemv_avx512.c), picked by the caller from common/cpu.h's level.
 * Not part of the public contract.
 */
#ifndef KVARN_LLAMA_QGEMV_H
#define KVARN_LLAMA_QGEMV_H

#include <stddef.h>
#include <stdint.h>

#include "common/cpu.h"
#include "kvarn/gguf.h"

/* Elements per block of every type served here. */
#define LLAMA_QK 32

/* y[r] = sum_i x[i] w_r[i] for rows r in [0, rows): row r's blocks start at
 * q + r * row_bytes (row_bytes = kvarn_ggml_row_bytes(type, in), any
 * alignment), in a positive multiple of LLAMA_QK elements; x [in] fp32,
 * y [rows] fp32. NaN / Inf in x or in the weights propagate as in an fp32
 * dot product. */
typedef void (*llama_qgemv_fn)(const uint8_t *q, size_t row_bytes, int in, const float *x,
                               float *y, int rows);

/* dst[r][i] = w_r[i] (fp32, bit for bit dequant.c's value) for rows r in
 * [0, rows); dst rows in floats apart (ld = in). */
typedef void (*llama_qdequant_fn)(const uint8_t *q, size_t row_bytes, int in, float *dst,
                                  int rows);

typedef struct llama_qkernels {
    llama_qgemv_fn gemv;
    llama_qdequant_fn dequant;
} llama_qkernels;

/* The kernels of type at SIMD level (clamped to what exists for it); NULL
 * for a type not served (anything but Q4_0, Q4_1, Q8_0). The level is the
 * caller's (kvarn__cpu_level(), or lower to test the reference). */
const llama_qkernels *llama_qkernels_get(kvarn_ggml_type type, kvarn_cpu_level level);

/* 1 for the types llama_qkernels_get serves. */
int llama_qtype_served(kvarn_ggml_type type);

/* The per-level tables (llama_qgemv.c, _avx2.c, _avx512.c), indexed by
 * LLAMA_QTYPE_* below; internal to the kernel files. */
enum { LLAMA_QTYPE_Q4_0 = 0, LLAMA_QTYPE_Q4_1 = 1, LLAMA_QTYPE_Q8_0 = 2, LLAMA_QTYPES = 3 };
extern const llama_qkernels llama_qkernels_ref[LLAMA_QTYPES];
extern const llama_qkernels llama_qkernels_avx2[LLAMA_QTYPES];
extern const llama_qkernels llama_qkernels_avx512[LLAMA_QTYPES];

/* Little-endian u16 at any address (the blocks' fp16 fields). */
static inline uint16_t llama_q_u16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

#endif
