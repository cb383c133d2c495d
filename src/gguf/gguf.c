/*
 * gguf.c -- GGUF reader: map the file, validate the header, metadata and
 * tensor infos once, then answer lookups from the validated index.
 *
 * Source: the GGUF format description (ggml docs/gguf.md), versions 2 and 3,
 * summarized in include/kvarn/gguf.h. Every read goes through a bounds-
 * checked cursor; every count is checked against the bytes left before
 * anything is allocated for it, so a hostile header cannot make us allocate
 * more than a small multiple of the file size.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvarn/gguf.h"
#include "common/alloc_internal.h"

#define GGUF_DEFAULT_ALIGNMENT 32u
#define GGUF_MAX_KEY 65535u  /* keys are at most 2^16 - 1 bytes (format) */

typedef struct gguf_kv {
    kvarn_gguf_str key;
    kvarn_gguf_type type;
    const uint8_t *val;        /* scalar value bytes (little-endian) */
    kvarn_gguf_str str;        /* STRING value */
    kvarn_gguf_array arr;      /* ARRAY value */
    kvarn_gguf_str *strs;      /* STRING array elements (owned) */
} gguf_kv;

typedef struct sorted_key {    /* for binary search and duplicate checks */
    const char *ptr;
    uint64_t len;
    uint64_t index;
} sorted_key;

struct kvarn_gguf {
    kvarn_allocator alloc;     /* the handle and its index (alloc.h) */
    const uint8_t *base;
    size_t size;
    int mapped;                /* munmap base on close */
    uint32_t version;
    uint32_t alignment;
    uint64_t data_offset;
    uint64_t n_kv;
    gguf_kv *kv;
    sorted_key *kv_sorted;
    uint64_t n_tensors;
    kvarn_gguf_tensor *tensors;
    sorted_key *tensor_sorted;
};

/* ------------------------------------------------------------------------ */
/* Errors and the bounds-checked cursor                                     */
/* ------------------------------------------------------------------------ */

typedef struct cursor {
    const uint8_t *base;
    size_t size;
    size_t pos;
    char *err;
    size_t errlen;
    const kvarn_allocator *alloc; /* for the index being built */
} cursor;

static kvarn_status fail(cursor *c, kvarn_status st, const char *fmt, ...)
{
    if (c->err && c->errlen > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->err, c->errlen, fmt, ap);
        va_end(ap);
    }
    return st;
}

/* A name from the file (a key, a tensor name) quoted for a one-line
 * message: between single quotes, its first NAME_SHOWN bytes, "..." after
 * the closing quote when there are more; a quote or backslash escaped with
 * a backslash, newline, carriage return and tab as \n \r \t, any other
 * byte outside printable ASCII as \xNN, so that a name can neither split
 * the line nor send terminal escapes. */
#define NAME_SHOWN 64
#define QUOTED_LEN (2 + 4 * NAME_SHOWN + 3 + 1)

static const char *quoted(const char *p, uint64_t len, char buf[QUOTED_LEN])
{
    static const char hex[] = "0123456789abcdef";
    size_t n = len < NAME_SHOWN ? (size_t)len : NAME_SHOWN, o = 0;
    buf[o++] = '\'';
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)p[i];
        if (ch == '\'' || ch == '\\') {
            buf[o++] = '\\';
            buf[o++] = (char)ch;
        } else if (ch == '\n' || ch == '\r' || ch == '\t') {
            buf[o++] = '\\';
            buf[o++] = ch == '\n' ? 'n' : ch == '\r' ? 'r' : 't';
        } else if (ch < 0x20 || ch >= 0x7f) {
            buf[o++] = '\\';
            buf[o++] = 'x';
            buf[o++] = hex[ch >> 4];
            buf[o++] = hex[ch & 15];
        } else {
            buf[o++] = (char)ch;
        }
    }
    buf[o++] = '\'';
    if (len > NAME_SHOWN) {
        memcpy(buf + o, "...", 3);
        o += 3;
    }
    buf[o] = '\0';
    return buf;
}

/* A tensor name (NUL-terminated copy) quoted as above. */
static const char *qname(const char *name, char buf[QUOTED_LEN])
{
    return quoted(name, strlen(name), buf);
}

static size_t left(const cursor *c) { return c->size - c->pos; }

static kvarn_status need(cursor *c, uint64_t n, const char *what)
{
    if (n > left(c))
        return fail(c, KVARN_ERR_BAD_FILE,
                    "the file ends early: %s at byte %zu needs %llu bytes, only %zu left",
                    what, c->pos, (unsigned long long)n, left(c));
    return KVARN_OK;
}

static uint32_t peek_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
}

static uint64_t peek_u64(const uint8_t *p)
{
    return (uint64_t)peek_u32(p) | ((uint64_t)peek_u32(p + 4) << 32);
}

static kvarn_status rd_u32(cursor *c, uint32_t *v, const char *what)
{
    kvarn_status st = need(c, 4, what);
    if (st) return st;
    *v = peek_u32(c->base + c->pos);
    c->pos += 4;
    return KVARN_OK;
}

static kvarn_status rd_u64(cursor *c, uint64_t *v, const char *what)
{
    kvarn_status st = need(c, 8, what);
    if (st) return st;
    *v = peek_u64(c->base + c->pos);
    c->pos += 8;
    return KVARN_OK;
}

static kvarn_status rd_str(cursor *c, kvarn_gguf_str *s, const char *what)
{
    uint64_t len;
    size_t at = c->pos;
    kvarn_status st = rd_u64(c, &len, what);
    if (st) return st;
    if (len > left(c))
        return fail(c, KVARN_ERR_BAD_FILE,
                    "%s at byte %zu: string length %llu runs past the end of the file "
                    "(%zu bytes left)", what, at, (unsigned long long)len, left(c));
    s->ptr = (const char *)(c->base + c->pos);
    s->len = len;
    c->pos += (size_t)len;
    return KVARN_OK;
}

/* ------------------------------------------------------------------------ */
/* Metadata values                                                          */
/* ------------------------------------------------------------------------ */

/* Bytes of one scalar of type t; 0 for STRING, ARRAY and invalid types. */
static size_t scalar_size(uint32_t t)
{
    switch (t) {
    case KVARN_GGUF_UINT8: case KVARN_GGUF_INT8: case KVARN_GGUF_BOOL: return 1;
    case KVARN_GGUF_UINT16: case KVARN_GGUF_INT16: return 2;
    case KVARN_GGUF_UINT32: case KVARN_GGUF_INT32: case KVARN_GGUF_FLOAT32: return 4;
    case KVARN_GGUF_UINT64: case KVARN_GGUF_INT64: case KVARN_GGUF_FLOAT64: return 8;
    default: return 0;
    }
}

static const char *const TYPE_NAMES[KVARN_GGUF_TYPE_COUNT] = {
    "uint8", "int8", "uint16", "int16", "uint32", "int32", "float32",
    "bool", "string", "array", "uint64", "int64", "float64"};

const char *kvarn_gguf_type_name(kvarn_gguf_type t)
{
    if ((unsigned)t >= KVARN_GGUF_TYPE_COUNT) return "invalid";
    return TYPE_NAMES[t];
}

static kvarn_status check_bools(cursor *c, const uint8_t *p, uint64_t n, const char *key)
{
    for (uint64_t i = 0; i < n; i++)
        if (p[i] > 1)
            return fail(c, KVARN_ERR_BAD_FILE,
                        "key %s: bool value %u at byte %zu is neither 0 nor 1", key,
                        (unsigned)p[i], (size_t)(p + i - c->base));
    return KVARN_OK;
}

static kvarn_status parse_value(cursor *c, gguf_kv *kv, const char *key)
{
    uint32_t t;
    size_t at = c->pos;
    kvarn_status st = rd_u32(c, &t, "metadata value type");
    if (st) return st;
    if (t >= KVARN_GGUF_TYPE_COUNT)
        return fail(c, KVARN_ERR_BAD_FILE, "key %s: unknown value type %u at byte %zu",
                    key, t, at);
    kv->type = (kvarn_gguf_type)t;
    if (t == KVARN_GGUF_STRING) return rd_str(c, &kv->str, "metadata string value");
    if (t != KVARN_GGUF_ARRAY) {
        size_t sz = scalar_size(t);
        if ((st = need(c, sz, "metadata value"))) return st;
        kv->val = c->base + c->pos;
        if (t == KVARN_GGUF_BOOL && (st = check_bools(c, kv->val, 1, key))) return st;
        c->pos += sz;
        return KVARN_OK;
    }

    uint32_t et;
    uint64_t n;
    at = c->pos;
    if ((st = rd_u32(c, &et, "array element type"))) return st;
    if (et == KVARN_GGUF_ARRAY)
        return fail(c, KVARN_ERR_UNSUPPORTED,
                    "key %s: arrays of arrays (byte %zu) are not supported", key, at);
    if (et >= KVARN_GGUF_TYPE_COUNT)
        return fail(c, KVARN_ERR_BAD_FILE,
                    "key %s: unknown array element type %u at byte %zu", key, et, at);
    at = c->pos;
    if ((st = rd_u64(c, &n, "array length"))) return st;
    kv->arr.type = (kvarn_gguf_type)et;
    kv->arr.n = n;
    if (et != KVARN_GGUF_STRING) {
        size_t sz = scalar_size(et);
        if (n > left(c) / sz)
            return fail(c, KVARN_ERR_BAD_FILE,
                        "key %s: array of %llu %s at byte %zu runs past the end of the "
                        "file (%zu bytes left)", key, (unsigned long long)n,
                        kvarn_gguf_type_name((kvarn_gguf_type)et), at, left(c));
        kv->arr.data = c->base + c->pos;
        if (et == KVARN_GGUF_BOOL && (st = check_bools(c, kv->arr.data, n, key))) return st;
        c->pos += (size_t)(n * sz);
        return KVARN_OK;
    }
    /* A string takes at least its 8-byte length: bound n before allocating. */
    if (n > left(c) / 8)
        return fail(c, KVARN_ERR_BAD_FILE,
                    "key %s: array of %llu strings at byte %zu runs past the end of "
                    "the file (%zu bytes left)", key, (unsigned long long)n, at, left(c));
    kv->arr.data = NULL;
    if (n > 0) {
        kv->strs = kvarn__malloc(c->alloc, (size_t)n, sizeof *kv->strs);
        if (!kv->strs)
            return fail(c, KVARN_ERR_NOMEM, "key %s: out of memory for %llu strings", key,
                        (unsigned long long)n);
        for (uint64_t i = 0; i < n; i++)
            if ((st = rd_str(c, &kv->strs[i], "array string element"))) return st;
    }
    return KVARN_OK;
}

/* Integer value of any integer type at p: neg = 1 and s the value when it
 * is negative, else neg = 0 and u the value. Returns 0 for non-integers. */
typedef struct int_val {
    int neg;
    int64_t s;
    uint64_t u;
} int_val;

static int read_int(kvarn_gguf_type t, const uint8_t *p, int_val *v)
{
    int64_t s = 0;
    v->neg = 0;
    v->s = 0;
    v->u = 0;
    switch (t) {
    case KVARN_GGUF_UINT8: v->u = p[0]; return 1;
    case KVARN_GGUF_UINT16: v->u = (uint64_t)p[0] | ((uint64_t)p[1] << 8); return 1;
    case KVARN_GGUF_UINT32: v->u = peek_u32(p); return 1;
    case KVARN_GGUF_UINT64: v->u = peek_u64(p); return 1;
    case KVARN_GGUF_INT8: s = (int8_t)p[0]; break;
    case KVARN_GGUF_INT16: s = (int16_t)(uint16_t)((unsigned)p[0] | ((unsigned)p[1] << 8)); break;
    case KVARN_GGUF_INT32: s = (int32_t)peek_u32(p); break;
    case KVARN_GGUF_INT64: s = (int64_t)peek_u64(p); break;
    default: return 0;
    }
    if (s < 0) {
        v->neg = 1;
        v->s = s;
    } else {
        v->u = (uint64_t)s;
    }
    return 1;
}

static int read_f32(kvarn_gguf_type t, const uint8_t *p, float *out)
{
    int_val v;
    if (t == KVARN_GGUF_FLOAT32) {
        uint32_t b = peek_u32(p);
        memcpy(out, &b, 4);
        return 1;
    }
    if (t == KVARN_GGUF_FLOAT64) {
        uint64_t b = peek_u64(p);
        double d;
        memcpy(&d, &b, 8);
        *out = (float)d;
        return 1;
    }
    if (!read_int(t, p, &v)) return 0;
    *out = v.neg ? (float)v.s : (float)v.u;
    return 1;
}

/* ------------------------------------------------------------------------ */
/* Sorted name index                                                        */
/* ------------------------------------------------------------------------ */

static int cmp_bytes(const char *a, uint64_t alen, const char *b, uint64_t blen)
{
    uint64_t n = alen < blen ? alen : blen;
    int r = n ? memcmp(a, b, (size_t)n) : 0;
    if (r) return r;
    return alen < blen ? -1 : (alen > blen ? 1 : 0);
}

static int cmp_sorted(const void *pa, const void *pb)
{
    const sorted_key *a = pa, *b = pb;
    return cmp_bytes(a->ptr, a->len, b->ptr, b->len);
}

static int64_t find_sorted(const sorted_key *keys, uint64_t n, const char *name)
{
    size_t len = strlen(name);
    uint64_t lo = 0, hi = n;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        int r = cmp_bytes(keys[mid].ptr, keys[mid].len, name, len);
        if (r == 0) return (int64_t)keys[mid].index;
        if (r < 0) lo = mid + 1;
        else hi = mid;
    }
    return -1;
}

/* Sort and reject duplicates; what names the kind for the message. */
static kvarn_status sort_unique(cursor *c, sorted_key *keys, uint64_t n, const char *what)
{
    if (n < 2) return KVARN_OK;
    qsort(keys, (size_t)n, sizeof *keys, cmp_sorted);
    for (uint64_t i = 1; i < n; i++)
        if (cmp_sorted(&keys[i - 1], &keys[i]) == 0) {
            char buf[QUOTED_LEN];
            return fail(c, KVARN_ERR_BAD_FILE, "duplicate %s %s", what,
                        quoted(keys[i].ptr, keys[i].len, buf));
        }
    return KVARN_OK;
}

/* ------------------------------------------------------------------------ */
/* Parsing                                                                  */
/* ------------------------------------------------------------------------ */

/* Names of ggml tensor types this reader does not serve, for messages;
 * NULL for a number that is no ggml type (or one ggml has removed). */
static const char *other_type_name(uint32_t t)
{
    switch (t) {
    case 6: return "Q5_0";
    case 7: return "Q5_1";
    case 9: return "Q8_1";
    case 10: return "Q2_K";
    case 11: return "Q3_K";
    case 12: return "Q4_K";
    case 13: return "Q5_K";
    case 14: return "Q6_K";
    case 15: return "Q8_K";
    case 24: return "I8";
    case 25: return "I16";
    case 26: return "I32";
    case 27: return "I64";
    case 16: return "IQ2_XXS";
    case 17: return "IQ2_XS";
    case 18: return "IQ3_XXS";
    case 19: return "IQ1_S";
    case 20: return "IQ4_NL";
    case 21: return "IQ3_S";
    case 22: return "IQ2_S";
    case 23: return "IQ4_XS";
    case 28: return "F64";
    case 29: return "IQ1_M";
    case 34: return "TQ1_0";
    case 35: return "TQ2_0";
    case 39: return "MXFP4";
    default: return NULL;
    }
}

static kvarn_status parse_metadata(cursor *c, kvarn_gguf *g)
{
    kvarn_status st;
    /* A pair takes at least 8 (key length) + 4 (type) + 1 (value) bytes. */
    if (g->n_kv > left(c) / 13)
        return fail(c, KVARN_ERR_BAD_FILE,
                    "header claims %llu metadata pairs, more than the file can hold "
                    "(truncated or corrupt)",
                    (unsigned long long)g->n_kv);
    if (g->n_kv > 0) {
        g->kv = kvarn__calloc(&g->alloc, (size_t)g->n_kv, sizeof *g->kv);
        g->kv_sorted = kvarn__calloc(&g->alloc, (size_t)g->n_kv, sizeof *g->kv_sorted);
        if (!g->kv || !g->kv_sorted)
            return fail(c, KVARN_ERR_NOMEM, "out of memory for %llu metadata pairs",
                        (unsigned long long)g->n_kv);
    }
    for (uint64_t i = 0; i < g->n_kv; i++) {
        gguf_kv *kv = &g->kv[i];
        size_t at = c->pos;
        char buf[QUOTED_LEN];
        if ((st = rd_str(c, &kv->key, "metadata key"))) return st;
        if (kv->key.len == 0 || kv->key.len > GGUF_MAX_KEY ||
            memchr(kv->key.ptr, 0, (size_t)kv->key.len))
            return fail(c, KVARN_ERR_BAD_FILE,
                        "metadata key %llu at byte %zu is empty, longer than %u bytes or "
                        "contains a NUL byte", (unsigned long long)i, at, GGUF_MAX_KEY);
        if ((st = parse_value(c, kv, quoted(kv->key.ptr, kv->key.len, buf)))) return st;
        g->kv_sorted[i] = (sorted_key){kv->key.ptr, kv->key.len, i};
    }
    return sort_unique(c, g->kv_sorted, g->n_kv, "metadata key");
}

static kvarn_status parse_alignment(cursor *c, kvarn_gguf *g)
{
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    int64_t k = kvarn_gguf_find_key(g, "general.alignment");
    if (k < 0) return KVARN_OK;
    const gguf_kv *kv = &g->kv[k];
    int_val v;
    const char *must = "must be a power of two that fits uint32";
    if (kv->type == KVARN_GGUF_STRING || kv->type == KVARN_GGUF_ARRAY ||
        !read_int(kv->type, kv->val, &v))
        return fail(c, KVARN_ERR_BAD_FILE, "general.alignment is a%s %s, not an integer: %s",
                    kv->type == KVARN_GGUF_ARRAY ? "n" : "", kvarn_gguf_type_name(kv->type),
                    must);
    if (v.neg)
        return fail(c, KVARN_ERR_BAD_FILE, "general.alignment = %lld: %s", (long long)v.s,
                    must);
    if (v.u == 0 || v.u > UINT32_MAX || (v.u & (v.u - 1)) != 0)
        return fail(c, KVARN_ERR_BAD_FILE, "general.alignment = %llu: %s",
                    (unsigned long long)v.u, must);
    g->alignment = (uint32_t)v.u;
    return KVARN_OK;
}

static kvarn_status parse_tensor_info(cursor *c, kvarn_gguf *g, uint64_t i)
{
    kvarn_gguf_tensor *t = &g->tensors[i];
    kvarn_gguf_str name;
    size_t at = c->pos;
    char qn[QUOTED_LEN];
    kvarn_status st = rd_str(c, &name, "tensor name");
    if (st) return st;
    if (name.len == 0 || name.len > KVARN_GGUF_MAX_NAME ||
        memchr(name.ptr, 0, (size_t)name.len))
        return fail(c, KVARN_ERR_BAD_FILE,
                    "tensor %llu at byte %zu: name %s is empty, longer than %d bytes or "
                    "contains a NUL byte", (unsigned long long)i, at,
                    quoted(name.ptr, name.len, qn), KVARN_GGUF_MAX_NAME);
    memcpy(t->name, name.ptr, (size_t)name.len);
    t->name[name.len] = '\0';
    qname(t->name, qn);

    at = c->pos;
    if ((st = rd_u32(c, &t->n_dims, "tensor n_dims"))) return st;
    if (t->n_dims == 0 || t->n_dims > KVARN_GGUF_MAX_DIMS)
        return fail(c, KVARN_ERR_BAD_FILE,
                    "tensor %s at byte %zu: n_dims %u is outside 1..%d", qn, at,
                    t->n_dims, KVARN_GGUF_MAX_DIMS);
    /* All dimensions first, so that a message can show the whole shape. */
    const size_t dims_at = c->pos;
    for (uint32_t d = 0; d < KVARN_GGUF_MAX_DIMS; d++) {
        t->ne[d] = 1;
        if (d < t->n_dims && (st = rd_u64(c, &t->ne[d], "tensor dimension"))) return st;
    }
    char shape[128];
    size_t sl = 0;
    for (uint32_t d = 0; d < t->n_dims && sl < sizeof shape; d++)
        sl += (size_t)snprintf(shape + sl, sizeof shape - sl, "%s%llu", d ? ", " : "",
                               (unsigned long long)t->ne[d]);
    uint64_t n = 1;
    for (uint32_t d = 0; d < t->n_dims; d++) {
        if (t->ne[d] == 0)
            return fail(c, KVARN_ERR_BAD_FILE,
                        "tensor %s at byte %zu: dimension %u is zero (shape [%s])", qn,
                        dims_at, d, shape);
        if (t->ne[d] > (uint64_t)INT64_MAX / n)
            return fail(c, KVARN_ERR_BAD_FILE,
                        "tensor %s at byte %zu: shape [%s] has more than 2^63 - 1 elements "
                        "(the element count overflows at dimension %u)", qn, dims_at, shape,
                        d);
        n *= t->ne[d];
    }
    t->n_elements = n;

    uint32_t type;
    at = c->pos;
    if ((st = rd_u32(c, &type, "tensor type"))) return st;
    t->type = (kvarn_ggml_type)type;
    uint32_t bs = kvarn_ggml_block_size(t->type);
    if (bs == 0) {
        const char *other = other_type_name(type);
        if (!other)
            return fail(c, KVARN_ERR_UNSUPPORTED,
                        "tensor %s: unknown type %u (supported: F32, F16, BF16, Q8_0, Q4_0, "
                        "Q4_1)", qn, type);
        return fail(c, KVARN_ERR_UNSUPPORTED,
                    "tensor %s: type %u (%s) is not supported (supported: F32, F16, "
                    "BF16, Q8_0, Q4_0, Q4_1)", qn, type, other);
    }
    if (t->ne[0] % bs != 0)
        return fail(c, KVARN_ERR_BAD_FILE,
                    "tensor %s: row length %llu is not a multiple of the %s block "
                    "size %u", qn, (unsigned long long)t->ne[0],
                    kvarn_ggml_type_name(t->type), bs);
    t->n_bytes = kvarn_ggml_row_bytes(t->type, n);
    if (t->n_bytes == 0) /* n is a multiple of the block size: an overflow */
        return fail(c, KVARN_ERR_BAD_FILE,
                    "tensor %s at byte %zu: shape [%s] of %s takes more than 2^64 - 1 bytes "
                    "(the byte size overflows)", qn, dims_at, shape,
                    kvarn_ggml_type_name(t->type));
    if ((st = rd_u64(c, &t->offset, "tensor offset"))) return st;
    return KVARN_OK;
}

/* Sort tensor indices ix[0..n) by data offset, ties by index: a heap sort
 * (qsort has no context pointer in C11, and the library keeps no global
 * state). */
static int offset_before(const kvarn_gguf_tensor *ts, uint64_t a, uint64_t b)
{
    return ts[a].offset < ts[b].offset || (ts[a].offset == ts[b].offset && a < b);
}

static void sift_down(const kvarn_gguf_tensor *ts, uint64_t *ix, uint64_t root, uint64_t n)
{
    for (;;) {
        uint64_t child = 2 * root + 1;
        if (child >= n) return;
        if (child + 1 < n && offset_before(ts, ix[child], ix[child + 1])) child++;
        if (!offset_before(ts, ix[root], ix[child])) return;
        uint64_t tmp = ix[root];
        ix[root] = ix[child];
        ix[child] = tmp;
        root = child;
    }
}

static void sort_by_offset(const kvarn_gguf_tensor *ts, uint64_t *ix, uint64_t n)
{
    for (uint64_t i = n / 2; i-- > 0;) sift_down(ts, ix, i, n);
    for (uint64_t end = n; end-- > 1;) {
        uint64_t tmp = ix[0];
        ix[0] = ix[end];
        ix[end] = tmp;
        sift_down(ts, ix, 0, end);
    }
}

static uint64_t align_up(uint64_t x, uint64_t a) { return x + (a - x % a) % a; }

/* The data section is packed, as ggml's and llama.cpp's readers require:
 * in offset order the first tensor starts at 0 and each next one exactly
 * where the previous one ends, rounded up to the alignment; after the last
 * one at most that padding. A tensor whose type or shape in the header
 * does not match its data breaks this: retyped to a larger type it reads
 * the next tensors' bytes as its own (an overlap), to a smaller one it
 * leaves bytes unaccounted for and reads the wrong values (a gap). Both
 * would load and compute garbage. Tensor infos may be listed in any
 * order: they are checked in offset order (sorted when not listed so), so
 * the message names the first bad pair from the data section's start. */
static kvarn_status check_layout(cursor *c, kvarn_gguf *g, uint64_t data_size)
{
    const uint64_t n = g->n_tensors; /* >= 1; every range inside the data section */
    const uint64_t al = g->alignment;
    const kvarn_gguf_tensor *ts = g->tensors;
    /* Most files list their tensors in data order: walk them as listed
     * without allocating, and sort only when it is not so. */
    uint64_t *ix = NULL;
    uint64_t i = 1;
    while (i < n && ts[i - 1].offset < ts[i].offset) i++;
    if (i < n) {
        ix = kvarn__malloc(&g->alloc, (size_t)n, sizeof *ix);
        if (!ix)
            return fail(c, KVARN_ERR_NOMEM, "out of memory for the offsets of %llu tensors",
                        (unsigned long long)n);
        for (uint64_t k = 0; k < n; k++) ix[k] = k;
        sort_by_offset(ts, ix, n);
    }
#define AT(k) (&ts[ix ? ix[k] : (k)])
    kvarn_status st = KVARN_OK;
    char qa[QUOTED_LEN], qb[QUOTED_LEN];
    const kvarn_gguf_tensor *first = AT(0);
    if (first->offset != 0)
        st = fail(c, KVARN_ERR_BAD_FILE,
                  "tensor %s (data bytes [%llu, %llu)) is the first in the data section "
                  "but starts at %llu, not 0: %llu bytes unaccounted for; a tensor's "
                  "offset in the header does not match the data (a corrupt tensor info)",
                  qname(first->name, qa), (unsigned long long)first->offset,
                  (unsigned long long)(first->offset + first->n_bytes),
                  (unsigned long long)first->offset, (unsigned long long)first->offset);
    for (uint64_t k = 1; k < n && st == KVARN_OK; k++) {
        const kvarn_gguf_tensor *a = AT(k - 1), *b = AT(k);
        /* a->offset <= b->offset */
        const uint64_t a_end = a->offset + a->n_bytes, next = align_up(a_end, al);
        if (b->offset - a->offset < a->n_bytes)
            st = fail(c, KVARN_ERR_BAD_FILE,
                      "tensors %s (data bytes [%llu, %llu)) and %s ([%llu, %llu)) overlap: "
                      "a tensor's type, shape or offset in the header does not match the "
                      "data (a retyped or corrupt tensor info)",
                      qname(a->name, qa), (unsigned long long)a->offset,
                      (unsigned long long)a_end, qname(b->name, qb),
                      (unsigned long long)b->offset,
                      (unsigned long long)(b->offset + b->n_bytes));
        else if (b->offset != next) /* b->offset > next: both are aligned */
            st = fail(c, KVARN_ERR_BAD_FILE,
                      "tensors %s (data bytes [%llu, %llu)) and %s ([%llu, %llu)) leave "
                      "%llu bytes unaccounted for: a type or shape in the header does not "
                      "match the data (retyped to a smaller type?)",
                      qname(a->name, qa), (unsigned long long)a->offset,
                      (unsigned long long)a_end, qname(b->name, qb),
                      (unsigned long long)b->offset,
                      (unsigned long long)(b->offset + b->n_bytes),
                      (unsigned long long)(b->offset - next));
    }
    if (st == KVARN_OK) {
        const kvarn_gguf_tensor *last = AT(n - 1);
        const uint64_t end = last->offset + last->n_bytes, padded = align_up(end, al);
        if (data_size > padded)
            st = fail(c, KVARN_ERR_BAD_FILE,
                      "the data section (%llu bytes) goes on %llu bytes past its last tensor "
                      "%s (data bytes [%llu, %llu)), more than the %llu bytes of padding to "
                      "the alignment %u: a type or shape in the header does not match the "
                      "data (retyped to a smaller type?), or trailing bytes",
                      (unsigned long long)data_size, (unsigned long long)(data_size - end),
                      qname(last->name, qa), (unsigned long long)last->offset,
                      (unsigned long long)end,
                      (unsigned long long)(padded - end), g->alignment);
    }
#undef AT
    kvarn__free(&g->alloc, ix);
    return st;
}

static kvarn_status parse_tensors(cursor *c, kvarn_gguf *g)
{
    kvarn_status st;
    /* An info takes at least 8 + 1 (name) + 4 + 8 (one dim) + 4 + 8 bytes. */
    if (g->n_tensors > left(c) / 33)
        return fail(c, KVARN_ERR_BAD_FILE,
                    "header claims %llu tensors, more than the file can hold "
                    "(truncated or corrupt)",
                    (unsigned long long)g->n_tensors);
    if (g->n_tensors > 0) {
        g->tensors = kvarn__calloc(&g->alloc, (size_t)g->n_tensors, sizeof *g->tensors);
        g->tensor_sorted = kvarn__calloc(&g->alloc, (size_t)g->n_tensors, sizeof *g->tensor_sorted);
        if (!g->tensors || !g->tensor_sorted)
            return fail(c, KVARN_ERR_NOMEM, "out of memory for %llu tensor infos",
                        (unsigned long long)g->n_tensors);
    }
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        if ((st = parse_tensor_info(c, g, i))) return st;
        g->tensor_sorted[i] =
            (sorted_key){g->tensors[i].name, strlen(g->tensors[i].name), i};
    }
    if ((st = sort_unique(c, g->tensor_sorted, g->n_tensors, "tensor name"))) return st;

    /* The data section starts at the next multiple of the alignment. */
    uint64_t a = g->alignment;
    uint64_t pad = (a - c->pos % a) % a;
    if (g->n_tensors == 0) {
        g->data_offset = pad <= left(c) ? c->pos + pad : c->size;
        return KVARN_OK;
    }
    if (pad > left(c))
        return fail(c, KVARN_ERR_BAD_FILE,
                    "the file ends early: the data section would start at byte %llu, past "
                    "the end (%zu bytes)", (unsigned long long)(c->pos + pad), c->size);
    g->data_offset = c->pos + pad;
    uint64_t data_size = c->size - g->data_offset;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        kvarn_gguf_tensor *t = &g->tensors[i];
        char qn[QUOTED_LEN];
        if (t->offset % a != 0)
            return fail(c, KVARN_ERR_BAD_FILE,
                        "tensor %s: offset %llu is not a multiple of the alignment %u",
                        qname(t->name, qn), (unsigned long long)t->offset, g->alignment);
        if (t->offset > data_size || t->n_bytes > data_size - t->offset)
            return fail(c, KVARN_ERR_BAD_FILE,
                        "tensor %s: data [%llu, +%llu) runs past the end of the data "
                        "section (%llu bytes)", qname(t->name, qn), (unsigned long long)t->offset,
                        (unsigned long long)t->n_bytes, (unsigned long long)data_size);
        t->data = c->base + g->data_offset + t->offset;
    }
    return check_layout(c, g, data_size);
}

static kvarn_status parse(cursor *c, kvarn_gguf *g)
{
    kvarn_status st;
    if (c->size < 4)
        return fail(c, KVARN_ERR_BAD_FILE, "the file is %zu bytes, too short for the GGUF magic",
                    c->size);
    if (memcmp(c->base, "GGUF", 4) != 0)
        return fail(c, KVARN_ERR_BAD_FILE,
                    "bad magic %02x %02x %02x %02x: not a GGUF file (expected \"GGUF\")",
                    c->base[0], c->base[1], c->base[2], c->base[3]);
    c->pos = 4;
    if ((st = rd_u32(c, &g->version, "version"))) return st;
    if (g->version != 2 && g->version != 3)
        return fail(c, KVARN_ERR_UNSUPPORTED,
                    "GGUF version %u is not supported (only 2 and 3)", g->version);
    if ((st = rd_u64(c, &g->n_tensors, "tensor count"))) return st;
    if ((st = rd_u64(c, &g->n_kv, "metadata count"))) return st;
    if ((st = parse_metadata(c, g))) return st;
    if ((st = parse_alignment(c, g))) return st;
    return parse_tensors(c, g);
}

static void free_index(kvarn_gguf *g)
{
    if (g->kv)
        for (uint64_t i = 0; i < g->n_kv; i++) kvarn__free(&g->alloc, g->kv[i].strs);
    kvarn__free(&g->alloc, g->kv);
    kvarn__free(&g->alloc, g->kv_sorted);
    kvarn__free(&g->alloc, g->tensors);
    kvarn__free(&g->alloc, g->tensor_sorted);
}

static kvarn_status open_bytes(const uint8_t *base, size_t size, int mapped,
                               const kvarn_allocator *alloc, kvarn_gguf **out,
                               char *err, size_t errlen)
{
    cursor c = {base, size, 0, err, errlen, alloc};
    kvarn_gguf *g = kvarn__calloc(alloc, 1, sizeof *g);
    if (!g) return fail(&c, KVARN_ERR_NOMEM, "out of memory");
    g->alloc = *alloc;
    g->base = base;
    g->size = size;
    g->mapped = mapped;
    kvarn_status st = parse(&c, g);
    if (st != KVARN_OK) {
        free_index(g); /* the caller unmaps */
        kvarn__free(alloc, g);
        return st;
    }
    *out = g;
    return KVARN_OK;
}

/* ------------------------------------------------------------------------ */
/* Public API: opening                                                      */
/* ------------------------------------------------------------------------ */

kvarn_status kvarn_gguf_open_memory(const void *data, size_t size, kvarn_gguf **out,
                                    char *err, size_t errlen)
{
    return kvarn_gguf_open_memory_ex(data, size, NULL, out, err, errlen);
}

kvarn_status kvarn_gguf_open_memory_ex(const void *data, size_t size,
                                       const kvarn_allocator *allocator, kvarn_gguf **out,
                                       char *err, size_t errlen)
{
    cursor c = {data, size, 0, err, errlen, NULL};
    if (err && errlen) err[0] = '\0';
    if (!out) return fail(&c, KVARN_ERR_INVALID_ARG, "no output handle given");
    *out = NULL;
    kvarn_allocator alloc;
    if (kvarn__alloc_init(&alloc, allocator) != KVARN_OK)
        return fail(&c, KVARN_ERR_INVALID_ARG, "allocator with only one of alloc/free set");
    if (!data && size > 0) return fail(&c, KVARN_ERR_INVALID_ARG, "no data given");
    if (size == 0) return fail(&c, KVARN_ERR_BAD_FILE, "empty input: not a GGUF file");
    return open_bytes(data, size, 0, &alloc, out, err, errlen);
}

kvarn_status kvarn_gguf_open(const char *path, kvarn_gguf **out, char *err, size_t errlen)
{
    return kvarn_gguf_open_ex(path, NULL, out, err, errlen);
}

kvarn_status kvarn_gguf_open_ex(const char *path, const kvarn_allocator *allocator,
                                kvarn_gguf **out, char *err, size_t errlen)
{
    cursor c = {NULL, 0, 0, err, errlen, NULL};
    if (err && errlen) err[0] = '\0';
    if (!out) return fail(&c, KVARN_ERR_INVALID_ARG, "no output handle given");
    *out = NULL;
    kvarn_allocator alloc;
    if (kvarn__alloc_init(&alloc, allocator) != KVARN_OK)
        return fail(&c, KVARN_ERR_INVALID_ARG, "allocator with only one of alloc/free set");
    if (!path) return fail(&c, KVARN_ERR_INVALID_ARG, "no path given");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return fail(&c, KVARN_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return fail(&c, KVARN_ERR_IO, "cannot stat '%s': %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return fail(&c, KVARN_ERR_IO, "'%s' is not a regular file", path);
    }
    if (sb.st_size == 0) {
        close(fd);
        return fail(&c, KVARN_ERR_BAD_FILE, "'%s' is empty: not a GGUF file", path);
    }
    if ((uint64_t)sb.st_size > SIZE_MAX) {
        close(fd);
        return fail(&c, KVARN_ERR_IO, "'%s' is too large to map", path);
    }
    size_t size = (size_t)sb.st_size;
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd); /* the mapping keeps the file open */
    if (map == MAP_FAILED)
        return fail(&c, KVARN_ERR_IO, "cannot map '%s': %s", path, strerror(e));
    kvarn_status st = open_bytes(map, size, 1, &alloc, out, err, errlen);
    if (st != KVARN_OK) munmap(map, size);
    return st;
}

void kvarn_gguf_close(kvarn_gguf *g)
{
    if (!g) return;
    free_index(g);
    if (g->mapped) munmap((void *)g->base, g->size);
    const kvarn_allocator a = g->alloc;
    kvarn__free(&a, g);
}

uint32_t kvarn_gguf_version(const kvarn_gguf *g) { return g ? g->version : 0; }
uint32_t kvarn_gguf_alignment(const kvarn_gguf *g) { return g ? g->alignment : 0; }
uint64_t kvarn_gguf_data_offset(const kvarn_gguf *g) { return g ? g->data_offset : 0; }
uint64_t kvarn_gguf_file_size(const kvarn_gguf *g) { return g ? g->size : 0; }

/* ------------------------------------------------------------------------ */
/* Public API: metadata                                                     */
/* ------------------------------------------------------------------------ */

uint64_t kvarn_gguf_kv_count(const kvarn_gguf *g) { return g ? g->n_kv : 0; }

kvarn_gguf_str kvarn_gguf_kv_key(const kvarn_gguf *g, uint64_t i)
{
    if (!g || i >= g->n_kv) return (kvarn_gguf_str){"", 0};
    return g->kv[i].key;
}

kvarn_gguf_type kvarn_gguf_kv_type(const kvarn_gguf *g, uint64_t i)
{
    if (!g || i >= g->n_kv) return KVARN_GGUF_TYPE_COUNT;
    return g->kv[i].type;
}

int64_t kvarn_gguf_find_key(const kvarn_gguf *g, const char *key)
{
    if (!g || !key) return -1;
    return find_sorted(g->kv_sorted, g->n_kv, key);
}

static const gguf_kv *lookup(const kvarn_gguf *g, const char *key)
{
    int64_t i = kvarn_gguf_find_key(g, key);
    return i < 0 ? NULL : &g->kv[i];
}

/* Integer value under key (scalar of any integer type). */
static kvarn_status get_int(const kvarn_gguf *g, const char *key, int_val *v)
{
    const gguf_kv *kv = lookup(g, key);
    if (!kv) return KVARN_ERR_BAD_FILE;
    if (kv->type == KVARN_GGUF_STRING || kv->type == KVARN_GGUF_ARRAY) return KVARN_ERR_BAD_FILE;
    return read_int(kv->type, kv->val, v) ? KVARN_OK : KVARN_ERR_BAD_FILE;
}

#define CHECK_ARGS(g, key, out) \
    do { if (!(g) || !(key) || !(out)) return KVARN_ERR_INVALID_ARG; } while (0)

kvarn_status kvarn_gguf_get_u32(const kvarn_gguf *g, const char *key, uint32_t *out)
{
    CHECK_ARGS(g, key, out);
    int_val v;
    kvarn_status st = get_int(g, key, &v);
    if (st) return st;
    if (v.neg || v.u > UINT32_MAX) return KVARN_ERR_BAD_FILE;
    *out = (uint32_t)v.u;
    return KVARN_OK;
}

kvarn_status kvarn_gguf_get_i32(const kvarn_gguf *g, const char *key, int32_t *out)
{
    CHECK_ARGS(g, key, out);
    int_val v;
    kvarn_status st = get_int(g, key, &v);
    if (st) return st;
    if (v.neg ? v.s < INT32_MIN : v.u > INT32_MAX) return KVARN_ERR_BAD_FILE;
    *out = v.neg ? (int32_t)v.s : (int32_t)v.u;
    return KVARN_OK;
}

kvarn_status kvarn_gguf_get_u64(const kvarn_gguf *g, const char *key, uint64_t *out)
{
    CHECK_ARGS(g, key, out);
    int_val v;
    kvarn_status st = get_int(g, key, &v);
    if (st) return st;
    if (v.neg) return KVARN_ERR_BAD_FILE;
    *out = v.u;
    return KVARN_OK;
}

static kvarn_status int_to_i64(const int_val *v, int64_t *out)
{
    if (!v->neg && v->u > (uint64_t)INT64_MAX) return KVARN_ERR_BAD_FILE;
    *out = v->neg ? v->s : (int64_t)v->u;
    return KVARN_OK;
}

kvarn_status kvarn_gguf_get_i64(const kvarn_gguf *g, const char *key, int64_t *out)
{
    CHECK_ARGS(g, key, out);
    int_val v;
    kvarn_status st = get_int(g, key, &v);
    if (st) return st;
    return int_to_i64(&v, out);
}

kvarn_status kvarn_gguf_get_f32(const kvarn_gguf *g, const char *key, float *out)
{
    CHECK_ARGS(g, key, out);
    const gguf_kv *kv = lookup(g, key);
    if (!kv || kv->type == KVARN_GGUF_STRING || kv->type == KVARN_GGUF_ARRAY ||
        kv->type == KVARN_GGUF_BOOL)
        return KVARN_ERR_BAD_FILE;
    return read_f32(kv->type, kv->val, out) ? KVARN_OK : KVARN_ERR_BAD_FILE;
}

kvarn_status kvarn_gguf_get_bool(const kvarn_gguf *g, const char *key, int *out)
{
    CHECK_ARGS(g, key, out);
    const gguf_kv *kv = lookup(g, key);
    if (!kv || kv->type != KVARN_GGUF_BOOL) return KVARN_ERR_BAD_FILE;
    *out = kv->val[0] != 0;
    return KVARN_OK;
}

kvarn_status kvarn_gguf_get_string(const kvarn_gguf *g, const char *key, kvarn_gguf_str *out)
{
    CHECK_ARGS(g, key, out);
    const gguf_kv *kv = lookup(g, key);
    if (!kv || kv->type != KVARN_GGUF_STRING) return KVARN_ERR_BAD_FILE;
    *out = kv->str;
    return KVARN_OK;
}

kvarn_status kvarn_gguf_get_array(const kvarn_gguf *g, const char *key, kvarn_gguf_array *out)
{
    CHECK_ARGS(g, key, out);
    const gguf_kv *kv = lookup(g, key);
    if (!kv || kv->type != KVARN_GGUF_ARRAY) return KVARN_ERR_BAD_FILE;
    *out = kv->arr;
    return KVARN_OK;
}

/* The array under key and a pointer to its element i (numeric types). */
static kvarn_status array_elem(const kvarn_gguf *g, const char *key, uint64_t i,
                               const gguf_kv **kvp, const uint8_t **elem)
{
    const gguf_kv *kv = lookup(g, key);
    if (!kv || kv->type != KVARN_GGUF_ARRAY) return KVARN_ERR_BAD_FILE;
    if (i >= kv->arr.n) return KVARN_ERR_INVALID_ARG;
    *kvp = kv;
    *elem = kv->arr.type == KVARN_GGUF_STRING
                ? NULL
                : (const uint8_t *)kv->arr.data + i * scalar_size(kv->arr.type);
    return KVARN_OK;
}

kvarn_status kvarn_gguf_array_string(const kvarn_gguf *g, const char *key, uint64_t i,
                                     kvarn_gguf_str *out)
{
    CHECK_ARGS(g, key, out);
    const gguf_kv *kv;
    const uint8_t *p;
    kvarn_status st = array_elem(g, key, i, &kv, &p);
    if (st) return st;
    if (kv->arr.type != KVARN_GGUF_STRING) return KVARN_ERR_BAD_FILE;
    *out = kv->strs[i];
    return KVARN_OK;
}

kvarn_status kvarn_gguf_array_i64(const kvarn_gguf *g, const char *key, uint64_t i,
                                  int64_t *out)
{
    CHECK_ARGS(g, key, out);
    const gguf_kv *kv;
    const uint8_t *p;
    int_val v;
    kvarn_status st = array_elem(g, key, i, &kv, &p);
    if (st) return st;
    if (!p || !read_int(kv->arr.type, p, &v)) return KVARN_ERR_BAD_FILE;
    return int_to_i64(&v, out);
}

kvarn_status kvarn_gguf_array_f32(const kvarn_gguf *g, const char *key, uint64_t i,
                                  float *out)
{
    CHECK_ARGS(g, key, out);
    const gguf_kv *kv;
    const uint8_t *p;
    kvarn_status st = array_elem(g, key, i, &kv, &p);
    if (st) return st;
    if (!p || kv->arr.type == KVARN_GGUF_BOOL) return KVARN_ERR_BAD_FILE;
    return read_f32(kv->arr.type, p, out) ? KVARN_OK : KVARN_ERR_BAD_FILE;
}

kvarn_status kvarn_gguf_str_copy(kvarn_gguf_str s, char *buf, size_t len)
{
    if (!buf || len == 0) return KVARN_ERR_INVALID_ARG;
    if (s.len >= len) {
        buf[0] = '\0';
        return KVARN_ERR_BUFFER_TOO_SMALL;
    }
    if (s.len) memcpy(buf, s.ptr, (size_t)s.len);
    buf[s.len] = '\0';
    return KVARN_OK;
}

int kvarn_gguf_str_eq(kvarn_gguf_str s, const char *c)
{
    if (!c || !s.ptr) return 0;
    size_t n = strlen(c);
    return s.len == n && (n == 0 || memcmp(s.ptr, c, n) == 0);
}

/* ------------------------------------------------------------------------ */
/* Public API: tensors                                                      */
/* ------------------------------------------------------------------------ */

uint64_t kvarn_gguf_tensor_count(const kvarn_gguf *g) { return g ? g->n_tensors : 0; }

const kvarn_gguf_tensor *kvarn_gguf_tensor_at(const kvarn_gguf *g, uint64_t i)
{
    if (!g || i >= g->n_tensors) return NULL;
    return &g->tensors[i];
}

const kvarn_gguf_tensor *kvarn_gguf_find_tensor(const kvarn_gguf *g, const char *name)
{
    if (!g || !name) return NULL;
    int64_t i = find_sorted(g->tensor_sorted, g->n_tensors, name);
    return i < 0 ? NULL : &g->tensors[i];
}
