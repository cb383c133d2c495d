/*
 * paged_ops.c -- store and commit into caller-owned paged arenas
 * (include/kvarn/paged_ops.h): the CPU side of what a serving engine such
 * as vLLM needs when it owns the block pool and kvarn owns the codec.
 */
#include "kvarn/paged_ops.h"

#include <math.h>
#include <string.h>

#include "cache/paged_check.h"
#include "cache/staging.h"
#include "codec/codec_internal.h"
#include "codec/fp_convert.h"
#include "codec/hadamard.h"
#include "common/checked.h"
#include "kvarn/record.h"

#define MAX_KVARN_D 512 /* KVarN serves D in {64, 128, 256, 512} */
/* Largest per-token record: fp16/bf16, 4 * D bytes at D = 1024
 * (include/kvarn/record.h; kvarn_format_check_head_dim). */
#define MAX_TOKEN_RECORD (4 * 1024)

kvarn_status kvarn_paged_check(const kvarn_paged_kv *kv)
{
    if (kv == NULL || kv->n_kv_heads < 1) return KVARN_ERR_INVALID_ARG;
    kvarn_status st = kvarn_format_check_head_dim(&kv->fmt, kv->head_dim);
    if (st != KVARN_OK) return st;
    const int is_kvarn = kv->fmt.kind == KVARN_KIND_KVARN;
    if (is_kvarn ? kv->block_size != kv->fmt.tile_tokens
                 : (kv->block_size < 1 || kv->block_size > 1024))
        return KVARN_ERR_INVALID_ARG;
    kvarn_record_layout L;
    st = kvarn_record_layout_get(&kv->fmt, kv->head_dim, &L);
    if (st != KVARN_OK) return st;
    /* store and commit write both arenas (cache/paged_check.h) */
    return kvarn__paged_check_arenas(kv, &L, KVARN_PAGED_NEED_BLOCKS | KVARN_PAGED_NEED_PAGES,
                                     KVARN_ERR_INVALID_ARG);
}

/* Whether every rotated component of x (D values) fits fp16: |(Hx)_i| <=
 * ||x||_2 <= sqrt(D) max_d |x_d|, so the exact rotation is computed only
 * when that bound is beyond fp16's largest finite value (the max is exact
 * in any order: the loop vectorizes, as a double sum of squares did not).
 * Also rejects NaN/Inf. */
static int rotated_fits(const float *x, int D)
{
    float amax = 0.0f;
    int finite = 1;
    for (int d = 0; d < D; d++) {
        const float a = fabsf(x[d]);
        finite &= a <= 3.4028234663852886e38f; /* false for NaN and Inf */
        amax = a > amax ? a : amax;
    }
    if (!finite) return 0;
    if ((double)amax * sqrt((double)D) <= 65504.0) return 1;
    float tmp[MAX_KVARN_D];
    memcpy(tmp, x, (size_t)D * sizeof(float));
    kvarn_hadamard(tmp, D);
    for (int d = 0; d < D; d++)
        if (!(fabsf(tmp[d]) <= 65504.0f)) return 0;
    return 1;
}

/* Whether the n_vec vectors of x (D floats each, contiguous) are finite
 * and each, rotated, fits fp16: one max |x| over them all first (the
 * integer max of the bit patterns with the sign cleared: Inf and NaN lie
 * above every finite value, and the loop vectorizes), and rotated_fits
 * per vector only when sqrt(D) max|x| may pass fp16's largest value. */
static int rows_fit(const float *x, size_t n_vec, int D)
{
    const size_t n = n_vec * (size_t)D;
    uint32_t m = 0;
    for (size_t i = 0; i < n; i++) {
        const uint32_t u = kvarn__f32_bits(x[i]) & 0x7fffffffu;
        m = u > m ? u : m;
    }
    if (m >= 0x7f800000u) return 0;
    if ((double)kvarn__bits_f32(m) * sqrt((double)D) <= 65504.0) return 1;
    for (size_t i = 0; i < n_vec; i++)
        if (!rotated_fits(x + i * (size_t)D, D)) return 0;
    return 1;
}

static kvarn_status check_store(const kvarn_paged_kv *kv, const kvarn_token_writer *tw,
                                const float *k, const float *v, const int64_t *slots, int n)
{
    const int G = kv->block_size, H = kv->n_kv_heads, D = kv->head_dim;
    const int is_kvarn = kv->fmt.kind == KVARN_KIND_KVARN;
    const int64_t n_ids = is_kvarn ? kv->n_fp16_pages : kv->n_blocks;
    for (int j = 0; j < n; j++) {
        if (slots[j] < 0) continue;
        if (slots[j] / G >= n_ids) return KVARN_ERR_INVALID_ARG;
    }
    /* Per-token formats refuse more than NaN/Inf: a finite value whose fp16
     * scale, zero-point or value would overflow (an int8 zero-point below
     * -65504, say). Only the codec knows each format's limits, so every
     * token-head is checked here by the codec -- int8 and int4 by their
     * rows' scale and zero point (kvarn__rtn_rows_fit), fp8 by its rows'
     * scales (kvarn__fp8_rows_fit), the others encoded
     * once into scratch and thrown away -- and a batch is refused before
     * any token of it is written. */
    unsigned char scratch[MAX_TOKEN_RECORD];
    const size_t rec_bytes = is_kvarn ? 0 : kvarn_record_bytes(&kv->fmt, D);
    if (rec_bytes > sizeof scratch) return KVARN_ERR_UNSUPPORTED_HEAD_DIM;
    for (int j = 0; j < n; j++) {
        if (slots[j] < 0) continue;
        const size_t row = (size_t)j * (size_t)H * (size_t)D;
        if (is_kvarn) {
            if (!(rows_fit(k + row, (size_t)H, D) && rows_fit(v + row, (size_t)H, D)))
                return KVARN_ERR_NONFINITE;
            continue;
        }
        for (int h = 0; h < H; h++) {
            const float *kx = k + row + (size_t)h * D, *vx = v + row + (size_t)h * D;
            if (tw->bits) { /* int8/int4: the rows' scale and zero point, no codes */
                if (!kvarn__rtn_rows_fit(kx, vx, D, tw->bits, tw->avx512)) return KVARN_ERR_NONFINITE;
                continue;
            }
            if (tw->fp8) { /* fp8: the rows' scales, no codes */
                if (!kvarn__fp8_rows_fit(tw->fp8 == 1, kx, vx, D, tw->avx512)) return KVARN_ERR_NONFINITE;
                continue;
            }
            kvarn_status st = kvarn_encode(&kv->fmt, D, kx, vx, scratch, rec_bytes, NULL, 0, NULL);
            if (st != KVARN_OK) return st;
        }
    }
    return KVARN_OK;
}

kvarn_status kvarn_paged_store(const kvarn_paged_kv *kv, const float *k, const float *v,
                               const int64_t *slot_mapping, int n_tokens)
{
    if (n_tokens < 0 || (n_tokens > 0 && (k == NULL || v == NULL || slot_mapping == NULL)))
        return KVARN_ERR_INVALID_ARG;
    kvarn_status st = kvarn_paged_check(kv);
    if (st != KVARN_OK) return st;
    /* a slot is id * G + offset into a whole fp16 page: a view whose tail
     * lives in small pages has no slot numbering for them */
    if (kvarn_paged_small_tail(kv)) return KVARN_ERR_INVALID_ARG;
    if (n_tokens == 0) return KVARN_OK;
    kvarn_token_writer tw; /* per-token formats' records (the KVarN view's: unused) */
    kvarn__token_writer_init(&tw, &kv->fmt, kv->head_dim);
    st = check_store(kv, &tw, k, v, slot_mapping, n_tokens);
    if (st != KVARN_OK) return st;

    const int G = kv->block_size, H = kv->n_kv_heads, D = kv->head_dim;
    /* staging as records: the staging's per-token format (kvarn_paged_check
     * accepted the value) */
    kvarn_format sf;
    const int staged = kv->fmt.kind == KVARN_KIND_KVARN && kvarn__staging_format(kv->staging, &sf) > 0;
    kvarn_stager stager;
    if (staged) kvarn__stager_init(&stager, &sf, D);
    const kvarn_hadamard_fn rotate = kvarn__hadamard_pick(D);
    float vec[MAX_KVARN_D], vec2[MAX_KVARN_D];
    for (int j = 0; j < n_tokens; j++) {
        if (slot_mapping[j] < 0) continue;
        const int32_t id = (int32_t)(slot_mapping[j] / G);
        const int off = (int)(slot_mapping[j] % G);
        const size_t row = (size_t)j * (size_t)H * (size_t)D;
        for (int h = 0; h < H; h++) {
            const float *kx = k + row + (size_t)h * D, *vx = v + row + (size_t)h * D;
            if (staged) {
                /* the rotated values fit fp16 (check_store), so the
                 * record's scale and zero-point do */
                st = kvarn__stage_token(&stager, kx, vx, vec, vec2,
                                        kvarn_paged_page_rec(kv, id, h, off),
                                        kv->staging_record_bytes);
                if (st != KVARN_OK) return st;
            } else if (kv->fmt.kind == KVARN_KIND_KVARN) {
                uint16_t *dk = kvarn_paged_page_k(kv, id, h) + (size_t)off * D;
                uint16_t *dv = kvarn_paged_page_v(kv, id, h) + (size_t)off * D;
                for (int which = 0; which < 2; which++) {
                    memcpy(vec, which ? vx : kx, (size_t)D * sizeof(float));
                    rotate(vec, D);
                    uint16_t *dst = which ? dv : dk;
                    for (int d = 0; d < D; d++) dst[d] = kvarn__fp16_from_f32(vec[d]);
                }
            } else {
                st = kvarn__token_writer_encode(&tw, kx, vx, kvarn_paged_token_record(kv, id, h, off),
                                                kv->token_record_bytes);
                if (st != KVARN_OK) return st; /* cannot happen after the checks */
            }
        }
    }
    return KVARN_OK;
}

size_t kvarn_paged_commit_workspace_bytes(const kvarn_paged_kv *kv)
{
    if (kvarn_paged_check(kv) != KVARN_OK || kv->fmt.kind != KVARN_KIND_KVARN) return 0;
    const size_t tile = (size_t)kv->block_size * (size_t)kv->head_dim * sizeof(float);
    return 2 * tile + kvarn_encode_workspace_bytes(&kv->fmt, kv->head_dim);
}

kvarn_status kvarn_paged_commit(const kvarn_paged_kv *kv, const int32_t *src_pages,
                                const int32_t *dst_blocks, int n_tiles,
                                const kvarn_codec_opts *opts,
                                void *workspace, size_t workspace_size)
{
    if (n_tiles < 0 || (n_tiles > 0 && (src_pages == NULL || dst_blocks == NULL)))
        return KVARN_ERR_INVALID_ARG;
    kvarn_status st = kvarn_paged_check(kv);
    if (st != KVARN_OK) return st;
    if (kv->fmt.kind != KVARN_KIND_KVARN) return KVARN_ERR_INVALID_ARG;
    kvarn_format sf; /* staging as records: its per-token format */
    const int staged = kvarn__staging_format(kv->staging, &sf) > 0;
    /* opts' range as kvarn.h gives it, checked here too so that it is
     * refused even when every entry is skipped */
    if (opts != NULL && (opts->balance_iters < 0 || opts->balance_iters > 64 ||
                         (opts->rtn_range < KVARN_RTN_MINMAX || opts->rtn_range > KVARN_RTN_MSE_V)))
        return KVARN_ERR_INVALID_ARG;
    if (n_tiles == 0) return KVARN_OK;
    const size_t need = kvarn_paged_commit_workspace_bytes(kv);
    if (workspace == NULL || workspace_size < need) return KVARN_ERR_BUFFER_TOO_SMALL;
    if ((uintptr_t)workspace % 16 != 0) return KVARN_ERR_INVALID_ARG; /* fp32 scratch on it */
    for (int i = 0; i < n_tiles; i++) {
        if (src_pages[i] < 0 || dst_blocks[i] < 0) continue;
        if (src_pages[i] >= kv->n_fp16_pages || dst_blocks[i] >= kv->n_blocks)
            return KVARN_ERR_INVALID_ARG;
    }
    kvarn_codec_opts co = KVARN_CODEC_OPTS_DEFAULT;
    if (opts != NULL) co = *opts;
    co.prerotated = 1;

    const int G = kv->block_size, D = kv->head_dim;
    const size_t GD = (size_t)G * (size_t)D;
    float *tk = (float *)workspace, *tv = tk + GD;
    void *enc = tv + GD;
    const size_t enc_bytes = workspace_size - 2 * GD * sizeof(float);
    for (int i = 0; i < n_tiles; i++) {
        if (src_pages[i] < 0 || dst_blocks[i] < 0) continue;
        for (int h = 0; h < kv->n_kv_heads; h++) {
            if (staged) {
                /* the staged records decoded to the fp32 they stand for */
                for (int j = 0; j < G; j++) {
                    st = kvarn_decode(&sf, D, kvarn_paged_page_rec(kv, src_pages[i], h, j),
                                      kv->staging_record_bytes, tk + (size_t)j * D,
                                      tv + (size_t)j * D, 0);
                    if (st != KVARN_OK) return st;
                }
            } else {
                const uint16_t *pk = kvarn_paged_page_k(kv, src_pages[i], h);
                const uint16_t *pv = kvarn_paged_page_v(kv, src_pages[i], h);
                for (size_t e = 0; e < GD; e++) {
                    tk[e] = kvarn__fp16_to_f32(pk[e]);
                    tv[e] = kvarn__fp16_to_f32(pv[e]);
                }
            }
            st = kvarn_encode(&kv->fmt, D, tk, tv, kvarn_paged_record(kv, dst_blocks[i], h),
                              kv->record_stride, enc, enc_bytes, &co);
            if (st != KVARN_OK) return st;
        }
    }
    return KVARN_OK;
}

kvarn_status kvarn_paged_commit_exact(const kvarn_paged_kv *kv, const float *k, const float *v,
                                      int n_tokens, const int32_t *first_rows,
                                      const int32_t *dst_blocks, int n_tiles,
                                      const kvarn_codec_opts *opts,
                                      void *workspace, size_t workspace_size)
{
    if (n_tiles < 0 || n_tokens < 0 ||
        (n_tiles > 0 && (k == NULL || v == NULL || first_rows == NULL || dst_blocks == NULL)))
        return KVARN_ERR_INVALID_ARG;
    kvarn_status st = kvarn_paged_check(kv);
    if (st != KVARN_OK) return st;
    if (kv->fmt.kind != KVARN_KIND_KVARN) return KVARN_ERR_INVALID_ARG;
    if (opts != NULL && (opts->balance_iters < 0 || opts->balance_iters > 64 ||
                         (opts->rtn_range < KVARN_RTN_MINMAX || opts->rtn_range > KVARN_RTN_MSE_V)))
        return KVARN_ERR_INVALID_ARG;
    if (n_tiles == 0) return KVARN_OK;
    const size_t need = kvarn_paged_commit_workspace_bytes(kv);
    if (workspace == NULL || workspace_size < need) return KVARN_ERR_BUFFER_TOO_SMALL;
    if ((uintptr_t)workspace % 16 != 0) return KVARN_ERR_INVALID_ARG;
    const int G = kv->block_size, H = kv->n_kv_heads, D = kv->head_dim;
    for (int i = 0; i < n_tiles; i++) {
        if (first_rows[i] < 0 || dst_blocks[i] < 0) continue;
        if (dst_blocks[i] >= kv->n_blocks || first_rows[i] > n_tokens - G)
            return KVARN_ERR_INVALID_ARG;
    }
    /* the values: what kvarn_paged_store accepts (finite, rotated within
     * fp16), so that no tile fails half-way */
    for (int i = 0; i < n_tiles; i++) {
        if (first_rows[i] < 0 || dst_blocks[i] < 0) continue;
        const size_t r0 = (size_t)first_rows[i] * (size_t)H * (size_t)D;
        if (!(rows_fit(k + r0, (size_t)G * (size_t)H, D) && rows_fit(v + r0, (size_t)G * (size_t)H, D)))
            return KVARN_ERR_NONFINITE;
    }
    const size_t GD = (size_t)G * (size_t)D;
    float *tk = (float *)workspace, *tv = tk + GD;
    void *enc = tv + GD;
    const size_t enc_bytes = workspace_size - 2 * GD * sizeof(float);
    for (int i = 0; i < n_tiles; i++) {
        if (first_rows[i] < 0 || dst_blocks[i] < 0) continue;
        for (int h = 0; h < H; h++) {
            /* cannot fail after the checks above */
            st = kvarn__encode_rows(&kv->fmt, D, H, h, k, v, (size_t)first_rows[i], tk, tv,
                                    kvarn_paged_record(kv, dst_blocks[i], h), kv->record_stride,
                                    enc, enc_bytes, opts);
            if (st != KVARN_OK) return st;
        }
    }
    return KVARN_OK;
}
