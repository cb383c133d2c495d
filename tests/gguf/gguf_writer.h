/* gguf_writer.h -- builds GGUF files in memory for the GGUF reader's tests
 * and its fuzz driver (header only). Written from the format description in
 * include/kvarn/gguf.h, independently of the reader.
 *
 * gw_sample() writes the reference synthetic file: every metadata value
 * type, arrays of each element type (strings included), and one tensor of
 * each supported type whose expected fp32 values are computed here from
 * exact fp16/bf16 bit patterns, not by the code under test. */
#ifndef KVARN_TEST_GGUF_WRITER_H
#define KVARN_TEST_GGUF_WRITER_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/testutil.h"

typedef struct gw {
    uint8_t *buf;
    size_t len, cap;
} gw;

static inline void gw_bytes(gw *w, const void *p, size_t n)
{
    if (w->len + n > w->cap) {
        size_t cap = w->cap ? w->cap : 256;
        while (cap < w->len + n) cap *= 2;
        uint8_t *b = realloc(w->buf, cap);
        if (!b) abort(); /* test helper: out of memory ends the test */
        w->buf = b;
        w->cap = cap;
    }
    if (n) memcpy(w->buf + w->len, p, n);
    w->len += n;
}

static inline void gw_u8(gw *w, uint8_t v) { gw_bytes(w, &v, 1); }
static inline void gw_u16(gw *w, uint16_t v)
{
    uint8_t b[2] = {(uint8_t)v, (uint8_t)(v >> 8)};
    gw_bytes(w, b, 2);
}
static inline void gw_u32(gw *w, uint32_t v)
{
    uint8_t b[4];
    for (int i = 0; i < 4; i++) b[i] = (uint8_t)(v >> (8 * i));
    gw_bytes(w, b, 4);
}
static inline void gw_u64(gw *w, uint64_t v)
{
    uint8_t b[8];
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)(v >> (8 * i));
    gw_bytes(w, b, 8);
}
static inline void gw_f32(gw *w, float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    gw_u32(w, u);
}
static inline void gw_f64(gw *w, double f)
{
    uint64_t u;
    memcpy(&u, &f, 8);
    gw_u64(w, u);
}
static inline void gw_strn(gw *w, const char *s, size_t n)
{
    gw_u64(w, n);
    gw_bytes(w, s, n);
}
static inline void gw_str(gw *w, const char *s) { gw_strn(w, s, strlen(s)); }
static inline void gw_pad(gw *w, size_t align)
{
    while (w->len % align) gw_u8(w, 0);
}
static inline void gw_free(gw *w)
{
    free(w->buf);
    w->buf = NULL;
    w->len = w->cap = 0;
}

/* Header: magic, version, tensor count, metadata count. */
static inline void gw_header(gw *w, uint32_t version, uint64_t n_tensors, uint64_t n_kv)
{
    gw_bytes(w, "GGUF", 4);
    gw_u32(w, version);
    gw_u64(w, n_tensors);
    gw_u64(w, n_kv);
}

/* A key and its value type; the caller writes the value. */
static inline void gw_key(gw *w, const char *key, uint32_t type)
{
    gw_str(w, key);
    gw_u32(w, type);
}

/* One tensor to write. */
typedef struct gw_tensor {
    const char *name;
    uint32_t n_dims;
    uint64_t ne[4];
    uint32_t type;
    const uint8_t *data;
    size_t n_bytes;
} gw_tensor;

/* Tensor infos, padding to align and the data, each tensor at the next
 * multiple of align; the last tensor ends the file (no trailing padding). */
static inline void gw_tensors(gw *w, const gw_tensor *t, size_t nt, size_t align)
{
    uint64_t off = 0;
    for (size_t i = 0; i < nt; i++) {
        gw_str(w, t[i].name);
        gw_u32(w, t[i].n_dims);
        for (uint32_t d = 0; d < t[i].n_dims; d++) gw_u64(w, t[i].ne[d]);
        gw_u32(w, t[i].type);
        gw_u64(w, off);
        off += t[i].n_bytes;
        off = (off + align - 1) / align * align;
    }
    gw_pad(w, align);
    size_t start = w->len;
    for (size_t i = 0; i < nt; i++) {
        while ((w->len - start) % align) gw_u8(w, 0);
        gw_bytes(w, t[i].data, t[i].n_bytes);
    }
}

/* ------------------------------------------------------------------------ */
/* The reference synthetic file                                             */
/* ------------------------------------------------------------------------ */

/* fp16 bit patterns with their exact values (normal, negative, large,
 * small, subnormal), used for every fp16 scale, min and element. */
static const uint16_t GW_H_BITS[8] = {0x3C00, 0x3800, 0xB400, 0x4900,
                                      0x1400, 0x0001, 0xC500, 0x0000};
static const float GW_H_VAL[8] = {1.0f, 0.5f, -0.25f, 10.0f,
                                  0.0009765625f, 5.9604644775390625e-8f, -5.0f, 0.0f};

enum { GW_NT = 6, GW_MAXEL = 128 };

typedef struct gw_expect {
    const char *name[GW_NT];
    uint32_t type[GW_NT];
    uint32_t n_dims[GW_NT];
    uint64_t ne[GW_NT][4];
    uint64_t n_el[GW_NT];
    float val[GW_NT][GW_MAXEL];
} gw_expect;

/* Number of metadata pairs gw_sample writes (plus one for alignment). */
#define GW_SAMPLE_KV 27

/* Write the reference synthetic file: version (2 or 3), alignment (a power
 * of two; 0 = write no general.alignment key, so the default 32 applies),
 * tensors from seed. Fills exp (if not NULL) with what a reader must see. */
static inline void gw_sample(gw *w, uint32_t version, uint32_t alignment, uint64_t seed,
                             gw_expect *exp)
{
    static gw_expect scratch;
    if (!exp) exp = &scratch;
    test_rng rng;
    test_rng_seed(&rng, seed);
    uint32_t align = alignment ? alignment : 32;

    gw_header(w, version, GW_NT, GW_SAMPLE_KV + (alignment ? 1 : 0));
    gw_key(w, "general.architecture", 8); gw_str(w, "llama");
    gw_key(w, "t.u8", 0); gw_u8(w, 200);
    gw_key(w, "t.i8", 1); gw_u8(w, (uint8_t)(int8_t)-100);
    gw_key(w, "t.u16", 2); gw_u16(w, 60000);
    gw_key(w, "t.i16", 3); gw_u16(w, (uint16_t)(int16_t)-30000);
    gw_key(w, "t.u32", 4); gw_u32(w, 4000000000u);
    gw_key(w, "t.i32", 5); gw_u32(w, (uint32_t)(int32_t)-2000000000);
    gw_key(w, "t.f32", 6); gw_f32(w, 1.5f);
    gw_key(w, "t.bool", 7); gw_u8(w, 1);
    gw_key(w, "t.str", 8); gw_str(w, "h\xc3\xa9llo");
    gw_key(w, "t.u64", 10); gw_u64(w, 1ull << 40);
    gw_key(w, "t.i64", 11); gw_u64(w, (uint64_t)-(int64_t)(1ll << 40));
    gw_key(w, "t.f64", 12); gw_f64(w, 0.1);
    gw_key(w, "t.empty", 8); gw_str(w, "");
    gw_key(w, "t.small", 11); gw_u64(w, 30); /* an int64 that fits u32 */
    gw_key(w, "t.a_u8", 9); gw_u32(w, 0); gw_u64(w, 3); gw_u8(w, 1); gw_u8(w, 2); gw_u8(w, 255);
    gw_key(w, "t.a_i8", 9); gw_u32(w, 1); gw_u64(w, 2); gw_u8(w, 0x80); gw_u8(w, 0x7f);
    gw_key(w, "t.a_u16", 9); gw_u32(w, 2); gw_u64(w, 1); gw_u16(w, 65535);
    gw_key(w, "t.a_i16", 9); gw_u32(w, 3); gw_u64(w, 2); gw_u16(w, 0x8000); gw_u16(w, 7);
    gw_key(w, "t.a_i32", 9); gw_u32(w, 5); gw_u64(w, 3);
    gw_u32(w, (uint32_t)-1); gw_u32(w, 0); gw_u32(w, 0x7fffffff);
    gw_key(w, "t.a_f32", 9); gw_u32(w, 6); gw_u64(w, 2); gw_f32(w, -2.5f); gw_f32(w, 1e-5f);
    gw_key(w, "t.a_bool", 9); gw_u32(w, 7); gw_u64(w, 2); gw_u8(w, 0); gw_u8(w, 1);
    gw_key(w, "t.a_str", 9); gw_u32(w, 8); gw_u64(w, 3);
    gw_str(w, "a"); gw_str(w, ""); gw_strn(w, "x\0y", 3);
    gw_key(w, "t.a_u64", 9); gw_u32(w, 10); gw_u64(w, 2); gw_u64(w, 5); gw_u64(w, UINT64_MAX);
    gw_key(w, "t.a_i64", 9); gw_u32(w, 11); gw_u64(w, 1); gw_u64(w, (uint64_t)INT64_MIN);
    gw_key(w, "t.a_f64", 9); gw_u32(w, 12); gw_u64(w, 1); gw_f64(w, 100000.0);
    gw_key(w, "t.a_empty", 9); gw_u32(w, 4); gw_u64(w, 0);
    if (alignment) { gw_key(w, "general.alignment", 4); gw_u32(w, alignment); }

    static const char *names[GW_NT] = {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"};
    static const uint32_t types[GW_NT] = {0, 1, 30, 8, 2, 3};
    static const uint32_t dims[GW_NT] = {2, 1, 3, 2, 2, 4};
    static const uint64_t nes[GW_NT][4] = {{8, 3, 1, 1}, {16, 1, 1, 1}, {4, 2, 2, 1},
                                           {64, 2, 1, 1}, {32, 3, 1, 1}, {32, 1, 1, 2}};
    static uint8_t data[GW_NT][GW_MAXEL * 4];
    gw_tensor t[GW_NT];
    for (int k = 0; k < GW_NT; k++) {
        uint64_t n = nes[k][0] * nes[k][1] * nes[k][2] * nes[k][3];
        uint8_t *p = data[k];
        float *x = exp->val[k];
        exp->name[k] = names[k];
        exp->type[k] = types[k];
        exp->n_dims[k] = dims[k];
        memcpy(exp->ne[k], nes[k], sizeof nes[k]);
        exp->n_el[k] = n;
        size_t nb = 0;
        if (types[k] == 0) { /* F32 */
            for (uint64_t i = 0; i < n; i++) {
                x[i] = (float)test_rng_normal(&rng);
                memcpy(p + 4 * i, &x[i], 4);
            }
            nb = 4 * n;
        } else if (types[k] == 1) { /* F16 */
            for (uint64_t i = 0; i < n; i++) {
                uint32_t j = test_rng_below(&rng, 8);
                p[2 * i] = (uint8_t)GW_H_BITS[j];
                p[2 * i + 1] = (uint8_t)(GW_H_BITS[j] >> 8);
                x[i] = GW_H_VAL[j];
            }
            nb = 2 * n;
        } else if (types[k] == 30) { /* BF16: the top half of an fp32 */
            for (uint64_t i = 0; i < n; i++) {
                float f = (float)test_rng_normal(&rng) * 100.0f;
                uint32_t u;
                memcpy(&u, &f, 4);
                u &= 0xFFFF0000u;
                memcpy(&x[i], &u, 4);
                p[2 * i] = (uint8_t)(u >> 16);
                p[2 * i + 1] = (uint8_t)(u >> 24);
            }
            nb = 2 * n;
        } else { /* Q8_0, Q4_0, Q4_1: 32-element blocks */
            uint8_t *b = p;
            for (uint64_t blk = 0; blk < n / 32; blk++) {
                uint32_t jd = test_rng_below(&rng, 7), jm = test_rng_below(&rng, 8);
                float d = GW_H_VAL[jd], m = GW_H_VAL[jm];
                float *xb = x + blk * 32;
                *b++ = (uint8_t)GW_H_BITS[jd];
                *b++ = (uint8_t)(GW_H_BITS[jd] >> 8);
                if (types[k] == 8) {
                    for (int i = 0; i < 32; i++) {
                        int q = (int)test_rng_below(&rng, 256) - 128;
                        *b++ = (uint8_t)(int8_t)q;
                        xb[i] = (float)q * d;
                    }
                    continue;
                }
                if (types[k] == 3) {
                    *b++ = (uint8_t)GW_H_BITS[jm];
                    *b++ = (uint8_t)(GW_H_BITS[jm] >> 8);
                }
                for (int j = 0; j < 16; j++) {
                    int lo = (int)test_rng_below(&rng, 16), hi = (int)test_rng_below(&rng, 16);
                    *b++ = (uint8_t)(lo | (hi << 4));
                    if (types[k] == 2) {
                        xb[j] = (float)(lo - 8) * d;
                        xb[j + 16] = (float)(hi - 8) * d;
                    } else {
                        xb[j] = (float)lo * d + m;
                        xb[j + 16] = (float)hi * d + m;
                    }
                }
            }
            nb = (size_t)(b - p);
        }
        t[k] = (gw_tensor){names[k], dims[k], {nes[k][0], nes[k][1], nes[k][2], nes[k][3]},
                           types[k], p, nb};
    }
    gw_tensors(w, t, GW_NT, align);
}

#endif
