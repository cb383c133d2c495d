/*
 * attn_dispatch.c -- which kernels one attention call runs: the rows of
 * kernel_table.c at the SIMD level kvarn__cpu_level() reports (capped by
 * KVARN_SIMD and the testing knob force_scalar), the VNNI builds where the
 * CPU has VNNI, the AMX matrix kernel of KVarN records where it applies;
 * and the public reports of that choice (kvarn_attn_kernel_name,
 * kvarn_attn_kernel_info_get). docs/attention-simd.md "Dispatch and
 * register blocking".
 */
#define KVARN_EXPERIMENTAL_API /* the testing knobs of kvarn_attn_opts */
#include <stddef.h>

#include "attn/attn_internal.h"
#include "cache/staging.h"
#include "common/cpu.h"

/* The kernels of this format kind and head_dim at the SIMD level
 * kvarn__cpu_level() reports (capped by KVARN_SIMD, common/cpu.h), read from
 * the kind's row (kernel_table.c): a level whose head_dim multiple (AVX-512
 * 32, AVX2 16) does not divide D runs the next lower one. */
static int top_level_of(const kvarn_attn_opts *o)
{
    return attn_force_scalar_of(o) ? KVARN_CPU_SCALAR : (int)kvarn__cpu_level();
}

/* The VNNI builds of the AVX-512 KVarN and int8 kernels run where the CPU
 * has VNNI (same results; the testing knob no_vnni keeps the vpmaddwd
 * builds). */
static int vnni_of(const kvarn_attn_opts *o)
{
    return !(o->testing && o->testing->no_vnni) && kvarn__cpu_avx512_vnni();
}

/* The AVX512-BF16 kernels of the fp8 and bf16 formats
 * (kernel_avx512_bf16.c) where the CPU has AVX512-BF16 and the level is
 * AVX-512, unless the testing knob no_bf16 keeps the fp32 kernels. */
static int bf16_of(const kvarn_attn_opts *o)
{
    return !(o->testing && o->testing->no_bf16) && kvarn__cpu_avx512_bf16();
}

/* The matrix kernel of KVarN records (kernel_amx.c) a call runs for items
 * of ATTN_MATRIX_MIN_ROWS rows or more: 1 AMX tiles, 2 emulated (the
 * testing knob amx = 2, or KVARN_AMX=emulate: its rounding measured on any
 * CPU, docs/attention-matrix.md), 0 none (knob amx = 1, force_scalar, no
 * AMX). */
static int amx_of(const kvarn_attn_opts *o)
{
    const int knob = o->testing ? o->testing->amx : 0;
    if (knob == 2) return 2;
    if (knob == 1 || attn_force_scalar_of(o)) return 0;
    return (int)kvarn__cpu_amx(); /* 0 none, 1 tiles, 2 emulated */
}

/* The matrix kernel for a KVarN format of tiles of G tokens at head_dim D
 * (NULL: none). */
static attn_matrix_tile_fn matrix_kernel(const kvarn_attn_opts *o, kvarn_kind kind, int D, int G)
{
    if (kind != KVARN_KIND_KVARN || !attn_matrix_geometry(D, G)) return NULL;
    switch (amx_of(o)) {
    case 1: return attn_amx_kvarn_tile;
    case 2: return attn_amxemu_kvarn_tile;
    default: return NULL;
    }
}

/* The matrix kernel of per-token records at head_dim D (NULL: none): a
 * KVarN view's staged tokens (staged: int8 and int4 staging) and the int4,
 * fp8 and bf16 formats' blocks with one bf16 query and weights; the int8 format's
 * blocks with two each (_x2): its own error is small enough (KLD
 * 0.00007 on SmolLM2, `kvarn eval`) that one bf16 would be of its
 * order. */
static attn_token_matrix_fn token_matrix_kernel(const kvarn_attn_opts *o, kvarn_kind kind, int D,
                                                int staged)
{
    if (!attn_matrix_geometry(D, 32)) return NULL;
    const int amx = amx_of(o);
    if (amx == 0) return NULL;
    if (!staged && attn_kind_bf16_exact(kind)) {
        /* the fp8 and bf16 formats' blocks: codes exact in bf16 (not as a
         * KVarN view's fp8 staging, which kvarn_attn_kernel_info does not
         * report) */
        if (kind == KVARN_KIND_FP8_E4M3) return amx == 1 ? attn_amx_token_tile_fp8_e4m3 : attn_amxemu_token_tile_fp8_e4m3;
        if (kind == KVARN_KIND_FP8_E5M2) return amx == 1 ? attn_amx_token_tile_fp8_e5m2 : attn_amxemu_token_tile_fp8_e5m2;
        return amx == 1 ? attn_amx_token_tile_bf16 : attn_amxemu_token_tile_bf16;
    }
    if (!(kind == KVARN_KIND_INT4 || kind == KVARN_KIND_INT8)) return NULL;
    const int x2 = kind == KVARN_KIND_INT8 && !staged;
    if (amx == 1) return x2 ? attn_amx_token_tile_x2 : attn_amx_token_tile;
    return x2 ? attn_amxemu_token_tile_x2 : attn_amxemu_token_tile;
}

/* The AVX512-BF16 kernel (kernel_avx512_bf16.c) in place of the level's
 * token kernel t at head_dim D, or NULL: for the fp8 and bf16 formats'
 * AVX-512 kernels where bf16_of, at a head_dim the span scratch r->mat
 * takes (attn_matrix_geometry), and not as a KVarN view's fp8 staging
 * (staged: kvarn_attn_kernel_info reports the staged tokens' kernel as
 * fp32, and tests bound them so). The kernel itself takes its fp32 path
 * for items of fewer than ATTN_SPAN_F32_MIN_ROWS rows. */
static attn_token_tile_fn bf16_token_tile(const kvarn_attn_opts *o, attn_token_tile_fn t, int D,
                                          int staged)
{
    if (staged || !bf16_of(o) || !attn_matrix_geometry(D, 32)) return NULL;
    if (t == attn_avx512_token_fp8_e4m3) return attn_avx512bf16_token_fp8_e4m3;
    if (t == attn_avx512_token_fp8_e5m2) return attn_avx512bf16_token_fp8_e5m2;
    if (t == attn_avx512_token_bf16) return attn_avx512bf16_token_bf16;
    return NULL;
}

void attn_pick_kernels(const kvarn_attn_opts *o, kvarn_kind kind, int head_dim, int G, int staged,
                       attn_kernels *out)
{
    /* kind checked by attn_make_geom */
    (void)attn_select_kernels(kind, head_dim, top_level_of(o), out);
    const int vnni = vnni_of(o);
    if (vnni && out->kvarn_tile == attn_avx512_kvarn_tile) out->kvarn_tile = attn_avx512vnni_kvarn_tile;
    if (vnni && out->token_tile == attn_avx512_token_int8) out->token_tile = attn_avx512vnni_token_int8;
    if (vnni && out->token_tile == attn_avx512_token_int4) out->token_tile = attn_avx512vnni_token_int4;
    const attn_token_tile_fn bf = bf16_token_tile(o, out->token_tile, head_dim, staged);
    if (bf) out->token_tile = bf;
    out->kvarn_matrix = matrix_kernel(o, kind, head_dim, G);
    out->token_matrix = token_matrix_kernel(o, kind, head_dim, staged);
}

const char *kvarn_attn_kernel_name(const kvarn_attn_opts *opts)
{
    if (opts != NULL && attn_force_scalar_of(opts))
        return attn_level_row_of(KVARN_CPU_SCALAR)->name;
    return attn_level_row_of((int)kvarn__cpu_level())->name;
}

kvarn_status kvarn_attn_kernel_info_get(const kvarn_format *fmt, int head_dim, int staging,
                                        const kvarn_attn_opts *opts,
                                        kvarn_attn_kernel_info *out)
{
    if (fmt == NULL || out == NULL || (opts != NULL && !attn_opts_valid(opts)))
        return KVARN_ERR_INVALID_ARG;
    kvarn_record_layout L;
    kvarn_status st = kvarn_record_layout_get(fmt, head_dim, &L);
    if (st != KVARN_OK) return st;
    kvarn_format sf;
    const int staged = fmt->kind == KVARN_KIND_KVARN ? kvarn__staging_format(staging, &sf) : 0;
    if (staged < 0) return KVARN_ERR_INVALID_ARG;
    const attn_kind_row *row = attn_kind_row_of(fmt->kind);
    if (row == NULL) return KVARN_ERR_INVALID_ARG;
    const kvarn_attn_opts o = opts ? *opts : (kvarn_attn_opts)KVARN_ATTN_OPTS_DEFAULT(1.0f);
    const int top = top_level_of(&o), vnni = vnni_of(&o);
    kvarn_attn_kernel_info info;
    attn_kernels k;
    info.level = attn_level_row_of(attn_select_kernels_from(row, head_dim, top, &k))->name;
    attn_select_arith_from(row, fmt, head_dim, top, vnni, &info.scores, &info.sums);
    info.staged_scores = info.scores;
    info.staged_sums = info.sums;
    info.matrix = NULL;
    info.matrix_rows = 0;
    info.matrix_scores = info.matrix_sums = KVARN_ATTN_ARITH_FP32;
    info.matrix_staged = 0;
    const attn_matrix_tile_fn mk = matrix_kernel(&o, fmt->kind, head_dim, fmt->tile_tokens);
    const attn_token_matrix_fn tk = token_matrix_kernel(&o, fmt->kind, head_dim, 0);
    if (mk != NULL || tk != NULL) {
        /* KVarN records, or the int4, int8, fp8 and bf16 formats' blocks */
        info.matrix = amx_of(&o) == 2 ? "amx-bf16-emulated" : "amx-bf16";
        info.matrix_rows = ATTN_MATRIX_MIN_ROWS;
        info.matrix_scores = info.matrix_sums =
            fmt->kind == KVARN_KIND_INT8 ? KVARN_ATTN_ARITH_BF16X2 : KVARN_ATTN_ARITH_BF16;
    }
    if (info.matrix == NULL && bf16_token_tile(&o, k.token_tile, head_dim, 0)) {
        /* the fp8 and bf16 formats' blocks */
        info.matrix = "avx512-bf16";
        info.matrix_rows = ATTN_SPAN_F32_MIN_ROWS;
        info.matrix_scores = info.matrix_sums = KVARN_ATTN_ARITH_BF16;
    }
    if (fmt->kind == KVARN_KIND_KVARN) {
        /* fp16 staging: the fp16 page kernel (fp32 arithmetic) */
        info.staged_scores = info.staged_sums = KVARN_ATTN_ARITH_FP32;
        if (staged > 0) {
            attn_select_arith_from(attn_kind_row_of(sf.kind), &sf, head_dim, top, vnni,
                                   &info.staged_scores, &info.staged_sums);
            /* the staged tokens of the matrix kernel's items take it too
             * (attn.c staged_tile) */
            info.matrix_staged = mk != NULL && token_matrix_kernel(&o, sf.kind, head_dim, 1) != NULL
                                     ? ATTN_STAGED_MATRIX_MIN_QUERIES : 0;
        }
    }
    *out = info;
    return KVARN_OK;
}
