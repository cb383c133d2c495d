/*
 * store.c -- moving K/V in and out of the paged cache: write (fp16 page or
 * per-token record; kvarn_cache_write_exact also encodes the whole tiles of
 * the chunk from the exact K/V), commit (a full KVarN tail tile into its
 * block with kvarn_encode(prerotated = 1) from its staged copy, unless its
 * record came from the exact K/V), and read back as fp32.
 * Source: ../shared/spec/KVARN.md "The fp16 tail and the sink";
 * include/kvarn/paged.h for where every byte lives.
 */
#include <math.h>
#include <string.h>

#include "cache/cache_internal.h"
#include "cache/staging.h"
#include "codec/fp_convert.h"
#include "codec/hadamard.h"

/* Largest |x| as its fp32 bit pattern (bits of non-negative floats order
 * like their values; Inf and NaN compare above every finite value). Integer
 * max, so the loop vectorizes. */
static uint32_t max_abs_bits(const float *x, size_t n)
{
    uint32_t m = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t u = kvarn__f32_bits(x[i]) & 0x7fffffffu;
        m = u > m ? u : m;
    }
    return m;
}

/* Whether one vector, rotated, fits in fp16 (exact check, rarely needed). */
static int rotated_fits_fp16(kvarn_cache *c, const float *x)
{
    const int D = c->info.head_dim;
    memcpy(c->vec, x, (size_t)D * sizeof(float));
    kvarn_hadamard(c->vec, D);
    for (int d = 0; d < D; d++)
        if (!isfinite(kvarn__fp16_to_f32(kvarn__fp16_from_f32(c->vec[d])))) return 0;
    return 1;
}

/* KVARN_OK if the n token-head vectors (D each) of x are finite and, for
 * KVarN, stay within fp16 after the rotation. The rotation keeps the L2
 * norm, so every rotated element is at most sqrt(D) * max|x|: only inputs
 * above 65000 / sqrt(D) need the exact check. */
static kvarn_status check_input(kvarn_cache *c, const float *x, size_t n_vec)
{
    const int D = c->info.head_dim;
    const uint32_t mb = max_abs_bits(x, n_vec * (size_t)D);
    if (mb >= 0x7f800000u) return KVARN_ERR_NONFINITE; /* Inf or NaN */
    const float m = kvarn__bits_f32(mb);
    if (!c->is_kvarn || m * sqrtf((float)D) < 65000.0f) return KVARN_OK;
    for (size_t i = 0; i < n_vec; i++)
        if (!rotated_fits_fp16(c, x + i * (size_t)D)) return KVARN_ERR_NONFINITE;
    return KVARN_OK;
}

/* Every tile (and small tail page) that tokens [pos, pos + n) touch is held
 * by this sequence alone. */
static int tiles_private(const kvarn_cache *c, const kvarn_seq *s, int pos, int n)
{
    const int G = c->info.block_size;
    for (int t = pos / G; t <= (pos + n - 1) / G; t++)
        if (kvarn__pool_shared(&c->block_pool, s->blk[t]) ||
            kvarn__pool_shared(&c->page_pool, s->pg[t]))
            return 0;
    if (c->small_tail)
        for (int q = pos / c->tail_T; q <= (pos + n - 1) / c->tail_T; q++)
            if (kvarn__pool_shared(&c->tail_pool, s->tp[q])) return 0;
    return 1;
}

/* The direct path of kvarn_cache_write_exact, after the checks: the
 * records of the non-sink tiles wholly inside [pos, pos + n), this layer,
 * from the exact k, v (cache.h). Marks of every tile the write touches are
 * cleared first (their staged copy is about to change), then set for the
 * tiles encoded. */
static kvarn_status write_records(kvarn_cache *c, kvarn_seq *s, int layer, int pos, int n,
                                  const float *k, const float *v, int exact)
{
    const int G = c->info.block_size, H = c->info.n_kv_heads, D = c->info.head_dim;
    const size_t L = (size_t)c->info.n_layers;
    for (int t = pos / G; t <= (pos + n - 1) / G; t++) s->exact[(size_t)t * L + (size_t)layer] = 0;
    if (!exact) return KVARN_OK;
    int t0 = (pos + G - 1) / G;
    if (t0 < c->info.sink_tiles) t0 = c->info.sink_tiles;
    const int t1 = (pos + n) / G; /* tiles [t0, t1) lie wholly inside */
    for (int t = t0; t < t1; t++) {
        for (int h = 0; h < H; h++) {
            /* the values passed check_input: cannot fail */
            kvarn_status st = kvarn__encode_rows(&c->info.format, D, H, h, k, v,
                                                 (size_t)(t * G - pos), c->tile_k, c->tile_v,
                                                 kvarn__block_record(c, layer, s->blk[t], h),
                                                 c->info.record_stride, c->enc_ws,
                                                 c->enc_ws_bytes, &c->codec_opts);
            if (st != KVARN_OK) return st;
        }
        s->exact[(size_t)t * L + (size_t)layer] = 1;
    }
    return KVARN_OK;
}

static kvarn_status cache_write(kvarn_cache *c, int seq, int layer, int pos, int n,
                                const float *k, const float *v, int exact)
{
    kvarn_seq *s = kvarn__seq_get(c, seq);
    if (s == NULL || layer < 0 || layer >= c->info.n_layers || n < 0 || pos < 0 ||
        pos > s->len || n > s->len - pos || (n > 0 && (k == NULL || v == NULL)))
        return KVARN_ERR_INVALID_ARG;
    if (n == 0) return KVARN_OK;
    if (pos < kvarn__seq_frozen_len(c, s) || pos > s->written[layer] ||
        !tiles_private(c, s, pos, n))
        return KVARN_ERR_STATE;

    const int G = c->info.block_size, H = c->info.n_kv_heads, D = c->info.head_dim;
    const size_t row = (size_t)H * (size_t)D;
    kvarn_status st = check_input(c, k, (size_t)n * (size_t)H);
    if (st == KVARN_OK) st = check_input(c, v, (size_t)n * (size_t)H);
    if (st != KVARN_OK) return st;

    /* Checks done: from here on every token is stored. */
    if (c->is_kvarn) {
        st = write_records(c, s, layer, pos, n, k, v, exact);
        if (st != KVARN_OK) return st;
    }
    kvarn_stager stager;
    if (kvarn__staged_records(c)) kvarn__stager_init(&stager, &c->stage_fmt, D);
    for (int j = 0; j < n; j++) {
        const int p = pos + j, t = p / G, off = p % G;
        for (int h = 0; h < H; h++) {
            const float *kx = k + (size_t)j * row + (size_t)h * (size_t)D;
            const float *vx = v + (size_t)j * row + (size_t)h * (size_t)D;
            if (kvarn__staged_records(c)) {
                /* rotated into scratch rows of the commit tile (unused
                 * between commits), then the staging's token codec */
                st = kvarn__stage_token(&stager, kx, vx, c->tile_k, c->tile_v,
                                        kvarn__row_rec(c, s, layer, p, h),
                                        c->info.staging_record_bytes);
                /* the rotated values fit fp16 (check_input), so the
                 * record's scale and zero-point do: cannot fail after the
                 * checks */
                if (st != KVARN_OK) return st;
            } else if (c->is_kvarn) {
                for (int kv = 0; kv < 2; kv++) {
                    uint16_t *dst = kvarn__row_kv(c, s, layer, p, h, kv);
                    memcpy(c->vec, kv ? vx : kx, (size_t)D * sizeof(float));
                    kvarn_hadamard(c->vec, D);
                    for (int d = 0; d < D; d++) dst[d] = kvarn__fp16_from_f32(c->vec[d]);
                }
            } else {
                uint8_t *rec = kvarn__block_record(c, layer, s->blk[t], h) +
                               (size_t)off * c->info.token_record_bytes;
                st = kvarn_encode(&c->info.format, D, kx, vx, rec,
                                  c->info.token_record_bytes, NULL, 0, NULL);
                /* Arguments were checked above; only a codec that cannot
                 * serve the format can fail here, for the first token. */
                if (st != KVARN_OK) return st;
            }
        }
    }
    if (pos + n > s->written[layer]) s->written[layer] = pos + n;
    return KVARN_OK;
}

kvarn_status kvarn_cache_write(kvarn_cache *c, int seq, int layer, int pos,
                               int n, const float *k, const float *v)
{
    return cache_write(c, seq, layer, pos, n, k, v, 0);
}

kvarn_status kvarn_cache_write_exact(kvarn_cache *c, int seq, int layer, int pos,
                                     int n, const float *k, const float *v)
{
    return cache_write(c, seq, layer, pos, n, k, v, 1);
}

/* Encode tile t of every layer and KV head from its page (or its small
 * tail pages, gathered row by row into the same fp32 scratch) into its
 * block; a layer whose record kvarn_cache_write_exact wrote from the exact
 * K/V (s->exact) keeps it. */
static kvarn_status encode_tile(kvarn_cache *c, const kvarn_seq *s, int t)
{
    const int G = c->info.block_size, D = c->info.head_dim;
    for (int l = 0; l < c->info.n_layers; l++) {
        if (s->exact[(size_t)t * (size_t)c->info.n_layers + (size_t)l]) continue;
        for (int h = 0; h < c->info.n_kv_heads; h++) {
            for (int j = 0; j < G && kvarn__staged_records(c); j++) {
                /* the staged record decoded to the fp32 it stands for */
                kvarn_status st = kvarn_decode(&c->stage_fmt, D, kvarn__row_rec(c, s, l, t * G + j, h),
                                               c->info.staging_record_bytes,
                                               c->tile_k + (size_t)j * D, c->tile_v + (size_t)j * D, 0);
                if (st != KVARN_OK) return st;
            }
            for (int j = 0; j < G && !kvarn__staged_records(c); j++) {
                const uint16_t *pk = kvarn__row_kv(c, s, l, t * G + j, h, 0);
                const uint16_t *pv = kvarn__row_kv(c, s, l, t * G + j, h, 1);
                float *dk = c->tile_k + (size_t)j * D, *dv = c->tile_v + (size_t)j * D;
                for (int d = 0; d < D; d++) {
                    dk[d] = kvarn__fp16_to_f32(pk[d]);
                    dv[d] = kvarn__fp16_to_f32(pv[d]);
                }
            }
            kvarn_status st = kvarn_encode(&c->info.format, D, c->tile_k, c->tile_v,
                                           kvarn__block_record(c, l, s->blk[t], h),
                                           c->info.record_stride, c->enc_ws,
                                           c->enc_ws_bytes, &c->codec_opts);
            if (st != KVARN_OK) return st;
        }
    }
    return KVARN_OK;
}

/* Copy tokens [0, r) of tile t (every layer and KV head) from its page or
 * small pages into the sequence's sink slot (r = info.sink_partial). */
static void copy_sink(kvarn_cache *c, const kvarn_seq *s, int seq, int t)
{
    const int G = c->info.block_size, D = c->info.head_dim;
    const size_t row = (size_t)D * sizeof(uint16_t);
    if (kvarn__staged_records(c)) {
        for (int l = 0; l < c->info.n_layers; l++)
            for (int h = 0; h < c->info.n_kv_heads; h++)
                for (int j = 0; j < c->info.sink_partial; j++)
                    memcpy(kvarn__sink_rec(c, l, seq, h, j), kvarn__row_rec(c, s, l, t * G + j, h),
                           c->info.staging_record_bytes);
        return;
    }
    for (int l = 0; l < c->info.n_layers; l++)
        for (int h = 0; h < c->info.n_kv_heads; h++)
            for (int kv = 0; kv < 2; kv++)
                for (int j = 0; j < c->info.sink_partial; j++)
                    memcpy(kvarn__sink_kv(c, l, seq, h, kv) + (size_t)j * D,
                           kvarn__row_kv(c, s, l, t * G + j, h, kv), row);
}

kvarn_status kvarn_cache_commit(kvarn_cache *c, int seq, int committed_len)
{
    kvarn_seq *s = kvarn__seq_get(c, seq);
    if (s == NULL || committed_len < 0 || committed_len > s->len) return KVARN_ERR_INVALID_ARG;
    for (int l = 0; l < c->info.n_layers; l++)
        if (s->written[l] < committed_len) return KVARN_ERR_STATE;

    if (c->is_kvarn) {
        const int first = c->info.sink_tiles + s->n_quant;
        const int end = committed_len / c->info.block_size; /* tiles wholly below */
        /* Encode every tile first; a failure leaves the state as it was (the
         * blocks written belong to this sequence's uncommitted tiles, or hold
         * the same record already if shared: see docs/paged-cache.md). */
        for (int t = first; t < end; t++) {
            kvarn_status st = encode_tile(c, s, t);
            if (st != KVARN_OK) return st;
        }
        /* The partial sink tile keeps its first r tokens in fp16: copied
         * from its page into the sequence's sink slot before the page goes. */
        if (c->sinks && first == c->info.sink_tiles && end > first)
            copy_sink(c, s, seq, first);
        for (int t = first; t < end; t++) {
            kvarn__pool_decref(&c->page_pool, s->pg[t]);
            s->pg[t] = -1;
        }
        if (c->small_tail) {
            const int Q = c->info.block_size / c->tail_T;
            for (int q = first * Q; q < end * Q; q++) {
                kvarn__pool_decref(&c->tail_pool, s->tp[q]);
                s->tp[q] = -1;
            }
        }
        if (end > first) {
            s->n_quant += end - first;
            for (int t = first; t < end; t++) kvarn__seq_set_entry(c, s, t);
        }
    }
    if (committed_len > s->committed_len) s->committed_len = committed_len;
    return KVARN_OK;
}

kvarn_status kvarn_cache_read(kvarn_cache *c, int seq, int layer, int pos,
                              int n, float *k, float *v, unsigned flags)
{
    const kvarn_seq *s = kvarn__seq_get(c, seq);
    if (s == NULL || layer < 0 || layer >= c->info.n_layers || n < 0 || pos < 0 ||
        pos > s->len || n > s->len - pos || (flags & ~KVARN_DECODE_ROTATED) != 0)
        return KVARN_ERR_INVALID_ARG;
    const int G = c->info.block_size, H = c->info.n_kv_heads, D = c->info.head_dim;
    const size_t row = (size_t)H * (size_t)D;
    const int unrotate = c->is_kvarn && !(flags & KVARN_DECODE_ROTATED);
    const int sink_end = c->info.sink_tiles, quant_end = sink_end + s->n_quant;
    /* tokens [sink_end * G, sink_end * G + r) of a quantized partial sink
     * tile come from the sink slot, as attention reads them */
    const int slot_end = c->sinks && s->n_quant > 0 ? c->info.sink_partial : 0;

    int p = pos;
    while (p < pos + n) {
        const int t = p / G, off0 = p % G;
        int cnt = G - off0;
        if (cnt > pos + n - p) cnt = pos + n - p;
        const int in_page = c->is_kvarn && (t < sink_end || t >= quant_end);
        for (int h = 0; h < H; h++) {
            if (in_page && kvarn__staged_records(c)) {
                for (int j = 0; j < cnt; j++) {
                    const size_t o = (size_t)(p - pos + j) * row + (size_t)h * D;
                    kvarn_status st = kvarn_decode(&c->stage_fmt, D,
                                                   kvarn__row_rec(c, s, layer, p + j, h),
                                                   c->info.staging_record_bytes,
                                                   k ? k + o : NULL, v ? v + o : NULL, 0);
                    if (st != KVARN_OK) return st;
                    if (unrotate && k) kvarn_hadamard(k + o, D);
                    if (unrotate && v) kvarn_hadamard(v + o, D);
                }
            } else if (in_page) {
                for (int kv = 0; kv < 2; kv++) {
                    float *out = kv ? v : k;
                    if (out == NULL) continue;
                    for (int j = 0; j < cnt; j++) {
                        float *dst = out + (size_t)(p - pos + j) * row + (size_t)h * D;
                        const uint16_t *x = kvarn__row_kv(c, s, layer, p + j, h, kv);
                        for (int d = 0; d < D; d++) dst[d] = kvarn__fp16_to_f32(x[d]);
                        if (unrotate) kvarn_hadamard(dst, D);
                    }
                }
            } else if (c->is_kvarn) {
                kvarn_status st = kvarn_decode(&c->info.format, D,
                                               kvarn__block_record(c, layer, s->blk[t], h),
                                               c->info.record_stride, c->tile_k, c->tile_v,
                                               flags);
                if (st != KVARN_OK) return st;
                for (int j = 0; j < cnt; j++) {
                    size_t o = (size_t)(p - pos + j) * row + (size_t)h * D;
                    size_t src = (size_t)(off0 + j) * D;
                    if (t == sink_end && off0 + j < slot_end && kvarn__staged_records(c)) {
                        kvarn_status st2 = kvarn_decode(&c->stage_fmt, D,
                                                        kvarn__sink_rec(c, layer, seq, h, off0 + j),
                                                        c->info.staging_record_bytes,
                                                        k ? k + o : NULL, v ? v + o : NULL, 0);
                        if (st2 != KVARN_OK) return st2;
                        if (unrotate && k) kvarn_hadamard(k + o, D);
                        if (unrotate && v) kvarn_hadamard(v + o, D);
                        continue;
                    }
                    if (t == sink_end && off0 + j < slot_end) {
                        for (int kv = 0; kv < 2; kv++) {
                            float *dst = kv ? v : k;
                            if (dst == NULL) continue;
                            const uint16_t *x =
                                kvarn__sink_kv(c, layer, seq, h, kv) + (size_t)(off0 + j) * D;
                            for (int d = 0; d < D; d++) dst[o + d] = kvarn__fp16_to_f32(x[d]);
                            if (unrotate) kvarn_hadamard(dst + o, D);
                        }
                        continue;
                    }
                    if (k) memcpy(k + o, c->tile_k + src, (size_t)D * sizeof(float));
                    if (v) memcpy(v + o, c->tile_v + src, (size_t)D * sizeof(float));
                }
            } else {
                for (int j = 0; j < cnt; j++) {
                    size_t o = (size_t)(p - pos + j) * row + (size_t)h * D;
                    const uint8_t *rec = kvarn__block_record(c, layer, s->blk[t], h) +
                                         (size_t)(off0 + j) * c->info.token_record_bytes;
                    kvarn_status st = kvarn_decode(&c->info.format, D, rec,
                                                   c->info.token_record_bytes,
                                                   k ? k + o : NULL, v ? v + o : NULL, 0);
                    if (st != KVARN_OK) return st;
                }
            }
        }
        p += cnt;
    }
    return KVARN_OK;
}
