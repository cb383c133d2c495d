/*
 * llama_session.c -- a llama session: one sequence, its K/V store (the paged
 * cache in the chosen format, or the exact fp32 store) and the scratch every
 * forward call reuses. All memory is allocated here, once.
 */
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"
#include "kvarn/cache.h"
#include "model/llama_internal.h"

#define DEFAULT_MAX_CHUNK 512

void kvarn_llama_session_free(kvarn_llama_session *s)
{
    if (!s) return;
    if (s->kv) s->kv->ops->destroy(s->kv);
    llama_mm_ctx_destroy(&s->alloc, &s->mm);
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

/* Bytes of the forward pass's scratch for chunks of n tokens, and of one
 * fp32 K (= V) copy for keep_kv_f32, each checked to fit size_t. */
typedef struct session_sizes {
    size_t x, xn, qkv, attn, gu, act, rope; /* rope: cos (= sin) */
    size_t kept;
} session_sizes;

/* Options resolved (0 = defaults) and checked, format parsed, every size
 * computed in 64 bits: what kvarn_llama_session_plan reports and
 * kvarn_llama_session_create runs before it allocates anything. */
static kvarn_status session_plan(const kvarn_llama *model,
                                 const kvarn_llama_session_opts *opts,
                                 kvarn_llama_session_opts *o, kvarn_format *fmt,
                                 llama_kv_shape *sh, session_sizes *z,
                                 kvarn_llama_session_info *info)
{
    if (!model) return KVARN_ERR_INVALID_ARG;
    kvarn_llama_session_opts d = KVARN_LLAMA_SESSION_OPTS_DEFAULT;
    *o = opts ? *opts : d;
    const kvarn_llama_hparams *hp = &model->hp;
    if (o->max_tokens == 0) o->max_tokens = hp->context_length;
    if (o->max_chunk == 0) o->max_chunk = DEFAULT_MAX_CHUNK;
    if (o->max_chunk > o->max_tokens) o->max_chunk = o->max_tokens;
    if (o->max_tokens < 1 || o->max_chunk < 1 || o->sink_tiles < -1 || o->sink_tokens < 0 ||
        o->tail_page_tokens < 0 ||
        (o->staging != -1 && kvarn_cache_staging_name(o->staging) == NULL) ||
        (o->rtn_range < KVARN_RTN_MINMAX || o->rtn_range > KVARN_RTN_MSE_V) ||
        o->balance_iters < -1 || o->balance_iters > 64 || (o->exact != 0 && o->exact != 1) ||
        o->attn_threads < 0 || o->attn_threads > 256 ||
        (o->exact_chunk != 0 && o->exact_chunk != 1) ||
        (o->keep_kv_f32 != 0 && o->keep_kv_f32 != 1))
        return KVARN_ERR_INVALID_ARG;
    if (o->cache) {
        /* A caller's cache decides the format and the KVarN settings. */
        kvarn_cache_info ci;
        if (o->exact || o->format || o->sink_tiles != -1 || o->sink_tokens != 0 ||
            o->tail_page_tokens != 0 || o->staging != -1 ||
            o->balance_iters != -1 || o->rtn_range != KVARN_RTN_MINMAX ||
            kvarn_cache_get_info(o->cache, &ci) != KVARN_OK || ci.n_layers != hp->n_layers ||
            ci.n_kv_heads != hp->n_kv_heads || ci.head_dim != hp->head_dim ||
            o->max_tokens > ci.max_seq_len)
            return KVARN_ERR_INVALID_ARG;
        *fmt = ci.format;
    } else if (!o->exact) {
        /* The caller's format as given (no name crosses this API; NULL is
         * fp16, the unquantized reference), checked as a whole row: kind,
         * bits and tile agree, and the head_dim is served. */
        kvarn_status st = KVARN_OK;
        if (o->format) *fmt = *o->format;
        else st = kvarn_format_parse("fp16", fmt);
        if (st != KVARN_OK) return st;
        fmt->name[sizeof fmt->name - 1] = '\0'; /* a hand-made name may be unterminated */
        st = kvarn_format_check_head_dim(fmt, hp->head_dim);
        if (st != KVARN_OK) return st;
    }
    /* A context no cache can hold is refused here, whatever the store. */
    if (o->max_tokens > KVARN_CACHE_MAX_SEQ_LEN) return KVARN_ERR_TOO_LARGE;

    const uint64_t F = sizeof(float), n = (uint64_t)o->max_chunk;
    const uint64_t E = (uint64_t)hp->hidden, D = (uint64_t)hp->head_dim;
    const uint64_t qd = (uint64_t)hp->n_heads * D;          /* < 2^62 */
    const uint64_t qkvd = ((uint64_t)hp->n_heads + 2 * (uint64_t)hp->n_kv_heads) * D;
    const uint64_t ffn = (uint64_t)hp->ffn;
    uint64_t v;
    int bad = 0;
#define SIZE3(field, a, b)                                                     \
    do {                                                                       \
        bad |= kvarn__mul3_u64((a), (b), F, &v) | kvarn__u64_to_size(v, &z->field); \
    } while (0)
    memset(z, 0, sizeof *z);
    SIZE3(x, n, E);
    SIZE3(xn, n, E > qd ? E : qd);
    SIZE3(qkv, n, qkvd);
    SIZE3(attn, n, qd);
    SIZE3(gu, n, 2 * ffn);
    SIZE3(act, n, ffn);
    SIZE3(rope, n, D / 2);
    if (o->keep_kv_f32) {
        uint64_t per_token;
        bad |= kvarn__mul3_u64((uint64_t)hp->n_layers, (uint64_t)hp->n_kv_heads, D, &per_token);
        SIZE3(kept, (uint64_t)o->max_tokens, per_token);
    }
#undef SIZE3
    if (bad) return KVARN_ERR_TOO_LARGE;

    llama_kv_shape shape = { hp->n_layers, hp->n_heads, hp->n_kv_heads,
                             hp->head_dim, o->max_tokens, o->max_chunk, NULL };
    *sh = shape;
    uint64_t kv_bytes, store_other;
    kvarn_status st = o->exact ? llama_kv_exact_plan(sh, &kv_bytes, &store_other)
                               : llama_kv_paged_plan(sh, fmt, o, &kv_bytes, &store_other);
    if (st != KVARN_OK) return st;
    uint64_t other = store_other + sizeof(kvarn_llama_session); /* small: no overflow */
    const size_t parts[] = { z->x, z->xn, z->qkv, z->attn, z->gu, z->act, z->rope, z->rope };
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++)
        bad |= kvarn__add_u64(other, parts[i], &other);
    /* The weight matmuls' buffers (bf16 / int8 activations and scratchpad;
     * gguf: the chunk slab) and the gguf GEMV's thread pool. */
    uint64_t max_in = E > qd ? E : qd, mm_bytes;
    if (ffn > max_in) max_in = ffn;
    st = llama_mm_ctx_plan(model, o->max_chunk, (int)max_in, o->attn_threads, &mm_bytes);
    if (st != KVARN_OK) return st;
    bad |= kvarn__add_u64(other, mm_bytes, &other);
    uint64_t kept2, total;
    bad |= kvarn__add_u64(z->kept, z->kept, &kept2);
    bad |= kvarn__add_u64(other, kept2, &other);
    bad |= kvarn__add_u64(kv_bytes, other, &total);
    if (bad) return KVARN_ERR_TOO_LARGE;

    memset(info, 0, sizeof *info);
    info->max_tokens = o->max_tokens;
    info->max_chunk = o->max_chunk;
    info->exact = o->exact;
    if (!o->exact) info->format = *fmt;
    info->n_layers = hp->n_layers;
    info->n_kv_heads = hp->n_kv_heads;
    info->head_dim = hp->head_dim;
    info->kv_bytes = kv_bytes;
    info->other_bytes = other;
    info->total_bytes = total;
    return KVARN_OK;
}

kvarn_status kvarn_llama_session_plan(const kvarn_llama *model,
                                      const kvarn_llama_session_opts *opts,
                                      kvarn_llama_session_info *out)
{
    if (!out) return KVARN_ERR_INVALID_ARG;
    kvarn_llama_session_opts o;
    kvarn_format fmt;
    llama_kv_shape sh;
    session_sizes z;
    kvarn_llama_session_info info;
    kvarn_status st = session_plan(model, opts, &o, &fmt, &sh, &z, &info);
    if (st == KVARN_OK) *out = info;
    return st;
}

kvarn_status kvarn_llama_session_create(const kvarn_llama *model,
                                        const kvarn_llama_session_opts *opts,
                                        kvarn_llama_session **out)
{
    if (!out) return KVARN_ERR_INVALID_ARG;
    *out = NULL;
    kvarn_llama_session_opts o;
    kvarn_format fmt;
    llama_kv_shape sh;
    session_sizes z;
    kvarn_llama_session_info info;
    /* Every size first: nothing is allocated for a session that cannot be. */
    kvarn_status st = session_plan(model, opts, &o, &fmt, &sh, &z, &info);
    if (st != KVARN_OK) return st;
    kvarn_allocator alloc;
    if (kvarn__alloc_init(&alloc, o.allocator) != KVARN_OK) return KVARN_ERR_INVALID_ARG;

    kvarn_llama_session *s = kvarn__calloc(&alloc, 1, sizeof *s);
    if (!s) return KVARN_ERR_NOMEM;
    s->alloc = alloc;
    s->model = model;
    s->max_tokens = o.max_tokens;
    s->max_chunk = o.max_chunk;
    s->x = kvarn__malloc(&alloc, z.x, 1);
    s->xn = kvarn__malloc(&alloc, z.xn, 1);
    s->qkv = kvarn__malloc(&alloc, z.qkv, 1);
    s->attn = kvarn__malloc(&alloc, z.attn, 1);
    s->gu = kvarn__malloc(&alloc, z.gu, 1);
    s->act = kvarn__malloc(&alloc, z.act, 1);
    s->rope_cos = kvarn__malloc(&alloc, z.rope, 1);
    s->rope_sin = kvarn__malloc(&alloc, z.rope, 1);
    if (o.keep_kv_f32) {
        s->keep_k = kvarn__malloc(&alloc, z.kept, 1);
        s->keep_v = kvarn__malloc(&alloc, z.kept, 1);
    }
    if (!s->x || !s->xn || !s->qkv || !s->attn || !s->gu || !s->act ||
        !s->rope_cos || !s->rope_sin ||
        (o.keep_kv_f32 && (!s->keep_k || !s->keep_v))) {
        kvarn_llama_session_free(s);
        return KVARN_ERR_NOMEM;
    }
    {
        const kvarn_llama_hparams *hp = &model->hp;
        int max_in = hp->hidden;
        if (hp->n_heads * hp->head_dim > max_in) max_in = hp->n_heads * hp->head_dim;
        if (hp->ffn > max_in) max_in = hp->ffn;
        st = llama_mm_ctx_create(model, &s->alloc, o.max_chunk, max_in, o.attn_threads, &s->mm);
        if (st != KVARN_OK) {
            kvarn_llama_session_free(s);
            return st;
        }
    }
    sh.alloc = &s->alloc;
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

kvarn_status kvarn_llama_session_load_state(kvarn_llama_session *s, const void *buf, size_t len)
{
    if (!s || (!buf && len > 0)) return KVARN_ERR_INVALID_ARG;
    if (s->pos != 0) return KVARN_ERR_STATE;
    if (!s->kv->ops->restore || s->keep_k) return KVARN_ERR_UNSUPPORTED;
    int n = 0;
    kvarn_status st = s->kv->ops->restore(s->kv, buf, len, s->max_tokens, &n);
    if (st == KVARN_OK) s->pos = n;
    return st;
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

kvarn_cache *kvarn_llama_session_cache(kvarn_llama_session *s)
{
    int seq;
    return s ? s->kv->ops->cache(s->kv, &seq) : NULL;
}

int kvarn_llama_session_seq(const kvarn_llama_session *s)
{
    int seq = -1;
    if (s) s->kv->ops->cache(s->kv, &seq);
    return seq;
}
