/* paged_arena.h -- a caller-owned paged KV layer shaped as a vLLM plug-in
 * hands it to kvarn_paged_store / kvarn_paged_commit (include/kvarn/
 * paged_ops.h; layout in include/kvarn/paged.h "Who owns the arenas"), for
 * the tests (header only, so it is not linked into every test program):
 *   - the quantized block tensor [n_blocks][Hk][G][bytes_per_token] (uint8)
 *     with padding after every KV head's record (KVarN) or token record
 *     (per-token formats) and after every block, all odd byte counts, so that
 *     records sit at odd addresses and every writer must follow the strides;
 *   - the fp16 pool [n_pages][Hk][2][G][D] with padding after every head's
 *     K+V tile and after every page (even byte counts: paged.h requires it).
 * Both are filled with a position-dependent canary byte pattern, so that a
 * write to the wrong address, into padding or a wrong length shows when the
 * whole arena is compared with the expected one (pa_expect_* write what the
 * codec says an op must write into a canary copy).
 * The oracles are the codec's public calls: kvarn_encode for records,
 * kvarn_hadamard (the rotation kvarn_encode applies itself when not
 * prerotated) and kvarn_fp32_to_fp16 (IEEE round to nearest even) for pages. */
#ifndef KVARN_PAGED_ARENA_H
#define KVARN_PAGED_ARENA_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "codec/hadamard.h"
#include "common/testutil.h"
#include "kvarn/kvarn.h"
#include "kvarn/paged.h"
#include "kvarn/paged_ops.h"
#include "kvarn/record.h"

enum {
    PA_REC_PAD = 5,    /* bytes after each KV head's record (KVarN) */
    PA_TOK_PAD = 3,    /* bytes after each token record (per-token) */
    PA_HEAD_PAD = 7,   /* bytes after each KV head's G token records (per-token) */
    PA_BLOCK_PAD = 11, /* bytes after each block */
    PA_PHEAD_PAD = 6,  /* bytes after each KV head's fp16 K+V tile */
    PA_PAGE_PAD = 10   /* bytes after each page */
};

typedef struct pa_arena {
    kvarn_paged_kv kv;
    kvarn_record_layout L;
    uint8_t *blocks;
    size_t blocks_bytes;
    uint16_t *pages; /* uint16_t storage: 2-byte aligned as paged.h requires */
    size_t pages_bytes;
} pa_arena;

static inline uint8_t pa_canary(size_t i)
{
    return (uint8_t)(0x5au ^ (uint8_t)(i * 151u) ^ (uint8_t)(i >> 8));
}

static inline void pa_fill_canary(uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++) p[i] = pa_canary(i);
}

/* Build a padded arena for format `name`, head_dim D, Hk KV heads;
 * G: tokens per block for per-token formats (KVarN uses its tile). KVarN
 * gets n_pages fp16 pages; per-token formats none (fp16_pages NULL).
 * Returns 0 on success. */
static inline int pa_make(pa_arena *a, const char *name, int D, int Hk, int G,
                          int n_blocks, int n_pages)
{
    memset(a, 0, sizeof *a);
    kvarn_paged_kv *kv = &a->kv;
    if (kvarn_format_parse(name, &kv->fmt) != KVARN_OK) return -1;
    if (kvarn_record_layout_get(&kv->fmt, D, &a->L) != KVARN_OK) return -2;
    const int is_kvarn = kv->fmt.kind == KVARN_KIND_KVARN;
    kv->head_dim = D;
    kv->n_kv_heads = Hk;
    kv->block_size = is_kvarn ? kv->fmt.tile_tokens : G;
    kv->sink_tiles = is_kvarn ? 1 : 0;
    if (is_kvarn) {
        kv->record_stride = a->L.record_bytes + PA_REC_PAD;
    } else {
        kv->token_record_bytes = a->L.record_bytes + PA_TOK_PAD;
        kv->record_stride = (size_t)G * kv->token_record_bytes + PA_HEAD_PAD;
    }
    kv->block_stride = (size_t)Hk * kv->record_stride + PA_BLOCK_PAD;
    kv->n_blocks = n_blocks;
    a->blocks_bytes = (size_t)n_blocks * kv->block_stride;
    a->blocks = malloc(a->blocks_bytes + 1);
    if (a->blocks == NULL) return -3;
    pa_fill_canary(a->blocks, a->blocks_bytes);
    kv->blocks = a->blocks;
    if (is_kvarn) {
        kv->page_head_stride = kvarn_paged_fp16_tile_bytes(kv->block_size, D) + PA_PHEAD_PAD;
        kv->page_stride = (size_t)Hk * kv->page_head_stride + PA_PAGE_PAD;
        kv->n_fp16_pages = n_pages;
        a->pages_bytes = (size_t)n_pages * kv->page_stride;
        a->pages = malloc(a->pages_bytes + 2);
        if (a->pages == NULL) return -4;
        pa_fill_canary((uint8_t *)a->pages, a->pages_bytes);
        kv->fp16_pages = a->pages;
    }
    return 0;
}

static inline void pa_free(pa_arena *a)
{
    free(a->blocks);
    free(a->pages);
    memset(a, 0, sizeof *a);
}

/* Offset of the pages in a snapshot: after the blocks, 16-byte aligned. */
static inline size_t pa_snap_pages_off(const pa_arena *a)
{
    return (a->blocks_bytes + 15) & ~(size_t)15;
}

/* A copy of the arena's bytes (blocks, then pages at pa_snap_pages_off), to
 * compare whole arenas before and after a call. Caller frees. */
static inline uint8_t *pa_snapshot(const pa_arena *a)
{
    uint8_t *s = malloc(pa_snap_pages_off(a) + a->pages_bytes + 1);
    if (s == NULL) return NULL;
    memcpy(s, a->blocks, a->blocks_bytes);
    if (a->pages_bytes) memcpy(s + pa_snap_pages_off(a), a->pages, a->pages_bytes);
    return s;
}

/* Whether the arena's bytes equal a snapshot (1) or not (0). */
static inline int pa_equals(const pa_arena *a, const uint8_t *snap)
{
    return memcmp(a->blocks, snap, a->blocks_bytes) == 0 &&
           (a->pages_bytes == 0 || memcmp(a->pages, snap + pa_snap_pages_off(a), a->pages_bytes) == 0);
}

/* A view of the same geometry over another copy of the bytes (the
 * snapshot layout of pa_snapshot), for writing expected contents. */
static inline kvarn_paged_kv pa_view_of(const pa_arena *a, uint8_t *snap)
{
    kvarn_paged_kv kv = a->kv;
    kv.blocks = snap;
    kv.fp16_pages = a->pages_bytes ? (uint16_t *)(void *)(snap + pa_snap_pages_off(a)) : NULL;
    return kv;
}

/* Oracle of one KVarN page row: x (fp32 [D], original basis) rotated by
 * kvarn_hadamard and rounded to fp16 (nearest even). */
static inline void pa_expect_page_row(uint16_t *dst, const float *x, int D)
{
    float t[1024];
    memcpy(t, x, (size_t)D * sizeof(float));
    kvarn_hadamard(t, D);
    for (int d = 0; d < D; d++) {
        dst[d] = kvarn_fp32_to_fp16(t[d]);
    }
}

/* Store expected of kvarn_paged_store into the view `ev` (a pa_view_of
 * copy): k, v fp32 [n][Hk][D], slots int64 [n]. Returns 0 on success. */
static inline int pa_expect_store(const kvarn_paged_kv *ev, const float *k, const float *v,
                                  const int64_t *slots, int n)
{
    const int G = ev->block_size, Hk = ev->n_kv_heads, D = ev->head_dim;
    for (int j = 0; j < n; j++) {
        if (slots[j] < 0) continue;
        int32_t id = (int32_t)(slots[j] / G);
        int off = (int)(slots[j] % G);
        for (int h = 0; h < Hk; h++) {
            const float *kx = k + ((size_t)j * Hk + h) * D, *vx = v + ((size_t)j * Hk + h) * D;
            if (ev->fmt.kind == KVARN_KIND_KVARN) {
                pa_expect_page_row(kvarn_paged_page_k(ev, id, h) + (size_t)off * D, kx, D);
                pa_expect_page_row(kvarn_paged_page_v(ev, id, h) + (size_t)off * D, vx, D);
            } else {
                /* the token record's own bytes: its padding stays canary */
                uint8_t rec[8192];
                size_t rb = kvarn_record_bytes(&ev->fmt, D);
                if (rb == 0 || rb > sizeof rec) return -1;
                if (kvarn_encode(&ev->fmt, D, kx, vx, rec, rb, NULL, 0, NULL) != KVARN_OK)
                    return -2;
                memcpy(kvarn_paged_token_record(ev, id, h, off), rec, rb);
            }
        }
    }
    return 0;
}

/* Oracle of one KVarN tile as kvarn_paged_commit must write it: K and V
 * (fp32 [G][D], original basis, token-major) each rotated row by row with
 * kvarn_hadamard, rounded to fp16 and widened back (exact), then
 * kvarn_encode(prerotated = 1) into rec (L.record_bytes). Returns the
 * codec's status. */
static inline kvarn_status pa_oracle_record(const kvarn_format *fmt, int D, const float *k,
                                            const float *v, uint8_t *rec, size_t rec_bytes,
                                            const kvarn_codec_opts *opts)
{
    const int G = fmt->tile_tokens;
    const size_t GD = (size_t)G * D;
    float *tk = malloc(GD * sizeof(float)), *tv = malloc(GD * sizeof(float));
    size_t wsz = kvarn_encode_workspace_bytes(fmt, D);
    void *ws = malloc(wsz + 16);
    kvarn_status st = KVARN_ERR_NOMEM;
    if (tk && tv && ws) {
        for (size_t e = 0; e < GD; e++) {
            tk[e] = k[e];
            tv[e] = v[e];
        }
        for (int t = 0; t < G; t++) {
            kvarn_hadamard(tk + (size_t)t * D, D);
            kvarn_hadamard(tv + (size_t)t * D, D);
        }
        for (size_t e = 0; e < GD; e++) {
            tk[e] = kvarn_fp16_to_fp32(kvarn_fp32_to_fp16(tk[e]));
            tv[e] = kvarn_fp16_to_fp32(kvarn_fp32_to_fp16(tv[e]));
        }
        kvarn_codec_opts co = KVARN_CODEC_OPTS_DEFAULT;
        if (opts) co = *opts;
        co.prerotated = 1;
        st = kvarn_encode(fmt, D, tk, tv, rec, rec_bytes, ws, wsz, &co);
    }
    free(tk);
    free(tv);
    free(ws);
    return st;
}

/* Gather the K/V of one KV head h for tokens [t0, t0 + G) of a sequence
 * stored as fp32 [len][Hk][D] into token-major [G][D] tiles. */
static inline void pa_gather_tile(const float *k, const float *v, int Hk, int D, int h, int t0,
                                  int G, float *tk, float *tv)
{
    for (int t = 0; t < G; t++) {
        memcpy(tk + (size_t)t * D, k + ((size_t)(t0 + t) * Hk + h) * D, (size_t)D * sizeof(float));
        memcpy(tv + (size_t)t * D, v + ((size_t)(t0 + t) * Hk + h) * D, (size_t)D * sizeof(float));
    }
}

#endif
