/*
 * attn.h -- attention that reads the paged KV cache directly, in any format.
 *
 * The paged layout (the views kvarn_paged_kv and kvarn_seq_view, block
 * table, fp16 pages, strides, slot mapping) is written down once, in
 * include/kvarn/paged.h; the cache (cache.h) fills those views for its own
 * arenas, a caller may fill them for arenas it owns, and the CPU kernels
 * (src/attn) and the CUDA kernels (src/cuda) read them through its helpers.
 *
 * Attention (docs/attention.md). Queries and outputs are fp32 in the
 * ORIGINAL basis. Query head j reads KV head j / (Hq / Hk) (GQA). Scores are
 * softmax_scale * q.k over the positions a query may see; the output is the
 * softmax-weighted sum of V. For KVarN the kernels fold the record's scales
 * into the query and the weights (spec "Attention over records") and never
 * expand a record to fp16/fp32 in memory.
 *
 * Threads: the caller creates one kvarn_thread_pool and passes it to every
 * call (NULL: run on the calling thread only). Work items are (sequence, KV
 * head, block of up to 512 query rows, context chunk); long contexts with
 * few items are split into chunks (split-K) merged by log-sum-exp in a fixed
 * order, so a call is bit-for-bit deterministic for a given thread count
 * and options. Memory: the caller passes a workspace of
 * kvarn_attn_workspace_bytes(); the calls never allocate.
 */
#ifndef KVARN_ATTN_H
#define KVARN_ATTN_H

#include <stddef.h>
#include <stdint.h>

#include "kvarn/alloc.h"
#include "kvarn/kvarn.h"
#include "kvarn/paged.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Thread pool                                                              */
/* ------------------------------------------------------------------------ */

typedef struct kvarn_thread_pool kvarn_thread_pool;

/* Create a pool of n_threads workers (the calling thread counts as one, so
 * n_threads - 1 pthreads are started; n_threads in [1, 256]). Create once,
 * reuse for every call; the threads sleep between calls. A pool serves one
 * call at a time: calls that share a pool must not overlap.
 * Errors: KVARN_ERR_INVALID_ARG (NULL out, n_threads out of range),
 * KVARN_ERR_NOMEM (allocation or thread creation failed; nothing leaks). */
kvarn_status kvarn_thread_pool_create(int n_threads, kvarn_thread_pool **out);

/* The same, with the pool and its thread table allocated through allocator
 * (copied; must outlive the pool; NULL = malloc/free, alloc.h). The threads'
 * stacks are the C library's. Errors as above, and KVARN_ERR_INVALID_ARG for
 * an allocator with only one of alloc/free set. */
kvarn_status kvarn_thread_pool_create_ex(int n_threads, const kvarn_allocator *allocator,
                                         kvarn_thread_pool **out);

/* Stop and join the workers, free the pool. NULL is a no-op. */
void kvarn_thread_pool_destroy(kvarn_thread_pool *pool);

/* Workers in the pool, the calling thread included; 1 for NULL. */
int kvarn_thread_pool_size(const kvarn_thread_pool *pool);

/* ------------------------------------------------------------------------ */
/* Attention                                                                */
/* ------------------------------------------------------------------------ */

/* Knobs for tests and benchmarks (split-K forcing, scalar kernels): declared
 * in the experimental section at the end of this header. */
struct kvarn_attn_testing;

/* Options of one attention call. */
typedef struct kvarn_attn_opts {
    float softmax_scale; /* multiplies q.k (usually 1/sqrt(D)); finite, > 0 */
    int sliding_window;  /* W > 0: a query at position p sees only positions
                            (p - W, p]; 0: off. Non-causal queries count the
                            window back from the sequence's last token. */
    int causal;          /* multi-query: 1 (default) query i of a chunk of
                            q_len sees positions <= seq_len - q_len + i;
                            0: every query sees the whole sequence */
    const struct kvarn_attn_testing *testing; /* NULL (default): split-K
                            automatic (with fewer than 4 work items per
                            thread, contexts are split into chunks of >= 512
                            tokens, ~4 per thread in all), the best kernels
                            KVARN_SIMD allows. Else the experimental knobs
                            (KVARN_EXPERIMENTAL_API, below); borrowed for
                            the call. */
    const float *sinks;  /* NULL (default): no sink. Else fp32 [Hq], one
                            learned sink logit s_h per query head (gpt-oss's
                            `sinks`), in the units of the scores (the
                            softmax scale already applied, natural log):
                            head h's softmax gets one more term exp(s_h)
                            in its denominator with no value, o = sum_t
                            exp(x_t) v_t / (exp(s_h) + sum_t exp(x_t));
                            -INFINITY: no sink for that head (the output
                            is then the plain call's, bit for bit); NaN or
                            +INFINITY: KVARN_ERR_NONFINITE. Borrowed for
                            the call; docs/attention.md "Learned sinks". */
    int io_bf16;         /* 0 (default): q and out are fp32, as the calls'
                            signatures say. 1: they are bfloat16 (16-bit
                            patterns, the same shapes in elements; pass the
                            pointers cast to float *): q read exactly
                            (bf16 -> fp32), each output element rounded
                            once to bf16 (nearest even) from the fp32 value
                            the fp32 call writes, what a bf16 model's layer
                            passes and wants without converting whole
                            tensors around the call. lse stays fp32. Other
                            values: KVARN_ERR_INVALID_ARG. Read by
                            kvarn_attn_decode, kvarn_attn_multi and their
                            _lse forms. */
} kvarn_attn_opts;

#define KVARN_ATTN_OPTS_DEFAULT(scale) { (scale), 0, 1, NULL, NULL, 0 }

/* Bytes of workspace a call needs, an upper bound for any call with at most
 * max_seqs sequences and max_total_q query tokens in all (decode:
 * max_total_q = max_seqs) on a pool of n_threads workers (1 for no pool),
 * with these options (NULL: defaults). 0 on bad arguments (unsupported
 * format or head_dim, n_q_heads not a positive multiple of n_kv_heads,
 * negative counts) and when the workspace or the query array
 * (max_total_q * n_q_heads * head_dim floats) would not fit size_t: sizes
 * are formed in 64 bits with checked products, never wrapped; the calls
 * below then return KVARN_ERR_TOO_LARGE. Allocate once for the largest
 * batch, reuse. opts->sinks is not read (sinks need no workspace). */
size_t kvarn_attn_workspace_bytes(const kvarn_paged_kv *kv, int n_q_heads,
                                  int max_seqs, int max_total_q,
                                  int n_threads, const kvarn_attn_opts *opts);

/* Decode attention: one query token per sequence, at position seq_len - 1.
 *   kv         the layer's paged K/V (see the top of this header).
 *   seqs       [n_seqs] sequence views; seq_len 0 gives a zero output.
 *   n_q_heads  Hq, a positive multiple of kv->n_kv_heads.
 *   q          fp32 [n_seqs][Hq][D] queries (post-RoPE), original basis.
 *   out        fp32 [n_seqs][Hq][D] attention outputs, original basis.
 *   opts       NULL: softmax_scale 1/sqrt(D), no window, no sinks, auto split.
 *   pool       NULL: single-threaded.
 *   workspace  at least kvarn_attn_workspace_bytes(kv, Hq, n_seqs, n_seqs,
 *              pool size, opts) bytes, any alignment.
 * Errors (out untouched): KVARN_ERR_INVALID_ARG (NULL, n_seqs < 0, Hq not a
 * multiple of Hk, bad view geometry, seq_len < 0, committed_tiles out of
 * range, a block table entry outside the arena, bad opts),
 * KVARN_ERR_UNSUPPORTED_HEAD_DIM, KVARN_ERR_NONFINITE (NaN/Inf in q, a NaN
 * or +Inf sink logit in opts->sinks),
 * KVARN_ERR_BUFFER_TOO_SMALL (workspace), KVARN_ERR_TOO_LARGE (a workspace
 * beyond size_t, see kvarn_attn_workspace_bytes). */
kvarn_status kvarn_attn_decode(const kvarn_paged_kv *kv,
                               const kvarn_seq_view *seqs, int n_seqs,
                               int n_q_heads, const float *q, float *out,
                               const kvarn_attn_opts *opts,
                               kvarn_thread_pool *pool,
                               void *workspace, size_t workspace_size);

/* Multi-query attention (chunked prefill, speculative verification): the
 * queries of sequence s are its LAST q_len = query_start_loc[s+1] -
 * query_start_loc[s] positions (query i at position seq_len - q_len + i;
 * q_len <= seq_len), already written to the cache.
 *   query_start_loc  int32 [n_seqs + 1], query_start_loc[0] = 0,
 *              non-decreasing; total_q = query_start_loc[n_seqs].
 *   q, out     fp32 [total_q][Hq][D], original basis.
 * Causal by default, each query with its own limit; opts->causal = 0 lets
 * every query see the whole sequence, and then the queries may also come
 * after the sequence's keys (any q_len, also q_len > seq_len: the history
 * half of a chunk whose own K/V are attended elsewhere, merged by
 * log-sum-exp, see kvarn_attn_multi_lse); a sequence with seq_len 0 gets
 * zero outputs. Everything else as for decode, with the workspace sized
 * for (n_seqs, total_q). */
kvarn_status kvarn_attn_multi(const kvarn_paged_kv *kv,
                              const kvarn_seq_view *seqs, int n_seqs,
                              const int32_t *query_start_loc,
                              int n_q_heads, const float *q, float *out,
                              const kvarn_attn_opts *opts,
                              kvarn_thread_pool *pool,
                              void *workspace, size_t workspace_size);

/* The same two calls, also writing the log-sum-exp of every output row:
 *   lse  NULL (then exactly kvarn_attn_decode / kvarn_attn_multi), or fp32
 *        [total_q][Hq] (decode: total_q = n_seqs): for query token i and
 *        query head h, lse[i][h] = ln sum_t exp(softmax_scale * q.k_t) over
 *        the positions t the query sees (natural log of the softmax
 *        denominator, the scale included); -INFINITY when it sees none
 *        (seq_len 0, its output is then zero). With opts->sinks the
 *        denominator holds the sink's term too: lse = ln(exp(s_h) + sum_t
 *        ...), = s_h for a query that sees no position (output zero).
 * Two attentions of the same query over disjoint key sets (o1, lse1) and
 * (o2, lse2) merge into the attention over their union as
 *   lse = ln(e^lse1 + e^lse2),  o = e^(lse1 - lse) o1 + e^(lse2 - lse) o2.
 * For KVarN the scores are computed in the rotated basis, where they equal
 * the original ones (the rotation is orthonormal), and the outputs are
 * rotated back, so o and lse merge with attention computed anywhere else
 * in the original basis. A learned sink (opts->sinks) is one more such
 * part with output zero: it must be in exactly one of the merged calls.
 * Errors as for the calls without lse. */
kvarn_status kvarn_attn_decode_lse(const kvarn_paged_kv *kv,
                                   const kvarn_seq_view *seqs, int n_seqs,
                                   int n_q_heads, const float *q, float *out,
                                   float *lse, const kvarn_attn_opts *opts,
                                   kvarn_thread_pool *pool,
                                   void *workspace, size_t workspace_size);
kvarn_status kvarn_attn_multi_lse(const kvarn_paged_kv *kv,
                                  const kvarn_seq_view *seqs, int n_seqs,
                                  const int32_t *query_start_loc,
                                  int n_q_heads, const float *q, float *out,
                                  float *lse, const kvarn_attn_opts *opts,
                                  kvarn_thread_pool *pool,
                                  void *workspace, size_t workspace_size);

/* Name of the kernel set a call with these options would use on this CPU,
 * at the SIMD level the environment variable KVARN_SIMD (scalar|avx2|avx512)
 * caps (and opts->testing's force_scalar): "avx512", "avx2" or "scalar".
 * Never NULL. A head_dim that the level does not take (AVX-512: D % 32 !=
 * 0; AVX2: D % 16 != 0) steps down to the next level that takes it. */
const char *kvarn_attn_kernel_name(const kvarn_attn_opts *opts);

/* The arithmetic of one half of an attention kernel (scores q.k, sums
 * p.v), docs/attention-intdot.md:
 *   KVARN_ATTN_ARITH_FP32   every code converted to fp32, fp32 products:
 *                           the scalar reference's (kernel_ref.c) up to the
 *                           order of the fp32 sums.
 *   KVARN_ATTN_ARITH_INT16  the query (scores) or the softmax weights
 *                           (sums) rounded to int16 per row and tile or
 *                           span, multiplied with the integer codes in
 *                           int16 (vpmaddwd / vpdpwssd), exact int32 sums
 *                           (int4 per-token codes c as the bytes 16 c + 8,
 *                           with scale / 16: exactly the same values):
 *                           off the reference by the rounding of that
 *                           operand, bounded in docs/attention-intdot.md.
 *   KVARN_ATTN_ARITH_INT8   the same int16 query as two int8 digits times
 *                           the u8 codes (vpdpbusd): the same sums, bit for
 *                           bit, as INT16.
 *   KVARN_ATTN_ARITH_U8     (sums) the softmax weights rounded to u8 per
 *                           row and tile (255 steps of the row's largest),
 *                           times the codes (vpdpbusd), exact int32 sums:
 *                           INT16's rounding with 255 for 32767, bounded
 *                           likewise (docs/attention-intdot.md "u8
 *                           weights").
 *   KVARN_ATTN_ARITH_BF16X2 (MLA's matrix kernel's scores; the matrix
 *                           kernel's scores and sums over the int8
 *                           format's blocks) the folded query q'_d a_d
 *                           (int8: q'_d; sums: each softmax weight times
 *                           its value scale, p_t a_t) carried as two bf16
 *                           values, hi = bf16(x) and lo = bf16(x - hi)
 *                           (nearest even: relative error at most 2^-16;
 *                           values below 2^-126 read as 0), each times the
 *                           codes (exact in bf16) on AMX tiles with fp32
 *                           sums; zero-point terms, softmax and output
 *                           fp32, the softmax's 2^x (int8 blocks on the
 *                           tiles) by a degree-5 fit (relative error
 *                           below 2.2e-7; MLA and the emulated build:
 *                           expf) (src/attn/kernel_amx.c,
 *                           docs/attention-matrix.md).
 *   KVARN_ATTN_ARITH_BF16   (the matrix kernel's matrix_scores and
 *                           matrix_sums) KVarN records: the query q'_d,
 *                           each key s_tok_t (a_d c_td + b_d) and each
 *                           value s_chan_d (a_t c_td + b_t) (formed in
 *                           fp32: one FMA, then the product) and each
 *                           softmax weight p_t rounded to bf16, as vLLM's
 *                           bf16 cache holds its keys and values and its
 *                           attention rounds queries and weights; staged
 *                           per-token records and the int4 format's
 *                           blocks: q'_d and each p_t a_t (a_t the value
 *                           scale) rounded once to bf16, times the centred
 *                           codes (code - 2^(bits - 1), exact in bf16),
 *                           zero-point terms fp32. Nearest even: relative
 *                           error at most 2^-8 a rounding; below 2^-126
 *                           read as 0. On AMX tiles with fp32 sums;
 *                           softmax and output fp32, the softmax's 2^x by
 *                           a degree-3 fit (relative error below 7.5e-5,
 *                           src/attn/kernel_amx.c; the emulated build:
 *                           expf).
 * An integer half may still keep fp32 for a call whose run-time conditions
 * it does not meet (KVarN: a tile where any query row's max |q_d a_d| is
 * below 2^-100, or any reaches 2^80, and for the matrix kernel a row's
 * |q'_d| reaching 2^80 or a key bound of 2^36; int8 and int4: a span over 256 tokens, so
 * every span where the cache's block_size exceeds 256), and U8 keeps INT16
 * for a tile with a negative or NaN value scale a_t (which no encoder
 * writes); FP32 means it never rounds. */
typedef enum kvarn_attn_arith {
    KVARN_ATTN_ARITH_FP32 = 0,
    KVARN_ATTN_ARITH_INT16 = 1,
    KVARN_ATTN_ARITH_INT8 = 2,
    KVARN_ATTN_ARITH_U8 = 3,
    KVARN_ATTN_ARITH_BF16X2 = 4,
    KVARN_ATTN_ARITH_BF16 = 5
} kvarn_attn_arith;

/* Which kernels attention runs for a format on this CPU, and their
 * arithmetic. */
typedef struct kvarn_attn_kernel_info {
    const char *level;              /* as kvarn_attn_kernel_name: "avx512",
                                       "avx2" or "scalar", stepped down for
                                       a head_dim the level does not take */
    kvarn_attn_arith scores;        /* q.k over the format's records */
    kvarn_attn_arith sums;          /* p.v over them */
    kvarn_attn_arith staged_scores; /* KVarN: q.k over the staged tokens
                                       (sink, tail) in the staging's
                                       per-token format (fp16 staging:
                                       FP32); per-token formats: = scores */
    kvarn_attn_arith staged_sums;   /* the same for p.v */
    const char *matrix;             /* KVarN records, and the int4,
                                       int8, fp8 and bf16 formats'
                                       per-token blocks, of work
                                       items with at least matrix_rows
                                       query rows (prefill chunks,
                                       verification: query tokens x the GQA
                                       group, up to 512 a work item) go
                                       through the matrix kernel:
                                       "amx-bf16" (AMX tiles, where
                                       kvarn's level is AVX-512, the CPU
                                       has AMX-BF16 and AVX512-BF16, Linux
                                       grants the tile
                                       state and KVARN_AMX is not "0"),
                                       "amx-bf16-emulated" (the testing
                                       knob amx = 2, or the environment's
                                       KVARN_AMX=emulate), or NULL: none.
                                       Without the tiles, the fp8
                                       (E4M3, E5M2) and bf16 formats'
                                       per-token blocks of such items at
                                       the AVX-512 level on a CPU with
                                       AVX512-BF16, head_dim a multiple
                                       of 32 up to 512:
                                       "avx512-bf16" (vdpbf16ps against a
                                       bf16 query and bf16 weights
                                       p_t vs_t, the codes exact;
                                       src/attn/kernel_avx512_bf16.c) */
    int matrix_rows;                /* that row count (16); 0 with NULL */
    kvarn_attn_arith matrix_scores; /* its q.k: KVARN_ATTN_ARITH_BF16
                                       (the int8 format: _BF16X2) (a
                                       tile outside its conditions runs the
                                       level's kernel: scores, sums) */
    kvarn_attn_arith matrix_sums;   /* its p.v: as matrix_scores */
    int matrix_staged;              /* > 0: the staged tokens (int8 or
                                       int4 staging) of those items that
                                       hold at least this many query tokens
                                       (32: prefill chunks, not
                                       verification's 1 + K) go through it
                                       too, with the same rounding of q'
                                       and the weights (the codes exact,
                                       centred); 0, and in the other
                                       items: the staging's token kernel
                                       (staged_scores, staged_sums) */
} kvarn_attn_kernel_info;

/* Fill *out with the kernels and arithmetic a call with these options
 * (NULL: defaults) would use for format fmt at head_dim (channels) with
 * staging (a kvarn_staging value, paged.h; read for KVarN formats only) on
 * this CPU, at the SIMD level KVARN_SIMD caps (as kvarn_attn_kernel_name).
 * Source: src/attn/kernel_table.c, whose rows the kernels are picked from;
 * the integer paths' conditions are stated once in
 * src/attn/attn_internal.h and tested by the kernels themselves.
 * Sinks (opts->sinks, not read here) change no kernel: they enter in the
 * final normalization, after the kernels (docs/attention.md).
 * Errors (*out untouched): KVARN_ERR_INVALID_ARG (NULL fmt or out, staging
 * outside kvarn_staging, options a call would refuse, sinks aside),
 * KVARN_ERR_UNSUPPORTED_HEAD_DIM (head_dim the format does not take, as
 * kvarn_record_layout_get). */
kvarn_status kvarn_attn_kernel_info_get(const kvarn_format *fmt, int head_dim, int staging,
                                        const kvarn_attn_opts *opts,
                                        kvarn_attn_kernel_info *out);

#ifdef __cplusplus
}
#endif

#endif /* KVARN_ATTN_H */

/* ======================================================================== */
/* EXPERIMENTAL / TESTING API                                               */
/* ======================================================================== */
/* Seen only by code that defines KVARN_EXPERIMENTAL_API before including
 * this header (the tests and the benchmarks do). Knobs for tests and
 * measurements, not for production: no stable meaning, may change or
 * vanish in any release. The stable part above never depends on them: a
 * kvarn_attn_opts with testing = NULL is all a user needs. */
#if defined(KVARN_EXPERIMENTAL_API) && !defined(KVARN_ATTN_H_EXPERIMENTAL)
#define KVARN_ATTN_H_EXPERIMENTAL

#ifdef __cplusplus
extern "C" {
#endif

/* What kvarn_attn_opts.testing points at. All zero = the defaults. */
typedef struct kvarn_attn_testing {
    int split_k;      /* 0: automatic (as with testing = NULL); 1: never
                         split; s in [2, 1024]: split every work item's
                         context into up to s chunks (so that short test
                         contexts go through the log-sum-exp merge) */
    int force_scalar; /* 1: the scalar reference kernels even when the CPU
                         has AVX2 or AVX-512 (KVARN_SIMD=avx2 or =scalar
                         caps the level for a whole process); 0: the best */
    int no_vnni;      /* 1: the AVX-512 KVarN kernel without AVX512-VNNI
                         (vpmaddwd + vpaddd) even when the CPU has it (the
                         results are the same bits; tests run both) */
    int amx;          /* the matrix kernel of KVarN records (attn.h
                         kvarn_attn_kernel_info.matrix): 0 where the CPU
                         grants AMX (the default), 1 never, 2 its logic
                         with the tiles emulated in C on any CPU (slow;
                         for tests) */
    int no_bf16;      /* 1: the fp8 (E4M3, E5M2) and bf16 formats' spans
                         in fp32 even where the CPU has AVX512-BF16
                         (kvarn_attn_kernel_info.matrix "avx512-bf16");
                         0: the default */
} kvarn_attn_testing;

#ifdef __cplusplus
}
#endif

#endif /* KVARN_EXPERIMENTAL_API */
