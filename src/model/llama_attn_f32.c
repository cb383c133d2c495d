/*
 * llama_attn_f32.c -- causal GQA attention in fp32 over K/V held as plain
 * float arrays: the chunk's own exact K/V (prefill semantics,
 * ../shared/spec/KVARN.md "The fp16 tail and the sink") and the exact fp32
 * store. Scores and the weighted sum of values are GEMMs over blocks of
 * queries, so a long prefill stays batched; the log-sum-exp it returns lets
 * the caller merge it with attention over the paged history.
 */
#include <cblas.h>
#include <math.h>

#include "model/llama_internal.h"

/* Queries per block: the score block is QBLK x nk floats. */
#define QBLK 64

size_t llama_attn_f32_scratch_floats(int nk)
{
    return (size_t)QBLK * (size_t)(nk > 0 ? nk : 1);
}

void llama_attn_f32(int n_heads, int n_kv_heads, int head_dim,
                    const float *q, int ldq, int nq, int q_pos0,
                    const float *k, const float *v, int ld, size_t head_stride,
                    int nk, float *out, float *lse, float *scratch)
{
    int group = n_heads / n_kv_heads;
    int ldo = n_heads * head_dim;
    float scale = 1.0f / sqrtf((float)head_dim);
    for (int h = 0; h < n_heads; h++) {
        const float *kh = k + (size_t)(h / group) * head_stride;
        const float *vh = v + (size_t)(h / group) * head_stride;
        for (int i0 = 0; i0 < nq; i0 += QBLK) {
            int mb = nq - i0 < QBLK ? nq - i0 : QBLK;
            /* Keys the last query of the block can see. */
            int kend = q_pos0 + i0 + mb;
            if (kend > nk) kend = nk;
            const float *qb = q + (size_t)i0 * ldq + (size_t)h * head_dim;
            float *ob = out + (size_t)i0 * ldo + (size_t)h * head_dim;
            if (kend <= 0) {
                for (int i = 0; i < mb; i++) {
                    for (int d = 0; d < head_dim; d++) ob[(size_t)i * ldo + d] = 0.0f;
                    if (lse) lse[(size_t)(i0 + i) * n_heads + h] = -INFINITY;
                }
                continue;
            }
            /* S = scale * Q K^T  [mb][kend] */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, mb, kend,
                        head_dim, scale, qb, ldq, kh, ld, 0.0f, scratch, kend);
            for (int i = 0; i < mb; i++) {
                float *s = scratch + (size_t)i * kend;
                int lim = q_pos0 + i0 + i + 1; /* visible keys: j < lim */
                if (lim > kend) lim = kend;
                float m = -INFINITY;
                for (int j = 0; j < lim; j++) m = s[j] > m ? s[j] : m;
                double sum = 0.0;
                for (int j = 0; j < lim; j++) {
                    s[j] = expf(s[j] - m);
                    sum += s[j];
                }
                float inv = lim > 0 ? (float)(1.0 / sum) : 0.0f;
                for (int j = 0; j < lim; j++) s[j] *= inv;
                for (int j = lim; j < kend; j++) s[j] = 0.0f;
                if (lse)
                    lse[(size_t)(i0 + i) * n_heads + h] =
                        lim > 0 ? m + (float)log(sum) : -INFINITY;
            }
            /* O = P V  [mb][D] */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, mb, head_dim,
                        kend, 1.0f, scratch, kend, vh, ld, 0.0f, ob, ldo);
        }
    }
}

void llama_attn_merge(int n_heads, int head_dim, int nq, float *out,
                      float *lse, const float *out2, const float *lse2)
{
    for (int i = 0; i < nq; i++) {
        for (int h = 0; h < n_heads; h++) {
            float l1 = lse[(size_t)i * n_heads + h];
            float l2 = lse2[(size_t)i * n_heads + h];
            float *o = out + ((size_t)i * n_heads + h) * head_dim;
            const float *o2 = out2 + ((size_t)i * n_heads + h) * head_dim;
            if (l2 == -INFINITY) continue;
            if (l1 == -INFINITY) {
                for (int d = 0; d < head_dim; d++) o[d] = o2[d];
                lse[(size_t)i * n_heads + h] = l2;
                continue;
            }
            float m = l1 > l2 ? l1 : l2;
            float w1 = expf(l1 - m), w2 = expf(l2 - m);
            float inv = 1.0f / (w1 + w2);
            for (int d = 0; d < head_dim; d++)
                o[d] = (w1 * o[d] + w2 * o2[d]) * inv;
            lse[(size_t)i * n_heads + h] = m + logf(w1 + w2);
        }
    }
}
