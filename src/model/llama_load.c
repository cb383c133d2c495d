/*
 * llama_load.c -- load a llama-architecture GGUF: hyper-parameters from the
 * llama.* metadata, every weight dequantized to fp32 (include/kvarn/gguf.h)
 * and laid out for batched GEMMs (src/model/llama_internal.h).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codec/checked.h"
#include "kvarn/gguf.h"
#include "model/llama_internal.h"

/* Read an optional u32 key; absent leaves *out unchanged. */
static kvarn_status opt_u32(const kvarn_gguf *g, const char *key, int *out)
{
    if (kvarn_gguf_find_key(g, key) < 0) return KVARN_OK;
    uint32_t v;
    kvarn_status st = kvarn_gguf_get_u32(g, key, &v);
    if (st != KVARN_OK) return st;
    if (v > (uint32_t)INT32_MAX) return KVARN_ERR_BAD_FILE;
    *out = (int)v;
    return KVARN_OK;
}

static kvarn_status opt_f32(const kvarn_gguf *g, const char *key, float *out)
{
    if (kvarn_gguf_find_key(g, key) < 0) return KVARN_OK;
    return kvarn_gguf_get_f32(g, key, out);
}

static kvarn_status read_hparams(const kvarn_gguf *g, kvarn_llama_hparams *hp)
{
    kvarn_gguf_str arch;
    if (kvarn_gguf_get_string(g, "general.architecture", &arch) != KVARN_OK ||
        !kvarn_gguf_str_eq(arch, "llama"))
        return KVARN_ERR_BAD_FILE;
    memset(hp, 0, sizeof *hp);
    hp->n_heads = -1;
    hp->hidden = -1;
    hp->n_layers = -1;
    hp->ffn = -1;
    hp->n_kv_heads = -1;
    hp->head_dim = -1;
    hp->context_length = 2048;
    hp->rope_theta = 10000.0f;
    hp->rms_eps = 1e-5f;
    int rope_dim = -1;
    kvarn_status st;
    if ((st = opt_u32(g, "llama.block_count", &hp->n_layers)) ||
        (st = opt_u32(g, "llama.embedding_length", &hp->hidden)) ||
        (st = opt_u32(g, "llama.attention.head_count", &hp->n_heads)) ||
        (st = opt_u32(g, "llama.attention.head_count_kv", &hp->n_kv_heads)) ||
        (st = opt_u32(g, "llama.attention.key_length", &hp->head_dim)) ||
        (st = opt_u32(g, "llama.feed_forward_length", &hp->ffn)) ||
        (st = opt_u32(g, "llama.context_length", &hp->context_length)) ||
        (st = opt_u32(g, "llama.rope.dimension_count", &rope_dim)) ||
        (st = opt_f32(g, "llama.rope.freq_base", &hp->rope_theta)) ||
        (st = opt_f32(g, "llama.attention.layer_norm_rms_epsilon", &hp->rms_eps)))
        return KVARN_ERR_BAD_FILE;
    if (hp->n_layers < 1 || hp->hidden < 1 || hp->n_heads < 1 || hp->ffn < 1 ||
        hp->context_length < 1)
        return KVARN_ERR_BAD_FILE;
    if (hp->n_kv_heads < 0) hp->n_kv_heads = hp->n_heads;
    if (hp->head_dim < 0) {
        if (hp->hidden % hp->n_heads) return KVARN_ERR_BAD_FILE;
        hp->head_dim = hp->hidden / hp->n_heads;
    }
    if (hp->n_kv_heads < 1 || hp->n_heads % hp->n_kv_heads || hp->head_dim < 2 ||
        hp->head_dim % 2 || !(hp->rope_theta > 0.0f) || !(hp->rms_eps >= 0.0f))
        return KVARN_ERR_BAD_FILE;
    /* Partial RoPE (rotating fewer channels than head_dim) is not llama. */
    if (rope_dim >= 0 && rope_dim != hp->head_dim) return KVARN_ERR_UNSUPPORTED;
    return KVARN_OK;
}

/* Dequantize tensor name, which must be ne = {in, out} (out = 1 and n_dims
 * 1 for a vector), into dst[out * in]. */
static kvarn_status load_tensor(const kvarn_gguf *g, const char *name, int in,
                                int out, float *dst)
{
    const kvarn_gguf_tensor *t = kvarn_gguf_find_tensor(g, name);
    if (!t) return KVARN_ERR_BAD_FILE;
    if (t->ne[0] != (uint64_t)in || t->ne[1] != (uint64_t)out || t->ne[2] != 1 ||
        t->ne[3] != 1)
        return KVARN_ERR_BAD_FILE;
    kvarn_status st = kvarn_gguf_tensor_dequantize(t, 0, t->n_elements, dst);
    return st == KVARN_ERR_INVALID_ARG ? KVARN_ERR_BAD_FILE : st;
}

/* Float counts of every weight buffer (llama_internal.h's layout), formed
 * in 64 bits with checked products; each fits size_t with room for the
 * 64-byte rounding of alloc_floats, and the Q and K/V widths fit the int
 * tensor dimensions load_tensor takes. */
typedef struct weight_sizes {
    size_t wqkv, wo, w_gate_up, w_down, embd; /* floats */
} weight_sizes;

static kvarn_status weight_sizes_get(const kvarn_llama_hparams *hp, weight_sizes *w)
{
    const uint64_t E = (uint64_t)hp->hidden, D = (uint64_t)hp->head_dim;
    const uint64_t qd = (uint64_t)hp->n_heads * D, kd = (uint64_t)hp->n_kv_heads * D;
    const uint64_t F = (uint64_t)hp->ffn, limit = (SIZE_MAX - 64) / sizeof(float);
    if (qd > INT32_MAX || kd > INT32_MAX) return KVARN_ERR_TOO_LARGE;
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
            kvarn__free_aligned(&m->alloc, L->wqkv);
            kvarn__free_aligned(&m->alloc, L->wo);
            kvarn__free_aligned(&m->alloc, L->ffn_norm);
            kvarn__free_aligned(&m->alloc, L->w_gate_up);
            kvarn__free_aligned(&m->alloc, L->w_down);
        }
        kvarn__free(&m->alloc, m->layers);
    }
    if (m->output != m->tok_embd) kvarn__free_aligned(&m->alloc, m->output);
    kvarn__free_aligned(&m->alloc, m->tok_embd);
    kvarn__free_aligned(&m->alloc, m->output_norm);
    const kvarn_allocator a = m->alloc;
    kvarn__free(&a, m);
}

static kvarn_status load_layer(const kvarn_gguf *g, const kvarn_llama_hparams *hp,
                               const kvarn_allocator *a, int l, llama_layer *L)
{
    int E = hp->hidden, D = hp->head_dim, H = hp->n_heads, Hk = hp->n_kv_heads;
    int F = hp->ffn;
    size_t qd = (size_t)H * D, kd = (size_t)Hk * D;
    weight_sizes w;
    kvarn_status st = weight_sizes_get(hp, &w);
    if (st != KVARN_OK) return st;
    L->attn_norm = alloc_floats(a, E);
    L->wqkv = alloc_floats(a, w.wqkv);
    L->wo = alloc_floats(a, w.wo);
    L->ffn_norm = alloc_floats(a, E);
    L->w_gate_up = alloc_floats(a, w.w_gate_up);
    L->w_down = alloc_floats(a, w.w_down);
    if (!L->attn_norm || !L->wqkv || !L->wo || !L->ffn_norm || !L->w_gate_up ||
        !L->w_down)
        return KVARN_ERR_NOMEM;
    char name[KVARN_GGUF_MAX_NAME + 1];
#define LOAD(suffix, in, out, dst)                                          \
    do {                                                                    \
        snprintf(name, sizeof name, "blk.%d." suffix ".weight", l);         \
        kvarn_status st_ = load_tensor(g, name, (in), (out), (dst));        \
        if (st_ != KVARN_OK) return st_;                                    \
    } while (0)
    LOAD("attn_norm", E, 1, L->attn_norm);
    LOAD("attn_q", E, (int)qd, L->wqkv);
    LOAD("attn_k", E, (int)kd, L->wqkv + qd * E);
    LOAD("attn_v", E, (int)kd, L->wqkv + (qd + kd) * E);
    LOAD("attn_output", (int)qd, E, L->wo);
    LOAD("ffn_norm", E, 1, L->ffn_norm);
    LOAD("ffn_gate", E, F, L->w_gate_up);
    LOAD("ffn_up", E, F, L->w_gate_up + (size_t)F * E);
    LOAD("ffn_down", F, E, L->w_down);
#undef LOAD
    return KVARN_OK;
}

static kvarn_status load_from(const kvarn_gguf *g, kvarn_llama *m)
{
    kvarn_llama_hparams *hp = &m->hp;
    kvarn_status st = read_hparams(g, hp);
    if (st != KVARN_OK) return st;
    const kvarn_gguf_tensor *emb = kvarn_gguf_find_tensor(g, "token_embd.weight");
    if (!emb || emb->ne[0] != (uint64_t)hp->hidden || emb->ne[1] < 1 ||
        emb->ne[1] > (uint64_t)INT32_MAX)
        return KVARN_ERR_BAD_FILE;
    hp->vocab = (int)emb->ne[1];
    hp->tied_output = kvarn_gguf_find_tensor(g, "output.weight") == NULL;
    /* Every weight size checked before the first allocation. */
    weight_sizes w;
    st = weight_sizes_get(hp, &w);
    if (st != KVARN_OK) return st;

    size_t E = (size_t)hp->hidden;
    m->tok_embd = alloc_floats(&m->alloc, w.embd);
    m->output_norm = alloc_floats(&m->alloc, E);
    if (!m->tok_embd || !m->output_norm) return KVARN_ERR_NOMEM;
    if ((st = load_tensor(g, "token_embd.weight", hp->hidden, hp->vocab, m->tok_embd)) ||
        (st = load_tensor(g, "output_norm.weight", hp->hidden, 1, m->output_norm)))
        return st;
    if (hp->tied_output) {
        m->output = m->tok_embd;
    } else {
        m->output = alloc_floats(&m->alloc, w.embd);
        if (!m->output) return KVARN_ERR_NOMEM;
        if ((st = load_tensor(g, "output.weight", hp->hidden, hp->vocab, m->output)))
            return st;
    }
    m->layers = kvarn__calloc(&m->alloc, (size_t)hp->n_layers, sizeof *m->layers);
    if (!m->layers) return KVARN_ERR_NOMEM;
    for (int l = 0; l < hp->n_layers; l++)
        if ((st = load_layer(g, hp, &m->alloc, l, &m->layers[l]))) return st;
    return KVARN_OK;
}

kvarn_status kvarn_llama_load_gguf(const kvarn_gguf *g, kvarn_llama **out)
{
    return kvarn_llama_load_gguf_ex(g, NULL, out);
}

kvarn_status kvarn_llama_load_gguf_ex(const kvarn_gguf *g, const kvarn_allocator *allocator,
                                      kvarn_llama **out)
{
    if (!out) return KVARN_ERR_INVALID_ARG;
    *out = NULL;
    kvarn_allocator alloc;
    if (!g || kvarn__alloc_init(&alloc, allocator) != KVARN_OK) return KVARN_ERR_INVALID_ARG;
    kvarn_llama *m = kvarn__calloc(&alloc, 1, sizeof *m);
    if (!m) return KVARN_ERR_NOMEM;
    m->alloc = alloc;
    kvarn_status st = load_from(g, m);
    if (st != KVARN_OK) {
        /* n_layers may be set while layers is NULL: free handles both. */
        kvarn_llama_free(m);
        return st;
    }
    *out = m;
    return KVARN_OK;
}

kvarn_status kvarn_llama_load(const char *path, kvarn_llama **out)
{
    return kvarn_llama_load_ex(path, NULL, out);
}

kvarn_status kvarn_llama_load_ex(const char *path, const kvarn_allocator *allocator,
                                 kvarn_llama **out)
{
    if (!out) return KVARN_ERR_INVALID_ARG;
    *out = NULL;
    if (!path) return KVARN_ERR_INVALID_ARG;
    kvarn_gguf *g = NULL;
    kvarn_status st = kvarn_gguf_open_ex(path, allocator, &g, NULL, 0);
    if (st != KVARN_OK) return st;
    st = kvarn_llama_load_gguf_ex(g, allocator, out);
    kvarn_gguf_close(g);
    return st;
}

const kvarn_llama_hparams *kvarn_llama_get_hparams(const kvarn_llama *m)
{
    return m ? &m->hp : NULL;
}
