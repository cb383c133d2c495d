/*
 * paged_ops.h -- store and commit into a paged KV arena the caller owns
 * (a vLLM per-layer cache tensor and an fp16 staging pool beside it): the
 * CPU counterparts of kvarn_cuda_store / kvarn_cuda_commit (cuda.h), on the
 * same views (include/kvarn/paged.h). kvarn_cache (cache.h) manages its own
 * arenas and does not need these; an engine that owns the block pool, the
 * block tables and the slot mapping (vLLM) does.
 *
 * Source: ../shared/spec/KVARN.md "Store pipeline" and "The fp16 tail and
 * the sink"; docs/vllm.md says how the plug-in uses them.
 */
#ifndef KVARN_PAGED_OPS_H
#define KVARN_PAGED_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "kvarn/kvarn.h"
#include "kvarn/paged.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Check a view's geometry before storing or committing through it: a
 * served format and head_dim, n_kv_heads >= 1, block_size = the format's
 * tile (KVarN) or in [1, 1024] (per-token), strides as paged.h's
 * "Constraints" (record_stride >= the tile record's bytes or G token
 * records, block_stride >= Hk * record_stride, page strides for KVarN,
 * all products checked), blocks non-NULL with n_blocks >= 0, and for KVarN
 * fp16_pages non-NULL, 2-byte aligned, with n_fp16_pages >= 0.
 * Errors: KVARN_ERR_INVALID_ARG, KVARN_ERR_UNSUPPORTED_HEAD_DIM. */
kvarn_status kvarn_paged_check(const kvarn_paged_kv *kv);

/* Store the K/V of n_tokens tokens at their slots.
 *   k, v          fp32 [n_tokens][Hk][D], contiguous (keys after RoPE).
 *   slot_mapping  int64 [n_tokens]: slot = id * G + offset (paged.h's
 *                 kvarn_paged_slot): id is an fp16 page for KVarN (every
 *                 KVarN token waits in fp16 until its tile is committed),
 *                 a block for per-token formats. Negative = padding, skipped.
 * KVarN: each token-head's K and V are rotated by H/sqrt(D) and stored as
 * fp16 (round to nearest even) in the page row, or, with a record staging
 * (KVARN_STAGING_INT8, _FP8_E4M3, _INT4), as one token record of the
 * rotated K and V (kvarn_encode of the staging's per-token format,
 * staging_record_bytes; paged.h "Staging"). Per-token formats: the
 * token record is encoded in place, the bytes of kvarn_encode (int8 and
 * int4 checked first by their rows' scale and zero point alone; the other
 * formats' token-heads encoded twice: once into scratch by the checks,
 * once in place).
 * Everything is checked before anything is written: on any error nothing
 * was stored. No allocation; n_tokens == 0 is a no-op.
 * Slots address whole fp16 pages only: a view with small tail pages
 * (paged.h's kvarn_paged_small_tail, 0 < tail_page_tokens < G) is refused,
 * since its small pages have no slot numbering.
 * Errors: KVARN_ERR_INVALID_ARG (NULL with n_tokens > 0, n_tokens < 0, bad
 * view or a view with small tail pages, a slot's id outside the arena),
 * KVARN_ERR_UNSUPPORTED_HEAD_DIM,
 * KVARN_ERR_NONFINITE (NaN/Inf in k or v; KVarN: a rotated value beyond
 * fp16's range; per-token: a finite value kvarn_encode refuses because a
 * stored fp16 field would overflow, e.g. an int8 zero-point below -65504). */
kvarn_status kvarn_paged_store(const kvarn_paged_kv *kv, const float *k, const float *v,
                               const int64_t *slot_mapping, int n_tokens);

/* Bytes of workspace kvarn_paged_commit needs for this view: two fp32
 * [G][D] tiles and the encoder's scratch. 0 for per-token formats and bad
 * views. */
size_t kvarn_paged_commit_workspace_bytes(const kvarn_paged_kv *kv);

/* Commit full, accepted KVarN tiles: for each i < n_tiles, read page
 * src_pages[i] (every KV head; already rotated; fp16 rows, or with a record
 * staging its G token records decoded to fp32 by kvarn_decode of the
 * staging's per-token format) and encode one record per
 * KV head into block dst_blocks[i] with kvarn_encode(prerotated = 1). The
 * page is left as it is (the caller frees or keeps it: a sink tile may
 * keep its fp16 copy). A negative entry in either array skips that tile.
 *   src_pages, dst_blocks  int32 [n_tiles].
 *   opts       NULL for the defaults (8 balance iterations); prerotated is
 *              ignored (pages are always rotated).
 *   workspace  kvarn_paged_commit_workspace_bytes(kv) bytes, 16-byte
 *              aligned.
 * Ids are checked before anything is written. A NaN/Inf in a page (a
 * caller writing pages by hand) stops at that tile with
 * KVARN_ERR_NONFINITE; earlier tiles were written.
 * Errors: KVARN_ERR_INVALID_ARG (NULL with n_tiles > 0, n_tiles < 0,
 * per-token format, bad view or opts (also when every entry is skipped),
 * workspace not 16-byte aligned, an id outside its arena),
 * KVARN_ERR_BUFFER_TOO_SMALL (workspace NULL or too small),
 * KVARN_ERR_NONFINITE. */
kvarn_status kvarn_paged_commit(const kvarn_paged_kv *kv, const int32_t *src_pages,
                                const int32_t *dst_blocks, int n_tiles,
                                const kvarn_codec_opts *opts,
                                void *workspace, size_t workspace_size);

/* Commit whole KVarN tiles straight from the exact K/V of the step that
 * brought all their tokens (a prefill chunk), not from their staged copy:
 * for each i < n_tiles, tokens [first_rows[i], first_rows[i] + G) of k and v
 * (G = the format's tile) are, per KV head, the tile's G tokens in order,
 * and kvarn_encode(prerotated = 0) of that fp32 tile (the whole store
 * pipeline, ../shared/spec/KVARN.md "Store pipeline for one full tile",
 * rotation included) is written into block dst_blocks[i]. The record is the
 * one kvarn_encode gives for those K/V bit for bit; kvarn_paged_commit of
 * the same tokens' page would encode them after the staging's rounding
 * (fp16 rows or int8/fp8/int4 token records: two roundings, "The fp16 tail
 * and the sink"). Pages are neither read nor written: the caller still
 * stores the tokens (kvarn_paged_store) for the attention that reads the
 * tile staged before its commit. Only tiles whose tokens are all final
 * (accepted, never speculative drafts) may be committed, as with
 * kvarn_paged_commit. A negative entry in either array skips that tile.
 *   k, v        fp32 [n_tokens][Hk][D], contiguous, the model's basis (keys
 *               after RoPE): the arrays kvarn_paged_store takes.
 *   n_tokens    rows of k and v (>= 0).
 *   first_rows, dst_blocks  int32 [n_tiles]; first_rows[i] + G <= n_tokens.
 *   opts        NULL for the defaults (8 balance iterations, min/max RTN);
 *               prerotated is ignored (the input is always rotated here).
 *   workspace   kvarn_paged_commit_workspace_bytes(kv) bytes, 16-byte
 *               aligned (the workspace kvarn_paged_commit takes).
 * Everything is checked before anything is written: on any error no block
 * changed. No allocation; n_tiles == 0 is a no-op (after the checks of kv
 * and opts).
 * Errors: KVARN_ERR_INVALID_ARG (NULL with n_tiles > 0, n_tiles < 0 or
 * n_tokens < 0, per-token format, bad view or opts, workspace not 16-byte
 * aligned, a row range outside [0, n_tokens), a block id outside the
 * arena), KVARN_ERR_UNSUPPORTED_HEAD_DIM, KVARN_ERR_BUFFER_TOO_SMALL
 * (workspace NULL or too small), KVARN_ERR_NONFINITE (NaN/Inf in a tile's
 * K/V, or a rotated value beyond fp16's range: what kvarn_paged_store
 * refuses for the same tokens). */
kvarn_status kvarn_paged_commit_exact(const kvarn_paged_kv *kv, const float *k, const float *v,
                                      int n_tokens, const int32_t *first_rows,
                                      const int32_t *dst_blocks, int n_tiles,
                                      const kvarn_codec_opts *opts,
                                      void *workspace, size_t workspace_size);

#ifdef __cplusplus
}
#endif

#endif /* KVARN_PAGED_OPS_H */
