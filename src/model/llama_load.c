/*
 * llama_load.c -- load a llama-architecture GGUF: hyper-parameters from the
 * llama.* metadata, every weight dequantized (include/kvarn/gguf.h) to the
 * precision chosen (fp32, bf16 or int8, llama_weights.c), or with gguf
 * weights copied as the file's own blocks, and laid out for batched GEMMs
 * (src/model/llama_internal.h).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"
#include "kvarn/cache.h"
#include "kvarn/gguf.h"
#include "model/llama_internal.h"
#include "common/cpu.h"
#include "model/llama_qgemv.h"

/* The message of a refused file into err[errlen] (err may be NULL);
 * returns st. */
static kvarn_status hp_fail(char *err, size_t errlen, kvarn_status st, const char *fmt, ...)
{
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return st;
}

/* Read integer key into *out (an int in [lo, INT32_MAX]); absent: *out
 * unchanged, or an error naming the key when required. Any integer type
 * is accepted (gguf.h's getters); another type, or a value out of range,
 * is an error naming the key and what it holds. */
static kvarn_status hp_int(const kvarn_gguf *g, const char *key, int required, int lo, int *out,
                           char *err, size_t errlen)
{
    int64_t idx = kvarn_gguf_find_key(g, key);
    if (idx < 0)
        return required ? hp_fail(err, errlen, KVARN_ERR_BAD_FILE,
                                  "GGUF key %s is missing (a llama model needs it)", key)
                        : KVARN_OK;
    kvarn_gguf_type t = kvarn_gguf_kv_type(g, (uint64_t)idx);
    int64_t v;
    uint64_t u;
    if (kvarn_gguf_get_i64(g, key, &v) == KVARN_OK) {
        if (v < lo || v > INT32_MAX)
            return hp_fail(err, errlen, KVARN_ERR_BAD_FILE,
                           "GGUF key %s = %lld: must be from %d to %d", key, (long long)v, lo,
                           INT32_MAX);
        *out = (int)v;
        return KVARN_OK;
    }
    if (kvarn_gguf_get_u64(g, key, &u) == KVARN_OK) /* above INT64_MAX */
        return hp_fail(err, errlen, KVARN_ERR_BAD_FILE, "GGUF key %s = %llu: must be from %d to %d",
                       key, (unsigned long long)u, lo, INT32_MAX);
    return hp_fail(err, errlen, KVARN_ERR_BAD_FILE, "GGUF key %s has type %s: expected an integer",
                   key, kvarn_gguf_type_name(t));
}

/* Read optional real key into *out (absent: unchanged); another type is an
 * error naming the key. */
static kvarn_status hp_real(const kvarn_gguf *g, const char *key, float *out, char *err,
                            size_t errlen)
{
    int64_t idx = kvarn_gguf_find_key(g, key);
    if (idx < 0) return KVARN_OK;
    if (kvarn_gguf_get_f32(g, key, out) == KVARN_OK) return KVARN_OK;
    return hp_fail(err, errlen, KVARN_ERR_BAD_FILE, "GGUF key %s has type %s: expected a number",
                   key, kvarn_gguf_type_name(kvarn_gguf_kv_type(g, (uint64_t)idx)));
}

/* t's shape as "[ne0, ne1, ...]" (its n_dims entries) into buf[len]. */
static void shape_text(const kvarn_gguf_tensor *t, char *buf, size_t len)
{
    size_t at = 0;
    buf[0] = '\0';
    for (uint32_t d = 0; d < t->n_dims && d < KVARN_GGUF_MAX_DIMS && at < len; d++) {
        int n = snprintf(buf + at, len - at, "%s%llu", d ? ", " : "[", (unsigned long long)t->ne[d]);
        if (n < 0) return;
        at += (size_t)n;
    }
    if (at < len) snprintf(buf + at, len - at, "]");
}

kvarn_status kvarn_llama_read_hparams(const kvarn_gguf *g, kvarn_llama_hparams *out, char *err,
                                      size_t errlen)
{
    if (err && errlen) err[0] = '\0';
    if (!g || !out) return hp_fail(err, errlen, KVARN_ERR_INVALID_ARG, "NULL argument");
    kvarn_gguf_str arch;
    int64_t ai = kvarn_gguf_find_key(g, "general.architecture");
    if (ai < 0)
        return hp_fail(err, errlen, KVARN_ERR_BAD_FILE,
                       "GGUF key general.architecture is missing (a llama model has 'llama')");
    if (kvarn_gguf_get_string(g, "general.architecture", &arch) != KVARN_OK)
        return hp_fail(err, errlen, KVARN_ERR_BAD_FILE,
                       "GGUF key general.architecture has type %s: expected the string 'llama'",
                       kvarn_gguf_type_name(kvarn_gguf_kv_type(g, (uint64_t)ai)));
    if (!kvarn_gguf_str_eq(arch, "llama")) {
        int n = arch.len > 64 ? 64 : (int)arch.len;
        return hp_fail(err, errlen, KVARN_ERR_BAD_FILE,
                       "GGUF key general.architecture = '%.*s%s': this runner takes 'llama'", n,
                       arch.ptr, arch.len > 64 ? "..." : "");
    }
    kvarn_llama_hparams h;
    memset(&h, 0, sizeof h);
    h.n_kv_heads = -1;
    h.head_dim = -1;
    h.context_length = 2048;
    h.rope_theta = 10000.0f;
    h.rms_eps = 1e-5f;
    int rope_dim = -1;
    kvarn_status st;
    if ((st = hp_int(g, "llama.block_count", 1, 1, &h.n_layers, err, errlen)) ||
        (st = hp_int(g, "llama.embedding_length", 1, 1, &h.hidden, err, errlen)) ||
        (st = hp_int(g, "llama.attention.head_count", 1, 1, &h.n_heads, err, errlen)) ||
        (st = hp_int(g, "llama.attention.head_count_kv", 0, 0, &h.n_kv_heads, err, errlen)) ||
        (st = hp_int(g, "llama.attention.key_length", 0, 0, &h.head_dim, err, errlen)) ||
        (st = hp_int(g, "llama.feed_forward_length", 1, 1, &h.ffn, err, errlen)) ||
        (st = hp_int(g, "llama.context_length", 0, 1, &h.context_length, err, errlen)) ||
        (st = hp_int(g, "llama.rope.dimension_count", 0, 0, &rope_dim, err, errlen)) ||
        (st = hp_real(g, "llama.rope.freq_base", &h.rope_theta, err, errlen)) ||
        (st = hp_real(g, "llama.attention.layer_norm_rms_epsilon", &h.rms_eps, err, errlen)))
        return st;
    if (h.n_kv_heads < 0) h.n_kv_heads = h.n_heads;
    else if (h.n_kv_heads < 1 || h.n_heads % h.n_kv_heads)
        return hp_fail(err, errlen, KVARN_ERR_BAD_FILE,
                       "GGUF key llama.attention.head_count_kv = %d: must be >= 1 and divide "
                       "head_count %d", h.n_kv_heads, h.n_heads);
    /* the cache's limits (kvarn/cache.h): every session has a cache */
    if (h.n_layers > KVARN_CACHE_MAX_LAYERS)
        return hp_fail(err, errlen, KVARN_ERR_TOO_LARGE,
                       "GGUF key llama.block_count = %d: more layers than a cache holds (at most %d)",
                       h.n_layers, KVARN_CACHE_MAX_LAYERS);
    if (h.n_kv_heads > KVARN_CACHE_MAX_KV_HEADS)
        return hp_fail(err, errlen, KVARN_ERR_TOO_LARGE,
                       "GGUF key %s = %d: more KV heads than a cache holds (at most %d)",
                       kvarn_gguf_find_key(g, "llama.attention.head_count_kv") >= 0
                           ? "llama.attention.head_count_kv" : "llama.attention.head_count",
                       h.n_kv_heads, KVARN_CACHE_MAX_KV_HEADS);
    if (h.head_dim < 0) {
        if (h.hidden % h.n_heads)
            return hp_fail(err, errlen, KVARN_ERR_BAD_FILE,
                           "GGUF key llama.embedding_length = %d: must be a multiple of "
                           "llama.attention.head_count %d (no llama.attention.key_length)",
                           h.hidden, h.n_heads);
        h.head_dim = h.hidden / h.n_heads;
        if (h.head_dim < 2 || h.head_dim % 2)
            return hp_fail(err, errlen, KVARN_ERR_BAD_FILE,
                           "head_dim %d (llama.embedding_length %d / llama.attention.head_count "
                           "%d): must be even and >= 2 (RoPE rotates channel pairs)",
                           h.head_dim, h.hidden, h.n_heads);
    } else if (h.head_dim < 2 || h.head_dim % 2) {
        return hp_fail(err, errlen, KVARN_ERR_BAD_FILE,
                       "GGUF key llama.attention.key_length = %d: must be even and >= 2 (RoPE "
                       "rotates channel pairs)", h.head_dim);
    }
    if (!(h.rope_theta > 0.0f) || h.rope_theta > 3.4e38f)
        return hp_fail(err, errlen, KVARN_ERR_BAD_FILE,
                       "GGUF key llama.rope.freq_base = %g: must be a finite number > 0",
                       (double)h.rope_theta);
    if (!(h.rms_eps >= 0.0f) || h.rms_eps > 3.4e38f)
        return hp_fail(err, errlen, KVARN_ERR_BAD_FILE,
                       "GGUF key llama.attention.layer_norm_rms_epsilon = %g: must be a finite "
                       "number >= 0", (double)h.rms_eps);
    /* Partial RoPE (rotating fewer channels than head_dim) is not llama. */
    if (rope_dim >= 0 && rope_dim != h.head_dim)
        return hp_fail(err, errlen, KVARN_ERR_UNSUPPORTED,
                       "GGUF key llama.rope.dimension_count = %d: a RoPE over other than all "
                       "head_dim %d channels is not supported", rope_dim, h.head_dim);
    /* vocab and the head from the tensors */
    const kvarn_gguf_tensor *emb = kvarn_gguf_find_tensor(g, "token_embd.weight");
    if (!emb)
        return hp_fail(err, errlen, KVARN_ERR_BAD_FILE, "GGUF tensor token_embd.weight is missing");
    if (emb->ne[0] != (uint64_t)h.hidden || emb->ne[1] < 1 || emb->ne[1] > (uint64_t)INT32_MAX ||
        emb->ne[2] != 1 || emb->ne[3] != 1) {
        char shape[128];
        shape_text(emb, shape, sizeof shape);
        return hp_fail(err, errlen, KVARN_ERR_BAD_FILE,
                       "GGUF tensor token_embd.weight has shape %s: expected [embedding_length %d, "
                       "vocab from 1 to %d]", shape, h.hidden, INT32_MAX);
    }
    h.vocab = (int)emb->ne[1];
    h.tied_output = kvarn_gguf_find_tensor(g, "output.weight") == NULL;
    *out = h;
    return KVARN_OK;
}

/* Tensor name must be present with ne = {in, out} (out 0: a vector [in]);
 * in_what / out_what say where in and out come from, for the message. */
static kvarn_status check_tensor(const kvarn_gguf *g, const char *name, uint64_t in,
                                 const char *in_what, uint64_t out, const char *out_what,
                                 const char *needed, char *err, size_t errlen)
{
    const kvarn_gguf_tensor *t = kvarn_gguf_find_tensor(g, name);
    if (!t) return hp_fail(err, errlen, KVARN_ERR_BAD_FILE, "GGUF tensor %s is missing (%s)", name, needed);
    if (t->ne[0] == in && t->ne[1] == (out ? out : 1) && t->ne[2] == 1 && t->ne[3] == 1)
        return KVARN_OK;
    char shape[128];
    shape_text(t, shape, sizeof shape);
    if (out)
        return hp_fail(err, errlen, KVARN_ERR_BAD_FILE,
                       "GGUF tensor %s has shape %s: expected [%llu, %llu] (%s, %s)", name, shape,
                       (unsigned long long)in, (unsigned long long)out, in_what, out_what);
    return hp_fail(err, errlen, KVARN_ERR_BAD_FILE, "GGUF tensor %s has shape %s: expected [%llu] (%s)",
                   name, shape, (unsigned long long)in, in_what);
}

kvarn_status kvarn_llama_check_tensors(const kvarn_gguf *g, const kvarn_llama_hparams *hp,
                                       char *err, size_t errlen)
{
    if (err && errlen) err[0] = '\0';
    if (!g || !hp) return hp_fail(err, errlen, KVARN_ERR_INVALID_ARG, "NULL argument");
    const uint64_t E = (uint64_t)hp->hidden, D = (uint64_t)hp->head_dim;
    const uint64_t Q = (uint64_t)hp->n_heads * D, KV = (uint64_t)hp->n_kv_heads * D;
    const uint64_t F = (uint64_t)hp->ffn;
    char e[48], q[80], kv[80], f[48], v[32];
    snprintf(e, sizeof e, "embedding_length %d", hp->hidden);
    snprintf(q, sizeof q, "head_count %d x head_dim %d", hp->n_heads, hp->head_dim);
    snprintf(kv, sizeof kv, "head_count_kv %d x head_dim %d", hp->n_kv_heads, hp->head_dim);
    snprintf(f, sizeof f, "feed_forward_length %d", hp->ffn);
    snprintf(v, sizeof v, "vocab %d", hp->vocab);
    static const char model_needs[] = "a llama model needs it";
    static const char layer_needs[] =
        "every llama layer N has blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm, "
        "ffn_gate, ffn_up, ffn_down}.weight";
    kvarn_status st;
    if ((st = check_tensor(g, "token_embd.weight", E, e, (uint64_t)hp->vocab, v, model_needs, err,
                           errlen)) ||
        (st = check_tensor(g, "output_norm.weight", E, e, 0, NULL, model_needs, err, errlen)))
        return st;
    if (!hp->tied_output &&
        (st = check_tensor(g, "output.weight", E, e, (uint64_t)hp->vocab, v, model_needs, err, errlen)))
        return st;
    static const struct {
        const char *part;
        int in, out; /* 0 E, 1 Q, 2 KV, 3 F; out -1: a vector */
    } parts[9] = {{"attn_norm", 0, -1}, {"attn_q", 0, 1},   {"attn_k", 0, 2},
                  {"attn_v", 0, 2},     {"attn_output", 1, 0}, {"ffn_norm", 0, -1},
                  {"ffn_gate", 0, 3},   {"ffn_up", 0, 3},   {"ffn_down", 3, 0}};
    const uint64_t dim[4] = {E, Q, KV, F};
    const char *what[4] = {e, q, kv, f};
    for (int l = 0; l < hp->n_layers; l++)
        for (int i = 0; i < 9; i++) {
            char name[KVARN_GGUF_MAX_NAME + 1];
            snprintf(name, sizeof name, "blk.%d.%s.weight", l, parts[i].part);
            const int o = parts[i].out;
            st = check_tensor(g, name, dim[parts[i].in], what[parts[i].in], o < 0 ? 0 : dim[o],
                              o < 0 ? NULL : what[o], layer_needs, err, errlen);
            if (st) return st;
        }
    return KVARN_OK;
}

/* Check that tensor name is ne = {in, out} (out = 1 and n_dims 1 for a
 * vector). */
static kvarn_status find_tensor(const kvarn_gguf *g, const char *name, int in, int out,
                                const kvarn_gguf_tensor **t)
{
    *t = kvarn_gguf_find_tensor(g, name);
    if (!*t) return KVARN_ERR_BAD_FILE;
    if ((*t)->ne[0] != (uint64_t)in || (*t)->ne[1] != (uint64_t)out || (*t)->ne[2] != 1 ||
        (*t)->ne[3] != 1)
        return KVARN_ERR_BAD_FILE;
    return KVARN_OK;
}

static kvarn_status dequant_status(kvarn_status st)
{
    return st == KVARN_ERR_INVALID_ARG ? KVARN_ERR_BAD_FILE : st;
}

/* Dequantize vector tensor name [in] into dst[in] (fp32). */
static kvarn_status load_vector(const kvarn_gguf *g, const char *name, int in, float *dst)
{
    const kvarn_gguf_tensor *t;
    kvarn_status st = find_tensor(g, name, in, 1, &t);
    if (st != KVARN_OK) return st;
    return dequant_status(kvarn_gguf_tensor_dequantize(t, 0, t->n_elements, dst));
}

/* Dequantize matrix tensor name (ne = {in, out}) into rows [r0, r0 + out)
 * of m, LOAD_ROWS rows at a time through rowbuf (LOAD_ROWS * in floats). */
#define LOAD_ROWS 64
static kvarn_status load_rows(const kvarn_gguf *g, const char *name, int in, int out,
                              llama_matrix *m, int r0, float *rowbuf)
{
    const kvarn_gguf_tensor *t;
    kvarn_status st = find_tensor(g, name, in, out, &t);
    if (st != KVARN_OK) return st;
    if (m->q) /* gguf: the blocks as they are (type and size checked) */
        return llama_matrix_set_q_rows(m, r0, out, t->type, t->data, t->n_bytes);
    for (int r = 0; r < out; r += LOAD_ROWS) {
        int rows = out - r < LOAD_ROWS ? out - r : LOAD_ROWS;
        st = kvarn_gguf_tensor_dequantize(t, (uint64_t)r * (uint64_t)in,
                                          (uint64_t)rows * (uint64_t)in, rowbuf);
        if (st != KVARN_OK) return dequant_status(st);
        llama_matrix_set_rows(m, r0 + r, rows, rowbuf);
    }
    return KVARN_OK;
}

/* Float counts of every weight buffer (llama_internal.h's layout), formed
 * in 64 bits with checked products; each fits size_t with room for the
 * 64-byte rounding of alloc_floats, and the matrix heights fit the int
 * llama_matrix takes. */
typedef struct weight_sizes {
    size_t wqkv, wo, w_gate_up, w_down, embd; /* floats */
} weight_sizes;

static kvarn_status weight_sizes_get(const kvarn_llama_hparams *hp, weight_sizes *w)
{
    const uint64_t E = (uint64_t)hp->hidden, D = (uint64_t)hp->head_dim;
    const uint64_t qd = (uint64_t)hp->n_heads * D, kd = (uint64_t)hp->n_kv_heads * D;
    const uint64_t F = (uint64_t)hp->ffn, limit = (SIZE_MAX - 64) / sizeof(float);
    /* Matrix heights (llama_matrix.out is an int): Q + 2 K/V rows, 2 ffn. */
    if (qd + 2 * kd > INT32_MAX || 2 * F > INT32_MAX) return KVARN_ERR_TOO_LARGE;
    uint64_t v[5];
    int bad = kvarn__mul_u64(qd + 2 * kd, E, &v[0]);
    bad |= kvarn__mul_u64(E, qd, &v[1]);
    bad |= kvarn__mul3_u64(2, F, E, &v[2]);
    bad |= kvarn__mul_u64(E, F, &v[3]);
    bad |= kvarn__mul_u64((uint64_t)hp->vocab, E, &v[4]);
    for (int i = 0; i < 5; i++) bad |= v[i] > limit;
    if (bad) return KVARN_ERR_TOO_LARGE;
    w->wqkv = (size_t)v[0];
    w->wo = (size_t)v[1];
    w->w_gate_up = (size_t)v[2];
    w->w_down = (size_t)v[3];
    w->embd = (size_t)v[4];
    return KVARN_OK;
}

static float *alloc_floats(const kvarn_allocator *a, size_t n)
{
    /* 64-byte aligned rows help the GEMMs; sizes are rounded up to 64 B.
     * n <= (SIZE_MAX - 64) / 4 (weight_sizes_get), so this cannot wrap. */
    size_t bytes = (n * sizeof(float) + 63) & ~(size_t)63;
    return kvarn__malloc_aligned(a, bytes ? bytes : 64, 64, 0);
}

void kvarn_llama_free(kvarn_llama *m)
{
    if (!m) return;
    if (m->layers) {
        for (int l = 0; l < m->hp.n_layers; l++) {
            llama_layer *L = &m->layers[l];
            kvarn__free_aligned(&m->alloc, L->attn_norm);
            llama_matrix_free(m, &L->wqkv);
            llama_matrix_free(m, &L->wo);
            kvarn__free_aligned(&m->alloc, L->ffn_norm);
            llama_matrix_free(m, &L->w_gate_up);
            llama_matrix_free(m, &L->w_down);
        }
        kvarn__free(&m->alloc, m->layers);
    }
    if (m->output_owned) llama_matrix_free(m, &m->output);
    llama_matrix_free(m, &m->tok_embd);
    kvarn__free_aligned(&m->alloc, m->output_norm);
    llama_weights_engine_destroy(m);
    const kvarn_allocator a = m->alloc;
    kvarn__free(&a, m);
}

/* gguf weights: the block type a matrix stacked from the tensors names[0..n)
 * is kept in (all of one served type: Q4_0, Q4_1, Q8_0), else F32: held in
 * fp32 like the fp32 weights (a missing tensor is reported by load_rows). */
static kvarn_ggml_type stack_type(const kvarn_llama *m, const kvarn_gguf *g,
                                  const char *const *names, int n)
{
    if (m->weights != KVARN_LLAMA_WEIGHTS_GGUF) return KVARN_GGML_F32;
    kvarn_ggml_type t = KVARN_GGML_F32;
    for (int i = 0; i < n; i++) {
        const kvarn_gguf_tensor *x = kvarn_gguf_find_tensor(g, names[i]);
        if (!x || !llama_qtype_served(x->type) || (i > 0 && x->type != t)) return KVARN_GGML_F32;
        t = x->type;
    }
    return t;
}

/* Allocate a matrix for the tensors names[0..n) stacked: the blocks' type
 * (stack_type) or the model's precision. */
static kvarn_status alloc_stacked(const kvarn_gguf *g, kvarn_llama *m, llama_matrix *w,
                                  int out, int in, const char *const *names, int n)
{
    kvarn_ggml_type t = stack_type(m, g, names, n);
    return t == KVARN_GGML_F32 ? llama_matrix_alloc(m, w, out, in)
                               : llama_matrix_alloc_q(m, w, out, in, t);
}

static kvarn_status load_layer(const kvarn_gguf *g, kvarn_llama *m, int l, float *rowbuf)
{
    const kvarn_llama_hparams *hp = &m->hp;
    const kvarn_allocator *a = &m->alloc;
    llama_layer *L = &m->layers[l];
    int E = hp->hidden, D = hp->head_dim, H = hp->n_heads, Hk = hp->n_kv_heads;
    int F = hp->ffn;
    int qd = H * D, kd = Hk * D; /* fit int: weight_sizes_get */
    kvarn_status st;
    L->attn_norm = alloc_floats(a, E);
    L->ffn_norm = alloc_floats(a, E);
    if (!L->attn_norm || !L->ffn_norm) return KVARN_ERR_NOMEM;
    char nm[7][KVARN_GGUF_MAX_NAME + 1];
    static const char *const parts[7] = {"attn_q", "attn_k", "attn_v", "attn_output",
                                         "ffn_gate", "ffn_up", "ffn_down"};
    const char *np[7];
    for (int i = 0; i < 7; i++) {
        snprintf(nm[i], sizeof nm[i], "blk.%d.%s.weight", l, parts[i]);
        np[i] = nm[i];
    }
    if ((st = alloc_stacked(g, m, &L->wqkv, qd + 2 * kd, E, np, 3)) ||
        (st = alloc_stacked(g, m, &L->wo, E, qd, np + 3, 1)) ||
        (st = alloc_stacked(g, m, &L->w_gate_up, 2 * F, E, np + 4, 2)) ||
        (st = alloc_stacked(g, m, &L->w_down, E, F, np + 6, 1)))
        return st;
    char name[KVARN_GGUF_MAX_NAME + 1];
#define NAME(suffix) (snprintf(name, sizeof name, "blk.%d." suffix ".weight", l), name)
    if ((st = load_vector(g, NAME("attn_norm"), E, L->attn_norm)) ||
        (st = load_rows(g, NAME("attn_q"), E, qd, &L->wqkv, 0, rowbuf)) ||
        (st = load_rows(g, NAME("attn_k"), E, kd, &L->wqkv, qd, rowbuf)) ||
        (st = load_rows(g, NAME("attn_v"), E, kd, &L->wqkv, qd + kd, rowbuf)) ||
        (st = load_rows(g, NAME("attn_output"), qd, E, &L->wo, 0, rowbuf)) ||
        (st = load_vector(g, NAME("ffn_norm"), E, L->ffn_norm)) ||
        (st = load_rows(g, NAME("ffn_gate"), E, F, &L->w_gate_up, 0, rowbuf)) ||
        (st = load_rows(g, NAME("ffn_up"), E, F, &L->w_gate_up, F, rowbuf)) ||
        (st = load_rows(g, NAME("ffn_down"), F, E, &L->w_down, 0, rowbuf)))
        return st;
#undef NAME
    if ((st = llama_matrix_prepare(m, &L->wqkv, 0)) || (st = llama_matrix_prepare(m, &L->wo, 0)) ||
        (st = llama_matrix_prepare(m, &L->w_gate_up, 0)) ||
        (st = llama_matrix_prepare(m, &L->w_down, 0)))
        return st;
    return KVARN_OK;
}

static kvarn_status load_from(const kvarn_gguf *g, kvarn_llama *m)
{
    kvarn_llama_hparams *hp = &m->hp;
    kvarn_status st = kvarn_llama_read_hparams(g, hp, NULL, 0);
    if (st != KVARN_OK) return st;
    /* Every weight size checked before the first allocation. */
    weight_sizes w;
    st = weight_sizes_get(hp, &w);
    if (st != KVARN_OK) return st;
    /* every tensor present and of its shape, before the first allocation */
    st = kvarn_llama_check_tensors(g, hp, NULL, 0);
    if (st != KVARN_OK) return st;

    if ((m->weights == KVARN_LLAMA_WEIGHTS_BF16 || m->weights == KVARN_LLAMA_WEIGHTS_INT8) &&
        (st = llama_weights_engine_create(m)))
        return st;
    /* Rows are dequantized LOAD_ROWS at a time through one buffer as wide as
     * the widest matrix row (hidden, H D or ffn floats). */
    int wmax = hp->hidden;
    if (hp->n_heads * hp->head_dim > wmax) wmax = hp->n_heads * hp->head_dim;
    if (hp->ffn > wmax) wmax = hp->ffn;
    float *rowbuf = alloc_floats(&m->alloc, (size_t)LOAD_ROWS * (size_t)wmax);
    if (!rowbuf) return KVARN_ERR_NOMEM;
    m->output_norm = alloc_floats(&m->alloc, (size_t)hp->hidden);
    if (!m->output_norm) st = KVARN_ERR_NOMEM;
    static const char *const embd_name[1] = {"token_embd.weight"};
    static const char *const out_name[1] = {"output.weight"};
    if (!st) st = alloc_stacked(g, m, &m->tok_embd, hp->vocab, hp->hidden, embd_name, 1);
    if (!st) st = load_rows(g, "token_embd.weight", hp->hidden, hp->vocab, &m->tok_embd, 0, rowbuf);
    if (!st) st = load_vector(g, "output_norm.weight", hp->hidden, m->output_norm);
    if (!st && hp->tied_output) {
        /* tied: the head multiplies the embedding, whose rows are also
         * looked up per token (the plain copy is kept for that) */
        st = llama_matrix_prepare(m, &m->tok_embd, 1);
        m->output = m->tok_embd;
    } else if (!st) {
        m->output_owned = 1;
        st = alloc_stacked(g, m, &m->output, hp->vocab, hp->hidden, out_name, 1);
        if (!st) st = load_rows(g, "output.weight", hp->hidden, hp->vocab, &m->output, 0, rowbuf);
        if (!st) st = llama_matrix_prepare(m, &m->output, 0);
    }
    if (!st) {
        m->layers = kvarn__calloc(&m->alloc, (size_t)hp->n_layers, sizeof *m->layers);
        if (!m->layers) st = KVARN_ERR_NOMEM;
    }
    for (int l = 0; !st && l < hp->n_layers; l++) st = load_layer(g, m, l, rowbuf);
    kvarn__free_aligned(&m->alloc, rowbuf);
    return st;
}

/* 1 when every matrix of the file (each tensor of two or more dimensions:
 * the layers' matrices, the embedding, the head) is of a type the gguf
 * GEMV serves (Q4_0, Q4_1, Q8_0). */
static int all_matrices_blocked(const kvarn_gguf *g)
{
    uint64_t n = kvarn_gguf_tensor_count(g), mats = 0;
    for (uint64_t i = 0; i < n; i++) {
        const kvarn_gguf_tensor *t = kvarn_gguf_tensor_at(g, i);
        if (!t || t->n_dims < 2) continue;
        if (!llama_qtype_served(t->type)) return 0;
        mats++;
    }
    return mats > 0;
}

kvarn_status kvarn_llama_weights_parse(const char *name, kvarn_llama_weights *out)
{
    if (!name || !out) return KVARN_ERR_INVALID_ARG;
    if (!strcmp(name, "fp32")) *out = KVARN_LLAMA_WEIGHTS_FP32;
    else if (!strcmp(name, "bf16")) *out = KVARN_LLAMA_WEIGHTS_BF16;
    else if (!strcmp(name, "int8")) *out = KVARN_LLAMA_WEIGHTS_INT8;
    else if (!strcmp(name, "gguf")) *out = KVARN_LLAMA_WEIGHTS_GGUF;
    else return KVARN_ERR_INVALID_ARG;
    return KVARN_OK;
}

/* AUTO: KVARN_WEIGHTS when set, else gguf for a file whose matrices are all
 * Q4_0 / Q4_1 / Q8_0 (all_matrices_blocked) on a CPU with the AVX2 or
 * AVX-512 GEMV (the scalar reference runs at ~0.3x fp32's sgemv: only
 * there are bf16 / fp32 faster), else bf16 when this build and CPU can
 * make oneDNN's bf16 matmul (tried: the engine and one primitive), else
 * fp32. */
static kvarn_status resolve_weights(const kvarn_gguf *g, kvarn_llama_weights asked,
                                    const kvarn_allocator *alloc, kvarn_llama_weights *out)
{
    if (asked == KVARN_LLAMA_WEIGHTS_FP32 || asked == KVARN_LLAMA_WEIGHTS_BF16 ||
        asked == KVARN_LLAMA_WEIGHTS_INT8 || asked == KVARN_LLAMA_WEIGHTS_GGUF) {
        *out = asked;
        return KVARN_OK;
    }
    if (asked != KVARN_LLAMA_WEIGHTS_AUTO) return KVARN_ERR_INVALID_ARG;
    const char *env = getenv("KVARN_WEIGHTS");
    if (env && *env) return kvarn_llama_weights_parse(env, out);
    if (all_matrices_blocked(g) && kvarn__cpu_level() >= KVARN_CPU_AVX2) {
        *out = KVARN_LLAMA_WEIGHTS_GGUF;
        return KVARN_OK;
    }
    /* A 1 x 32 bf16 matrix: can oneDNN run it here? */
    kvarn_llama probe;
    memset(&probe, 0, sizeof probe);
    probe.alloc = *alloc;
    probe.weights = KVARN_LLAMA_WEIGHTS_BF16;
    llama_matrix m;
    kvarn_status st = llama_weights_engine_create(&probe);
    if (!st) st = llama_matrix_alloc(&probe, &m, 1, 32);
    if (!st) {
        memset(m.bf16, 0, 64);
        st = llama_matrix_prepare(&probe, &m, 0);
        llama_matrix_free(&probe, &m);
    }
    llama_weights_engine_destroy(&probe);
    if (st == KVARN_ERR_NOMEM) return st;
    *out = st == KVARN_OK ? KVARN_LLAMA_WEIGHTS_BF16 : KVARN_LLAMA_WEIGHTS_FP32;
    return KVARN_OK;
}

kvarn_status kvarn_llama_load_gguf_with(const kvarn_gguf *g,
                                        const kvarn_llama_load_opts *opts,
                                        kvarn_llama **out)
{
    if (!out) return KVARN_ERR_INVALID_ARG;
    *out = NULL;
    kvarn_llama_load_opts o = KVARN_LLAMA_LOAD_OPTS_DEFAULT;
    if (opts) o = *opts;
    kvarn_allocator alloc;
    if (!g || kvarn__alloc_init(&alloc, o.allocator) != KVARN_OK) return KVARN_ERR_INVALID_ARG;
    kvarn_llama_weights weights;
    kvarn_status st = resolve_weights(g, o.weights, &alloc, &weights);
    if (st != KVARN_OK) return st;
    kvarn_llama *m = kvarn__calloc(&alloc, 1, sizeof *m);
    if (!m) return KVARN_ERR_NOMEM;
    m->alloc = alloc;
    m->weights = weights;
    st = load_from(g, m);
    if (st != KVARN_OK) {
        /* n_layers may be set while layers is NULL: free handles both. */
        kvarn_llama_free(m);
        return st;
    }
    *out = m;
    return KVARN_OK;
}

kvarn_status kvarn_llama_load_with(const char *path, const kvarn_llama_load_opts *opts,
                                   kvarn_llama **out)
{
    if (!out) return KVARN_ERR_INVALID_ARG;
    *out = NULL;
    if (!path) return KVARN_ERR_INVALID_ARG;
    kvarn_gguf *g = NULL;
    kvarn_status st = kvarn_gguf_open_ex(path, opts ? opts->allocator : NULL, &g, NULL, 0);
    if (st != KVARN_OK) return st;
    st = kvarn_llama_load_gguf_with(g, opts, out);
    kvarn_gguf_close(g);
    return st;
}

kvarn_llama_weights kvarn_llama_get_weights(const kvarn_llama *m)
{
    return m ? m->weights : KVARN_LLAMA_WEIGHTS_FP32;
}

/* Bytes a matrix holds: fp32, or bf16 / int8 in oneDNN's layout (int8:
 * and a float scale per row) plus the plain copy where one is kept (the
 * tied embedding: rows looked up per token). */
static uint64_t matrix_bytes(const llama_matrix *w)
{
    uint64_t n = (uint64_t)w->out * (uint64_t)w->in;
    return (w->f32 ? 4u * n : 0) + (w->bf16 ? 2u * n : 0) + (w->s8 ? n : 0) +
           (w->q ? (uint64_t)w->out * (uint64_t)w->row_bytes : 0) +
           (w->wscale ? 4u * (uint64_t)w->out : 0) + (uint64_t)w->blk_bytes;
}

uint64_t kvarn_llama_weight_bytes(const kvarn_llama *m)
{
    if (!m) return 0;
    uint64_t b = matrix_bytes(&m->tok_embd) + (m->output_owned ? matrix_bytes(&m->output) : 0);
    for (int l = 0; l < m->hp.n_layers; l++) {
        const llama_layer *L = &m->layers[l];
        b += matrix_bytes(&L->wqkv) + matrix_bytes(&L->wo) + matrix_bytes(&L->w_gate_up) +
             matrix_bytes(&L->w_down);
    }
    return b;
}

kvarn_status kvarn_llama_load_gguf(const kvarn_gguf *g, kvarn_llama **out)
{
    return kvarn_llama_load_gguf_with(g, NULL, out);
}

kvarn_status kvarn_llama_load_gguf_ex(const kvarn_gguf *g, const kvarn_allocator *allocator,
                                      kvarn_llama **out)
{
    kvarn_llama_load_opts o = KVARN_LLAMA_LOAD_OPTS_DEFAULT;
    o.allocator = allocator;
    return kvarn_llama_load_gguf_with(g, &o, out);
}

kvarn_status kvarn_llama_load(const char *path, kvarn_llama **out)
{
    return kvarn_llama_load_with(path, NULL, out);
}

kvarn_status kvarn_llama_load_ex(const char *path, const kvarn_allocator *allocator,
                                 kvarn_llama **out)
{
    kvarn_llama_load_opts o = KVARN_LLAMA_LOAD_OPTS_DEFAULT;
    o.allocator = allocator;
    return kvarn_llama_load_with(path, &o, out);
}

const kvarn_llama_hparams *kvarn_llama_get_hparams(const kvarn_llama *m)
{
    return m ? &m->hp : NULL;
}
