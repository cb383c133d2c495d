/* fuzz_mla.c -- fuzz target for the MLA format-name parser and for MLA
 * records of hostile bytes (include/kvarn/mla.h).
 *
 * Input layout (any bytes are valid input):
 *   name bytes, then optionally 0x00 followed by
 *   latent_dim 2 bytes, little-endian int16 (odd, negative, huge allowed)
 *   rope_dim   2 bytes, little-endian int16
 *   flags      1 byte: bit 1 encode raw float bits from the input (NaN,
 *              Inf, huge), otherwise finite pseudo-random floats; bits 2-3
 *              the tail length of the attention call (0..3)
 *   rest       seeds the record bytes and the floats
 * Without a 0x00 the whole input is the name, dims 512 and 64.
 *
 * Checked on every input: a rejected name leaves *out untouched; an
 * accepted one has a record size exactly when its dims are served, and
 * unserved dims are refused by encode; for served dims, decoding a record
 * of arbitrary bytes (in a buffer of exactly the record size, so ASan sees
 * any overrun) succeeds and writes only G x D and G x R floats; encoding
 * returns OK or NONFINITE and on NONFINITE leaves the record untouched;
 * attention over a hostile record, the encoded one and a short tail
 * returns OK and writes only its output.
 *
 * kvarn_fuzz_mla returns 0, or a negative number naming the broken
 * invariant. Built by tests/fuzz/test_fuzz_mla.c (cmocka, ctest). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvarn/mla.h"

static uint64_t fuzz_mla_mix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int fuzz_mla_records(const kvarn_mla_format *f, int D, int R, unsigned flags,
                            const uint8_t *rest, size_t rest_size)
{
    const int G = f->tile_tokens;
    const size_t rb = kvarn_mla_record_bytes(f, D, R);
    const size_t nl = (size_t)G * D, nr = (size_t)G * R;
    const int n_tail = (int)((flags >> 2) & 3u), NR = 2, NH = 2;
    uint64_t seed = 0x3a1a ^ (uint64_t)rest_size;
    for (size_t i = 0; i < rest_size; i++) seed = seed * 131 + rest[i];
    const float guard = -12345.5f;
    int rc = 0;
    uint8_t *rec = malloc(rb), *rec2 = malloc(rb), *keep = malloc(rb);
    float *lat = malloc((nl + 2) * sizeof(float)), *rope = malloc((nr + 2) * sizeof(float));
    float *q = malloc((size_t)NR * NH * (D + R) * sizeof(float));
    float *out = malloc(((size_t)NR * NH * D + 2) * sizeof(float));
    void *ws = malloc(kvarn_mla_workspace_bytes(f, D, R, NR, NH));
    if (!rec || !rec2 || !keep || !lat || !rope || !q || !out || !ws) goto done; /* OOM: not a bug */

    for (size_t i = 0; i < rb; i++) rec[i] = i < rest_size ? rest[i] : (uint8_t)fuzz_mla_mix(&seed);
    lat[0] = lat[nl + 1] = rope[0] = rope[nr + 1] = guard;
    if (kvarn_mla_decode(f, D, R, rec, lat + 1, rope + 1) != KVARN_OK) { rc = -23; goto done; }
    if (lat[0] != guard || lat[nl + 1] != guard || rope[0] != guard || rope[nr + 1] != guard) { rc = -24; goto done; }

    for (size_t i = 0; i < nl + nr; i++) {
        float *x = i < nl ? &lat[1 + i] : &rope[1 + i - nl];
        const uint64_t r = fuzz_mla_mix(&seed);
        if (flags & 2u) {
            const uint32_t a = (uint32_t)r;
            memcpy(x, &a, 4);
        } else {
            *x = (float)((int32_t)(r & 0xffff) - 32768) * (1.0f / 4096.0f);
        }
    }
    memset(rec2, 0xcc, rb);
    memcpy(keep, rec2, rb);
    kvarn_status st = kvarn_mla_encode(f, D, R, lat + 1, rope + 1, ws, rec2);
    if (st != KVARN_OK && st != KVARN_ERR_NONFINITE) { rc = -25; goto done; }
    if (st == KVARN_ERR_NONFINITE && memcmp(rec2, keep, rb) != 0) { rc = -26; goto done; }

    /* attention: the hostile record, the encoded one (or the hostile one
     * again), a tail of finite rows; hostile fp16 fields may make the
     * output NaN, but the call must succeed and stay in its buffers */
    const uint8_t *recs[2] = {rec, st == KVARN_OK ? rec2 : rec};
    for (size_t i = 0; i < (size_t)n_tail * (D + R); i++) /* reuse lat as tail rows */
        lat[1 + i] = (float)((int32_t)(fuzz_mla_mix(&seed) & 0xff) - 128) * (1.0f / 64.0f);
    for (size_t i = 0; i < (size_t)NR * NH * (D + R); i++)
        q[i] = (float)((int32_t)(fuzz_mla_mix(&seed) & 0xff) - 128) * (1.0f / 64.0f);
    const int total = 2 * G + n_tail;
    int row_len[2] = {1 + (int)(fuzz_mla_mix(&seed) % (uint64_t)total), total};
    const size_t no = (size_t)NR * NH * D;
    out[0] = out[no + 1] = guard;
    st = kvarn_mla_attn(f, D, R, recs, 2, lat + 1, lat + 1 + (size_t)n_tail * D, n_tail, q,
                        q + (size_t)NR * NH * D, NR, NH, row_len, 0.1f, out + 1, NULL, ws);
    if (st != KVARN_OK) { rc = -27; goto done; }
    if (out[0] != guard || out[no + 1] != guard) { rc = -28; goto done; }
done:
    free(rec), free(rec2), free(keep), free(lat), free(rope), free(q), free(out), free(ws);
    return rc;
}

int kvarn_fuzz_mla(const uint8_t *data, size_t size)
{
    size_t name_len = 0;
    while (name_len < size && data[name_len] != 0) name_len++;
    int D = 512, R = 64;
    unsigned flags = 0;
    const uint8_t *rest = NULL;
    size_t rest_size = 0;
    if (name_len < size) {
        const uint8_t *p = data + name_len + 1;
        const size_t left = size - name_len - 1;
        if (left >= 2) D = (int16_t)(uint16_t)(p[0] | (p[1] << 8));
        if (left >= 4) R = (int16_t)(uint16_t)(p[2] | (p[3] << 8));
        if (left >= 5) flags = p[4];
        if (left > 5) rest = p + 5, rest_size = left - 5;
    }
    char *name = malloc(name_len + 1);
    if (name == NULL) return 0;
    memcpy(name, data, name_len);
    name[name_len] = '\0';
    kvarn_mla_format f = {-7, -7, -7};
    const kvarn_status st = kvarn_mla_format_parse(name, &f);
    free(name);
    if (st != KVARN_OK) {
        if (st != KVARN_ERR_UNKNOWN_FORMAT) return -20;
        return f.latent_bits == -7 && f.tile_tokens == -7 && f.rope_bits == -7 ? 0 : -21;
    }
    const int served = kvarn_mla_check_dims(&f, D, R) == KVARN_OK;
    if (served != (kvarn_mla_record_bytes(&f, D, R) > 0)) return -22;
    if (!served) {
        float x = 0.0f;
        uint8_t b = 0;
        return kvarn_mla_encode(&f, D, R, &x, &x, &b, &b) == KVARN_ERR_UNSUPPORTED_HEAD_DIM ? 0 : -29;
    }
    return fuzz_mla_records(&f, D, R, flags, rest, rest_size);
}
