/*
 * llama_qgemv.c -- the scalar reference of the gguf-weights GEMV and row
 * dequantization (llama_qgemv.h), and the dispatch over SIMD levels.
 *
 * The reference decodes each weight with the expressions of
 * src/gguf/dequant.c (this file is compiled as ISO C, so q * d + m is not
 * contracted into an fma: two roundings, the first exact) and sums the
 * products in row order, one rounding per product and per addition: the
 * oracle the AVX2 / AVX-512 kernels are tested against
 * (tests/model/test_qgemv.c).
 */
#include "model/llama_qgemv.h"

#include "kvarn/kvarn.h"

/* One block of 32 weights into w[32], as dequant.c decodes it. */
static void block_q4_0(const uint8_t *b, float *w)
{
    float d = kvarn_fp16_to_fp32(llama_q_u16(b));
    const uint8_t *qs = b + 2;
    for (int j = 0; j < LLAMA_QK / 2; j++) {
        w[j] = (float)((int)(qs[j] & 0x0F) - 8) * d;
        w[j + LLAMA_QK / 2] = (float)((int)(qs[j] >> 4) - 8) * d;
    }
}

static void block_q4_1(const uint8_t *b, float *w)
{
    float d = kvarn_fp16_to_fp32(llama_q_u16(b));
    float m = kvarn_fp16_to_fp32(llama_q_u16(b + 2));
    const uint8_t *qs = b + 4;
    for (int j = 0; j < LLAMA_QK / 2; j++) {
        w[j] = (float)(qs[j] & 0x0F) * d + m;
        w[j + LLAMA_QK / 2] = (float)(qs[j] >> 4) * d + m;
    }
}

static void block_q8_0(const uint8_t *b, float *w)
{
    float d = kvarn_fp16_to_fp32(llama_q_u16(b));
    const int8_t *q = (const int8_t *)(b + 2);
    for (int j = 0; j < LLAMA_QK; j++) w[j] = (float)q[j] * d;
}

#define REF_KERNELS(name, bytes)                                                  \
    static void gemv_##name(const uint8_t *q, size_t row_bytes, int in,          \
                            const float *x, float *y, int rows)                  \
    {                                                                            \
        float w[LLAMA_QK];                                                       \
        for (int r = 0; r < rows; r++) {                                         \
            const uint8_t *b = q + (size_t)r * row_bytes;                        \
            float acc = 0.0f;                                                    \
            for (int i0 = 0; i0 < in; i0 += LLAMA_QK, b += (bytes)) {            \
                block_##name(b, w);                                              \
                for (int j = 0; j < LLAMA_QK; j++) acc += x[i0 + j] * w[j];      \
            }                                                                    \
            y[r] = acc;                                                          \
        }                                                                        \
    }                                                                            \
    static void dequant_##name(const uint8_t *q, size_t row_bytes, int in,       \
                               float *dst, int rows)                             \
    {                                                                            \
        for (int r = 0; r < rows; r++) {                                         \
            const uint8_t *b = q + (size_t)r * row_bytes;                        \
            float *o = dst + (size_t)r * (size_t)in;                             \
            for (int i0 = 0; i0 < in; i0 += LLAMA_QK, b += (bytes))              \
                block_##name(b, o + i0);                                         \
        }                                                                        \
    }

REF_KERNELS(q4_0, 2 + LLAMA_QK / 2)
REF_KERNELS(q4_1, 4 + LLAMA_QK / 2)
REF_KERNELS(q8_0, 2 + LLAMA_QK)

const llama_qkernels llama_qkernels_ref[LLAMA_QTYPES] = {
    [LLAMA_QTYPE_Q4_0] = {gemv_q4_0, dequant_q4_0},
    [LLAMA_QTYPE_Q4_1] = {gemv_q4_1, dequant_q4_1},
    [LLAMA_QTYPE_Q8_0] = {gemv_q8_0, dequant_q8_0},
};

static int qtype_index(kvarn_ggml_type type)
{
    switch (type) {
    case KVARN_GGML_Q4_0: return LLAMA_QTYPE_Q4_0;
    case KVARN_GGML_Q4_1: return LLAMA_QTYPE_Q4_1;
    case KVARN_GGML_Q8_0: return LLAMA_QTYPE_Q8_0;
    default: return -1;
    }
}

int llama_qtype_served(kvarn_ggml_type type)
{
    return qtype_index(type) >= 0;
}

const llama_qkernels *llama_qkernels_get(kvarn_ggml_type type, kvarn_cpu_level level)
{
    int t = qtype_index(type);
    if (t < 0) return NULL;
    if (level >= KVARN_CPU_AVX512) return &llama_qkernels_avx512[t];
    if (level >= KVARN_CPU_AVX2) return &llama_qkernels_avx2[t];
    return &llama_qkernels_ref[t];
}
