/*
 * kernel_ref.c -- scalar reference tile kernels of the attention: the
 * oracle the SIMD kernels are tested against, and the fallback on CPUs
 * without AVX2 (or when opts.testing->force_scalar is set, attn.h).
 *
 * Every kernel does the same three steps for one tile and every row of a
 * work item: scores, online-softmax update, weighted sum of V. The scale
 * folding follows ../shared/spec/KVARN.md "Attention over records"; the
 * per-token formats fold their scale and zero-point the same way:
 *   int8/int4  k = code*scale + zero:  q.k = scale*(q.code) + zero*sum(q)
 *   fp8        k = fp8(code)*scale:    q.k = scale*(q.fp8(code))
 *   V side     sum_t p_t v_t[d] = sum_t (p_t*scale_t)*code[t,d] + sum_t p_t*zero_t
 */
#include <math.h>
#include <string.h>

#include "attn/attn_internal.h"

void attn_softmax_update_ref(attn_rows *r, int t0, int nt)
{
    const int D = r->D, G = r->gs;
    for (int i = 0; i < r->n; i++) {
        float *s = r->s + (size_t)i * G;
        int a, b; /* visible [a, b) */
        if (!attn_row_visible(r, i, t0, nt, &a, &b)) {
            for (int t = 0; t < nt; t++) s[t] = 0.0f;
            continue;
        }
        float mt = s[a];
        for (int t = a + 1; t < b; t++) mt = s[t] > mt ? s[t] : mt;
        float m_old = r->m[i];
        float m_new = mt > m_old ? mt : m_old;
        float corr = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
        float sum = 0.0f;
        for (int t = 0; t < nt; t++) {
            float p = (t >= a && t < b) ? expf(s[t] - m_new) : 0.0f;
            s[t] = p;
            sum += p;
        }
        r->m[i] = m_new;
        r->l[i] = r->l[i] * corr + sum;
        r->psum[i] = sum;
        if (corr != 1.0f) {
            float *acc = r->acc + (size_t)i * D;
            for (int d = 0; d < D; d++) acc[d] *= corr;
        }
    }
}

/* ---------------------------------------------------------- fp16 pages */

void attn_ref_fp16_tile(attn_rows *r, const uint16_t *k, const uint16_t *v, int t0, int nt)
{
    const int D = r->D, G = r->gs;
    for (int i = 0; i < r->n; i++) {
        const float *q = r->q + (size_t)i * D;
        for (int t = 0; t < nt; t++) {
            float dot = 0.0f;
            for (int d = 0; d < D; d++) dot += q[d] * kvarn_fp16_to_fp32(k[(size_t)t * D + d]);
            r->s[(size_t)i * G + t] = dot;
        }
    }
    attn_softmax_update_ref(r, t0, nt);
    for (int i = 0; i < r->n; i++) {
        float *acc = r->acc + (size_t)i * D;
        for (int t = 0; t < nt; t++) {
            float p = r->s[(size_t)i * G + t];
            for (int d = 0; d < D; d++) acc[d] += p * kvarn_fp16_to_fp32(v[(size_t)t * D + d]);
        }
    }
}

/* --------------------------------------------------------- KVarN records */

/* Code i of a row of packed codes (record.h: low bits first). */
static inline unsigned code_at(const uint8_t *row, int i, int bits)
{
    int per = 8 / bits;
    return (row[i / per] >> ((i % per) * bits)) & ((1u << bits) - 1u);
}

static void fp16_array(const uint8_t *src, int n, float *dst)
{
    for (int i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, src + 2 * i, 2);
        dst[i] = kvarn_fp16_to_fp32(h);
    }
}

void attn_ref_kvarn_tile(attn_rows *r, const kvarn_record_layout *L, const uint8_t *rec,
                         int t0, int nt)
{
    const int D = r->D, G = r->gs, kb = L->key_bits, vb = L->value_bits;
    float *ka = r->meta, *kbias = ka + D, *schan = kbias + D;
    float *stok = schan + D, *va = stok + G, *vbias = va + G;
    fp16_array(rec + L->k_a_off, D, ka);
    fp16_array(rec + L->k_b_off, D, kbias);
    fp16_array(rec + L->k_stok_off, G, stok);
    fp16_array(rec + L->v_schan_off, D, schan);
    fp16_array(rec + L->v_a_off, G, va);
    fp16_array(rec + L->v_b_off, G, vbias);
    const uint8_t *kc = rec + L->k_codes_off, *vc = rec + L->v_codes_off;
    const size_t krow = (size_t)L->tile_tokens * kb / 8, vrow = (size_t)D * vb / 8;

    /* score(t) = s_tok_t * (sum_d (q_d a_d) code[d,t] + sum_d q_d b_d) */
    for (int i = 0; i < r->n; i++) {
        const float *q = r->q + (size_t)i * D;
        float *qa = r->qa + (size_t)i * D, c = 0.0f;
        for (int d = 0; d < D; d++) {
            qa[d] = q[d] * ka[d];
            c += q[d] * kbias[d];
        }
        float *s = r->s + (size_t)i * G;
        for (int t = 0; t < nt; t++) s[t] = 0.0f;
        for (int d = 0; d < D; d++)
            for (int t = 0; t < nt; t++) s[t] += qa[d] * (float)code_at(kc + d * krow, t, kb);
        for (int t = 0; t < nt; t++) s[t] = stok[t] * (s[t] + c);
    }
    attn_softmax_update_ref(r, t0, nt);
    /* o[d] += s_chan_d * (sum_t (p_t a_t) code[t,d] + sum_t p_t b_t) */
    for (int i = 0; i < r->n; i++) {
        float *p = r->s + (size_t)i * G, *tmp = r->qa + (size_t)i * D, pb = 0.0f;
        for (int d = 0; d < D; d++) tmp[d] = 0.0f;
        for (int t = 0; t < nt; t++) {
            float w = p[t] * va[t];
            pb += p[t] * vbias[t];
            for (int d = 0; d < D; d++) tmp[d] += w * (float)code_at(vc + t * vrow, d, vb);
        }
        float *acc = r->acc + (size_t)i * D;
        for (int d = 0; d < D; d++) acc[d] += schan[d] * (tmp[d] + pb);
    }
}

/* ----------------------------------------------------- per-token blocks */

/* Element d of a per-token code array, before scale and zero-point: one
 * loader per kind (the kind's token kernel below passes its own). */
typedef float (*token_elem_fn)(const uint8_t *codes, int d);

static float elem_fp16(const uint8_t *codes, int d)
{
    uint16_t h;
    memcpy(&h, codes + 2 * d, 2);
    return kvarn_fp16_to_fp32(h);
}

static float elem_bf16(const uint8_t *codes, int d)
{
    uint16_t h;
    memcpy(&h, codes + 2 * d, 2);
    return kvarn_bf16_to_fp32(h);
}

static float elem_fp8_e4m3(const uint8_t *codes, int d) { return kvarn_fp8_e4m3_to_fp32(codes[d]); }
static float elem_fp8_e5m2(const uint8_t *codes, int d) { return kvarn_fp8_e5m2_to_fp32(codes[d]); }
static float elem_int8(const uint8_t *codes, int d) { return (float)codes[d]; }
static float elem_int4(const uint8_t *codes, int d) { return (float)code_at(codes, d, 4); }

/* Scale and zero-point of one K or V row (1 and 0 when the format has none). */
static void token_scale(const uint8_t *rec, size_t a_off, size_t a_bytes,
                        size_t b_off, size_t b_bytes, float *scale, float *zero)
{
    uint16_t h;
    *scale = 1.0f;
    *zero = 0.0f;
    if (a_bytes) { memcpy(&h, rec + a_off, 2); *scale = kvarn_fp16_to_fp32(h); }
    if (b_bytes) { memcpy(&h, rec + b_off, 2); *zero = kvarn_fp16_to_fp32(h); }
}

static inline void token_tile_ref(attn_rows *r, token_elem_fn token_elem,
                                  const kvarn_record_layout *L, const uint8_t *const *recs,
                                  int t0, int nt)
{
    const int D = r->D, G = r->gs;
    float *ks = r->meta, *kz = ks + G, *vs = kz + G, *vz = vs + G;
    for (int t = 0; t < nt; t++) {
        const uint8_t *rec = recs[t];
        token_scale(rec, L->k_a_off, L->k_a_bytes, L->k_b_off, L->k_b_bytes, &ks[t], &kz[t]);
        token_scale(rec, L->v_a_off, L->v_a_bytes, L->v_b_off, L->v_b_bytes, &vs[t], &vz[t]);
    }
    for (int i = 0; i < r->n; i++) {
        const float *q = r->q + (size_t)i * D;
        for (int t = 0; t < nt; t++) {
            const uint8_t *kc = recs[t] + L->k_codes_off;
            float dot = 0.0f;
            for (int d = 0; d < D; d++) dot += q[d] * token_elem(kc, d);
            r->s[(size_t)i * G + t] = ks[t] * dot + kz[t] * r->qsum[i];
        }
    }
    attn_softmax_update_ref(r, t0, nt);
    for (int i = 0; i < r->n; i++) {
        float *acc = r->acc + (size_t)i * D, *p = r->s + (size_t)i * G, pz = 0.0f;
        for (int t = 0; t < nt; t++) {
            const uint8_t *vc = recs[t] + L->v_codes_off;
            float w = p[t] * vs[t];
            pz += p[t] * vz[t];
            for (int d = 0; d < D; d++) acc[d] += w * token_elem(vc, d);
        }
        for (int d = 0; d < D; d++) acc[d] += pz;
    }
}

#define TOKEN_TILE_REF(KIND)                                                              \
    void attn_ref_token_##KIND(attn_rows *r, const kvarn_record_layout *L,                \
                               const uint8_t *const *rec, int t0, int nt)                 \
    {                                                                                     \
        token_tile_ref(r, elem_##KIND, L, rec, t0, nt);                                   \
    }
TOKEN_TILE_REF(fp16)
TOKEN_TILE_REF(bf16)
TOKEN_TILE_REF(fp8_e4m3)
TOKEN_TILE_REF(fp8_e5m2)
TOKEN_TILE_REF(int8)
TOKEN_TILE_REF(int4)
