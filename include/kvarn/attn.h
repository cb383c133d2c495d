/*
 * attn.h -- attention that reads the paged KV cache directly, in any format.
 *
 * The paged layout is written down here once; the cache (cache.h) fills
 * these views, the CPU kernels (src/attn) and the CUDA kernels (src/cuda)
 * read them the same way.
 *
 * Paged layout of one layer (vLLM's PagedAttention vocabulary):
 *   - A sequence of n tokens covers ceil(n / G) tiles; tile i holds tokens
 *     [i*G, (i+1)*G). The sequence's block table maps tile i to an id.
 *   - Tile i is an fp16 page when i < sink_tiles (KVarN formats only: the
 *     attention-sink tiles kept in fp16 for good) or i >= committed_tiles
 *     (the fp16 staging tail not yet quantized); otherwise it is a block of
 *     the quantized arena. Per-token formats have sink_tiles = 0 and write
 *     records at once, so committed_tiles = ceil(n / G) for them.
 *   - Quantized block b, KV head h: the record at
 *       blocks + b * block_stride + h * record_stride
 *     For KVarN it is one record (include/kvarn/record.h). For per-token
 *     formats it is G token records back to back, token j at
 *       + j * token_record_bytes.
 *   - fp16 page p, KV head h: K then V, each fp16 [G][D] token-major:
 *       K at fp16_pages + ((p * n_kv_heads + h) * 2 + 0) * G * D
 *       V at fp16_pages + ((p * n_kv_heads + h) * 2 + 1) * G * D
 *     For KVarN formats the fp16 K and V are stored already rotated by
 *     H/sqrt(D) (../shared/spec/KVARN.md "The fp16 tail and the sink"), so
 *     attention works in the rotated basis throughout: the query is rotated
 *     in once and the output rotated back once.
 *   - Slot mapping (what an engine passes when storing): slot = block * G +
 *     offset for the token at offset within its tile.
 */
#ifndef KVARN_ATTN_H
#define KVARN_ATTN_H

#include <stddef.h>
#include <stdint.h>

#include "kvarn/kvarn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One layer's paged K/V, as attention reads it. Borrowed pointers. */
typedef struct kvarn_paged_kv {
    kvarn_format fmt;
    int head_dim;               /* D */
    int n_kv_heads;             /* Hk */
    int block_size;             /* G, tokens per block (= tile_tokens for KVarN) */
    int sink_tiles;             /* fp16 sink tiles at the start (KVarN only) */
    const uint8_t *blocks;      /* quantized arena of this layer */
    size_t block_stride;        /* bytes between blocks (>= Hk * record_stride) */
    size_t record_stride;       /* bytes between KV heads inside a block */
    size_t token_record_bytes;  /* per-token formats: bytes of one token record */
    const uint16_t *fp16_pages; /* fp16 page arena of this layer */
} kvarn_paged_kv;

/* One sequence, as attention reads it. */
typedef struct kvarn_seq_view {
    const int32_t *block_table; /* [ceil(seq_len / G)] block or page ids */
    int seq_len;                /* tokens of context, >= 0 */
    int committed_tiles;        /* tiles [sink_tiles, committed_tiles) are quantized */
} kvarn_seq_view;

#ifdef __cplusplus
}
#endif

#endif /* KVARN_ATTN_H */
