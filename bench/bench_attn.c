/* bench_attn.c -- decode attention time per call over the paged cache, for
 * every cache format, as a speed ratio to the fp16 cache measured in the
 * same run, with the bytes of cache read per second and the machine's
 * memcpy bandwidth for scale.
 *
 *   bench_attn [--quick] [--contexts 1024,4096,...] [--shapes smol,llama]
 *              [--batches 1,16] [--threads 1,2] [--formats fp16,int8,...|all]
 *              [--min-time SECONDS] [--max-mb MB] [--working-set MB]
 *              [--block-size G] [--queries Q] [--staging fp16|int8] [--scalar]
 *              [--no-amx] [--no-bf16] [--products]
 *
 * Shapes: smol = SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64),
 * llama = Llama-3-8B (32 / 8, head_dim 128). One call is one layer; the
 * layer is copied enough times that the calls, cycling through the copies,
 * touch at least --working-set MB (default 256, well above the L3 cache),
 * as a real model's layers do; --working-set 0 times one cache-resident
 * layer. Pages are
 * built the way tests/common/paged_fixture.h builds them (records from
 * kvarn_encode, fp16 sink page, shuffled block ids), except that a pool of
 * encoded tiles is copied into all blocks instead of encoding every tile
 * (the kernels' speed does not depend on the values). Per-token formats use
 * block size 16 (--block-size); KVarN keeps 1 fp16 sink tile and commits every full tile.
 * --queries Q (default 1) times kvarn_attn_multi instead, Q causal queries
 * per sequence at its last Q positions: a speculative verification step
 * of Q - 1 drafts (docs/vllm.md "Benchmark"); us/call is still per layer.
 * --staging int8 holds KVarN's staged tiles (the sink and the partial last
 * tile) as int8 token records, as the vLLM plug-in does by default on the
 * CPU (paged.h "Staging"), instead of fp16 rows.
 * --no-amx keeps the KVarN records of items of 16 or more query rows off
 * the AMX matrix kernel (attn.h kvarn_attn_kernel_info.matrix), where the
 * CPU has one: run with and without it to compare (docs/attention-matrix.md).
 * --no-bf16 keeps the fp8 and bf16 formats' blocks of such items off the
 * AVX512-BF16 kernel (kernel_avx512_bf16.c), in fp32, where the CPU has
 * AVX512-BF16 (docs/attention-simd.md).
 * --products (with --queries > 1) adds, after the formats of each shape,
 * batch and context, the scores and values products alone of the same call
 * through oneDNN and libxsmm where the build found them (attn_products.h:
 * what they are, what they leave out), on one thread: rows "prod:<library>"
 * in the same table, so that a library's products can be set against
 * kvarn's whole call (issue 44: take a library where it is faster).
 * Each configuration runs at least --min-time seconds (3 calls at least)
 * and reports its fastest call: with 1 thread timed by the thread's CPU
 * clock, with more threads by the wall clock. */
#define KVARN_EXPERIMENTAL_API /* the testing knobs (attn.h, cache.h) */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvarn/attn.h"
#include "kvarn/kvarn.h"
#include "kvarn/record.h"
#include "attn_products.h"
#include "format_list.h"
#include "simd_env.h"

#define MAXL 16
#define MAX_FORMATS 64

typedef struct list { int n; int v[MAXL]; } list;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* CPU time of the calling thread: with one worker the whole call runs on
 * it, and this clock does not count time lost to other processes on a
 * shared machine. */
static double thread_cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static double rnd(void) /* uniform [-1, 1) */
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / 4503599627370496.0 - 1.0;
}

/* A comma-separated list of positive integers ("1024,4096"). Returns 0 and
 * fills *out, or -1 for an empty list, an empty item, a non-number, a value
 * outside [1, INT_MAX] or more than MAXL items (*out untouched). */
static int parse_list(const char *s, list *out)
{
    list l = {0, {0}};
    for (;;) {
        if (l.n == MAXL) return -1;
        char *end;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (end == s || errno != 0 || v < 1 || v > INT_MAX) return -1;
        l.v[l.n++] = (int)v;
        if (*end == '\0') break;
        if (*end != ',') return -1;
        s = end + 1;
    }
    *out = l;
    return 0;
}

/* Whether every item of a comma-separated shape list names a shape of
 * names[0..n); sets used[i] for each shape listed. */
static int parse_shapes(const char *s, const char *const *names, int n, int *used)
{
    for (int i = 0; i < n; i++) used[i] = 0;
    while (1) {
        size_t len = strcspn(s, ",");
        int found = 0;
        for (int i = 0; i < n; i++)
            if (len == strlen(names[i]) && strncmp(s, names[i], len) == 0) used[i] = found = 1;
        if (!found) return -1;
        if (s[len] == '\0') return 0;
        s += len + 1;
    }
}

typedef struct bench_cache {
    kvarn_paged_kv kv;
    kvarn_seq_view *views;
    int32_t *tables;
    uint8_t *blocks;
    uint16_t *pages;
    double bytes_read; /* per call */
    int n_layers;      /* copies of the layer, to exceed the CPU caches */
    size_t blocks_bytes, pages_bytes; /* of one layer */
} bench_cache;

static void free_cache(bench_cache *c)
{
    free(c->views); free(c->tables); free(c->blocks); free(c->pages);
    memset(c, 0, sizeof *c);
}

/* Bytes the cache of this shape would take; 0 if the format cannot serve D. */
static double cache_bytes(const kvarn_format *fmt, int D, int Hk, int ctx, int batch)
{
    double bpt = kvarn_bytes_per_token_head(fmt, D);
    return bpt * (double)ctx * Hk * batch;
}

static int build_cache(bench_cache *c, const kvarn_format *fmt, int D, int Hk, int ctx, int batch,
                       int block_size, int n_layers, int staging_int8)
{
    memset(c, 0, sizeof *c);
    kvarn_record_layout L;
    if (kvarn_record_layout_get(fmt, D, &L) != KVARN_OK) return -1;
    const int kvarn = fmt->kind == KVARN_KIND_KVARN;
    const int G = kvarn ? fmt->tile_tokens : block_size, sink = kvarn ? 1 : 0;
    const int nt = (ctx + G - 1) / G;
    const size_t rec_stride = kvarn ? L.record_bytes : (size_t)G * L.record_bytes;
    const size_t block_stride = rec_stride * Hk;
    int n_pages = 0, n_blocks = 0;
    for (int i = 0; i < nt; i++) {
        int page = kvarn && (i < sink || (i + 1) * G > ctx);
        if (page) n_pages++; else n_blocks++;
    }
    n_pages *= batch;
    n_blocks *= batch;
    c->n_layers = n_layers;
    c->blocks_bytes = (size_t)(n_blocks ? n_blocks : 1) * block_stride;
    kvarn_paged_kv *kv = &c->kv;
    kv->fmt = *fmt;
    kv->head_dim = D;
    kv->n_kv_heads = Hk;
    kv->block_size = G;
    kv->sink_tiles = sink;
    kv->block_stride = block_stride;
    kv->record_stride = rec_stride;
    kv->token_record_bytes = kvarn ? 0 : L.record_bytes;
    kvarn_format i8;
    kvarn_record_layout L8;
    const int st8 = kvarn && staging_int8;
    if (st8) {
        if (kvarn_format_parse("int8", &i8) != KVARN_OK || kvarn_record_layout_get(&i8, D, &L8) != KVARN_OK)
            return -1;
        kv->staging = KVARN_STAGING_INT8;
        kv->staging_record_bytes = L8.record_bytes;
    }
    kvarn_paged_pack_pages(kv); /* kvarn_cache's layout */
    kv->n_blocks = n_blocks;
    kv->n_fp16_pages = n_pages;
    c->pages_bytes = (size_t)(n_pages ? n_pages : 1) * kv->page_stride;
    c->blocks = malloc(c->blocks_bytes * n_layers);
    c->pages = malloc(c->pages_bytes * n_layers);
    c->tables = malloc(sizeof(int32_t) * (size_t)nt * batch);
    c->views = malloc(sizeof(kvarn_seq_view) * (size_t)batch);
    if (!c->blocks || !c->pages || !c->tables || !c->views) return -2;
    kv->blocks = c->blocks;
    kv->fp16_pages = c->pages;

    /* A pool of encoded records, copied round robin into every block. */
    enum { POOL = 8 };
    size_t wsz = kvarn_encode_workspace_bytes(fmt, D);
    void *ws = wsz ? malloc(wsz) : NULL;
    float *k = malloc(sizeof(float) * (size_t)G * D), *v = malloc(sizeof(float) * (size_t)G * D);
    uint8_t *pool = malloc(POOL * rec_stride);
    for (int p = 0; p < POOL; p++) {
        for (int i = 0; i < G * D; i++) {
            k[i] = (float)(2.0 * rnd());
            v[i] = (float)rnd();
        }
        if (kvarn) {
            kvarn_encode(fmt, D, k, v, pool + p * rec_stride, rec_stride, ws, wsz, NULL);
        } else {
            for (int t = 0; t < G; t++)
                kvarn_encode(fmt, D, k + (size_t)t * D, v + (size_t)t * D,
                             pool + p * rec_stride + (size_t)t * L.record_bytes, L.record_bytes,
                             NULL, 0, NULL);
        }
    }
    for (int b = 0; b < n_blocks; b++)
        for (int h = 0; h < Hk; h++)
            memcpy(kvarn_paged_record(kv, b, h),
                   pool + (size_t)((b * 7 + h) % POOL) * rec_stride, rec_stride);
    if (st8) { /* int8 token records of random rotated K/V */
        for (int p = 0; p < n_pages; p++)
            for (int h = 0; h < Hk; h++)
                for (int t = 0; t < G; t++) {
                    for (int i = 0; i < D; i++) {
                        k[i] = (float)(2.0 * rnd());
                        v[i] = (float)rnd();
                    }
                    kvarn_encode(&i8, D, k, v, kvarn_paged_page_rec(kv, p, h, t), L8.record_bytes,
                                 NULL, 0, NULL);
                }
    } else {
        for (size_t i = 0; i < (size_t)n_pages * kv->page_stride / sizeof(uint16_t); i++)
            c->pages[i] = kvarn_fp32_to_fp16((float)rnd());
    }
    free(k); free(v); free(pool); free(ws);

    /* Shuffled ids: sequences interleave in the arena. */
    int32_t *bid = malloc(sizeof(int32_t) * (size_t)(n_blocks + 1));
    int32_t *pid = malloc(sizeof(int32_t) * (size_t)(n_pages + 1));
    for (int i = 0; i < n_blocks; i++) bid[i] = i;
    for (int i = 0; i < n_pages; i++) pid[i] = i;
    for (int i = n_blocks - 1; i > 0; i--) {
        int j = (int)((rnd() + 1.0) * 0.5 * (i + 1)) % (i + 1);
        int32_t t = bid[i]; bid[i] = bid[j]; bid[j] = t;
    }
    int nb = 0, np = 0;
    c->bytes_read = 0;
    for (int s = 0; s < batch; s++) {
        int32_t *tab = c->tables + (size_t)s * nt;
        int committed = kvarn ? ctx / G : nt;
        for (int i = 0; i < nt; i++) {
            int page = kvarn && (i < sink || i >= committed);
            tab[i] = page ? pid[np++] : bid[nb++];
            int cnt = ctx - i * G < G ? ctx - i * G : G;
            c->bytes_read += page ? (double)cnt * (st8 ? (double)L8.record_bytes : 4.0 * D) * Hk
                                  : (kvarn ? (double)L.record_bytes : (double)cnt * L.record_bytes) * Hk;
        }
        c->views[s].block_table = tab;
        c->views[s].seq_len = ctx;
        c->views[s].committed_tiles = committed;
    }
    free(bid); free(pid);
    for (int l = 1; l < n_layers; l++) {
        memcpy(c->blocks + l * c->blocks_bytes, c->blocks, c->blocks_bytes);
        memcpy((uint8_t *)c->pages + l * c->pages_bytes, c->pages, c->pages_bytes);
    }
    return 0;
}

/* The view of layer l (all layers share the block tables). */
static kvarn_paged_kv layer_kv(const bench_cache *c, int l)
{
    kvarn_paged_kv kv = c->kv;
    kv.blocks = c->blocks + (size_t)l * c->blocks_bytes;
    kv.fp16_pages = (uint16_t *)((uint8_t *)c->pages + (size_t)l * c->pages_bytes);
    return kv;
}

/* One layer's call: decode (one query per sequence), or Q causal queries
 * per sequence through kvarn_attn_multi. */
static kvarn_status call(const kvarn_paged_kv *kv, const bench_cache *c, int batch, int Hq,
                         int n_queries, const int32_t *qsl, const float *q, float *out,
                         const kvarn_attn_opts *o, kvarn_thread_pool *pool, void *ws, size_t wsz)
{
    if (n_queries == 1) return kvarn_attn_decode(kv, c->views, batch, Hq, q, out, o, pool, ws, wsz);
    kvarn_attn_opts m = *o;
    m.causal = 1;
    return kvarn_attn_multi(kv, c->views, batch, qsl, Hq, q, out, &m, pool, ws, wsz);
}

static double memcpy_gbs(void)
{
    size_t n = (size_t)256 << 20;
    char *a = malloc(n), *b = malloc(n);
    if (!a || !b) { free(a); free(b); return 0; }
    memset(a, 1, n);
    memset(b, 2, n);
    double best = 1e30;
    for (int i = 0; i < 4; i++) {
        double t = now_s();
        memcpy(b, a, n);
        t = now_s() - t;
        if (t < best) best = t;
        a[i] = b[n - 1 - i]; /* keep the copies alive */
    }
    free(a); free(b);
    return (double)n / best / 1e9;
}

int main(int argc, char **argv)
{
    if (simd_env_check("bench_attn")) return 2; /* KVARN_SIMD names no level */
    list ctxs, batches, threads;
    parse_list("1024,4096,8192,16384,32768", &ctxs);
    parse_list("1,16", &batches);
    parse_list("1,2", &threads);
    int bad_list = 0;
    const char *shapes = "smol,llama", *formats = NULL;
    double min_time = 0.3, max_mb = 3000, ws_mb = 256;
    int scalar = 0, block_size = 16, n_queries = 1, staging_int8 = 0, no_amx = 0, no_bf16 = 0,
        products = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *nx = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--quick")) {
            parse_list("1024,8192", &ctxs);
            parse_list("1", &batches);
            parse_list("1", &threads);
            min_time = 0.1;
        } else if (!strcmp(a, "--contexts") && nx) { bad_list |= parse_list(nx, &ctxs) ? 1 : 0; i++; }
        else if (!strcmp(a, "--batches") && nx) { bad_list |= parse_list(nx, &batches) ? 2 : 0; i++; }
        else if (!strcmp(a, "--threads") && nx) { bad_list |= parse_list(nx, &threads) ? 4 : 0; i++; }
        else if (!strcmp(a, "--shapes") && nx) { shapes = nx; i++; }
        else if (!strcmp(a, "--formats") && nx) { formats = nx; i++; }
        else if (!strcmp(a, "--min-time") && nx) { min_time = atof(nx); i++; }
        else if (!strcmp(a, "--max-mb") && nx) { max_mb = atof(nx); i++; }
        else if (!strcmp(a, "--block-size") && nx) { block_size = atoi(nx); i++; }
        else if (!strcmp(a, "--working-set") && nx) { ws_mb = atof(nx); i++; }
        else if (!strcmp(a, "--queries") && nx) { n_queries = atoi(nx); i++; }
        else if (!strcmp(a, "--staging") && nx && (!strcmp(nx, "fp16") || !strcmp(nx, "int8"))) {
            staging_int8 = !strcmp(nx, "int8");
            i++;
        } else if (!strcmp(a, "--scalar")) scalar = 1;
        else if (!strcmp(a, "--no-amx")) no_amx = 1;
        else if (!strcmp(a, "--no-bf16")) no_bf16 = 1;
        else if (!strcmp(a, "--products")) products = 1;
        else {
            const int help = !strcmp(a, "-h") || !strcmp(a, "--help");
            fprintf(help ? stdout : stderr,
                    "usage: bench_attn [--quick] [--contexts L] [--shapes smol,llama] "
                    "[--batches L] [--threads L] [--formats L] [--min-time S] "
                    "[--max-mb MB] [--working-set MB] [--block-size G] [--queries Q] [--staging fp16|int8] [--scalar] [--no-amx] [--no-bf16] [--products]\n");
            return help ? 0 : 2;
        }
    }
    struct { const char *name; int Hq, Hk, D; } shp[2] = {{"smol", 9, 3, 64}, {"llama", 32, 8, 128}};
    const char *const shape_names[2] = {shp[0].name, shp[1].name};
    int shape_used[2];
    if (bad_list) {
        fprintf(stderr, "bench_attn: --%s: expected a comma-separated list of integers in "
                        "[1, %d], at most %d items\n",
                bad_list & 1 ? "contexts" : bad_list & 2 ? "batches" : "threads", INT_MAX, MAXL);
        return 2;
    }
    if (parse_shapes(shapes, shape_names, 2, shape_used) != 0) {
        fprintf(stderr, "bench_attn: --shapes: unknown or empty shape in '%s' (accepted: smol, llama)\n",
                shapes);
        return 2;
    }
    if (n_queries < 1 || n_queries > 1024) {
        fprintf(stderr, "bench_attn: --queries: expected an integer in [1, 1024]\n");
        return 2;
    }
    for (int ci = 0; ci < ctxs.n; ci++)
        if (ctxs.v[ci] < n_queries) { /* causal: a sequence's queries lie in its context */
            fprintf(stderr, "bench_attn: --queries %d exceeds context %d (each context must hold "
                            "its queries)\n", n_queries, ctxs.v[ci]);
            return 2;
        }
    if (products && n_queries < 2) {
        fprintf(stderr, "bench_attn: --products times prefill / verification products: give --queries >= 2\n");
        return 2;
    }
    if (products) setenv("OMP_NUM_THREADS", "1", 1); /* oneDNN's OpenMP: the calling thread only */
    kvarn_attn_opts o0 = KVARN_ATTN_OPTS_DEFAULT(0.125f);
    kvarn_attn_testing knobs = {0, scalar, 0, no_amx, no_bf16};
    o0.testing = &knobs;
    printf("memcpy bandwidth (1 thread, 256 MiB): %.1f GB/s copied\n", memcpy_gbs());
    printf("kernels: %s\n", kvarn_attn_kernel_name(&o0));
    {
        kvarn_format k42;
        kvarn_attn_kernel_info info;
        if (kvarn_format_parse("kvarn_k4v2_g128", &k42) == KVARN_OK &&
            kvarn_attn_kernel_info_get(&k42, 64, 0, &o0, &info) == KVARN_OK)
            printf("matrix kernel (KVarN records, items of >= 16 query rows): %s\n",
                   info.matrix ? info.matrix : "none");
    }
    if (n_queries > 1) printf("queries: %d causal per sequence (kvarn_attn_multi)\n", n_queries);
    if (staging_int8) printf("staging: int8 token records (KVarN sink and partial tiles)\n");
    printf("%-6s %5s %6s %3s %-16s %10s %9s %9s\n", "shape", "batch", "ctx", "thr", "format",
           "us/call", "vs fp16", "GB/s");
    /* fp16 first (every ratio's baseline), then the listed formats (default
     * all), through the command's own list parser: an unknown name or an
     * empty item is an error, any name the library accepts runs. */
    kvarn_format fmts[MAX_FORMATS + 1], listed[MAX_FORMATS];
    char err[1024];
    int n_listed = format_list_parse(formats ? formats : "all", listed, MAX_FORMATS, err, sizeof err);
    if (n_listed < 0) {
        fprintf(stderr, "bench_attn: --formats: %s\n", err);
        return 2;
    }
    int nf = 0;
    kvarn_format_parse("fp16", &fmts[nf++]);
    for (int i = 0; i < n_listed; i++)
        if (strcmp(listed[i].name, "fp16") != 0) fmts[nf++] = listed[i];
    for (int si = 0; si < 2; si++) {
        if (!shape_used[si]) continue;
        const int D = shp[si].D, Hk = shp[si].Hk, Hq = shp[si].Hq;
        for (int bi = 0; bi < batches.n; bi++)
            for (int ci = 0; ci < ctxs.n; ci++) {
                const int batch = batches.v[bi], ctx = ctxs.v[ci];
                double t_fp16[MAXL] = {0};
                for (int fi = 0; fi < nf; fi++) {
                    const kvarn_format fmt = fmts[fi];
                    const char *fname = fmt.name;
                    if (cache_bytes(&fmt, D, Hk, ctx, batch) > max_mb * 1e6) {
                        printf("%-6s %5d %6d %3s %-16s   skipped (cache over --max-mb)\n", shp[si].name,
                               batch, ctx, "-", fname);
                        continue;
                    }
                    bench_cache c;
                    double layer_bytes = cache_bytes(&fmt, D, Hk, ctx, batch);
                    int n_layers = layer_bytes > 0 ? (int)(ws_mb * 1e6 / layer_bytes) + 1 : 1;
                    if (ws_mb <= 0) n_layers = 1;
                    if (n_layers * layer_bytes > max_mb * 1e6) n_layers = (int)(max_mb * 1e6 / layer_bytes);
                    if (n_layers < 1) n_layers = 1;
                    if (build_cache(&c, &fmt, D, Hk, ctx, batch, block_size, n_layers, staging_int8) != 0) {
                        printf("%-6s %5d %6d %3s %-16s   could not build\n", shp[si].name, batch, ctx,
                               "-", fname);
                        free_cache(&c);
                        continue;
                    }
                    const size_t nrow = (size_t)batch * n_queries;
                    float *q = malloc(sizeof(float) * nrow * Hq * D);
                    float *out = malloc(sizeof(float) * nrow * Hq * D);
                    int32_t *qsl = malloc(sizeof(int32_t) * ((size_t)batch + 1));
                    for (size_t i = 0; i < nrow * Hq * D; i++) q[i] = (float)rnd();
                    for (int s = 0; s <= batch; s++) qsl[s] = s * n_queries;
                    for (int ti = 0; ti < threads.n; ti++) {
                        kvarn_thread_pool *pool = NULL;
                        if (kvarn_thread_pool_create(threads.v[ti], &pool) != KVARN_OK) continue;
                        size_t wsz = kvarn_attn_workspace_bytes(&c.kv, Hq, batch, (int)nrow,
                                                                threads.v[ti], &o0);
                        kvarn_paged_kv kv = layer_kv(&c, 0);
                        void *ws = malloc(wsz);
                        kvarn_status st = call(&kv, &c, batch, Hq, n_queries, qsl, q, out, &o0,
                                               pool, ws, wsz); /* warm-up */
                        /* Best of the timed calls: the machine may be shared, and the
                         * fastest call is the one least disturbed by others. */
                        int iters = 0;
                        double t0 = now_s(), el = 0, best = 1e30;
                        while (st == KVARN_OK && (el < min_time || iters < 3 || iters < c.n_layers)) {
                            const int one = threads.v[ti] == 1;
                            kv = layer_kv(&c, (iters + 1) % c.n_layers);
                            double t1 = one ? thread_cpu_s() : now_s();
                            st = call(&kv, &c, batch, Hq, n_queries, qsl, q, out, &o0, pool, ws, wsz);
                            t1 = (one ? thread_cpu_s() : now_s()) - t1;
                            best = t1 < best ? t1 : best;
                            iters++;
                            el = now_s() - t0;
                        }
                        if (st != KVARN_OK) {
                            printf("%-6s %5d %6d %3d %-16s   error: %s\n", shp[si].name, batch, ctx,
                                   threads.v[ti], fname, kvarn_strerror(st));
                        } else {
                            double per = best;
                            if (fi == 0) t_fp16[ti] = per;
                            char ratio[32] = "      -";
                            if (t_fp16[ti] > 0) snprintf(ratio, sizeof ratio, "%8.2fx", t_fp16[ti] / per);
                            printf("%-6s %5d %6d %3d %-16s %10.1f %9s %9.2f\n", shp[si].name, batch, ctx,
                                   threads.v[ti], fname, per * 1e6, ratio, c.bytes_read / per / 1e9);
                            fflush(stdout);
                        }
                        free(ws);
                        kvarn_thread_pool_destroy(pool);
                    }
                    free(q); free(out); free(qsl);
                    free_cache(&c);
                }
                if (products) { /* one thread: the ratio is to fp16's first thread count */
                    prod_shape ps = {batch, Hk, D, 128, n_queries * (Hq / Hk), (ctx + 127) / 128, 1};
                    const double kvb = prod_kv_bytes(&ps, 2);
                    ps.n_copies = ws_mb > 0 ? (int)(ws_mb * 1e6 / kvb) + 1 : 1;
                    if (ps.n_copies * kvb > max_mb * 1e6) ps.n_copies = (int)(max_mb * 1e6 / kvb);
                    if (ps.n_copies < 1) ps.n_copies = 1;
                    for (int k = 0; k < PROD_COUNT; k++) {
                        char name[32];
                        snprintf(name, sizeof name, "prod:%s", prod_names[k]);
                        const double per = prod_time(k, &ps, min_time);
                        if (per <= 0) {
                            printf("%-6s %5d %6d %3d %-16s   not built in, or no kernel for the shape\n",
                                   shp[si].name, batch, ctx, 1, name);
                            continue;
                        }
                        char ratio[32] = "      -";
                        if (t_fp16[0] > 0) snprintf(ratio, sizeof ratio, "%8.2fx", t_fp16[0] / per);
                        printf("%-6s %5d %6d %3d %-16s %10.1f %9s %9.2f\n", shp[si].name, batch, ctx, 1,
                               name, per * 1e6, ratio,
                               prod_kv_bytes(&ps, prod_is_int8(k) ? 1 : 2) / per / 1e9);
                        fflush(stdout);
                    }
                }
            }
    }
    return 0;
}
