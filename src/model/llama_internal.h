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

#include "kvarn/kvarn.h"
#include "kvarn/model.h"
#include "codec/alloc_internal.h"

/* One transformer block. Every matrix is fp32, row-major [out][in] (a GGUF
 * matrix of ne = {in, out} dequantized as stored), so a chunk's activations
 * X [n][in] give Y = X W^T. Q, K and V are stacked into one matrix and gate
 * and up into another, so each is a single GEMM per chunk. */
typedef struct llama_layer {
    float *attn_norm;   /* [hidden] */
    float *wqkv;        /* [(H + 2 Hk) D][hidden]: Q rows, then K, then V */
    float *wo;          /* [hidden][H D] */
    float *ffn_norm;    /* [hidden] */
    float *w_gate_up;   /* [2 ffn][hidden]: gate rows, then up rows */
    float *w_down;      /* [hidden][ffn] */
} llama_layer;

struct kvarn_llama {
    kvarn_allocator alloc; /* the model and its weights (alloc.h) */
    kvarn_llama_hparams hp;
    float *tok_embd;    /* [vocab][hidden] */
    float *output_norm; /* [hidden] */
    float *output;      /* [vocab][hidden]; == tok_embd when tied */
    llama_layer *layers; /* [n_layers] */
};

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
 * Every size is checked in 64 bits (codec/checked.h). The _create calls
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

/* Y[n][out] = X[n][in] W^T with W [out][in] (OpenBLAS; GEMV for n == 1). */
void llama_matmul(const float *x, int n, int in, const float *w, int out,
                  float *y);

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
    /* keep_kv_f32: fp32 K (post-RoPE) and V of every token as computed,
     * [n_layers][max_tokens][Hk D] each; NULL when not kept. */
    float *keep_k, *keep_v;
};

#endif
