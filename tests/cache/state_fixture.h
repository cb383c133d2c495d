/* state_fixture.h -- sequences to save and restore (include/kvarn/state.h),
 * shared by tests/cache/test_cache_state.c (records, reads, errors) and
 * tests/attn/test_attn_state.c (attention over a restored sequence): a
 * few caches of different formats, sinks, tails and stagings, filled with
 * random K/V, and the comparison of two sequences. Header only. */
#ifndef KVARN_TESTS_CACHE_STATE_FIXTURE_H
#define KVARN_TESTS_CACHE_STATE_FIXTURE_H

#define KVARN_EXPERIMENTAL_API /* kvarn_cache_block_refs, _page_refs */
#include <stdlib.h>
#include <string.h>

#include "kvarn/cache.h"
#include "kvarn/kvarn.h"
#include "kvarn/state.h"
#include "common/testutil.h"

enum { ST_L = 2, ST_HK = 2, ST_D = 64 };

/* One sequence to save: its cache's settings and how it was filled. */
typedef struct st_case {
    const char *name;
    const char *fmt;
    int staging;      /* KVarN staging */
    int sink_tokens;  /* KVarN: 0 = one tile */
    int T;            /* KVarN tail_page_tokens */
    int G;            /* per-token block size */
    int len;          /* tokens written and committed up to committed */
    int committed;    /* committed_len (tokens past it: staged drafts) */
    int exact;        /* 1: written with kvarn_cache_write_exact */
    int fork;         /* 1: the saved sequence is a fork of one, grown by fork tokens */
} st_case;

static const st_case st_cases[] = {
    /* partial sink (64 + 20 tokens), drafts past committed_len */
    {"kvarn g64 fp16 staging, partial sink", "kvarn_k4v2_g64", KVARN_STAGING_FP16, 84, 0, 0, 300,
     290, 0, 0},
    /* small tail pages, a full tail tile with exact records not committed */
    {"kvarn g128 int8 staging, small tail, exact", "kvarn_k4v2_g128", KVARN_STAGING_INT8, 0, 32,
     0, 128 * 3 + 40, 256, 1, 0},
    {"kvarn g64c fp8 staging", "kvarn_k4v4_g64c", KVARN_STAGING_FP8_E4M3, 0, 0, 0, 200, 200, 0, 0},
    {"int8 per-token", "int8", 0, 0, 0, 16, 77, 77, 0, 0},
    {"fp16 per-token", "fp16", 0, 0, 0, 16, 50, 40, 0, 0},
    /* a fork that shares its parent's tiles, grown by 70 tokens */
    {"kvarn fork", "kvarn_k4v2_g64", KVARN_STAGING_FP16, 84, 0, 0, 150, 150, 0, 70},
    {"int4 fork", "int4", 0, 0, 0, 16, 40, 40, 0, 30},
};
#define ST_N_CASES (int)(sizeof st_cases / sizeof st_cases[0])

static inline kvarn_cache_opts st_opts(const st_case *k)
{
    kvarn_cache_opts o = kvarn_cache_default_opts();
    if (kvarn_format_parse(k->fmt, &o.format) != KVARN_OK) o.format.kind = KVARN_KIND_COUNT;
    o.n_layers = ST_L;
    o.n_kv_heads = ST_HK;
    o.head_dim = ST_D;
    o.max_seqs = 4;
    o.budget_bytes = 16u << 20;
    o.max_seq_len = 4096;
    if (o.format.kind == KVARN_KIND_KVARN) {
        o.staging = k->staging;
        o.sink_tokens = k->sink_tokens;
        o.tail_page_tokens = k->T;
        o.n_pages = 40;
    } else {
        o.block_size = k->G;
    }
    return o;
}

/* k, v: fp32 [n][Hk][D] of layer l, token pos.. (seeded by pos and l, so
 * that the same tokens can be made again for another cache). */
static inline void st_kv(int l, int pos, int n, float *k, float *v)
{
    const size_t row = (size_t)ST_HK * ST_D;
    for (int j = 0; j < n; j++) {
        test_rng r;
        test_rng_seed(&r, 0x57a7e000u + (uint64_t)(pos + j) * 7919u + (uint64_t)l);
        for (size_t i = 0; i < row; i++) {
            k[(size_t)j * row + i] = (float)(1.5 * test_rng_normal(&r)) + (i % ST_D == 5 ? 4.0f : 0.0f);
            v[(size_t)j * row + i] = (float)test_rng_normal(&r);
        }
    }
}

/* Append n tokens to seq (all layers), then commit up to committed. */
static inline kvarn_status st_append(kvarn_cache *c, int seq, int n, int committed, int exact)
{
    kvarn_cache_seq_info si;
    kvarn_status st = kvarn_cache_seq_get_info(c, seq, &si);
    if (st == KVARN_OK) st = kvarn_cache_reserve(c, seq, n);
    const size_t row = (size_t)ST_HK * ST_D;
    float *k = malloc(sizeof(float) * row * (size_t)(n ? n : 1));
    float *v = malloc(sizeof(float) * row * (size_t)(n ? n : 1));
    for (int l = 0; l < ST_L && st == KVARN_OK; l++) {
        st_kv(l, si.seq_len, n, k, v);
        st = exact ? kvarn_cache_write_exact(c, seq, l, si.seq_len, n, k, v)
                   : kvarn_cache_write(c, seq, l, si.seq_len, n, k, v);
    }
    free(k);
    free(v);
    if (st == KVARN_OK) st = kvarn_cache_commit(c, seq, committed);
    return st;
}

/* A cache for case k with the case's sequence in it (*seq; for a fork case
 * the child, its parent stays live beside it). */
static inline kvarn_cache *st_build(const st_case *k, int *seq)
{
    kvarn_cache_opts o = st_opts(k);
    kvarn_cache *c = NULL;
    if (kvarn_cache_create(&o, &c) != KVARN_OK) return NULL;
    int s = -1;
    kvarn_status st = kvarn_cache_seq_create(c, &s);
    /* in two chunks, the second one a decode-sized step */
    if (st == KVARN_OK) st = st_append(c, s, k->len - 1, k->committed < k->len - 1 ? k->committed : k->len - 1, k->exact);
    if (st == KVARN_OK) st = st_append(c, s, 1, k->committed, k->exact);
    if (st == KVARN_OK && k->fork) {
        int child = -1;
        st = kvarn_cache_seq_fork(c, s, &child);
        if (st == KVARN_OK) st = st_append(c, child, k->fork, k->len + k->fork, 0);
        s = child;
    }
    if (st != KVARN_OK) {
        kvarn_cache_destroy(c);
        return NULL;
    }
    *seq = s;
    return c;
}

/* The stream of seq, malloc'ed; *n its bytes. NULL on error. */
static inline uint8_t *st_save(const kvarn_cache *c, int seq, size_t *n)
{
    if (kvarn_cache_seq_state_size(c, seq, n) != KVARN_OK) return NULL;
    uint8_t *b = malloc(*n);
    size_t w = 0;
    if (b == NULL || kvarn_cache_seq_save(c, seq, b, *n, &w) != KVARN_OK || w != *n) {
        free(b);
        return NULL;
    }
    return b;
}

/* Everything a failed call must leave as it was: the counters and the
 * reference count of every block, page and small tail page. Returns a
 * malloc'ed snapshot of *n bytes. */
static inline uint8_t *st_snapshot(const kvarn_cache *c, size_t *n)
{
    kvarn_cache_stats s;
    memset(&s, 0, sizeof s);
    kvarn_cache_get_stats(c, &s);
    const size_t ids = (size_t)s.blocks_total + (size_t)s.pages_total + (size_t)s.tail_pages_total;
    *n = sizeof s + ids * sizeof(int);
    uint8_t *b = malloc(*n);
    memcpy(b, &s, sizeof s);
    int *r = (int *)(void *)(b + sizeof s);
    for (int i = 0; i < s.blocks_total; i++) *r++ = kvarn_cache_block_refs(c, i);
    for (int i = 0; i < s.pages_total; i++) *r++ = kvarn_cache_page_refs(c, i);
    for (int i = 0; i < s.tail_pages_total; i++) *r++ = kvarn_cache_tail_page_refs(c, i);
    return b;
}

/* Whether sequences a (cache ca) and b (cache cb) hold the same: their
 * info, every token of every layer as kvarn_cache_read gives it (both
 * bases), bit for bit, and their streams byte for byte. 1 if so. */
static inline int st_same(kvarn_cache *ca, int a, kvarn_cache *cb, int b)
{
    kvarn_cache_seq_info ia, ib;
    if (kvarn_cache_seq_get_info(ca, a, &ia) != KVARN_OK ||
        kvarn_cache_seq_get_info(cb, b, &ib) != KVARN_OK || memcmp(&ia, &ib, sizeof ia) != 0)
        return 0;
    const size_t n = (size_t)ia.seq_len * ST_HK * ST_D + 1;
    float *x[4];
    for (int i = 0; i < 4; i++) x[i] = malloc(n * sizeof(float));
    int same = 1;
    for (int l = 0; l < ST_L && same; l++)
        for (unsigned f = 0; f < 2 && same; f++) {
            const unsigned flags = f ? KVARN_DECODE_ROTATED : 0u;
            same = kvarn_cache_read(ca, a, l, 0, ia.seq_len, x[0], x[1], flags) == KVARN_OK &&
                   kvarn_cache_read(cb, b, l, 0, ib.seq_len, x[2], x[3], flags) == KVARN_OK &&
                   memcmp(x[0], x[2], (n - 1) * sizeof(float)) == 0 &&
                   memcmp(x[1], x[3], (n - 1) * sizeof(float)) == 0;
        }
    for (int i = 0; i < 4; i++) free(x[i]);
    size_t na = 0, nb = 0;
    uint8_t *sa = st_save(ca, a, &na), *sb = st_save(cb, b, &nb);
    same = same && sa && sb && na == nb && memcmp(sa, sb, na) == 0;
    free(sa);
    free(sb);
    return same;
}

#endif
