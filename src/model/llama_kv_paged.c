/*
 * llama_kv_paged.c -- the session's K/V in the paged cache (cache.h), one
 * sequence, in any format: in a cache of its own (sized by cache_settings)
 * or in the caller's (opts.cache), whose pool it shares with the caller's
 * other sequences.
 *
 * A chunk of n tokens at [pos, pos + n) (n = 1 for a decode step):
 *   begin   kvarn_cache_reserve(n)
 *   attend  for layer l: kvarn_cache_write_exact the chunk's K (post-RoPE)
 *           and V (staged; a tile that lies wholly inside the chunk also
 *           gets its record now, encoded from these exact K/V rather than
 *           later from the staged copy: one rounding, not two);
 *           then attention of the chunk's queries as two parts merged by
 *           log-sum-exp (../shared/spec/KVARN.md "The fp16 tail and the
 *           sink": the chunk attends to the exact K/V it just computed, the
 *           history is read quantized):
 *     self     the chunk over its own fp32 K/V, causal (llama_attn_f32; a
 *              decode step's 1 x 1 part is written out directly).
 *     history  the chunk's queries over [0, pos) as the cache holds it, by
 *              one of two paths:
 *       kernels (default)  kvarn_attn_multi_lse, non-causal, on a sequence
 *              view cut to seq_len = pos (the chunk's tokens, already in
 *              the cache, are not visible): quantized blocks, fp16 sink
 *              and tail pages, read in place.
 *       exact chunk  the history decoded with kvarn_cache_read into fp32
 *              and attended in fp32. Decodes the whole history every call:
 *              a cross-check of the kernels, not a serving path.
 *           Both parts are in the original basis (the KVarN kernels rotate
 *           their output back), so they merge directly.
 *   end     kvarn_cache_commit(pos + n): every token of a forward call is
 *           final, so each tile that is full gets quantized (from its
 *           staged copy, unless the attend step already encoded it).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvarn/attn.h"
#include "attn/attn_internal.h"
#include "common/checked.h"
#include "kvarn/cache.h"
#include "kvarn/state.h"
#include "model/llama_internal.h"

typedef struct kv_paged {
    llama_kv base;
    llama_kv_shape sh;
    kvarn_format fmt;
    kvarn_cache *cache;
    int owns_cache;      /* 0: the caller's (opts.cache), shared */
    int seq;             /* the session's sequence in it; -1 before one */
    float *kbuf, *vbuf;  /* [max_chunk][Hk][D]: the chunk's K/V, contiguous */
    float *hist_k, *hist_v; /* [max_tokens][Hk][D]: decoded history */
    float *hist_out;     /* [max_chunk][H][D] */
    float *hist_lse;     /* [max_chunk][H] */
    float *lse;          /* [max_chunk][H] */
    float *scratch;      /* llama_attn_f32_scratch_floats(max_tokens on the
                            exact-chunk path, else max_chunk) */
    /* Kernel path. */
    int exact_chunk;
    kvarn_paged_kv *views;  /* [n_layers] layer views (fixed for the cache) */
    kvarn_thread_pool *pool;
    kvarn_attn_opts attn_opts;
    float *qbuf;            /* [max_chunk][H][D] contiguous queries */
    void *ws;               /* attention workspace */
    size_t ws_bytes;
} kv_paged;

static kvarn_status paged_begin(llama_kv *kv, int pos, int n)
{
    kv_paged *p = (kv_paged *)kv;
    if (n < 1 || n > p->sh.max_chunk || pos > p->sh.max_tokens - n)
        return KVARN_ERR_OUT_OF_BLOCKS;
    return kvarn_cache_reserve(p->cache, p->seq, n);
}

/* Attention of the chunk's queries over the history [0, pos), read back
 * through the cache as fp32 (decoded records, widened fp16 pages). */
static kvarn_status history_by_read(kv_paged *p, int layer, int pos, int n,
                                    const float *q, int ldq)
{
    const llama_kv_shape *sh = &p->sh;
    int D = sh->head_dim, kd = sh->n_kv_heads * D;
    kvarn_status st = kvarn_cache_read(p->cache, p->seq, layer, 0, pos,
                                       p->hist_k, p->hist_v, 0);
    if (st != KVARN_OK) return st;
    /* q_pos0 = pos: every history key is visible to every query. */
    llama_attn_f32(sh->n_heads, sh->n_kv_heads, D, q, ldq, n, pos, p->hist_k,
                   p->hist_v, kd, (size_t)D, pos, p->hist_out, p->hist_lse,
                   p->scratch);
    return KVARN_OK;
}

/* Attention of the chunk's queries over the history [0, pos) through the
 * paged kernels: a non-causal multi-query call on the sequence view cut to
 * its first pos tokens (queries after every key, attn.h). */
static kvarn_status history_by_kernels(kv_paged *p, int layer, int pos, int n,
                                       const float *q, int ldq)
{
    const llama_kv_shape *sh = &p->sh;
    int qd = sh->n_heads * sh->head_dim;
    for (int t = 0; t < n; t++)
        memcpy(p->qbuf + (size_t)t * qd, q + (size_t)t * ldq, sizeof(float) * qd);
    kvarn_seq_view sv;
    kvarn_status st = kvarn_cache_seq_view(p->cache, p->seq, &sv);
    if (st != KVARN_OK) return st;
    /* Commit runs at the end of a call, so every quantized tile lies below
     * pos; tiles past pos drop out of the view. */
    int G = p->views[layer].block_size, tiles = (pos + G - 1) / G;
    sv.seq_len = pos;
    if (sv.committed_tiles > tiles) sv.committed_tiles = tiles;
    int32_t qsl[2] = { 0, n };
    return kvarn_attn_multi_lse(&p->views[layer], &sv, 1, qsl, sh->n_heads, p->qbuf,
                                p->hist_out, p->hist_lse, &p->attn_opts, p->pool,
                                p->ws, p->ws_bytes);
}

/* A decode step over its own token: every query head sees one key, so the
 * output is that key's V and the log-sum-exp its scaled score. */
static void self_one(const llama_kv_shape *sh, const float *q, const float *k,
                     const float *v, float *out, float *lse)
{
    int D = sh->head_dim, group = sh->n_heads / sh->n_kv_heads;
    float scale = 1.0f / sqrtf((float)D);
    for (int h = 0; h < sh->n_heads; h++) {
        const float *qh = q + (size_t)h * D, *kh = k + (size_t)(h / group) * D;
        float dot = 0.0f;
        for (int d = 0; d < D; d++) dot += qh[d] * kh[d];
        lse[h] = dot * scale;
        memcpy(out + (size_t)h * D, v + (size_t)(h / group) * D, sizeof(float) * D);
    }
}

static kvarn_status paged_attend(llama_kv *kv, int layer, int pos, int n,
                                 const float *q, int ldq, const float *k,
                                 const float *v, int ldkv, float *out)
{
    kv_paged *p = (kv_paged *)kv;
    const llama_kv_shape *sh = &p->sh;
    int D = sh->head_dim, kd = sh->n_kv_heads * D;
    for (int t = 0; t < n; t++) {
        memcpy(p->kbuf + (size_t)t * kd, k + (size_t)t * ldkv, sizeof(float) * kd);
        memcpy(p->vbuf + (size_t)t * kd, v + (size_t)t * ldkv, sizeof(float) * kd);
    }
    /* every token of a forward call is final (paged_end commits them all;
     * a failed call truncates back to pos, which drops the records) */
    kvarn_status st = kvarn_cache_write_exact(p->cache, p->seq, layer, pos, n,
                                              p->kbuf, p->vbuf);
    if (st != KVARN_OK) return st;
    /* The chunk over its own exact K/V. */
    if (n == 1)
        self_one(sh, q, p->kbuf, p->vbuf, out, p->lse);
    else
        llama_attn_f32(sh->n_heads, sh->n_kv_heads, D, q, ldq, n, 0, p->kbuf,
                       p->vbuf, kd, (size_t)D, n, out, p->lse, p->scratch);
    if (pos == 0) return KVARN_OK;
    st = p->exact_chunk ? history_by_read(p, layer, pos, n, q, ldq)
                        : history_by_kernels(p, layer, pos, n, q, ldq);
    if (st != KVARN_OK) return st;
    llama_attn_merge(sh->n_heads, D, n, out, p->lse, p->hist_out, p->hist_lse);
    return KVARN_OK;
}

static kvarn_status paged_end(llama_kv *kv, int pos, int n)
{
    kv_paged *p = (kv_paged *)kv;
    return kvarn_cache_commit(p->cache, p->seq, pos + n);
}

static void paged_abort(llama_kv *kv, int pos)
{
    kv_paged *p = (kv_paged *)kv;
    /* Commit only ever quantized tiles below pos, so cutting back to pos
     * touches the fp16 sink/tail or per-token records only: never refused. */
    kvarn_cache_truncate(p->cache, p->seq, pos);
}

static void paged_reset(llama_kv *kv)
{
    kv_paged *p = (kv_paged *)kv;
    /* Truncating into quantized tiles is refused by design (cache.h), so
     * the sequence is dropped and made anew; with one sequence in the cache
     * the free and the create cannot fail. */
    kvarn_cache_seq_free(p->cache, p->seq);
    kvarn_cache_seq_create(p->cache, &p->seq);
}

static void paged_destroy(llama_kv *kv)
{
    kv_paged *p = (kv_paged *)kv;
    if (!p) return;
    if (p->owns_cache) kvarn_cache_destroy(p->cache);
    else if (p->seq >= 0) kvarn_cache_seq_free(p->cache, p->seq);
    kvarn_thread_pool_destroy(p->pool);
    const kvarn_allocator *a = p->sh.alloc;
    kvarn__free(a, p->views);
    kvarn__free(a, p->qbuf);
    kvarn__free(a, p->ws);
    kvarn__free(a, p->kbuf);
    kvarn__free(a, p->vbuf);
    kvarn__free(a, p->hist_k);
    kvarn__free(a, p->hist_v);
    kvarn__free(a, p->hist_out);
    kvarn__free(a, p->hist_lse);
    kvarn__free(a, p->lse);
    kvarn__free(a, p->scratch);
    kvarn__free(a, p);
}

static const char *paged_name(const llama_kv *kv)
{
    return ((const kv_paged *)kv)->fmt.name;
}

static kvarn_cache *paged_cache(const llama_kv *kv, int *seq)
{
    const kv_paged *p = (const kv_paged *)kv;
    *seq = p->seq;
    return p->cache;
}

/* The empty sequence is freed so that the restored one can take its slot
 * (a one-sequence cache has no other); on error an empty one is made again,
 * which after the free cannot fail (cache.h). */
static kvarn_status paged_restore(llama_kv *kv, const void *buf, size_t len, int max_tokens,
                                  int *n_tokens)
{
    kv_paged *p = (kv_paged *)kv;
    kvarn_seq_state_info info;
    kvarn_status st = kvarn_cache_seq_state_peek(p->cache, buf, len, &info);
    if (st == KVARN_OK && info.seq_len > max_tokens) st = KVARN_ERR_OUT_OF_BLOCKS;
    if (st != KVARN_OK) return st;
    int seq = -1;
    kvarn_cache_seq_free(p->cache, p->seq);
    st = kvarn_cache_seq_restore(p->cache, buf, len, &seq);
    if (st != KVARN_OK) {
        kvarn_cache_seq_create(p->cache, &p->seq);
        return st;
    }
    p->seq = seq;
    *n_tokens = info.seq_len;
    return KVARN_OK;
}

static const llama_kv_ops paged_ops = {
    paged_begin, paged_attend, paged_end, paged_abort, paged_reset, paged_destroy, paged_name,
    paged_cache, paged_restore,
};

/* Settings of a one-sequence cache that holds max_tokens tokens and chunks
 * of max_chunk tokens: enough blocks for every non-sink tile and enough
 * fp16 pages for the sink plus every tile a chunk can leave in the tail;
 * max_seq_len = max_tokens, so the cache itself refuses a token past the
 * context. The budget is computed from the cache's own geometry
 * (kvarn_cache_plan with budget 0), in 64 bits with checked products.
 * Errors: KVARN_ERR_TOO_LARGE (more than KVARN_CACHE_MAX_SEQ_LEN tokens, or
 * a budget beyond 64 bits), errors of kvarn_cache_plan. No allocation. */
static kvarn_status cache_settings(const llama_kv_shape *sh, const kvarn_format *fmt,
                                   int sink_tiles, int sink_tokens, int tail_tokens,
                                   int balance_iters, int rtn_range, int staging,
                                   kvarn_cache_opts *out,
                                   kvarn_cache_info *info)
{
    if (sh->max_tokens > KVARN_CACHE_MAX_SEQ_LEN) return KVARN_ERR_TOO_LARGE;
    kvarn_cache_opts o = kvarn_cache_default_opts();
    o.format = *fmt;
    o.n_layers = sh->n_layers;
    o.n_kv_heads = sh->n_kv_heads;
    o.head_dim = sh->head_dim;
    o.max_seqs = 1;
    o.allocator = sh->alloc;
    o.max_seq_len = sh->max_tokens;
    if (balance_iters >= 0) o.balance_iters = balance_iters;
    o.rtn_range = rtn_range;
    if (fmt->per_tile) {
        o.sink_tiles = sink_tiles >= 0 ? sink_tiles : 1;
        /* S tokens replace sink_tiles: floor(S / G) whole sink tiles */
        o.sink_tokens = sink_tokens;
        if (sink_tokens > 0) o.sink_tiles = sink_tokens / fmt->tile_tokens;
        /* Sink, the partly filled tile a chunk starts in, and every tile
         * the chunk opens (max_chunk <= 2^30, so this stays an int). */
        const int tail = (int)kvarn__ceil_div_u64((uint64_t)sh->max_chunk,
                                                  (uint64_t)fmt->tile_tokens) + 2;
        o.n_pages = o.sink_tiles + tail;
        if (tail_tokens > 0 && tail_tokens < fmt->tile_tokens) {
            /* those tail tiles in small pages of T tokens instead; the
             * whole pages hold the sink (n_pages 0 = auto: the sink) */
            o.tail_page_tokens = tail_tokens;
            o.n_pages = o.sink_tiles;
            if (tail > (1 << 30) / (fmt->tile_tokens / tail_tokens)) return KVARN_ERR_TOO_LARGE;
            o.n_tail_pages = tail * (fmt->tile_tokens / tail_tokens);
        }
        if (staging >= 0) o.staging = staging; /* -1: the cache's default */
    }
    /* Budget 0: the plan gives the geometry only (G, sink tiles, block and
     * page bytes); per-token formats take the cache's default block size. */
    o.budget_bytes = 0;
    kvarn_cache_info geo;
    kvarn_status st = kvarn_cache_plan(&o, &geo);
    if (st != KVARN_OK) return st;
    const uint64_t tiles = kvarn__ceil_div_u64((uint64_t)sh->max_tokens, (uint64_t)geo.block_size);
    const uint64_t sink = (uint64_t)geo.sink_tiles;
    const uint64_t blocks = tiles > sink ? tiles - sink : 1;
    uint64_t block_total, page_total;
    int bad = kvarn__mul_u64(blocks, geo.block_bytes, &block_total);
    /* the plan of budget 0 has no blocks: its arena is the pages and the
     * sink slot */
    page_total = geo.arena_bytes;
    bad |= kvarn__add_u64(block_total, page_total, &o.budget_bytes);
    if (bad) return KVARN_ERR_TOO_LARGE;
    st = kvarn_cache_plan(&o, info);
    if (st != KVARN_OK) return st;
    *out = o;
    return KVARN_OK;
}

/* The cache a store runs on: the caller's opts->cache as it is (its
 * geometry was checked against the model by the session's plan), or the
 * settings of the store's own (cache_settings; *co is set only then). */
static kvarn_status store_geometry(const llama_kv_shape *sh, const kvarn_format *fmt,
                                   const kvarn_llama_session_opts *o, kvarn_cache_opts *co,
                                   kvarn_cache_info *ci)
{
    if (o->cache) return kvarn_cache_get_info(o->cache, ci);
    return cache_settings(sh, fmt, o->sink_tiles, o->sink_tokens, o->tail_page_tokens,
                          o->balance_iters, o->rtn_range, o->staging, co, ci);
}

/* Bytes of every buffer llama_kv_paged_create allocates besides the cache
 * arena, each checked to fit size_t. */
typedef struct paged_sizes {
    size_t chunk_kv;     /* kbuf, vbuf: [max_chunk][Hk][D] floats */
    size_t chunk_q;      /* qbuf, hist_out: [max_chunk][H][D] floats */
    size_t chunk_lse;    /* lse, hist_lse: [max_chunk][H] floats */
    size_t scratch;      /* llama_attn_f32 scratch */
    size_t hist;         /* hist_k, hist_v (exact_chunk): [max_tokens][Hk][D] */
    size_t ws;           /* attention workspace (kernel path) */
} paged_sizes;

static kvarn_status paged_sizes_get(const llama_kv_shape *sh, const kvarn_cache_info *ci,
                                    int exact_chunk, int threads, paged_sizes *z)
{
    memset(z, 0, sizeof *z);
    const uint64_t F = sizeof(float), C = (uint64_t)sh->max_chunk;
    const uint64_t T = (uint64_t)sh->max_tokens, D = (uint64_t)sh->head_dim;
    uint64_t v;
    int bad = kvarn__mul3_u64(C, (uint64_t)sh->n_kv_heads * D, F, &v) |
              kvarn__u64_to_size(v, &z->chunk_kv);
    bad |= kvarn__mul3_u64(C, (uint64_t)sh->n_heads * D, F, &v) |
           kvarn__u64_to_size(v, &z->chunk_q);
    bad |= kvarn__mul3_u64(C, (uint64_t)sh->n_heads, F, &v) |
           kvarn__u64_to_size(v, &z->chunk_lse);
    bad |= kvarn__mul_size(llama_attn_f32_scratch_floats(exact_chunk ? sh->max_tokens
                                                                      : sh->max_chunk),
                           sizeof(float), &z->scratch);
    if (exact_chunk)
        bad |= kvarn__mul3_u64(T, (uint64_t)sh->n_kv_heads * D, F, &v) |
               kvarn__u64_to_size(v, &z->hist);
    if (bad) return KVARN_ERR_TOO_LARGE;
    if (!exact_chunk) {
        /* Sized for the largest call: one sequence, max_chunk queries. The
         * workspace depends on the view's geometry only, not its arenas. */
        kvarn_paged_kv view;
        memset(&view, 0, sizeof view);
        view.fmt = ci->format;
        view.head_dim = ci->head_dim;
        view.n_kv_heads = ci->n_kv_heads;
        view.block_size = ci->block_size;
        view.sink_tiles = ci->sink_tiles;
        /* the staged tokens' format: int8 / int4 staging need the integer
         * path's scratch (attn_internal.h attn_rows.x8) */
        view.staging = ci->staging;
        /* small tail pages: the workspace gathers a tail tile (attn.h) */
        view.tail_page_tokens = ci->n_tail_pages > 0 ? ci->tail_page_tokens : 0;
        kvarn_attn_opts ao = KVARN_ATTN_OPTS_DEFAULT(1.0f / sqrtf((float)sh->head_dim));
        ao.causal = 0;
        z->ws = kvarn_attn_workspace_bytes(&view, sh->n_heads, 1, sh->max_chunk, threads, &ao);
        /* the format serves head_dim (checked by the cache plan), so 0
         * means a workspace beyond size_t */
        if (z->ws == 0) return KVARN_ERR_TOO_LARGE;
    }
    return KVARN_OK;
}

kvarn_status llama_kv_paged_plan(const llama_kv_shape *shape, const kvarn_format *fmt,
                                 const kvarn_llama_session_opts *o, uint64_t *kv_bytes,
                                 uint64_t *other_bytes)
{
    kvarn_cache_opts co;
    kvarn_cache_info ci;
    kvarn_status st = store_geometry(shape, fmt, o, &co, &ci);
    if (st != KVARN_OK) return st;
    paged_sizes z;
    int threads = o->attn_threads > 0 ? o->attn_threads : 1;
    st = paged_sizes_get(shape, &ci, o->exact_chunk, threads, &z);
    if (st != KVARN_OK) return st;
    /* a caller's cache: its arena and books are the caller's (the
     * sequence's block table comes from the cache's own allocator); the
     * store's own: every byte kvarn_cache_create and its one sequence ask
     * for besides the arenas (struct, id pools, block table, scratch,
     * alignment slack), as the cache itself counts them */
    uint64_t other = 0;
    if (!o->cache) {
        kvarn_cache_capacity cap;
        st = kvarn_cache_capacity_get(&co, 1, 1, &cap);
        if (st != KVARN_OK) return st;
        other = cap.books_bytes;
    }
    int bad = kvarn__add_u64(other, 2 * (uint64_t)z.chunk_kv, &other);
    bad |= kvarn__add_u64(other, 2 * (uint64_t)z.chunk_q, &other);
    bad |= kvarn__add_u64(other, 2 * (uint64_t)z.chunk_lse, &other);
    bad |= kvarn__add_u64(other, (uint64_t)z.scratch, &other);
    bad |= kvarn__add_u64(other, 2 * (uint64_t)z.hist, &other);
    bad |= kvarn__add_u64(other, (uint64_t)z.ws, &other);
    /* the store and its layer views */
    bad |= kvarn__add_u64(other, sizeof(kv_paged) +
                                     (uint64_t)shape->n_layers * sizeof(kvarn_paged_kv), &other);
    /* the attention's thread pool (llama_kv_paged_create makes it for
     * threads > 1) */
    if (threads > 1) bad |= kvarn__add_u64(other, kvarn__thread_pool_bytes(threads), &other);
    if (bad) return KVARN_ERR_TOO_LARGE;
    *kv_bytes = o->cache ? 0 : ci.arena_bytes;
    *other_bytes = other;
    return KVARN_OK;
}

kvarn_status llama_kv_paged_create(const llama_kv_shape *shape,
                                   const kvarn_format *fmt,
                                   const kvarn_llama_session_opts *o,
                                   llama_kv **out)
{
    *out = NULL;
    /* Every size first (checked, no allocation): a context the cache
     * cannot hold fails here, not later as an exhausted block pool. */
    kvarn_cache_opts co;
    kvarn_cache_info ci;
    paged_sizes z;
    int threads = o->attn_threads > 0 ? o->attn_threads : 1;
    kvarn_status st = store_geometry(shape, fmt, o, &co, &ci);
    if (st == KVARN_OK) st = paged_sizes_get(shape, &ci, o->exact_chunk, threads, &z);
    if (st != KVARN_OK) return st;
    kv_paged *p = kvarn__calloc(shape->alloc, 1, sizeof *p);
    if (!p) return KVARN_ERR_NOMEM;
    p->base.ops = &paged_ops;
    p->sh = *shape;
    p->fmt = *fmt;
    p->exact_chunk = o->exact_chunk;
    p->seq = -1;
    p->owns_cache = o->cache == NULL;
    if (o->cache) p->cache = o->cache;
    else st = kvarn_cache_create(&co, &p->cache);
    if (st == KVARN_OK) st = kvarn_cache_seq_create(p->cache, &p->seq);
    if (st == KVARN_OK && threads > 1) st = kvarn_thread_pool_create_ex(threads, shape->alloc, &p->pool);
    if (st != KVARN_OK) {
        paged_destroy(&p->base);
        return st;
    }
    p->kbuf = kvarn__malloc(shape->alloc, z.chunk_kv, 1);
    p->vbuf = kvarn__malloc(shape->alloc, z.chunk_kv, 1);
    p->lse = kvarn__malloc(shape->alloc, z.chunk_lse, 1);
    p->qbuf = kvarn__malloc(shape->alloc, z.chunk_q, 1);
    p->hist_out = kvarn__malloc(shape->alloc, z.chunk_q, 1);
    p->hist_lse = kvarn__malloc(shape->alloc, z.chunk_lse, 1);
    p->scratch = kvarn__malloc(shape->alloc, z.scratch, 1);
    p->views = kvarn__calloc(shape->alloc, (size_t)shape->n_layers, sizeof *p->views);
    if (!p->kbuf || !p->vbuf || !p->lse || !p->qbuf || !p->hist_out || !p->hist_lse ||
        !p->scratch || !p->views) {
        paged_destroy(&p->base);
        return KVARN_ERR_NOMEM;
    }
    for (int l = 0; l < shape->n_layers && st == KVARN_OK; l++)
        st = kvarn_cache_layer_view(p->cache, l, &p->views[l]);
    if (st != KVARN_OK) {
        paged_destroy(&p->base);
        return st;
    }
    /* History only: every query comes after every key it sees. */
    kvarn_attn_opts ao = KVARN_ATTN_OPTS_DEFAULT(1.0f / sqrtf((float)shape->head_dim));
    ao.causal = 0;
    p->attn_opts = ao;
    if (p->exact_chunk) {
        /* The cross-check path decodes whole histories into fp32. */
        p->hist_k = kvarn__malloc(shape->alloc, z.hist, 1);
        p->hist_v = kvarn__malloc(shape->alloc, z.hist, 1);
        if (!p->hist_k || !p->hist_v) {
            paged_destroy(&p->base);
            return KVARN_ERR_NOMEM;
        }
    } else {
        /* Sized for the largest call: one sequence, max_chunk queries. */
        p->ws_bytes = z.ws;
        p->ws = kvarn__malloc(shape->alloc, p->ws_bytes, 1);
        if (!p->ws) {
            paged_destroy(&p->base);
            return KVARN_ERR_NOMEM;
        }
    }
    *out = &p->base;
    return KVARN_OK;
}
