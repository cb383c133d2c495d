/*
 * kernel_avx512.c -- the AVX-512 tile kernels in fp32 over token-major
 * rows: the fp16 page kernel (every kind's sink and tail pages) and the
 * per-token tiles of
 * the fp16, bf16 and fp8 (E4M3, E5M2) kinds. Their loops are
 * kernel_avx512.h's (the int8 / int4 kernel's fp32 path runs them too); the
 * int8 and int4 per-token kernel is kernel_avx512_int8.c, the KVarN record kernel
 * kernel_avx512_kvarn.c. kernel_avx512.h describes the family.
 */
#include "attn/kernel_avx512.h"

/* ---------------------------------------------------------- fp16 pages */

void attn_avx512_fp16_tile(attn_rows *r, const uint16_t *k, const uint16_t *v, int t0, int nt)
{
    /* Token t's K row; its V row is at the same place in the V half. */
    for (int t = 0; t < nt; t++) r->tok[t] = (const uint8_t *)(k + (size_t)t * r->D);
    const size_t voff = (size_t)((const uint8_t *)v - (const uint8_t *)k);
    if (tm_span_f32(r, KVARN_KIND_FP16, r->tok, 0, voff, t0, nt, NULL, NULL, NULL, NULL)) return;
    tm_scores(r, KVARN_KIND_FP16, r->tok, 0, nt, NULL, NULL);
    softmax_update_avx512(r, t0, nt);
    tm_values(r, KVARN_KIND_FP16, r->tok, voff, nt, NULL);
}

/* ----------------------------------------------------- per-token blocks */

#define TOKEN_TILE(NAME, KIND)                                                        \
    void attn_avx512_token_##NAME(attn_rows *r, const kvarn_record_layout *L,         \
                     const uint8_t *const *rec, int t0, int nt)                       \
    {                                                                                 \
        token_tile_body(r, KIND, L, rec, t0, nt);                                     \
    }

TOKEN_TILE(fp16, KVARN_KIND_FP16)
TOKEN_TILE(bf16, KVARN_KIND_BF16)
TOKEN_TILE(fp8_e4m3, KVARN_KIND_FP8_E4M3)
TOKEN_TILE(fp8_e5m2, KVARN_KIND_FP8_E5M2)
/* int8 and int4: attn_avx512_token_int8 / _int4 in kernel_avx512_int8.c
 * (integer dot products) */
