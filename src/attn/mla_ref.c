/*
 * mla_ref.c -- the reference (oracle) tile kernels of the absorbed MLA
 * attention (mla_kernels.h): plain fp32 loops over dense rotated rows, in
 * the order the formulas are written.
 */
#include "attn/mla_kernels.h"

void attn_mla_ref_scores(const float *lat, const float *rope, int n, int D, int R,
                         const float *q_rot, const float *q_pe, float scale, float *sc)
{
    for (int t = 0; t < n; t++) {
        const float *c = lat + (size_t)t * (size_t)D;
        float s = 0.0f, r = 0.0f;
        for (int d = 0; d < D; d++) s += q_rot[d] * c[d];
        const float *kp = rope + (size_t)t * (size_t)R;
        for (int j = 0; j < R; j++) r += q_pe[j] * kp[j];
        sc[t] = scale * (s + r);
    }
}

void attn_mla_ref_accum(const float *lat, int n, int D, const float *p, float *acc)
{
    for (int t = 0; t < n; t++) {
        const float *c = lat + (size_t)t * (size_t)D;
        for (int d = 0; d < D; d++) acc[d] += p[t] * c[d];
    }
}
