/*
 * mla_record.c -- MLA records (include/kvarn/mla.h): the format names, the
 * byte layout, encode and decode of one tile of latent + rope rows.
 *
 * The latent part is a KVarN K tile (../shared/spec/KVARN.md "Store
 * pipeline", the latent's D channels as the tile's rows): it is encoded and
 * decoded by the tile codec itself (kvarn__tile_encode with no V,
 * kvarn__tile_decode, src/codec/kvarn_tile.c), through a
 * kvarn_record_layout holding only K fields. The int8 rope part is the
 * per-token RTN of the int8 cache format (kvarn__rtn_row_encode,
 * src/codec/per_token.c). Layout and choices: docs/mla.md.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "codec/codec_internal.h"
#include "codec/fp_convert.h"
#include "codec/mla_internal.h"
#include "codec/pack.h"

/* ---------------------------------------------------------------------- */
/* Names                                                                   */
/* ---------------------------------------------------------------------- */

static int good_format(const kvarn_mla_format *f)
{
    return (f->latent_bits == 2 || f->latent_bits == 4 || f->latent_bits == 8) &&
           (f->tile_tokens == 64 || f->tile_tokens == 128) &&
           (f->rope_bits == 8 || f->rope_bits == 16);
}

/* Read a decimal number of at most 3 digits at *p, without a leading zero
 * (one spelling per format, as kvarn_format_parse's strict names); -1 if
 * none. */
static int read_num(const char **p)
{
    int n = 0, k = 0;
    if (**p == '0') return -1;
    while (**p >= '0' && **p <= '9' && k < 4) {
        n = 10 * n + (**p - '0');
        (*p)++;
        k++;
    }
    return k == 0 || k > 3 ? -1 : n;
}

kvarn_status kvarn_mla_format_parse(const char *name, kvarn_mla_format *out)
{
    if (name == NULL || out == NULL) return KVARN_ERR_INVALID_ARG;
    static const char prefix[] = "kvarn_mla_k";
    if (strncmp(name, prefix, sizeof prefix - 1) != 0) return KVARN_ERR_UNKNOWN_FORMAT;
    const char *p = name + sizeof prefix - 1;
    kvarn_mla_format f;
    f.latent_bits = read_num(&p);
    f.rope_bits = KVARN_MLA_DEFAULT_ROPE_BITS;
    if (*p == 'r') {
        p++;
        f.rope_bits = read_num(&p);
    }
    if (p[0] != '_' || p[1] != 'g') return KVARN_ERR_UNKNOWN_FORMAT;
    p += 2;
    f.tile_tokens = read_num(&p);
    if (*p != '\0' || !good_format(&f)) return KVARN_ERR_UNKNOWN_FORMAT;
    *out = f;
    return KVARN_OK;
}

static const char k_accepted[] =
    "kvarn_mla_k{2,4,8}[r{8,16}]_g{64,128} (e.g. kvarn_mla_k4_g128, rope at 8 bits; "
    "kvarn_mla_k4r16_g128)";

char *kvarn_mla_format_explain(kvarn_status status, const char *name, int latent_dim,
                               int rope_dim, char *buf, size_t len)
{
    if (buf == NULL || len == 0) return NULL;
    switch (status) {
    case KVARN_OK:
        snprintf(buf, len, "ok");
        break;
    case KVARN_ERR_UNKNOWN_FORMAT:
        snprintf(buf, len, "unknown MLA cache format '%s'; accepted: %s", name ? name : "(null)",
                 k_accepted);
        break;
    case KVARN_ERR_UNSUPPORTED_HEAD_DIM:
        snprintf(buf, len,
                 "MLA format %s does not serve latent_dim %d / rope_dim %d: latent_dim must be a "
                 "power of two in 64..512 (the KVarN tile codec's range), rope_dim a multiple of "
                 "16 in 0..128",
                 name ? name : "", latent_dim, rope_dim);
        break;
    case KVARN_ERR_INVALID_ARG:
        snprintf(buf, len,
                 "malformed MLA format: latent_bits must be 2, 4 or 8, tile_tokens 64 or 128, "
                 "rope_bits 8 or 16 (%s)",
                 k_accepted);
        break;
    default:
        snprintf(buf, len, "%s", kvarn_strerror(status));
        break;
    }
    return buf;
}

/* ---------------------------------------------------------------------- */
/* Layout and sizes                                                        */
/* ---------------------------------------------------------------------- */

kvarn_status kvarn_mla_check_dims(const kvarn_mla_format *fmt, int latent_dim, int rope_dim)
{
    if (fmt == NULL || !good_format(fmt)) return KVARN_ERR_INVALID_ARG;
    if (latent_dim < 64 || latent_dim > 512 || (latent_dim & (latent_dim - 1)) != 0)
        return KVARN_ERR_UNSUPPORTED_HEAD_DIM;
    if (rope_dim < 0 || rope_dim > 128 || rope_dim % 16 != 0) return KVARN_ERR_UNSUPPORTED_HEAD_DIM;
    return KVARN_OK;
}

kvarn_status kvarn__mla_layout(const kvarn_mla_format *fmt, int latent_dim, int rope_dim,
                               kvarn_mla_layout *L)
{
    kvarn_status st = kvarn_mla_check_dims(fmt, latent_dim, rope_dim);
    if (st != KVARN_OK) return st;
    const size_t D = (size_t)latent_dim, R = (size_t)rope_dim, G = (size_t)fmt->tile_tokens;
    memset(L, 0, sizeof *L);
    L->latent_dim = latent_dim;
    L->rope_dim = rope_dim;
    L->tile_tokens = fmt->tile_tokens;
    L->latent_bits = fmt->latent_bits;
    L->rope_bits = fmt->rope_bits;
    kvarn_record_layout *k = &L->lat;
    k->head_dim = latent_dim;
    k->tile_tokens = fmt->tile_tokens;
    k->key_bits = fmt->latent_bits;
    k->value_bits = 0;
    size_t off = 0;
    k->k_codes_off = off; k->k_codes_bytes = kvarn_packed_bytes(G, fmt->latent_bits) * D; off += k->k_codes_bytes;
    k->k_a_off = off; k->k_a_bytes = 2 * D; off += 2 * D;
    k->k_b_off = off; k->k_b_bytes = 2 * D; off += 2 * D;
    k->k_stok_off = off; k->k_stok_bytes = 2 * G; off += 2 * G;
    /* no V fields: zero sizes at the end of the latent part */
    k->v_codes_off = k->v_schan_off = k->v_a_off = k->v_b_off = k->v_mu_off = off;
    k->payload_bytes = k->record_bytes = off; /* a multiple of 8: D, G >= 64 */
    L->rope_off = off;
    if (fmt->rope_bits == 16) {
        off += 2 * G * R;
        L->rope_scale_off = L->rope_zero_off = off;
    } else {
        off += G * R;
        L->rope_scale_off = off;
        off += R ? 2 * G : 0;
        L->rope_zero_off = off;
        off += R ? 2 * G : 0;
    }
    L->payload_bytes = off;
    L->record_bytes = (off + 7) & ~(size_t)7;
    return KVARN_OK;
}

size_t kvarn_mla_record_bytes(const kvarn_mla_format *fmt, int latent_dim, int rope_dim)
{
    kvarn_mla_layout L;
    return kvarn__mla_layout(fmt, latent_dim, rope_dim, &L) == KVARN_OK ? L.record_bytes : 0;
}

/* Encode scratch: the tile codec's, then the staged rope part. */
static size_t encode_ws_bytes(const kvarn_mla_layout *L)
{
    return kvarn__mla_round64(kvarn__tile_workspace_bytes(L->latent_dim, L->tile_tokens)) +
           (L->record_bytes - L->rope_off);
}

size_t kvarn_mla_workspace_bytes(const kvarn_mla_format *fmt, int latent_dim, int rope_dim,
                                 int n_rows, int n_heads)
{
    kvarn_mla_layout L;
    if (kvarn__mla_layout(fmt, latent_dim, rope_dim, &L) != KVARN_OK) return 0;
    if (n_rows < 0 || n_heads < 0) return 0;
    if (n_heads > 0 && n_rows > KVARN_MLA_MAX_QROWS / n_heads) return 0;
    const size_t enc = encode_ws_bytes(&L);
    const size_t att = kvarn__mla_attn_ws_carve(latent_dim, rope_dim, L.tile_tokens, n_rows * n_heads,
                                                NULL, NULL);
    return enc > att ? enc : att;
}

/* ---------------------------------------------------------------------- */
/* Encode / decode                                                         */
/* ---------------------------------------------------------------------- */

static void store_u16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }

static uint16_t load_u16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* The rope part of the record (from rope_off to the padded end) into dst;
 * KVARN_ERR_NONFINITE if a value is NaN/Inf or beyond fp16. */
static kvarn_status encode_rope(const kvarn_mla_layout *L, const float *rope, uint8_t *dst)
{
    const size_t R = (size_t)L->rope_dim, G = (size_t)L->tile_tokens;
    const size_t base = L->rope_off;
    memset(dst, 0, L->record_bytes - base);
    if (R == 0) return KVARN_OK;
    for (size_t i = 0; i < G * R; i++)
        if (!isfinite(rope[i])) return KVARN_ERR_NONFINITE;
    if (L->rope_bits == 16) {
        for (size_t i = 0; i < G * R; i++) {
            const uint16_t h = kvarn_fp32_to_fp16(rope[i]);
            if ((h & 0x7c00u) == 0x7c00u) return KVARN_ERR_NONFINITE; /* |x| >= 65520 */
            store_u16(dst + 2 * i, h);
        }
        return KVARN_OK;
    }
    for (size_t t = 0; t < G; t++) {
        uint16_t s, z;
        kvarn_status st = kvarn__rtn_row_encode(rope + t * R, (int)R, 8, dst + t * R, &s, &z);
        if (st != KVARN_OK) return st;
        store_u16(dst + (L->rope_scale_off - base) + 2 * t, s);
        store_u16(dst + (L->rope_zero_off - base) + 2 * t, z);
    }
    return KVARN_OK;
}

kvarn_status kvarn_mla_encode(const kvarn_mla_format *fmt, int latent_dim, int rope_dim,
                              const float *latent, const float *rope, void *workspace,
                              uint8_t *record)
{
    kvarn_mla_layout L;
    kvarn_status st = kvarn__mla_layout(fmt, latent_dim, rope_dim, &L);
    if (st != KVARN_OK) return st;
    if (latent == NULL || workspace == NULL || record == NULL || (rope_dim > 0 && rope == NULL))
        return KVARN_ERR_INVALID_ARG;
    /* The rope part is staged first (all its checks done), then the tile
     * codec writes the latent part only once it has succeeded, then the
     * staged rope is copied: on any error the record is untouched. */
    uint8_t *stage = (uint8_t *)workspace +
                     kvarn__mla_round64(kvarn__tile_workspace_bytes(latent_dim, L.tile_tokens));
    st = encode_rope(&L, rope, stage);
    if (st != KVARN_OK) return st;
    st = kvarn__tile_encode(&L.lat, latent, NULL, record, workspace, NULL);
    if (st != KVARN_OK) return st;
    memcpy(record + L.rope_off, stage, L.record_bytes - L.rope_off);
    return KVARN_OK;
}

static void decode_rope(const kvarn_mla_layout *L, const uint8_t *record, float *rope)
{
    const size_t R = (size_t)L->rope_dim, G = (size_t)L->tile_tokens;
    if (R == 0) return;
    const uint8_t *src = record + L->rope_off;
    if (L->rope_bits == 16) {
        for (size_t i = 0; i < G * R; i++) rope[i] = kvarn_fp16_to_fp32(load_u16(src + 2 * i));
        return;
    }
    for (size_t t = 0; t < G; t++)
        kvarn__rtn_row_decode(src + t * R, (int)R, load_u16(record + L->rope_scale_off + 2 * t),
                              load_u16(record + L->rope_zero_off + 2 * t), rope + t * R);
}

void kvarn__mla_decode_rotated(const kvarn_mla_layout *L, const uint8_t *record, float *lat_rot,
                               float *rope)
{
    if (lat_rot != NULL) (void)kvarn__tile_decode(&L->lat, record, lat_rot, NULL, KVARN_DECODE_ROTATED);
    if (rope != NULL) decode_rope(L, record, rope);
}

kvarn_status kvarn_mla_decode(const kvarn_mla_format *fmt, int latent_dim, int rope_dim,
                              const uint8_t *record, float *latent, float *rope)
{
    kvarn_mla_layout L;
    kvarn_status st = kvarn__mla_layout(fmt, latent_dim, rope_dim, &L);
    if (st != KVARN_OK) return st;
    if (record == NULL) return KVARN_ERR_INVALID_ARG;
    if (latent != NULL) (void)kvarn__tile_decode(&L.lat, record, latent, NULL, 0);
    if (rope != NULL) decode_rope(&L, record, rope);
    return KVARN_OK;
}
