/*
 * staging.h -- staging as records of a per-token format (include/kvarn/
 * paged.h "Staging"): which per-token format a kvarn_staging stands for,
 * and the write rule for one staged token-head that kvarn_cache (store.c)
 * and the caller-arena store (paged_ops.c) share. Internal to the library.
 */
#ifndef KVARN_CACHE_STAGING_H
#define KVARN_CACHE_STAGING_H

#include <stdint.h>
#include <string.h>

#include "codec/hadamard.h"
#include "kvarn/kvarn.h"
#include "kvarn/paged.h"

/* The per-token format whose records hold the tokens staged under
 * `staging` (a kvarn_staging value): for KVARN_STAGING_INT8, _FP8_E4M3 and
 * _INT4 the format of that name (int8, fp8_e4m3, int4; kvarn.h) into *fmt,
 * returning 1; for KVARN_STAGING_FP16 0 (fp16 rows; *fmt untouched); -1
 * for any other value (*fmt untouched). staging.c. */
int kvarn__staging_format(int staging, kvarn_format *fmt);

/* k, v: fp32 [D] in the model's basis; rk, rv: fp32 [D] scratch that gets
 * the rotated vectors (x H / sqrt(D)); rec: rb bytes, written with
 * kvarn_encode of the staging's per-token format sf on (rk, rv). Returns
 * kvarn_encode's status: KVARN_OK whenever the rotated values fit fp16 (the
 * callers check that first), since the per-token scale (fp8: max|x| / 448,
 * int8 / int4: (max - min) / (2^bits - 1), rounded up) and zero-point (the
 * minimum) of such values fit fp16 too. */
static inline kvarn_status kvarn__stage_token(const kvarn_format *sf, int D, const float *k,
                                              const float *v, float *rk, float *rv,
                                              uint8_t *rec, size_t rb)
{
    memcpy(rk, k, (size_t)D * sizeof(float));
    memcpy(rv, v, (size_t)D * sizeof(float));
    kvarn_hadamard(rk, D);
    kvarn_hadamard(rv, D);
    return kvarn_encode(sf, D, rk, rv, rec, rb, NULL, 0, NULL);
}

#endif
