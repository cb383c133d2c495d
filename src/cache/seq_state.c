/*
 * seq_state.c -- save one sequence of the paged cache as a byte stream and
 * restore it as a new sequence (include/kvarn/state.h; the byte layout:
 * docs/state.md). One walk over the sequence's bytes serves the size, the
 * save, the check of a stream and the restore, so the four cannot disagree
 * on the order; the restore checks the whole stream before it takes a
 * block, so a refused stream leaves the cache as it was.
 * Source: include/kvarn/paged.h (where every byte lives), docs/state.md.
 */
#include <stdint.h>
#include <string.h>
#include <zlib.h>

#include "cache/cache_internal.h"
#include "kvarn/state.h"

static const char k_magic[8] = {'K', 'V', 'A', 'R', 'N', 'S', 'E', 'Q'};

/* Header byte offsets (docs/state.md "Byte layout"). */
enum {
    H_MAGIC = 0, H_VERSION = 8, H_HEADER_BYTES = 12, H_FORMAT = 16, H_HEAD_DIM = 48,
    H_KV_HEADS = 52, H_LAYERS = 56, H_BLOCK = 60, H_SINK_TILES = 64, H_SINK_PARTIAL = 68,
    H_STAGING = 72, H_RTN = 76, H_BALANCE = 80, H_SEQ_LEN = 84, H_COMMITTED = 88,
    H_QUANT = 92, H_PAYLOAD = 96, H_CRC = 104, H_RESERVED = 108,
    H_END = KVARN_SEQ_STATE_HEADER_BYTES
};

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t get64(const uint8_t *p)
{
    return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32;
}

/* CRC-32 of the header with its CRC field taken as zero, then the payload. */
static uint32_t stream_crc(const uint8_t *hdr, const uint8_t *payload, size_t payload_bytes)
{
    uint8_t h[H_END];
    memcpy(h, hdr, H_END);
    put32(h + H_CRC, 0);
    uLong crc = crc32_z(0L, Z_NULL, 0);
    crc = crc32_z(crc, h, H_END);
    if (payload_bytes) crc = crc32_z(crc, payload, payload_bytes);
    return (uint32_t)crc;
}

/* ---- the walk over a sequence's bytes --------------------------------- */

typedef enum walk_mode {
    W_SIZE,  /* count the bytes */
    W_SAVE,  /* cache -> stream */
    W_CHECK, /* stream checked, nothing touched (no sequence yet) */
    W_LOAD   /* stream -> cache, after W_CHECK passed */
} walk_mode;

/* What a chunk must hold: a record of the cache's format, a staged token
 * (fp16 rows or a record of the staging's per-token format), a mark. */
typedef enum chunk_kind { C_RECORD, C_STAGED, C_MARK } chunk_kind;

typedef struct walker {
    walk_mode mode;
    const kvarn_cache *c;
    kvarn_seq *s;              /* the sequence (NULL while checking) */
    int seq;                   /* its id (the sink slot) */
    int len, nq;               /* seq_len, quantized tiles */
    uint8_t *buf;              /* the payload (NULL for W_SIZE) */
    size_t cap, off;           /* its bytes, the walk's position */
    kvarn_record_layout stage_layout; /* of a staged record */
    kvarn_status st;
} walker;

static int fp16_finite(const uint8_t *p, size_t bytes)
{
    for (size_t i = 0; i + 1 < bytes; i += 2) {
        uint16_t u;
        memcpy(&u, p + i, 2);
        if ((u & 0x7c00u) == 0x7c00u) return 0;
    }
    return 1;
}

/* The codes of a record of kind k are finite: fp16 / bf16 values, fp8
 * codes other than NaN (E4M3 S.1111.111) or Inf/NaN (E5M2 exponent
 * 11111); integer codes always are. */
static int codes_finite(kvarn_kind k, const uint8_t *p, size_t bytes)
{
    for (size_t i = 0; i < bytes; i++) {
        if (k == KVARN_KIND_FP8_E4M3 && (p[i] & 0x7fu) == 0x7fu) return 0;
        if (k == KVARN_KIND_FP8_E5M2 && (p[i] & 0x7cu) == 0x7cu) return 0;
        if (k == KVARN_KIND_BF16 && (i & 1u) && (p[i] & 0x7fu) == 0x7fu &&
            (p[i - 1] & 0x80u))
            return 0;
    }
    return k != KVARN_KIND_FP16 || fp16_finite(p, bytes);
}

/* Every value of one record of format kind k with layout L is finite: its
 * fp16 fields (scales, offsets, balance factors, means; record.h) and its
 * codes. */
static int record_finite(kvarn_kind k, const kvarn_record_layout *L, const uint8_t *r)
{
    const size_t f[][2] = {{L->k_a_off, L->k_a_bytes},       {L->k_b_off, L->k_b_bytes},
                           {L->k_stok_off, L->k_stok_bytes}, {L->v_schan_off, L->v_schan_bytes},
                           {L->v_a_off, L->v_a_bytes},       {L->v_b_off, L->v_b_bytes},
                           {L->v_mu_off, L->v_mu_bytes}};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        if (!fp16_finite(r + f[i][0], f[i][1])) return 0;
    return codes_finite(k, r + L->k_codes_off, L->k_codes_bytes) &&
           codes_finite(k, r + L->v_codes_off, L->v_codes_bytes);
}

/* Status of one stream chunk of n bytes as the cache would hold it. */
static kvarn_status check_chunk(const walker *w, const uint8_t *b, size_t n, chunk_kind k)
{
    const kvarn_cache *c = w->c;
    if (k == C_MARK) return *b <= 1 ? KVARN_OK : KVARN_ERR_BAD_FILE;
    if (k == C_RECORD) {
        /* a tile record, or a per-token block's token records one by one */
        const size_t rb = c->is_kvarn ? c->info.record_stride : c->info.token_record_bytes;
        for (size_t o = 0; o + rb <= n; o += rb)
            if (!record_finite(c->info.format.kind, &c->layout, b + o)) return KVARN_ERR_NONFINITE;
        return KVARN_OK;
    }
    if (!kvarn__staged_records(c)) return fp16_finite(b, n) ? KVARN_OK : KVARN_ERR_NONFINITE;
    const size_t rb = c->info.staging_record_bytes;
    for (size_t o = 0; o + rb <= n; o += rb)
        if (!record_finite(c->stage_fmt.kind, &w->stage_layout, b + o)) return KVARN_ERR_NONFINITE;
    return KVARN_OK;
}

/* One chunk of n bytes at cache address p (not read while checking or
 * sizing). Returns the chunk's stream bytes for a mark's value, NULL once
 * the walk failed or when sizing. */
static const uint8_t *chunk(walker *w, void *p, size_t n, chunk_kind k)
{
    if (w->st != KVARN_OK) return NULL;
    if (w->mode == W_SIZE) {
        if (n > SIZE_MAX - w->off) w->st = KVARN_ERR_TOO_LARGE;
        w->off += n;
        return NULL;
    }
    if (n > w->cap - w->off) {
        w->st = KVARN_ERR_BAD_FILE; /* the fields promise more than the payload holds */
        return NULL;
    }
    uint8_t *b = w->buf + w->off;
    w->off += n;
    if (w->mode == W_SAVE) memcpy(b, p, n);
    else if (w->mode == W_LOAD) memcpy(p, b, n);
    else w->st = check_chunk(w, b, n, k);
    return w->st == KVARN_OK ? b : NULL;
}

/* Per-token formats: the token records per (layer, token, KV head). */
static void walk_per_token(walker *w)
{
    const kvarn_cache *c = w->c;
    const size_t tb = c->info.token_record_bytes;
    const int G = c->info.block_size;
    for (int l = 0; l < c->info.n_layers; l++)
        for (int p = 0; p < w->len; p++)
            for (int h = 0; h < c->info.n_kv_heads; h++) {
                uint8_t *r = w->s ? kvarn__block_record(c, l, w->s->blk[p / G], h) +
                                        (size_t)(p % G) * tb
                                  : NULL;
                chunk(w, r, tb, C_RECORD);
            }
}

/* One staged token-head: fp16 K row then V row, or one staged record. */
static void walk_staged_token(walker *w, int l, int p, int h)
{
    const kvarn_cache *c = w->c;
    const int D = c->info.head_dim;
    if (kvarn__staged_records(c)) {
        chunk(w, w->s ? kvarn__row_rec(c, w->s, l, p, h) : NULL, c->info.staging_record_bytes,
              C_STAGED);
        return;
    }
    for (int kv = 0; kv < 2; kv++)
        chunk(w, w->s ? kvarn__row_kv(c, w->s, l, p, h, kv) : NULL,
              (size_t)D * sizeof(uint16_t), C_STAGED);
}

/* KVarN: quantized records, staged tokens, sink slot, exact marks. */
static void walk_kvarn(walker *w)
{
    const kvarn_cache *c = w->c;
    const int G = c->info.block_size, sink = c->info.sink_tiles, H = c->info.n_kv_heads;
    const int L = c->info.n_layers, qend = sink + w->nq, nt = (w->len + G - 1) / G;
    const size_t rs = c->info.record_stride;
    for (int l = 0; l < L; l++)
        for (int t = sink; t < qend; t++)
            for (int h = 0; h < H; h++)
                chunk(w, w->s ? kvarn__block_record(c, l, w->s->blk[t], h) : NULL, rs, C_RECORD);
    for (int l = 0; l < L; l++)
        for (int p = 0; p < w->len; p++)
            if (p / G < sink || p / G >= qend)
                for (int h = 0; h < H; h++) walk_staged_token(w, l, p, h);
    if (c->info.sink_partial > 0 && w->nq > 0)
        for (int l = 0; l < L; l++)
            for (int h = 0; h < H; h++)
                chunk(w, w->s ? kvarn__sink_kv(c, l, w->seq, h, 0) : NULL,
                      kvarn__staging_bytes(c, c->info.sink_partial), C_STAGED);
    for (int t = qend; t < nt; t++)
        for (int l = 0; l < L; l++) {
            uint8_t *mark = w->s ? &w->s->exact[(size_t)t * (size_t)L + (size_t)l] : NULL;
            const uint8_t *b = chunk(w, mark, 1, C_MARK);
            /* saving and sizing read the sequence's mark, the others the stream's */
            const int set = w->mode == W_SAVE || w->mode == W_SIZE ? *mark : b ? *b : 0;
            if (w->mode == W_CHECK && set && (t + 1) * G > w->len)
                w->st = KVARN_ERR_BAD_FILE; /* exact records are of full tiles only */
            for (int h = 0; h < H && set; h++)
                chunk(w, w->s ? kvarn__block_record(c, l, w->s->blk[t], h) : NULL, rs, C_RECORD);
        }
}

static kvarn_status walk(walker *w)
{
    if (w->c->is_kvarn) walk_kvarn(w);
    else walk_per_token(w);
    if (w->st == KVARN_OK && w->mode != W_SIZE && w->off != w->cap) w->st = KVARN_ERR_BAD_FILE;
    return w->st;
}

static walker walker_init(walk_mode mode, const kvarn_cache *c, kvarn_seq *s, int seq, int len,
                          int nq, uint8_t *buf, size_t cap)
{
    walker w;
    memset(&w, 0, sizeof w);
    w.mode = mode;
    w.c = c;
    w.s = s;
    w.seq = seq;
    w.len = len;
    w.nq = nq;
    w.buf = buf;
    w.cap = cap;
    w.st = KVARN_OK;
    if (kvarn__staged_records(c) &&
        kvarn_record_layout_get(&c->stage_fmt, c->info.head_dim, &w.stage_layout) != KVARN_OK)
        w.st = KVARN_ERR_STATE; /* the cache made this layout at create */
    return w;
}

/* ---- saving ------------------------------------------------------------ */

/* The sequence, with every layer written up to its length. */
static kvarn_status saveable(const kvarn_cache *c, int seq, kvarn_seq **out)
{
    kvarn_seq *s = kvarn__seq_get(c, seq);
    if (s == NULL) return KVARN_ERR_INVALID_ARG;
    for (int l = 0; l < c->info.n_layers; l++)
        if (s->written[l] != s->len) return KVARN_ERR_STATE;
    *out = s;
    return KVARN_OK;
}

kvarn_status kvarn_cache_seq_state_size(const kvarn_cache *c, int seq, size_t *bytes)
{
    kvarn_seq *s = NULL;
    if (c == NULL || bytes == NULL) return KVARN_ERR_INVALID_ARG;
    kvarn_status st = saveable(c, seq, &s);
    if (st != KVARN_OK) return st;
    walker w = walker_init(W_SIZE, c, s, seq, s->len, s->n_quant, NULL, 0);
    if ((st = walk(&w)) != KVARN_OK) return st;
    if (w.off > SIZE_MAX - H_END) return KVARN_ERR_TOO_LARGE;
    *bytes = H_END + w.off;
    return KVARN_OK;
}

/* The format name field: the canonical name, NUL-padded to 32 bytes. */
static void format_field(const kvarn_cache *c, uint8_t *f)
{
    memset(f, 0, sizeof c->info.format.name);
    memcpy(f, c->info.format.name, strnlen(c->info.format.name, sizeof c->info.format.name - 1));
}

static void write_header(const kvarn_cache *c, const kvarn_seq *s, uint8_t *h, size_t payload)
{
    memset(h, 0, H_END);
    memcpy(h + H_MAGIC, k_magic, sizeof k_magic);
    put32(h + H_VERSION, KVARN_SEQ_STATE_VERSION);
    put32(h + H_HEADER_BYTES, H_END);
    format_field(c, h + H_FORMAT);
    const int v[] = {c->info.head_dim,    c->info.n_kv_heads,       c->info.n_layers,
                     c->info.block_size,  c->info.sink_tiles,       c->info.sink_partial,
                     c->info.staging,     c->codec_opts.rtn_range,  c->codec_opts.balance_iters,
                     s->len,              s->committed_len,         s->n_quant};
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) put32(h + H_HEAD_DIM + 4 * i, (uint32_t)v[i]);
    put64(h + H_PAYLOAD, payload);
}

kvarn_status kvarn_cache_seq_save(const kvarn_cache *c, int seq, void *buf, size_t cap,
                                  size_t *written)
{
    size_t need = 0;
    if (written == NULL || (buf == NULL && cap > 0)) return KVARN_ERR_INVALID_ARG;
    kvarn_status st = kvarn_cache_seq_state_size(c, seq, &need);
    if (st != KVARN_OK) return st;
    *written = need;
    if (cap < need) return KVARN_ERR_BUFFER_TOO_SMALL;
    kvarn_seq *s = &c->seqs[seq];
    uint8_t *h = buf;
    walker w = walker_init(W_SAVE, c, s, seq, s->len, s->n_quant, h + H_END, need - H_END);
    if ((st = walk(&w)) != KVARN_OK) return st;
    write_header(c, s, h, need - H_END);
    put32(h + H_CRC, stream_crc(h, h + H_END, need - H_END));
    return KVARN_OK;
}

/* ---- reading ----------------------------------------------------------- */

/* The first field of the header that differs from the cache's, or NULL. */
static const char *mismatch(const kvarn_cache *c, const uint8_t *h, const kvarn_seq_state_info *i)
{
    uint8_t name[sizeof c->info.format.name];
    format_field(c, name);
    if (memcmp(h + H_FORMAT, name, sizeof name) != 0) return "format"; /* padding included */
    const struct { int got, want; const char *name; } f[] = {
        {i->head_dim, c->info.head_dim, "head_dim"},
        {i->n_kv_heads, c->info.n_kv_heads, "n_kv_heads"},
        {i->n_layers, c->info.n_layers, "n_layers"},
        {i->block_size, c->info.block_size, "block_size"},
        {i->sink_tiles, c->info.sink_tiles, "sink_tiles"},
        {i->sink_partial, c->info.sink_partial, "sink_partial"},
        {i->staging, c->info.staging, "staging"},
        {i->rtn_range, c->codec_opts.rtn_range, "rtn_range"},
        {i->balance_iters, c->codec_opts.balance_iters, "balance_iters"},
    };
    for (size_t k = 0; k < sizeof f / sizeof f[0]; k++)
        if (f[k].got != f[k].want) return f[k].name;
    return NULL;
}

/* The header fields into *i (magic and header size already checked). */
static void read_header(const uint8_t *h, kvarn_seq_state_info *i)
{
    memcpy(i->format, h + H_FORMAT, sizeof i->format);
    i->format[sizeof i->format - 1] = '\0';
    int *v[] = {&i->head_dim,     &i->n_kv_heads, &i->n_layers,  &i->block_size,
                &i->sink_tiles,   &i->sink_partial, &i->staging, &i->rtn_range,
                &i->balance_iters, &i->seq_len,   &i->committed_len, &i->quantized_tiles};
    for (size_t k = 0; k < sizeof v / sizeof v[0]; k++) *v[k] = (int)get32(h + H_HEAD_DIM + 4 * k);
    i->payload_bytes = get64(h + H_PAYLOAD);
}

kvarn_status kvarn_cache_seq_state_peek(const kvarn_cache *c, const void *buf, size_t len,
                                        kvarn_seq_state_info *out)
{
    if (out == NULL || (buf == NULL && len > 0)) return KVARN_ERR_INVALID_ARG;
    memset(out, 0, sizeof *out);
    const uint8_t *b = buf;
    /* what there is of the magic must match before a short stream is
     * called truncated rather than something else */
    if (len > 0 && memcmp(b, k_magic, len < sizeof k_magic ? len : sizeof k_magic) != 0)
        return KVARN_ERR_BAD_FILE;
    if (len < H_HEADER_BYTES + 4) return KVARN_ERR_TRUNCATED;
    out->version = get32(b + H_VERSION);
    if (out->version != KVARN_SEQ_STATE_VERSION) return KVARN_ERR_BAD_VERSION;
    if (get32(b + H_HEADER_BYTES) != H_END) return KVARN_ERR_BAD_FILE;
    if (len < H_END) return KVARN_ERR_TRUNCATED;
    for (int k = H_RESERVED; k < H_END; k++)
        if (b[k] != 0) return KVARN_ERR_BAD_FILE;
    read_header(b, out);
    if (out->payload_bytes > UINT64_MAX - H_END) return KVARN_ERR_BAD_FILE;
    out->total_bytes = H_END + out->payload_bytes;
    if ((uint64_t)len < out->total_bytes) return KVARN_ERR_TRUNCATED;
    if ((uint64_t)len > out->total_bytes) return KVARN_ERR_BAD_FILE;
    if (stream_crc(b, b + H_END, len - H_END) != get32(b + H_CRC)) return KVARN_ERR_CHECKSUM;
    if (c != NULL && (out->mismatch = mismatch(c, b, out)) != NULL) return KVARN_ERR_MISMATCH;
    return KVARN_OK;
}

/* The sequence fields are ones the cache could hold: lengths in range, the
 * quantized tiles full and below committed_len's frozen bound, every full
 * tile below committed_len quantized (commit's rule, cache.h). */
static kvarn_status check_lengths(const kvarn_cache *c, const kvarn_seq_state_info *i)
{
    const int64_t G = c->info.block_size, sink = c->info.sink_tiles;
    const int64_t len = i->seq_len, cl = i->committed_len, nq = i->quantized_tiles;
    if (len < 0 || len > KVARN_CACHE_MAX_SEQ_LEN || cl < 0 || cl > len || nq < 0)
        return KVARN_ERR_BAD_FILE;
    if (!c->is_kvarn) return nq == 0 ? KVARN_OK : KVARN_ERR_BAD_FILE;
    if (nq > 0 && ((sink + nq) * G > len || cl < (sink + nq) * G)) return KVARN_ERR_BAD_FILE;
    if (cl / G > sink + nq) return KVARN_ERR_BAD_FILE;
    return KVARN_OK;
}

/* Blocks, pages and small tail pages the restored sequence holds:
 * the same as the saved one held (cache.h "Block accounting"). */
static void needs(const kvarn_cache *c, int len, int nq, int *nb, int *np, int *ntp)
{
    const int G = c->info.block_size, sink = c->info.sink_tiles, nt = (len + G - 1) / G;
    *nb = nt;
    *np = *ntp = 0;
    if (!c->is_kvarn) return;
    const int sink_pages = nt < sink ? nt : sink, tail_tiles = nt > sink + nq ? nt - sink - nq : 0;
    *nb = nt - sink_pages;
    *np = sink_pages + (c->small_tail ? 0 : tail_tiles);
    const int a = (sink + nq) * G; /* the tail's first token */
    if (c->small_tail && len > a) *ntp = (len + c->tail_T - 1) / c->tail_T - a / c->tail_T;
}

/* Give the new sequence s its blocks and pages and the saved lengths.
 * The pools were checked: cannot fail. */
static void take(kvarn_cache *c, kvarn_seq *s, const kvarn_seq_state_info *i)
{
    const int G = c->info.block_size, sink = c->info.sink_tiles, nq = i->quantized_tiles;
    const int nt = (i->seq_len + G - 1) / G;
    for (int t = 0; t < nt; t++) {
        if (c->is_kvarn) {
            const int page = t < sink || (!c->small_tail && t >= sink + nq);
            s->pg[t] = page ? kvarn__pool_alloc(&c->page_pool) : -1;
            s->blk[t] = t >= sink ? kvarn__pool_alloc(&c->block_pool) : -1;
        } else {
            s->blk[t] = kvarn__pool_alloc(&c->block_pool);
        }
    }
    if (c->small_tail && i->seq_len > (sink + nq) * G)
        for (int q = (sink + nq) * G / c->tail_T; q < (i->seq_len + c->tail_T - 1) / c->tail_T; q++)
            s->tp[q] = kvarn__pool_alloc(&c->tail_pool);
    s->len = i->seq_len;
    s->n_quant = nq;
    s->committed_len = i->committed_len;
    for (int l = 0; l < c->info.n_layers; l++) s->written[l] = i->seq_len;
    for (int t = 0; t < nt; t++) kvarn__seq_set_entry(c, s, t);
}

kvarn_status kvarn_cache_seq_restore(kvarn_cache *c, const void *buf, size_t len, int *seq_out)
{
    if (c == NULL || seq_out == NULL) return KVARN_ERR_INVALID_ARG;
    kvarn_seq_state_info i;
    kvarn_status st = kvarn_cache_seq_state_peek(c, buf, len, &i);
    if (st == KVARN_OK) st = check_lengths(c, &i);
    if (st != KVARN_OK) return st;
    if (i.seq_len > c->info.max_seq_len) return KVARN_ERR_OUT_OF_BLOCKS;
    uint8_t *payload = (uint8_t *)(uintptr_t)buf + H_END;
    walker w = walker_init(W_CHECK, c, NULL, -1, i.seq_len, i.quantized_tiles, payload,
                           (size_t)i.payload_bytes);
    if ((st = walk(&w)) != KVARN_OK) return st;

    int nb, np, ntp;
    needs(c, i.seq_len, i.quantized_tiles, &nb, &np, &ntp);
    if (nb > c->block_pool.n_free || np > c->page_pool.n_free || ntp > c->tail_pool.n_free)
        return KVARN_ERR_OUT_OF_BLOCKS;
    int seq;
    if ((st = kvarn_cache_seq_create(c, &seq)) != KVARN_OK) return st;
    /* From here on nothing can fail. */
    kvarn_seq *s = &c->seqs[seq];
    take(c, s, &i);
    w = walker_init(W_LOAD, c, s, seq, i.seq_len, i.quantized_tiles, payload,
                    (size_t)i.payload_bytes);
    walk(&w); /* the same walk W_CHECK passed */
    *seq_out = seq;
    return KVARN_OK;
}
