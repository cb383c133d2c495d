/*
 * paged.h -- the paged KV layout of one layer, written down once: the view
 * structs and the address helpers every reader and writer of the layout uses
 * (the cache, the CPU attention kernels, the CUDA kernels, the tests, the
 * benchmarks, a plug-in). Nothing else spells out an address.
 *
 * Vocabulary (vLLM's PagedAttention): G tokens per block (= the KVarN tile),
 * Hk KV heads, head_dim D, a block table per sequence, a slot mapping for
 * stores.
 *
 * Tiles. A sequence of n tokens covers ceil(n / G) tiles; tile i holds
 * tokens [i*G, (i+1)*G). The sequence's block table maps tile i to an id.
 * Tile i is an fp16 page when the format is KVarN and i < sink_tiles (the
 * attention-sink tiles kept in fp16 for good) or i >= committed_tiles (the
 * fp16 staging tail not yet quantized); otherwise it is a block of the
 * quantized arena (kvarn_paged_tile_is_page). Per-token formats have
 * sink_tiles = 0, no pages, and write records at once.
 *
 * Quantized arena (bytes). Block b, KV head h: the tile record at
 *     blocks + b * block_stride + h * record_stride          (kvarn_paged_record)
 *   KVarN: one record of kvarn_record_bytes(fmt, D) bytes (include/kvarn/
 *   record.h). Per-token formats: G token records back to back, token j of
 *   the block at + j * token_record_bytes                   (kvarn_paged_token_record)
 *   Constraints: record_stride >= the tile record's bytes (KVarN) or
 *   >= G * token_record_bytes (per-token); block_stride >= Hk * record_stride.
 *
 * fp16 page arena (bytes; KVarN only). Page p, KV head h: an fp16 tile of
 * kvarn_paged_fp16_tile_bytes(G, D) = 2 * G * D * 2 bytes at
 *     fp16_pages + p * page_stride + h * page_head_stride    (kvarn_paged_page_k)
 *   holding K then V, each fp16 (IEEE half) [G][D], token-major:
 *     K row t at + t * D * 2 bytes, V row t at + (G + t) * D * 2 bytes
 *                                                             (kvarn_paged_page_v)
 *   For KVarN the fp16 K and V are stored already rotated by H/sqrt(D)
 *   (../shared/spec/KVARN.md "The fp16 tail and the sink"), so attention
 *   works in the rotated basis throughout.
 *   Constraints: page_head_stride >= kvarn_paged_fp16_tile_bytes(G, D),
 *   page_stride >= Hk * page_head_stride, both multiples of 2.
 *
 * Who owns the arenas. The strides make the view describe any arena:
 *   - kvarn_cache's own (include/kvarn/cache.h), packed: record_stride =
 *     tile record bytes, block_stride = Hk * record_stride, page_head_stride
 *     = kvarn_paged_fp16_tile_bytes(G, D), page_stride = Hk * page_head_stride
 *     (kvarn_paged_pack_pages); layer l's view points at arena + l * (the
 *     bytes of one layer's blocks or pages).
 *   - a caller's page arena, e.g. a vLLM per-layer cache tensor of shape
 *     [num_blocks][Hk][G][bytes_per_token] (uint8): blocks = its data
 *     pointer, block_stride = its stride(0) and record_stride = its stride(1)
 *     in bytes, n_blocks = num_blocks; and an fp16 sink/staging pool
 *     [num_pages][Hk][2][G][D] (fp16) keyed by its own ids: fp16_pages = its
 *     data pointer, page_stride = stride(0) * 2, page_head_stride =
 *     stride(1) * 2.
 *
 * Sink shorter than a tile (KVarN; sink_partial = r in (0, G)). The first
 * S = sink_tiles * G + r tokens of a sequence are the attention sink. The
 * sink_tiles whole tiles are fp16 pages as above; tile sink_tiles (the
 * partial sink tile) is an ordinary tile: an fp16 tail page until its
 * commit, then a block holding its record, encoded from all G tokens as
 * usual (the record layout is the spec's). From its commit on, its first r
 * tokens are ALSO kept in fp16 in the sequence's sink slot, and attention
 * reads tokens [0, r) of that tile from the slot and only [r, G) from the
 * record. The slot of sequence s (kvarn_seq_view.sink_slot), KV head h:
 *     fp16_sinks + slot * sink_stride + h * sink_head_stride (kvarn_paged_sink_k)
 *   holding K then V, each fp16 (IEEE half) [r][D], token-major, rotated
 *   like the pages: K row t at + t * D * 2, V row t at + (r + t) * D * 2
 *                                                          (kvarn_paged_sink_v)
 *   Constraints: sink_head_stride >= kvarn_paged_fp16_tile_bytes(r, D),
 *   sink_stride >= Hk * sink_head_stride, both multiples of 2; the slot is
 *   read only while tile sink_tiles is quantized (committed_tiles >
 *   sink_tiles), and must then lie in [0, n_sink_slots).
 *   r = 0 (every sink a whole number of tiles): no slots; fp16_sinks,
 *   the sink strides, n_sink_slots and sink_slot are not read.
 *
 * Small tail pages (KVarN; tail_page_tokens = T with 0 < T < G and T
 * dividing G). The tail tiles (i >= max(sink_tiles, committed_tiles),
 * kvarn_paged_tile_in_tail_pages) are not whole pages then: their tokens
 * live in small fp16 pages of T tokens each, from their own arena, and
 * their block table entries are not read. The sequence's tail starts at
 * token a = max(sink_tiles, committed_tiles) * G (kvarn_paged_tail_start);
 * kvarn_seq_view.tail_pages[j] is the small page holding tokens
 * [a + j*T, a + (j+1)*T), for j < ceil((seq_len - a) / T). Small page q,
 * KV head h:
 *     fp16_tail_pages + q * tail_page_stride + h * tail_page_head_stride
 *                                                          (kvarn_paged_tail_k)
 *   holding K then V, each fp16 (IEEE half) [T][D], token-major, rotated
 *   like the pages: K row t at + t * D * 2, V row t at + (T + t) * D * 2
 *                                                          (kvarn_paged_tail_v)
 *   Constraints: tail_page_head_stride >= kvarn_paged_fp16_tile_bytes(T, D),
 *   tail_page_stride >= Hk * tail_page_head_stride, both multiples of 2;
 *   every id in [0, n_tail_pages). Sink tiles stay whole pages.
 *   T = 0 or T = G: the tail is whole pages as above; the small-page fields
 *   are not read (a zeroed view is today's layout).
 *
 * Slot mapping (what an engine passes when storing): slot = id * G + offset
 * for the token at offset within its tile (kvarn_paged_slot); id is the page
 * for KVarN (every store lands in the fp16 sink or tail) and the block for
 * per-token formats. With small tail pages a tail token's slot is
 * q * T + (its offset in the small page q), in the small pages' id space.
 *
 * n_blocks and n_fp16_pages bound the arenas: readers check every id they
 * will follow against them and never reach outside. The helpers below do
 * not check: they are the arithmetic only, for ids already checked.
 */
#ifndef KVARN_PAGED_H
#define KVARN_PAGED_H

#include <stddef.h>
#include <stdint.h>

#include "kvarn/kvarn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The helpers are plain inline arithmetic, callable from C, C++ and CUDA
 * device code alike. */
/* Staging. How a KVarN cache holds the tokens it stages (the sink tiles,
 * the tail not yet committed, the sink slots): fp16 rows (the layout
 * above), or records of a per-token format (include/kvarn/record.h, that
 * format's own codec), one record per token and KV head, token-major:
 * token t of a page / small page / slot, KV head h, is the record at
 *     + t * staging_record_bytes  from the head's start (kvarn_paged_page_rec,
 * _tail_rec, _sink_rec). Staged values are the rotated ones, as for fp16.
 * The record stagings and their per-token formats (bytes per token-head):
 *   KVARN_STAGING_INT8      int8: asymmetric RTN, fp16 scale and
 *                           zero-point per token-head and K/V     2D + 8
 *   KVARN_STAGING_FP8_E4M3  fp8_e4m3: E4M3 codes, fp16 scale per
 *                           token-head and K/V                    2D + 4
 *   KVARN_STAGING_INT4      int4: as int8 with 4-bit codes         D + 8
 * (fp16 rows: 4D). */
typedef enum kvarn_staging {
    KVARN_STAGING_FP16 = 0,
    KVARN_STAGING_INT8 = 1,
    KVARN_STAGING_FP8_E4M3 = 2,
    KVARN_STAGING_INT4 = 3
} kvarn_staging;

#if defined(__CUDACC__)
#define KVARN_PAGED_FN static inline __host__ __device__
#else
#define KVARN_PAGED_FN static inline
#endif

/* One layer's paged K/V. Borrowed pointers: the view owns nothing. CPU
 * attention (attn.h) only reads through it; the CUDA store and commit
 * (cuda.h) write through it (device pointers there). */
typedef struct kvarn_paged_kv {
    kvarn_format fmt;
    int head_dim;               /* D, channels */
    int n_kv_heads;             /* Hk */
    int block_size;             /* G, tokens per block (= tile_tokens for KVarN) */
    int sink_tiles;             /* fp16 sink tiles at the start (KVarN only) */
    uint8_t *blocks;            /* quantized arena of this layer */
    size_t block_stride;        /* bytes between blocks (>= Hk * record_stride) */
    size_t record_stride;       /* bytes between KV heads inside a block */
    size_t token_record_bytes;  /* per-token formats: bytes of one token record */
    uint16_t *fp16_pages;       /* fp16 page arena of this layer (KVarN; may be
                                   NULL for per-token formats) */
    size_t page_stride;         /* bytes between pages (>= Hk * page_head_stride) */
    size_t page_head_stride;    /* bytes between KV heads inside a page
                                   (>= kvarn_paged_fp16_tile_bytes(G, D)) */
    int n_blocks;               /* blocks in the quantized arena: ids [0, n_blocks) */
    int n_fp16_pages;           /* pages in the fp16 arena: ids [0, n_fp16_pages) */
    /* Sink shorter than a tile (KVarN; see the top). Zero (memset) = none. */
    int sink_partial;           /* r in [0, G): sink tokens of tile sink_tiles
                                   kept in fp16 slots once it is quantized */
    uint16_t *fp16_sinks;       /* sink slot arena of this layer (r > 0) */
    size_t sink_stride;         /* bytes between slots (>= Hk * sink_head_stride) */
    size_t sink_head_stride;    /* bytes between KV heads inside a slot
                                   (>= kvarn_paged_fp16_tile_bytes(r, D)) */
    int n_sink_slots;           /* slots in the arena: ids [0, n_sink_slots) */
    /* Small tail pages (KVarN; see the top). Zero (memset) = none. */
    int tail_page_tokens;       /* T: 0 or G = whole tail pages; else 0 < T <
                                   G, T divides G: tail tiles in small pages */
    uint16_t *fp16_tail_pages;  /* small page arena of this layer (0 < T < G) */
    size_t tail_page_stride;    /* bytes between small pages
                                   (>= Hk * tail_page_head_stride) */
    size_t tail_page_head_stride; /* bytes between KV heads inside a small
                                   page (>= kvarn_paged_fp16_tile_bytes(T, D)) */
    int n_tail_pages;           /* small pages in the arena: ids [0, n_tail_pages) */
    /* Staging below fp16 (KVarN; "Staging" at kvarn_staging). Zero
     * (memset) = fp16, today's layout. */
    int staging;                /* kvarn_staging: format of every staged
                                   token (whole pages, small tail pages, sink
                                   slots) */
    size_t staging_record_bytes;/* staging other than fp16: bytes of one
                                   staged token record (>= kvarn_record_bytes
                                   of the staging's per-token format at D);
                                   else not read */
} kvarn_paged_kv;

/* One sequence, as attention reads it. */
typedef struct kvarn_seq_view {
    const int32_t *block_table; /* [ceil(seq_len / G)] block or page ids */
    int seq_len;                /* tokens of context, >= 0 */
    int committed_tiles;        /* tiles [sink_tiles, committed_tiles) are quantized */
    int sink_slot;              /* the sequence's sink slot (kv->sink_partial > 0) */
    const int32_t *tail_pages;  /* small tail pages (0 < kv->tail_page_tokens
                                   < G): [ceil((seq_len - kvarn_paged_tail_start)
                                   / T)] ids, tail token order; else not read */
} kvarn_seq_view;

/* Bytes of one KV head's fp16 tile in a page: K and V, fp16 [G][D] each. */
KVARN_PAGED_FN size_t kvarn_paged_fp16_tile_bytes(int block_size, int head_dim)
{
    return (size_t)2 * (size_t)block_size * (size_t)head_dim * sizeof(uint16_t);
}

/* Bytes of one KV head's staged tokens (K and V) for `tokens` tokens in the
 * view's staging format: kvarn_paged_fp16_tile_bytes for fp16, tokens *
 * staging_record_bytes for a record staging (int8, fp8_e4m3, int4). */
KVARN_PAGED_FN size_t kvarn_paged_staging_bytes(const kvarn_paged_kv *kv, int tokens)
{
    if (kv->staging != KVARN_STAGING_FP16) return (size_t)tokens * kv->staging_record_bytes;
    return kvarn_paged_fp16_tile_bytes(tokens, kv->head_dim);
}

/* Set page_head_stride and page_stride to the packed page layout
 * [page][Hk][K, V][G][D] (fp16) or [page][Hk][G] staged token records from
 * kv->block_size, head_dim, n_kv_heads and staging (the layout kvarn_cache
 * uses). For G <= 1024, D <= 1024, Hk <= 65535 the products stay below
 * 2^38. */
KVARN_PAGED_FN void kvarn_paged_pack_pages(kvarn_paged_kv *kv)
{
    kv->page_head_stride = kvarn_paged_staging_bytes(kv, kv->block_size);
    kv->page_stride = (size_t)kv->n_kv_heads * kv->page_head_stride;
}

/* Byte offset of (id, KV head) in an arena with these strides (bytes). The
 * one place the paged address is formed. id and head >= 0. */
KVARN_PAGED_FN size_t kvarn_paged_offset(size_t id_stride, size_t head_stride,
                                         int32_t id, int head)
{
    return (size_t)id * id_stride + (size_t)head * head_stride;
}

/* Tile record of block `block`, KV head `head` (KVarN: the record; per-token:
 * the first of its G token records). block in [0, n_blocks), head in [0, Hk). */
KVARN_PAGED_FN uint8_t *kvarn_paged_record(const kvarn_paged_kv *kv, int32_t block, int head)
{
    return kv->blocks + kvarn_paged_offset(kv->block_stride, kv->record_stride, block, head);
}

/* Per-token formats: the record of token `token` (in [0, G)) of block
 * `block`, KV head `head`. */
KVARN_PAGED_FN uint8_t *kvarn_paged_token_record(const kvarn_paged_kv *kv, int32_t block,
                                                 int head, int token)
{
    return kvarn_paged_record(kv, block, head) + (size_t)token * kv->token_record_bytes;
}

/* fp16 K [G][D] of page `page`, KV head `head` (page in [0, n_fp16_pages)). */
KVARN_PAGED_FN uint16_t *kvarn_paged_page_k(const kvarn_paged_kv *kv, int32_t page, int head)
{
    return (uint16_t *)((uint8_t *)kv->fp16_pages +
                        kvarn_paged_offset(kv->page_stride, kv->page_head_stride, page, head));
}

/* fp16 V [G][D] of page `page`, KV head `head`: right after its K. */
KVARN_PAGED_FN uint16_t *kvarn_paged_page_v(const kvarn_paged_kv *kv, int32_t page, int head)
{
    return kvarn_paged_page_k(kv, page, head) + (size_t)kv->block_size * (size_t)kv->head_dim;
}

/* Set sink_head_stride and sink_stride to the packed slot layout
 * [slot][Hk][K, V][r][D] from kv->sink_partial, head_dim and n_kv_heads
 * (the layout kvarn_cache uses). */
KVARN_PAGED_FN void kvarn_paged_pack_sinks(kvarn_paged_kv *kv)
{
    kv->sink_head_stride = kvarn_paged_staging_bytes(kv, kv->sink_partial);
    kv->sink_stride = (size_t)kv->n_kv_heads * kv->sink_head_stride;
}

/* fp16 K [r][D] of sink slot `slot`, KV head `head` (slot in
 * [0, n_sink_slots), r = kv->sink_partial > 0). */
KVARN_PAGED_FN uint16_t *kvarn_paged_sink_k(const kvarn_paged_kv *kv, int32_t slot, int head)
{
    return (uint16_t *)((uint8_t *)kv->fp16_sinks +
                        kvarn_paged_offset(kv->sink_stride, kv->sink_head_stride, slot, head));
}

/* fp16 V [r][D] of sink slot `slot`, KV head `head`: right after its K. */
KVARN_PAGED_FN uint16_t *kvarn_paged_sink_v(const kvarn_paged_kv *kv, int32_t slot, int head)
{
    return kvarn_paged_sink_k(kv, slot, head) + (size_t)kv->sink_partial * (size_t)kv->head_dim;
}

/* Tokens of tile i read from the sink slot instead of the tile's record:
 * r for the quantized partial sink tile (i == sink_tiles < committed_tiles,
 * KVarN), else 0. */
KVARN_PAGED_FN int kvarn_paged_tile_sink_tokens(const kvarn_paged_kv *kv, int committed_tiles,
                                                int i)
{
    if (kv->fmt.kind != KVARN_KIND_KVARN || kv->sink_partial <= 0) return 0;
    return i == kv->sink_tiles && i < committed_tiles ? kv->sink_partial : 0;
}

/* Whether tile i of a sequence with committed_tiles quantized tiles is an
 * fp16 page (1) or a block of the quantized arena (0). */
KVARN_PAGED_FN int kvarn_paged_tile_is_page(const kvarn_paged_kv *kv, int committed_tiles, int i)
{
    if (kv->fmt.kind != KVARN_KIND_KVARN) return 0;
    return i < kv->sink_tiles || i >= committed_tiles;
}

/* Whether the tail of this view lives in small pages of T tokens
 * (KVarN, 0 < tail_page_tokens < G). */
KVARN_PAGED_FN int kvarn_paged_small_tail(const kvarn_paged_kv *kv)
{
    return kv->fmt.kind == KVARN_KIND_KVARN && kv->tail_page_tokens > 0 &&
           kv->tail_page_tokens < kv->block_size;
}

/* First token of the tail, a = max(sink_tiles, committed_tiles) * G: tail
 * token a + j * T + t is row t of small page tail_pages[j]. */
KVARN_PAGED_FN int64_t kvarn_paged_tail_start(const kvarn_paged_kv *kv, int committed_tiles)
{
    const int first = committed_tiles > kv->sink_tiles ? committed_tiles : kv->sink_tiles;
    return (int64_t)first * kv->block_size;
}

/* Whether tile i is read from small tail pages (kvarn_paged_small_tail and
 * i >= max(sink_tiles, committed_tiles)); such a tile is also a page for
 * kvarn_paged_tile_is_page, but its block table entry is not read. */
KVARN_PAGED_FN int kvarn_paged_tile_in_tail_pages(const kvarn_paged_kv *kv, int committed_tiles,
                                                  int i)
{
    return kvarn_paged_small_tail(kv) && i >= kv->sink_tiles && i >= committed_tiles;
}

/* Set tail_page_head_stride and tail_page_stride to the packed small page
 * layout [page][Hk][K, V][T][D] from kv->tail_page_tokens, head_dim and
 * n_kv_heads (the layout kvarn_cache uses). */
KVARN_PAGED_FN void kvarn_paged_pack_tail_pages(kvarn_paged_kv *kv)
{
    kv->tail_page_head_stride = kvarn_paged_staging_bytes(kv, kv->tail_page_tokens);
    kv->tail_page_stride = (size_t)kv->n_kv_heads * kv->tail_page_head_stride;
}

/* fp16 K [T][D] of small tail page `page`, KV head `head` (page in
 * [0, n_tail_pages)). */
KVARN_PAGED_FN uint16_t *kvarn_paged_tail_k(const kvarn_paged_kv *kv, int32_t page, int head)
{
    return (uint16_t *)((uint8_t *)kv->fp16_tail_pages +
                        kvarn_paged_offset(kv->tail_page_stride, kv->tail_page_head_stride,
                                           page, head));
}

/* fp16 V [T][D] of small tail page `page`, KV head `head`: right after its K. */
KVARN_PAGED_FN uint16_t *kvarn_paged_tail_v(const kvarn_paged_kv *kv, int32_t page, int head)
{
    return kvarn_paged_tail_k(kv, page, head) +
           (size_t)kv->tail_page_tokens * (size_t)kv->head_dim;
}

/* Staging as records (not fp16): the staged token record of token `t` of page
 * `page` / small tail page `page` / sink slot `slot`, KV head `head`. */
KVARN_PAGED_FN uint8_t *kvarn_paged_page_rec(const kvarn_paged_kv *kv, int32_t page, int head,
                                             int t)
{
    return (uint8_t *)kvarn_paged_page_k(kv, page, head) + (size_t)t * kv->staging_record_bytes;
}

KVARN_PAGED_FN uint8_t *kvarn_paged_tail_rec(const kvarn_paged_kv *kv, int32_t page, int head,
                                             int t)
{
    return (uint8_t *)kvarn_paged_tail_k(kv, page, head) + (size_t)t * kv->staging_record_bytes;
}

KVARN_PAGED_FN uint8_t *kvarn_paged_sink_rec(const kvarn_paged_kv *kv, int32_t slot, int head,
                                             int t)
{
    return (uint8_t *)kvarn_paged_sink_k(kv, slot, head) + (size_t)t * kv->staging_record_bytes;
}

/* Slot of the token at `offset` (in [0, G)) of the tile stored at id (a
 * page for KVarN, a block for per-token formats): id * G + offset. */
KVARN_PAGED_FN int64_t kvarn_paged_slot(int32_t id, int block_size, int offset)
{
    return (int64_t)id * block_size + offset;
}

#ifdef __cplusplus
}
#endif

#endif /* KVARN_PAGED_H */
