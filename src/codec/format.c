/*
 * format.c -- the table of cache formats (the named presets, in ladder
 * order): parsing a name, head_dim checks, record layouts, record sizes and
 * capacity. What differs between format kinds is read from the kind's row
 * (format_kinds.h); nothing here switches on the kind.
 * Source: ../shared/spec/KVARN.md (presets, record layout), docs/formats.md.
 */
#include <stdio.h>
#include <string.h>

#include "codec/format_kinds.h"
#include "common/checked.h"
#include "kvarn/kvarn.h"
#include "kvarn/record.h"

/* A named format: its kind and, for kinds whose geometry comes from the
 * name (KVarN), G and the bit widths; 0 means the kind's fixed value
 * (format_kinds.c). */
typedef struct format_row {
    const char *name;
    const char *alias;
    kvarn_kind kind;
    int tile_tokens, key_bits, value_bits;
} format_row;

/* Ladder order: unquantized first, then fp8 -> int8 -> int4 -> KVarN. */
static const format_row k_rows[] = {
    {"fp16", "auto", KVARN_KIND_FP16, 0, 0, 0},
    {"bf16", NULL, KVARN_KIND_BF16, 0, 0, 0},
    {"fp8_e4m3", "fp8", KVARN_KIND_FP8_E4M3, 0, 0, 0},
    {"fp8_e5m2", NULL, KVARN_KIND_FP8_E5M2, 0, 0, 0},
    {"int8", NULL, KVARN_KIND_INT8, 0, 0, 0},
    {"int4", NULL, KVARN_KIND_INT4, 0, 0, 0},
    {"kvarn_k4v4_g128", NULL, KVARN_KIND_KVARN, 128, 4, 4},
    {"kvarn_k4v4_g64", NULL, KVARN_KIND_KVARN, 64, 4, 4},
    {"kvarn_k4v2_g128", NULL, KVARN_KIND_KVARN, 128, 4, 2},
    {"kvarn_k4v2_g64", NULL, KVARN_KIND_KVARN, 64, 4, 2},
};

#define N_ROWS ((int)(sizeof k_rows / sizeof k_rows[0]))

static const char k_accepted[] =
    "fp16 (alias auto), bf16, fp8_e4m3 (alias fp8), fp8_e5m2, int8, int4, "
    "kvarn_k4v2_g128 (default KVarN preset), kvarn_k4v2_g64, kvarn_k4v4_g128, "
    "kvarn_k4v4_g64, or kvarn_k{2,4,8}v{2,4,8}_g{32,64,128}, each KVarN name "
    "optionally followed by c (mean-centred values, e.g. kvarn_k4v2_g128c)";

const char *kvarn_strerror(kvarn_status status)
{
    switch (status) {
    case KVARN_OK: return "ok";
    case KVARN_ERR_INVALID_ARG: return "invalid argument";
    case KVARN_ERR_UNKNOWN_FORMAT: return "unknown cache format";
    case KVARN_ERR_UNSUPPORTED_HEAD_DIM: return "unsupported head_dim for this format";
    case KVARN_ERR_NONFINITE: return "non-finite (NaN or Inf) input";
    case KVARN_ERR_BUFFER_TOO_SMALL: return "buffer too small";
    case KVARN_ERR_OUT_OF_BLOCKS: return "block pool exhausted";
    case KVARN_ERR_NOMEM: return "out of memory";
    case KVARN_ERR_IO: return "I/O error";
    case KVARN_ERR_BAD_FILE: return "malformed or truncated file";
    case KVARN_ERR_UNSUPPORTED: return "not supported";
    case KVARN_ERR_STATE: return "invalid state for this call";
    case KVARN_ERR_NO_DEVICE: return "no usable GPU";
    case KVARN_ERR_TOO_LARGE: return "too large (beyond the library's size limits)";
    case KVARN_ERR_TRUNCATED: return "truncated stream";
    case KVARN_ERR_BAD_VERSION: return "unknown layout version";
    case KVARN_ERR_CHECKSUM: return "checksum mismatch";
    case KVARN_ERR_MISMATCH: return "saved for a cache of other settings";
    }
    return "unknown status";
}

const char *kvarn_format_accepted_names(void) { return k_accepted; }

int kvarn_format_count(void) { return N_ROWS; }

const char *kvarn_format_name_at(int i)
{
    return (i >= 0 && i < N_ROWS) ? k_rows[i].name : NULL;
}

kvarn_status kvarn_format_parse(const char *name, kvarn_format *out)
{
    if (name == NULL || out == NULL) return KVARN_ERR_INVALID_ARG;
    for (int i = 0; i < N_ROWS; i++) {
        const format_row *r = &k_rows[i];
        if (strcmp(name, r->name) == 0 || (r->alias && strcmp(name, r->alias) == 0)) {
            kvarn_format f;
            memset(&f, 0, sizeof f);
            const kvarn_kind_ops *op = kvarn__kind_ops(r->kind);
            f.kind = r->kind;
            snprintf(f.name, sizeof f.name, "%s", r->name);
            f.tile_tokens = r->tile_tokens ? r->tile_tokens : op->tile_tokens;
            f.key_bits = r->key_bits ? r->key_bits : op->key_bits;
            f.value_bits = r->value_bits ? r->value_bits : op->value_bits;
            f.per_tile = op->per_tile;
            *out = f;
            return KVARN_OK;
        }
    }
    /* Name patterns beyond the presets (kvarn_k{kb}v{vb}_g{G}). */
    for (int k = 0; k < KVARN_KIND_COUNT; k++) {
        const kvarn_kind_ops *op = kvarn__kind_ops((kvarn_kind)k);
        kvarn_format f;
        if (op->parse_name && op->parse_name(name, &f)) {
            *out = f;
            return KVARN_OK;
        }
    }
    return KVARN_ERR_UNKNOWN_FORMAT;
}

kvarn_status kvarn_format_check_head_dim(const kvarn_format *fmt, int head_dim)
{
    if (!kvarn__format_valid(fmt)) return KVARN_ERR_INVALID_ARG;
    const kvarn_kind_ops *op = kvarn__kind_ops(fmt->kind);
    int ok = head_dim >= op->min_head_dim && head_dim <= op->max_head_dim &&
             head_dim % op->head_dim_step == 0 &&
             (!op->pow2_head_dim || (head_dim & (head_dim - 1)) == 0);
    return ok ? KVARN_OK : KVARN_ERR_UNSUPPORTED_HEAD_DIM;
}

char *kvarn_format_explain(kvarn_status status, const char *name, int head_dim,
                           char *buf, size_t len)
{
    if (buf == NULL || len == 0) return buf;
    const char *n = name ? name : "(null)";
    switch (status) {
    case KVARN_ERR_UNKNOWN_FORMAT:
        snprintf(buf, len, "unknown cache format '%s'; accepted: %s", n, k_accepted);
        break;
    case KVARN_ERR_UNSUPPORTED_HEAD_DIM:
        snprintf(buf, len,
                 "cache format '%s' cannot serve head_dim %d; KVarN formats serve "
                 "head_dim 64, 128, 256 or 512, the other formats any even head_dim "
                 "from 2 to 1024",
                 n, head_dim);
        break;
    default:
        snprintf(buf, len, "cache format '%s': %s", n, kvarn_strerror(status));
        break;
    }
    return buf;
}

/* Bytes of a metadata field (format_kinds.h): fp16 values. */
static size_t meta_bytes(unsigned char count, size_t D, size_t G)
{
    switch ((kvarn_meta_count)count) {
    case KVARN_META_ONE: return 2;
    case KVARN_META_PER_CHANNEL: return 2 * D;
    case KVARN_META_PER_TOKEN: return 2 * G;
    case KVARN_META_NONE: break;
    }
    return 0;
}

kvarn_status kvarn_record_layout_get(const kvarn_format *fmt, int head_dim,
                                     kvarn_record_layout *out)
{
    if (out == NULL) return KVARN_ERR_INVALID_ARG;
    kvarn_status st = kvarn_format_check_head_dim(fmt, head_dim);
    if (st != KVARN_OK) return st;

    const kvarn_kind_ops *op = kvarn__kind_ops(fmt->kind);
    const size_t D = (size_t)head_dim, G = (size_t)fmt->tile_tokens;
    kvarn_record_layout L;
    memset(&L, 0, sizeof L);
    L.head_dim = head_dim;
    L.tile_tokens = fmt->tile_tokens;
    L.key_bits = fmt->key_bits;
    L.value_bits = fmt->value_bits;

    const kvarn_kind_meta *m = &op->meta;
    const size_t ka = meta_bytes(m->k_a, D, G), kb = meta_bytes(m->k_b, D, G);
    const size_t kst = meta_bytes(m->k_stok, D, G), vsc = meta_bytes(m->v_schan, D, G);
    const size_t va = meta_bytes(m->v_a, D, G), vb = meta_bytes(m->v_b, D, G);
    const size_t vmu = fmt->centred ? meta_bytes(m->v_mu, D, G) : 0;
    size_t off = 0;
    L.k_codes_off = off; L.k_codes_bytes = D * G * (size_t)fmt->key_bits / 8; off += L.k_codes_bytes;
    L.k_a_off = off; L.k_a_bytes = ka; off += ka;
    L.k_b_off = off; L.k_b_bytes = kb; off += kb;
    L.k_stok_off = off; L.k_stok_bytes = kst; off += kst;
    L.v_codes_off = off; L.v_codes_bytes = D * G * (size_t)fmt->value_bits / 8; off += L.v_codes_bytes;
    L.v_schan_off = off; L.v_schan_bytes = vsc; off += vsc;
    L.v_a_off = off; L.v_a_bytes = va; off += va;
    L.v_b_off = off; L.v_b_bytes = vb; off += vb;
    L.v_mu_off = off; L.v_mu_bytes = vmu; off += vmu;
    L.payload_bytes = off;
    L.record_bytes = op->record_bytes ? op->record_bytes(off, D, G) : off;
    *out = L;
    return KVARN_OK;
}

size_t kvarn_record_bytes(const kvarn_format *fmt, int head_dim)
{
    kvarn_record_layout L;
    return kvarn_record_layout_get(fmt, head_dim, &L) == KVARN_OK ? L.record_bytes : 0;
}

double kvarn_bytes_per_token_head(const kvarn_format *fmt, int head_dim)
{
    size_t r = kvarn_record_bytes(fmt, head_dim);
    return r ? (double)r / (double)fmt->tile_tokens : 0.0;
}

uint64_t kvarn_capacity_tokens(const kvarn_format *fmt, int head_dim,
                               int n_layers, int n_kv_heads,
                               uint64_t budget_bytes)
{
    size_t r = kvarn_record_bytes(fmt, head_dim);
    if (r == 0 || n_layers <= 0 || n_kv_heads <= 0) return 0;
    /* A tile of every layer and head beyond 64 bits is beyond any budget
     * (it used to wrap, to 0 for some shapes: a division by zero). */
    uint64_t per_tile, tiles, tokens;
    if (kvarn__mul3_u64((uint64_t)r, (uint64_t)n_layers, (uint64_t)n_kv_heads, &per_tile))
        return 0;
    tiles = budget_bytes / per_tile;
    return kvarn__mul_u64(tiles, (uint64_t)fmt->tile_tokens, &tokens) ? UINT64_MAX : tokens;
}
