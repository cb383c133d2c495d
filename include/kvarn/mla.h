/*
 * mla.h -- KVarN records for Multi-head Latent Attention (MLA) caches and
 * attention in the absorbed form reading them.
 *
 * MLA (DeepSeek-V2/V3, Kimi-K2) caches per token and layer one latent c_kv
 * (kv_lora_rank channels, 512, after its RMSNorm) and one post-RoPE key part
 * k_pe (qk_rope_head_dim channels, 64) shared by every query head. Decode in
 * the absorbed form: per query head h, q_lat_h = q_nope_h W_UK_h (latent_dim
 * wide) and q_pe_h (rope_dim wide),
 *     score_t = scale (q_lat_h . c_t + q_pe_h . k_pe_t),
 *     out_h   = sum_t softmax_t(score) c_t    (latent_dim wide; W_UV after).
 * The latent is both key and value, so it is stored once.
 *
 * Record: one per tile of G tokens of one sequence and one layer (G = the
 * paged cache's block size), in this order (docs/mla.md):
 *   latent codes   D rows (channels) x G codes, kb bits    D*G*kb/8 bytes
 *   latent a_d     fp16 [D]   per-channel scale (RTN scale folded)   2D
 *   latent b_d     fp16 [D]   per-channel offset (RTN min folded)    2D
 *   latent s_tok_t fp16 [G]   per-token balance scale                2G
 *   rope, rope_bits 16: fp16 [G][R] (token-major)                   2GR
 *         rope_bits 8:  codes u8 [G][R], then scale fp16 [G], then
 *                       zero-point fp16 [G]                      GR + 4G
 *   padding (zero bytes) to a multiple of 8 bytes; no power-of-two rule
 *   (docs/mla.md "Padding").
 * D = latent_dim, R = rope_dim. The latent part is exactly a KVarN K tile
 * (../shared/spec/KVARN.md "Store pipeline": Hadamard H/sqrt(D) per token,
 * log-space variance normalization of the [D channels x G tokens] matrix,
 * asymmetric RTN per channel, fold); in the rotated basis
 *     c_rot[t][d] = (code[d,t] a_d + b_d) s_tok_t,   c = c_rot H/sqrt(D).
 * The rope part is not rotated: k_pe[t][j] = fp16, or code * scale_t +
 * zero_t (int8: per-token asymmetric RTN as the int8 cache format,
 * docs/formats.md: zero = the token's minimum rounded down to fp16, scale
 * rounded up, so |k_pe - decoded| <= scale_t / 2).
 *
 * Supported: latent_bits 2, 4, 8; G 64, 128; rope_bits 8, 16; latent_dim a
 * power of two in 64..512 (the KVarN tile codec's range; DeepSeek's is
 * 512); rope_dim a multiple of 16 in 0..128. There are no CUDA kernels for
 * these records (cuda.h serves kvarn_format only).
 */
#ifndef KVARN_MLA_H
#define KVARN_MLA_H

#include <stddef.h>
#include <stdint.h>

#include "kvarn/kvarn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A parsed MLA format. Plain value; copy freely. */
typedef struct kvarn_mla_format {
    int latent_bits;  /* bits per latent code: 2, 4 or 8 */
    int tile_tokens;  /* G: tokens per tile (= the paged cache's block size): 64 or 128 */
    int rope_bits;    /* the RoPE key part: 8 (int8 RTN per token, fp16 scale
                         + zero-point) or 16 (fp16) */
} kvarn_mla_format;

/* The rope_bits of a name without "r..": 8, chosen by the measurement in
 * docs/mla.md "Rope at 8 or 16 bits" (bench_mla: the int8 rope adds a KLD
 * ~1e4 times smaller than the 4-bit latent's and saves 60 of 402 bytes
 * per token). */
#define KVARN_MLA_DEFAULT_ROPE_BITS 8

/* Parse "kvarn_mla_k{2,4,8}[r{8,16}]_g{64,128}", e.g. "kvarn_mla_k4_g128"
 * (rope at KVARN_MLA_DEFAULT_ROPE_BITS), "kvarn_mla_k4r8_g128",
 * "kvarn_mla_k4r16_g128", "kvarn_mla_k2_g64"; numbers without leading
 * zeros (one spelling per format). Returns KVARN_OK and fills
 * *out; KVARN_ERR_UNKNOWN_FORMAT for any other string (out untouched; the
 * reason from kvarn_mla_format_explain); KVARN_ERR_INVALID_ARG for NULL. */
kvarn_status kvarn_mla_format_parse(const char *name, kvarn_mla_format *out);

/* Write a one-line explanation of a failed kvarn_mla_format_parse or
 * kvarn_mla_check_dims (status) into buf (at most len bytes, NUL-terminated):
 * what was wrong and what is accepted. name may be NULL; latent_dim and
 * rope_dim are quoted when status is KVARN_ERR_UNSUPPORTED_HEAD_DIM.
 * Returns buf (NULL if buf is NULL or len is 0). */
char *kvarn_mla_format_explain(kvarn_status status, const char *name, int latent_dim,
                               int rope_dim, char *buf, size_t len);

/* Bytes of one record (tile of G tokens: latent and rope, padding counted)
 * for these dims, as the table above. 0 if fmt or the dims are not
 * supported. Examples, latent 512 + rope 64: kvarn_mla_k4_g128 (= k4r8):
 * 43776 (342 bytes per token, 3.37x smaller than the 1152 of vLLM's bf16
 * 576-wide MLA cache); kvarn_mla_k4r16_g128: 51456 (402, 2.87x). */
size_t kvarn_mla_record_bytes(const kvarn_mla_format *fmt, int latent_dim, int rope_dim);

/* Whether fmt is well formed (bits and G above) and serves latent_dim
 * (a power of two 64..512) and rope_dim (0..128, a multiple of 16).
 * Returns KVARN_OK, KVARN_ERR_INVALID_ARG (NULL or a malformed hand-built
 * fmt) or KVARN_ERR_UNSUPPORTED_HEAD_DIM (dims). Every call below checks
 * its fmt and dims through here. */
kvarn_status kvarn_mla_check_dims(const kvarn_mla_format *fmt, int latent_dim, int rope_dim);

/* Bytes of scratch memory for kvarn_mla_encode (n_rows, n_heads ignored:
 * pass 0) and for kvarn_mla_attn with up to n_rows x n_heads query rows.
 * One buffer of the size for the largest call serves both. 0 if fmt or the
 * dims are not supported, or n_rows / n_heads are negative or their product
 * is beyond 2^20 rows. Any alignment (the calls align inside). */
size_t kvarn_mla_workspace_bytes(const kvarn_mla_format *fmt, int latent_dim, int rope_dim,
                                 int n_rows, int n_heads);

/* Encode one tile of G = fmt->tile_tokens tokens into one record.
 *   latent     fp32 [G][latent_dim] token-major: c_kv after its RMSNorm
 *   rope       fp32 [G][rope_dim] token-major: k_pe after RoPE (may be NULL
 *              when rope_dim is 0)
 *   workspace  kvarn_mla_workspace_bytes(fmt, latent_dim, rope_dim, 0, 0)
 *   record     kvarn_mla_record_bytes(fmt, latent_dim, rope_dim) bytes out
 * Source: ../shared/spec/KVARN.md "Store pipeline" (the latent as a K
 * tile, 8 balance iterations, min/max RTN); docs/mla.md.
 * Errors: KVARN_ERR_INVALID_ARG (NULL), as kvarn_mla_check_dims,
 * KVARN_ERR_NONFINITE (NaN/Inf in latent or rope, or a value whose folded
 * scale cannot be held in fp16). On any error nothing is written. */
kvarn_status kvarn_mla_encode(const kvarn_mla_format *fmt, int latent_dim, int rope_dim,
                              const float *latent, const float *rope, void *workspace,
                              uint8_t *record);

/* Decode one record back to fp32 in the original basis: latent
 * [G][latent_dim], rope [G][rope_dim] (either may be NULL to skip it).
 * Errors: KVARN_ERR_INVALID_ARG (NULL record), as kvarn_mla_check_dims. */
kvarn_status kvarn_mla_decode(const kvarn_mla_format *fmt, int latent_dim, int rope_dim,
                              const uint8_t *record, float *latent, float *rope);

/* Absorbed-form attention of one sequence. Tokens [0, n_tiles G) are in
 * the records (records[i] holds tokens [i G, (i+1) G)), tokens
 * [n_tiles G, n_tiles G + n_tail) in the fp32 tail (not rotated: the
 * caller's raw latent [n_tail][latent_dim] and rope [n_tail][rope_dim]
 * rows; any n_tail >= 0, usually < G: the tile not yet full). n_rows
 * query rows (e.g. 1 + k drafts), each with n_heads heads; row i sees the first row_len[i] tokens (causal; NULL: all), 1 <=
 * row_len[i] <= n_tiles G + n_tail. q_latent [n_rows][n_heads][latent_dim]
 * (already absorbed), q_rope [n_rows][n_heads][rope_dim] (may be NULL when
 * rope_dim is 0), out [n_rows][n_heads][latent_dim] (un-rotated, ready for
 * W_UV). scale: softmax scale, finite and > 0 (vLLM passes it; DeepSeek's
 * is 1/sqrt(qk_nope + qk_rope) times the yarn mscale squared). lse (may be
 * NULL): [n_rows][n_heads] natural-log sum-exp of the scaled scores.
 * workspace: kvarn_mla_workspace_bytes(fmt, latent_dim, rope_dim, n_rows,
 * n_heads) bytes. The kernel's SIMD level: kvarn_mla_attn_kernel_name.
 * Source: ../shared/spec/KVARN.md "Attention over records" with the latent
 * as key and value; docs/mla.md.
 * Errors (out and lse untouched): KVARN_ERR_INVALID_ARG (NULL pointer,
 * n_tiles or n_tail < 0, no token, n_rows or n_heads <= 0,
 * row_len[i] out of range, scale not finite and > 0, n_rows x n_heads over
 * 2^20), as kvarn_mla_check_dims, KVARN_ERR_NONFINITE (NaN/Inf in
 * q_latent, q_rope or the tail). Finite inputs are not range-checked:
 * scores that overflow fp32 (e.g. queries of 1e30 against a tail of 1e20)
 * or a record of arbitrary bytes may give NaN/Inf in out and lse with
 * KVARN_OK (tests/fuzz/fuzz_mla.c keeps such calls in their buffers). */
kvarn_status kvarn_mla_attn(const kvarn_mla_format *fmt, int latent_dim, int rope_dim,
                            const uint8_t *const *records, int n_tiles,
                            const float *tail_latent, const float *tail_rope, int n_tail,
                            const float *q_latent, const float *q_rope, int n_rows, int n_heads,
                            const int *row_len, float scale, float *out, float *lse,
                            void *workspace);

/* The SIMD level kvarn_mla_attn runs now for fmt and latent_dim ("avx512",
 * "avx2" or "scalar"), capped by KVARN_SIMD as every kernel family
 * (kvarn_simd_level). Never NULL ("scalar" for a fmt or dims it refuses). */
const char *kvarn_mla_attn_kernel_name(const kvarn_mla_format *fmt, int latent_dim);

/* The matrix kernel kvarn_mla_attn runs now for fmt and latent_dim in a
 * call of 16 or more query rows (n_rows x n_heads: prefill chunks,
 * verification): "amx-bf16" (AMX tiles: where kvarn_mla_attn_kernel_name
 * is "avx512", the CPU has AMX-BF16, Linux grants the tile state and
 * KVARN_AMX is not "0"), "amx-bf16-emulated" (KVARN_AMX=emulate: the same
 * logic with the tiles emulated in C, slow, for tests and measurements),
 * or NULL: none (the SIMD level's kernel; also for a fmt or dims it
 * refuses, and tiles of a length not a multiple of 32). Its arithmetic:
 * the folded query q a and the weights carried as two bf16 values each,
 * relative error at most 2^-16, fp32 sums (attn.h
 * KVARN_ATTN_ARITH_BF16X2; docs/attention-matrix.md). */
const char *kvarn_mla_attn_matrix_name(const kvarn_mla_format *fmt, int latent_dim);

#ifdef __cplusplus
}
#endif

#endif /* KVARN_MLA_H */
