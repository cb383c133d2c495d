/*
 * llama_ops.c -- the element-wise pieces of the llama forward pass (RMSNorm,
 * RoPE, SwiGLU). The weight matmul is in llama_weights.c.
 */
#include <math.h>

#include "model/llama_internal.h"

void llama_rmsnorm(const float *x, const float *w, float eps, int n, int dim,
                   float *y)
{
    for (int t = 0; t < n; t++) {
        const float *xr = x + (size_t)t * dim;
        float *yr = y + (size_t)t * dim;
        double ss = 0.0;
        for (int i = 0; i < dim; i++) ss += (double)xr[i] * xr[i];
        float r = (float)(1.0 / sqrt(ss / dim + (double)eps));
        for (int i = 0; i < dim; i++) yr[i] = xr[i] * r * w[i];
    }
}

void llama_rope_table(int pos, int n, int head_dim, float theta, float *cos_t,
                      float *sin_t)
{
    int half = head_dim / 2;
    for (int i = 0; i < half; i++) {
        /* theta^(-2i/D): the frequency of pair i. */
        double freq = pow((double)theta, -2.0 * i / head_dim);
        for (int t = 0; t < n; t++) {
            double a = (double)(pos + t) * freq;
            cos_t[(size_t)t * half + i] = (float)cos(a);
            sin_t[(size_t)t * half + i] = (float)sin(a);
        }
    }
}

void llama_rope_apply(float *x, int ld, int n, int n_heads, int head_dim,
                      const float *cos_t, const float *sin_t)
{
    int half = head_dim / 2;
    for (int t = 0; t < n; t++) {
        const float *c = cos_t + (size_t)t * half;
        const float *s = sin_t + (size_t)t * half;
        for (int h = 0; h < n_heads; h++) {
            float *p = x + (size_t)t * ld + (size_t)h * head_dim;
            for (int i = 0; i < half; i++) {
                float a = p[2 * i], b = p[2 * i + 1];
                p[2 * i] = a * c[i] - b * s[i];
                p[2 * i + 1] = a * s[i] + b * c[i];
            }
        }
    }
}

void llama_swiglu(const float *gu, int n, int ffn, float *act)
{
    for (int t = 0; t < n; t++) {
        const float *g = gu + (size_t)t * 2 * ffn;
        const float *u = g + ffn;
        float *a = act + (size_t)t * ffn;
        for (int j = 0; j < ffn; j++) a[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}
