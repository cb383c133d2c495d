/*
 * dequant.c -- the tensor types kvarn reads from GGUF files, as one traits
 * table (name, elements per block, bytes per block, block decoder), and the
 * scalar reference dequantization to fp32.
 *
 * Block layouts (ggml's ggml-common.h, described in include/kvarn/gguf.h):
 *   Q8_0  fp16 d, int8 q[32]:                 x[i] = q[i] * d
 *   Q4_0  fp16 d, uint8 qs[16]:               x[j] = (lo(qs[j]) - 8) * d,
 *                                             x[j+16] = (hi(qs[j]) - 8) * d
 *   Q4_1  fp16 d, fp16 m, uint8 qs[16]:       x[j] = lo(qs[j]) * d + m,
 *                                             x[j+16] = hi(qs[j]) * d + m
 * All multi-byte fields are little-endian and read with memcpy, so blocks
 * may sit at any address.
 */
#include <string.h>

#include "kvarn/gguf.h"
#include "kvarn/kvarn.h"

#define QK 32 /* elements per block of every Q type here */

static uint16_t load_u16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static void decode_f32(const uint8_t *src, float *dst, uint64_t n)
{
    memcpy(dst, src, (size_t)n * sizeof(float));
}

static void decode_f16(const uint8_t *src, float *dst, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++) dst[i] = kvarn_fp16_to_fp32(load_u16(src + 2 * i));
}

static void decode_bf16(const uint8_t *src, float *dst, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++) dst[i] = kvarn_bf16_to_fp32(load_u16(src + 2 * i));
}

static void decode_q8_0(const uint8_t *src, float *dst, uint64_t n)
{
    for (uint64_t b = 0; b < n / QK; b++, src += 2 + QK, dst += QK) {
        float d = kvarn_fp16_to_fp32(load_u16(src));
        const int8_t *q = (const int8_t *)(src + 2);
        for (int i = 0; i < QK; i++) dst[i] = (float)q[i] * d;
    }
}

static void decode_q4_0(const uint8_t *src, float *dst, uint64_t n)
{
    for (uint64_t b = 0; b < n / QK; b++, src += 2 + QK / 2, dst += QK) {
        float d = kvarn_fp16_to_fp32(load_u16(src));
        const uint8_t *qs = src + 2;
        for (int j = 0; j < QK / 2; j++) {
            dst[j] = (float)((int)(qs[j] & 0x0F) - 8) * d;
            dst[j + QK / 2] = (float)((int)(qs[j] >> 4) - 8) * d;
        }
    }
}

static void decode_q4_1(const uint8_t *src, float *dst, uint64_t n)
{
    for (uint64_t b = 0; b < n / QK; b++, src += 4 + QK / 2, dst += QK) {
        float d = kvarn_fp16_to_fp32(load_u16(src));
        float m = kvarn_fp16_to_fp32(load_u16(src + 2));
        const uint8_t *qs = src + 4;
        for (int j = 0; j < QK / 2; j++) {
            dst[j] = (float)(qs[j] & 0x0F) * d + m;
            dst[j + QK / 2] = (float)(qs[j] >> 4) * d + m;
        }
    }
}

typedef struct type_traits {
    kvarn_ggml_type type;
    const char *name;
    uint32_t block_size;   /* elements per block */
    uint32_t block_bytes;  /* bytes per block */
    void (*decode)(const uint8_t *src, float *dst, uint64_t n);
} type_traits;

static const type_traits TRAITS[] = {
    {KVARN_GGML_F32, "F32", 1, 4, decode_f32},
    {KVARN_GGML_F16, "F16", 1, 2, decode_f16},
    {KVARN_GGML_BF16, "BF16", 1, 2, decode_bf16},
    {KVARN_GGML_Q8_0, "Q8_0", QK, 2 + QK, decode_q8_0},
    {KVARN_GGML_Q4_0, "Q4_0", QK, 2 + QK / 2, decode_q4_0},
    {KVARN_GGML_Q4_1, "Q4_1", QK, 4 + QK / 2, decode_q4_1},
};

static const type_traits *traits_of(kvarn_ggml_type t)
{
    for (size_t i = 0; i < sizeof TRAITS / sizeof TRAITS[0]; i++)
        if (TRAITS[i].type == t) return &TRAITS[i];
    return NULL;
}

const char *kvarn_ggml_type_name(kvarn_ggml_type t)
{
    const type_traits *tr = traits_of(t);
    return tr ? tr->name : "unknown";
}

uint32_t kvarn_ggml_block_size(kvarn_ggml_type t)
{
    const type_traits *tr = traits_of(t);
    return tr ? tr->block_size : 0;
}

uint32_t kvarn_ggml_block_bytes(kvarn_ggml_type t)
{
    const type_traits *tr = traits_of(t);
    return tr ? tr->block_bytes : 0;
}

uint64_t kvarn_ggml_row_bytes(kvarn_ggml_type t, uint64_t n)
{
    const type_traits *tr = traits_of(t);
    if (!tr || n % tr->block_size != 0) return 0;
    uint64_t blocks = n / tr->block_size;
    if (blocks > UINT64_MAX / tr->block_bytes) return 0;
    return blocks * tr->block_bytes;
}

kvarn_status kvarn_ggml_dequantize(kvarn_ggml_type t, const void *src,
                                   float *dst, uint64_t n)
{
    const type_traits *tr = traits_of(t);
    if (!tr) return KVARN_ERR_UNSUPPORTED;
    if (n == 0) return KVARN_OK;
    if (!src || !dst || n % tr->block_size != 0 || n > SIZE_MAX / sizeof(float))
        return KVARN_ERR_INVALID_ARG;
    tr->decode((const uint8_t *)src, dst, n);
    return KVARN_OK;
}

kvarn_status kvarn_gguf_tensor_dequantize(const kvarn_gguf_tensor *t,
                                          uint64_t first, uint64_t n,
                                          float *dst)
{
    if (!t) return KVARN_ERR_INVALID_ARG;
    const type_traits *tr = traits_of(t->type);
    if (!tr) return KVARN_ERR_UNSUPPORTED;
    if (first > t->n_elements || n > t->n_elements - first) return KVARN_ERR_INVALID_ARG;
    if (first % tr->block_size != 0 || n % tr->block_size != 0) return KVARN_ERR_INVALID_ARG;
    if (n == 0) return KVARN_OK;
    if (!dst) return KVARN_ERR_INVALID_ARG;
    const uint8_t *src = (const uint8_t *)t->data + first / tr->block_size * tr->block_bytes;
    return kvarn_ggml_dequantize(t->type, src, dst, n);
}
