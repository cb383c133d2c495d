/*
 * codec_internal.h -- entry points shared inside src/codec (and read by the
 * cache and attention stages). Not part of the public contract.
 */
#ifndef KVARN_CODEC_INTERNAL_H
#define KVARN_CODEC_INTERNAL_H

#include "kvarn/kvarn.h"
#include "kvarn/record.h"

/* KVarN tile codec (src/codec/kvarn_tile.c). k, v: fp32 [G][D]. The
 * arguments are already validated by kvarn_encode/kvarn_decode. v == NULL
 * (encode) encodes the K half alone into L's K fields (the MLA latent,
 * src/codec/mla_record.c; L->record_bytes: the bytes written, at most
 * those of an 8-bit KVarN record of the same D and G). */
size_t kvarn__tile_workspace_bytes(int head_dim, int tile_tokens);
kvarn_status kvarn__tile_encode(const kvarn_record_layout *L, const float *k,
                                const float *v, void *record, void *workspace,
                                const kvarn_codec_opts *opts);
kvarn_status kvarn__tile_decode(const kvarn_record_layout *L, const void *record,
                                float *k_out, float *v_out, unsigned flags);

/* Per-token formats (src/codec/per_token.c), one encode/decode pair per
 * kind, in the signatures of format_kinds.h (the rows' entry points).
 * k, v: fp32 [D] of one token; workspace, opts and flags are not read. */
#define KVARN_TOKEN_CODEC_DECL(NAME)                                                       \
    kvarn_status kvarn__##NAME##_encode(const kvarn_record_layout *L, const float *k,      \
                                        const float *v, void *record, void *workspace,     \
                                        const kvarn_codec_opts *opts);                     \
    kvarn_status kvarn__##NAME##_decode(const kvarn_record_layout *L, const void *record,  \
                                        float *k_out, float *v_out, unsigned flags);
KVARN_TOKEN_CODEC_DECL(fp16)
KVARN_TOKEN_CODEC_DECL(bf16)
KVARN_TOKEN_CODEC_DECL(fp8_e4m3)
KVARN_TOKEN_CODEC_DECL(fp8_e5m2)
KVARN_TOKEN_CODEC_DECL(int8)
KVARN_TOKEN_CODEC_DECL(int4)
#undef KVARN_TOKEN_CODEC_DECL

/* One row of per-token asymmetric RTN as the int8/int4 formats
 * (per_token.c, docs/formats.md): zero = min rounded down to fp16, scale =
 * (max - zero) / (2^bits - 1) rounded up to fp16 (a constant row whose
 * value is an fp16: 1.0), codes [D] one per byte (not packed), so
 * |x - (code scale + zero)| <= scale / 2. x finite; bits 4 or 8; D in
 * 2..1024. KVARN_ERR_NONFINITE if scale or zero overflow fp16 (nothing
 * written). kvarn__rtn_row_decode: out[i] = codes[i] scale + zero. */
kvarn_status kvarn__rtn_row_encode(const float *x, int D, int bits, uint8_t *codes,
                                   uint16_t *scale, uint16_t *zero);
void kvarn__rtn_row_decode(const uint8_t *codes, int D, uint16_t scale, uint16_t zero,
                           float *out);

/* kvarn__rtn_row_encode compiled with AVX-512 (rtn_row_avx512.c; plain C
 * where the build has no AVX-512 flags): the same bytes. Only where
 * kvarn__cpu_level() is KVARN_CPU_AVX512. */
kvarn_status kvarn__rtn_row_encode_avx512(const float *x, int D, int bits, uint8_t *codes,
                                          uint16_t *scale, uint16_t *zero);

/* Whether the K row k and V row v (fp32 [D]) are finite and their int8
 * (bits 8) / int4 (bits 4) scale and zero point fit fp16, i.e. whether
 * kvarn_encode of that per-token format would accept them, without
 * forming the codes; 0 for other bits or D outside 2..1024 (even). avx512:
 * the AVX-512 build (rtn_row_avx512.c, the caller has seen the level; the
 * same answer either way). */
int kvarn__rtn_rows_fit(const float *k, const float *v, int D, int bits, int avx512);
int kvarn__rtn_rows_fit_avx512(const float *k, const float *v, int D, int bits);

/* One int8 (bits 8) or int4 (bits 4) per-token record (include/kvarn/
 * record.h) of the K row k and V row v (fp32 [L->head_dim], finite), as
 * kvarn_encode writes it; L: that format's layout at this head_dim.
 * avx512: the rows through kvarn__rtn_row_encode_avx512 (the caller has
 * seen kvarn__cpu_level() == KVARN_CPU_AVX512; the same bytes either way).
 * KVARN_ERR_INVALID_ARG for other bits; KVARN_ERR_NONFINITE (nothing
 * written) when a scale or zero point would overflow fp16. For batches of
 * tokens (kvarn__token_writer_encode, below) without kvarn_encode's
 * per-call checks and dispatch. */
kvarn_status kvarn__rtn_record_encode(int bits, const kvarn_record_layout *L, const float *k,
                                      const float *v, void *record, int avx512);

/* One fp8 record (e4m3 1: FP8 E4M3, 0: E5M2; include/kvarn/record.h) of
 * the K row k and V row v (fp32 [L->head_dim]) as kvarn_encode writes it
 * (fp8_row.h; L: that format's layout at this head_dim). avx512: through
 * fp8_row_avx512.c (the caller has seen kvarn__cpu_level() ==
 * KVARN_CPU_AVX512; the same bytes either way). KVARN_ERR_NONFINITE
 * (nothing written) where a row holds NaN or Inf or its scale would
 * overflow fp16; KVARN_ERR_UNSUPPORTED_HEAD_DIM for a head_dim outside
 * 2..1024 (even). kvarn__fp8_rows_fit: whether it would write them (1),
 * without forming the codes (0 for such a head_dim). per_token.c. */
kvarn_status kvarn__fp8_record_encode(int e4m3, const kvarn_record_layout *L, const float *k,
                                      const float *v, void *record, int avx512);
kvarn_status kvarn__fp8_record_encode_avx512(int e4m3, const kvarn_record_layout *L, const float *k,
                                             const float *v, void *record);
int kvarn__fp8_rows_fit(int e4m3, const float *k, const float *v, int D, int avx512);
int kvarn__fp8_rows_fit_avx512(int e4m3, const float *k, const float *v, int D);

/* The records of one batch of token-heads of a per-token format, as
 * kvarn_encode writes them, with the choices made once a batch: int8 and
 * int4 through kvarn__rtn_record_encode (bits 8 or 4, their layout L, the
 * CPU level asked once: it reads KVARN_SIMD on every call), fp8_e4m3 and
 * fp8_e5m2 through kvarn__fp8_record_encode (fp8 1 or 2), the other
 * formats through kvarn_encode (bits and fp8 0). kvarn__token_writer_init: fmt a
 * per-token format, D its head_dim. kvarn__token_writer_encode: k, v fp32
 * [D], rec rb bytes; kvarn_encode's status (int8/int4 with rb below the
 * record size go through kvarn_encode too). per_token.c. */
typedef struct kvarn_token_writer {
    kvarn_format fmt;
    int D;
    int bits;
    int fp8;
    int avx512;
    kvarn_record_layout L;
} kvarn_token_writer;
void kvarn__token_writer_init(kvarn_token_writer *w, const kvarn_format *fmt, int D);
kvarn_status kvarn__token_writer_encode(const kvarn_token_writer *w, const float *k, const float *v,
                                        void *rec, size_t rb);

#endif
