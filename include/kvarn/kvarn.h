/*
 * kvarn.h -- the public contract of libkvarn: status codes, the table of
 * KV-cache formats, record sizes and capacity, and the tile codec.
 *
 * Read top to bottom. Every function says what it takes (shapes, units),
 * what it returns and how it fails. Nothing here keeps global state, prints,
 * allocates on the hot path, or aborts: errors are kvarn_status values and
 * kvarn_strerror() names them.
 *
 * Terms (see ../shared/spec/KVARN.md and docs/formats.md):
 *   D          head_dim, channels per head.
 *   G          tile length in tokens; for KVarN formats it is the paged
 *              cache's block size. Per-token formats have G = 1.
 *   tile       the K (or V) of one KV head for G consecutive tokens.
 *   record     the encoded K and V of one tile (one per block and KV head).
 *   token-head one token of one KV head (the unit of "bytes per token").
 */
#ifndef KVARN_KVARN_H
#define KVARN_KVARN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Status codes                                                             */
/* ------------------------------------------------------------------------ */

typedef enum kvarn_status {
    KVARN_OK = 0,
    KVARN_ERR_INVALID_ARG = -1,        /* NULL pointer, negative size, bad option */
    KVARN_ERR_UNKNOWN_FORMAT = -2,     /* cache format name not in the table */
    KVARN_ERR_UNSUPPORTED_HEAD_DIM = -3, /* format cannot serve this head_dim */
    KVARN_ERR_NONFINITE = -4,          /* NaN or Inf in the input activations */
    KVARN_ERR_BUFFER_TOO_SMALL = -5,   /* output or workspace smaller than needed */
    KVARN_ERR_OUT_OF_BLOCKS = -6,      /* block pool exhausted */
    KVARN_ERR_NOMEM = -7,              /* allocation failed (setup calls only) */
    KVARN_ERR_IO = -8,                 /* a file could not be opened or read */
    KVARN_ERR_BAD_FILE = -9,           /* a file is truncated, malformed or hostile */
    KVARN_ERR_UNSUPPORTED = -10,       /* a valid request this build does not serve */
    KVARN_ERR_STATE = -11,             /* call not valid in the object's current state */
    KVARN_ERR_NO_DEVICE = -12,         /* no usable GPU (CUDA backend) */
    KVARN_ERR_TOO_LARGE = -13,         /* a count or byte size beyond what the
                                          library can hold (more than its
                                          token/id limits, or a size that
                                          overflows 64 bits or size_t);
                                          found before anything is allocated */
    KVARN_ERR_TRUNCATED = -14,         /* a stream ends before the bytes its
                                          header declares (state.h) */
    KVARN_ERR_BAD_VERSION = -15,       /* a stream of a layout version this
                                          build does not read (state.h) */
    KVARN_ERR_CHECKSUM = -16,          /* a stream whose checksum does not
                                          match its bytes (state.h) */
    KVARN_ERR_MISMATCH = -17           /* a saved state made by a cache of
                                          other settings (state.h names the
                                          field) */
} kvarn_status;

/* Short, stable English name of a status code ("unknown cache format", ...).
 * Never returns NULL; unknown codes give "unknown status". */
const char *kvarn_strerror(kvarn_status status);

/* The SIMD level every kernel family (codec, Hadamard, attention, GEMV)
 * runs at now: the CPU's best ("avx512": AVX-512 F/BW/VL; "avx2": AVX2 +
 * FMA + F16C; else "scalar"), capped by the environment variable
 * KVARN_SIMD = scalar | avx2 | avx512 (unset or empty: no cap; a cap never
 * raises the level above the CPU's). *name (may be NULL) gets the level's
 * name, a static string. Returns KVARN_OK, or KVARN_ERR_INVALID_ARG when
 * KVARN_SIMD holds anything else: the kernels then ignore it and run at
 * the CPU's level (*name says which); the library prints nothing, so a
 * program decides whether to refuse it (the kvarn command and the
 * benchmarks do: a usage error, exit 2). Reads the environment on every
 * call; thread-safe as getenv is. Source: common/cpu.c. */
kvarn_status kvarn_simd_level(const char **name);

/* ------------------------------------------------------------------------ */
/* Formats: one row per cache format (docs/formats.md)                      */
/* ------------------------------------------------------------------------ */

typedef enum kvarn_kind {
    KVARN_KIND_FP16 = 0,   /* IEEE half, no quantization (alias "auto") */
    KVARN_KIND_BF16,       /* bfloat16, no quantization */
    KVARN_KIND_FP8_E4M3,   /* OCP FP8 E4M3 (max 448), fp16 scale per token-head */
    KVARN_KIND_FP8_E5M2,   /* OCP FP8 E5M2 (max 57344), fp16 scale per token-head */
    KVARN_KIND_INT8,       /* asymmetric RTN, fp16 scale + zero-point per token-head */
    KVARN_KIND_INT4,       /* asymmetric RTN, fp16 scale + zero-point per token-head */
    KVARN_KIND_KVARN,      /* KVarN tile codec (../shared/spec/KVARN.md) */
    KVARN_KIND_COUNT
} kvarn_kind;

/* A parsed cache format. Plain value; copy freely. */
typedef struct kvarn_format {
    kvarn_kind kind;
    char name[32];        /* canonical name, e.g. "kvarn_k4v2_g128", "fp16" */
    int tile_tokens;      /* G: tokens per record; 1 for per-token formats */
    int key_bits;         /* bits per stored key element (16 for fp16/bf16) */
    int value_bits;       /* bits per stored value element */
    int per_tile;         /* 1: a whole tile is encoded at once (KVarN);
                             0: token by token */
    int centred;          /* KVarN only: 1 = mean-centred values (names
                             ending in "c", e.g. kvarn_k4v2_g128c): each
                             record also holds the per-channel mean of its
                             rotated V tile, fp16 [D] (record.h), removed
                             before the variance normalization and added
                             back on decode and in attention; 0 = the
                             spec's record (every upstream preset) */
} kvarn_format;

/* Parse a cache format name exactly as a user types it (--kv-cache-dtype):
 * "fp16" (alias "auto"), "bf16", "fp8_e4m3" (alias "fp8"), "fp8_e5m2",
 * "int8", "int4", and "kvarn_k{2,4,8}v{2,4,8}_g{32,64,128}" (upstream
 * presets kvarn_k4v2_g128 (the default KVarN preset), kvarn_k4v2_g64,
 * kvarn_k4v4_g128, kvarn_k4v4_g64), each KVarN name optionally followed by
 * "c" for its mean-centred variant (kvarn_k4v2_g128c; .centred = 1).
 * Returns KVARN_OK and fills *out, KVARN_ERR_UNKNOWN_FORMAT for any other
 * string (out untouched), KVARN_ERR_INVALID_ARG for NULL. */
kvarn_status kvarn_format_parse(const char *name, kvarn_format *out);

/* Comma-separated list of every accepted name, for error messages and
 * --help. Static string; never NULL. */
const char *kvarn_format_accepted_names(void);

/* Number of rows in the format table and the canonical name of row i
 * (0 <= i < count), in ladder order: fp16, bf16, fp8_e4m3, fp8_e5m2, int8,
 * int4, then the upstream KVarN presets. NULL for i out of range. */
int kvarn_format_count(void);
const char *kvarn_format_name_at(int i);

/* Whether the format serves head_dim D. KVarN serves D in {64, 128, 256,
 * 512} (the fast Walsh-Hadamard needs a power of two; upstream serves 128,
 * 256, 512 and we add 64 for SmolLM2, see docs/formats.md); per-token formats
 * serve any even D in [2, 1024].
 * Returns KVARN_OK or KVARN_ERR_UNSUPPORTED_HEAD_DIM; KVARN_ERR_INVALID_ARG
 * for NULL or a format its kind does not admit (e.g. a hand-built int8
 * format with other bit widths, or a KVarN tile length outside
 * {32, 64, 128}): every call that takes a format checks it through here. */
kvarn_status kvarn_format_check_head_dim(const kvarn_format *fmt, int head_dim);

/* Write a one-line, human-readable explanation of a failed parse or
 * head_dim check into buf (at most len bytes, NUL-terminated), listing what
 * is accepted. name may be NULL, head_dim may be 0. Returns buf. */
char *kvarn_format_explain(kvarn_status status, const char *name, int head_dim,
                           char *buf, size_t len);

/* ------------------------------------------------------------------------ */
/* Sizes and capacity                                                       */
/* ------------------------------------------------------------------------ */

/* Bytes of one record (K and V of one tile of G tokens and one KV head, all
 * metadata and padding counted) for head_dim D. 0 if D is not served.
 * Examples: kvarn_k4v2_g128, D=128: 13824; D=64: 7296; fp16, D=64: 256. */
size_t kvarn_record_bytes(const kvarn_format *fmt, int head_dim);

/* Bytes per token per KV head (K and V together) = record bytes / G.
 * 0.0 if D is not served. */
double kvarn_bytes_per_token_head(const kvarn_format *fmt, int head_dim);

/* Tokens whose K/V for n_layers layers and n_kv_heads KV heads fit in
 * budget_bytes, counting whole records (a partial tile costs a full
 * record). 0 on bad arguments and when one tile of every layer and head
 * is beyond 64 bits (formed with checked products). Records only: what a
 * paged cache in that budget holds (fp16 sink and tail pages, tables
 * counted) is kvarn_cache_capacity_get in cache.h, which every kvarn tool
 * reports. */
uint64_t kvarn_capacity_tokens(const kvarn_format *fmt, int head_dim,
                               int n_layers, int n_kv_heads,
                               uint64_t budget_bytes);

/* ------------------------------------------------------------------------ */
/* Tile codec                                                               */
/* ------------------------------------------------------------------------ */

/* The range of each KVarN RTN row (kvarn_codec_opts.rtn_range). Both
 * write the same record layout, read by the same decoder and kernels. */
#define KVARN_RTN_MINMAX 0  /* the spec's: lo = min, hi = max of the row */
#define KVARN_RTN_MSE 1     /* the (lo, scale) of smallest squared
                               reconstruction error found by a search over
                               clipped ranges, then least-squares refits
                               (docs/kvarn-centred.md "Error-minimizing
                               range"), for K's rows and V's; plain C,
                               ~25x the encode time (D 64: 1.0 ms a tile
                               against 38 us) */
#define KVARN_RTN_MSE_V 2   /* KVARN_RTN_MSE for V's rows only, K min/max
                               (clipping a key row clips its outliers,
                               which the softmax weighs most) */

/* Codec settings. Pass NULL for the defaults. */
typedef struct kvarn_codec_opts {
    int balance_iters;    /* KVarN variance-normalization iterations
                             (spec step 2); default 8, range [0, 64] */
    int prerotated;       /* encode: input already multiplied by H/sqrt(D)
                             (the paged cache's fp16 tail); default 0 */
    int rtn_range;        /* KVarN: KVARN_RTN_MINMAX (default),
                             KVARN_RTN_MSE or KVARN_RTN_MSE_V; ignored by
                             per-token formats */
} kvarn_codec_opts;

#define KVARN_CODEC_OPTS_DEFAULT { 8, 0, KVARN_RTN_MINMAX }

/* Bytes of scratch memory kvarn_encode needs for this format and D (0 for
 * per-token formats). Allocate once, reuse for every tile. */
size_t kvarn_encode_workspace_bytes(const kvarn_format *fmt, int head_dim);

/* Encode one tile into one record.
 *   k, v      fp32 [G][D] token-major (token t, channel d at t*D + d), the
 *             K (post-RoPE) and V of one KV head for G = fmt->tile_tokens
 *             tokens.
 *   record    output, record_size >= kvarn_record_bytes(fmt, D) bytes; the
 *             layout is in include/kvarn/record.h.
 *   workspace kvarn_encode_workspace_bytes(fmt, D) bytes, 16-byte aligned
 *             (may be NULL when that is 0).
 * Source: ../shared/spec/KVARN.md "Store pipeline" for KVarN;
 * docs/formats.md for the per-token formats.
 * Errors: KVARN_ERR_INVALID_ARG (NULL, bad opts), KVARN_ERR_UNSUPPORTED_HEAD_DIM,
 * KVARN_ERR_BUFFER_TOO_SMALL (record or workspace), KVARN_ERR_NONFINITE (any
 * NaN/Inf in k or v). On any error nothing is written to record. */
kvarn_status kvarn_encode(const kvarn_format *fmt, int head_dim,
                          const float *k, const float *v,
                          void *record, size_t record_size,
                          void *workspace, size_t workspace_size,
                          const kvarn_codec_opts *opts);

/* Decode flags. */
#define KVARN_DECODE_ROTATED 1u  /* KVarN: leave K/V in the Hadamard-rotated
                                    basis (what attention works in) */

/* Decode one record back to fp32.
 *   k_out, v_out  fp32 [G][D] token-major; either may be NULL to skip it.
 * For KVarN the output is rotated back to the original basis unless
 * KVARN_DECODE_ROTATED is given.
 * Errors: KVARN_ERR_INVALID_ARG, KVARN_ERR_UNSUPPORTED_HEAD_DIM,
 * KVARN_ERR_BUFFER_TOO_SMALL (record_size below the record bytes). */
kvarn_status kvarn_decode(const kvarn_format *fmt, int head_dim,
                          const void *record, size_t record_size,
                          float *k_out, float *v_out, unsigned flags);

/* ------------------------------------------------------------------------ */
/* Number conversions (IEEE round to nearest even)                          */
/* ------------------------------------------------------------------------ */

uint16_t kvarn_fp32_to_fp16(float x);
float kvarn_fp16_to_fp32(uint16_t h);
uint16_t kvarn_fp32_to_bf16(float x);
float kvarn_bf16_to_fp32(uint16_t h);
/* OCP FP8; out-of-range values saturate to the largest finite value. */
uint8_t kvarn_fp32_to_fp8_e4m3(float x);
float kvarn_fp8_e4m3_to_fp32(uint8_t b);
uint8_t kvarn_fp32_to_fp8_e5m2(float x);
float kvarn_fp8_e5m2_to_fp32(uint8_t b);

#ifdef __cplusplus
}
#endif

#endif /* KVARN_KVARN_H */
