/*
 * bench_capacity.c -- effective KV-cache capacity, all memory counted, as a
 * multiple of the fp16 cache (issue 11).
 *
 * For a model shape, n concurrent sequences of len tokens and a format, the
 * bytes a server must give the paged cache to hold them: the smallest cache
 * (kvarn_cache_create's opts with max_seqs = n, max_seq_len = len, sink
 * length S and auto staging pages) whose kvarn_cache_capacity_get says it
 * holds n sequences of len, counted as its total_bytes (quantized records,
 * staged sink and tail pages, sink slots, block tables, id pools, scratch).
 * KVarN formats get one row per S of --sinks (tokens staged: 128 is
 * the default whole sink tile, 0 no sink, others a sink shorter than a tile
 * with the rest of that tile quantized, cache.h sink_tokens), and per T of
 * --tails (tokens per tail page: 128 = G, a whole tile per tail page;
 * 16 = small tail pages taken on demand, cache.h tail_page_tokens). The ratio
 * printed is fp16's total over the format's: the factor by which the same
 * memory holds more such requests. Two pools of tail pages: "auto" (the
 * cache's default, what lets every sequence fill a whole tail tile at the
 * same time: a page, or G / T small pages, per sequence plus the shared
 * reserve) and "mean" (sized for n sequences whose tails are spread evenly
 * over the tile: n * E[ceil(r / T)] pages over r uniform in [0, G), plus
 * one tile's worth for the sequence crossing a tile boundary; such a cache
 * answers KVARN_ERR_OUT_OF_BLOCKS when more tails than that are full at
 * once, e.g. sequences decoding in lockstep). No timing: the numbers are exact byte counts
 * from the library's one capacity computation (docs/paged-cache.md
 * "Capacity"), so the table does not depend on the machine.
 *
 * --staging fp16 | int8 | fp8_e4m3 | int4: how every staged KVarN token
 * (sink, tail, sink slots) is held, fp16 rows or a token record of that
 * per-token format (cache.h staging; fp8 is fp8_e4m3); default int8, the
 * cache's default.
 *
 *   bench_capacity [--formats LIST] [--seqs 1,16,64,256] [--lens 2048,8192]
 *                  [--shapes smol,llama] [--sinks 128,32,16,0] [--tails 128,16]
 *                  [--staging fp16|int8|fp8_e4m3|int4]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "format_list.h"
#include "kvarn/cache.h"
#include "kvarn/kvarn.h"

typedef struct shape { const char *name; int layers, kv_heads, head_dim; } shape;
static const shape SHAPES[] = {
    {"smol", 30, 3, 64},    /* SmolLM2-135M */
    {"llama", 32, 8, 128},  /* Llama-3-8B */
};

static int g_staging = KVARN_STAGING_INT8; /* --staging (the cache default) */

/* Tail pages of n sequences whose tails are spread evenly over a tile of G
 * tokens, in pages of T tokens: ceil(n * sum_r ceil(r / T) / G) over r in
 * [0, G), plus G / T for the sequence filling a tile before its commit. */
static int mean_pool(int n, int G, int T)
{
    uint64_t sum = 0;
    for (int r = 0; r < G; r++) sum += (uint64_t)((r + T - 1) / T);
    return (int)(((uint64_t)n * sum + (uint64_t)G - 1) / (uint64_t)G) + G / T;
}

/* Total bytes of the smallest cache of format f with sink length S tokens
 * (KVarN; -1: the default), tail pages of T tokens (KVarN; 0: whole tiles)
 * and the auto (mean = 0) or mean tail pool that holds n sequences of len
 * tokens; 0 on error (message on stderr). */
static uint64_t bytes_for(const shape *s, const kvarn_format *f, int S, int T, int mean, int n,
                          int len, kvarn_cache_capacity *out)
{
    kvarn_cache_opts o = kvarn_cache_default_opts();
    o.format = *f;
    o.n_layers = s->layers;
    o.n_kv_heads = s->kv_heads;
    o.head_dim = s->head_dim;
    o.max_seqs = n;
    o.max_seq_len = len;
    if (S >= 0) {
        o.sink_tokens = S;
        if (S == 0) o.sink_tiles = 0;
    }
    if (f->kind == KVARN_KIND_KVARN) {
        const int G = f->tile_tokens, sink = S >= 0 ? S / G : o.sink_tiles;
        o.tail_page_tokens = T < G ? T : 0;
        if (mean && T < G) o.n_tail_pages = mean_pool(n, G, T);
        if (mean) o.n_pages = n * sink + (T < G ? 0 : mean_pool(n, G, G));
        o.staging = g_staging;
    }
    o.budget_bytes = 0; /* sizing: per-block and per-page bytes, the pages */
    kvarn_cache_capacity cap;
    kvarn_status st = kvarn_cache_capacity_get(&o, 1, len, &cap);
    if (st != KVARN_OK) {
        fprintf(stderr, "bench_capacity: %s: %s\n", f->name, kvarn_strerror(st));
        return 0;
    }
    /* the plan of budget 0 has no blocks: its arena is the pages and the
     * sink slots */
    o.budget_bytes = cap.info.arena_bytes + (uint64_t)n * cap.seq_blocks * cap.info.block_bytes;
    if (cap.seq_blocks == 0) o.budget_bytes += cap.info.block_bytes; /* a cache has >= 1 block */
    st = kvarn_cache_capacity_get(&o, 1, len, &cap);
    if (st != KVARN_OK || cap.seqs < n) {
        fprintf(stderr, "bench_capacity: %s: %s (holds %d of %d)\n", f->name,
                kvarn_strerror(st), cap.seqs, n);
        return 0;
    }
    *out = cap;
    return cap.total_bytes;
}

static int parse_ints_min(const char *s, int *out, int max, int lo)
{
    int n = 0;
    while (*s && n < max) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < lo || v > (1 << 30)) return -1;
        out[n++] = (int)v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return -1;
    }
    return n;
}

static int parse_ints(const char *s, int *out, int max, int lo)
{
    return parse_ints_min(s, out, max, lo);
}

int main(int argc, char **argv)
{
    const char *formats = "int8,int4,kvarn_k4v4_g128,kvarn_k4v2_g128,kvarn_k4v2_g64";
    const char *seqs_s = "1,16,64,256", *lens_s = "2048,8192", *shapes_s = "smol,llama";
    const char *sinks_s = "128,32,16,0", *tails_s = "128,16";
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            printf("usage: bench_capacity [--formats LIST] [--seqs 1,16,64,256] [--lens 2048,8192]\n"
                   "                      [--shapes smol,llama] [--sinks 128,32,16,0] [--tails 128,16]\n"
                   "                      [--staging fp16|int8|fp8_e4m3|int4]\n"
                   "KV-cache capacity as a multiple of fp16, all memory counted (exact byte counts)\n");
            return 0;
        }
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--formats") == 0) formats = argv[i + 1];
        else if (strcmp(argv[i], "--seqs") == 0) seqs_s = argv[i + 1];
        else if (strcmp(argv[i], "--lens") == 0) lens_s = argv[i + 1];
        else if (strcmp(argv[i], "--shapes") == 0) shapes_s = argv[i + 1];
        else if (strcmp(argv[i], "--sinks") == 0) sinks_s = argv[i + 1];
        else if (strcmp(argv[i], "--tails") == 0) tails_s = argv[i + 1];
        else if (strcmp(argv[i], "--staging") == 0) {
            if (kvarn_cache_staging_parse(argv[i + 1], &g_staging) != KVARN_OK) {
                fprintf(stderr, "bench_capacity: --staging %s: expected fp16, int8, fp8_e4m3 "
                                "(alias fp8) or int4\n", argv[i + 1]);
                return 2;
            }
        } else {
            fprintf(stderr, "bench_capacity: unknown option '%s'\n", argv[i]);
            return 2;
        }
    }
    if (argc % 2 == 0) {
        fprintf(stderr, "bench_capacity: option '%s' needs a value\n", argv[argc - 1]);
        return 2;
    }
    kvarn_format fmts[32];
    char err[1024];
    int nf = format_list_parse(formats, fmts, 32, err, sizeof err);
    if (nf < 0) {
        fprintf(stderr, "bench_capacity: %s\n", err);
        return 2;
    }
    int seqs[16], lens[16], sinks[16], tails[16];
    int ns = parse_ints(seqs_s, seqs, 16, 1), nl = parse_ints(lens_s, lens, 16, 1);
    int nk = parse_ints(sinks_s, sinks, 16, 0), nt = parse_ints(tails_s, tails, 16, 1);
    if (ns < 1 || nl < 1 || nk < 1 || nt < 1) {
        fprintf(stderr, "bench_capacity: --seqs, --lens, --tails (positive) and --sinks (>= 0) "
                        "take integers separated by commas\n");
        return 2;
    }
    kvarn_format fp16;
    kvarn_format_parse("fp16", &fp16);
    printf("effective capacity, all memory counted: fp16 bytes / format bytes for n sequences of len tokens"
           " (KVarN staging: %s)\n", kvarn_cache_staging_name(g_staging));
    printf("%-6s %5s %6s %-18s %4s %4s %14s %9s %9s %11s %14s %9s\n", "shape", "n", "len",
           "format", "S", "T", "total bytes", "x fp16", "records", "staged part", "bytes (mean)",
           "x (mean)");
    int rc = 0;
    for (size_t si = 0; si < sizeof SHAPES / sizeof SHAPES[0]; si++) {
        if (strstr(shapes_s, SHAPES[si].name) == NULL) continue;
        const shape *s = &SHAPES[si];
        for (int li = 0; li < nl; li++)
            for (int ni = 0; ni < ns; ni++) {
                kvarn_cache_capacity base, cap;
                uint64_t b0 = bytes_for(s, &fp16, -1, 0, 0, seqs[ni], lens[li], &base);
                if (b0 == 0) { rc = 1; continue; }
                printf("%-6s %5d %6d %-18s %4s %4s %14llu %8.2fx %8.2fx %10.1f%% %14s %9s\n",
                       s->name, seqs[ni], lens[li], "fp16", "-", "-", (unsigned long long)b0, 1.0,
                       1.0, 0.0, "-", "-");
                for (int f = 0; f < nf; f++) {
                    if (strcmp(fmts[f].name, "fp16") == 0) continue;
                    if (kvarn_format_check_head_dim(&fmts[f], s->head_dim) != KVARN_OK) continue;
                    const int kv = fmts[f].kind == KVARN_KIND_KVARN;
                    for (int ki = 0; ki < (kv ? nk : 1); ki++)
                    for (int ti = 0; ti < (kv ? nt : 1); ti++) {
                        const int G = fmts[f].tile_tokens;
                        if (kv && (tails[ti] > G || G % tails[ti] != 0)) continue;
                        const int T = kv ? tails[ti] : 0;
                        uint64_t b = bytes_for(s, &fmts[f], kv ? sinks[ki] : -1, T, 0, seqs[ni],
                                               lens[li], &cap);
                        if (b == 0) { rc = 1; continue; }
                        kvarn_cache_capacity capm;
                        uint64_t bm = kv ? bytes_for(s, &fmts[f], sinks[ki], T, 1, seqs[ni],
                                                     lens[li], &capm)
                                         : 0;
                        if (kv && bm == 0) { rc = 1; continue; }
                        /* records only: what long contexts reach */
                        double rec = (double)kvarn_bytes_per_token_head(&fp16, s->head_dim) /
                                     kvarn_bytes_per_token_head(&fmts[f], s->head_dim);
                        double staged_part = (double)cap.info.n_pages * (double)cap.info.page_bytes +
                                             (double)cap.info.n_tail_pages *
                                                 (double)cap.info.tail_page_bytes +
                                             (double)cap.info.max_seqs * (double)cap.info.sink_bytes;
                        char sk[16], tk[16], bms[24], xm[16];
                        snprintf(sk, sizeof sk, kv ? "%d" : "-", sinks[ki]);
                        snprintf(tk, sizeof tk, kv ? "%d" : "-", T);
                        snprintf(bms, sizeof bms, kv ? "%llu" : "-", (unsigned long long)bm);
                        if (kv) snprintf(xm, sizeof xm, "%.2fx", (double)b0 / (double)bm);
                        else snprintf(xm, sizeof xm, "-");
                        printf("%-6s %5d %6d %-18s %4s %4s %14llu %8.2fx %8.2fx %10.1f%% %14s %9s\n",
                               s->name, seqs[ni], lens[li], fmts[f].name, sk, tk,
                               (unsigned long long)b, (double)b0 / (double)b, rec,
                               100.0 * staged_part / (double)b, bms, xm);
                    }
                }
            }
    }
    printf("x fp16: the same memory holds that many times more such requests; records: the\n"
           "multiple from record bytes alone; S: sink tokens staged (KVarN); T: tokens per\n"
           "tail page (G: whole tiles; less: small pages on demand); staged part: share of\n"
           "the total in staging pages with the auto pool (whole sink tiles, and the tail: (max_seqs\n"
           "+ ceil(max_seqs / 8)) x G tokens, whatever T) and sink slots (max_seqs x (S mod G)\n"
           "tokens); (mean): the tail pool sized for tails spread evenly over the tile instead\n"
           "(n x E[ceil(r / T)] pages + G / T), which fails when more tails are full at once\n");
    return rc;
}
