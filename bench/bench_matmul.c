/*
 * bench_matmul.c -- the weight matmul of the llama runner on SmolLM2-135M's
 * shapes, Y[M][N] = X[M][K] W^T with W [N][K], in each way the weights can
 * be held: fp32 through OpenBLAS (sgemv for M = 1, sgemm otherwise), bf16
 * through OpenBLAS's cblas_sbgemm / cblas_sbgemv where this OpenBLAS exports
 * them (looked up at run time: Debian 12's 0.3.21 declares them in cblas.h
 * but is built without BUILD_BFLOAT16), bf16 and int8 through oneDNN's
 * matmul (when built with libdnnl-dev): with the weights in the layout
 * oneDNN prefers and M fixed at creation, and ("rt") with M given per call
 * and the weights in their plain [N][K] layout, as the llama runner holds
 * them; and kvarn's "gguf" weights (the file's own blocks: Q4_1 for the
 * layers, Q8_0 for the head, as SmolLM2's GGUF holds them) through the
 * runner's llama_matmul (M = 1: kvarn's GEMV at the CPU's SIMD level; M > 1:
 * slabs dequantized to fp32 and OpenBLAS sgemm), and for M = 1 the GEMV at
 * each SIMD level the CPU has ("gemv scalar" / "gemv avx2" / "gemv avx512").
 * Each row is a ratio to fp32 measured in the same run, formats
 * interleaved, median of --repeat rounds. Not a test.
 *
 *   bench_matmul [--m 1,128] [--repeat 5] [--stream 0|1]
 *
 * --stream 1: every variant holds 30 copies of each layer matrix (the
 * head: 1) and cycles through them, so that the weights come from memory
 * as in a decode step (SmolLM2's 30 layers), not from cache; the default
 * multiplies one matrix again and again (its weights in cache: it ranks
 * kernels, not decode steps). The "token" line sums 30 x each layer shape
 * + the head.
 *
 * Threads: OPENBLAS_NUM_THREADS for OpenBLAS, the same value for oneDNN
 * (OMP_NUM_THREADS) if set; kvarn's GEMV runs on the calling thread.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cblas.h>

#include "common/cpu.h"
#include "kvarn/kvarn.h"
#include "model/llama_internal.h"
#include "model/llama_qgemv.h"
#include "simd_env.h"

#ifdef KVARN_BENCH_DNNL
#include <oneapi/dnnl/dnnl.h>
#define HAVE_DNNL 1
#else
#define HAVE_DNNL 0
#endif

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef struct shape { const char *name; int n, k; } shape;
/* SmolLM2-135M: hidden 576, 9 heads / 3 KV heads of 64, ffn 1536, vocab
 * 49152; per token: 30 x (qkv, wo, gate_up, down) + the head once. */
static const shape SHAPES[] = {
    {"qkv", 960, 576}, {"wo", 576, 576}, {"gate_up", 3072, 576},
    {"down", 576, 1536}, {"head", 49152, 576},
};
#define NSHAPE (int)(sizeof SHAPES / sizeof SHAPES[0])

typedef void (*sbgemm_fn)(int, int, int, int, int, int, float, const uint16_t *, int,
                          const uint16_t *, int, float, float *, int);

enum { V_F32, V_SBGEMM, V_DNNL_RT, V_DNNL_BF16, V_DNNL_S8, V_GGUF, V_Q_REF, V_Q_AVX2,
       V_Q_AVX512, NV };
static const char *VNAME[NV] = {"fp32 sgemm/v", "bf16 sbgemm", "bf16 oneDNN rt",
                                "bf16 oneDNN", "int8 oneDNN", "gguf matmul", "gemv scalar",
                                "gemv avx2", "gemv avx512"};

#define MAX_COPIES 30

typedef struct job {
    int m, n, k;
    int copies, cur;   /* weight copies held per variant; the one in use */
    float *x, *y, *w[MAX_COPIES];
    uint16_t *wb, *xb;
    sbgemm_fn sbgemm;
    kvarn_llama *shell; /* gguf: a model shell for llama_matmul */
    llama_matrix q[MAX_COPIES];
    llama_mm_ctx qmm;   /* gguf: the session's matmul state */
#ifdef KVARN_BENCH_DNNL
    dnnl_engine_t eng;
    dnnl_stream_t strm;
    dnnl_primitive_t mm[2];
    dnnl_memory_t src[2], wei[2][MAX_COPIES], dst[2];
    int8_t *xs8;
    dnnl_primitive_t rt;
    dnnl_memory_t wrt;
#endif
} job;

#ifdef KVARN_BENCH_DNNL
#define DN(call) do { if ((call) != dnnl_success) { fprintf(stderr, "oneDNN: %s failed\n", #call); exit(1); } } while (0)

/* A matmul primitive src [m][k] (type st) x wei [k][n] (type wt, held in
 * the layout oneDNN prefers, reordered once from W [n][k]) -> dst f32. */
static void dnnl_setup(job *j, int idx, dnnl_data_type_t st, dnnl_data_type_t wt, void *xsrc,
                       const void *wsrc)
{
    dnnl_memory_desc_t smd, wmd, dmd, wuser;
    dnnl_dims_t sd = {j->m, j->k}, wd = {j->k, j->n}, dd = {j->m, j->n};
    DN(dnnl_memory_desc_init_by_tag(&smd, 2, sd, st, dnnl_ab));
    DN(dnnl_memory_desc_init_by_tag(&wmd, 2, wd, wt, dnnl_format_tag_any));
    DN(dnnl_memory_desc_init_by_tag(&dmd, 2, dd, dnnl_f32, dnnl_ab));
    DN(dnnl_memory_desc_init_by_tag(&wuser, 2, wd, wt, dnnl_ba));
    dnnl_matmul_desc_t md;
    DN(dnnl_matmul_desc_init(&md, &smd, &wmd, NULL, &dmd));
    dnnl_primitive_attr_t attr;
    DN(dnnl_primitive_attr_create(&attr));
    if (st == dnnl_s8) {
        float sc = 1.0f / 127.0f;
        DN(dnnl_primitive_attr_set_output_scales(attr, 1, 0, &sc));
    }
    dnnl_primitive_desc_t pd;
    DN(dnnl_primitive_desc_create(&pd, &md, attr, j->eng, NULL));
    DN(dnnl_primitive_create(&j->mm[idx], pd));
    const dnnl_memory_desc_t *wq = dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
    DN(dnnl_memory_create(&j->src[idx], &smd, j->eng, xsrc));
    DN(dnnl_memory_create(&j->dst[idx], &dmd, j->eng, j->y));
    dnnl_memory_t wu;
    DN(dnnl_memory_create(&wu, &wuser, j->eng, (void *)wsrc));
    dnnl_primitive_desc_t rpd;
    dnnl_primitive_t r;
    DN(dnnl_reorder_primitive_desc_create(&rpd, &wuser, j->eng, wq, j->eng, NULL));
    DN(dnnl_primitive_create(&r, rpd));
    for (int c = 0; c < j->copies; c++) {
        DN(dnnl_memory_create(&j->wei[idx][c], wq, j->eng, DNNL_MEMORY_ALLOCATE));
        dnnl_exec_arg_t ra[2] = {{DNNL_ARG_FROM, wu}, {DNNL_ARG_TO, j->wei[idx][c]}};
        DN(dnnl_primitive_execute(r, j->strm, 2, ra));
        DN(dnnl_stream_wait(j->strm));
    }
    dnnl_primitive_destroy(r);
    dnnl_primitive_desc_destroy(rpd);
    dnnl_memory_destroy(wu);
    dnnl_primitive_desc_destroy(pd);
    dnnl_primitive_attr_destroy(attr);
}

/* The runtime-M primitive on the plain [N][K] bf16 weights. */
static void dnnl_setup_rt(job *j)
{
    dnnl_memory_desc_t smd, wmd, dmd;
    dnnl_dims_t sd = {DNNL_RUNTIME_DIM_VAL, j->k}, wd = {j->k, j->n},
                dd = {DNNL_RUNTIME_DIM_VAL, j->n};
    DN(dnnl_memory_desc_init_by_tag(&smd, 2, sd, dnnl_bf16, dnnl_ab));
    DN(dnnl_memory_desc_init_by_tag(&wmd, 2, wd, dnnl_bf16, dnnl_ba));
    DN(dnnl_memory_desc_init_by_tag(&dmd, 2, dd, dnnl_f32, dnnl_ab));
    dnnl_matmul_desc_t md;
    DN(dnnl_matmul_desc_init(&md, &smd, &wmd, NULL, &dmd));
    dnnl_primitive_desc_t pd;
    DN(dnnl_primitive_desc_create(&pd, &md, NULL, j->eng, NULL));
    DN(dnnl_primitive_create(&j->rt, pd));
    DN(dnnl_memory_create(&j->wrt, &wmd, j->eng, j->wb));
    dnnl_primitive_desc_destroy(pd);
}

static void dnnl_run(job *j, int idx)
{
    dnnl_exec_arg_t a[3] = {{DNNL_ARG_SRC, j->src[idx]}, {DNNL_ARG_WEIGHTS, j->wei[idx][j->cur]},
                            {DNNL_ARG_DST, j->dst[idx]}};
    DN(dnnl_primitive_execute(j->mm[idx], j->strm, 3, a));
    DN(dnnl_stream_wait(j->strm));
}
#endif

static int have(const job *j, int v)
{
    if (v == V_SBGEMM) return j->sbgemm != NULL && j->copies == 1;
    if (v == V_DNNL_RT) return j->copies == 1 && HAVE_DNNL;
    if (v >= V_Q_REF) /* the raw kernels: one token, levels this CPU has */
        return j->m == 1 && (int)kvarn__cpu_level() >= v - V_Q_REF;
#ifndef KVARN_BENCH_DNNL
    if (v == V_DNNL_BF16 || v == V_DNNL_S8 || v == V_DNNL_RT) return 0;
#endif
    return 1;
}

static void run(job *j, int v)
{
    size_t mk = (size_t)j->m * j->k;
    const float *w = j->w[j->cur];
    switch (v) {
    case V_F32:
        if (j->m == 1)
            cblas_sgemv(CblasRowMajor, CblasNoTrans, j->n, j->k, 1.0f, w, j->k, j->x, 1,
                        0.0f, j->y, 1);
        else
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, j->m, j->n, j->k, 1.0f, j->x,
                        j->k, w, j->k, 0.0f, j->y, j->n);
        break;
    case V_GGUF:
        if (llama_matmul(&j->qmm, j->x, j->m, &j->q[j->cur], j->y) != KVARN_OK) exit(1);
        break;
    case V_Q_REF:
    case V_Q_AVX2:
    case V_Q_AVX512: {
        const llama_matrix *q = &j->q[j->cur];
        llama_qkernels_get(q->qtype, (kvarn_cpu_level)(v - V_Q_REF))
            ->gemv(q->q, q->row_bytes, q->in, j->x, j->y, q->out);
        break;
    }
    case V_SBGEMM:
        /* activations rounded to bf16 each call: part of the cost */
        for (size_t i = 0; i < mk; i++) j->xb[i] = kvarn_fp32_to_bf16(j->x[i]);
        j->sbgemm(CblasRowMajor, CblasNoTrans, CblasTrans, j->m, j->n, j->k, 1.0f, j->xb,
                  j->k, j->wb, j->k, 0.0f, j->y, j->n);
        break;
#ifdef KVARN_BENCH_DNNL
    case V_DNNL_BF16:
        for (size_t i = 0; i < mk; i++) j->xb[i] = kvarn_fp32_to_bf16(j->x[i]);
        dnnl_run(j, 0);
        break;
    case V_DNNL_RT: {
        /* runtime M, weights in their plain [N][K] bf16 layout: memory
         * objects made per call, as a forward pass with any chunk size would */
        for (size_t i = 0; i < mk; i++) j->xb[i] = kvarn_fp32_to_bf16(j->x[i]);
        dnnl_memory_desc_t smd, dmd;
        dnnl_dims_t sd = {j->m, j->k}, dd = {j->m, j->n};
        DN(dnnl_memory_desc_init_by_tag(&smd, 2, sd, dnnl_bf16, dnnl_ab));
        DN(dnnl_memory_desc_init_by_tag(&dmd, 2, dd, dnnl_f32, dnnl_ab));
        dnnl_memory_t sm, dm;
        DN(dnnl_memory_create(&sm, &smd, j->eng, j->xb));
        DN(dnnl_memory_create(&dm, &dmd, j->eng, j->y));
        dnnl_exec_arg_t a[3] = {{DNNL_ARG_SRC, sm}, {DNNL_ARG_WEIGHTS, j->wrt},
                                {DNNL_ARG_DST, dm}};
        DN(dnnl_primitive_execute(j->rt, j->strm, 3, a));
        DN(dnnl_stream_wait(j->strm));
        dnnl_memory_destroy(sm);
        dnnl_memory_destroy(dm);
        break;
    }
    case V_DNNL_S8: {
        /* activations quantized per row (symmetric, 127 steps): part of the cost */
        for (int r = 0; r < j->m; r++) {
            const float *xr = j->x + (size_t)r * j->k;
            float amax = 0.0f;
            for (int i = 0; i < j->k; i++) amax = fmaxf(amax, fabsf(xr[i]));
            float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            for (int i = 0; i < j->k; i++)
                j->xs8[(size_t)r * j->k + i] = (int8_t)lrintf(xr[i] * inv);
        }
        dnnl_run(j, 1);
        break;
    }
#endif
    default:
        break;
    }
}

static int parse_list(const char *s, long *out, int max)
{
    int n = 0;
    while (*s && n < max) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < 1) return -1;
        out[n++] = v;
        if (*end != ',' && *end != '\0') return -1;
        s = *end == ',' ? end + 1 : end;
    }
    return n;
}

int main(int argc, char **argv)
{
    if (simd_env_check("bench_matmul")) return 2; /* KVARN_SIMD names no level */
    long ms[8] = {1, 128};
    int n_m = 2;
    long repeat = 5, stream = 0;
    static const char usage[] = "usage: bench_matmul [--m 1,128] [--repeat 5] [--stream 0|1]\n";
    for (int i = 1; i < argc; i += 2) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) { fputs(usage, stdout); return 0; }
        if (i + 1 >= argc) {
            fprintf(stderr, "bench_matmul: %s needs a value\n%s", argv[i], usage);
            return 2;
        }
        if (!strcmp(argv[i], "--m")) { if ((n_m = parse_list(argv[i + 1], ms, 8)) <= 0) return 2; }
        else if (!strcmp(argv[i], "--repeat")) repeat = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--stream")) stream = atol(argv[i + 1]);
        else { fprintf(stderr, "bench_matmul: unknown option %s\n%s", argv[i], usage); return 2; }
    }
    if (repeat < 1 || repeat > 99 || stream < 0 || stream > 1) return 2;
    printf("kvarn SIMD level: %s; %s\n", kvarn__cpu_level_name(kvarn__cpu_level()),
           stream ? "--stream 1: 30 copies of each layer matrix, weights from memory"
                  : "one copy of each matrix (weights in cache)");
    sbgemm_fn sb = (sbgemm_fn)(uintptr_t)dlsym(RTLD_DEFAULT, "cblas_sbgemm");
    printf("OpenBLAS cblas_sbgemm: %s\n", sb ? "exported" : "not exported by this OpenBLAS (built without BUILD_BFLOAT16)");
#ifndef KVARN_BENCH_DNNL
    printf("oneDNN: not built in (libdnnl-dev absent at configure time)\n");
#endif
    srand(1);
    printf("%-8s %5s %6s %6s", "shape", "M", "N", "K");
    for (int v = 0; v < NV; v++) printf(" %14s", VNAME[v]);
    printf("\n");
    double tot[8][NV] = {{0}};
    int nshapes[8][NV] = {{0}}; /* shapes a variant ran on: the token line
                                   needs all of them */
    for (int mi = 0; mi < n_m; mi++) {
        for (int s = 0; s < NSHAPE; s++) {
            job j = {0};
            j.m = (int)ms[mi];
            j.n = SHAPES[s].n;
            j.k = SHAPES[s].k;
            j.sbgemm = sb;
            j.copies = stream && s < NSHAPE - 1 ? MAX_COPIES : 1;
            size_t nk = (size_t)j.n * j.k, mk = (size_t)j.m * j.k;
            for (int c = 0; c < j.copies; c++) {
                j.w[c] = aligned_alloc(64, ((nk * 4) + 63) & ~(size_t)63);
                if (!j.w[c]) return 1;
            }
            j.wb = aligned_alloc(64, ((nk * 2) + 63) & ~(size_t)63);
            j.x = malloc(mk * 4);
            j.xb = malloc(mk * 2);
            j.y = malloc((size_t)j.m * j.n * 4);
            int8_t *ws8 = malloc(nk);
            if (!j.wb || !j.x || !j.xb || !j.y || !ws8) return 1;
            /* gguf: Q4_1 blocks for the layers, Q8_0 for the head (as the
             * file), random codes and scales about the weights' size */
            kvarn_ggml_type qt = s == NSHAPE - 1 ? KVARN_GGML_Q8_0 : KVARN_GGML_Q4_1;
            j.shell = calloc(1, sizeof *j.shell);
            if (!j.shell || kvarn__alloc_init(&j.shell->alloc, NULL) != KVARN_OK) return 1;
            j.shell->weights = KVARN_LLAMA_WEIGHTS_GGUF;
            for (int c = 0; c < j.copies; c++) {
                if (llama_matrix_alloc_q(j.shell, &j.q[c], j.n, j.k, qt) != KVARN_OK) return 1;
                size_t qb = j.q[c].row_bytes * (size_t)j.n;
                uint32_t bb = kvarn_ggml_block_bytes(qt);
                for (size_t b = 0; b < qb; b++) j.q[c].q[b] = (uint8_t)rand();
                for (size_t b = 0; b < qb; b += bb) { /* scale, min: fp16 ~ 1/64 */
                    uint16_t h = kvarn_fp32_to_fp16((float)rand() / RAND_MAX / 64.0f);
                    memcpy(j.q[c].q + b, &h, 2);
                    if (qt == KVARN_GGML_Q4_1) memcpy(j.q[c].q + b + 2, &h, 2);
                }
            }
            if (llama_mm_ctx_create(j.shell, &j.shell->alloc, j.m, j.k, 1, &j.qmm) != KVARN_OK)
                return 1;
            for (size_t i = 0; i < nk; i++) {
                j.w[0][i] = (float)rand() / RAND_MAX - 0.5f;
                j.wb[i] = kvarn_fp32_to_bf16(j.w[0][i]);
                ws8[i] = (int8_t)(rand() % 255 - 127);
            }
            for (int c = 1; c < j.copies; c++) memcpy(j.w[c], j.w[0], nk * 4);
            for (size_t i = 0; i < mk; i++) j.x[i] = (float)rand() / RAND_MAX - 0.5f;
#ifdef KVARN_BENCH_DNNL
            j.xs8 = malloc(mk);
            DN(dnnl_engine_create(&j.eng, dnnl_cpu, 0));
            DN(dnnl_stream_create(&j.strm, j.eng, dnnl_stream_default_flags));
            dnnl_setup(&j, 0, dnnl_bf16, dnnl_bf16, j.xb, j.wb);
            dnnl_setup(&j, 1, dnnl_s8, dnnl_s8, j.xs8, ws8);
            dnnl_setup_rt(&j);
#endif
            /* iterations: about 20 ms of fp32 work per round */
            double t0 = now();
            int it = 0;
            do { run(&j, V_F32); j.cur = (j.cur + 1) % j.copies; it++; } while (now() - t0 < 0.02);
            it = (it + j.copies - 1) / j.copies * j.copies; /* whole cycles */
            double med[NV];
            double *rt = malloc(sizeof(double) * (size_t)repeat * NV);
            for (long r = 0; r < repeat; r++)
                for (int v = 0; v < NV; v++) {
                    if (!have(&j, v)) continue;
                    run(&j, v); /* warm */
                    double a = now();
                    for (int i = 0; i < it; i++) {
                        j.cur = i % j.copies;
                        run(&j, v);
                    }
                    rt[v * repeat + r] = (now() - a) / it;
                }
            for (int v = 0; v < NV; v++) {
                if (!have(&j, v)) { med[v] = 0; continue; }
                qsort(rt + v * repeat, (size_t)repeat, sizeof(double), cmp_d);
                med[v] = rt[v * repeat + repeat / 2];
                tot[mi][v] += med[v] * (s == NSHAPE - 1 ? 1 : 30);
                nshapes[mi][v]++;
            }
            printf("%-8s %5d %6d %6d %11.1f us", SHAPES[s].name, j.m, j.n, j.k, med[0] * 1e6);
            for (int v = 1; v < NV; v++) {
                if (have(&j, v)) printf(" %13.2fx", med[0] / med[v]);
                else printf(" %14s", "-");
            }
            printf("\n");
            free(rt);
#ifdef KVARN_BENCH_DNNL
            for (int i = 0; i < 2; i++) {
                dnnl_primitive_destroy(j.mm[i]);
                dnnl_memory_destroy(j.src[i]);
                for (int c = 0; c < j.copies; c++) dnnl_memory_destroy(j.wei[i][c]);
                dnnl_memory_destroy(j.dst[i]);
            }
            dnnl_primitive_destroy(j.rt);
            dnnl_memory_destroy(j.wrt);
            dnnl_stream_destroy(j.strm);
            dnnl_engine_destroy(j.eng);
            free(j.xs8);
#endif
            llama_mm_ctx_destroy(&j.shell->alloc, &j.qmm);
            for (int c = 0; c < j.copies; c++) {
                free(j.w[c]);
                llama_matrix_free(j.shell, &j.q[c]);
            }
            free(j.shell);
            free(j.wb); free(j.x); free(j.xb); free(j.y); free(ws8);
        }
        printf("%-8s %5ld %13s %11.2f ms", "token", ms[mi], "(30 layers+head)", tot[mi][0] * 1e3);
        for (int v = 1; v < NV; v++) {
            if (tot[mi][v] > 0 && nshapes[mi][v] == NSHAPE) printf(" %13.2fx", tot[mi][0] / tot[mi][v]);
            else printf(" %14s", "-");
        }
        printf("\n");
    }
    return 0;
}
