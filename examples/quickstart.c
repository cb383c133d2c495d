/*
 * quickstart.c -- the C API end to end: parse a format, create a paged
 * cache for a model's shape, append K/V, attend, print what the cache holds.
 * Built by the CMake build (target example_quickstart) and run by ctest;
 * the README's "C API" block is a part of this file (checked by
 * examples/check_readme.sh).
 *
 * The shape is SmolLM2-135M's (30 layers, 3 KV heads, head_dim 64, 9 query
 * heads); K/V and the query are made-up numbers, not a model's, so the
 * error printed says only that the pieces fit together.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "kvarn/attn.h"
#include "kvarn/cache.h"
#include "kvarn/kvarn.h"

enum { LAYERS = 30, HK = 3, HQ = 9, D = 64, N = 300 };

#define CHECK(call)                                                         \
    do {                                                                    \
        kvarn_status st_ = (call);                                          \
        if (st_ != KVARN_OK) {                                              \
            fprintf(stderr, "%s: %s\n", #call, kvarn_strerror(st_));        \
            return 1;                                                       \
        }                                                                   \
    } while (0)

/* deterministic numbers in [-1, 1) */
static float next_value(unsigned *s)
{
    *s = *s * 1664525u + 1013904223u;
    return (float)(*s >> 8) / (float)(1u << 23) - 1.0f;
}

/* Exact fp32 attention of one query head over the K/V as written. */
static void reference(const float *k, const float *v, const float *q, int kv_head, float *out)
{
    double w[N], m = -INFINITY, l = 0;
    for (int t = 0; t < N; t++) {
        double s = 0;
        for (int d = 0; d < D; d++) s += (double)q[d] * k[((size_t)t * HK + kv_head) * D + d];
        w[t] = s / sqrt((double)D);
        if (w[t] > m) m = w[t];
    }
    for (int t = 0; t < N; t++) l += (w[t] = exp(w[t] - m));
    for (int d = 0; d < D; d++) {
        double o = 0;
        for (int t = 0; t < N; t++) o += w[t] * v[((size_t)t * HK + kv_head) * D + d];
        out[d] = (float)(o / l);
    }
}

int main(void)
{
    float *k = malloc(sizeof(float) * N * HK * D), *v = malloc(sizeof(float) * N * HK * D);
    float q[HQ * D], out[HQ * D], want[D];
    if (!k || !v) return 1;
    unsigned s = 1;
    for (int i = 0; i < N * HK * D; i++) {     /* values with a mean per channel, as a model's */
        k[i] = next_value(&s);
        v[i] = 0.5f * (float)((i % D) % 5 - 2) + 0.5f * next_value(&s);
    }
    for (int i = 0; i < HQ * D; i++) q[i] = 4.0f * next_value(&s);

    /* readme: begin */
    kvarn_cache_opts o = kvarn_cache_default_opts();            /* SmolLM2-135M's shape: */
    o.n_layers = 30; o.n_kv_heads = 3; o.head_dim = 64; o.max_seqs = 4; o.budget_bytes = 64u << 20;
    CHECK(kvarn_format_parse("kvarn_k4v2_g128", &o.format));    /* any --kv-cache-dtype name */
    kvarn_cache *c; int seq;
    CHECK(kvarn_cache_create(&o, &c)); CHECK(kvarn_cache_seq_create(c, &seq));
    CHECK(kvarn_cache_reserve(c, seq, N));                      /* N new tokens, then per layer */
    for (int layer = 0; layer < o.n_layers; layer++)            /* k, v: fp32 [N][Hk][D] */
        CHECK(kvarn_cache_write(c, seq, layer, 0, N, k, v));
    CHECK(kvarn_cache_commit(c, seq, N));                       /* full tiles -> 4/2-bit records */
    kvarn_paged_kv kv; kvarn_seq_view view;                     /* decode attention, layer 0 */
    CHECK(kvarn_cache_layer_view(c, 0, &kv)); CHECK(kvarn_cache_seq_view(c, seq, &view));
    size_t ws_bytes = kvarn_attn_workspace_bytes(&kv, HQ, 1, 1, 1, NULL);
    void *ws = malloc(ws_bytes);                                /* q, out: fp32 [Hq][D] */
    CHECK(kvarn_attn_decode(&kv, &view, 1, HQ, q, out, NULL, NULL, ws, ws_bytes));
    int fit;                                                    /* 2k-token requests in 1 GiB */
    CHECK(kvarn_cache_seqs_fit(&o, 1ull << 30, 2048, &fit, NULL));
    /* readme: end */

    int fit_fp16;
    kvarn_cache_opts o16 = o;
    CHECK(kvarn_format_parse("fp16", &o16.format));
    CHECK(kvarn_cache_seqs_fit(&o16, 1ull << 30, 2048, &fit_fp16, NULL));

    /* the quantized attention against the exact one (query head 0, KV head 0) */
    reference(k, v, q, 0, want);
    double err = 0, norm = 0;
    for (int d = 0; d < D; d++) {
        err += (double)(out[d] - want[d]) * (out[d] - want[d]);
        norm += (double)want[d] * want[d];
    }
    double rel = sqrt(err / norm);

    kvarn_cache_stats stats;
    CHECK(kvarn_cache_get_stats(c, &stats));
    double fp16_token_bytes = 2.0 * LAYERS * HK * D * 2; /* K and V, 2 bytes each */
    const kvarn_format *fmt = &o.format;
    printf("format %s: %zu record bytes per tile and KV head (fp16: %d)\n", fmt->name,
           kvarn_record_bytes(fmt, D), 2 * fmt->tile_tokens * D * 2);
    printf("cache: %lld tokens, %.0f bytes per token in records (fp16 %.0f: %.2fx), "
           "%.0f as held now (staged sink and tail tiles counted)\n",
           (long long)stats.tokens, stats.record_bytes_per_token, fp16_token_bytes,
           fp16_token_bytes / stats.record_bytes_per_token, stats.used_bytes_per_token);
    printf("attention (%s kernels): relative RMS error %.3f of one head's output against exact\n"
           "  fp32 attention (random K/V, values at 2 bits; on a model's K/V see kvarn eval's KLD)\n",
           kvarn_attn_kernel_name(NULL), rel);
    printf("requests of 2048 tokens in 1 GiB, all memory counted: %d (fp16: %d)\n", fit, fit_fp16);

    free(ws);
    kvarn_cache_destroy(c);
    free(k);
    free(v);
    /* a working cache: a finite output near the exact one, more requests than fp16 */
    return (isfinite(rel) && rel < 0.5 && fit > fit_fp16) ? 0 : 1;
}
