/* fuzz_format.c -- fuzz target for the cache-format name parser and for
 * decoding hostile record bytes.
 *
 * Input layout (any bytes are valid input):
 *   name bytes, then optionally 0x00 followed by
 *   head_dim  2 bytes, little-endian int16 (odd, negative, huge all allowed)
 *   flags     1 byte: bit 0 decode with KVARN_DECODE_ROTATED,
 *                     bit 1 encode raw float bits from the input (NaN, Inf,
 *                     huge), otherwise finite pseudo-random floats
 *   rest      seeds the record bytes and the floats
 * Without a 0x00 the whole input is the name and head_dim is 128.
 *
 * Checked on every input: the parser accepts or rejects without touching
 * *out on rejection; an accepted name's canonical name parses back to the same
 * format; for a served head_dim, decoding a record of arbitrary bytes (in a
 * buffer of exactly the record size, so ASan sees any overrun) succeeds,
 * writes only G*D floats per output, and a buffer one byte short is refused;
 * encoding returns OK or NONFINITE and, when OK, decodes.
 *
 * kvarn_fuzz_format returns 0, or a negative number naming the broken
 * invariant. Built by tests/fuzz/test_fuzz_format.c (cmocka, ctest) and, with
 * -DKVARN_LIBFUZZER, as a libFuzzer target (see tests/fuzz/README.md). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvarn/kvarn.h"

static uint64_t fuzz_mix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int fuzz_decode_encode(const kvarn_format *f, int D, unsigned flags,
                              const uint8_t *rest, size_t rest_size)
{
    const size_t rb = kvarn_record_bytes(f, D);
    const size_t n = (size_t)f->tile_tokens * (size_t)D;
    if (rb == 0 || n == 0) return -10;
    uint64_t seed = 0x5eed ^ (uint64_t)rest_size;
    for (size_t i = 0; i < rest_size; i++) seed = seed * 131 + rest[i];

    int rc = 0;
    uint8_t *rec = malloc(rb);
    /* one float of guard on each side to see stray writes */
    float *ko = malloc((n + 2) * sizeof(float)), *vo = malloc((n + 2) * sizeof(float));
    float *k = malloc(n * sizeof(float)), *v = malloc(n * sizeof(float));
    size_t wsb = kvarn_encode_workspace_bytes(f, D);
    void *ws = NULL;
    if (wsb && posix_memalign(&ws, 64, wsb) != 0) ws = NULL;
    if (!rec || !ko || !vo || !k || !v || (wsb && !ws)) { rc = 0; goto out; } /* OOM: not a bug */

    /* hostile record: the input's bytes, then pseudo-random bytes */
    for (size_t i = 0; i < rb; i++)
        rec[i] = i < rest_size ? rest[i] : (uint8_t)fuzz_mix(&seed);
    const float guard = -12345.5f;
    ko[0] = vo[0] = ko[n + 1] = vo[n + 1] = guard;
    unsigned dflags = (flags & 1u) ? KVARN_DECODE_ROTATED : 0u;
    if (kvarn_decode(f, D, rec, rb, ko + 1, vo + 1, dflags) != KVARN_OK) { rc = -11; goto out; }
    if (ko[0] != guard || vo[0] != guard || ko[n + 1] != guard || vo[n + 1] != guard) { rc = -12; goto out; }
    if (kvarn_decode(f, D, rec, rb, NULL, vo + 1, dflags) != KVARN_OK) { rc = -13; goto out; }
    if (kvarn_decode(f, D, rec, rb, ko + 1, NULL, dflags) != KVARN_OK) { rc = -13; goto out; }
    if (kvarn_decode(f, D, rec, rb - 1, ko + 1, vo + 1, dflags) != KVARN_ERR_BUFFER_TOO_SMALL) { rc = -14; goto out; }

    /* encode: raw float bits from the input (may be NaN/Inf) or finite ones */
    for (size_t i = 0; i < n; i++) {
        uint64_t r = fuzz_mix(&seed);
        if (flags & 2u) {
            uint32_t a = (uint32_t)r, b = (uint32_t)(r >> 32);
            memcpy(&k[i], &a, 4);
            memcpy(&v[i], &b, 4);
        } else {
            k[i] = (float)((int32_t)(r & 0xffff) - 32768) * (1.0f / 1024.0f);
            v[i] = (float)((int32_t)((r >> 16) & 0xffff) - 32768) * (1.0f / 4096.0f);
        }
    }
    kvarn_status st = kvarn_encode(f, D, k, v, rec, rb, ws, wsb, NULL);
    if (st != KVARN_OK && st != KVARN_ERR_NONFINITE && st != KVARN_ERR_UNSUPPORTED) { rc = -15; goto out; }
    if (!(flags & 2u) && st == KVARN_ERR_NONFINITE) { rc = -16; goto out; } /* finite, in range */
    if (st == KVARN_OK && kvarn_decode(f, D, rec, rb, ko + 1, vo + 1, dflags) != KVARN_OK) { rc = -17; goto out; }
out:
    free(rec); free(ko); free(vo); free(k); free(v); free(ws);
    return rc;
}

int kvarn_fuzz_format(const uint8_t *data, size_t size);

int kvarn_fuzz_format(const uint8_t *data, size_t size)
{
    const uint8_t *nul = size ? memchr(data, 0, size) : NULL;
    size_t name_len = nul ? (size_t)(nul - data) : size;
    char *name = malloc(name_len + 1);
    if (name == NULL) return 0;
    if (name_len) memcpy(name, data, name_len);
    name[name_len] = '\0';

    int D = 128;
    unsigned flags = 0;
    const uint8_t *rest = data + size;
    size_t rest_size = 0;
    if (nul) {
        const uint8_t *p = nul + 1, *end = data + size;
        if (end - p >= 2) { D = (int16_t)(uint16_t)(p[0] | (p[1] << 8)); p += 2; }
        if (end - p >= 1) flags = *p++;
        rest = p;
        rest_size = (size_t)(end - p);
    }

    int rc = 0;
    kvarn_format f;
    memset(&f, 0x6b, sizeof f);
    kvarn_status st = kvarn_format_parse(name, &f);
    if (st == KVARN_ERR_UNKNOWN_FORMAT) {
        const unsigned char *b = (const unsigned char *)&f;
        for (size_t i = 0; i < sizeof f; i++)
            if (b[i] != 0x6b) { rc = -1; break; } /* out touched on rejection */
        goto out;
    }
    if (st != KVARN_OK) { rc = -2; goto out; }
    /* canonical name: NUL-terminated, parses back to the same row */
    if (memchr(f.name, 0, sizeof f.name) == NULL) { rc = -3; goto out; }
    kvarn_format g;
    if (kvarn_format_parse(f.name, &g) != KVARN_OK || g.kind != f.kind ||
        g.tile_tokens != f.tile_tokens || g.key_bits != f.key_bits ||
        g.value_bits != f.value_bits || strcmp(g.name, f.name) != 0) { rc = -4; goto out; }
    if (f.tile_tokens < 1 || f.tile_tokens > 128) { rc = -5; goto out; }

    st = kvarn_format_check_head_dim(&f, D);
    if (st == KVARN_ERR_UNSUPPORTED_HEAD_DIM) {
        if (kvarn_record_bytes(&f, D) != 0) rc = -6;
        goto out;
    }
    if (st != KVARN_OK) { rc = -7; goto out; }
    rc = fuzz_decode_encode(&f, D, flags, rest, rest_size);
out:
    free(name);
    return rc;
}

#ifdef KVARN_LIBFUZZER
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (kvarn_fuzz_format(data, size) != 0) __builtin_trap();
    return 0;
}
#endif
