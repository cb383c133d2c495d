/* gpu_bench.c -- checks and timings of the CUDA backend on a GPU machine
 * (bench/gpu/run.sh drives it; docs/gpu-notes.md explains the numbers).
 *
 *   gpu_bench plan  [--format F] [--batch B] [--ctx C] [--hq 32] [--hk 8] [--d 128]
 *       host only: the split-K plan, workspace and bytes one decode step
 *       reads, for the shapes given (no GPU needed).
 *   gpu_bench time  --format F --batch B --ctx C [--hq 32] [--hk 8] [--d 128]
 *                   [--warmup 10] [--iters 50] [--queries 1]
 *       builds a paged cache of B sequences of C tokens (KVarN: one fp16
 *       sink tile per sequence, every other tile committed; ids shuffled),
 *       times decode attention with CUDA events (median of --iters after
 *       --warmup) and a device-to-device copy of the bytes attention reads;
 *       prints one CSV line:
 *       time,format,batch,ctx,splits,attn_ms,bytes_read,attn_GBps,copy_ms
 *       With --queries Q > 1: a prefill chunk instead, the last Q tokens of
 *       each sequence as queries (causal), timed with the tensor-core
 *       kernel where it serves and again with KVARN_CUDA_MATRIX=0 (the
 *       vector kernel), one CSV line:
 *       prefill,format,batch,ctx,queries,splits,matrix_ms,vector_ms,vector/matrix
 *   gpu_bench dump  --dump FILE --format F [--layers 4] [--gqa 3]
 *       real K/V (docs/kv-dump.md): every layer asked for is stored and
 *       committed on the GPU; records are compared with kvarn_encode
 *       (differing codes, scales within rtol 0.02 / atol 0.1) and decode /
 *       multi-query attention with a double reference over the same
 *       records (cosine >= 0.9999, rel err < 1e-3). Exit status 1 on a
 *       failed check. Queries are the dump's own keys (GQA: each KV head's
 *       key rows perturbed once per query head).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "kvarn/cuda.h"
#include "kvarn/kvarn.h"
#include "kvarn/record.h"

typedef struct opts {
    const char *mode, *format, *dump;
    int batch, ctx, hq, hk, d, warmup, iters, layers, gqa, queries;
} opts;

static int die(const char *what)
{
    fprintf(stderr, "gpu_bench: %s\n", what);
    return 2;
}

#define CK(call)                                                                      \
    do {                                                                              \
        cudaError_t e_ = (call);                                                      \
        if (e_ != cudaSuccess) {                                                      \
            fprintf(stderr, "gpu_bench: %s: %s\n", #call, cudaGetErrorString(e_));    \
            exit(2);                                                                  \
        }                                                                             \
    } while (0)

#define KV(call)                                                                      \
    do {                                                                              \
        kvarn_status s_ = (call);                                                     \
        if (s_ != KVARN_OK) {                                                         \
            fprintf(stderr, "gpu_bench: %s: %s\n", #call, kvarn_strerror(s_));        \
            exit(2);                                                                  \
        }                                                                             \
    } while (0)

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rng_u64(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double rng_normal(void)
{
    double u1 = ((rng_u64() >> 11) + 1.0) * (1.0 / 9007199254740993.0);
    double u2 = (rng_u64() >> 11) * (1.0 / 9007199254740992.0);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

static void shuffle(int32_t *a, int n)
{
    for (int i = n - 1; i > 0; i--) {
        int j = (int)(rng_u64() % (uint64_t)(i + 1));
        int32_t t = a[i];
        a[i] = a[j];
        a[j] = t;
    }
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) { fprintf(stderr, "gpu_bench: out of host memory\n"); exit(2); }
    return p;
}

static void *dmalloc(size_t n)
{
    void *p = NULL;
    CK(cudaMalloc(&p, n ? n : 16));
    return p;
}

/* The paged-cache description of one layer: records packed back to back,
 * block = Hk records (per-token: G token records per head). */
static kvarn_paged_kv describe(const kvarn_format *f, int D, int Hk, int n_blocks,
                                    int n_pages)
{
    kvarn_paged_kv kv;
    memset(&kv, 0, sizeof kv);
    kv.fmt = *f;
    kv.head_dim = D;
    kv.n_kv_heads = Hk;
    const int kvarn = f->kind == KVARN_KIND_KVARN;
    kv.block_size = kvarn ? f->tile_tokens : 16;
    kv.sink_tiles = kvarn ? 1 : 0;
    size_t rec = kvarn_record_bytes(f, D);
    if (kvarn) kv.record_stride = rec;
    else { kv.token_record_bytes = rec; kv.record_stride = rec * (size_t)kv.block_size; }
    kv.block_stride = kv.record_stride * (size_t)Hk;
    kv.n_blocks = n_blocks;
    kv.n_fp16_pages = kvarn ? n_pages : 0;
    kvarn_paged_pack_pages(&kv);
    return kv;
}

/* Bytes one decode step reads for B sequences of C tokens: records (or
 * token records) of every quantized tile, fp16 pages of the sink and tail
 * tiles, the queries and the outputs. */
static double step_bytes(const kvarn_paged_kv *kv, int B, int C, int Hq)
{
    const int G = kv->block_size, tiles = (C + G - 1) / G, D = kv->head_dim;
    const int kvarn = kv->fmt.kind == KVARN_KIND_KVARN;
    const int pages = kvarn ? (tiles < 1 ? 0 : 1 + (C % G ? 1 : 0)) : 0;
    const double rec = (double)kv->record_stride; /* one tile of one KV head */
    double per_seq = (double)(tiles - pages) * rec * kv->n_kv_heads +
                     (double)pages * 2.0 * G * D * 2.0 * kv->n_kv_heads;
    return B * (per_seq + 2.0 * Hq * D * 4.0);
}

static int cmd_plan(const opts *o)
{
    kvarn_format f;
    if (kvarn_format_parse(o->format, &f) != KVARN_OK) return die("unknown --format");
    const int G = f.kind == KVARN_KIND_KVARN ? f.tile_tokens : 16;
    const int tiles = (o->ctx + G - 1) / G;
    static _Alignas(64) uint8_t fake[64];
    kvarn_paged_kv kv = describe(&f, o->d, o->hk, o->batch * tiles, o->batch);
    kv.blocks = fake;
    kv.fp16_pages = (uint16_t *)(void *)fake;
    kvarn_status st = kvarn_cuda_check_kv(&kv);
    if (st != KVARN_OK) {
        fprintf(stderr, "gpu_bench: %s D=%d: %s\n", o->format, o->d, kvarn_strerror(st));
        return 2;
    }
    kvarn_cuda_attn_shape sh = {o->batch, o->hq, tiles + 1, o->ctx, 1, 0, 1.0f / sqrtf((float)o->d)};
    kvarn_cuda_attn_plan p;
    KV(kvarn_cuda_attn_plan_make(&kv, &sh, 132, &p)); /* H200: 132 SMs */
    const double bytes = step_bytes(&kv, o->batch, o->ctx, o->hq);
    printf("plan,%s,%d,%d,splits=%d,workspace=%zu,bytes_read=%.0f,predicted_us_at_4.8TBps=%.1f\n",
           f.name, o->batch, o->ctx, p.num_splits, p.workspace_bytes, bytes, bytes / 4.8e12 * 1e6);
    return 0;
}

static double median(float *v, int n)
{
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && v[j - 1] > v[j]; j--) {
            float t = v[j]; v[j] = v[j - 1]; v[j - 1] = t;
        }
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Median ms of o->iters attention calls after o->warmup, CUDA events
 * around each (ms: scratch [o->iters]). */
static double time_attention(const opts *o, const kvarn_paged_kv *kv, const kvarn_cuda_attn_plan *plan,
                             const kvarn_cuda_attn_args *args, void *ws, cudaStream_t stream,
                             cudaEvent_t e0, cudaEvent_t e1, float *ms)
{
    for (int i = 0; i < o->warmup + o->iters; i++) {
        CK(cudaEventRecord(e0, stream));
        KV(kvarn_cuda_attention(kv, plan, args, ws, plan->workspace_bytes, stream));
        CK(cudaEventRecord(e1, stream));
        CK(cudaEventSynchronize(e1));
        if (i >= o->warmup) CK(cudaEventElapsedTime(&ms[i - o->warmup], e0, e1));
    }
    return median(ms, o->iters);
}

static int cmd_time(const opts *o)
{
    kvarn_format f;
    if (kvarn_format_parse(o->format, &f) != KVARN_OK) return die("unknown --format");
    const int kvarn = f.kind == KVARN_KIND_KVARN;
    const int B = o->batch, C = o->ctx, Hk = o->hk, Hq = o->hq, D = o->d;
    const int G = kvarn ? f.tile_tokens : 16, tiles = (C + G - 1) / G;
    const int n_blocks = B * tiles, n_pages = kvarn ? B * 2 : 1;
    kvarn_paged_kv kv = describe(&f, D, Hk, n_blocks, n_pages);
    const size_t arena = kv.block_stride * (size_t)n_blocks;
    const size_t page_bytes = kv.page_stride;
    kv.blocks = dmalloc(arena);
    kv.fp16_pages = kvarn ? dmalloc(page_bytes * n_pages) : NULL;
    KV(kvarn_cuda_check_kv(&kv));

    /* Fill: store one chunk of random tokens (KVarN: into pages, then
     * commit them), then replicate that chunk's bytes over the arena. */
    const int chunk_tiles = tiles < 256 ? tiles : 256;
    const int chunk_tok = chunk_tiles * G;
    const size_t elems = (size_t)chunk_tok * Hk * D;
    uint16_t *hk16 = xmalloc(2 * elems), *hv16 = xmalloc(2 * elems);
    for (size_t i = 0; i < elems; i++) {
        hk16[i] = kvarn_fp32_to_fp16((float)rng_normal());
        hv16[i] = kvarn_fp32_to_fp16((float)(0.5 * rng_normal()));
    }
    void *dk = dmalloc(2 * elems), *dv = dmalloc(2 * elems);
    CK(cudaMemcpy(dk, hk16, 2 * elems, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dv, hv16, 2 * elems, cudaMemcpyHostToDevice));
    int64_t *slots = xmalloc(sizeof(int64_t) * chunk_tok);
    int64_t *dslots = dmalloc(sizeof(int64_t) * chunk_tok);
    if (kvarn) {
        /* chunk tile i goes through page (i % n_pages) and commits to block i */
        int32_t *src = xmalloc(sizeof(int32_t) * chunk_tiles), *dst = xmalloc(sizeof(int32_t) * chunk_tiles);
        int32_t *dsrc = dmalloc(sizeof(int32_t) * chunk_tiles), *ddst = dmalloc(sizeof(int32_t) * chunk_tiles);
        for (int i0 = 0; i0 < chunk_tiles; i0 += n_pages) {
            const int n = chunk_tiles - i0 < n_pages ? chunk_tiles - i0 : n_pages;
            for (int t = 0; t < n * G; t++) slots[t] = kvarn_paged_slot(t / G, G, t % G);
            for (int i = 0; i < n; i++) { src[i] = i; dst[i] = i0 + i; }
            CK(cudaMemcpy(dslots, slots, sizeof(int64_t) * n * G, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(dsrc, src, sizeof(int32_t) * n, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(ddst, dst, sizeof(int32_t) * n, cudaMemcpyHostToDevice));
            const size_t off = (size_t)i0 * G * Hk * D;
            KV(kvarn_cuda_store(&kv, KVARN_CUDA_F16, (uint16_t *)dk + off, (uint16_t *)dv + off, dslots, n * G, NULL));
            KV(kvarn_cuda_commit(&kv, dsrc, ddst, n, NULL, NULL));
        }
        /* the sink pages (page p = 2s) and spare pages hold real rows too */
        for (int p = 0; p < n_pages; p++) {
            for (int t = 0; t < G; t++) slots[t] = kvarn_paged_slot(p, G, t);
            CK(cudaMemcpy(dslots, slots, sizeof(int64_t) * G, cudaMemcpyHostToDevice));
            KV(kvarn_cuda_store(&kv, KVARN_CUDA_F16, dk, dv, dslots, G, NULL));
        }
        CK(cudaDeviceSynchronize());
        free(src); free(dst); CK(cudaFree(dsrc)); CK(cudaFree(ddst));
    } else {
        for (int t = 0; t < chunk_tok; t++) slots[t] = t;
        CK(cudaMemcpy(dslots, slots, sizeof(int64_t) * chunk_tok, cudaMemcpyHostToDevice));
        KV(kvarn_cuda_store(&kv, KVARN_CUDA_F16, dk, dv, dslots, chunk_tok, NULL));
    }
    const size_t chunk_bytes = kv.block_stride * (size_t)chunk_tiles;
    for (size_t off = chunk_bytes; off < arena; off += chunk_bytes) {
        size_t n = arena - off < chunk_bytes ? arena - off : chunk_bytes;
        CK(cudaMemcpy((uint8_t *)kv.blocks + off, kv.blocks, n, cudaMemcpyDeviceToDevice));
    }
    CK(cudaDeviceSynchronize());

    /* Block tables: shuffled block ids; KVarN tile 0 is the sink page 2s. */
    const int MB = tiles + 1;
    int32_t *ids = xmalloc(sizeof(int32_t) * n_blocks), *table = xmalloc(sizeof(int32_t) * B * MB);
    for (int i = 0; i < n_blocks; i++) ids[i] = i;
    shuffle(ids, n_blocks);
    int32_t *lens = xmalloc(sizeof(int32_t) * B), *committed = xmalloc(sizeof(int32_t) * B);
    for (int s = 0; s < B; s++) {
        for (int i = 0; i < MB; i++) table[s * MB + i] = i < tiles ? ids[s * tiles + i] : -1;
        if (kvarn) table[s * MB] = 2 * s;
        if (kvarn && C % G) table[s * MB + tiles - 1] = 2 * s + 1;
        lens[s] = C;
        committed[s] = kvarn ? C / G : tiles;
    }
    const int Q = o->queries, nq = B * Q; /* Q > 1: a prefill chunk per sequence */
    float *hq = xmalloc(sizeof(float) * nq * Hq * D);
    for (int i = 0; i < nq * Hq * D; i++) hq[i] = (float)rng_normal();
    int32_t *qsl = xmalloc(sizeof(int32_t) * (B + 1));
    for (int s = 0; s <= B; s++) qsl[s] = s * Q;
    int32_t *dtab = dmalloc(sizeof(int32_t) * B * MB), *dlens = dmalloc(sizeof(int32_t) * B);
    int32_t *dcom = dmalloc(sizeof(int32_t) * B), *dqsl = dmalloc(sizeof(int32_t) * (B + 1));
    float *dq = dmalloc(sizeof(float) * nq * Hq * D), *dout = dmalloc(sizeof(float) * nq * Hq * D);
    CK(cudaMemcpy(dtab, table, sizeof(int32_t) * B * MB, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dlens, lens, sizeof(int32_t) * B, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dcom, committed, sizeof(int32_t) * B, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dqsl, qsl, sizeof(int32_t) * (B + 1), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dq, hq, sizeof(float) * nq * Hq * D, cudaMemcpyHostToDevice));

    int sms = 0;
    KV(kvarn_cuda_sm_count(0, &sms));
    kvarn_cuda_attn_shape sh = {B, Hq, MB, C, Q, 0, 1.0f / sqrtf((float)D)};
    kvarn_cuda_attn_plan plan;
    KV(kvarn_cuda_attn_plan_make(&kv, &sh, sms, &plan));
    void *ws = plan.workspace_bytes ? dmalloc(plan.workspace_bytes) : NULL;
    kvarn_cuda_attn_args args = {dq, dout, dtab, dlens, kvarn ? dcom : NULL, Q > 1 ? dqsl : NULL, NULL};

    cudaStream_t stream;
    CK(cudaStreamCreate(&stream));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    float *ms = xmalloc(sizeof(float) * o->iters), *cms = xmalloc(sizeof(float) * o->iters);
    if (Q > 1) {
        /* the same call on each kernel, in one process */
        double t[2];
        int finite = 1;
        for (int k = 0; k < 2; k++) {
            if (k == 1) setenv("KVARN_CUDA_MATRIX", "0", 1);
            t[k] = time_attention(o, &kv, &plan, &args, ws, stream, e0, e1, ms);
            /* each kernel's output finite */
            CK(cudaMemcpy(hq, dout, sizeof(float) * nq * Hq * D, cudaMemcpyDeviceToHost));
            for (int i = 0; i < nq * Hq * D; i++) finite &= isfinite(hq[i]) != 0;
        }
        unsetenv("KVARN_CUDA_MATRIX");
        kvarn_cuda_attn_kernel_info info;
        KV(kvarn_cuda_attn_kernel_info_get(&kv, &plan, &info));
        printf("prefill,%s,%d,%d,%d,%d,%.4f,%.4f,%.2f%s%s\n", f.name, B, C, Q, plan.num_splits, t[0],
               t[1], t[1] / t[0], info.matrix ? "" : ",NO_MATRIX_KERNEL", finite ? "" : ",BAD_OUTPUT");
        fflush(stdout);
        return finite ? 0 : 1; /* the process ends: the OS frees the rest */
    }
    const double t_attn = time_attention(o, &kv, &plan, &args, ws, stream, e0, e1, ms);
    const double bytes = step_bytes(&kv, B, C, Hq);
    /* A plain copy of the same number of bytes (it reads and writes them). */
    void *csrc = dmalloc((size_t)bytes), *cdst = dmalloc((size_t)bytes);
    CK(cudaMemset(csrc, 1, (size_t)bytes));
    for (int i = 0; i < o->warmup + o->iters; i++) {
        CK(cudaEventRecord(e0, stream));
        CK(cudaMemcpyAsync(cdst, csrc, (size_t)bytes, cudaMemcpyDeviceToDevice, stream));
        CK(cudaEventRecord(e1, stream));
        CK(cudaEventSynchronize(e1));
        if (i >= o->warmup) CK(cudaEventElapsedTime(&cms[i - o->warmup], e0, e1));
    }
    /* One sanity look at the output: finite and not all zero. */
    CK(cudaMemcpy(hq, dout, sizeof(float) * B * Hq * D, cudaMemcpyDeviceToHost));
    int finite = 1;
    double norm = 0.0;
    for (int i = 0; i < B * Hq * D; i++) { finite &= isfinite(hq[i]) != 0; norm += (double)hq[i] * hq[i]; }
    const double t_copy = median(cms, o->iters);
    printf("time,%s,%d,%d,%d,%.4f,%.0f,%.1f,%.4f%s\n", f.name, B, C, plan.num_splits, t_attn, bytes,
           bytes / (t_attn * 1e-3) / 1e9, t_copy, finite && norm > 0 ? "" : ",BAD_OUTPUT");
    fflush(stdout);

    CK(cudaFree(csrc)); CK(cudaFree(cdst)); CK(cudaFree(dk)); CK(cudaFree(dv)); CK(cudaFree(dslots));
    CK(cudaFree(dtab)); CK(cudaFree(dlens)); CK(cudaFree(dcom)); CK(cudaFree(dq)); CK(cudaFree(dout));
    CK(cudaFree(dqsl));
    free(qsl);
    if (ws) CK(cudaFree(ws));
    CK(cudaFree(kv.blocks));
    if (kv.fp16_pages) CK(cudaFree(kv.fp16_pages));
    CK(cudaEventDestroy(e0)); CK(cudaEventDestroy(e1)); CK(cudaStreamDestroy(stream));
    free(hk16); free(hv16); free(slots); free(ids); free(table); free(lens); free(committed);
    free(hq); free(ms); free(cms);
    return finite && norm > 0 ? 0 : 1;
}

/* ------------------------------------------------------------- dump */

typedef struct dump_header {
    char magic[8];
    uint32_t version, n_layers, n_tokens, n_kv_heads, head_dim, dtype, flags;
    uint32_t reserved[7]; /* zero; the header is 64 bytes */
} dump_header;

static void fwht_d(double *x, int n)
{
    for (int h = 1; h < n; h *= 2)
        for (int i = 0; i < n; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                double a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    for (int j = 0; j < n; j++) x[j] /= sqrt((double)n);
}

static int cmd_dump(const opts *o)
{
    kvarn_format f;
    if (kvarn_format_parse(o->format, &f) != KVARN_OK) return die("unknown --format");
    FILE *fp = fopen(o->dump, "rb");
    if (!fp) return die("cannot open --dump");
    dump_header h;
    if (fread(&h, sizeof h, 1, fp) != 1 || memcmp(h.magic, "KVDUMP1", 8) != 0 || h.version != 1 ||
        h.dtype != 0 || h.n_layers == 0 || h.n_tokens == 0 || h.n_kv_heads == 0 || h.head_dim == 0) {
        fclose(fp);
        return die("not a KV dump (docs/kv-dump.md)");
    }
    const int D = (int)h.head_dim, Hk = (int)h.n_kv_heads, gs = o->gqa, Hq = Hk * gs;
    const int kvarn = f.kind == KVARN_KIND_KVARN;
    const int G = kvarn ? f.tile_tokens : 16;
    const int T = (int)h.n_tokens, tiles = (T + G - 1) / G;
    const size_t layer_elems = (size_t)T * Hk * D;
    const int layers = o->layers < (int)h.n_layers ? o->layers : (int)h.n_layers;
    printf("dump %s: %u layers, %d tokens, %d KV heads, D=%d; checking %d layers with %s, GQA %d\n",
           o->dump, h.n_layers, T, Hk, D, layers, f.name, gs);
    float *kf = xmalloc(sizeof(float) * layer_elems), *vf = xmalloc(sizeof(float) * layer_elems);
    uint16_t *k16 = xmalloc(2 * layer_elems), *v16 = xmalloc(2 * layer_elems);
    int failed = 0;
    kvarn_record_layout L;
    KV(kvarn_record_layout_get(&f, D, &L));

    for (int l = 0; l < layers; l++) {
        const long kpos = (long)sizeof h + (long)l * (long)(layer_elems * 4);
        const long vpos = (long)sizeof h + (long)h.n_layers * (long)(layer_elems * 4) + (long)l * (long)(layer_elems * 4);
        if (fseek(fp, kpos, SEEK_SET) || fread(kf, 4, layer_elems, fp) != layer_elems ||
            fseek(fp, vpos, SEEK_SET) || fread(vf, 4, layer_elems, fp) != layer_elems) {
            fclose(fp);
            return die("dump truncated");
        }
        for (size_t i = 0; i < layer_elems; i++) { k16[i] = kvarn_fp32_to_fp16(kf[i]); v16[i] = kvarn_fp32_to_fp16(vf[i]); }

        /* One sequence of T tokens. KVarN: tile i -> page i, full tiles
         * after the sink commit to block i. Per-token: tile i -> block i. */
        kvarn_paged_kv kv = describe(&f, D, Hk, tiles, tiles);
        const size_t arena = kv.block_stride * (size_t)tiles, pbytes = (size_t)tiles * kv.page_stride;
        kv.blocks = dmalloc(arena);
        kv.fp16_pages = kvarn ? dmalloc(pbytes) : NULL;
        CK(cudaMemset(kv.blocks, 0, arena));
        int64_t *slots = xmalloc(sizeof(int64_t) * T);
        for (int t = 0; t < T; t++) slots[t] = t;
        void *dk = dmalloc(2 * layer_elems), *dv = dmalloc(2 * layer_elems), *ds = dmalloc(sizeof(int64_t) * T);
        CK(cudaMemcpy(dk, k16, 2 * layer_elems, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dv, v16, 2 * layer_elems, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(ds, slots, sizeof(int64_t) * T, cudaMemcpyHostToDevice));
        KV(kvarn_cuda_store(&kv, KVARN_CUDA_F16, dk, dv, ds, T, NULL));
        const int committed = kvarn ? T / G : tiles;
        int32_t *table = xmalloc(sizeof(int32_t) * (tiles + 1));
        for (int i = 0; i <= tiles; i++) table[i] = i < tiles ? i : -1;
        int n_commit = 0;
        if (kvarn && committed > 1) {
            n_commit = committed - 1;
            int32_t *ids = xmalloc(sizeof(int32_t) * n_commit);
            for (int i = 0; i < n_commit; i++) ids[i] = i + 1;
            int32_t *dids = dmalloc(sizeof(int32_t) * n_commit);
            CK(cudaMemcpy(dids, ids, sizeof(int32_t) * n_commit, cudaMemcpyHostToDevice));
            KV(kvarn_cuda_commit(&kv, dids, dids, n_commit, NULL, NULL));
            CK(cudaDeviceSynchronize());
            CK(cudaFree(dids));
            free(ids);
        }
        CK(cudaDeviceSynchronize());
        uint8_t *blocks = xmalloc(arena);
        uint16_t *pages = kvarn ? xmalloc(pbytes) : NULL;
        CK(cudaMemcpy(blocks, kv.blocks, arena, cudaMemcpyDeviceToHost));
        if (kvarn) CK(cudaMemcpy(pages, kv.fp16_pages, pbytes, cudaMemcpyDeviceToHost));
        kvarn_paged_kv host = kv; /* the same layout over the host copies */
        host.blocks = blocks;
        host.fp16_pages = pages;

        /* Records against the CPU encoder. */
        long codes = 0, code_bad = 0, scale_bad = 0;
        if (kvarn && n_commit > 0) {
            const size_t wsb = kvarn_encode_workspace_bytes(&f, D);
            void *ws = NULL;
            if (posix_memalign(&ws, 64, wsb)) return die("out of host memory");
            float *tk = xmalloc(sizeof(float) * G * D), *tv = xmalloc(sizeof(float) * G * D);
            uint8_t *want = xmalloc(L.record_bytes);
            kvarn_codec_opts co = KVARN_CODEC_OPTS_DEFAULT;
            co.prerotated = 1;
            for (int i = 1; i < committed; i++)
                for (int hh = 0; hh < Hk; hh++) {
                    const uint16_t *pk = kvarn_paged_page_k(&host, i, hh), *pv = kvarn_paged_page_v(&host, i, hh);
                    for (int e = 0; e < G * D; e++) { tk[e] = kvarn_fp16_to_fp32(pk[e]); tv[e] = kvarn_fp16_to_fp32(pv[e]); }
                    if (kvarn_encode(&f, D, tk, tv, want, L.record_bytes, ws, wsb, &co) != KVARN_OK) { scale_bad++; continue; }
                    const uint8_t *g = kvarn_paged_record(&host, i, hh);
                    for (size_t b = 0; b < L.k_a_off; b++) /* K codes */
                        for (int s = 0; s < 8; s += L.key_bits) code_bad += ((g[b] >> s) ^ (want[b] >> s)) & ((1u << L.key_bits) - 1) ? 1 : 0;
                    for (size_t b = L.v_codes_off; b < L.v_schan_off; b++)
                        for (int s = 0; s < 8; s += L.value_bits) code_bad += ((g[b] >> s) ^ (want[b] >> s)) & ((1u << L.value_bits) - 1) ? 1 : 0;
                    codes += 2L * G * D;
                    const size_t fields[2][2] = {{L.k_a_off, L.v_codes_off}, {L.v_schan_off, L.payload_bytes}};
                    for (int r = 0; r < 2; r++)
                        for (size_t b = fields[r][0]; b < fields[r][1]; b += 2) {
                            uint16_t a16, b16;
                            memcpy(&a16, g + b, 2);
                            memcpy(&b16, want + b, 2);
                            float x = kvarn_fp16_to_fp32(a16), y = kvarn_fp16_to_fp32(b16);
                            scale_bad += !(fabsf(x - y) <= 0.1f + 0.02f * fabsf(y));
                        }
                }
            free(ws); free(tk); free(tv); free(want);
            const long allowed = 16 * ((codes + (1L << 21) - 1) >> 21);
            const int ok = code_bad <= allowed && scale_bad == 0;
            printf("layer %d store+commit: %ld of %ld codes differ from kvarn_encode (allowed %ld), %ld scales off: %s\n",
                   l, code_bad, codes, allowed, scale_bad, ok ? "PASS" : "FAIL");
            failed |= !ok;
        }

        /* Attention: decode at T-1 and 4 causal queries with a window. */
        const int nq = T >= 4 ? 4 : T;
        float *q = xmalloc(sizeof(float) * nq * Hq * D), *out = xmalloc(sizeof(float) * nq * Hq * D);
        for (int j = 0; j < nq; j++)
            for (int hq = 0; hq < Hq; hq++)
                for (int d = 0; d < D; d++) /* the token's own key, perturbed per query head */
                    q[((size_t)j * Hq + hq) * D + d] = kf[((size_t)(T - nq + j) * Hk + hq / gs) * D + d] *
                                                       (float)(1.0 + 0.1 * rng_normal());
        int32_t lens = T, com = committed, qsl[2] = {0, nq};
        int32_t *dtab = dmalloc(sizeof(int32_t) * (tiles + 1)), *dl = dmalloc(4), *dc = dmalloc(4), *dqsl = dmalloc(8);
        float *dq = dmalloc(sizeof(float) * nq * Hq * D), *dout = dmalloc(sizeof(float) * nq * Hq * D);
        CK(cudaMemcpy(dtab, table, sizeof(int32_t) * (tiles + 1), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dl, &lens, 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dc, &com, 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dqsl, qsl, 8, cudaMemcpyHostToDevice));
        for (int mode = 0; mode < 2; mode++) {
            const int rows = mode ? nq : 1, window = mode ? 3 * G / 2 : 0;
            const float *qq = mode ? q : q + (size_t)(nq - 1) * Hq * D;
            CK(cudaMemcpy(dq, qq, sizeof(float) * rows * Hq * D, cudaMemcpyHostToDevice));
            kvarn_cuda_attn_shape sh = {1, Hq, tiles + 1, T, mode ? nq : 1, window, 1.0f / sqrtf((float)D)};
            kvarn_cuda_attn_plan plan;
            KV(kvarn_cuda_attn_plan_make(&kv, &sh, 132, &plan));
            void *ws = plan.workspace_bytes ? dmalloc(plan.workspace_bytes) : NULL;
            kvarn_cuda_attn_args a = {dq, dout, dtab, dl, kvarn ? dc : NULL, mode ? dqsl : NULL, NULL};
            CK(cudaMemset(dout, 0xff, sizeof(float) * rows * Hq * D));
            KV(kvarn_cuda_attention(&kv, &plan, &a, ws, plan.workspace_bytes, NULL));
            CK(cudaDeviceSynchronize());
            CK(cudaMemcpy(out, dout, sizeof(float) * rows * Hq * D, cudaMemcpyDeviceToHost));
            if (ws) CK(cudaFree(ws));

            /* double reference over the downloaded records and pages */
            double min_cos = 1.0, max_rel = 0.0;
            double *qr = xmalloc(sizeof(double) * D), *acc = xmalloc(sizeof(double) * D), *sc = xmalloc(sizeof(double) * T);
            float *tk = xmalloc(sizeof(float) * G * D), *tv = xmalloc(sizeof(float) * G * D);
            for (int j = 0; j < rows; j++) {
                const int pos = T - rows + j, lo = window && pos - window + 1 > 0 ? pos - window + 1 : 0;
                for (int hq = 0; hq < Hq; hq++) {
                    const int hk = hq / gs;
                    for (int d = 0; d < D; d++) qr[d] = qq[((size_t)j * Hq + hq) * D + d];
                    if (kvarn) fwht_d(qr, D);
                    double mx = -INFINITY, sum = 0.0;
                    for (int d = 0; d < D; d++) acc[d] = 0.0;
                    for (int pass = 0; pass < 2; pass++)
                        for (int i = lo / G; i <= pos / G; i++) {
                            /* K/V of tile i, attention basis */
                            const int page = kvarn_paged_tile_is_page(&host, committed, i);
                            if (page) {
                                const uint16_t *pk = kvarn_paged_page_k(&host, i, hk), *pv = kvarn_paged_page_v(&host, i, hk);
                                for (int e = 0; e < G * D; e++) { tk[e] = kvarn_fp16_to_fp32(pk[e]); tv[e] = kvarn_fp16_to_fp32(pv[e]); }
                            } else if (kvarn) {
                                KV(kvarn_decode(&f, D, kvarn_paged_record(&host, i, hk),
                                                L.record_bytes, tk, tv, KVARN_DECODE_ROTATED));
                            } else {
                                for (int t = 0; t < G && i * G + t < T; t++)
                                    KV(kvarn_decode(&f, D, kvarn_paged_token_record(&host, i, hk, t), kv.token_record_bytes,
                                                    tk + (size_t)t * D, tv + (size_t)t * D, 0));
                            }
                            for (int t = 0; t < G; t++) {
                                const int p = i * G + t;
                                if (p < lo || p > pos) continue;
                                if (pass == 0) {
                                    double dot = 0.0;
                                    for (int d = 0; d < D; d++) dot += qr[d] * tk[(size_t)t * D + d];
                                    sc[p] = dot / sqrt((double)D);
                                    mx = sc[p] > mx ? sc[p] : mx;
                                } else {
                                    const double w = exp(sc[p] - mx);
                                    sum += w;
                                    for (int d = 0; d < D; d++) acc[d] += w * tv[(size_t)t * D + d];
                                }
                            }
                        }
                    for (int d = 0; d < D; d++) acc[d] /= sum;
                    if (kvarn) fwht_d(acc, D);
                    const float *g = out + ((size_t)j * Hq + hq) * D;
                    double dot = 0, ng = 0, nr = 0, ne = 0;
                    for (int d = 0; d < D; d++) {
                        dot += g[d] * acc[d]; ng += (double)g[d] * g[d]; nr += acc[d] * acc[d];
                        ne += (g[d] - acc[d]) * (g[d] - acc[d]);
                    }
                    const double cs = ng > 0 && nr > 0 ? dot / sqrt(ng * nr) : 0.0;
                    const double rel = nr > 0 && isfinite(ne) ? sqrt(ne / nr) : INFINITY;
                    if (!(cs >= min_cos)) min_cos = cs;
                    if (!(rel <= max_rel)) max_rel = rel;
                }
            }
            const int ok = min_cos >= 0.9999 && max_rel < 1e-3;
            printf("layer %d attention %s (splits %d): min cosine %.7f, max rel err %.2e: %s\n", l,
                   mode ? "multi-query+window" : "decode", plan.num_splits, min_cos, max_rel, ok ? "PASS" : "FAIL");
            failed |= !ok;
            free(qr); free(acc); free(sc); free(tk); free(tv);
        }
        free(q); free(out); free(slots); free(table); free(blocks); free(pages);
        CK(cudaFree(dtab)); CK(cudaFree(dl)); CK(cudaFree(dc)); CK(cudaFree(dqsl)); CK(cudaFree(dq)); CK(cudaFree(dout));
        CK(cudaFree(dk)); CK(cudaFree(dv)); CK(cudaFree(ds)); CK(cudaFree(kv.blocks));
        if (kv.fp16_pages) CK(cudaFree(kv.fp16_pages));
    }
    fclose(fp);
    free(kf); free(vf); free(k16); free(v16);
    printf("dump check: %s\n", failed ? "FAIL" : "PASS");
    return failed;
}

int main(int argc, char **argv)
{
    opts o = {NULL, "kvarn_k4v2_g128", NULL, 1, 4096, 32, 8, 128, 10, 50, 4, 3, 1};
    if (argc < 2) return die("usage: gpu_bench plan|time|dump [options] (see the top of bench/gpu/gpu_bench.c)");
    o.mode = argv[1];
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (v == NULL) return die("option without a value");
        i++;
        if (!strcmp(a, "--format")) o.format = v;
        else if (!strcmp(a, "--dump")) o.dump = v;
        else if (!strcmp(a, "--batch")) o.batch = atoi(v);
        else if (!strcmp(a, "--ctx")) o.ctx = atoi(v);
        else if (!strcmp(a, "--hq")) o.hq = atoi(v);
        else if (!strcmp(a, "--hk")) o.hk = atoi(v);
        else if (!strcmp(a, "--d")) o.d = atoi(v);
        else if (!strcmp(a, "--warmup")) o.warmup = atoi(v);
        else if (!strcmp(a, "--iters")) o.iters = atoi(v);
        else if (!strcmp(a, "--layers")) o.layers = atoi(v);
        else if (!strcmp(a, "--gqa")) o.gqa = atoi(v);
        else if (!strcmp(a, "--queries")) o.queries = atoi(v);
        else return die("unknown option");
    }
    if (o.batch < 1 || o.ctx < 1 || o.hq < 1 || o.hk < 1 || o.hq % o.hk || o.warmup < 0 ||
        o.iters < 1 || o.layers < 1 || o.gqa < 1 || o.queries < 1 || o.queries > o.ctx)
        return die("bad option value");
    if (!strcmp(o.mode, "plan")) return cmd_plan(&o);
    int n = 0;
    if (kvarn_cuda_device_count(&n) != KVARN_OK) return die("no CUDA device");
    if (!strcmp(o.mode, "time")) return cmd_time(&o);
    if (!strcmp(o.mode, "dump")) {
        if (o.dump == NULL) return die("dump needs --dump FILE");
        return cmd_dump(&o);
    }
    return die("unknown mode (plan, time, dump)");
}
