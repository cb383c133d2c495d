/*
 * cache_internal.h -- the insides of a kvarn_cache, shared by the files of
 * src/cache. Not part of the public contract (that is include/kvarn/cache.h).
 */
#ifndef KVARN_CACHE_INTERNAL_H
#define KVARN_CACHE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kvarn/cache.h"
#include "kvarn/paged.h"
#include "kvarn/record.h"
#include "common/alloc_internal.h"

/* A pool of ids (blocks or pages) with reference counts. Free ids sit on a
 * LIFO stack, so ids come back in the order they were freed (scrambled after
 * a while, which the tests rely on to exercise non-contiguous block tables). */
typedef struct kvarn_id_pool {
    int n;            /* ids [0, n) */
    int n_free;       /* entries of free_ids in use */
    int32_t *refs;    /* [n] sequences holding the id; 0 = free */
    int32_t *free_ids;/* [n] stack, top at n_free - 1 */
} kvarn_id_pool;

kvarn_status kvarn__pool_init(kvarn_id_pool *p, int n, const kvarn_allocator *a);
void kvarn__pool_release(kvarn_id_pool *p, const kvarn_allocator *a);
/* Pop a free id with refcount 1; caller checked n_free > 0. */
int32_t kvarn__pool_alloc(kvarn_id_pool *p);
void kvarn__pool_incref(kvarn_id_pool *p, int32_t id);
/* Drop one reference; the id goes back on the free stack at 0. id < 0 is a
 * no-op (tiles without a block or page). */
void kvarn__pool_decref(kvarn_id_pool *p, int32_t id);
int kvarn__pool_shared(const kvarn_id_pool *p, int32_t id); /* refs > 1 */

/* One sequence. The arrays live in one allocation made at seq-create time
 * and sized for max_tiles tiles; the hot path never allocates. */
typedef struct kvarn_seq {
    int live;
    int len;            /* tokens reserved */
    int n_quant;        /* KVarN: tiles [sink, sink + n_quant) are quantized */
    int committed_len;  /* largest committed_len seen, clamped by truncate */
    int32_t *table;     /* [max_tiles] the block table attention reads */
    int32_t *blk;       /* [max_tiles] block of tile i, -1 for KVarN sink */
    int32_t *pg;        /* [max_tiles] page of tile i, -1 when none (and for
                           tail tiles held in small pages) */
    int32_t *tp;        /* small tail pages (c->small_tail): [max_tiles * G / T]
                           small page of tokens [q*T, (q+1)*T), -1 when none;
                           NULL otherwise */
    int *written;       /* [n_layers] tokens [0, written[l]) written in layer l */
    uint8_t *exact;     /* KVarN (NULL otherwise): [max_tiles][n_layers] 1 where the tile's
                           block already holds, for that layer, the record
                           kvarn_cache_write_exact encoded from the exact
                           K/V of its tokens as last written (commit keeps
                           it); 0: commit encodes from the staged copy */
    void *mem;          /* the allocation behind the arrays; kept by a free
                           slot for its next sequence */
} kvarn_seq;

struct kvarn_cache {
    kvarn_allocator alloc;        /* every allocation below (alloc.h) */
    kvarn_cache_info info;
    kvarn_record_layout layout;   /* of one record (KVarN tile or one token) */
    kvarn_codec_opts codec_opts;  /* prerotated = 1 */
    int is_kvarn;
    int max_tiles;                /* block table entries per sequence */
    size_t page_stride;           /* bytes per page per layer (paged.h, packed) */
    uint8_t *blocks;              /* [layer][block][kv_head] records */
    uint16_t *pages;              /* [layer][page][kv_head][K,V][G][D] */
    uint16_t *sinks;              /* [layer][seq slot][kv_head][K,V][r][D]
                                     (r = info.sink_partial > 0; else NULL) */
    void *blocks_mem, *pages_mem, *sinks_mem; /* the allocations behind them */
    kvarn_id_pool block_pool, page_pool;
    int small_tail;               /* 0 < T < G: the tail in small pages */
    int tail_T;                   /* T, tokens per small tail page */
    uint16_t *tail_pages;         /* [layer][small page][kv_head][K,V][T][D] */
    void *tail_pages_mem;
    kvarn_id_pool tail_pool;
    kvarn_format stage_fmt;       /* the staging's per-token format when it
                                     stages records (kvarn__staged_records) */
    kvarn_seq *seqs;              /* [max_seqs] */
    int n_live;
    /* scratch for commit and read (a cache is single-threaded) */
    float *tile_k, *tile_v;       /* [G][D] */
    float *vec;                   /* [D] */
    void *enc_ws;
    size_t enc_ws_bytes;
};

/* Where things are: the view of one layer (include/kvarn/paged.h, the
 * packed layout), from which every address is taken with paged.h's helpers.
 * Layer l's blocks and pages follow the l earlier layers' ones. */
static inline kvarn_paged_kv kvarn__layer_view(const kvarn_cache *c, int layer)
{
    kvarn_paged_kv v;
    memset(&v, 0, sizeof v);
    v.fmt = c->info.format;
    v.head_dim = c->info.head_dim;
    v.n_kv_heads = c->info.n_kv_heads;
    v.block_size = c->info.block_size;
    v.sink_tiles = c->info.sink_tiles;
    v.block_stride = c->info.block_stride;
    v.record_stride = c->info.record_stride;
    v.token_record_bytes = c->info.token_record_bytes;
    v.n_blocks = c->info.n_blocks;
    v.n_fp16_pages = c->info.n_pages;
    v.staging = c->info.staging;
    v.staging_record_bytes = c->info.staging_record_bytes;
    kvarn_paged_pack_pages(&v);
    v.blocks = c->blocks + (size_t)layer * (size_t)c->info.n_blocks * c->info.block_stride;
    v.fp16_pages = c->pages ? (uint16_t *)((uint8_t *)c->pages + (size_t)layer *
                                           (size_t)c->info.n_pages * v.page_stride)
                            : NULL;
    if (c->small_tail) {
        v.tail_page_tokens = c->tail_T;
        v.n_tail_pages = c->info.n_tail_pages;
        kvarn_paged_pack_tail_pages(&v);
        v.fp16_tail_pages = (uint16_t *)((uint8_t *)c->tail_pages +
                                         (size_t)layer * (size_t)c->info.n_tail_pages *
                                             v.tail_page_stride);
    }
    v.sink_partial = c->info.sink_partial;
    if (c->sinks) {
        kvarn_paged_pack_sinks(&v);
        v.n_sink_slots = c->info.max_seqs;
        v.fp16_sinks = (uint16_t *)((uint8_t *)c->sinks +
                                    (size_t)layer * (size_t)c->info.max_seqs * v.sink_stride);
    }
    return v;
}

/* K (kv = 0) or V (kv = 1) fp16 [r][D] of a sequence's sink slot (the
 * sequence id), one layer and KV head; r = info.sink_partial > 0. */
static inline uint16_t *kvarn__sink_kv(const kvarn_cache *c, int layer, int slot, int head,
                                       int kv)
{
    const kvarn_paged_kv v = kvarn__layer_view(c, layer);
    return kv ? kvarn_paged_sink_v(&v, slot, head) : kvarn_paged_sink_k(&v, slot, head);
}

static inline uint8_t *kvarn__block_record(const kvarn_cache *c, int layer,
                                           int32_t block, int head)
{
    const kvarn_paged_kv v = kvarn__layer_view(c, layer);
    return kvarn_paged_record(&v, block, head);
}

/* K (kv = 0) or V (kv = 1) fp16 [G][D] of one page, layer and KV head. */
static inline uint16_t *kvarn__page_kv(const kvarn_cache *c, int layer,
                                       int32_t page, int head, int kv)
{
    const kvarn_paged_kv v = kvarn__layer_view(c, layer);
    return kv ? kvarn_paged_page_v(&v, page, head) : kvarn_paged_page_k(&v, page, head);
}

/* K (kv = 0) or V (kv = 1) fp16 [T][D] of one small tail page, layer and
 * KV head. */
static inline uint16_t *kvarn__tail_kv(const kvarn_cache *c, int layer, int32_t page,
                                       int head, int kv)
{
    const kvarn_paged_kv v = kvarn__layer_view(c, layer);
    return kv ? kvarn_paged_tail_v(&v, page, head) : kvarn_paged_tail_k(&v, page, head);
}

/* The fp16 row [D] of token p of a KVarN sequence held in a page (a sink
 * tile's page, a whole tail page, or a small tail page), one layer and KV
 * head, K (kv = 0) or V (kv = 1). p must lie in a tile held in fp16. */
static inline uint16_t *kvarn__row_kv(const kvarn_cache *c, const struct kvarn_seq *s,
                                      int layer, int p, int head, int kv)
{
    const int G = c->info.block_size, D = c->info.head_dim, t = p / G;
    if (c->small_tail && t >= c->info.sink_tiles)
        return kvarn__tail_kv(c, layer, s->tp[p / c->tail_T], head, kv) +
               (size_t)(p % c->tail_T) * (size_t)D;
    return kvarn__page_kv(c, layer, s->pg[t], head, kv) + (size_t)(p % G) * (size_t)D;
}

/* Whether staged tokens are records of a per-token format (paged.h
 * "Staging"; c->stage_fmt) rather than fp16 rows. */
static inline int kvarn__staged_records(const kvarn_cache *c)
{
    return c->is_kvarn && c->info.staging != KVARN_STAGING_FP16;
}

/* Staging as records: the staged token record of token p of a KVarN
 * sequence (K and V, paged.h), as kvarn__row_kv finds fp16 rows. */
static inline uint8_t *kvarn__row_rec(const kvarn_cache *c, const struct kvarn_seq *s,
                                      int layer, int p, int head)
{
    const kvarn_paged_kv v = kvarn__layer_view(c, layer);
    const int G = c->info.block_size, t = p / G;
    if (c->small_tail && t >= c->info.sink_tiles)
        return kvarn_paged_tail_rec(&v, s->tp[p / c->tail_T], head, p % c->tail_T);
    return kvarn_paged_page_rec(&v, s->pg[t], head, p % G);
}

/* Staging as records: token t of a sequence's sink slot, as a record. */
static inline uint8_t *kvarn__sink_rec(const kvarn_cache *c, int layer, int slot, int head, int t)
{
    const kvarn_paged_kv v = kvarn__layer_view(c, layer);
    return kvarn_paged_sink_rec(&v, slot, head, t);
}

/* Bytes of one KV head's staged tokens, `tokens` of them (paged.h). */
static inline size_t kvarn__staging_bytes(const kvarn_cache *c, int tokens)
{
    const kvarn_paged_kv v = kvarn__layer_view(c, 0);
    return kvarn_paged_staging_bytes(&v, tokens);
}

/* The live sequence with this id, or NULL. */
kvarn_seq *kvarn__seq_get(const kvarn_cache *c, int seq);

/* Refresh table[t] from blk/pg and the quantized range. */
void kvarn__seq_set_entry(const kvarn_cache *c, kvarn_seq *s, int t);

/* Tokens truncate may not cut: end of the last quantized tile. */
int kvarn__seq_frozen_len(const kvarn_cache *c, const kvarn_seq *s);

/* Forget the exact records (kvarn_seq.exact) of tiles [t0, t1), every
 * layer: their tokens were cut or are about to be rewritten. */
void kvarn__seq_clear_exact(const kvarn_cache *c, kvarn_seq *s, int t0, int t1);

/* The budget plan (capacity.c): check opts and work out the cache's
 * geometry into *info and the format's record layout into *layout, no
 * allocation. KVARN_ERR_INVALID_ARG for bad opts, KVARN_ERR_TOO_LARGE for a
 * count or an arena that does not fit. sizing = 1: budget_bytes 0 is
 * accepted and gives n_blocks 0 (kvarn_cache_plan); kvarn_cache_create
 * passes 0. */
kvarn_status kvarn__cache_geometry(const kvarn_cache_opts *o, kvarn_cache_info *info,
                                   kvarn_record_layout *layout, int sizing);

#endif
