/*
 * record.h -- the byte layout of every record, written down once.
 *
 * A record holds the K and V of one tile (G tokens of one KV head). The CPU
 * codec, the CPU attention kernels, the CUDA kernels and any plug-in read the
 * bytes through this struct, never through their own offset arithmetic.
 *
 * KVarN record (../shared/spec/KVARN.md "Record layout"), in this order:
 *   K codes     D rows (channels) x G codes, kb bits each    D*G*kb/8 bytes
 *   K a_d       fp16 [D]   per-channel scale (RTN scale folded)   2D
 *   K b_d       fp16 [D]   per-channel offset (RTN min folded)    2D
 *   K s_tok_t   fp16 [G]   per-token balance scale                2G
 *   V codes     G rows (tokens) x D codes, vb bits each      G*D*vb/8
 *   V s_chan_d  fp16 [D]   per-channel balance scale              2D
 *   V a_t       fp16 [G]   per-token scale                        2G
 *   V b_t       fp16 [G]   per-token offset                       2G
 *   V mu_d      fp16 [D]   per-channel mean of the rotated V tile 2D
 *               (mean-centred formats only, kvarn_format.centred; else
 *               absent, 0 bytes: the spec's record)
 *   padding to a multiple of 8 bytes; for D >= 256 the record is padded so
 *   that record_bytes / G is a power of two (upstream's page-size rule).
 * Dequantized:  K[d,t] = (code*a_d + b_d) * s_tok_t
 *               V[t,d] = (code*a_t + b_t) * s_chan_d (+ mu_d if centred)
 *                                                         (rotated basis)
 * Codes in a row: code i in byte i/(8/bits) at bit (i mod (8/bits))*bits,
 * low bits first (4-bit: even index = low nibble).
 *
 * Per-token records (G = 1; one token of one KV head), in this order:
 *   fp16, bf16  K[D] u16, V[D] u16                                4D bytes
 *   fp8_*       K codes u8[D], K scale fp16, V codes u8[D], V scale fp16
 *               x = fp8(code) * scale                           2D + 4
 *   int8        K codes u8[D], K scale fp16, K zero fp16, V same   2D + 8
 *   int4        K codes (D/2 bytes, packed as above), K scale, K zero,
 *               V same                                          D + 8
 *               x = code * scale + zero  (zero = the row's minimum)
 * A paged block of G tokens of a per-token format stores G token records
 * back to back (see include/kvarn/cache.h).
 */
#ifndef KVARN_RECORD_H
#define KVARN_RECORD_H

#include <stddef.h>
#include "kvarn/kvarn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Byte offsets inside one record. For per-token formats the *_a (scale) and
 * *_b (zero) fields are single fp16 values (b absent for fp8: size 0) and
 * k_stok / v_schan / v_b... follow the table above; unused fields have
 * size 0 and offset equal to the next field's. */
typedef struct kvarn_record_layout {
    int head_dim;          /* D */
    int tile_tokens;       /* G */
    int key_bits, value_bits;
    size_t k_codes_off, k_codes_bytes;
    size_t k_a_off, k_a_bytes;       /* KVarN: a_d [D]; per-token: K scale */
    size_t k_b_off, k_b_bytes;       /* KVarN: b_d [D]; per-token: K zero  */
    size_t k_stok_off, k_stok_bytes; /* KVarN: s_tok_t [G]; else 0 bytes   */
    size_t v_codes_off, v_codes_bytes;
    size_t v_schan_off, v_schan_bytes; /* KVarN: s_chan_d [D]; else 0      */
    size_t v_a_off, v_a_bytes;       /* KVarN: a_t [G]; per-token: V scale */
    size_t v_b_off, v_b_bytes;       /* KVarN: b_t [G]; per-token: V zero  */
    size_t v_mu_off, v_mu_bytes;     /* centred KVarN: mu_d [D]; else 0    */
    size_t payload_bytes;            /* sum of the fields, before padding  */
    size_t record_bytes;             /* with padding                       */
} kvarn_record_layout;

/* Fill *out with the layout of fmt's record for head_dim D.
 * Errors: KVARN_ERR_INVALID_ARG (NULL), KVARN_ERR_UNSUPPORTED_HEAD_DIM. */
kvarn_status kvarn_record_layout_get(const kvarn_format *fmt, int head_dim,
                                     kvarn_record_layout *out);

#ifdef __cplusplus
}
#endif

#endif /* KVARN_RECORD_H */
