/*
 * staging.c -- the staging formats of a KVarN cache (kvarn_staging,
 * include/kvarn/paged.h "Staging"): their names (kvarn_cache_staging_parse,
 * kvarn_cache_staging_name, include/kvarn/cache.h) and the per-token format
 * each record staging stands for (kvarn__staging_format, staging.h); the
 * write of one staged token-head (kvarn__stager_init, kvarn__stage_token).
 */
#include <string.h>

#include "cache/staging.h"
#include "kvarn/cache.h"

/* Indexed by kvarn_staging. A record staging is named after its per-token
 * format: the name is also the format's name in kvarn_format_parse. */
static const char *const k_names[] = {
    [KVARN_STAGING_FP16] = "fp16",
    [KVARN_STAGING_INT8] = "int8",
    [KVARN_STAGING_FP8_E4M3] = "fp8_e4m3",
    [KVARN_STAGING_INT4] = "int4",
};
#define N_STAGINGS ((int)(sizeof k_names / sizeof k_names[0]))

const char *kvarn_cache_staging_name(int staging)
{
    return staging >= 0 && staging < N_STAGINGS ? k_names[staging] : NULL;
}

int kvarn__staging_format(int staging, kvarn_format *fmt)
{
    if (staging == KVARN_STAGING_FP16) return 0;
    const char *name = kvarn_cache_staging_name(staging);
    kvarn_format f;
    if (name == NULL || kvarn_format_parse(name, &f) != KVARN_OK) return -1;
    *fmt = f;
    return 1;
}

kvarn_status kvarn_cache_staging_parse(const char *name, int *out)
{
    if (name == NULL || out == NULL) return KVARN_ERR_INVALID_ARG;
    for (int s = 0; s < N_STAGINGS; s++)
        if (strcmp(name, k_names[s]) == 0) {
            *out = s;
            return KVARN_OK;
        }
    /* an alias the format table gives a record staging's format ("fp8"
     * for fp8_e4m3); fp16 is named "fp16" only */
    kvarn_format f, sf;
    if (kvarn_format_parse(name, &f) != KVARN_OK) return KVARN_ERR_INVALID_ARG;
    for (int s = 0; s < N_STAGINGS; s++)
        if (kvarn__staging_format(s, &sf) == 1 && sf.kind == f.kind) {
            *out = s;
            return KVARN_OK;
        }
    return KVARN_ERR_INVALID_ARG;
}

void kvarn__stager_init(kvarn_stager *st, const kvarn_format *sf, int D)
{
    st->rotate = kvarn__hadamard_pick(D);
    kvarn__token_writer_init(&st->w, sf, D);
}

kvarn_status kvarn__stage_token(const kvarn_stager *st, const float *k, const float *v, float *rk,
                                float *rv, uint8_t *rec, size_t rb)
{
    const int D = st->w.D;
    memcpy(rk, k, (size_t)D * sizeof(float));
    memcpy(rv, v, (size_t)D * sizeof(float));
    st->rotate(rk, D);
    st->rotate(rv, D);
    return kvarn__token_writer_encode(&st->w, rk, rv, rec, rb);
}
