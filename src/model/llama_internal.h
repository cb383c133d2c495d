/*
 * llama_internal.h -- what the files of the llama runner share: the weight
 * layout, the session, and the small interface behind which the K/V store
 * sits (the paged cache in every format, or an exact fp32 store for
 * cross-checks). Not part of the public contract (include/kvarn/model.h).
 */
#ifndef KVARN_LLAMA_INTERNAL_H
#define KVARN_LLAMA_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "kvarn/attn.h"
#include "kvarn/cache.h"
#include "kvarn/kvarn.h"
#include "kvarn/model.h"
#include "common/alloc_internal.h"

/* One weight matrix, row-major [out][in] (a GGUF matrix of ne = {in, out}
 * as stored), so a chunk's activations X [n][in] give Y = X W^T. Held in
 * fp32 (f32 set), in bf16 (each weight rounded to nearest even at load,
 * multiplied through oneDNN's bf16 matmul, llama_weights.c) or in int8
 * (codes per row with a scale per row, oneDNN's s8 matmul). A bf16 / int8
 * matrix is filled in its plain layout ([out][in]); llama_matrix_prepare
 * reorders it once into the blocked layout oneDNN's matmul reads fastest
 * (blk) and frees the plain copy unless row lookups need it (the token
 * embedding). prim1 multiplies one row (decode), primb LLAMA_MM_BLOCK rows
 * (chunks); both read blk. */
#define LLAMA_MM_BLOCK 16
typedef struct llama_matrix {
    int out, in;
    float *f32;         /* [out][in], or NULL */
    uint16_t *bf16;     /* [out][in] plain, or NULL (freed after prepare) */
    int8_t *s8;         /* int8: codes [out][in] plain, or NULL (likewise) */
    float *wscale;      /* int8: [out] row scales (w ~ s8 * wscale); kept */
    void *blk;          /* bf16 weights in oneDNN's layout, blk_bytes */
    size_t blk_bytes;
    void *prim1;        /* dnnl_primitive_t, M = 1; NULL for fp32 */
    void *primb;        /* dnnl_primitive_t, M = LLAMA_MM_BLOCK */
    void *wmem;         /* dnnl_memory_t over blk */
    size_t scratch_bytes; /* the larger scratchpad of the two */
    uint8_t *q;         /* gguf: the file's own blocks [out][row_bytes]
                           (llama_qgemv.h), or NULL */
    size_t row_bytes;   /* gguf: bytes of one row of blocks */
    kvarn_ggml_type qtype; /* gguf: Q4_0, Q4_1 or Q8_0 */
} llama_matrix;

/* One transformer block. Q, K and V are stacked into one matrix and gate
 * and up into another, so each is a single GEMM per chunk. */
typedef struct llama_layer {
    float *attn_norm;       /* [hidden] */
    llama_matrix wqkv;      /* [(H + 2 Hk) D][hidden]: Q rows, then K, then V */
    llama_matrix wo;        /* [hidden][H D] */
    float *ffn_norm;        /* [hidden] */
    llama_matrix w_gate_up; /* [2 ffn][hidden]: gate rows, then up rows */
    llama_matrix w_down;    /* [hidden][ffn] */
} llama_layer;

struct kvarn_llama {
    kvarn_allocator alloc; /* the model and its weights (alloc.h) */
    kvarn_llama_hparams hp;
    kvarn_llama_weights weights; /* FP32, BF16, INT8 or GGUF (resolved) */
    llama_matrix tok_embd;  /* [vocab][hidden]; rows looked up by token */
    float *output_norm;     /* [hidden] */
    llama_matrix output;    /* [vocab][hidden]; a copy of tok_embd's
                               pointers when tied (owns = 0) */
    int output_owned;
    llama_layer *layers;    /* [n_layers] */
    void *engine;           /* dnnl_engine_t when weights == BF16 */
    size_t scratch_bytes;   /* largest scratchpad of any matrix */
    int max_out;            /* most rows (out) of any prepared bf16 matrix */
};

/* ------------------------------------------------------------------------ */
/* Weight matrices (llama_weights.c)                                        */
/* ------------------------------------------------------------------------ */

/* Allocate m for [out][in] in the model's precision (m->f32 or m->bf16,
 * through the model's allocator; the contents are filled by
 * llama_matrix_set_rows). Errors: KVARN_ERR_NOMEM. */
kvarn_status llama_matrix_alloc(kvarn_llama *model, llama_matrix *m, int out, int in);
/* Allocate m for [out][in] kept as the GGUF's own blocks of type (gguf
 * weights: Q4_0, Q4_1, Q8_0; in a multiple of 32), filled by
 * llama_matrix_set_q_rows. Errors: KVARN_ERR_UNSUPPORTED (another type),
 * KVARN_ERR_BAD_FILE (in not a whole number of blocks), KVARN_ERR_NOMEM. */
kvarn_status llama_matrix_alloc_q(kvarn_llama *model, llama_matrix *m, int out, int in,
                                  kvarn_ggml_type type);
/* Rows [r0, r0 + rows) of a gguf matrix from a tensor's blocks: src holds
 * bytes bytes of type. Errors (m unchanged): KVARN_ERR_BAD_FILE (another
 * type, or bytes != rows * row_bytes: a truncated or odd tensor),
 * KVARN_ERR_INVALID_ARG (rows outside the matrix). */
kvarn_status llama_matrix_set_q_rows(llama_matrix *m, int r0, int rows, kvarn_ggml_type type,
                                     const void *src, uint64_t bytes);
/* Rows [r0, r0 + rows) of m from fp32 src [rows][in] (rounded to bf16 when
 * m is bf16). */
void llama_matrix_set_rows(llama_matrix *m, int r0, int rows, const float *src);
/* Row r of m in fp32 (widened when bf16, dequantized as src/gguf/dequant.c
 * does when gguf) into dst [in]. A bf16 matrix must hold its plain copy
 * (before prepare, or prepared with keep_rows). */
void llama_matrix_get_row(const llama_matrix *m, int r, float *dst);
/* Make m ready to multiply. bf16: reorder the plain weights into blk (the
 * model's allocator, blk_bytes as oneDNN lays them out), make the M = 1 and
 * M = LLAMA_MM_BLOCK matmul primitives over it, and free the plain copy
 * unless keep_rows (then llama_matrix_get_row still works; the matrix holds
 * both). fp32: nothing. Errors: KVARN_ERR_NOMEM, KVARN_ERR_UNSUPPORTED
 * (oneDNN cannot make it here); m is then as before the call. */
kvarn_status llama_matrix_prepare(kvarn_llama *model, llama_matrix *m, int keep_rows);
void llama_matrix_free(kvarn_llama *model, llama_matrix *m);

/* The model's oneDNN engine for bf16 weights. Errors: KVARN_ERR_UNSUPPORTED
 * (built without oneDNN, or no CPU engine), KVARN_ERR_NOMEM. */
kvarn_status llama_weights_engine_create(kvarn_llama *model);
void llama_weights_engine_destroy(kvarn_llama *model);

/* Per-session state of the matmuls: a oneDNN stream, the activations as
 * the weights take them (bf16, or int8 codes and a scale per row) for
 * `rows` rows (max_chunk, raised to LLAMA_MM_BLOCK when 1 < max_chunk <
 * LLAMA_MM_BLOCK: a chunk shorter than a block is padded to one), the
 * output of such a padded block ([LLAMA_MM_BLOCK][model->max_out] floats;
 * only when max_chunk > 1) and the scratchpad. */
typedef struct llama_mm_ctx {
    float *slab;        /* gguf, max_chunk > 1: [LLAMA_MM_SLAB][max_in] fp32
                           rows dequantized for a chunk's sgemm */
    kvarn_thread_pool *pool; /* gguf, threads > 1: splits a GEMV's rows */
    void *stream;       /* dnnl_stream_t; NULL for fp32 weights */
    uint16_t *xb;       /* bf16: [rows][max_in] */
    int8_t *xq;         /* int8: [rows][max_in] codes */
    float *xs;          /* int8: [rows] scales */
    float *ypad;        /* [LLAMA_MM_BLOCK][max_out], or NULL */
    void *scratch;      /* model->scratch_bytes */
} llama_mm_ctx;

/* Rows of a gguf matrix dequantized at a time for a chunk (n > 1): the
 * slab, LLAMA_MM_SLAB x max_in floats (SmolLM2: 384 KiB at in = 1536),
 * stays in L2 while OpenBLAS multiplies it by the chunk. */
#define LLAMA_MM_SLAB 64

/* Bytes llama_mm_ctx_create(model, a, max_chunk, max_in, threads, c)
 * allocates (0 for fp32 weights): the buffers for chunks of max_chunk rows
 * of at most max_in floats and, for gguf weights with threads > 1, the GEMV
 * thread pool (kvarn__thread_pool_bytes); checked: KVARN_ERR_TOO_LARGE. */
kvarn_status llama_mm_ctx_plan(const kvarn_llama *model, int max_chunk, int max_in,
                               int threads, uint64_t *bytes);
/* threads: workers that split a gguf GEMV's rows (the session's
 * attn_threads; <= 1: the calling thread alone; other precisions ignore
 * it). Errors: KVARN_ERR_NOMEM, KVARN_ERR_UNSUPPORTED (bf16/int8 without
 * oneDNN), KVARN_ERR_TOO_LARGE. */
kvarn_status llama_mm_ctx_create(const kvarn_llama *model, const kvarn_allocator *a,
                                 int max_chunk, int max_in, int threads, llama_mm_ctx *c);
void llama_mm_ctx_destroy(const kvarn_allocator *a, llama_mm_ctx *c);

/* Y[n][out] = X[n][in] W^T (fp32: OpenBLAS, GEMV for n == 1; gguf: n == 1
 * the GEMV of llama_qgemv.h at the CPU's SIMD level, rows split over the
 * ctx's pool; n > 1 LLAMA_MM_SLAB rows at a time dequantized into the slab
 * and multiplied by OpenBLAS sgemm; bf16: X
 * rounded to bf16, oneDNN matmul, fp32 sums and Y; int8: X quantized per
 * row, int32 sums, scaled by the row's and the channel's scales; bf16 and
 * int8 alike: one row through prim1;
 * n >= LLAMA_MM_BLOCK rows in blocks of LLAMA_MM_BLOCK through primb, the
 * last block ending at row n (it may recompute rows of the one before);
 * 1 < n < LLAMA_MM_BLOCK rows as one block padded with the ctx's rows past
 * n, whose outputs land in ypad and are dropped). Errors (bf16/int8 only):
 * KVARN_ERR_NOMEM (oneDNN's per-call descriptors), KVARN_ERR_UNSUPPORTED. */
kvarn_status llama_matmul(llama_mm_ctx *c, const float *x, int n, const llama_matrix *w,
                          float *y);

/* ------------------------------------------------------------------------ */
/* K/V store interface                                                      */
/* ------------------------------------------------------------------------ */

/* A forward chunk of n tokens at positions [pos, pos + n) drives the store
 * as: begin(pos, n); then for each layer attend(layer, ...); then
 * end(pos, n). attend stores the chunk's K (post-RoPE) and V for that layer
 * and returns the attention output of the chunk's n queries: each query at
 * position pos + i sees the exact fp32 K/V of chunk tokens 0..i and the
 * store's history for positions < pos. */
typedef struct llama_kv llama_kv;

typedef struct llama_kv_ops {
    /* Make room for tokens [pos, pos + n) in every layer. */
    kvarn_status (*begin)(llama_kv *kv, int pos, int n);
    /* q [n][H D], k and v [n][Hk D] (row strides ldq, ldkv floats); out
     * [n][H D] contiguous. */
    kvarn_status (*attend)(llama_kv *kv, int layer, int pos, int n,
                           const float *q, int ldq, const float *k,
                           const float *v, int ldkv, float *out);
    /* The chunk is final: commit (quantize) what is due. */
    kvarn_status (*end)(llama_kv *kv, int pos, int n);
    /* A call failed between begin and end: drop tokens from pos on, so the
     * store is as it was before begin(pos, n). */
    void (*abort)(llama_kv *kv, int pos);
    /* Forget every token. */
    void (*reset)(llama_kv *kv);
    void (*destroy)(llama_kv *kv);
    const char *(*format_name)(const llama_kv *kv);
    /* The paged cache and the sequence id in it; NULL (and *seq = -1) for
     * a store without one. */
    kvarn_cache *(*cache)(const llama_kv *kv, int *seq);
    /* Replace the (empty) sequence by the one saved in buf (state.h), of
     * at most max_tokens tokens; its length goes to *n_tokens. On error the
     * store holds an empty sequence again. NULL: the store cannot. */
    kvarn_status (*restore)(llama_kv *kv, const void *buf, size_t len, int max_tokens,
                            int *n_tokens);
} llama_kv_ops;

struct llama_kv {
    const llama_kv_ops *ops;
};

/* Shapes a store is created for. */
typedef struct llama_kv_shape {
    int n_layers, n_heads, n_kv_heads, head_dim;
    int max_tokens; /* context capacity */
    int max_chunk;  /* most tokens per begin/attend/end */
    const kvarn_allocator *alloc; /* the session's: the store's memory */
} llama_kv_shape;

/* The exact fp32 store (llama_kv_exact.c). */
kvarn_status llama_kv_exact_create(const llama_kv_shape *shape, llama_kv **out);

/* The paged cache in any format (llama_kv_paged.c). */
kvarn_status llama_kv_paged_create(const llama_kv_shape *shape,
                                   const kvarn_format *fmt,
                                   const kvarn_llama_session_opts *opts,
                                   llama_kv **out);

/* What the _create above would allocate, without allocating: *kv_bytes
 * for the K/V themselves (the cache arena: blocks + fp16 pages; or the
 * fp32 K and V), *other_bytes for the store's scratch and bookkeeping.
 * Every size is checked in 64 bits (common/checked.h). The _create calls
 * run the same checks first, so they fail before allocating.
 * Errors: KVARN_ERR_TOO_LARGE (max_tokens above KVARN_CACHE_MAX_SEQ_LEN,
 * or a size beyond 64 bits / size_t); the cache's option errors. */
kvarn_status llama_kv_exact_plan(const llama_kv_shape *shape, uint64_t *kv_bytes,
                                 uint64_t *other_bytes);
kvarn_status llama_kv_paged_plan(const llama_kv_shape *shape, const kvarn_format *fmt,
                                 const kvarn_llama_session_opts *opts, uint64_t *kv_bytes,
                                 uint64_t *other_bytes);

/* ------------------------------------------------------------------------ */
/* fp32 attention (llama_attn_f32.c)                                        */
/* ------------------------------------------------------------------------ */

/* Causal GQA attention in fp32, softmax scale 1/sqrt(D).
 *   q     [nq] rows of H*D (row stride ldq floats); query i sits at absolute
 *         position q_pos0 + i.
 *   k, v  for KV head h, key j (absolute position j, 0 <= j < nk) at
 *         k + h * head_stride + j * ld (the same for v).
 *   out   [nq][H*D] contiguous (normalized output).
 *   lse   NULL, or [nq][H]: log of the softmax denominator (scaled scores,
 *         natural log), for merging with another key set.
 *   scratch  llama_attn_f32_scratch_floats(nk) floats.
 * Query i sees keys j <= q_pos0 + i (and j < nk). */
size_t llama_attn_f32_scratch_floats(int nk);
void llama_attn_f32(int n_heads, int n_kv_heads, int head_dim,
                    const float *q, int ldq, int nq, int q_pos0,
                    const float *k, const float *v, int ld, size_t head_stride,
                    int nk, float *out, float *lse, float *scratch);

/* Merge a second partial attention (out2, lse2) into (out, lse), both
 * [nq][H*D] / [nq][H]: out = (e^lse out + e^lse2 out2) / (e^lse + e^lse2).
 * lse entries of -INFINITY mean "no keys". */
void llama_attn_merge(int n_heads, int head_dim, int nq, float *out,
                      float *lse, const float *out2, const float *lse2);

/* ------------------------------------------------------------------------ */
/* Element-wise ops (llama_ops.c)                                           */
/* ------------------------------------------------------------------------ */

/* y[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w, for n rows of dim floats. */
void llama_rmsnorm(const float *x, const float *w, float eps, int n, int dim,
                   float *y);

/* RoPE angles for tokens at positions [pos, pos + n): cos and sin
 * [n][D/2], pair i turned by (pos + t) * theta^(-2i/D), computed in double. */
void llama_rope_table(int pos, int n, int head_dim, float theta, float *cos_t,
                      float *sin_t);

/* Rotate the adjacent pairs (2i, 2i + 1) of every head (n_heads heads of D
 * channels at x + t * ld) of n tokens, "normal" RoPE as GGUF stores llama. */
void llama_rope_apply(float *x, int ld, int n, int n_heads, int head_dim,
                      const float *cos_t, const float *sin_t);

/* act[t][j] = silu(gu[t][j]) * gu[t][ffn + j] for n tokens. */
void llama_swiglu(const float *gu, int n, int ffn, float *act);

/* ------------------------------------------------------------------------ */
/* Session                                                                  */
/* ------------------------------------------------------------------------ */

struct kvarn_llama_session {
    kvarn_allocator alloc; /* the session, its scratch and its store */
    const kvarn_llama *model;
    llama_kv *kv;
    int pos;          /* tokens in the sequence */
    int max_tokens;
    int max_chunk;
    /* Scratch, [max_chunk] rows each, allocated once. */
    float *x;         /* residual stream [n][hidden] */
    float *xn;        /* normalized [n][hidden] */
    float *qkv;       /* [n][(H + 2 Hk) D] */
    float *attn;      /* attention output [n][H D] */
    float *gu;        /* [n][2 ffn] */
    float *act;       /* [n][ffn] */
    float *rope_cos;  /* [n][D/2] */
    float *rope_sin;  /* [n][D/2] */
    llama_mm_ctx mm;  /* the weight matmuls' stream and scratch */
    /* keep_kv_f32: fp32 K (post-RoPE) and V of every token as computed,
     * [n_layers][max_tokens][Hk D] each; NULL when not kept. */
    float *keep_k, *keep_v;
};

#endif
