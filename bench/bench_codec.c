/* bench_codec.c -- single-thread encode / decode throughput of every cache
 * format in the table, at D = 64, 128 and 256, beside a plain memcpy of the
 * same bytes measured in the same run.
 *
 * Unit: fp16-input bytes per second per core, and microseconds of encode
 * per tile (enc us/t: one record for KVarN, 128 token records otherwise). One tile is G tokens x D
 * channels x 2 (K and V) x 2 bytes, whatever the format; G is the format's
 * tile length for KVarN and 128 tokens (one paged block of 128 token
 * records) for the per-token formats. The memcpy baseline copies that many
 * bytes per tile. Each figure is the median of several runs, each run
 * repeating the operation over a batch of tiles (about 1 MiB of fp32 input)
 * for at least --min-ms milliseconds of this thread's CPU time
 * (CLOCK_THREAD_CPUTIME_ID: steadier than the wall clock on a shared
 * machine), after a warm-up run. The default settings take about 7 s of CPU
 * time; --quick about 1 s.
 *
 * Usage: bench_codec [--quick] [--runs N] [--min-ms MS] [--formats NAME[,NAME...]|all] [--dim D]
 *        (--format is the same option)
 *   --quick   3 runs of >= 5 ms (about 1 s in all); default 5 of >= 20 ms.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvarn/kvarn.h"
#include "format_list.h"
#include "simd_env.h"

#define PER_TOKEN_BLOCK 128
#define BATCH_INPUT_BYTES (1u << 20)

typedef struct bench_cfg {
    int runs;
    double min_s;
    const char *only_format;
    int only_dim;
} bench_cfg;

typedef struct bench_ctx {
    kvarn_format fmt;
    int D, G;             /* G: tokens per tile as benchmarked */
    int n_tiles;
    size_t rec_bytes;     /* bytes of the encoded tile (G/tile_tokens records) */
    size_t tile_fp16;     /* fp16-input bytes of one tile: G*D*2*2 */
    float *k, *v, *kd, *vd;
    unsigned char *rec;
    unsigned char *src16, *dst16; /* memcpy baseline buffers */
    void *ws;
    size_t ws_bytes;
} bench_ctx;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void clobber(void *p) { __asm__ volatile("" : : "r"(p) : "memory"); }

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static double rng_normal(void)
{
    /* sum of 4 uniforms, centred: cheap, bell-shaped, deterministic */
    double s = 0;
    for (int i = 0; i < 4; i++) {
        rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
        s += (double)(rng_state >> 11) * (1.0 / 9007199254740992.0);
    }
    return (s - 2.0) * 1.7320508;
}

/* Encode every tile of the batch once. */
static kvarn_status encode_batch(bench_ctx *c)
{
    const size_t per = kvarn_record_bytes(&c->fmt, c->D);
    const int recs_per_tile = c->G / c->fmt.tile_tokens;
    for (int i = 0; i < c->n_tiles; i++) {
        for (int r = 0; r < recs_per_tile; r++) {
            size_t tok = (size_t)i * c->G + (size_t)r * c->fmt.tile_tokens;
            kvarn_status st = kvarn_encode(&c->fmt, c->D, c->k + tok * c->D, c->v + tok * c->D,
                                           c->rec + ((size_t)i * recs_per_tile + r) * per, per,
                                           c->ws, c->ws_bytes, NULL);
            if (st != KVARN_OK) return st;
        }
    }
    clobber(c->rec);
    return KVARN_OK;
}

static kvarn_status decode_batch(bench_ctx *c)
{
    const size_t per = kvarn_record_bytes(&c->fmt, c->D);
    const int recs_per_tile = c->G / c->fmt.tile_tokens;
    for (int i = 0; i < c->n_tiles; i++) {
        for (int r = 0; r < recs_per_tile; r++) {
            size_t tok = (size_t)i * c->G + (size_t)r * c->fmt.tile_tokens;
            kvarn_status st = kvarn_decode(&c->fmt, c->D, c->rec + ((size_t)i * recs_per_tile + r) * per,
                                           per, c->kd + tok * c->D, c->vd + tok * c->D, 0);
            if (st != KVARN_OK) return st;
        }
    }
    clobber(c->kd);
    clobber(c->vd);
    return KVARN_OK;
}

static kvarn_status memcpy_batch(bench_ctx *c)
{
    for (int i = 0; i < c->n_tiles; i++)
        memcpy(c->dst16 + (size_t)i * c->tile_fp16, c->src16 + (size_t)i * c->tile_fp16, c->tile_fp16);
    clobber(c->dst16);
    return KVARN_OK;
}

typedef kvarn_status (*batch_fn)(bench_ctx *);

/* One run: repeat the batch for at least min_s; fp16-input bytes / s. */
static double one_run(bench_ctx *c, batch_fn fn, double min_s, kvarn_status *st)
{
    long reps = 0;
    double t0 = now_s(), t;
    do {
        *st = fn(c);
        if (*st != KVARN_OK) return 0;
        reps++;
        t = now_s();
    } while (t - t0 < min_s);
    return (double)reps * (double)c->n_tiles * (double)c->tile_fp16 / (t - t0);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *x, int n)
{
    qsort(x, (size_t)n, sizeof *x, cmp_double);
    return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

static int setup(bench_ctx *c, const char *name, int D)
{
    memset(c, 0, sizeof *c);
    if (kvarn_format_parse(name, &c->fmt) != KVARN_OK) return -1;
    if (kvarn_format_check_head_dim(&c->fmt, D) != KVARN_OK) return -1;
    c->D = D;
    c->G = c->fmt.per_tile ? c->fmt.tile_tokens : PER_TOKEN_BLOCK;
    c->tile_fp16 = (size_t)c->G * D * 2 * 2;
    size_t tile_f32 = (size_t)c->G * D * 2 * sizeof(float);
    c->n_tiles = (int)(BATCH_INPUT_BYTES / tile_f32);
    if (c->n_tiles < 1) c->n_tiles = 1;
    size_t n = (size_t)c->n_tiles * c->G * D;
    size_t recs = (size_t)c->n_tiles * (size_t)(c->G / c->fmt.tile_tokens);
    c->rec_bytes = kvarn_record_bytes(&c->fmt, D) * (size_t)(c->G / c->fmt.tile_tokens);
    c->k = malloc(n * sizeof(float));
    c->v = malloc(n * sizeof(float));
    c->kd = malloc(n * sizeof(float));
    c->vd = malloc(n * sizeof(float));
    c->rec = calloc(recs, kvarn_record_bytes(&c->fmt, D));
    c->src16 = malloc((size_t)c->n_tiles * c->tile_fp16);
    c->dst16 = malloc((size_t)c->n_tiles * c->tile_fp16);
    c->ws_bytes = kvarn_encode_workspace_bytes(&c->fmt, D);
    if (c->ws_bytes && posix_memalign(&c->ws, 64, c->ws_bytes) != 0) c->ws = NULL;
    if (!c->k || !c->v || !c->kd || !c->vd || !c->rec || !c->src16 || !c->dst16 ||
        (c->ws_bytes && !c->ws))
        return -1;
    /* keys: Gaussian with 4 outlier channels (x10..x30); values: Gaussian */
    for (size_t i = 0; i < n; i++) {
        int d = (int)(i % (size_t)D);
        float s = (d == 3 || d == D / 3 || d == D / 2 + 1 || d == D - 5) ? 10.0f + (float)(d % 20) : 1.0f;
        c->k[i] = (float)rng_normal() * s;
        c->v[i] = (float)rng_normal();
    }
    memset(c->src16, 0x3c, (size_t)c->n_tiles * c->tile_fp16);
    return 0;
}

static void teardown(bench_ctx *c)
{
    free(c->k); free(c->v); free(c->kd); free(c->vd); free(c->rec);
    free(c->src16); free(c->dst16); free(c->ws);
}

/* The usage, naming the program as its messages do ("bench_codec: ..."). */
static void usage(FILE *to)
{
    fprintf(to,
            "usage: bench_codec [--quick] [--runs N] [--min-ms MS] [--formats NAME[,NAME...]|all] [--dim D]\n"
            "  encode/decode throughput of each cache format vs memcpy, single thread\n");
}

int main(int argc, char **argv)
{
    if (simd_env_check("bench_codec")) return 2; /* KVARN_SIMD names no level */
    bench_cfg cfg = {5, 0.020, NULL, 0};
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0) { cfg.runs = 3; cfg.min_s = 0.005; }
        else if (strcmp(argv[i], "--runs") == 0 && i + 1 < argc) cfg.runs = atoi(argv[++i]);
        else if (strcmp(argv[i], "--min-ms") == 0 && i + 1 < argc) cfg.min_s = atof(argv[++i]) / 1000.0;
        else if ((strcmp(argv[i], "--format") == 0 || strcmp(argv[i], "--formats") == 0) && i + 1 < argc)
            cfg.only_format = argv[++i];
        else if (strcmp(argv[i], "--dim") == 0 && i + 1 < argc) cfg.only_dim = atoi(argv[++i]);
        else if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            usage(stdout);
            return 0;
        } else { usage(stderr); return 2; }
    }
    if (cfg.runs < 1 || cfg.runs > 101 || cfg.min_s <= 0) { usage(stderr); return 2; }

    /* The kvarn command's own list parser: an unknown name or an empty item
     * is an error, any name the library accepts runs. */
    kvarn_format fmts[64];
    char err[1024];
    int n_names = format_list_parse(cfg.only_format ? cfg.only_format : "all", fmts, 64, err, sizeof err);
    if (n_names < 0) {
        fprintf(stderr, "bench_codec: --format: %s\n", err);
        return 2;
    }
    const int dims[3] = {64, 128, 256};

    printf("bench_codec: single thread, median of %d runs of >= %.0f ms, fp16-input bytes "
           "(tile = G tok x D x K,V x 2 B)\n", cfg.runs, cfg.min_s * 1e3);
    printf("%-16s %4s %4s %9s | %9s %7s %8s | %9s %7s | %9s\n", "format", "D", "G", "rec B/tok",
           "enc GB/s", "enc/cpy", "enc us/t", "dec GB/s", "dec/cpy", "cpy GB/s");
    printf("--------------------------------------------------------------------------------------------------\n");
    int rc = 0;
    for (int fi = 0; fi < n_names; fi++) {
        for (int di = 0; di < 3; di++) {
            if (cfg.only_dim && dims[di] != cfg.only_dim) continue;
            bench_ctx c;
            if (setup(&c, fmts[fi].name, dims[di]) != 0) {
                printf("%-16s %4d  (not served or out of memory)\n", fmts[fi].name, dims[di]);
                teardown(&c);
                continue;
            }
            double enc[101], dec[101], cpy[101];
            kvarn_status st = KVARN_OK, st2 = KVARN_OK, st3;
            /* warm-up: one short run of each */
            one_run(&c, encode_batch, cfg.min_s / 2, &st);
            if (st == KVARN_OK) one_run(&c, decode_batch, cfg.min_s / 2, &st2);
            one_run(&c, memcpy_batch, cfg.min_s / 2, &st3);
            if (st != KVARN_OK || st2 != KVARN_OK) {
                printf("%-16s %4d %4d %9.1f | %s\n", c.fmt.name, c.D, c.G, (double)c.rec_bytes / c.G,
                       kvarn_strerror(st != KVARN_OK ? st : st2));
                if (st != KVARN_ERR_UNSUPPORTED) rc = 1;
                teardown(&c);
                continue;
            }
            /* interleave so that machine noise hits all three alike */
            for (int r = 0; r < cfg.runs; r++) {
                cpy[r] = one_run(&c, memcpy_batch, cfg.min_s, &st3);
                enc[r] = one_run(&c, encode_batch, cfg.min_s, &st);
                dec[r] = one_run(&c, decode_batch, cfg.min_s, &st2);
            }
            double e = median(enc, cfg.runs), d = median(dec, cfg.runs), m = median(cpy, cfg.runs);
            printf("%-16s %4d %4d %9.1f | %9.3f %7.4f %8.1f | %9.3f %7.4f | %9.2f\n", c.fmt.name, c.D,
                   c.G, (double)c.rec_bytes / c.G, e / 1e9, e / m, (double)c.tile_fp16 / e * 1e6, d / 1e9,
                   d / m, m / 1e9);
            fflush(stdout);
            teardown(&c);
        }
    }
    printf("enc/cpy, dec/cpy: format throughput over memcpy of the same fp16-input bytes in the same run.\n"
           "Timed with the thread's CPU clock (CLOCK_THREAD_CPUTIME_ID), so other load on the machine\n"
           "stretches the wall time more than the figures.\n");
    return rc;
}
