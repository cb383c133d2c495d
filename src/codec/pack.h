/*
 * pack.h -- bit packing of unsigned quantization codes, shared by the KVarN
 * tile codec and the per-token int4 codec.
 *
 * Layout (../shared/spec/KVARN.md "Store pipeline" step 5; record.h):
 * a row of n codes of `bits` bits (bits in {2, 4, 8}) is stored in
 * ceil(n * bits / 8) bytes; with per = 8 / bits codes per byte,
 *     code i lives in byte i / per, at bit offset (i % per) * bits,
 * low bits first. So for 4 bits the even index is the low nibble
 * (codes 0,1 -> byte 0x10), for 2 bits codes 0,1,2,3 -> byte 0xE4
 * (0 | 1<<2 | 2<<4 | 3<<6 = 228), and 8 bits is the identity.
 * A partial last byte (n not a multiple of per) has its unused high bits 0.
 * Rows are packed independently: a KVarN record's K codes are D rows of G
 * codes and its V codes G rows of D codes, each row starting on a byte.
 */
#ifndef KVARN_CODEC_PACK_H
#define KVARN_CODEC_PACK_H

#include <stddef.h>
#include <stdint.h>

#include "kvarn/kvarn.h"

/* Bytes that hold n codes of `bits` bits: ceil(n * bits / 8). */
static inline size_t kvarn_packed_bytes(size_t n, int bits)
{
    return (n * (size_t)bits + 7) / 8;
}

/* Code i of a packed row (no bounds check; bits in {2, 4, 8}). */
static inline unsigned kvarn_packed_code_at(const uint8_t *packed, size_t i, int bits)
{
    const unsigned per = 8u / (unsigned)bits;
    const unsigned shift = (unsigned)(i % per) * (unsigned)bits;
    return (packed[i / per] >> shift) & ((1u << bits) - 1u);
}

/* Pack n codes (uint8 [n], one code per byte) into
 * out[kvarn_packed_bytes(n, bits)]. Only the low `bits` bits of each code are
 * kept (codes are expected in [0, 2^bits - 1]). codes and out must not
 * overlap. Errors: KVARN_ERR_INVALID_ARG for NULL pointers or bits not in
 * {2, 4, 8} (out untouched). */
kvarn_status kvarn_pack_codes(const uint8_t *codes, size_t n, int bits, uint8_t *out);

/* Unpack n codes of a packed row into codes (uint8 [n], values in
 * [0, 2^bits - 1]). packed and codes must not overlap.
 * Errors: KVARN_ERR_INVALID_ARG as for kvarn_pack_codes. */
kvarn_status kvarn_unpack_codes(const uint8_t *packed, size_t n, int bits, uint8_t *codes);

#endif /* KVARN_CODEC_PACK_H */
