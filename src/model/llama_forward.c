/*
 * llama_forward.c -- the llama forward pass for one chunk of tokens:
 * embedding, then per layer RMSNorm -> QKV -> RoPE -> GQA attention through
 * the session's K/V store -> output projection + residual -> RMSNorm ->
 * SwiGLU FFN + residual; then the final RMSNorm and the logits. Every weight
 * matmul is one GEMM over the chunk's tokens (docs/model.md).
 */
#include <string.h>

#include "model/llama_internal.h"

static void add_rows(float *x, const float *y, size_t n)
{
    for (size_t i = 0; i < n; i++) x[i] += y[i];
}

/* keep_kv_f32: copy the chunk's K (post-RoPE) and V of layer l as computed.
 * A failed call leaves copies past the session's position, never read. */
static void keep_kv(kvarn_llama_session *s, int l, int pos, int n, int qd, int kd,
                    int qkvd)
{
    for (int t = 0; t < n; t++) {
        size_t dst = ((size_t)l * s->max_tokens + (size_t)(pos + t)) * kd;
        const float *row = s->qkv + (size_t)t * qkvd + qd;
        memcpy(s->keep_k + dst, row, sizeof(float) * kd);
        memcpy(s->keep_v + dst, row + kd, sizeof(float) * kd);
    }
}

kvarn_status kvarn_llama_forward(kvarn_llama_session *s, const int32_t *tokens,
                                 int n, kvarn_llama_logits which,
                                 float *logits, size_t logits_len)
{
    if (!s || !tokens || n < 1 || n > s->max_chunk) return KVARN_ERR_INVALID_ARG;
    const kvarn_llama *m = s->model;
    const kvarn_llama_hparams *hp = &m->hp;
    if (which != KVARN_LLAMA_LOGITS_NONE && which != KVARN_LLAMA_LOGITS_LAST &&
        which != KVARN_LLAMA_LOGITS_ALL)
        return KVARN_ERR_INVALID_ARG;
    size_t need = which == KVARN_LLAMA_LOGITS_ALL ? (size_t)n * hp->vocab
                : which == KVARN_LLAMA_LOGITS_LAST ? (size_t)hp->vocab : 0;
    if (need && !logits) return KVARN_ERR_INVALID_ARG;
    if (logits_len < need) return KVARN_ERR_BUFFER_TOO_SMALL;
    for (int t = 0; t < n; t++)
        if (tokens[t] < 0 || tokens[t] >= hp->vocab) return KVARN_ERR_INVALID_ARG;
    if (s->pos > s->max_tokens - n) return KVARN_ERR_OUT_OF_BLOCKS;

    int pos = s->pos;
    llama_kv *kv = s->kv;
    kvarn_status st = kv->ops->begin(kv, pos, n);
    if (st != KVARN_OK) return st;

    int E = hp->hidden, D = hp->head_dim, H = hp->n_heads, Hk = hp->n_kv_heads;
    int F = hp->ffn;
    int qd = H * D, kd = Hk * D, qkvd = qd + 2 * kd;

    for (int t = 0; t < n; t++)
        llama_matrix_get_row(&m->tok_embd, tokens[t], s->x + (size_t)t * E);
    llama_rope_table(pos, n, D, hp->rope_theta, s->rope_cos, s->rope_sin);

    /* A failed matmul (bf16: oneDNN's per-call descriptors) rolls the store
     * back like a failed attention. */
#define MATMUL(x, rows, w, y)                                                 \
    do {                                                                      \
        st = llama_matmul(&s->mm, (x), (rows), (w), (y));                     \
        if (st != KVARN_OK) {                                                 \
            kv->ops->abort(kv, pos);                                          \
            return st;                                                        \
        }                                                                     \
    } while (0)
    for (int l = 0; l < hp->n_layers; l++) {
        const llama_layer *L = &m->layers[l];
        /* Attention block. */
        llama_rmsnorm(s->x, L->attn_norm, hp->rms_eps, n, E, s->xn);
        MATMUL(s->xn, n, &L->wqkv, s->qkv);
        llama_rope_apply(s->qkv, qkvd, n, H, D, s->rope_cos, s->rope_sin);
        llama_rope_apply(s->qkv + qd, qkvd, n, Hk, D, s->rope_cos, s->rope_sin);
        if (s->keep_k) keep_kv(s, l, pos, n, qd, kd, qkvd);
        st = kv->ops->attend(kv, l, pos, n, s->qkv, qkvd, s->qkv + qd,
                             s->qkv + qd + kd, qkvd, s->attn);
        if (st != KVARN_OK) {
            kv->ops->abort(kv, pos);
            return st;
        }
        MATMUL(s->attn, n, &L->wo, s->xn);
        add_rows(s->x, s->xn, (size_t)n * E);
        /* SwiGLU feed-forward block. */
        llama_rmsnorm(s->x, L->ffn_norm, hp->rms_eps, n, E, s->xn);
        MATMUL(s->xn, n, &L->w_gate_up, s->gu);
        llama_swiglu(s->gu, n, F, s->act);
        MATMUL(s->act, n, &L->w_down, s->xn);
        add_rows(s->x, s->xn, (size_t)n * E);
    }
    /* The head, before the commit, so that a failure still rolls back. */
    if (which == KVARN_LLAMA_LOGITS_ALL) {
        llama_rmsnorm(s->x, m->output_norm, hp->rms_eps, n, E, s->xn);
        MATMUL(s->xn, n, &m->output, logits);
    } else if (which == KVARN_LLAMA_LOGITS_LAST) {
        llama_rmsnorm(s->x + (size_t)(n - 1) * E, m->output_norm, hp->rms_eps, 1,
                      E, s->xn);
        MATMUL(s->xn, 1, &m->output, logits);
    }
#undef MATMUL
    st = kv->ops->end(kv, pos, n);
    if (st != KVARN_OK) {
        kv->ops->abort(kv, pos);
        return st;
    }
    s->pos = pos + n;
    return KVARN_OK;
}
