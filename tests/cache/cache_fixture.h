/* cache_fixture.h -- helpers shared by the paged-cache tests: caches with an
 * exact number of blocks and pages, random K/V, and the expected read-back
 * of tokens computed by hand with the codec (kvarn_encode / kvarn_decode)
 * and the codec's Hadamard rotation (src/codec/hadamard.h). Header only. */
#ifndef KVARN_TESTS_CACHE_FIXTURE_H
#define KVARN_TESTS_CACHE_FIXTURE_H

#include <stdlib.h>
#include <string.h>

#include "kvarn/cache.h"
#include "kvarn/kvarn.h"
#include "codec/hadamard.h"
#include "common/testutil.h"

static inline kvarn_format fx_format(const char *name)
{
    kvarn_format f;
    memset(&f, 0, sizeof f);
    if (kvarn_format_parse(name, &f) != KVARN_OK) f.kind = KVARN_KIND_COUNT;
    return f;
}

/* Block size a test uses for format f: KVarN's tile, else G. */
static inline int fx_block_size(const kvarn_format *f, int G)
{
    return f->kind == KVARN_KIND_KVARN ? f->tile_tokens : G;
}

/* Options whose budget yields exactly n_blocks blocks and n_pages pages
 * (KVarN; per-token formats get no pages). */
static inline kvarn_cache_opts fx_opts(const char *name, int L, int Hk, int D,
                                       int G, int sink, int n_blocks, int n_pages,
                                       int max_seqs)
{
    kvarn_cache_opts o = kvarn_cache_default_opts();
    o.format = fx_format(name);
    o.n_layers = L;
    o.n_kv_heads = Hk;
    o.head_dim = D;
    const int kv = o.format.kind == KVARN_KIND_KVARN;
    const int g = fx_block_size(&o.format, G);
    o.block_size = kv ? 0 : G;
    o.sink_tiles = kv ? sink : 0;
    o.n_pages = kv ? n_pages : 0;
    o.max_seqs = max_seqs;
    /* fp16 staging: the page bytes below and the exact tail round trip the
     * cache tests check (record staging: test_cache_staging.c) */
    o.staging = KVARN_STAGING_FP16;
    size_t rec = kvarn_record_bytes(&o.format, D);
    uint64_t block = (uint64_t)L * Hk * rec * (kv ? 1 : (uint64_t)g);
    uint64_t page = kv ? (uint64_t)L * Hk * 2 * (uint64_t)g * D * 2 : 0;
    o.budget_bytes = block * (uint64_t)n_blocks + page * (uint64_t)o.n_pages;
    return o;
}

/* assert_memory_equal, fast on the (usual) equal path: cmocka's byte loop
 * dominates the randomized test otherwise. */
#define fx_assert_same(a, b, bytes)                                           \
    do {                                                                      \
        if (memcmp((a), (b), (bytes)) != 0) assert_memory_equal((a), (b), (bytes)); \
    } while (0)

static inline void fx_fill(test_rng *r, float *x, size_t n, float scale)
{
    for (size_t i = 0; i < n; i++) x[i] = (float)(test_rng_normal(r) * scale);
}

/* The fp16-rounded rotated copy of one D-vector: what a page holds. */
static inline void fx_rot16(const float *x, float *out, int D)
{
    memcpy(out, x, (size_t)D * sizeof(float));
    kvarn_hadamard(out, D);
    for (int d = 0; d < D; d++) out[d] = kvarn_fp16_to_fp32(kvarn_fp32_to_fp16(out[d]));
}

/* Expected read-back (original basis) of tokens [0, n) of one layer, given
 * the raw K and V written, fp32 [n][Hk][D] each:
 *   per-token formats: kvarn_decode(kvarn_encode(token-head));
 *   KVarN: tiles [sink, sink + nq) as the codec decodes the tile encoded
 *   (prerotated) from the fp16 rotated tokens; every other tile the fp16
 *   rotated tokens rotated back.
 * Returns 0 if any codec call failed. */
static inline int fx_expect(const kvarn_format *f, int G, int sink, int nq, int Hk,
                            int D, const float *k, const float *v, int n,
                            float *ek, float *ev)
{
    const size_t row = (size_t)Hk * D;
    if (f->kind != KVARN_KIND_KVARN) {
        size_t rb = kvarn_record_bytes(f, D);
        uint8_t *rec = malloc(rb);
        int ok = 1;
        for (size_t i = 0; i < (size_t)n * Hk && ok; i++) {
            ok = kvarn_encode(f, D, k + i * D, v + i * D, rec, rb, NULL, 0, NULL) == KVARN_OK &&
                 kvarn_decode(f, D, rec, rb, ek + i * D, ev + i * D, 0) == KVARN_OK;
        }
        free(rec);
        return ok;
    }
    for (size_t i = 0; i < (size_t)n * Hk; i++) {
        fx_rot16(k + i * D, ek + i * D, D);
        fx_rot16(v + i * D, ev + i * D, D);
    }
    const size_t GD = (size_t)G * D;
    size_t rb = kvarn_record_bytes(f, D), wb = kvarn_encode_workspace_bytes(f, D);
    float *tk = malloc(GD * sizeof(float)), *tv = malloc(GD * sizeof(float));
    uint8_t *rec = malloc(rb);
    void *ws = wb ? aligned_alloc(16, (wb + 15) & ~(size_t)15) : NULL;
    kvarn_codec_opts o = KVARN_CODEC_OPTS_DEFAULT;
    o.prerotated = 1;
    int ok = 1;
    const int ntiles = (n + G - 1) / G;
    for (int t = 0; t < ntiles && ok; t++) {
        const int quant = t >= sink && t < sink + nq;
        for (int h = 0; h < Hk && ok; h++) {
            for (int j = 0; j < G && t * G + j < n; j++) {
                memcpy(tk + (size_t)j * D, ek + (size_t)(t * G + j) * row + (size_t)h * D,
                       (size_t)D * sizeof(float));
                memcpy(tv + (size_t)j * D, ev + (size_t)(t * G + j) * row + (size_t)h * D,
                       (size_t)D * sizeof(float));
            }
            if (quant) {
                ok = t * G + G <= n &&
                     kvarn_encode(f, D, tk, tv, rec, rb, ws, wb, &o) == KVARN_OK &&
                     kvarn_decode(f, D, rec, rb, tk, tv, 0) == KVARN_OK;
            } else {
                for (int j = 0; j < G && t * G + j < n; j++) {
                    kvarn_hadamard(tk + (size_t)j * D, D);
                    kvarn_hadamard(tv + (size_t)j * D, D);
                }
            }
            for (int j = 0; j < G && t * G + j < n; j++) {
                memcpy(ek + (size_t)(t * G + j) * row + (size_t)h * D, tk + (size_t)j * D,
                       (size_t)D * sizeof(float));
                memcpy(ev + (size_t)(t * G + j) * row + (size_t)h * D, tv + (size_t)j * D,
                       (size_t)D * sizeof(float));
            }
        }
    }
    free(tk);
    free(tv);
    free(rec);
    free(ws);
    return ok;
}

#endif
