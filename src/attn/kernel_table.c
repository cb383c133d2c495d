/*
 * kernel_table.c -- which tile kernel attention runs: one row per SIMD level
 * (name, head_dim multiple, fp16 page kernel) and, per format kind, the
 * attention half of the kind's row (its tile kernel at each level; the codec
 * half is src/codec/format_kinds.c). attn_dispatch.c picks a call's kernels here
 * (attn_select_kernels); the kernel files hold only kernels.
 *
 * Adding a format kind: its row below, its scalar kernel in kernel_ref.c
 * (mandatory: the oracle) and, optionally, SIMD kernels (NULL runs the
 * next lower level's).
 */
#include <stddef.h>

#include "attn/attn_internal.h"
#include "common/cpu.h"

/* Indexed by kvarn_cpu_level. */
static const attn_level_row k_levels[ATTN_LEVELS] = {
    [KVARN_CPU_SCALAR] = {"scalar", 1, attn_ref_fp16_tile},
    [KVARN_CPU_AVX2] = {"avx2", 16, attn_avx2_fp16_tile},
    [KVARN_CPU_AVX512] = {"avx512", 32, attn_avx512_fp16_tile},
};

/* The AVX-512 kernels' integer arithmetic, by the conditions of
 * attn_internal.h (the kernels test the same ones). */
static void avx512_kvarn_arith(const kvarn_format *f, int D, int vnni, kvarn_attn_arith *scores,
                               kvarn_attn_arith *sums)
{
    /* the VNNI build's int16 products are vpdpwssd (the same rounding);
     * its V rounds the weights to u8 (kv_vsum2_u8) */
    *scores = attn_avx512_kvarn_k_int16(f->key_bits, f->tile_tokens, D) ? KVARN_ATTN_ARITH_INT16
                                                                        : KVARN_ATTN_ARITH_FP32;
    *sums = !attn_avx512_kvarn_v_int16(f->value_bits, f->tile_tokens, D) ? KVARN_ATTN_ARITH_FP32
            : vnni                                                      ? KVARN_ATTN_ARITH_U8
                                                                        : KVARN_ATTN_ARITH_INT16;
}

/* The int8 and int4 formats' per-token kernel (kernel_avx512_int8.c: int4
 * codes widened to bytes) */
static void avx512_token_int_arith(const kvarn_format *f, int D, int vnni, kvarn_attn_arith *scores,
                                   kvarn_attn_arith *sums)
{
    (void)f;
    /* spans: 128 tokens of whole blocks or one block; the kernel keeps
     * fp32 for a longer one, so "may round" holds for any */
    const int in = attn_avx512_int8_int16(D, 1);
    *scores = !in ? KVARN_ATTN_ARITH_FP32
                  : vnni && attn_avx512_int8_vnni_k(D) ? KVARN_ATTN_ARITH_INT8 : KVARN_ATTN_ARITH_INT16;
    *sums = in ? KVARN_ATTN_ARITH_INT16 : KVARN_ATTN_ARITH_FP32;
}

#define TOKEN_ROW(KIND, NAME, ARITH512)                                                    \
    [KIND] = {KIND,                                                                        \
              {attn_ref_token_##NAME, attn_avx2_token_##NAME, attn_avx512_token_##NAME},   \
              {NULL, NULL, NULL},                                                          \
              {NULL, NULL, ARITH512}}

/* Indexed by kvarn_kind; tests/attn/test_attn.c walks it. */
static const attn_kind_row k_kinds[KVARN_KIND_COUNT] = {
    TOKEN_ROW(KVARN_KIND_FP16, fp16, NULL),
    TOKEN_ROW(KVARN_KIND_BF16, bf16, NULL),
    TOKEN_ROW(KVARN_KIND_FP8_E4M3, fp8_e4m3, NULL),
    TOKEN_ROW(KVARN_KIND_FP8_E5M2, fp8_e5m2, NULL),
    TOKEN_ROW(KVARN_KIND_INT8, int8, avx512_token_int_arith),
    TOKEN_ROW(KVARN_KIND_INT4, int4, avx512_token_int_arith),
    [KVARN_KIND_KVARN] = {KVARN_KIND_KVARN,
                          {NULL, NULL, NULL},
                          {attn_ref_kvarn_tile, attn_avx2_kvarn_tile, attn_avx512_kvarn_tile},
                          {NULL, NULL, avx512_kvarn_arith}},
};

const attn_level_row *attn_level_row_of(int level)
{
    return level >= 0 && level < ATTN_LEVELS ? &k_levels[level] : NULL;
}

const attn_kind_row *attn_kind_row_of(kvarn_kind kind)
{
    return (unsigned)kind < KVARN_KIND_COUNT ? &k_kinds[kind] : NULL;
}

int attn_select_kernels_from(const attn_kind_row *row, int head_dim, int top,
                             attn_kernels *out)
{
    int lv = top < 0 ? 0 : top >= ATTN_LEVELS ? ATTN_LEVELS - 1 : top;
    while (lv > 0 && head_dim % k_levels[lv].head_dim_multiple != 0) lv--;
    attn_kernels k = {k_levels[lv].name, k_levels[lv].fp16_tile, NULL, NULL, NULL, NULL};
    for (int l = lv; l >= 0 && k.token_tile == NULL; l--) k.token_tile = row->token_tile[l];
    for (int l = lv; l >= 0 && k.kvarn_tile == NULL; l--) k.kvarn_tile = row->record_tile[l];
    *out = k;
    return lv;
}

void attn_select_arith_from(const attn_kind_row *row, const kvarn_format *fmt, int head_dim,
                            int top, int vnni, kvarn_attn_arith *scores,
                            kvarn_attn_arith *sums)
{
    attn_kernels k;
    int lv = attn_select_kernels_from(row, head_dim, top, &k);
    /* the level whose kernel runs: the first non-NULL at or below lv */
    while (lv > 0 && row->token_tile[lv] == NULL && row->record_tile[lv] == NULL) lv--;
    *scores = *sums = KVARN_ATTN_ARITH_FP32;
    if (row->arith[lv] != NULL) row->arith[lv](fmt, head_dim, vnni, scores, sums);
}

int attn_select_kernels(kvarn_kind kind, int head_dim, int top, attn_kernels *out)
{
    const attn_kind_row *row = attn_kind_row_of(kind);
    return row ? attn_select_kernels_from(row, head_dim, top, out) : -1;
}
