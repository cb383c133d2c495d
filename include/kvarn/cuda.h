/*
 * cuda.h -- the CUDA backend: store, commit and attention kernels that read
 * and write the paged KV cache in device memory, behind a plain C ABI.
 *
 * Read top to bottom. The paged layout is the one of include/kvarn/paged.h
 * (block table, slot mapping, fp16 pages, quantized blocks, strides), the
 * record layout the one of include/kvarn/record.h; nothing here invents its
 * own.
 *
 * Rules every call keeps (so that a caller can capture calls in a CUDA graph):
 *   - no allocation and no synchronization inside: every device buffer,
 *     workspace included, is the caller's; the size functions say how big;
 *   - work is enqueued on the caller's stream, passed as `void *` (a
 *     cudaStream_t; NULL is the legacy default stream) so that C users need
 *     not include CUDA headers;
 *   - arguments are checked on the host before anything is enqueued; a bad
 *     argument returns an error and enqueues nothing. Every launch's error
 *     is checked: KVARN_ERR_NO_DEVICE (no usable GPU or driver),
 *     KVARN_ERR_UNSUPPORTED (this device cannot run the kernel: no machine
 *     code or PTX for it, too little shared memory), KVARN_ERR_STATE (a
 *     sticky error left by an earlier fault on the context). Faults inside a
 *     kernel surface, as CUDA does, at the caller's next synchronization.
 *   - device pointers are not dereferenced on the host; values inside device
 *     arrays cannot be checked there without a synchronization, so the
 *     kernels skip slots and ids outside the arenas and trust the rest
 *     (sequence lengths <= max_seq_len, query_start_loc non-decreasing).
 *
 * Served by this build (one table, src/cuda/dispatch.h):
 *   - head_dim D in {64, 128, 256, 512} for every format;
 *   - KVarN presets with G in {64, 128} and (key, value) bits in {(4, 2),
 *     (4, 4)}: the four upstream presets (kvarn_k4v2_g128, kvarn_k4v2_g64,
 *     kvarn_k4v4_g128, kvarn_k4v4_g64); other KVarN names parse but return
 *     KVARN_ERR_UNSUPPORTED here;
 *   - every per-token format (fp16, bf16, fp8_e4m3, fp8_e5m2, int8, int4)
 *     with any block size G in [1, 128].
 * Not served: the MLA latent records of mla.h (kvarn_mla_* names are not a
 * kvarn_format: kvarn_format_parse refuses them with
 * KVARN_ERR_UNKNOWN_FORMAT, so no call here can be handed one; MLA runs on
 * the CPU, docs/mla.md).
 * Non-finite activations: the kernels cannot report them without a
 * synchronization; a NaN/Inf in K or V makes the affected record's values
 * undefined (the CPU encoder returns KVARN_ERR_NONFINITE instead).
 */
#ifndef KVARN_CUDA_H
#define KVARN_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "kvarn/attn.h"
#include "kvarn/kvarn.h"
#include "kvarn/paged.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Device                                                                   */
/* ------------------------------------------------------------------------ */

/* Number of CUDA devices the runtime sees. Returns KVARN_OK with *count > 0,
 * or KVARN_ERR_NO_DEVICE (no GPU, no driver; *count = 0), or
 * KVARN_ERR_INVALID_ARG for NULL. Host call; never fails otherwise. */
kvarn_status kvarn_cuda_device_count(int *count);

/* Streaming multiprocessors of device `device` (what kvarn_cuda_attn_plan
 * wants as num_sms). KVARN_ERR_NO_DEVICE if it does not exist. */
kvarn_status kvarn_cuda_sm_count(int device, int *num_sms);

/* ------------------------------------------------------------------------ */
/* The paged cache of one layer, in device memory                           */
/* ------------------------------------------------------------------------ */

/* A layer is described by kvarn_paged_kv (include/kvarn/paged.h, where the
 * layout, its strides and its address helpers are written down), with
 * device pointers in blocks and fp16_pages; the kernels write through them
 * (store, commit). The arenas may be the caller's own, e.g. a vLLM
 * per-layer cache tensor [num_blocks][Hk][G][bytes_per_token] and an fp16
 * sink/staging pool [num_pages][Hk][2][G][D], described by their strides.
 * How the store knows where a token goes: the slot mapping's id is a page
 * id for KVarN (every new token lands in the fp16 staging area; a full,
 * accepted tile moves into the arena with kvarn_cuda_commit) and a block id
 * for per-token formats (records are written at once). The block table a
 * sequence hands to attention maps tile i to a page id when
 * i < sink_tiles or i >= committed_tiles (KVarN), else to a block id.
 * Ids outside [0, n_blocks) / [0, n_fp16_pages) found in a slot mapping,
 * block table or commit list are skipped by the kernels (never read or
 * written), as negative ones are.
 * Alignment: blocks, block_stride, record_stride and token_record_bytes must
 * be multiples of 4 bytes; fp16_pages, page_stride and page_head_stride
 * (KVarN) of 16 bytes. */

/* Whether this build has kernels for fmt at head_dim D (the table above).
 * Host only; works without a GPU. Returns KVARN_OK,
 * KVARN_ERR_UNSUPPORTED_HEAD_DIM (D not in {64, 128, 256, 512} or not served by
 * the format), KVARN_ERR_UNSUPPORTED (valid format, no kernel here: among
 * them every mean-centred KVarN format, kvarn_format.centred) or
 * KVARN_ERR_INVALID_ARG (NULL or malformed format). */
kvarn_status kvarn_cuda_supports(const kvarn_format *fmt, int head_dim);

/* Check a paged-cache description: served format and D, n_kv_heads >= 1,
 * block_size (= tile_tokens for KVarN, in [1, 128] otherwise), strides large
 * enough for the record (record_stride >= record bytes, block_stride >=
 * n_kv_heads * record_stride, per-token: token_record_bytes >= record bytes
 * and record_stride >= G * token_record_bytes; KVarN: page_head_stride >=
 * kvarn_paged_fp16_tile_bytes(G, D), page_stride >= n_kv_heads *
 * page_head_stride), alignment, sink_tiles >= 0, sink_partial == 0 (a
 * sink shorter than a tile is read by the CPU kernels only:
 * KVARN_ERR_UNSUPPORTED), tail_page_tokens 0 or G (small tail pages are
 * read by the CPU kernels only: KVARN_ERR_UNSUPPORTED),
 * non-NULL arenas, n_blocks >= 1 (and n_fp16_pages >= 1 for KVarN). Host only. KVARN_OK or the first error found. */
kvarn_status kvarn_cuda_check_kv(const kvarn_paged_kv *kv);

/* ------------------------------------------------------------------------ */
/* Store and commit (../shared/spec/KVARN.md "Store pipeline")              */
/* ------------------------------------------------------------------------ */

/* Element type of the activations handed to the store. */
typedef enum kvarn_cuda_dtype {
    KVARN_CUDA_F16 = 0,
    KVARN_CUDA_BF16 = 1
} kvarn_cuda_dtype;

/* Write the K/V of num_tokens freshly computed tokens into the cache.
 *   k, v          device, dtype [num_tokens][n_kv_heads][D], contiguous
 *                 (keys after RoPE).
 *   slot_mapping  device, int64 [num_tokens]: slot = id * G + offset (id: an
 *                 fp16 page for KVarN, a block for per-token formats);
 *                 negative = padding, skipped.
 * KVarN: each token-head's K and V are rotated by H/sqrt(D) (fast
 * Walsh-Hadamard, fp32) and stored as fp16 (RNE) into the page row.
 * Per-token formats: the token record is encoded exactly as the CPU encoder
 * does (src/codec/per_token.c: fp16-rounded-up scales, rounded-down zero).
 * num_tokens == 0 enqueues nothing and returns KVARN_OK.
 * Errors: KVARN_ERR_INVALID_ARG (NULL, num_tokens < 0, bad dtype, bad kv),
 * KVARN_ERR_UNSUPPORTED(_HEAD_DIM), KVARN_ERR_NO_DEVICE. */
kvarn_status kvarn_cuda_store(const kvarn_paged_kv *kv, kvarn_cuda_dtype dtype,
                              const void *k, const void *v,
                              const int64_t *slot_mapping, int num_tokens,
                              void *stream);

/* Commit full, accepted KVarN tiles: for each i < num_tiles, read fp16 page
 * src_pages[i] (all n_kv_heads heads; already rotated) and write one record
 * per KV head into quantized block dst_blocks[i]: variance normalization
 * (opts->balance_iters iterations, default 8), asymmetric RTN, folding and
 * packing exactly as kvarn_encode with prerotated = 1 on the page's values.
 * The caller then points the block table's entry at the block and may
 * reuse the page. A negative entry in either array skips that tile (so a
 * graph can be captured for a fixed num_tiles).
 *   src_pages, dst_blocks  device, int32 [num_tiles].
 *   opts                   NULL for the defaults; `prerotated` is ignored
 *                          (pages are always rotated).
 * Errors: KVARN_ERR_INVALID_ARG (NULL, num_tiles < 0, per-token format,
 * balance_iters outside [0, 64], rtn_range not a KVARN_RTN_* value),
 * KVARN_ERR_UNSUPPORTED(_HEAD_DIM) (also for rtn_range KVARN_RTN_MSE: the
 * device commit runs the spec's min/max range only), KVARN_ERR_NO_DEVICE. */
kvarn_status kvarn_cuda_commit(const kvarn_paged_kv *kv,
                               const int32_t *src_pages, const int32_t *dst_blocks,
                               int num_tiles, const kvarn_codec_opts *opts,
                               void *stream);

/* ------------------------------------------------------------------------ */
/* Attention over the paged cache                                           */
/* ------------------------------------------------------------------------ */

/* Host-side shape of one attention call. */
typedef struct kvarn_cuda_attn_shape {
    int num_seqs;            /* sequences in the batch, [1, 65535] */
    int num_heads;           /* query heads Hq, a multiple of n_kv_heads (GQA) */
    int max_blocks_per_seq;  /* row length of the block table */
    int max_seq_len;         /* upper bound of every seq_lens[i] (tokens) */
    int max_query_len;       /* 1 for decode; >= every query count (multi-query) */
    int sliding_window;      /* 0: none; else a query at position p attends to
                                keys at positions (p - sliding_window, p] */
    float softmax_scale;     /* usually 1/sqrt(D) */
} kvarn_cuda_attn_shape;

/* How the work is split (flash-decoding split-K) and the workspace it needs.
 * Filled by kvarn_cuda_attn_plan_make; plain value. */
typedef struct kvarn_cuda_attn_plan {
    kvarn_cuda_attn_shape shape;
    int group_size;          /* Hq / Hk: query heads per KV head */
    int row_chunks;          /* blocks per (sequence, KV head): ceil(max_query_len
                                * group_size / 8); a block serves 8 query rows */
    int num_splits;          /* split-K factor over the context, in [1, 64] */
    size_t workspace_bytes;  /* device workspace kvarn_cuda_attention needs:
                                0 when num_splits == 1, else num_seqs *
                                n_kv_heads * row_chunks * num_splits * 8 *
                                (D + 2) * 4 bytes. A caller may change
                                num_splits (e.g. to test split-K on short
                                contexts) if it sets workspace_bytes to match. */
} kvarn_cuda_attn_plan;

/* Plan an attention call: checks kv and shape, picks num_splits so that
 * about 2 * num_sms thread blocks run when few sequences have long contexts
 * (num_sms <= 0: no split), and sizes the workspace (0 when no split).
 * Host only; works without a GPU. The same plan may be reused for every
 * call of that shape (and inside a captured graph).
 * Errors: KVARN_ERR_INVALID_ARG (NULL, sizes out of range, num_heads not a
 * multiple of n_kv_heads, softmax_scale not finite and > 0, bad kv),
 * KVARN_ERR_UNSUPPORTED(_HEAD_DIM). */
kvarn_status kvarn_cuda_attn_plan_make(const kvarn_paged_kv *kv,
                                  const kvarn_cuda_attn_shape *shape, int num_sms,
                                  kvarn_cuda_attn_plan *plan);

/* Device arrays of one attention call. */
typedef struct kvarn_cuda_attn_args {
    const float *q;               /* fp32 [num_q][Hq][D] (post-RoPE, unrotated) */
    float *out;                   /* fp32 [num_q][Hq][D] */
    const int32_t *block_tables;  /* int32 [num_seqs][max_blocks_per_seq] */
    const int32_t *seq_lens;      /* int32 [num_seqs]: context tokens, queries
                                     included (they are already stored) */
    const int32_t *committed_tiles; /* int32 [num_seqs]: tiles < this (and >=
                                     sink_tiles) are quantized; KVarN only,
                                     may be NULL for per-token formats */
    const int32_t *query_start_loc; /* NULL: decode, one query per sequence
                                     (num_q = num_seqs) at position seq_len-1;
                                     else int32 [num_seqs + 1]: sequence i owns
                                     queries [qsl[i], qsl[i+1]), the last
                                     tokens of its context, each causal */
    const float *sinks;           /* NULL: none; else fp32 [Hq], a learned
                                     sink logit per query head (attn.h
                                     kvarn_attn_opts.sinks: the scores'
                                     units, -INFINITY = none); device memory,
                                     not read on the host: the caller keeps
                                     out NaN and +Inf */
} kvarn_cuda_attn_args;

/* Attention of every query over its sequence's paged K/V (decode, chunked
 * prefill, speculative verification). For each query head h of KV head
 * h / group_size: out = softmax(scale * q K^T) V over the keys the query may
 * see (causal, optional sliding window). KVarN: the query is rotated by
 * H/sqrt(D) once, scores come straight from the integer codes
 * (../shared/spec/KVARN.md "Attention over records") and fp16 pages, and the
 * output is rotated back once. One pass over each tile serves up to 8 query
 * rows (the GQA group, times queries) of one KV head; with num_splits > 1
 * partial results go to the workspace and a second kernel merges them.
 * Prefill chunks over KVarN formats at D 64 or 128 (in a multi-query call
 * whose plan has max_query_len >= 32, each sequence with 32 or more queries,
 * on a device of compute capability 8.0 or later) take the tensor-core
 * kernel instead: 64 rows a thread block, each
 * tile's keys and values dequantized once to bf16, the scores and the
 * weighted values as bf16 matrix products with fp32 sums
 * (kvarn_cuda_attn_kernel_info_get says which kernel and its rounding).
 * A query that sees no key (seq_len 0) gets zeros. With args->sinks each
 * head's softmax denominator gets exp(s_h) more (the merge's last step).
 *   workspace  device, >= plan->workspace_bytes, 16-byte aligned (NULL if 0).
 * Errors: KVARN_ERR_INVALID_ARG (NULL arrays, plan not made for kv),
 * KVARN_ERR_BUFFER_TOO_SMALL (workspace), KVARN_ERR_UNSUPPORTED(_HEAD_DIM),
 * KVARN_ERR_NO_DEVICE. */
kvarn_status kvarn_cuda_attention(const kvarn_paged_kv *kv,
                                  const kvarn_cuda_attn_plan *plan,
                                  const kvarn_cuda_attn_args *args,
                                  void *workspace, size_t workspace_bytes,
                                  void *stream);

/* Which kernel kvarn_cuda_attention runs for a plan, and its arithmetic
 * (attn.h kvarn_attn_arith), so that a caller or a test can bound the
 * rounding. */
typedef struct kvarn_cuda_attn_kernel_info {
    kvarn_attn_arith scores;        /* the vector kernel (decode, verification,
                                       every per-token format, sequences of
                                       fewer than matrix_min_queries queries):
                                       KVARN_ATTN_ARITH_FP32 -- codes and fp16
                                       values converted to fp32, fp32 products
                                       and sums */
    kvarn_attn_arith sums;          /* the same for p.v */
    int matrix;                     /* 1: in a multi-query call (args->query_start_loc
                                       non-NULL) with this plan, every sequence
                                       with matrix_min_queries queries or more
                                       runs on the tensor-core kernel
                                       (src/cuda/attn_mma.cu), the others on
                                       the vector kernel, so a sequence's
                                       result does not depend on the rest of
                                       the batch; on a device of compute
                                       capability 8.0 or later with code built
                                       for it (otherwise the vector kernel
                                       runs, and the fields below overstate
                                       the rounding); 0: never (also when the
                                       environment's KVARN_CUDA_MATRIX is "0",
                                       read at each call) */
    int matrix_min_queries;         /* 32: a sequence's queries from which it
                                       takes the tensor-core kernel; 0 */
    int matrix_rows;                /* query rows per thread block there (64); 0 */
    kvarn_attn_arith matrix_scores; /* KVARN_ATTN_ARITH_BF16: the rotated query
                                       (softmax scale and log2(e) folded in)
                                       and every key rounded once to bf16
                                       (nearest even, relative error <= 2^-8;
                                       a record's key formed in fp32 as
                                       s_tok_t (a_d c_td + b_d), one FMA then
                                       the product; an fp16 page's key from
                                       fp16), exact products, fp32 sums;
                                       FP32 where matrix is 0 */
    kvarn_attn_arith matrix_sums;   /* KVARN_ATTN_ARITH_BF16: every weight
                                       p_t = 2^(s_t - m) and every value
                                       (s_chan_d (a_t c_td + b_t), or from
                                       fp16) rounded once to bf16, fp32 sums;
                                       the softmax denominator sums the
                                       unrounded p_t in fp32 */
} kvarn_cuda_attn_kernel_info;

/* Fill *info for attention calls with this plan over kv. Host only; works
 * without a GPU. Errors: KVARN_ERR_INVALID_ARG (NULL, plan not made for
 * kv), KVARN_ERR_UNSUPPORTED(_HEAD_DIM) as kvarn_cuda_attn_plan_make; *info
 * untouched on error. */
kvarn_status kvarn_cuda_attn_kernel_info_get(const kvarn_paged_kv *kv,
                                             const kvarn_cuda_attn_plan *plan,
                                             kvarn_cuda_attn_kernel_info *info);

#ifdef __cplusplus
}
#endif

#endif /* KVARN_CUDA_H */
