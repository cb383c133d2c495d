/*
 * paged_check.h -- the one check of a paged layer view's arena geometry
 * (include/kvarn/paged.h) that the CPU store/commit (paged_ops.c), the CPU
 * attention (src/attn/attn_check.c) and the CUDA backend (src/cuda/api.cu) share;
 * each adds only its own rules (block size range, sink slots, device
 * alignment). Internal to the library.
 */
#ifndef KVARN_CACHE_PAGED_CHECK_H
#define KVARN_CACHE_PAGED_CHECK_H

#include "kvarn/paged.h"
#include "kvarn/record.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The block arena must be given (store and commit write it; attention
 * checks each tile's arena in check_seq). */
#define KVARN_PAGED_NEED_BLOCKS 1u
/* Per-tile formats (KVarN): the fp16 page arena must be given (store and
 * commit write it). Without the flag the page geometry is checked only when
 * the arena is given: attention reads pages only for the tiles that are
 * pages, and refuses those when the arena is NULL. */
#define KVARN_PAGED_NEED_PAGES 2u

/* Check kv's arena geometry against L, its format's record layout
 * (kvarn_record_layout_get of kv->fmt and kv->head_dim, already checked by
 * the caller):
 *   counts     n_blocks, n_fp16_pages, sink_tiles >= 0;
 *   records    per-tile: record_stride >= L->record_bytes; per-token:
 *              token_record_bytes >= L->record_bytes and record_stride >=
 *              block_size x token_record_bytes;
 *   blocks     block_stride >= n_kv_heads x record_stride;
 *   fp16 pages (per-tile formats) 2-byte aligned base and strides,
 *              page_head_stride >= one K+V fp16 tile, page_stride >=
 *              n_kv_heads x page_head_stride.
 * Every product is checked: one beyond size_t is KVARN_ERR_INVALID_ARG (it
 * describes no arena; wrapped, it would pass as a small size). A size
 * shorter than what it must hold returns too_small (the CPU calls pass
 * KVARN_ERR_INVALID_ARG; CUDA KVARN_ERR_BUFFER_TOO_SMALL, as cuda.h
 * documents); anything else wrong KVARN_ERR_INVALID_ARG. Reads nothing
 * through the arena pointers. */
kvarn_status kvarn__paged_check_arenas(const kvarn_paged_kv *kv, const kvarn_record_layout *L,
                                       unsigned flags, kvarn_status too_small);

#ifdef __cplusplus
}
#endif

#endif
