/* paged_fixture.h -- builds one layer of a paged KV cache by hand for the
 * attention tests and benchmark (header only, so it is not linked into every
 * test program): random K/V, records written with kvarn_encode, fp16 pages
 * (rotated for KVarN, as include/kvarn/paged.h says), block and page ids
 * handed out in shuffled order so that no sequence is contiguous, and the
 * unwritten rest of partial blocks/pages filled with 0xff bytes (NaN as
 * fp16) so that reading them would show. It also keeps, per sequence, the
 * original K/V and the dequantized K/V attention must see (kvarn_decode;
 * rotated basis for KVarN), for double-precision reference attention.
 * The arenas are the caller's, not kvarn_cache's, and padded (blocks, heads
 * inside a page, pages), so that every reader must follow the view's strides;
 * every address is taken with paged.h's helpers. */
#ifndef KVARN_PAGED_FIXTURE_H
#define KVARN_PAGED_FIXTURE_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/testutil.h"
#include "kvarn/attn.h"
#include "kvarn/kvarn.h"
#include "kvarn/paged.h"
#include "kvarn/record.h"

typedef struct pf_seq_spec {
    int seq_len;
    int tail_tiles;   /* KVarN: full tiles left in the fp16 tail (not committed) */
} pf_seq_spec;

typedef struct paged_fixture {
    kvarn_format fmt;
    int D, Hk, G, sink_tiles, sink_partial, n_seqs;
    kvarn_paged_kv kv;
    kvarn_seq_view *views;
    int32_t **tables;
    uint8_t *blocks;
    uint16_t *pages;
    uint16_t *sinks;          /* sink slots (sink_partial > 0), padded */
    float **k_orig, **v_orig; /* per sequence [seq_len][Hk][D], original basis */
    float **k_deq, **v_deq;   /* per sequence [seq_len][Hk][D], attention basis */
    size_t rec_bytes;
} paged_fixture;

static inline void pf_shuffle(test_rng *rng, int32_t *ids, int n)
{
    for (int i = n - 1; i > 0; i--) {
        int j = (int)test_rng_below(rng, (uint32_t)(i + 1));
        int32_t t = ids[i];
        ids[i] = ids[j];
        ids[j] = t;
    }
}

/* Double-precision normalized Walsh-Hadamard transform (H/sqrt(n)). */
static inline void pf_hadamard_d(double *x, int n)
{
    for (int h = 1; h < n; h *= 2)
        for (int i = 0; i < n; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                double a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    double s = 1.0 / sqrt((double)n);
    for (int i = 0; i < n; i++) x[i] *= s;
}

/* Build the fixture. G: block size for per-token formats (KVarN uses its
 * tile size). sink_partial: KVarN r in [0, G), the sink tokens of tile
 * sink_tiles kept in fp16 sink slots once it is quantized (paged.h); the
 * slots are handed out shuffled too. Returns 0 on success. */
static inline int pf_build_sink(paged_fixture *f, const char *fmt_name, int D, int Hk, int G,
                                int sink_tiles, int sink_partial, const pf_seq_spec *specs,
                                int n_seqs, uint64_t seed)
{
    memset(f, 0, sizeof *f);
    if (kvarn_format_parse(fmt_name, &f->fmt) != KVARN_OK) return -1;
    const int is_kvarn = f->fmt.kind == KVARN_KIND_KVARN;
    if (is_kvarn) G = f->fmt.tile_tokens;
    else sink_tiles = sink_partial = 0;
    f->D = D; f->Hk = Hk; f->G = G; f->sink_tiles = sink_tiles; f->n_seqs = n_seqs;
    f->sink_partial = sink_partial;
    kvarn_record_layout L;
    if (kvarn_record_layout_get(&f->fmt, D, &L) != KVARN_OK) return -2;
    f->rec_bytes = L.record_bytes;
    test_rng rng;
    test_rng_seed(&rng, seed);

    /* Count tiles of each kind. */
    int n_blocks = 0, n_pages = 0;
    int *committed = calloc((size_t)n_seqs + 1, sizeof(int));
    for (int s = 0; s < n_seqs; s++) {
        int len = specs[s].seq_len, nt = (len + G - 1) / G;
        if (is_kvarn) {
            int full = len / G, c = full - specs[s].tail_tiles;
            if (c < 0) c = 0;
            committed[s] = c;
            for (int i = 0; i < nt; i++) {
                if (i < sink_tiles || i >= c) n_pages++;
                else n_blocks++;
            }
        } else {
            committed[s] = nt;
            n_blocks += nt;
        }
    }
    n_blocks += 3; /* spare ids, so the arena is not exactly full */
    n_pages += 2;
    size_t token_rec = is_kvarn ? 0 : L.record_bytes;
    size_t record_stride = is_kvarn ? L.record_bytes : (size_t)G * token_rec;
    size_t block_stride = (size_t)Hk * record_stride + 8; /* some padding */
    /* padded pages: 16 bytes after each head's K+V tile, 32 after a page */
    size_t page_head_stride = kvarn_paged_fp16_tile_bytes(G, D) + 16;
    size_t page_stride = (size_t)Hk * page_head_stride + 32;
    f->blocks = malloc((size_t)n_blocks * block_stride);
    f->pages = malloc((size_t)n_pages * page_stride);
    memset(f->blocks, 0xff, (size_t)n_blocks * block_stride);
    memset(f->pages, 0xff, (size_t)n_pages * page_stride);

    kvarn_paged_kv *kv = &f->kv;
    kv->fmt = f->fmt;
    kv->head_dim = D;
    kv->n_kv_heads = Hk;
    kv->block_size = G;
    kv->sink_tiles = sink_tiles;
    kv->blocks = f->blocks;
    kv->block_stride = block_stride;
    kv->record_stride = record_stride;
    kv->token_record_bytes = token_rec;
    kv->fp16_pages = f->pages;
    kv->page_stride = page_stride;
    kv->page_head_stride = page_head_stride;
    kv->n_blocks = n_blocks;
    kv->n_fp16_pages = n_pages;
    int32_t *slot_ids = malloc(sizeof(int32_t) * ((size_t)n_seqs + 2));
    for (int i = 0; i < n_seqs + 2; i++) slot_ids[i] = i;
    if (sink_partial > 0) {
        pf_shuffle(&rng, slot_ids, n_seqs + 2);
        /* padded slots: 8 bytes after each head, 16 after a slot */
        kv->sink_partial = sink_partial;
        kv->sink_head_stride = kvarn_paged_fp16_tile_bytes(sink_partial, D) + 8;
        kv->sink_stride = (size_t)Hk * kv->sink_head_stride + 16;
        kv->n_sink_slots = n_seqs + 2;
        f->sinks = malloc((size_t)kv->n_sink_slots * kv->sink_stride);
        memset(f->sinks, 0xff, (size_t)kv->n_sink_slots * kv->sink_stride);
        kv->fp16_sinks = f->sinks;
    }
    int32_t *bids = malloc(sizeof(int32_t) * (size_t)n_blocks);
    int32_t *pids = malloc(sizeof(int32_t) * (size_t)n_pages);
    for (int i = 0; i < n_blocks; i++) bids[i] = i;
    for (int i = 0; i < n_pages; i++) pids[i] = i;
    pf_shuffle(&rng, bids, n_blocks);
    pf_shuffle(&rng, pids, n_pages);
    int nb = 0, np = 0;

    f->views = calloc((size_t)n_seqs + 1, sizeof(kvarn_seq_view));
    f->tables = calloc((size_t)n_seqs + 1, sizeof(int32_t *));
    f->k_orig = calloc((size_t)n_seqs + 1, sizeof(float *));
    f->v_orig = calloc((size_t)n_seqs + 1, sizeof(float *));
    f->k_deq = calloc((size_t)n_seqs + 1, sizeof(float *));
    f->v_deq = calloc((size_t)n_seqs + 1, sizeof(float *));
    size_t wsz = kvarn_encode_workspace_bytes(&f->fmt, D);
    void *ws = wsz ? malloc(wsz) : NULL;
    float *tk = malloc(sizeof(float) * (size_t)G * D), *tv = malloc(sizeof(float) * (size_t)G * D);
    float *dk = malloc(sizeof(float) * (size_t)G * D), *dv = malloc(sizeof(float) * (size_t)G * D);
    int rc = 0;

    for (int s = 0; s < n_seqs && rc == 0; s++) {
        int len = specs[s].seq_len, nt = (len + G - 1) / G;
        size_t n = (size_t)len * Hk * D + 1;
        float *ko = f->k_orig[s] = malloc(sizeof(float) * n);
        float *vo = f->v_orig[s] = malloc(sizeof(float) * n);
        float *kd = f->k_deq[s] = malloc(sizeof(float) * n);
        float *vd = f->v_deq[s] = malloc(sizeof(float) * n);
        /* K with a per-channel offset and spread (like post-RoPE keys with
         * outlier channels), V plain Gaussian; for a mean-centred format
         * (kvarn_format.centred) V has a per-channel bias of -4.5..4.5 too,
         * so that the stored means (and attention's correction for them)
         * are large. */
        for (int t = 0; t < len; t++)
            for (int h = 0; h < Hk; h++)
                for (int d = 0; d < D; d++) {
                    size_t i = ((size_t)t * Hk + h) * D + d;
                    double chan = 1.0 + 2.0 * (double)((d * 7 + h) % 5 == 0);
                    ko[i] = (float)(chan * test_rng_normal(&rng) + 0.5 * ((d % 3) - 1));
                    vo[i] = (float)test_rng_normal(&rng) +
                            (f->fmt.centred ? 1.5f * (float)((d * 5 + h) % 7 - 3) : 0.0f);
                }
        int32_t *tab = f->tables[s] = malloc(sizeof(int32_t) * ((size_t)nt + 1));
        for (int i = 0; i < nt; i++) {
            int page = is_kvarn && (i < sink_tiles || i >= committed[s]);
            tab[i] = page ? pids[np++] : bids[nb++];
            int t0 = i * G, cnt = len - t0 < G ? len - t0 : G;
            for (int h = 0; h < Hk; h++) {
                for (int t = 0; t < cnt; t++) {
                    memcpy(tk + (size_t)t * D, ko + ((size_t)(t0 + t) * Hk + h) * D, sizeof(float) * D);
                    memcpy(tv + (size_t)t * D, vo + ((size_t)(t0 + t) * Hk + h) * D, sizeof(float) * D);
                }
                if (page) {
                    uint16_t *pk = kvarn_paged_page_k(kv, tab[i], h);
                    uint16_t *pv = kvarn_paged_page_v(kv, tab[i], h);
                    for (int t = 0; t < cnt; t++) {
                        double xk[1024], xv[1024];
                        for (int d = 0; d < D; d++) {
                            xk[d] = tk[(size_t)t * D + d];
                            xv[d] = tv[(size_t)t * D + d];
                        }
                        pf_hadamard_d(xk, D);
                        pf_hadamard_d(xv, D);
                        for (int d = 0; d < D; d++) {
                            pk[(size_t)t * D + d] = kvarn_fp32_to_fp16((float)xk[d]);
                            pv[(size_t)t * D + d] = kvarn_fp32_to_fp16((float)xv[d]);
                            dk[(size_t)t * D + d] = kvarn_fp16_to_fp32(pk[(size_t)t * D + d]);
                            dv[(size_t)t * D + d] = kvarn_fp16_to_fp32(pv[(size_t)t * D + d]);
                        }
                    }
                } else if (is_kvarn) {
                    uint8_t *rec = kvarn_paged_record(kv, tab[i], h);
                    if (kvarn_encode(&f->fmt, D, tk, tv, rec, L.record_bytes, ws, wsz, NULL) != KVARN_OK ||
                        kvarn_decode(&f->fmt, D, rec, L.record_bytes, dk, dv, KVARN_DECODE_ROTATED) != KVARN_OK)
                        rc = -3;
                    /* the partial sink tile: its first r tokens are what
                     * the slot holds, fp16 of the rotated originals */
                    if (i == sink_tiles && sink_partial > 0) {
                        uint16_t *sk = kvarn_paged_sink_k(kv, slot_ids[s], h);
                        uint16_t *sv = kvarn_paged_sink_v(kv, slot_ids[s], h);
                        for (int t = 0; t < sink_partial; t++) {
                            double xk[1024], xv[1024];
                            for (int d = 0; d < D; d++) {
                                xk[d] = tk[(size_t)t * D + d];
                                xv[d] = tv[(size_t)t * D + d];
                            }
                            pf_hadamard_d(xk, D);
                            pf_hadamard_d(xv, D);
                            for (int d = 0; d < D; d++) {
                                sk[(size_t)t * D + d] = kvarn_fp32_to_fp16((float)xk[d]);
                                sv[(size_t)t * D + d] = kvarn_fp32_to_fp16((float)xv[d]);
                                dk[(size_t)t * D + d] = kvarn_fp16_to_fp32(sk[(size_t)t * D + d]);
                                dv[(size_t)t * D + d] = kvarn_fp16_to_fp32(sv[(size_t)t * D + d]);
                            }
                        }
                    }
                } else {
                    for (int t = 0; t < cnt && rc == 0; t++) {
                        uint8_t *rec = kvarn_paged_token_record(kv, tab[i], h, t);
                        if (kvarn_encode(&f->fmt, D, tk + (size_t)t * D, tv + (size_t)t * D, rec,
                                         token_rec, NULL, 0, NULL) != KVARN_OK ||
                            kvarn_decode(&f->fmt, D, rec, token_rec, dk + (size_t)t * D,
                                         dv + (size_t)t * D, 0) != KVARN_OK)
                            rc = -4;
                    }
                }
                for (int t = 0; t < cnt; t++) {
                    memcpy(kd + ((size_t)(t0 + t) * Hk + h) * D, dk + (size_t)t * D, sizeof(float) * D);
                    memcpy(vd + ((size_t)(t0 + t) * Hk + h) * D, dv + (size_t)t * D, sizeof(float) * D);
                }
            }
        }
        f->views[s].block_table = tab;
        f->views[s].seq_len = len;
        f->views[s].committed_tiles = committed[s];
        f->views[s].sink_slot = slot_ids[s];
    }
    free(tk); free(tv); free(dk); free(dv); free(ws);
    free(bids); free(pids); free(committed); free(slot_ids);
    return rc;
}

static inline int pf_build(paged_fixture *f, const char *fmt_name, int D, int Hk, int G,
                           int sink_tiles, const pf_seq_spec *specs, int n_seqs,
                           uint64_t seed)
{
    return pf_build_sink(f, fmt_name, D, Hk, G, sink_tiles, 0, specs, n_seqs, seed);
}

static inline void pf_free(paged_fixture *f)
{
    for (int s = 0; s < f->n_seqs; s++) {
        if (f->tables) free(f->tables[s]);
        if (f->k_orig) free(f->k_orig[s]);
        if (f->v_orig) free(f->v_orig[s]);
        if (f->k_deq) free(f->k_deq[s]);
        if (f->v_deq) free(f->v_deq[s]);
    }
    free(f->tables); free(f->k_orig); free(f->v_orig); free(f->k_deq); free(f->v_deq);
    free(f->views); free(f->blocks); free(f->pages); free(f->sinks);
    memset(f, 0, sizeof *f);
}

/* Double-precision attention of one query (fp32 [D], original basis) of
 * sequence s, query head `head` (of Hq), over positions [lo, hi], against
 * the dequantized K/V (deq = 1; the query is rotated into, and the output
 * back out of, the Hadamard basis for KVarN) or the original K/V (deq = 0).
 * out: fp64 [D]; zero when no position is visible. */
static inline void pf_ref_attention(const paged_fixture *f, int s, int head, int Hq,
                                    const float *q, double scale, int lo, int hi,
                                    int deq, double *out)
{
    const int D = f->D, h = head / (Hq / f->Hk);
    const int rot = deq && f->fmt.kind == KVARN_KIND_KVARN;
    const float *K = deq ? f->k_deq[s] : f->k_orig[s], *V = deq ? f->v_deq[s] : f->v_orig[s];
    double qq[1024];
    for (int d = 0; d < D; d++) qq[d] = q[d];
    if (rot) pf_hadamard_d(qq, D);
    for (int d = 0; d < D; d++) out[d] = 0.0;
    if (lo < 0) lo = 0;
    if (hi < lo) return;
    double m = -INFINITY;
    for (int t = lo; t <= hi; t++) {
        double sc = 0.0;
        const float *k = K + ((size_t)t * f->Hk + h) * D;
        for (int d = 0; d < D; d++) sc += qq[d] * k[d];
        sc *= scale;
        if (sc > m) m = sc;
    }
    double l = 0.0;
    for (int t = lo; t <= hi; t++) {
        double sc = 0.0;
        const float *k = K + ((size_t)t * f->Hk + h) * D, *v = V + ((size_t)t * f->Hk + h) * D;
        for (int d = 0; d < D; d++) sc += qq[d] * k[d];
        double p = exp(sc * scale - m);
        l += p;
        for (int d = 0; d < D; d++) out[d] += p * v[d];
    }
    for (int d = 0; d < D; d++) out[d] /= l;
    if (rot) pf_hadamard_d(out, D);
}

#endif
