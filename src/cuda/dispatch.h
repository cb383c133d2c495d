/*
 * dispatch.h -- the one table of what the CUDA backend is specialized on.
 *
 * Kernels are templates over head_dim D, tile size G and bits; every
 * instantiation, and the host lookup that says whether a format is served
 * (kvarn_cuda_supports), is generated from the X-macro lists below. Serving
 * another preset is one line here.
 *
 * Plain C preprocessor only, so that host C/C++ and CUDA files can share it.
 */
#ifndef KVARN_CUDA_DISPATCH_H
#define KVARN_CUDA_DISPATCH_H

/* head_dim values every kernel is compiled for. */
#define KVARN_CUDA_HEAD_DIMS(X) X(64) X(128) X(256) X(512)

/* KVarN presets: X(D, G, key_bits, value_bits) for one D. The four upstream
 * presets (../shared/spec/KVARN.md "Presets"). */
#define KVARN_CUDA_KVARN_PRESETS(X, D) \
    X(D, 128, 4, 2) X(D, 64, 4, 2) X(D, 128, 4, 4) X(D, 64, 4, 4)

/* Per-token formats served: X(D, KIND). Each kind listed needs its device
 * traits, kc_kind<KIND> in src/cuda/kinds.cuh. */
#define KVARN_CUDA_TOKEN_KINDS(X, D)                                   \
    X(D, KVARN_KIND_FP16) X(D, KVARN_KIND_BF16) X(D, KVARN_KIND_FP8_E4M3) \
    X(D, KVARN_KIND_FP8_E5M2) X(D, KVARN_KIND_INT8) X(D, KVARN_KIND_INT4)

/* Largest block size (tokens) a per-token format's block may have here:
 * the attention kernel keeps one score per token of a block in shared
 * memory. */
#define KVARN_CUDA_MAX_BLOCK 128

/* Query rows (query heads of one GQA group, times queries of one sequence)
 * one attention thread block serves with a single pass over each tile. */
#define KVARN_CUDA_ROWS 8

/* Threads of one attention thread block. */
#define KVARN_CUDA_ATTN_THREADS 128

/* The tensor-core kernel (src/cuda/attn_mma.cu): the head_dim values it is
 * compiled for (KVarN presets only), the query rows one thread block serves
 * (16 per warp), and from how many queries of a sequence (the plan's
 * max_query_len: prefill chunks) a multi-query call takes it. */
#define KVARN_CUDA_MMA_HEAD_DIMS(X) X(64) X(128)
#define KVARN_CUDA_MMA_ROWS 64
#define KVARN_CUDA_MMA_MIN_QUERIES 32

/* Most split-K partitions a plan uses. */
#define KVARN_CUDA_MAX_SPLITS 64

#endif
