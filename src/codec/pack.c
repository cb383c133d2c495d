/*
 * pack.c -- bit packing of 2-, 4- and 8-bit codes, low bits first (layout in
 * pack.h; ../shared/spec/KVARN.md step 5). Loops are written per width with
 * whole bytes in the inner loop so the compiler can vectorize them.
 */
#include <string.h>

#include "codec/pack.h"

static int valid_bits(int bits) { return bits == 2 || bits == 4 || bits == 8; }

kvarn_status kvarn_pack_codes(const uint8_t *codes, size_t n, int bits, uint8_t *out)
{
    if (codes == NULL || out == NULL || !valid_bits(bits)) return KVARN_ERR_INVALID_ARG;
    size_t i = 0, o = 0;
    switch (bits) {
    case 8:
        memcpy(out, codes, n);
        return KVARN_OK;
    case 4:
        for (; i + 2 <= n; i += 2, o++)
            out[o] = (uint8_t)((codes[i] & 0xFu) | (unsigned)(codes[i + 1] & 0xFu) << 4);
        break;
    default: /* 2 */
        for (; i + 4 <= n; i += 4, o++)
            out[o] = (uint8_t)((codes[i] & 3u) | (unsigned)(codes[i + 1] & 3u) << 2 |
                               (unsigned)(codes[i + 2] & 3u) << 4 |
                               (unsigned)(codes[i + 3] & 3u) << 6);
        break;
    }
    if (i < n) { /* partial last byte: unused high bits stay 0 */
        unsigned byte = 0, mask = (1u << bits) - 1u;
        for (unsigned shift = 0; i < n; i++, shift += (unsigned)bits)
            byte |= (codes[i] & mask) << shift;
        out[o] = (uint8_t)byte;
    }
    return KVARN_OK;
}

kvarn_status kvarn_unpack_codes(const uint8_t *packed, size_t n, int bits, uint8_t *codes)
{
    if (packed == NULL || codes == NULL || !valid_bits(bits)) return KVARN_ERR_INVALID_ARG;
    size_t i = 0, o = 0;
    switch (bits) {
    case 8:
        memcpy(codes, packed, n);
        return KVARN_OK;
    case 4:
        for (; i + 2 <= n; i += 2, o++) {
            codes[i] = packed[o] & 0xFu;
            codes[i + 1] = packed[o] >> 4;
        }
        break;
    default: /* 2 */
        for (; i + 4 <= n; i += 4, o++) {
            codes[i] = packed[o] & 3u;
            codes[i + 1] = (packed[o] >> 2) & 3u;
            codes[i + 2] = (packed[o] >> 4) & 3u;
            codes[i + 3] = packed[o] >> 6;
        }
        break;
    }
    for (unsigned shift = 0; i < n; i++, shift += (unsigned)bits)
        codes[i] = (uint8_t)((packed[o] >> shift) & ((1u << bits) - 1u));
    return KVARN_OK;
}
