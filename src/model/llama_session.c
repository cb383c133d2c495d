/*
 * llama_session.c -- a llama session: one sequence, its K/V store (the paged
 * cache in the chosen format, or the exact fp32 store) and the scratch every
 * forward call reuses. All memory is allocated here, once.
 */
#include <stdlib.h>
#include <string.h>

#include "model/llama_internal.h"

#define DEFAULT_MAX_CHUNK 512

void kvarn_llama_session_free(kvarn_llama_session *s)
{
    if (!s) return;
    if (s->kv) s->kv->ops->destroy(s->kv);
    kvarn__free(&s->alloc, s->x);
    kvarn__free(&s->alloc, s->xn);
    kvarn__free(&s->alloc, s->qkv);
    kvarn__free(&s->alloc, s->attn);
    kvarn__free(&s->alloc, s->gu);
    kvarn__free(&s->alloc, s->act);
    kvarn__free(&s->alloc, s->rope_cos);
    kvarn__free(&s->alloc, s->rope_sin);
    kvarn__free(&s->alloc, s->keep_k);
    kvarn__free(&s->alloc, s->keep_v);
    const kvarn_allocator a = s->alloc;
    kvarn__free(&a, s);
}

kvarn_status kvarn_llama_session_create(const kvarn_llama *model,
                                        const kvarn_llama_session_opts *opts,
                                        kvarn_llama_session **out)
{
    if (!out) return KVARN_ERR_INVALID_ARG;
    *out = NULL;
    if (!model) return KVARN_ERR_INVALID_ARG;
    kvarn_llama_session_opts o = KVARN_LLAMA_SESSION_OPTS_DEFAULT;
    if (opts) o = *opts;
    const kvarn_llama_hparams *hp = &model->hp;
    if (o.max_tokens == 0) o.max_tokens = hp->context_length;
    if (o.max_chunk == 0) o.max_chunk = DEFAULT_MAX_CHUNK;
    if (o.max_chunk > o.max_tokens) o.max_chunk = o.max_tokens;
    if (o.max_tokens < 1 || o.max_chunk < 1 || o.sink_tiles < -1 ||
        o.balance_iters < -1 || o.balance_iters > 64 || (o.exact != 0 && o.exact != 1) ||
        o.attn_threads < 0 || o.attn_threads > 256 ||
        (o.exact_chunk != 0 && o.exact_chunk != 1) ||
        (o.keep_kv_f32 != 0 && o.keep_kv_f32 != 1))
        return KVARN_ERR_INVALID_ARG;
    kvarn_allocator alloc;
    if (kvarn__alloc_init(&alloc, o.allocator) != KVARN_OK) return KVARN_ERR_INVALID_ARG;

    kvarn_format fmt;
    kvarn_status st = KVARN_OK;
    if (!o.exact) {
        st = kvarn_format_parse(o.cache_format ? o.cache_format : "fp16", &fmt);
        if (st != KVARN_OK) return st;
        st = kvarn_format_check_head_dim(&fmt, hp->head_dim);
        if (st != KVARN_OK) return st;
    }

    kvarn_llama_session *s = kvarn__calloc(&alloc, 1, sizeof *s);
    if (!s) return KVARN_ERR_NOMEM;
    s->alloc = alloc;
    s->model = model;
    s->max_tokens = o.max_tokens;
    s->max_chunk = o.max_chunk;
    size_t n = (size_t)o.max_chunk;
    size_t E = (size_t)hp->hidden, D = (size_t)hp->head_dim;
    size_t qkvd = (size_t)(hp->n_heads + 2 * hp->n_kv_heads) * D;
    size_t qd = (size_t)hp->n_heads * D;
    s->x = kvarn__malloc(&alloc, n * E, sizeof(float));
    s->xn = kvarn__malloc(&alloc, n * (E > qd ? E : qd), sizeof(float));
    s->qkv = kvarn__malloc(&alloc, n * qkvd, sizeof(float));
    s->attn = kvarn__malloc(&alloc, n * qd, sizeof(float));
    s->gu = kvarn__malloc(&alloc, n * 2 * hp->ffn, sizeof(float));
    s->act = kvarn__malloc(&alloc, n * hp->ffn, sizeof(float));
    s->rope_cos = kvarn__malloc(&alloc, n * (D / 2), sizeof(float));
    s->rope_sin = kvarn__malloc(&alloc, n * (D / 2), sizeof(float));
    if (o.keep_kv_f32) {
        size_t kept = (size_t)hp->n_layers * (size_t)o.max_tokens *
                      (size_t)hp->n_kv_heads * D;
        s->keep_k = kvarn__malloc(&alloc, kept, sizeof(float));
        s->keep_v = kvarn__malloc(&alloc, kept, sizeof(float));
    }
    if (!s->x || !s->xn || !s->qkv || !s->attn || !s->gu || !s->act ||
        !s->rope_cos || !s->rope_sin ||
        (o.keep_kv_f32 && (!s->keep_k || !s->keep_v))) {
        kvarn_llama_session_free(s);
        return KVARN_ERR_NOMEM;
    }
    llama_kv_shape sh = { hp->n_layers, hp->n_heads, hp->n_kv_heads,
                          hp->head_dim, o.max_tokens, o.max_chunk, &s->alloc };
    if (o.exact)
        st = llama_kv_exact_create(&sh, &s->kv);
    else
        st = llama_kv_paged_create(&sh, &fmt, &o, &s->kv);
    if (st != KVARN_OK) {
        kvarn_llama_session_free(s);
        return st;
    }
    *out = s;
    return KVARN_OK;
}

void kvarn_llama_session_reset(kvarn_llama_session *s)
{
    if (!s) return;
    s->kv->ops->reset(s->kv);
    s->pos = 0;
}

int kvarn_llama_session_pos(const kvarn_llama_session *s)
{
    return s ? s->pos : 0;
}

kvarn_status kvarn_llama_session_read_kv(const kvarn_llama_session *s, int layer,
                                         int pos, int n, float *k, float *v)
{
    if (!s || !k || !v) return KVARN_ERR_INVALID_ARG;
    const kvarn_llama_hparams *hp = &s->model->hp;
    if (layer < 0 || layer >= hp->n_layers || pos < 0 || n < 1 || pos > s->pos - n)
        return KVARN_ERR_INVALID_ARG;
    if (!s->keep_k) return KVARN_ERR_UNSUPPORTED;
    size_t kd = (size_t)hp->n_kv_heads * hp->head_dim;
    size_t off = ((size_t)layer * s->max_tokens + (size_t)pos) * kd;
    memcpy(k, s->keep_k + off, sizeof(float) * (size_t)n * kd);
    memcpy(v, s->keep_v + off, sizeof(float) * (size_t)n * kd);
    return KVARN_OK;
}

const char *kvarn_llama_session_format(const kvarn_llama_session *s)
{
    return s ? s->kv->ops->format_name(s->kv) : "";
}
