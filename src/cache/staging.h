/*
 * staging.h -- staging as records of a per-token format (include/kvarn/
 * paged.h "Staging"): which per-token format a kvarn_staging stands for,
 * and the write rule for one staged token-head that kvarn_cache (store.c)
 * and the caller-arena store (paged_ops.c) share; and the direct encode of
 * a whole tile from the exact K/V that bypasses staging (kvarn__encode_rows:
 * kvarn_cache_write_exact, kvarn_paged_commit_exact). Internal to the
 * library.
 */
#ifndef KVARN_CACHE_STAGING_H
#define KVARN_CACHE_STAGING_H

#include <stdint.h>
#include <string.h>

#include "codec/codec_internal.h"
#include "codec/hadamard.h"
#include "kvarn/kvarn.h"
#include "kvarn/paged.h"
#include "kvarn/record.h"

/* The per-token format whose records hold the tokens staged under
 * `staging` (a kvarn_staging value): for KVARN_STAGING_INT8, _FP8_E4M3 and
 * _INT4 the format of that name (int8, fp8_e4m3, int4; kvarn.h) into *fmt,
 * returning 1; for KVARN_STAGING_FP16 0 (fp16 rows; *fmt untouched); -1
 * for any other value (*fmt untouched). staging.c. */
int kvarn__staging_format(int staging, kvarn_format *fmt);

/* How the token-heads of one batch are staged (kvarn__stager_init, then
 * kvarn__stage_token per token-head): the rotation and the records of the
 * staging's per-token format, chosen once a batch (kvarn__hadamard_pick,
 * kvarn__token_writer_init). Every choice gives the same bytes. */
typedef struct kvarn_stager {
    kvarn_hadamard_fn rotate;
    kvarn_token_writer w; /* the staging's per-token format at head_dim D */
} kvarn_stager;

/* sf: a record staging's per-token format (kvarn__staging_format), D its
 * head_dim (KVarN: 64..512, a power of two). Cannot fail. */
void kvarn__stager_init(kvarn_stager *st, const kvarn_format *sf, int D);

/* k, v: fp32 [D] in the model's basis; rk, rv: fp32 [D] scratch that
 * gets the rotated vectors (x H / sqrt(D)); rec: rb bytes, written as
 * kvarn_encode of the staging's per-token format writes (rk, rv). Returns
 * KVARN_OK whenever the rotated values fit fp16 (the callers check that
 * first), since the per-token scale (fp8: max|x| / 448, int8 / int4:
 * (max - min) / (2^bits - 1), rounded up) and zero-point (the minimum) of
 * such values fit fp16 too; else kvarn_encode's status. staging.c. */
kvarn_status kvarn__stage_token(const kvarn_stager *st, const float *k, const float *v, float *rk,
                                float *rv, uint8_t *rec, size_t rb);

/* The direct path of a whole tile (../shared/spec/KVARN.md "Store pipeline
 * for one full tile" on the exact K/V, not on a staged copy): KV head h of
 * tokens [row0, row0 + G) of k, v (fp32 [rows][Hk][D], the model's basis:
 * what kvarn_cache_write and kvarn_paged_store take) gathered into tk, tv
 * (fp32 [G][D] scratch) and encoded with kvarn_encode(fmt, prerotated = 0)
 * into rec (rec_size bytes): the record kvarn_encode gives for that tile
 * itself, bit for bit. opts: the cache's codec options (prerotated is
 * overridden). Returns kvarn_encode's status. */
static inline kvarn_status kvarn__encode_rows(const kvarn_format *fmt, int D, int Hk, int h,
                                              const float *k, const float *v, size_t row0,
                                              float *tk, float *tv, void *rec, size_t rec_size,
                                              void *ws, size_t ws_size,
                                              const kvarn_codec_opts *opts)
{
    const int G = fmt->tile_tokens;
    for (int j = 0; j < G; j++) {
        const size_t src = ((row0 + (size_t)j) * (size_t)Hk + (size_t)h) * (size_t)D;
        memcpy(tk + (size_t)j * D, k + src, (size_t)D * sizeof(float));
        memcpy(tv + (size_t)j * D, v + src, (size_t)D * sizeof(float));
    }
    kvarn_codec_opts co = KVARN_CODEC_OPTS_DEFAULT;
    if (opts != NULL) co = *opts;
    co.prerotated = 0;
    return kvarn_encode(fmt, D, tk, tv, rec, rec_size, ws, ws_size, &co);
}

#endif
