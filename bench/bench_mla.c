/*
 * bench_mla.c -- what MLA records cost in attention quality (docs/mla.md):
 * absorbed attention over kvarn_mla_* records against attention over the
 * exact fp32 latent and rope, on synthetic latent-like data, for the
 * latent at 2, 4 and 8 bits and the rope at 8 and 16 bits; and the latent
 * quantized per channel (the K-style groups of the MLA record) against per
 * token (V-style: a KVarN V tile, kvarn_encode's V half).
 *
 *   build/bench_mla [n_seqs]        (default 4; prints a markdown table)
 *
 * Data (one sequence: 16 tiles of 128 tokens + a tail of 37, D 512, R 64,
 * 16 query heads, 2 query rows at the end):
 *  - latent c_t = gamma * RMSNorm(mu + z_t): mu a per-channel mean N(0,
 *    0.7^2), z_t = 4 shared directions with N(0, 1) weights + N(0, 0.6^2)
 *    noise, gamma log-normal (sigma 0.4) with 8 outlier channels x 8: unit
 *    RMS per token before gamma, a few large channels, as c_kv after its
 *    RMSNorm;
 *  - rope k_pe: pairs (x, y) with log-normal magnitudes per pair, rotated
 *    by t theta_i (theta_i = 10000^(-2i/R)): post-RoPE keys;
 *  - queries: q_lat_h = 1.5 (c_j - mean c) + N(0, 0.7^2) for a random
 *    earlier token j per head (a head that looks for something), q_pe_h
 *    likewise from k_pe_j; scale 1/sqrt(192) (DeepSeek's qk_head_dim).
 * Metrics per (row, head), averaged: KLD(p_exact || p_quant) of the
 * attention weights over the tokens (double, from the decoded records),
 * and the output's relative L2 error ||o_q - o|| / ||o||. The kvarn_mla_attn
 * column is that output error of the library's own call (its SIMD level),
 * which must agree with the decoded-record one.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvarn/kvarn.h"
#include "kvarn/mla.h"
#include "simd_env.h"

enum { D = 512, R = 64, G = 128, NT = 16, NTAIL = 37, T = NT * G + NTAIL, H = 16, NR = 2 };

static uint64_t rng_s = 0x9e3779b97f4a7c15ull;
static double uni(void)
{
    rng_s ^= rng_s << 13, rng_s ^= rng_s >> 7, rng_s ^= rng_s << 17;
    return ((rng_s >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}
static double gauss(void) { return sqrt(-2.0 * log(uni())) * cos(6.283185307179586 * uni()); }

static float lat[T * D], rope[T * R], q[NR * H * D], qpe[NR * H * R];

static void make_seq(void)
{
    static double mu[D], gam[D], dir[4][D];
    for (int d = 0; d < D; d++) {
        mu[d] = 0.7 * gauss();
        gam[d] = exp(0.4 * gauss()) * (d % 64 == 5 ? 8.0 : 1.0);
        for (int k = 0; k < 4; k++) dir[k][d] = gauss();
    }
    for (int t = 0; t < T; t++) {
        double x[D], w[4], ss = 0.0;
        for (int k = 0; k < 4; k++) w[k] = gauss();
        for (int d = 0; d < D; d++) {
            x[d] = mu[d] + 0.6 * gauss();
            for (int k = 0; k < 4; k++) x[d] += w[k] * dir[k][d] * 0.5;
            ss += x[d] * x[d];
        }
        const double inv = 1.0 / sqrt(ss / D + 1e-6);
        for (int d = 0; d < D; d++) lat[t * D + d] = (float)(gam[d] * x[d] * inv);
    }
    static double mag[R / 2];
    for (int i = 0; i < R / 2; i++) mag[i] = exp(0.5 * gauss());
    for (int t = 0; t < T; t++)
        for (int i = 0; i < R / 2; i++) {
            const double th = t * pow(10000.0, -2.0 * i / R);
            const double x = mag[i] * (1.0 + 0.5 * gauss()), y = mag[i] * 0.5 * gauss();
            rope[t * R + 2 * i] = (float)(x * cos(th) - y * sin(th));
            rope[t * R + 2 * i + 1] = (float)(x * sin(th) + y * cos(th));
        }
    double mean[D] = {0};
    for (int t = 0; t < T; t++)
        for (int d = 0; d < D; d++) mean[d] += lat[t * D + d] / T;
    for (int r = 0; r < NR * H; r++) {
        const int j = (int)(uni() * (T - NR));
        for (int d = 0; d < D; d++) q[r * D + d] = (float)(1.5 * (lat[j * D + d] - mean[d]) + 0.7 * gauss());
        for (int k = 0; k < R; k++) qpe[r * R + k] = (float)(1.5 * rope[j * R + k] + 0.7 * gauss());
    }
}

/* Attention weights p [T] and output o [D] of query row r over latent c,
 * rope k (double), seeing the first n tokens. */
static void attend(const float *c, const float *k, int r, int n, double *p, double *o)
{
    const double scale = 1.0 / sqrt(192.0);
    double m = -INFINITY, l = 0.0;
    for (int t = 0; t < n; t++) {
        double s = 0.0;
        for (int d = 0; d < D; d++) s += (double)q[r * D + d] * c[t * D + d];
        for (int j = 0; j < R; j++) s += (double)qpe[r * R + j] * k[t * R + j];
        p[t] = s * scale;
        m = fmax(m, p[t]);
    }
    for (int t = 0; t < n; t++) l += (p[t] = exp(p[t] - m));
    for (int d = 0; d < D; d++) o[d] = 0.0;
    for (int t = 0; t < n; t++) {
        p[t] /= l;
        for (int d = 0; d < D; d++) o[d] += p[t] * c[t * D + d];
    }
}

typedef struct acc { double kld, oerr, lib_oerr; int n; } acc;

/* Compare attention over (dl, dr) (decoded) to the exact one; and, when
 * recs is given, kvarn_mla_attn over the records. */
static void measure(const float *dl, const float *dr, const kvarn_mla_format *f,
                    const uint8_t *const *recs, void *ws, acc *a)
{
    static double pe[T], pq[T], oe[D], oq[D];
    static float lo[NR * H * D];
    int row_len[NR];
    for (int i = 0; i < NR; i++) row_len[i] = T - (NR - 1 - i);
    if (recs != NULL) {
        kvarn_status st = kvarn_mla_attn(f, D, R, recs, NT, lat + NT * G * D, rope + NT * G * R, NTAIL, q, qpe,
                                         NR, H, row_len, (float)(1.0 / sqrt(192.0)), lo, NULL, ws);
        if (st != KVARN_OK) {
            fprintf(stderr, "bench_mla: kvarn_mla_attn: %s\n", kvarn_strerror(st));
            exit(1);
        }
    }
    for (int i = 0; i < NR; i++)
        for (int h = 0; h < H; h++) {
            const int r = i * H + h;
            attend(lat, rope, r, row_len[i], pe, oe);
            attend(dl, dr, r, row_len[i], pq, oq);
            double kld = 0.0, e2 = 0.0, n2 = 0.0, l2 = 0.0;
            for (int t = 0; t < row_len[i]; t++)
                if (pe[t] > 0.0) kld += pe[t] * log(pe[t] / fmax(pq[t], 1e-300));
            for (int d = 0; d < D; d++) {
                e2 += (oq[d] - oe[d]) * (oq[d] - oe[d]);
                n2 += oe[d] * oe[d];
                if (recs) l2 += (lo[r * D + d] - oe[d]) * (lo[r * D + d] - oe[d]);
            }
            a->kld += kld;
            a->oerr += sqrt(e2 / n2);
            a->lib_oerr += recs ? sqrt(l2 / n2) : NAN;
            a->n++;
        }
}

int main(int argc, char **argv)
{
    if (simd_env_check("bench_mla")) return 2;
    const int n_seqs = argc > 1 ? atoi(argv[1]) : 4;
    if (n_seqs < 1 || n_seqs > 100) {
        fprintf(stderr, "usage: bench_mla [n_seqs 1..100]\n");
        return 2;
    }
    enum { NV = 10 };
    static const char *names[NV] = {
        "kvarn_mla_k2r8_g128", "kvarn_mla_k2r16_g128", "kvarn_mla_k4r8_g128", "kvarn_mla_k4r16_g128",
        "kvarn_mla_k8r8_g128", "kvarn_mla_k8r16_g128",
        /* the latent per token (V-style) against per channel, rope fp16 */
        "per-token k2 (V tile)", "per-token k4 (V tile)",
        /* the rope alone quantized: exact latent */
        "latent fp32, rope r8", "latent fp32, rope r16"};
    acc a[NV];
    memset(a, 0, sizeof a);
    static float dl[T * D], dr[T * R];
    static uint8_t *recs[NT];
    const uint8_t *recp[NT];
    const char *level = NULL;
    for (int sidx = 0; sidx < n_seqs; sidx++) {
        make_seq();
        for (int v = 0; v < NV; v++) {
            memcpy(dl, lat, sizeof lat);
            memcpy(dr, rope, sizeof rope);
            if (v < 6) {
                kvarn_mla_format f;
                if (kvarn_mla_format_parse(names[v], &f) != KVARN_OK) return 1;
                void *ws = malloc(kvarn_mla_workspace_bytes(&f, D, R, NR, H));
                for (int i = 0; i < NT; i++) {
                    recs[i] = realloc(recs[i], kvarn_mla_record_bytes(&f, D, R));
                    recp[i] = recs[i];
                    if (kvarn_mla_encode(&f, D, R, lat + i * G * D, rope + i * G * R, ws, recs[i]) != KVARN_OK ||
                        kvarn_mla_decode(&f, D, R, recs[i], dl + i * G * D, dr + i * G * R) != KVARN_OK)
                        return 1;
                }
                level = kvarn_mla_attn_kernel_name(&f, D);
                measure(dl, dr, &f, recp, ws, &a[v]);
                free(ws);
            } else if (v < 8) { /* latent as K (per channel) and V (per token) of one KVarN tile */
                kvarn_format kf;
                if (kvarn_format_parse(v == 6 ? "kvarn_k2v2_g128" : "kvarn_k4v4_g128", &kf) != KVARN_OK) return 1;
                const size_t rb = kvarn_record_bytes(&kf, D), wb = kvarn_encode_workspace_bytes(&kf, D);
                void *rec = malloc(rb), *ws = malloc(wb);
                for (int i = 0; i < NT; i++) {
                    if (kvarn_encode(&kf, D, lat + i * G * D, lat + i * G * D, rec, rb, ws, wb, NULL) != KVARN_OK ||
                        kvarn_decode(&kf, D, rec, rb, NULL, dl + i * G * D, 0) != KVARN_OK)
                        return 1;
                    for (int k = 0; k < G * R; k++) /* rope fp16 */
                        dr[i * G * R + k] = kvarn_fp16_to_fp32(kvarn_fp32_to_fp16(rope[i * G * R + k]));
                }
                measure(dl, dr, NULL, NULL, NULL, &a[v]);
                free(rec), free(ws);
            } else { /* rope alone: decode the rope part of an 8-bit-latent record */
                kvarn_mla_format f = {8, 128, v == 8 ? 8 : 16};
                void *ws = malloc(kvarn_mla_workspace_bytes(&f, D, R, 0, 0));
                uint8_t *rec = malloc(kvarn_mla_record_bytes(&f, D, R));
                for (int i = 0; i < NT; i++)
                    if (kvarn_mla_encode(&f, D, R, lat + i * G * D, rope + i * G * R, ws, rec) != KVARN_OK ||
                        kvarn_mla_decode(&f, D, R, rec, NULL, dr + i * G * R) != KVARN_OK)
                        return 1;
                measure(dl, dr, NULL, NULL, NULL, &a[v]);
                free(rec), free(ws);
            }
        }
    }
    printf("bench_mla: %d sequences of %d tokens (%d tiles of %d + a tail of %d), latent %d, rope %d, "
           "%d heads x %d rows; kvarn_mla_attn at level %s\n\n",
           n_seqs, T, NT, G, NTAIL, D, R, H, NR, level);
    printf("| latent / rope | bytes/token | KLD mean | out rel. err | kvarn_mla_attn out rel. err |\n");
    printf("|---|---|---|---|---|\n");
    for (int v = 0; v < NV; v++) {
        char bytes[32] = "-";
        kvarn_mla_format f;
        if (v < 6 && kvarn_mla_format_parse(names[v], &f) == KVARN_OK)
            snprintf(bytes, sizeof bytes, "%.1f", kvarn_mla_record_bytes(&f, D, R) / (double)G);
        char lib[32] = "-";
        if (v < 6) snprintf(lib, sizeof lib, "%.5f", a[v].lib_oerr / a[v].n);
        printf("| %s | %s | %.3g | %.5f | %s |\n", names[v], bytes, a[v].kld / a[v].n, a[v].oerr / a[v].n, lib);
    }
    for (int i = 0; i < NT; i++) free(recs[i]);
    return 0;
}
