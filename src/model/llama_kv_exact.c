/*
 * llama_kv_exact.c -- the exact K/V store: every layer's post-RoPE K and V
 * kept in fp32, attention over all of it in fp32. Not a cache format: it is
 * the cross-check that the paged cache's fp16 format is measured against
 * (and what the numpy reference computes). Memory: 8 * layers * Hk * D bytes
 * per token, at most KVARN_CACHE_MAX_SEQ_LEN tokens like the paged cache.
 */
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"
#include "kvarn/cache.h"
#include "model/llama_internal.h"

typedef struct kv_exact {
    llama_kv base;
    llama_kv_shape sh;
    float *k;        /* [layer][Hk][max_tokens][D] */
    float *v;
    float *scratch;  /* llama_attn_f32_scratch_floats(max_tokens) */
} kv_exact;

static size_t layer_floats(const llama_kv_shape *sh)
{
    return (size_t)sh->n_kv_heads * sh->max_tokens * sh->head_dim;
}

static kvarn_status exact_begin(llama_kv *kv, int pos, int n)
{
    kv_exact *e = (kv_exact *)kv;
    if (pos < 0 || n < 1 || n > e->sh.max_chunk || pos > e->sh.max_tokens - n)
        return KVARN_ERR_OUT_OF_BLOCKS;
    return KVARN_OK;
}

static kvarn_status exact_attend(llama_kv *kv, int layer, int pos, int n,
                                 const float *q, int ldq, const float *k,
                                 const float *v, int ldkv, float *out)
{
    kv_exact *e = (kv_exact *)kv;
    const llama_kv_shape *sh = &e->sh;
    int D = sh->head_dim;
    size_t hstride = (size_t)sh->max_tokens * D;
    float *kl = e->k + (size_t)layer * layer_floats(sh);
    float *vl = e->v + (size_t)layer * layer_floats(sh);
    for (int t = 0; t < n; t++)
        for (int h = 0; h < sh->n_kv_heads; h++) {
            size_t dst = h * hstride + (size_t)(pos + t) * D;
            memcpy(kl + dst, k + (size_t)t * ldkv + (size_t)h * D, sizeof(float) * D);
            memcpy(vl + dst, v + (size_t)t * ldkv + (size_t)h * D, sizeof(float) * D);
        }
    llama_attn_f32(sh->n_heads, sh->n_kv_heads, D, q, ldq, n, pos, kl, vl, D,
                   hstride, pos + n, out, NULL, e->scratch);
    return KVARN_OK;
}

static kvarn_status exact_end(llama_kv *kv, int pos, int n)
{
    (void)kv;
    (void)pos;
    (void)n;
    return KVARN_OK;
}

static void exact_abort(llama_kv *kv, int pos)
{
    /* Positions >= pos are simply overwritten by the next chunk. */
    (void)kv;
    (void)pos;
}

static void exact_reset(llama_kv *kv)
{
    (void)kv;
}

static void exact_destroy(llama_kv *kv)
{
    kv_exact *e = (kv_exact *)kv;
    if (!e) return;
    const kvarn_allocator *a = e->sh.alloc;
    kvarn__free(a, e->k);
    kvarn__free(a, e->v);
    kvarn__free(a, e->scratch);
    kvarn__free(a, e);
}

static const char *exact_name(const llama_kv *kv)
{
    (void)kv;
    return "exact";
}

static kvarn_cache *exact_cache(const llama_kv *kv, int *seq)
{
    (void)kv;
    *seq = -1;
    return NULL;
}

static const llama_kv_ops exact_ops = {
    exact_begin, exact_attend, exact_end, exact_abort, exact_reset, exact_destroy, exact_name,
    exact_cache, NULL,
};

/* Bytes of K (= of V), all layers, and of the attention scratch, checked. */
static kvarn_status exact_sizes(const llama_kv_shape *sh, size_t *kv_bytes,
                                size_t *scratch_bytes)
{
    if (sh->max_tokens > KVARN_CACHE_MAX_SEQ_LEN) return KVARN_ERR_TOO_LARGE;
    uint64_t v;
    int bad = kvarn__mul3_u64((uint64_t)sh->n_layers * (uint64_t)sh->n_kv_heads,
                              (uint64_t)sh->max_tokens * (uint64_t)sh->head_dim,
                              sizeof(float), &v);
    bad |= kvarn__u64_to_size(v, kv_bytes);
    bad |= kvarn__mul_size(llama_attn_f32_scratch_floats(sh->max_tokens), sizeof(float),
                           scratch_bytes);
    return bad ? KVARN_ERR_TOO_LARGE : KVARN_OK;
}

kvarn_status llama_kv_exact_plan(const llama_kv_shape *shape, uint64_t *kv_bytes,
                                 uint64_t *other_bytes)
{
    size_t kvb, scr;
    kvarn_status st = exact_sizes(shape, &kvb, &scr);
    if (st != KVARN_OK) return st;
    if (kvarn__add_u64(kvb, kvb, kv_bytes)) return KVARN_ERR_TOO_LARGE; /* K and V */
    *other_bytes = (uint64_t)scr + sizeof(kv_exact); /* the scratch, the store */
    return KVARN_OK;
}

kvarn_status llama_kv_exact_create(const llama_kv_shape *shape, llama_kv **out)
{
    *out = NULL;
    size_t kv_bytes, scratch_bytes;
    kvarn_status st = exact_sizes(shape, &kv_bytes, &scratch_bytes);
    if (st != KVARN_OK) return st;
    kv_exact *e = kvarn__calloc(shape->alloc, 1, sizeof *e);
    if (!e) return KVARN_ERR_NOMEM;
    e->base.ops = &exact_ops;
    e->sh = *shape;
    e->k = kvarn__malloc(shape->alloc, kv_bytes, 1);
    e->v = kvarn__malloc(shape->alloc, kv_bytes, 1);
    e->scratch = kvarn__malloc(shape->alloc, scratch_bytes, 1);
    if (!e->k || !e->v || !e->scratch) {
        exact_destroy(&e->base);
        return KVARN_ERR_NOMEM;
    }
    *out = &e->base;
    return KVARN_OK;
}
