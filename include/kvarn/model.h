/*
 * model.h -- run a llama-architecture GGUF on the CPU with its KV cache in
 * any kvarn format.
 *
 * Two objects, both owned by the caller:
 *   kvarn_llama          the weights (fp32, bf16, int8 or the GGUF's own
 *                        blocks in memory, chosen at load) and the
 *                        hyper-parameters. Read-only after load; several
 *                        sessions may share one model (one thread each).
 *   kvarn_llama_session  one sequence: its paged KV cache (cache.h) in the
 *                        chosen format (or one sequence of a cache the
 *                        caller shares among sessions), its position, and
 *                        every scratch buffer, all allocated once at
 *                        creation. The forward pass allocates nothing.
 *
 * A forward call takes a chunk of n tokens at positions [pos, pos + n),
 * where pos is the session's current length, and appends them: their K
 * (post-RoPE) and V go into the cache, and the chunk's queries attend to
 * the chunk's own K/V exactly as computed (fp32, causal) and to the history
 * [0, pos) as the cache holds it, read in place by the paged kernels
 * (attn.h: quantized blocks, fp16 sink/tail pages), the two merged by
 * log-sum-exp (../shared/spec/KVARN.md "The fp16 tail and the sink": the
 * chunk attends to the exact K/V it just computed, later chunks and decode
 * read the quantized history). The same holds for every format and for
 * decode (n = 1). So the chunk size decides which part of the context is
 * seen unquantized: feed one tile (128 tokens) at a time to measure a
 * format as chunked prefill and decode see it (../shared/EVAL.md "How the
 * cache must be exercised"). Every token of a call is final: the cache
 * commits (quantizes) each tile as it fills. Two cross-check paths exist
 * (session options): exact_chunk (the same, with the history decoded by
 * kvarn_cache_read and attended in fp32) and exact (fp32 K/V, no cache).
 *
 * Architecture, RoPE convention and the cache usage: docs/model.md.
 */
#ifndef KVARN_MODEL_H
#define KVARN_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "kvarn/alloc.h"
#include "kvarn/cache.h"
#include "kvarn/gguf.h"
#include "kvarn/kvarn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Hyper-parameters, read from the GGUF metadata (llama.*). */
typedef struct kvarn_llama_hparams {
    int n_layers;        /* llama.block_count */
    int hidden;          /* llama.embedding_length */
    int n_heads;         /* llama.attention.head_count (query heads, H) */
    int n_kv_heads;      /* llama.attention.head_count_kv (Hk; H % Hk == 0) */
    int head_dim;        /* D: llama.attention.key_length, else hidden / n_heads */
    int ffn;             /* llama.feed_forward_length (SwiGLU width) */
    int vocab;           /* rows of token_embd.weight */
    int context_length;  /* llama.context_length (tokens) */
    float rope_theta;    /* llama.rope.freq_base (default 10000) */
    float rms_eps;       /* llama.attention.layer_norm_rms_epsilon (default 1e-5) */
    int tied_output;     /* 1: no output.weight, logits use token_embd.weight */
} kvarn_llama_hparams;

typedef struct kvarn_llama kvarn_llama;
typedef struct kvarn_llama_session kvarn_llama_session;

/* Read and check the hyper-parameters of a llama GGUF (g open, gguf.h)
 * into *out, as kvarn_llama_load does before it allocates anything: the
 * llama.* keys above (required: block_count, embedding_length,
 * attention.head_count, feed_forward_length; any integer type), the
 * defaults of the optional ones, and vocab and tied_output from the
 * tensors token_embd.weight ([embedding_length, vocab]) and output.weight.
 * On error err (errlen bytes, NUL-terminated, cut to fit; NULL or 0 for
 * none) names the key or tensor and its bad value, e.g.
 * "GGUF key llama.attention.head_count_kv = 0: must be >= 1 and divide
 * head_count 9"; *out is untouched. Errors: KVARN_ERR_INVALID_ARG (NULL g or
 * out), KVARN_ERR_BAD_FILE (general.architecture not "llama", a required
 * key missing, a key of the wrong type or out of range, head counts or
 * head_dim inconsistent, token_embd.weight missing or misshapen),
 * KVARN_ERR_UNSUPPORTED (llama.rope.dimension_count other than head_dim:
 * partial RoPE), KVARN_ERR_TOO_LARGE (more layers or KV heads than a cache
 * holds: KVARN_CACHE_MAX_LAYERS, _KV_HEADS). Source: the llama.* metadata of ggml's docs/gguf.md. */
kvarn_status kvarn_llama_read_hparams(const kvarn_gguf *g, kvarn_llama_hparams *out, char *err,
                                      size_t errlen);

/* Check that every tensor kvarn_llama_load reads is in g with its shape,
 * as kvarn_llama_load does before it allocates anything: token_embd.weight
 * [embedding_length, vocab], output_norm.weight [embedding_length],
 * output.weight [embedding_length, vocab] unless hp->tied_output, and for
 * each layer N < block_count blk.N.attn_norm / ffn_norm [E], attn_q [E,
 * H D], attn_k / attn_v [E, Hk D], attn_output [H D, E], ffn_gate / ffn_up
 * [E, F], ffn_down [F, E] (GGUF ne order, innermost first; E =
 * embedding_length, H / Hk = head_count / head_count_kv, D = head_dim, F
 * = feed_forward_length; trailing dimensions of 1 are accepted). hp is
 * what kvarn_llama_read_hparams gave for g. Tensor types need no check
 * here: kvarn_gguf_open refuses a type it does not serve (naming the
 * tensor), and every type it serves loads into any of them.
 * On error err (errlen bytes, NUL-terminated, cut to fit; NULL or 0 for
 * none) names the first bad tensor in load order and what is wrong, e.g.
 * "GGUF tensor blk.0.attn_k.weight has shape [64, 190]: expected [64, 192]
 * (embedding_length 64, head_count_kv 3 x head_dim 64)" or "GGUF tensor
 * blk.1.ffn_down.weight is missing (...)"; empty on success.
 * Errors: KVARN_ERR_INVALID_ARG (NULL g or hp), KVARN_ERR_BAD_FILE (a
 * tensor missing or of another shape). Source: the llama tensor names of
 * ggml's docs/gguf.md. */
kvarn_status kvarn_llama_check_tensors(const kvarn_gguf *g, const kvarn_llama_hparams *hp,
                                       char *err, size_t errlen);

/* Load a llama-architecture GGUF: checks general.architecture == "llama",
 * reads the hyper-parameters and dequantizes every weight (tensor types
 * F32, F16, BF16, Q8_0, Q4_0, Q4_1) to the precision
 * KVARN_LLAMA_WEIGHTS_AUTO picks (kvarn_llama_load_with below; SmolLM2-135M
 * takes ~540 MB in fp32, ~326 MB in bf16 and ~166 MB in int8: the tied
 * embedding keeps plain rows for lookups beside the multiplied copy; 96 MB
 * as its file's own Q4_1 / Q8_0 blocks, gguf weights, AUTO's choice for it).
 * Tensors used: token_embd, output_norm, output (optional: tied to
 * token_embd when absent), and per layer blk.N.{attn_norm, attn_q, attn_k,
 * attn_v, attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down}.weight.
 * Errors: KVARN_ERR_INVALID_ARG (NULL), KVARN_ERR_IO (cannot open/read),
 * KVARN_ERR_BAD_FILE (not GGUF, not llama, a tensor missing or of the wrong
 * shape, inconsistent hyper-parameters; kvarn_llama_read_hparams and
 * kvarn_llama_check_tensors name which), KVARN_ERR_UNSUPPORTED (a tensor
 * type or a partial RoPE this runner does not serve), KVARN_ERR_TOO_LARGE
 * (hyper-parameters whose weight sizes, formed in checked 64-bit
 * arithmetic, overflow size_t, or a Q/K width n_heads * head_dim beyond
 * INT32_MAX; found before the first weight is allocated), KVARN_ERR_NOMEM.
 * On error *out is NULL. */
kvarn_status kvarn_llama_load(const char *path, kvarn_llama **out);

/* The same from a GGUF already open (gguf.h); g is only read during the
 * call and may be closed afterwards (the weights are copied). Same errors,
 * without KVARN_ERR_IO. */
kvarn_status kvarn_llama_load_gguf(const kvarn_gguf *g, kvarn_llama **out);

/* kvarn_llama_load / kvarn_llama_load_gguf with the model and all its
 * weights allocated through allocator (copied; must outlive the model;
 * NULL = malloc/free, alloc.h). _ex also opens the file's index with it.
 * Errors as those, and KVARN_ERR_INVALID_ARG for an allocator with only one
 * of alloc/free set. */
kvarn_status kvarn_llama_load_ex(const char *path, const kvarn_allocator *allocator,
                                 kvarn_llama **out);
kvarn_status kvarn_llama_load_gguf_ex(const kvarn_gguf *g, const kvarn_allocator *allocator,
                                      kvarn_llama **out);

/* How the weight matrices are held in memory (docs/model.md "Weight
 * precision"). Norm weights are always fp32. */
typedef enum kvarn_llama_weights {
    KVARN_LLAMA_WEIGHTS_AUTO = 0, /* the environment's KVARN_WEIGHTS ("fp32",
                                     "bf16", "int8" or "gguf") when set, else
                                     gguf for a file whose matrices (every
                                     tensor of 2+ dimensions) are all Q4_0 /
                                     Q4_1 / Q8_0 on a CPU with AVX2, else
                                     bf16 where this build and CPU can run
                                     it, else fp32 */
    KVARN_LLAMA_WEIGHTS_FP32 = 1, /* every matrix dequantized to fp32 (4
                                     bytes/weight; OpenBLAS sgemm/sgemv);
                                     the cross-check tests' precision */
    KVARN_LLAMA_WEIGHTS_BF16 = 2, /* rounded to bf16 (2 bytes/weight; oneDNN
                                     bf16 matmul: activations rounded to bf16
                                     at each matmul's input, fp32 sums) */
    KVARN_LLAMA_WEIGHTS_INT8 = 3, /* int8 codes per row with a scale per row
                                     (1 byte/weight + 4/row; oneDNN s8 matmul:
                                     activations quantized to int8 per token
                                     at each matmul's input, int32 sums);
                                     opt-in, docs/model.md "Weight
                                     precision" */
    KVARN_LLAMA_WEIGHTS_GGUF = 4  /* each matrix whose tensors are Q4_0, Q4_1
                                     or Q8_0 kept as the file's own blocks
                                     (Q4_1: 0.625 bytes/weight), multiplied
                                     by kvarn's GEMV with fp32 activations
                                     and sums (each weight dequantized
                                     exactly as kvarn_ggml_dequantize does:
                                     the fp32 model, only the summation order
                                     differs); other types held in fp32.
                                     Chunks: rows dequantized to fp32 a slab
                                     at a time, OpenBLAS sgemm. */
} kvarn_llama_weights;

/* The weight precision named `name`, as KVARN_WEIGHTS takes it: "fp32",
 * "bf16", "int8" or "gguf" (case-sensitive; AUTO has no name) into *out
 * (docs/model.md "Weight precision"). KVARN_ERR_INVALID_ARG for any other
 * name or a NULL argument, *out untouched. */
kvarn_status kvarn_llama_weights_parse(const char *name, kvarn_llama_weights *out);

/* Load settings. Start from KVARN_LLAMA_LOAD_OPTS_DEFAULT. */
typedef struct kvarn_llama_load_opts {
    const kvarn_allocator *allocator; /* the model and its weights (copied;
                                         must outlive the model); NULL =
                                         malloc/free. oneDNN's own objects
                                         (engine, primitives) are its own. */
    kvarn_llama_weights weights;      /* AUTO, FP32, BF16, INT8 or GGUF */
} kvarn_llama_load_opts;

#define KVARN_LLAMA_LOAD_OPTS_DEFAULT { NULL, KVARN_LLAMA_WEIGHTS_AUTO }

/* kvarn_llama_load / kvarn_llama_load_gguf with settings (opts NULL = the
 * defaults; the calls above use the defaults with their allocator).
 * Errors: as those, and KVARN_ERR_INVALID_ARG (an unknown weights value, an
 * allocator with only one of alloc/free set, KVARN_WEIGHTS set to anything
 * but "fp32", "bf16", "int8" or "gguf" under AUTO), KVARN_ERR_UNSUPPORTED (BF16 or
 * INT8 asked for, or named by KVARN_WEIGHTS, where this build has no oneDNN or oneDNN
 * cannot make a bf16 matmul on this CPU). */
kvarn_status kvarn_llama_load_with(const char *path, const kvarn_llama_load_opts *opts,
                                   kvarn_llama **out);
kvarn_status kvarn_llama_load_gguf_with(const kvarn_gguf *g,
                                        const kvarn_llama_load_opts *opts,
                                        kvarn_llama **out);

/* The precision the model's weights are held in (FP32, BF16, INT8 or
 * GGUF: AUTO resolved); FP32 for NULL. */
kvarn_llama_weights kvarn_llama_get_weights(const kvarn_llama *model);

/* Bytes of the model's weight matrices as held (every matrix, the tied head
 * counted once; bf16/int8: oneDNN's blocked copy with its padding, int8's
 * float scale per row, and the plain rows a tied embedding keeps for
 * lookups; gguf: the blocks, and 4 bytes a weight for matrices held in
 * fp32); 0 for NULL. */
uint64_t kvarn_llama_weight_bytes(const kvarn_llama *model);

/* Free a model (NULL is fine). Free its sessions first. */
void kvarn_llama_free(kvarn_llama *model);

/* The model's hyper-parameters (valid while the model lives). */
const kvarn_llama_hparams *kvarn_llama_get_hparams(const kvarn_llama *model);

/* Session settings. Start from KVARN_LLAMA_SESSION_OPTS_DEFAULT. */
typedef struct kvarn_llama_session_opts {
    const kvarn_format *format; /* the cache format (kvarn_format_parse,
                                 kvarn.h), copied at creation; NULL = fp16
                                 (the unquantized reference). A format not
                                 made by kvarn_format_parse is checked as
                                 kvarn_format_check_head_dim checks it. */
    int max_tokens;           /* context capacity in tokens, at most
                                 KVARN_CACHE_MAX_SEQ_LEN (cache.h, 2^30);
                                 0 = the model's context_length */
    int max_chunk;            /* most tokens per forward call; 0 = 512 */
    int sink_tiles;           /* KVarN: fp16 sink tiles kept for good;
                                 -1 = default (1) */
    int balance_iters;        /* KVarN balance iterations; -1 = default (8) */
    int attn_threads;         /* workers of the attention thread pool
                                 (attn.h); 0 = 1 (no pool). Results do not
                                 depend on it beyond fp32 summation order. */
    int exact_chunk;          /* Both values: the chunk attends to its own
                                 K/V in fp32 and to the history as the cache
                                 holds it, merged by log-sum-exp. 0: the
                                 history through the paged kernels (attn.h),
                                 as a serving engine reads it. 1: the history
                                 decoded with kvarn_cache_read and attended
                                 in fp32: slow, for cross-checks. */
    int exact;                /* 1: keep K/V in fp32 outside the paged cache
                                 (cross-checks only; format ignored) */
    int keep_kv_f32;          /* 1: also keep a copy of every token's fp32 K
                                 (post-RoPE) and V as computed, before any
                                 cache rounding, for
                                 kvarn_llama_session_read_kv (K/V dumps,
                                 docs/kv-dump.md); costs 8 * n_layers *
                                 n_kv_heads * head_dim bytes per token of
                                 max_tokens. 0: no copy. */
    const kvarn_allocator *allocator; /* the session, its scratch, its cache
                                 and thread pool are allocated through it
                                 (copied; must outlive the session); NULL =
                                 malloc/free (alloc.h). Independent of the
                                 model's allocator. */
    kvarn_cache *cache;       /* NULL: the session makes and owns a
                                 one-sequence cache (kv_bytes of the plan).
                                 Else a cache the caller made
                                 (kvarn_cache_create) and keeps: the session
                                 takes one sequence of it, so that several
                                 sessions (an engine's requests) share one
                                 pool of blocks and pages. Its n_layers,
                                 n_kv_heads and head_dim must be the model's
                                 and max_tokens (set it: 0 means the model's
                                 context) at most its max_seq_len; the format,
                                 G, sink (tiles and tokens) and balance
                                 iterations are the cache's, so format must
                                 be NULL, sink_tiles and balance_iters -1,
                                 sink_tokens 0, exact 0. The cache
                                 must outlive the session and is used only
                                 by one call at a time (cache.h): sessions
                                 on one cache run one after another. A
                                 forward call fails with
                                 KVARN_ERR_OUT_OF_BLOCKS, the session as
                                 before, when the pool lacks the blocks or
                                 pages it needs (KVarN: about
                                 ceil(n / G) + 1 pages for a chunk of n
                                 until its commit, cache.h n_pages). */
    int sink_tokens;          /* KVarN: S, fp16 sink tokens (cache.h
                                 kvarn_cache_opts.sink_tokens: a sink shorter
                                 than a tile keeps the rest of that tile
                                 quantized); 0 (default) = sink_tiles * G.
                                 0 with a caller's cache (its sink is the
                                 cache's). */
    int tail_page_tokens;     /* KVarN: fp16 tail pages of T tokens taken on
                                 demand (cache.h kvarn_cache_opts.
                                 tail_page_tokens, T dividing G); 0 (default)
                                 or T >= G: a whole tile per tail page.
                                 Per-token formats: ignored. 0 with a
                                 caller's cache (its pages are the cache's). */
    int rtn_range;            /* KVarN: the RTN range of the session's own
                                 cache (cache.h kvarn_cache_opts.rtn_range):
                                 KVARN_RTN_MINMAX (0, default) or
                                 KVARN_RTN_MSE. 0 with a caller's cache. */
    int staging;              /* KVarN: how staged tokens are held (cache.h
                                 kvarn_cache_opts.staging, kvarn_staging);
                                 -1 (default): the cache's default, int8
                                 records; KVARN_STAGING_FP16 (0) fp16 rows.
                                 Per-token formats: ignored. -1 with a
                                 caller's cache. */
} kvarn_llama_session_opts;

#define KVARN_LLAMA_SESSION_OPTS_DEFAULT { NULL, 0, 0, -1, -1, 0, 0, 0, 0, NULL, NULL, 0, 0, 0, -1 }

/* What a session would be and take (kvarn_llama_session_plan). */
typedef struct kvarn_llama_session_info {
    int max_tokens;        /* context capacity, tokens (0 in opts resolved) */
    int max_chunk;         /* most tokens per forward call */
    int exact;             /* 1: the exact fp32 store (format unused) */
    kvarn_format format;   /* the cache format */
    int n_layers, n_kv_heads, head_dim; /* the K/V geometry of the model */
    uint64_t kv_bytes;     /* the K/V store: the paged cache's arena (blocks
                              + fp16 pages, all layers), or the exact fp32
                              K and V; 0 on a caller's cache (opts.cache) */
    uint64_t other_bytes;  /* everything else the session allocates: forward
                              scratch, attention workspace, block table and
                              id pools, keep_kv_f32 copies */
    uint64_t total_bytes;  /* kv_bytes + other_bytes */
} kvarn_llama_session_info;

/* Work out what kvarn_llama_session_create(model, opts) would allocate,
 * without allocating: resolves the options as create does and computes
 * every size in 64 bits with checked products. Lets a caller say how much
 * memory a context asks for before trying (or after KVARN_ERR_NOMEM).
 * Errors: as kvarn_llama_session_create, except KVARN_ERR_NOMEM. */
kvarn_status kvarn_llama_session_plan(const kvarn_llama *model,
                                      const kvarn_llama_session_opts *opts,
                                      kvarn_llama_session_info *out);

/* Create a session for model: allocates the cache for opts->max_tokens
 * tokens and all scratch for chunks up to opts->max_chunk tokens. opts may
 * be NULL for the defaults. Every size is checked first
 * (kvarn_llama_session_plan), so a context that cannot be held fails here,
 * with nothing allocated, never later as an exhausted cache.
 * Errors: KVARN_ERR_INVALID_ARG (NULL model, bad option, a format that
 * is no valid kvarn_format), KVARN_ERR_UNSUPPORTED_HEAD_DIM (the format
 * cannot serve the model's head_dim), KVARN_ERR_TOO_LARGE (max_tokens, or
 * the model's context_length when max_tokens is 0, above
 * KVARN_CACHE_MAX_SEQ_LEN = 2^30 tokens, or a buffer size beyond 64 bits /
 * size_t), KVARN_ERR_NOMEM; on a caller's cache (opts.cache) also
 * KVARN_ERR_INVALID_ARG for a cache of another shape, max_tokens above its
 * max_seq_len or an option it decides (format, sink_tiles, balance_iters,
 * exact), and KVARN_ERR_OUT_OF_BLOCKS when it already holds max_seqs
 * sequences. On error *out is NULL and the caller's cache is unchanged. */
kvarn_status kvarn_llama_session_create(const kvarn_llama *model,
                                        const kvarn_llama_session_opts *opts,
                                        kvarn_llama_session **out);

/* Free a session (NULL is fine). */
void kvarn_llama_session_free(kvarn_llama_session *s);

/* Forget the sequence: the next forward starts at position 0. The cache's
 * blocks are returned to its pool; nothing is freed or reallocated. */
void kvarn_llama_session_reset(kvarn_llama_session *s);

/* Load a sequence saved from a session's cache (kvarn_cache_seq_save of
 * kvarn_llama_session_cache / _seq, include/kvarn/state.h; len bytes at
 * buf) into s, which must be at position 0 (new or reset): the session then
 * holds those tokens' K/V exactly as saved and continues from their
 * position (kvarn_llama_session_pos), so that its next forward calls give
 * bit for bit what they gave in the session that saved it. The token ids
 * and the logits of the last token are not in the stream: the caller
 * keeps them (kvarn generate --save-state, docs/state.md).
 * Errors: KVARN_ERR_INVALID_ARG (NULL); KVARN_ERR_STATE (pos != 0);
 * KVARN_ERR_UNSUPPORTED (an exact session, or one with keep_kv_f32: the
 * stream has no fp32 copies); the errors of kvarn_cache_seq_restore
 * (KVARN_ERR_MISMATCH for another format, staging, sink or model shape,
 * KVARN_ERR_TRUNCATED, KVARN_ERR_CHECKSUM, ...), and
 * KVARN_ERR_OUT_OF_BLOCKS for more tokens than max_tokens. On error the
 * session is at position 0 as before. */
kvarn_status kvarn_llama_session_load_state(kvarn_llama_session *s, const void *buf, size_t len);

/* Tokens in the session (the position the next chunk starts at). */
int kvarn_llama_session_pos(const kvarn_llama_session *s);

/* The session's cache format (canonical name, e.g. "kvarn_k4v2_g128"), or
 * "exact" for an exact session. */
const char *kvarn_llama_session_format(const kvarn_llama_session *s);

/* The session's paged KV cache (cache.h): one cache of n_layers x
 * n_kv_heads x head_dim in the session's format, made at creation for one
 * sequence of max_tokens tokens (kvarn_llama_session_plan's kv_bytes is its
 * arena), and owned by the session: valid until kvarn_llama_session_free;
 * or the caller's opts.cache, which holds the session's sequence among
 * others. NULL for an exact session (no cache) or a NULL s.
 * Read it through cache.h: kvarn_cache_get_info (geometry: block size G in
 * tokens, sink tiles, blocks, pages, their bytes), kvarn_cache_get_stats
 * (blocks and pages in use, bytes per token held), and for the session's
 * sequence (kvarn_llama_session_seq) kvarn_cache_seq_get_info,
 * kvarn_cache_seq_view / kvarn_cache_layer_view / kvarn_cache_block_table
 * (the paged views attention reads, paged.h) and kvarn_cache_read (the K/V
 * as the cache holds them, fp32). Every token of a finished forward call is
 * committed, so with KVarN tiles [sink_tiles, floor(pos / G)) are
 * quantized blocks (per-token formats quantize each token as written).
 * The cache belongs to the session's forward calls: a caller must not
 * reserve, write, commit, truncate, fork or free the session's sequence
 * (the session's position would no longer describe it), and no cache call
 * may overlap a forward call or kvarn_llama_session_reset (cache.h: a cache
 * is not thread-safe). A reset frees the sequence and makes it anew: take
 * kvarn_llama_session_seq again after one. */
kvarn_cache *kvarn_llama_session_cache(kvarn_llama_session *s);

/* The id of the session's sequence in kvarn_llama_session_cache(s), in
 * [0, max_seqs) of that cache; -1 for an exact session or a NULL s. */
int kvarn_llama_session_seq(const kvarn_llama_session *s);

/* Copy the fp32 K (post-RoPE) and V of tokens [pos, pos + n) of one layer,
 * exactly as the forward pass computed them before the cache rounded or
 * quantized anything, in the original basis (never Hadamard-rotated; RoPE
 * on adjacent channel pairs of the GGUF's rows, docs/model.md).
 *   layer  in [0, n_layers)
 *   pos, n tokens already in the session: 0 <= pos, n >= 1,
 *          pos + n <= kvarn_llama_session_pos(s)
 *   k, v   fp32 [n][n_kv_heads][head_dim] each, token-major.
 * Needs a session created with keep_kv_f32 = 1.
 * Errors (k, v untouched): KVARN_ERR_INVALID_ARG (NULL, layer or range out
 * of bounds), KVARN_ERR_UNSUPPORTED (the session keeps no copy). */
kvarn_status kvarn_llama_session_read_kv(const kvarn_llama_session *s, int layer,
                                         int pos, int n, float *k, float *v);

/* Which logits kvarn_llama_forward writes. */
typedef enum kvarn_llama_logits {
    KVARN_LLAMA_LOGITS_NONE = 0, /* none (logits may be NULL) */
    KVARN_LLAMA_LOGITS_LAST = 1, /* the last token's: vocab floats */
    KVARN_LLAMA_LOGITS_ALL = 2   /* every token's: n * vocab floats,
                                    token-major */
} kvarn_llama_logits;

/* Run the model on tokens[0..n) at positions [pos, pos + n), pos =
 * kvarn_llama_session_pos(s), append their K/V to the cache and advance the
 * session by n. Logits (fp32, pre-softmax) go to logits, which holds
 * logits_len floats.
 * Errors: KVARN_ERR_INVALID_ARG (NULL, n < 1, n > max_chunk, a token id
 * outside [0, vocab), bad which), KVARN_ERR_BUFFER_TOO_SMALL (logits_len),
 * KVARN_ERR_OUT_OF_BLOCKS (pos + n > max_tokens, or a caller's cache
 * without the free blocks or pages the chunk needs), KVARN_ERR_NONFINITE
 * (NaN/Inf reached the cache). On any error the session is as before the
 * call: argument errors are found before any work, and a failure inside
 * the pass drops the chunk's tokens from the cache again (logits may then
 * hold partial results). KVARN_ERR_NOMEM / KVARN_ERR_UNSUPPORTED only with
 * bf16 / int8 weights: oneDNN refused a matmul call. */
kvarn_status kvarn_llama_forward(kvarn_llama_session *s, const int32_t *tokens,
                                 int n, kvarn_llama_logits which,
                                 float *logits, size_t logits_len);

#ifdef __cplusplus
}
#endif

#endif /* KVARN_MODEL_H */
