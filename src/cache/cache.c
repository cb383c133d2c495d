/*
 * cache.c -- creating a kvarn_cache (its arenas allocated to the plan of
 * capacity.c), its geometry, its counters, and the per-layer view attention
 * reads (include/kvarn/paged.h).
 */
#define KVARN_EXPERIMENTAL_API /* kvarn_cache_block_refs, _page_refs */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache_internal.h"
#include "cache/staging.h"

kvarn_cache_opts kvarn_cache_default_opts(void)
{
    kvarn_cache_opts o;
    memset(&o, 0, sizeof o);
    if (kvarn_format_parse("kvarn_k4v2_g128", &o.format) != KVARN_OK)
        memset(&o.format, 0, sizeof o.format);
    o.sink_tiles = 1;
    /* int8 staging: at the fp16 staging's decode KLD (0.97x of it, 4
     * windows) for 53% of its staged bytes (docs/capacity.md "Staging
     * below fp16") */
    o.staging = KVARN_STAGING_INT8;
    o.max_seqs = 64;
    o.balance_iters = 8;
    return o;
}

/* Zeroed arena aligned to 64 bytes. calloc, not aligned_alloc + memset: a
 * large calloc maps fresh zero pages lazily, so creating a cache does not
 * touch its whole budget. *mem receives the pointer to free. */
static void *arena64(const kvarn_allocator *a, size_t bytes, void **mem)
{
    *mem = NULL;
    if (bytes == 0 || bytes > SIZE_MAX - 64) return NULL;
    *mem = kvarn__calloc(a, 1, bytes + 64);
    if (*mem == NULL) return NULL;
    uintptr_t p = ((uintptr_t)*mem + 63) & ~(uintptr_t)63;
    return (void *)p;
}

static void *alloc64(const kvarn_allocator *a, size_t bytes)
{
    if (bytes == 0) return NULL;
    size_t rounded = (bytes + 63) & ~(size_t)63;
    return kvarn__malloc_aligned(a, rounded, 64, 0);
}

void kvarn_cache_destroy(kvarn_cache *c)
{
    if (c == NULL) return;
    if (c->seqs) {
        for (int i = 0; i < c->info.max_seqs; i++) kvarn__free(&c->alloc, c->seqs[i].mem);
        kvarn__free(&c->alloc, c->seqs);
    }
    const kvarn_allocator a = c->alloc;
    kvarn__pool_release(&c->block_pool, &a);
    kvarn__pool_release(&c->page_pool, &a);
    kvarn__pool_release(&c->tail_pool, &a);
    kvarn__free(&a, c->blocks_mem);
    kvarn__free(&a, c->pages_mem);
    kvarn__free(&a, c->tail_pages_mem);
    kvarn__free(&a, c->sinks_mem);
    kvarn__free_aligned(&a, c->tile_k);
    kvarn__free_aligned(&a, c->tile_v);
    kvarn__free_aligned(&a, c->vec);
    kvarn__free_aligned(&a, c->enc_ws);
    kvarn__free(&a, c);
}

kvarn_status kvarn_cache_create(const kvarn_cache_opts *opts, kvarn_cache **out)
{
    if (opts == NULL || out == NULL) return KVARN_ERR_INVALID_ARG;
    kvarn_cache_info info;
    kvarn_record_layout layout;
    kvarn_status st = kvarn__cache_geometry(opts, &info, &layout, 0);
    if (st != KVARN_OK) return st;

    kvarn_allocator alloc;
    if (kvarn__alloc_init(&alloc, opts->allocator) != KVARN_OK) return KVARN_ERR_INVALID_ARG;
    kvarn_cache *c = kvarn__calloc(&alloc, 1, sizeof *c);
    if (c == NULL) return KVARN_ERR_NOMEM;
    c->alloc = alloc;
    c->info = info;
    c->layout = layout;
    c->is_kvarn = info.format.kind == KVARN_KIND_KVARN;
    c->codec_opts.balance_iters = opts->balance_iters;
    c->codec_opts.prerotated = 1;
    c->codec_opts.rtn_range = opts->rtn_range;
    c->max_tiles = (info.max_seq_len + info.block_size - 1) / info.block_size;
    if (kvarn__staging_format(info.staging, &c->stage_fmt) < 0) {
        kvarn__free(&alloc, c);
        return KVARN_ERR_INVALID_ARG; /* the plan parsed it already */
    }
    c->page_stride = (size_t)info.page_bytes / (size_t)info.n_layers;

    /* The plan (kvarn__cache_geometry, capacity.c) proved both arenas fit
     * size_t; the products below are the ones it checked (block_bytes = n_layers * block_stride, page_bytes =
     * n_layers * page_stride). */
    const size_t GD = (size_t)info.block_size * (size_t)info.head_dim;
    const size_t block_arena = (size_t)info.n_blocks * info.block_bytes;
    const size_t page_arena = (size_t)info.n_pages * (info.page_bytes / sizeof(uint16_t));
    c->blocks = arena64(&alloc, block_arena, &c->blocks_mem);
    c->pages = page_arena ? arena64(&alloc, page_arena * sizeof(uint16_t), &c->pages_mem) : NULL;
    /* max_seqs * sink_bytes: checked by the plan like the other arenas */
    const size_t sink_arena = (size_t)info.max_seqs * info.sink_bytes;
    c->sinks = sink_arena ? arena64(&alloc, sink_arena, &c->sinks_mem) : NULL;
    /* n_tail_pages * tail_page_bytes: part of the page total the plan checked */
    c->small_tail = info.n_tail_pages > 0;
    c->tail_T = info.tail_page_tokens;
    const size_t tail_arena = (size_t)info.n_tail_pages * info.tail_page_bytes;
    c->tail_pages = tail_arena ? arena64(&alloc, tail_arena, &c->tail_pages_mem) : NULL;
    c->seqs = kvarn__calloc(&alloc, (size_t)info.max_seqs, sizeof *c->seqs);
    c->tile_k = alloc64(&alloc, GD * sizeof(float));
    c->tile_v = alloc64(&alloc, GD * sizeof(float));
    c->vec = alloc64(&alloc, (size_t)info.head_dim * sizeof(float));
    c->enc_ws_bytes = kvarn_encode_workspace_bytes(&info.format, info.head_dim);
    c->enc_ws = c->enc_ws_bytes ? alloc64(&alloc, c->enc_ws_bytes) : NULL;
    if (c->blocks == NULL || (page_arena && c->pages == NULL) ||
        (sink_arena && c->sinks == NULL) || (tail_arena && c->tail_pages == NULL) ||
        c->seqs == NULL ||
        c->tile_k == NULL || c->tile_v == NULL || c->vec == NULL ||
        (c->enc_ws_bytes && c->enc_ws == NULL)) {
        kvarn_cache_destroy(c);
        return KVARN_ERR_NOMEM;
    }
    if (kvarn__pool_init(&c->block_pool, info.n_blocks, &alloc) != KVARN_OK ||
        kvarn__pool_init(&c->page_pool, info.n_pages, &alloc) != KVARN_OK ||
        kvarn__pool_init(&c->tail_pool, info.n_tail_pages, &alloc) != KVARN_OK) {
        kvarn_cache_destroy(c);
        return KVARN_ERR_NOMEM;
    }
    *out = c;
    return KVARN_OK;
}

kvarn_status kvarn_cache_get_info(const kvarn_cache *c, kvarn_cache_info *out)
{
    if (c == NULL || out == NULL) return KVARN_ERR_INVALID_ARG;
    *out = c->info;
    return KVARN_OK;
}

static int count_shared(const kvarn_id_pool *p)
{
    int n = 0;
    for (int i = 0; i < p->n; i++) n += p->refs[i] > 1;
    return n;
}

kvarn_status kvarn_cache_get_stats(const kvarn_cache *c, kvarn_cache_stats *out)
{
    if (c == NULL || out == NULL) return KVARN_ERR_INVALID_ARG;
    kvarn_cache_stats s;
    memset(&s, 0, sizeof s);
    s.n_seqs = c->n_live;
    s.blocks_total = c->block_pool.n;
    s.blocks_free = c->block_pool.n_free;
    s.blocks_in_use = s.blocks_total - s.blocks_free;
    s.blocks_shared = count_shared(&c->block_pool);
    s.pages_total = c->page_pool.n;
    s.pages_free = c->page_pool.n_free;
    s.pages_in_use = s.pages_total - s.pages_free;
    s.pages_shared = count_shared(&c->page_pool);
    s.tail_pages_total = c->tail_pool.n;
    s.tail_pages_free = c->tail_pool.n_free;
    s.tail_pages_in_use = s.tail_pages_total - s.tail_pages_free;
    s.tail_pages_shared = count_shared(&c->tail_pool);
    for (int i = 0; i < c->info.max_seqs; i++)
        if (c->seqs[i].live) s.tokens += c->seqs[i].len;
    const double G = (double)c->info.block_size;
    s.record_bytes_per_token = (double)c->info.block_bytes / G;
    s.arena_bytes_per_token = c->info.capacity_tokens
                                  ? (double)c->info.arena_bytes / (double)c->info.capacity_tokens
                                  : 0.0;
    if (s.tokens > 0)
        s.used_bytes_per_token = ((double)s.blocks_in_use * (double)c->info.block_bytes +
                                  (double)s.pages_in_use * (double)c->info.page_bytes +
                                  (double)s.tail_pages_in_use * (double)c->info.tail_page_bytes +
                                  (double)s.n_seqs * (double)c->info.sink_bytes) /
                                 (double)s.tokens;
    *out = s;
    return KVARN_OK;
}

kvarn_status kvarn_cache_layer_view(const kvarn_cache *c, int layer, kvarn_paged_kv *out)
{
    if (c == NULL || out == NULL || layer < 0 || layer >= c->info.n_layers)
        return KVARN_ERR_INVALID_ARG;
    *out = kvarn__layer_view(c, layer);
    return KVARN_OK;
}

int kvarn_cache_block_refs(const kvarn_cache *c, int32_t block)
{
    if (c == NULL || block < 0 || block >= c->block_pool.n) return -1;
    return c->block_pool.refs[block];
}

int kvarn_cache_page_refs(const kvarn_cache *c, int32_t page)
{
    if (c == NULL || page < 0 || page >= c->page_pool.n) return -1;
    return c->page_pool.refs[page];
}

int kvarn_cache_tail_page_refs(const kvarn_cache *c, int32_t page)
{
    if (c == NULL || page < 0 || page >= c->tail_pool.n) return -1;
    return c->tail_pool.refs[page];
}
