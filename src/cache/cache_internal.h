/*
 * cache_internal.h -- the insides of a kvarn_cache, shared by the files of
 * src/cache. Not part of the public contract (that is include/kvarn/cache.h).
 */
#ifndef KVARN_CACHE_INTERNAL_H
#define KVARN_CACHE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "kvarn/cache.h"
#include "kvarn/record.h"
#include "codec/alloc_internal.h"

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
    int32_t *pg;        /* [max_tiles] page of tile i, -1 when none */
    int *written;       /* [n_layers] tokens [0, written[l]) written in layer l */
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
    size_t page_elems;            /* uint16 per page per layer: Hk * 2 * G * D */
    uint8_t *blocks;              /* [layer][block][kv_head] records */
    uint16_t *pages;              /* [layer][page][kv_head][K,V][G][D] */
    void *blocks_mem, *pages_mem; /* the allocations behind them */
    kvarn_id_pool block_pool, page_pool;
    kvarn_seq *seqs;              /* [max_seqs] */
    int n_live;
    /* scratch for commit and read (a cache is single-threaded) */
    float *tile_k, *tile_v;       /* [G][D] */
    float *vec;                   /* [D] */
    void *enc_ws;
    size_t enc_ws_bytes;
};

/* Where things are. */
static inline uint8_t *kvarn__block_record(const kvarn_cache *c, int layer,
                                           int32_t block, int head)
{
    return c->blocks + ((size_t)layer * (size_t)c->info.n_blocks + (size_t)block) *
                           c->info.block_stride +
           (size_t)head * c->info.record_stride;
}

/* K (kv = 0) or V (kv = 1) fp16 [G][D] of one page, layer and KV head. */
static inline uint16_t *kvarn__page_kv(const kvarn_cache *c, int layer,
                                       int32_t page, int head, int kv)
{
    size_t GD = (size_t)c->info.block_size * (size_t)c->info.head_dim;
    return c->pages + ((size_t)layer * (size_t)c->info.n_pages + (size_t)page) *
                          c->page_elems +
           ((size_t)head * 2 + (size_t)kv) * GD;
}

/* The live sequence with this id, or NULL. */
kvarn_seq *kvarn__seq_get(const kvarn_cache *c, int seq);

/* Refresh table[t] from blk/pg and the quantized range. */
void kvarn__seq_set_entry(const kvarn_cache *c, kvarn_seq *s, int t);

/* Tokens truncate may not cut: end of the last quantized tile. */
int kvarn__seq_frozen_len(const kvarn_cache *c, const kvarn_seq *s);

#endif
