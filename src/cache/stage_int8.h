/*
 * stage_int8.h -- one token-head staged as an int8 record (include/kvarn/
 * paged.h "Staging"), the write rule kvarn_cache (store.c) and the
 * caller-arena store (paged_ops.c) share. Internal to the library.
 */
#ifndef KVARN_CACHE_STAGE_INT8_H
#define KVARN_CACHE_STAGE_INT8_H

#include <stdint.h>
#include <string.h>

#include "codec/hadamard.h"
#include "kvarn/kvarn.h"

/* k, v: fp32 [D] in the model's basis; rk, rv: fp32 [D] scratch that gets
 * the rotated vectors (x H / sqrt(D)); rec: rb bytes, written with
 * kvarn_encode of the int8 format i8 on (rk, rv). Returns kvarn_encode's
 * status: KVARN_OK whenever the rotated values fit fp16 (the callers check
 * that first), since the int8 scale and zero-point then fit too. */
static inline kvarn_status kvarn__stage_int8(const kvarn_format *i8, int D, const float *k,
                                             const float *v, float *rk, float *rv,
                                             uint8_t *rec, size_t rb)
{
    memcpy(rk, k, (size_t)D * sizeof(float));
    memcpy(rv, v, (size_t)D * sizeof(float));
    kvarn_hadamard(rk, D);
    kvarn_hadamard(rv, D);
    return kvarn_encode(i8, D, rk, rv, rec, rb, NULL, 0, NULL);
}

#endif
