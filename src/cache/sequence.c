/*
 * sequence.c -- sequences of the paged cache: create, fork (prefix sharing
 * by reference counts), free, reserve (block and page allocation for all
 * layers, copy-on-write of a shared tile, atomic), truncate (rollback), and
 * the block table and slot mapping an engine reads.
 * Source: include/kvarn/paged.h (the paged layout), ../shared/spec/KVARN.md
 * "The fp16 tail and the sink".
 */
#include <stdlib.h>
#include <string.h>

#include "cache/cache_internal.h"

kvarn_seq *kvarn__seq_get(const kvarn_cache *c, int seq)
{
    if (c == NULL || seq < 0 || seq >= c->info.max_seqs || !c->seqs[seq].live) return NULL;
    return &c->seqs[seq];
}

static int n_tiles_of(const kvarn_cache *c, int len)
{
    return (len + c->info.block_size - 1) / c->info.block_size;
}

/* Tile t is read from a page: the sink, or the tail past the quantized run. */
static int tile_in_page(const kvarn_cache *c, const kvarn_seq *s, int t)
{
    return c->is_kvarn && (t < c->info.sink_tiles || t >= c->info.sink_tiles + s->n_quant);
}

void kvarn__seq_set_entry(const kvarn_cache *c, kvarn_seq *s, int t)
{
    /* a tail tile in small pages has no one id: its entry is not read */
    s->table[t] = tile_in_page(c, s, t) ? s->pg[t] : s->blk[t];
}

/* Small tail pages covering tokens [0, len): ceil(len / T). */
static int n_small_of(const kvarn_cache *c, int len)
{
    return (len + c->tail_T - 1) / c->tail_T;
}

/* Small pages per tile, G / T (c->small_tail). */
static int small_per_tile(const kvarn_cache *c)
{
    return c->info.block_size / c->tail_T;
}

int kvarn__seq_frozen_len(const kvarn_cache *c, const kvarn_seq *s)
{
    return s->n_quant > 0 ? (c->info.sink_tiles + s->n_quant) * c->info.block_size : 0;
}

void kvarn__seq_clear_exact(const kvarn_cache *c, kvarn_seq *s, int t0, int t1)
{
    const size_t L = (size_t)c->info.n_layers;
    if (t0 < 0) t0 = 0;
    if (t1 > c->max_tiles) t1 = c->max_tiles;
    if (s->exact != NULL && t1 > t0) memset(s->exact + (size_t)t0 * L, 0, (size_t)(t1 - t0) * L);
}

/* A free slot with its arrays allocated, or an error. */
static kvarn_status seq_open(kvarn_cache *c, int *id)
{
    /* A free slot, preferably one that kept its arrays from an earlier
     * sequence (kvarn_cache_seq_free): that one needs no memory. */
    int slot = -1;
    for (int i = 0; i < c->info.max_seqs; i++)
        if (!c->seqs[i].live && (slot < 0 || (c->seqs[i].mem && !c->seqs[slot].mem))) slot = i;
    if (slot < 0) return KVARN_ERR_OUT_OF_BLOCKS;

    /* seq_bytes() in capacity.c checked this sum against size_t at create. */
    const size_t T = (size_t)c->max_tiles;
    const size_t Q = c->small_tail ? (size_t)small_per_tile(c) : 0;
    const size_t L = (size_t)c->info.n_layers;
    const size_t M = c->is_kvarn ? T * L : 0; /* the exact-record marks */
    const size_t bytes = (3 + Q) * T * sizeof(int32_t) + L * sizeof(int) + M;
    void *mem = c->seqs[slot].mem ? c->seqs[slot].mem : kvarn__malloc(&c->alloc, bytes ? bytes : 1, 1);
    if (mem == NULL) return KVARN_ERR_NOMEM;
    kvarn_seq *s = &c->seqs[slot];
    memset(s, 0, sizeof *s);
    s->mem = mem;
    s->table = mem;
    s->blk = s->table + T;
    s->pg = s->blk + T;
    s->tp = Q ? s->pg + T : NULL;
    s->written = (int *)(void *)(s->pg + T + Q * T);
    s->exact = M ? (uint8_t *)(void *)(s->written + L) : NULL;
    if (M) memset(s->exact, 0, M);
    for (size_t t = 0; t < T; t++) s->table[t] = s->blk[t] = s->pg[t] = -1;
    for (size_t q = 0; q < Q * T; q++) s->tp[q] = -1;
    for (int l = 0; l < c->info.n_layers; l++) s->written[l] = 0;
    *id = slot;
    return KVARN_OK;
}

kvarn_status kvarn_cache_seq_create(kvarn_cache *c, int *seq)
{
    if (c == NULL || seq == NULL) return KVARN_ERR_INVALID_ARG;
    int id;
    kvarn_status st = seq_open(c, &id);
    if (st != KVARN_OK) return st;
    c->seqs[id].live = 1;
    c->n_live++;
    *seq = id;
    return KVARN_OK;
}

kvarn_status kvarn_cache_seq_fork(kvarn_cache *c, int parent, int *child)
{
    if (child == NULL) return KVARN_ERR_INVALID_ARG;
    kvarn_seq *p = kvarn__seq_get(c, parent);
    if (p == NULL) return KVARN_ERR_INVALID_ARG;
    int id;
    kvarn_status st = seq_open(c, &id);
    if (st != KVARN_OK) return st;
    kvarn_seq *s = &c->seqs[id];
    p = &c->seqs[parent];
    s->len = p->len;
    s->n_quant = p->n_quant;
    s->committed_len = p->committed_len;
    const int nt = n_tiles_of(c, p->len);
    for (int t = 0; t < nt; t++) {
        s->table[t] = p->table[t];
        s->blk[t] = p->blk[t];
        s->pg[t] = p->pg[t];
        kvarn__pool_incref(&c->block_pool, s->blk[t]);
        kvarn__pool_incref(&c->page_pool, s->pg[t]);
    }
    if (c->small_tail)
        for (int q = 0; q < n_small_of(c, p->len); q++) {
            s->tp[q] = p->tp[q];
            kvarn__pool_incref(&c->tail_pool, s->tp[q]);
        }
    memcpy(s->written, p->written, (size_t)c->info.n_layers * sizeof(int));
    /* records written from exact K/V sit in blocks the child now shares:
     * its commit keeps them too (re-encoding a shared block from the
     * staged copy would change the parent's record) */
    if (s->exact != NULL) memcpy(s->exact, p->exact, (size_t)nt * (size_t)c->info.n_layers);
    /* A quantized partial sink tile reads its first r tokens from the
     * sequence's own sink slot: the child gets a copy (slots are per
     * sequence, not shared). */
    if (c->sinks && p->n_quant > 0)
        for (int l = 0; l < c->info.n_layers; l++)
            memcpy(kvarn__sink_kv(c, l, id, 0, 0), kvarn__sink_kv(c, l, parent, 0, 0),
                   (size_t)c->info.n_kv_heads *
                       kvarn__staging_bytes(c, c->info.sink_partial));
    s->live = 1;
    c->n_live++;
    *child = id;
    return KVARN_OK;
}

/* Drop what s holds past its first new_len tokens: tiles [n_tiles(new_len),
 * n_tiles(len)) and small tail pages [n_small(new_len), n_small(len)). */
static void drop_from(kvarn_cache *c, kvarn_seq *s, int new_len)
{
    const int nt = n_tiles_of(c, s->len);
    for (int t = n_tiles_of(c, new_len); t < nt; t++) {
        kvarn__pool_decref(&c->block_pool, s->blk[t]);
        kvarn__pool_decref(&c->page_pool, s->pg[t]);
        s->table[t] = s->blk[t] = s->pg[t] = -1;
    }
    if (c->small_tail)
        for (int q = n_small_of(c, new_len); q < n_small_of(c, s->len); q++) {
            kvarn__pool_decref(&c->tail_pool, s->tp[q]);
            s->tp[q] = -1;
        }
}

kvarn_status kvarn_cache_seq_free(kvarn_cache *c, int seq)
{
    kvarn_seq *s = kvarn__seq_get(c, seq);
    if (s == NULL) return KVARN_ERR_INVALID_ARG;
    drop_from(c, s, 0);
    /* The slot keeps its arrays (freed with the cache), so a sequence made
     * after a free needs no memory: a session reset cannot fail. */
    void *mem = s->mem;
    memset(s, 0, sizeof *s);
    s->mem = mem;
    c->n_live--;
    return KVARN_OK;
}

kvarn_status kvarn_cache_seq_get_info(const kvarn_cache *c, int seq,
                                      kvarn_cache_seq_info *out)
{
    const kvarn_seq *s = kvarn__seq_get(c, seq);
    if (s == NULL || out == NULL) return KVARN_ERR_INVALID_ARG;
    kvarn_cache_seq_info i;
    memset(&i, 0, sizeof i);
    i.seq_len = s->len;
    i.n_tiles = n_tiles_of(c, s->len);
    if (c->is_kvarn) {
        int ct = c->info.sink_tiles + s->n_quant;
        i.committed_tiles = ct < i.n_tiles ? ct : i.n_tiles;
    } else {
        i.committed_tiles = i.n_tiles;
    }
    i.quantized_tiles = s->n_quant;
    i.committed_len = s->committed_len;
    i.frozen_len = kvarn__seq_frozen_len(c, s);
    *out = i;
    return KVARN_OK;
}

/* Copy one page (all layers) or one block (all layers). */
static void copy_page(kvarn_cache *c, int32_t dst, int32_t src)
{
    for (int l = 0; l < c->info.n_layers; l++)
        memcpy(kvarn__page_kv(c, l, dst, 0, 0), kvarn__page_kv(c, l, src, 0, 0),
               c->page_stride);
}

static void copy_tail_page(kvarn_cache *c, int32_t dst, int32_t src)
{
    for (int l = 0; l < c->info.n_layers; l++)
        memcpy(kvarn__tail_kv(c, l, dst, 0, 0), kvarn__tail_kv(c, l, src, 0, 0),
               (size_t)c->info.n_kv_heads *
                   kvarn__staging_bytes(c, c->tail_T));
}

static void copy_block(kvarn_cache *c, int32_t dst, int32_t src)
{
    for (int l = 0; l < c->info.n_layers; l++)
        memcpy(kvarn__block_record(c, l, dst, 0), kvarn__block_record(c, l, src, 0),
               c->info.block_stride);
}

kvarn_status kvarn_cache_reserve(kvarn_cache *c, int seq, int n_new)
{
    kvarn_seq *s = kvarn__seq_get(c, seq);
    if (s == NULL || n_new < 0) return KVARN_ERR_INVALID_ARG;
    if (n_new == 0) return KVARN_OK;
    if (n_new > c->info.max_seq_len - s->len) return KVARN_ERR_OUT_OF_BLOCKS;

    const int G = c->info.block_size, sink = c->info.sink_tiles;
    const int old_nt = n_tiles_of(c, s->len), new_nt = n_tiles_of(c, s->len + n_new);
    /* The partial last tile receives the first new token: a shared one is
     * made private (copy-on-write). It is never quantized (only full tiles
     * are). */
    const int cow = (s->len % G) ? s->len / G : -1;
    /* Small tail pages: the partial last small page of the tail receives
     * the first new token (made private like a tile), and every small page
     * a new token is the first to land in is taken, past the sink. */
    const int small = c->small_tail, T = c->tail_T;
    const int cow_q = small && s->len % T && s->len / G >= sink ? s->len / T : -1;
    const int q0 = small ? n_small_of(c, s->len) : 0, q1 = small ? n_small_of(c, s->len + n_new) : 0;
    const int q_sink = small ? sink * (G / T) : 0; /* first small page past the sink */
    const int q_first = q0 > q_sink ? q0 : q_sink;
    int need_b = 0, need_p = 0, need_t = 0;
    if (cow >= 0) {
        need_b += kvarn__pool_shared(&c->block_pool, s->blk[cow]);
        need_p += kvarn__pool_shared(&c->page_pool, s->pg[cow]);
    }
    if (cow_q >= 0) need_t += kvarn__pool_shared(&c->tail_pool, s->tp[cow_q]);
    if (small && q1 > q_first) need_t += q1 - q_first;
    for (int t = old_nt; t < new_nt; t++) {
        if (c->is_kvarn) {
            need_p += !small || t < sink;
            need_b += t >= sink;
        } else {
            need_b++;
        }
    }
    if (need_b > c->block_pool.n_free || need_p > c->page_pool.n_free ||
        need_t > c->tail_pool.n_free)
        return KVARN_ERR_OUT_OF_BLOCKS;

    /* From here on nothing can fail. */
    if (cow >= 0) {
        if (kvarn__pool_shared(&c->page_pool, s->pg[cow])) {
            int32_t p = kvarn__pool_alloc(&c->page_pool);
            copy_page(c, p, s->pg[cow]);
            kvarn__pool_decref(&c->page_pool, s->pg[cow]);
            s->pg[cow] = p;
        }
        if (kvarn__pool_shared(&c->block_pool, s->blk[cow])) {
            int32_t b = kvarn__pool_alloc(&c->block_pool);
            /* A KVarN tail tile's block holds no record yet: nothing to copy. */
            if (!c->is_kvarn) copy_block(c, b, s->blk[cow]);
            kvarn__pool_decref(&c->block_pool, s->blk[cow]);
            s->blk[cow] = b;
        }
        kvarn__seq_set_entry(c, s, cow);
    }
    if (cow_q >= 0 && kvarn__pool_shared(&c->tail_pool, s->tp[cow_q])) {
        int32_t p = kvarn__pool_alloc(&c->tail_pool);
        copy_tail_page(c, p, s->tp[cow_q]);
        kvarn__pool_decref(&c->tail_pool, s->tp[cow_q]);
        s->tp[cow_q] = p;
    }
    for (int q = q_first; q < q1; q++) s->tp[q] = kvarn__pool_alloc(&c->tail_pool);
    for (int t = old_nt; t < new_nt; t++) {
        if (c->is_kvarn) {
            s->pg[t] = !small || t < sink ? kvarn__pool_alloc(&c->page_pool) : -1;
            s->blk[t] = t >= sink ? kvarn__pool_alloc(&c->block_pool) : -1;
        } else {
            s->blk[t] = kvarn__pool_alloc(&c->block_pool);
        }
        kvarn__seq_set_entry(c, s, t);
    }
    s->len += n_new;
    return KVARN_OK;
}

kvarn_status kvarn_cache_truncate(kvarn_cache *c, int seq, int new_len)
{
    kvarn_seq *s = kvarn__seq_get(c, seq);
    if (s == NULL || new_len < 0 || new_len > s->len) return KVARN_ERR_INVALID_ARG;
    if (new_len < kvarn__seq_frozen_len(c, s)) return KVARN_ERR_STATE;
    drop_from(c, s, new_len);
    kvarn__seq_clear_exact(c, s, new_len / c->info.block_size, n_tiles_of(c, s->len));
    s->len = new_len;
    if (s->committed_len > new_len) s->committed_len = new_len;
    for (int l = 0; l < c->info.n_layers; l++)
        if (s->written[l] > new_len) s->written[l] = new_len;
    return KVARN_OK;
}

kvarn_status kvarn_cache_seq_view(const kvarn_cache *c, int seq, kvarn_seq_view *out)
{
    kvarn_cache_seq_info i;
    kvarn_status st = kvarn_cache_seq_get_info(c, seq, &i);
    if (st != KVARN_OK) return st;
    if (out == NULL) return KVARN_ERR_INVALID_ARG;
    out->block_table = c->seqs[seq].table;
    out->seq_len = i.seq_len;
    out->committed_tiles = i.committed_tiles;
    out->sink_slot = seq;
    /* the tail starts at tile max(sink_tiles, committed_tiles) = sink +
     * n_quant once the sequence is past its sink (paged.h) */
    out->tail_pages = NULL;
    if (c->small_tail) {
        const kvarn_seq *s = &c->seqs[seq];
        int first = c->info.sink_tiles + s->n_quant;
        if (first > c->max_tiles) first = c->max_tiles; /* a sink longer than the sequence */
        out->tail_pages = s->tp + (size_t)first * (size_t)small_per_tile(c);
    }
    return KVARN_OK;
}

kvarn_status kvarn_cache_block_table(const kvarn_cache *c, int seq,
                                     const int32_t **table, int *n_tiles)
{
    const kvarn_seq *s = kvarn__seq_get(c, seq);
    if (s == NULL || table == NULL || n_tiles == NULL) return KVARN_ERR_INVALID_ARG;
    *table = s->table;
    *n_tiles = n_tiles_of(c, s->len);
    return KVARN_OK;
}

kvarn_status kvarn_cache_slot_mapping(const kvarn_cache *c, int seq, int pos,
                                      int n, int64_t *slots)
{
    const kvarn_seq *s = kvarn__seq_get(c, seq);
    if (s == NULL || n < 0 || pos < 0 || pos > s->len || n > s->len - pos ||
        (n > 0 && slots == NULL))
        return KVARN_ERR_INVALID_ARG;
    const int G = c->info.block_size;
    for (int j = 0; j < n; j++) {
        int t = (pos + j) / G;
        if (c->is_kvarn && !tile_in_page(c, s, t)) return KVARN_ERR_STATE;
    }
    for (int j = 0; j < n; j++) {
        const int p = pos + j, t = p / G;
        if (c->small_tail && t >= c->info.sink_tiles) {
            /* a small tail page: its id space, T tokens per page */
            slots[j] = kvarn_paged_slot(s->tp[p / c->tail_T], c->tail_T, p % c->tail_T);
            continue;
        }
        int32_t id = c->is_kvarn ? s->pg[t] : s->blk[t];
        slots[j] = kvarn_paged_slot(id, G, p % G);
    }
    return KVARN_OK;
}
