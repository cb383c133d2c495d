/*
 * test_llama.c -- the llama runner on a tiny random llama GGUF written by
 * the test itself (2 layers, hidden 128, 4 query heads, 2 KV heads,
 * head_dim 64 via llama.attention.key_length, FFN 192, vocab 300, untied
 * output head; tensors in F32, F16, Q8_0 and Q4_1), so the C suite
 * exercises the model without the real 94 MB file
 * (tests/cli/test_llama_logits.py checks that one against numpy).
 *
 * Checked: hyper-parameters; full prefill == token-by-token decode ==
 * chunked for the exact store and for the fp16 cache; every cache format
 * runs and gives finite logits, with a quantization error that shrinks with
 * more bits; the paged kernels against decoded history; argument errors,
 * NaN activations (refused, rolled back); bad files.
 */
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "common/levels.h"
#include "common/testutil.h"
#include "kvarn/cache.h"
#include "kvarn/gguf.h"
#include "kvarn/model.h"
#include "common/cpu.h"
#include "model/llama_internal.h"

enum { NL = 2, E = 128, NH = 4, NKV = 2, HD = 64, FF = 192, VOCAB = 300 };
#define NTOK 300

/* ------------------------------------------------------------------------ */
/* A tiny GGUF writer                                                       */
/* ------------------------------------------------------------------------ */

typedef struct buf {
    uint8_t *p;
    size_t n, cap;
} buf;

static void put(buf *b, const void *src, size_t n)
{
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 1024;
        b->p = realloc(b->p, b->cap);
        assert_non_null(b->p);
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}
static void put_u32(buf *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(buf *b, uint64_t v) { put(b, &v, 8); }
static void put_str(buf *b, const char *s)
{
    put_u64(b, strlen(s));
    put(b, s, strlen(s));
}
static void kv_u32(buf *b, const char *k, uint32_t v)
{
    put_str(b, k);
    put_u32(b, 4); /* UINT32 */
    put_u32(b, v);
}
static void kv_f32(buf *b, const char *k, float v)
{
    put_str(b, k);
    put_u32(b, 6); /* FLOAT32 */
    put(b, &v, 4);
}
static void kv_str(buf *b, const char *k, const char *v)
{
    put_str(b, k);
    put_u32(b, 8); /* STRING */
    put_str(b, v);
}

typedef struct wtensor {
    char name[64];
    int in, out;          /* ne = {in, out}; out = 0 for a vector */
    kvarn_ggml_type type;
    buf data;
} wtensor;

/* Encode n floats of x as type t (ggml block layouts, gguf.h). */
static void encode(buf *b, kvarn_ggml_type t, const float *x, int n)
{
    if (t == KVARN_GGML_F32) {
        put(b, x, sizeof(float) * n);
    } else if (t == KVARN_GGML_F16) {
        for (int i = 0; i < n; i++) {
            uint16_t h = kvarn_fp32_to_fp16(x[i]);
            put(b, &h, 2);
        }
    } else if (t == KVARN_GGML_Q8_0) {
        for (int i = 0; i < n; i += 32) {
            float amax = 0;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[i + j]));
            float d = amax / 127.0f;
            uint16_t h = kvarn_fp32_to_fp16(d);
            put(b, &h, 2);
            for (int j = 0; j < 32; j++) {
                int8_t q = (int8_t)(d > 0 ? lrintf(x[i + j] / d) : 0);
                put(b, &q, 1);
            }
        }
    } else { /* Q4_1 */
        for (int i = 0; i < n; i += 32) {
            float lo = x[i], hi = x[i];
            for (int j = 0; j < 32; j++) {
                lo = fminf(lo, x[i + j]);
                hi = fmaxf(hi, x[i + j]);
            }
            float d = (hi - lo) / 15.0f;
            uint16_t hd = kvarn_fp32_to_fp16(d), hm = kvarn_fp32_to_fp16(lo);
            put(b, &hd, 2);
            put(b, &hm, 2);
            uint8_t q[32];
            for (int j = 0; j < 32; j++) {
                long c = d > 0 ? lrintf((x[i + j] - lo) / d) : 0;
                q[j] = (uint8_t)(c < 0 ? 0 : c > 15 ? 15 : c);
            }
            for (int j = 0; j < 16; j++) {
                uint8_t byte = (uint8_t)(q[j] | (q[j + 16] << 4));
                put(b, &byte, 1);
            }
        }
    }
}

static void make_tensor(wtensor *t, const char *name, int in, int out,
                        kvarn_ggml_type type, float scale, float bias,
                        test_rng *rng)
{
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->in = in;
    t->out = out;
    t->type = type;
    int n = in * (out ? out : 1);
    float *x = malloc(sizeof(float) * n);
    assert_non_null(x);
    for (int i = 0; i < n; i++) x[i] = bias + scale * (float)test_rng_normal(rng);
    encode(&t->data, type, x, n);
    free(x);
}

/* Metadata a test may change; the tensors keep the shapes of the enum. */
typedef struct wmeta {
    uint32_t context_length, head_count, head_count_kv, key_length;
    int all_blocked; /* 1: every matrix Q4_1 or Q8_0 (the F16 ones Q4_1) */
} wmeta;
static const wmeta k_meta = { 1024, NH, NKV, HD, 0 };

/* The whole file: metadata (arch and *meta as given), then the tensors. */
static buf write_gguf(const char *arch, int drop_tensor, const wmeta *meta)
{
    test_rng rng;
    test_rng_seed(&rng, 1234);
    wtensor *ts = calloc(4 + 9 * NL, sizeof *ts);
    assert_non_null(ts);
    int nt = 0;
    make_tensor(&ts[nt++], "token_embd.weight", E, VOCAB, KVARN_GGML_Q8_0, 1.0f, 0, &rng);
    /* The last token's embedding is NaN (fp16 NaN block scales), to test
     * that NaN reaching the cache is refused and rolled back. */
    for (int blk = (VOCAB - 1) * E / 32; blk < VOCAB * E / 32; blk++) {
        uint16_t nan16 = 0x7E00;
        memcpy(ts[0].data.p + (size_t)blk * 34, &nan16, 2);
    }
    make_tensor(&ts[nt++], "output_norm.weight", E, 0, KVARN_GGML_F32, 0.1f, 1.0f, &rng);
    /* An output head of its own (untied; the real model covers tied). */
    const kvarn_ggml_type f16 = meta->all_blocked ? KVARN_GGML_Q4_1 : KVARN_GGML_F16;
    make_tensor(&ts[nt++], "output.weight", E, VOCAB, f16, 1.0f, 0, &rng);
    float ws = 1.0f / sqrtf((float)E);
    for (int l = 0; l < NL; l++) {
        char nm[64];
#define T(suffix, in, out, type, scale, bias)                                  \
    do {                                                                       \
        snprintf(nm, sizeof nm, "blk.%d." suffix ".weight", l);                \
        make_tensor(&ts[nt++], nm, (in), (out), (type), (scale), (bias), &rng); \
    } while (0)
        T("attn_norm", E, 0, KVARN_GGML_F32, 0.1f, 1.0f);
        /* Larger Q/K make the softmax peaky, so attention matters. */
        T("attn_q", E, NH * HD, f16, 2 * ws, 0);
        T("attn_k", E, NKV * HD, KVARN_GGML_Q4_1, 2 * ws, 0);
        T("attn_v", E, NKV * HD, KVARN_GGML_Q8_0, ws, 0);
        T("attn_output", NH * HD, E, KVARN_GGML_Q4_1, 1.0f / sqrtf(NH * HD), 0);
        T("ffn_norm", E, 0, KVARN_GGML_F32, 0.1f, 1.0f);
        T("ffn_gate", E, FF, KVARN_GGML_Q4_1, ws, 0);
        T("ffn_up", E, FF, f16, ws, 0);
        T("ffn_down", FF, E, KVARN_GGML_Q8_0, 1.0f / sqrtf(FF), 0);
#undef T
    }
    buf b = { 0 };
    put(&b, "GGUF", 4);
    put_u32(&b, 3);
    int kept = nt - (drop_tensor ? 1 : 0);
    put_u64(&b, (uint64_t)kept);
    put_u64(&b, 11);
    kv_str(&b, "general.architecture", arch);
    kv_u32(&b, "llama.block_count", NL);
    kv_u32(&b, "llama.embedding_length", E);
    kv_u32(&b, "llama.feed_forward_length", FF);
    kv_u32(&b, "llama.attention.head_count", meta->head_count);
    kv_u32(&b, "llama.attention.head_count_kv", meta->head_count_kv);
    kv_u32(&b, "llama.attention.key_length", meta->key_length);
    kv_u32(&b, "llama.context_length", meta->context_length);
    kv_u32(&b, "llama.rope.dimension_count", meta->key_length);
    kv_f32(&b, "llama.rope.freq_base", 10000.0f);
    kv_f32(&b, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    uint64_t off = 0;
    for (int i = 0; i < kept; i++) {
        wtensor *t = &ts[i];
        put_str(&b, t->name);
        put_u32(&b, t->out ? 2 : 1);
        put_u64(&b, (uint64_t)t->in);
        if (t->out) put_u64(&b, (uint64_t)t->out);
        put_u32(&b, (uint32_t)t->type);
        put_u64(&b, off);
        off += (t->data.n + 31) / 32 * 32;
    }
    static const uint8_t zeros[32];
    put(&b, zeros, (32 - b.n % 32) % 32);
    for (int i = 0; i < kept; i++) {
        put(&b, ts[i].data.p, ts[i].data.n);
        put(&b, zeros, (32 - ts[i].data.n % 32) % 32);
    }
    for (int i = 0; i < nt; i++) free(ts[i].data.p);
    free(ts);
    return b;
}

/* ------------------------------------------------------------------------ */
/* Fixture and helpers                                                      */
/* ------------------------------------------------------------------------ */

typedef struct fixture {
    buf file;
    kvarn_gguf *g;
    kvarn_llama *m;
    int32_t ids[NTOK];
} fixture;

static int setup(void **state)
{
    fixture *f = calloc(1, sizeof *f);
    f->file = write_gguf("llama", 0, &k_meta);
    char err[256];
    if (kvarn_gguf_open_memory(f->file.p, f->file.n, &f->g, err, sizeof err) != KVARN_OK) {
        fprintf(stderr, "gguf: %s\n", err);
        return -1;
    }
    /* fp32 weights: every bound below is derived for them. */
    kvarn_llama_load_opts lo = KVARN_LLAMA_LOAD_OPTS_DEFAULT;
    lo.weights = KVARN_LLAMA_WEIGHTS_FP32;
    if (kvarn_llama_load_gguf_with(f->g, &lo, &f->m) != KVARN_OK) return -1;
    test_rng rng;
    test_rng_seed(&rng, 99);
    for (int i = 0; i < NTOK; i++) f->ids[i] = (int32_t)test_rng_below(&rng, VOCAB - 1);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;
    kvarn_llama_free(f->m);
    kvarn_gguf_close(f->g);
    free(f->file.p);
    free(f);
    return 0;
}

/* The parsed format of a name the tests use (sessions take a kvarn_format,
 * not a name); NULL for NULL. Kept for the program's life, one per name. */
static const kvarn_format *fmt_of(const char *name)
{
    static kvarn_format seen[32];
    static int n_seen;
    if (name == NULL) return NULL;
    kvarn_format f;
    assert_int_equal(kvarn_format_parse(name, &f), KVARN_OK);
    for (int i = 0; i < n_seen; i++)
        if (strcmp(seen[i].name, f.name) == 0) return &seen[i];
    assert_true(n_seen < 32);
    seen[n_seen] = f;
    return &seen[n_seen++];
}

/* How a run keeps its K/V. */
enum { KERNELS = 0, EXACT_CHUNK = 1, EXACT = 2 };

static float *run_model(const kvarn_llama *m, const fixture *f, const char *format, int mode,
                        int chunk, int threads);

/* Logits of all NTOK tokens fed in chunks of `chunk`; caller frees. */
static float *run(const fixture *f, const char *format, int mode, int chunk)
{
    return run_model(f->m, f, format, mode, chunk, test_threads(1));
}

/* The same on model m with `threads` attention (and gguf GEMV) workers. */
static float *run_model(const kvarn_llama *m, const fixture *f, const char *format, int mode,
                        int chunk, int threads)
{
    kvarn_llama_session_opts o = KVARN_LLAMA_SESSION_OPTS_DEFAULT;
    o.attn_threads = threads;
    o.format = fmt_of(format);
    o.exact = mode == EXACT;
    o.exact_chunk = mode == EXACT_CHUNK;
    o.max_tokens = NTOK;
    o.max_chunk = chunk;
    kvarn_llama_session *s = NULL;
    assert_int_equal(kvarn_llama_session_create(m, &o, &s), KVARN_OK);
    float *lg = malloc(sizeof(float) * NTOK * VOCAB);
    assert_non_null(lg);
    for (int p = 0; p < NTOK; p += chunk) {
        int c = NTOK - p < chunk ? NTOK - p : chunk;
        assert_int_equal(kvarn_llama_forward(s, f->ids + p, c, KVARN_LLAMA_LOGITS_ALL,
                                             lg + (size_t)p * VOCAB, (size_t)c * VOCAB),
                         KVARN_OK);
    }
    assert_int_equal(kvarn_llama_session_pos(s), NTOK);
    kvarn_llama_session_free(s);
    return lg;
}

/* Largest |a - b| over all logits, and the largest |a| (for scale). */
static double max_diff(const float *a, const float *b)
{
    double d = 0;
    for (size_t i = 0; i < (size_t)NTOK * VOCAB; i++) {
        double e = fabs((double)a[i] - b[i]);
        if (!(e <= d)) d = e; /* NaN propagates as a failure */
    }
    return d;
}

static double max_abs(const float *a)
{
    double d = 0;
    for (size_t i = 0; i < (size_t)NTOK * VOCAB; i++) d = fmax(d, fabs(a[i]));
    return d;
}

/* ------------------------------------------------------------------------ */
/* Tests                                                                    */
/* ------------------------------------------------------------------------ */

static void test_hparams(void **state)
{
    fixture *f = *state;
    const kvarn_llama_hparams *hp = kvarn_llama_get_hparams(f->m);
    assert_int_equal(hp->n_layers, NL);
    assert_int_equal(hp->hidden, E);
    assert_int_equal(hp->n_heads, NH);
    assert_int_equal(hp->n_kv_heads, NKV);
    assert_int_equal(hp->head_dim, HD);
    assert_int_equal(hp->ffn, FF);
    assert_int_equal(hp->vocab, VOCAB);
    assert_int_equal(hp->context_length, 1024);
    assert_int_equal(hp->tied_output, 0);
    assert_true(fabsf(hp->rope_theta - 10000.0f) < 1e-3f);
    assert_true(fabsf(hp->rms_eps - 1e-5f) < 1e-9f);
}

/* Exact store: one prefill, token-by-token decode and chunks of 7 and 128
 * see the same exact K/V, so only fp32 summation order differs (GEMM vs
 * GEMV, attention over different key ranges). Bound: the worst-case
 * relative error of an n-term fp32 dot product is gamma_n = n u / (1 - n u)
 * (u = 2^-24); the longest sums here have n = NTOK = 300 terms (attention
 * over the whole context), gamma_300 = 1.8e-5. Each path carries that
 * through the depth: per layer QKV, attention, output, gate/up, down (5
 * stages, 2 layers), then the head: 11 stages; the difference of two paths
 * is at most twice one path's error: 2 * 11 * gamma_300 = 3.9e-4 of
 * max|logit| (relative to the terms' magnitudes, which the RMSNorms keep at
 * the logits' scale). */
static void test_exact_prefill_decode_chunked(void **state)
{
    fixture *f = *state;
    float *pre = run(f, NULL, EXACT, NTOK);
    float *dec = run(f, NULL, EXACT, 1);
    float *c7 = run(f, NULL, EXACT, 7);
    float *c128 = run(f, NULL, EXACT, 128);
    double scale = max_abs(pre);
    const double u = 1.0 / 16777216.0, gamma = NTOK * u / (1.0 - NTOK * u);
    const double tol = 2.0 * (5 * NL + 1) * gamma;
    print_message("exact store max|diff| vs prefill (max|logit| %.2f): decode %.2e, "
                  "chunk 7 %.2e, chunk 128 %.2e (bound %.2e)\n", scale, max_diff(pre, dec),
                  max_diff(pre, c7), max_diff(pre, c128), tol * scale);
    assert_true(scale > 1.0);
    assert_true(max_diff(pre, dec) <= tol * scale);
    assert_true(max_diff(pre, c7) <= tol * scale);
    assert_true(max_diff(pre, c128) <= tol * scale);
    free(pre);
    free(dec);
    free(c7);
    free(c128);
}

/* fp16 cache. Both paths: a chunk sees its own K/V exact and the history
 * at fp16 from the cache, so a full prefill never reads the cache: it runs
 * the exact store's operations in the same order and gives the same
 * logits bit for bit. Decode and chunks of 128 read fp16 history; their
 * distance from the exact run is fp16's own effect, which (fp16 step 2^-11
 * relative, bf16 2^-8) is to first order 1/8 of bf16's: bounded here by
 * bf16's effect on the same run. The two paths (kernels, exact-chunk)
 * differ where a K/V element flips one fp16 step between them: at most
 * twice fp16's own effect (see test_model_kernels_match_exact_chunk). */
static void test_fp16_prefill_decode_chunked(void **state)
{
    fixture *f = *state;
    float *ex = run(f, NULL, EXACT, NTOK);
    float *pre = run(f, "fp16", KERNELS, NTOK);
    float *dec = run(f, "fp16", KERNELS, 1);
    float *c128 = run(f, "fp16", KERNELS, 128);
    float *pre_x = run(f, "fp16", EXACT_CHUNK, NTOK);
    float *dec_x = run(f, "fp16", EXACT_CHUNK, 1);
    float *dec_bf = run(f, "bf16", KERNELS, 1);
    float *c128_bf = run(f, "bf16", KERNELS, 128);
    double scale = max_abs(ex);
    double d_pre = max_diff(ex, pre), d_dec = max_diff(ex, dec);
    double d_c128 = max_diff(ex, c128), d_prex = max_diff(ex, pre_x);
    double d_decx = max_diff(dec_x, dec);
    double d_dec_bf = max_diff(ex, dec_bf), d_c128_bf = max_diff(ex, c128_bf);
    print_message("fp16 max|diff| (max|logit| %.2f): prefill-exact %.2e, "
                  "decode-exact %.2e (bf16 %.2e), chunk128-exact %.2e (bf16 %.2e), "
                  "exact-chunk prefill-exact %.2e, exact-chunk decode vs kernels "
                  "decode %.2e\n", scale, d_pre, d_dec, d_dec_bf, d_c128, d_c128_bf,
                  d_prex, d_decx);
    assert_true(scale > 1.0);
    assert_true(d_pre == 0.0);
    assert_true(d_prex == 0.0);
    /* ... the cache really is read by decode (fp16 is not bit-exact) ... */
    assert_true(d_dec > 0.0 && d_c128 > 0.0);
    /* ... and its effect is below bf16's (8x the step). */
    assert_true(d_dec <= d_dec_bf);
    assert_true(d_c128 <= d_c128_bf);
    assert_true(d_decx <= 2.0 * d_dec);
    free(ex);
    free(pre);
    free(dec);
    free(c128);
    free(pre_x);
    free(dec_x);
    free(dec_bf);
    free(c128_bf);
}

/* The paged kernels read the same history that kvarn_cache_read decodes,
 * and both paths see the chunk's own K/V exact. Two K/V stores of the same
 * format, one on the kernel path and one on the exact-chunk path, get
 * identical random Q/K/V (no model in the loop, so their caches hold
 * identical records): chunks of one tile, a chunk that starts mid-tile and
 * ends mid-tile, then decode steps. They differ only in fp32 summation
 * order: every step, every format within 1e-5 of max|out|. */
static void test_kernels_match_exact_chunk(void **state)
{
    (void)state;
    llama_kv_shape sh = { 2, NH, NKV, HD, 512, 128, NULL };
    int qd = NH * HD, kd = NKV * HD;
    float *q = malloc(sizeof(float) * 128 * qd);
    float *k = malloc(sizeof(float) * 128 * kd);
    float *v = malloc(sizeof(float) * 128 * kd);
    float *oa = malloc(sizeof(float) * 128 * qd);
    float *ob = malloc(sizeof(float) * 128 * qd);
    assert_true(q && k && v && oa && ob);
    /* every format with its default sink, then two sinks shorter than a
     * tile (the partial sink tile read from the sink slot by both paths) */
    for (int i = 0; i < kvarn_format_count() + 2; i++) {
        const int extra = i - kvarn_format_count();
        const char *name = extra < 0 ? kvarn_format_name_at(i)
                                     : extra == 0 ? "kvarn_k4v2_g128" : "kvarn_k4v4_g64";
        kvarn_format fmt;
        assert_int_equal(kvarn_format_parse(name, &fmt), KVARN_OK);
        const double tol = 1e-5;
        /* Kernels that multiply in integers or bf16 (the library says which:
         * kvarn_attn_kernel_info_get; docs/attention-intdot.md,
         * attention-matrix.md) are more than fp32 summation order apart
         * from the exact path; tests/attn
         * (test_attn, test_attn_cache, test_attn_lse) hold them to their
         * derived bounds. Here such a format runs capped at AVX2, whose
         * kernels, the library says, read the same records in fp32
         * (levels_hold: KVARN_SIMD put back at the end of the format). */
        levels_iter cap = LEVELS_NONE;
        const int staging = kvarn_cache_default_opts().staging; /* the session's (-1) */
        kvarn_attn_kernel_info ki;
        assert_int_equal(kvarn_attn_kernel_info_get(&fmt, HD, staging, NULL, &ki), KVARN_OK);
        if ((ki.scores | ki.sums | ki.staged_scores | ki.staged_sums) || ki.matrix != NULL) {
            cap = levels_hold(levels_index_of("avx2"));
            assert_int_equal(kvarn_attn_kernel_info_get(&fmt, HD, staging, NULL, &ki), KVARN_OK);
            print_message("%-16s runs at %s here: the integer and matrix kernels are tests/attn's\n",
                          name, ki.level);
            assert_int_equal(ki.scores | ki.sums | ki.staged_scores | ki.staged_sums,
                             KVARN_ATTN_ARITH_FP32);
            assert_null(ki.matrix);
        }
        kvarn_llama_session_opts oa_opts = KVARN_LLAMA_SESSION_OPTS_DEFAULT;
        oa_opts.attn_threads = test_threads(1);
        oa_opts.sink_tokens = extra < 0 ? 0 : extra == 0 ? 16 : 64 + 5;
        kvarn_llama_session_opts ob_opts = oa_opts;
        ob_opts.exact_chunk = 1;
        llama_kv *A = NULL, *B = NULL;
        assert_int_equal(llama_kv_paged_create(&sh, &fmt, &oa_opts, &A), KVARN_OK);
        assert_int_equal(llama_kv_paged_create(&sh, &fmt, &ob_opts, &B), KVARN_OK);
        test_rng rng;
        test_rng_seed(&rng, 7 + (uint64_t)i);
        double worst = 0, scale = 0;
        int pos = 0;
        const int steps[] = {128, 128, 100, 77, 1, 1, 1, 1, 1, 1, 1, 1};
        for (int step = 0; step < (int)(sizeof steps / sizeof steps[0]); step++) {
            int n = steps[step];
            for (int j = 0; j < n * qd; j++) q[j] = (float)test_rng_normal(&rng);
            for (int j = 0; j < n * kd; j++) {
                /* A large channel, as real keys have. */
                k[j] = (float)test_rng_normal(&rng) + (j % HD == 5 ? 4.0f : 0.0f);
                v[j] = (float)test_rng_normal(&rng);
            }
            assert_int_equal(A->ops->begin(A, pos, n), KVARN_OK);
            assert_int_equal(B->ops->begin(B, pos, n), KVARN_OK);
            for (int l = 0; l < sh.n_layers; l++) {
                assert_int_equal(A->ops->attend(A, l, pos, n, q, qd, k, v, kd, oa), KVARN_OK);
                assert_int_equal(B->ops->attend(B, l, pos, n, q, qd, k, v, kd, ob), KVARN_OK);
                for (int j = 0; j < n * qd; j++) {
                    worst = fmax(worst, fabs((double)oa[j] - ob[j]));
                    scale = fmax(scale, fabs((double)ob[j]));
                }
            }
            assert_int_equal(A->ops->end(A, pos, n), KVARN_OK);
            assert_int_equal(B->ops->end(B, pos, n), KVARN_OK);
            pos += n;
        }
        print_message("%-16s sink_tokens %-3d kernels vs exact-chunk attention: max|diff| %.2e "
                      "(max|out| %.2f)\n", name, oa_opts.sink_tokens, worst, scale);
        assert_true(scale > 0.1);
        assert_true(worst < tol * scale);
        A->ops->destroy(A);
        B->ops->destroy(B);
        levels_end(&cap);
    }
    free(q);
    free(k);
    free(v);
    free(oa);
    free(ob);
}

/* Mean over positions of KL(softmax(p) || softmax(q)), in nats, in double. */
static double mean_kld(const float *p, const float *q)
{
    double sum = 0;
    for (int t = 0; t < NTOK; t++) {
        const float *a = p + (size_t)t * VOCAB, *b = q + (size_t)t * VOCAB;
        double ma = a[0], mb = b[0], za = 0, zb = 0, kl = 0;
        for (int j = 1; j < VOCAB; j++) {
            ma = fmax(ma, a[j]);
            mb = fmax(mb, b[j]);
        }
        for (int j = 0; j < VOCAB; j++) {
            za += exp(a[j] - ma);
            zb += exp(b[j] - mb);
        }
        for (int j = 0; j < VOCAB; j++) {
            double la = a[j] - ma - log(za), lb = b[j] - mb - log(zb);
            kl += exp(la) * (la - lb);
        }
        sum += kl;
    }
    return sum / NTOK;
}

/* Positions whose argmax differs. */
static int top1_flips(const float *a, const float *b)
{
    int flips = 0;
    for (int t = 0; t < NTOK; t++) {
        const float *x = a + (size_t)t * VOCAB, *y = b + (size_t)t * VOCAB;
        int ix = 0, iy = 0;
        for (int j = 1; j < VOCAB; j++) {
            if (x[j] > x[ix]) ix = j;
            if (y[j] > y[iy]) iy = j;
        }
        flips += ix != iy;
    }
    return flips;
}

/* The whole model, every format: the kernel path agrees with the
 * exact-chunk path (same K/V semantics: the chunk exact, the history as the
 * cache holds it) for chunks of one tile, chunks that straddle tiles, and
 * token-by-token decode.
 *
 * What is compared, and why not max|logit diff| against a fixed fraction:
 * the two paths sum in different fp32 orders (and OpenBLAS picks different
 * GEMM kernels on different CPUs), so layer 1's input differs in the last
 * fp32 bits, and where a K/V element sits near a rounding boundary of the
 * format, one path stores it one step (one fp16/bf16 ulp, one int/fp8 code)
 * away from the other. Which elements flip depends on the machine; the
 * softmax then amplifies them (this model's attention is peaky). A fixed
 * bound on max|diff| is therefore one machine's measurement (2e-4 of
 * max|logit| here failed on a Xeon at bf16, chunk 1). The attention itself
 * on identical inputs is checked tightly by test_kernels_match_exact_chunk.
 *
 * The bound instead comes from the format's own error, measured in the
 * same run: the format run against the exact (fp32 K/V) store. Rounding to
 * the format moves EVERY K/V element by up to half a step; a flip between
 * the paths moves SOME elements by one step, i.e. at most twice the
 * rounding of that element. To first order (the logits are a smooth
 * function of K/V at this scale) the path difference is then at most 2x
 * the format's own effect in the max norm, and 4x in KLD (quadratic in
 * the logit change). The 16-bit formats are checked the same way: bf16's
 * step is 2^-8 relative, fp16's 2^-11. */
static void test_model_kernels_match_exact_chunk(void **state)
{
    fixture *f = *state;
    const int chunks[] = {128, 100, 1};
    float *ex[3];
    for (int c = 0; c < 3; c++) ex[c] = run(f, NULL, EXACT, chunks[c]);
    for (int i = 0; i < kvarn_format_count(); i++) {
        const char *name = kvarn_format_name_at(i);
        kvarn_format fmt;
        assert_int_equal(kvarn_format_parse(name, &fmt), KVARN_OK);
        for (int c = 0; c < 3; c++) {
            float *a = run(f, name, KERNELS, chunks[c]);
            float *b = run(f, name, EXACT_CHUNK, chunks[c]);
            double d = max_diff(a, b), scale = max_abs(b);
            double d_fmt = max_diff(ex[c], b);
            double kld = mean_kld(b, a), kld_fmt = mean_kld(ex[c], b);
            int flips = top1_flips(a, b), flips_fmt = top1_flips(ex[c], b);
            print_message("%-16s chunk %3d: kernels vs exact-chunk max|diff| %.2e "
                          "(format vs exact %.2e, ratio %.3f), KLD %.2e (format %.2e, "
                          "ratio %.3f), top-1 flips %d (format %d) of %d\n",
                          name, chunks[c], d, d_fmt, d / d_fmt, kld, kld_fmt,
                          kld / kld_fmt, flips, flips_fmt, NTOK);
            assert_true(scale > 1.0);
            /* The format must change the logits at all, or the bounds
             * below would be 0 (every format rounds fp32 K/V). */
            assert_true(d_fmt > 0.0 && kld_fmt > 0.0);
            /* One step per flipped element vs half a step on every one. */
            assert_true(d <= 2.0 * d_fmt);
            assert_true(kld <= 4.0 * kld_fmt);
            free(a);
            free(b);
        }
    }
    for (int c = 0; c < 3; c++) free(ex[c]);
}

/* Every format of the table runs chunked (one tile per call) with finite
 * logits; int8 history is closer to fp16 than int4 history. */
static void test_all_formats_run(void **state)
{
    fixture *f = *state;
    float *ref = run(f, "fp16", KERNELS, 128);
    double d_int8 = -1, d_int4 = -1;
    for (int i = 0; i < kvarn_format_count(); i++) {
        const char *name = kvarn_format_name_at(i);
        float *lg = run(f, name, KERNELS, 128);
        for (size_t j = 0; j < (size_t)NTOK * VOCAB; j++) assert_true(isfinite(lg[j]));
        double d = max_diff(ref, lg);
        if (strcmp(name, "int8") == 0) d_int8 = d;
        if (strcmp(name, "int4") == 0) d_int4 = d;
        /* Quantized history must change the logits past the first chunk. */
        if (strcmp(name, "fp16") != 0) assert_true(d > 0.0);
        free(lg);
    }
    assert_true(d_int8 >= 0 && d_int4 >= 0);
    assert_true(d_int8 < d_int4);
    free(ref);
}

/* keep_kv_f32 / kvarn_llama_session_read_kv: layer 0's K and V against a
 * double-precision recomputation from the weights (RMSNorm, projection,
 * adjacent-pair RoPE); a quantized session keeps the same fp32 K/V as the
 * exact store (layer 0 exactly; later layers differ by what the cache
 * changed upstream); argument errors. */
static void test_read_kv(void **state)
{
    fixture *f = *state;
    const int T = 40, kd = NKV * HD, qd = NH * HD;
    kvarn_llama_session_opts o = KVARN_LLAMA_SESSION_OPTS_DEFAULT;
    o.attn_threads = test_threads(1);
    o.format = fmt_of("int4");
    o.max_tokens = T;
    o.max_chunk = 16;
    o.keep_kv_f32 = 1;
    kvarn_llama_session *s = NULL, *e = NULL;
    assert_int_equal(kvarn_llama_session_create(f->m, &o, &s), KVARN_OK);
    o.exact = 1;
    assert_int_equal(kvarn_llama_session_create(f->m, &o, &e), KVARN_OK);
    for (int p = 0; p < T; p += 16) {
        int c = T - p < 16 ? T - p : 16;
        assert_int_equal(kvarn_llama_forward(s, f->ids + p, c, KVARN_LLAMA_LOGITS_NONE, NULL, 0), KVARN_OK);
        assert_int_equal(kvarn_llama_forward(e, f->ids + p, c, KVARN_LLAMA_LOGITS_NONE, NULL, 0), KVARN_OK);
    }
    float *k = malloc(sizeof(float) * T * kd), *v = malloc(sizeof(float) * T * kd);
    float *k2 = malloc(sizeof(float) * T * kd), *v2 = malloc(sizeof(float) * T * kd);
    assert_int_equal(kvarn_llama_session_read_kv(s, 0, 0, T, k, v), KVARN_OK);
    assert_int_equal(kvarn_llama_session_read_kv(e, 0, 0, T, k2, v2), KVARN_OK);
    assert_memory_equal(k, k2, sizeof(float) * T * kd);
    assert_memory_equal(v, v2, sizeof(float) * T * kd);
    /* Recompute layer 0 in double, with each element's fp32 error bound
     * (u = 2^-24): RMSNorm sums in double and rounds r, x*r and *w (h off
     * by 3u relative); the projection is an E-term fp32 dot product (gamma_E
     * of sum_i |h_i w_i|, plus h's 3u of the same sum); RoPE (cos/sin
     * rounded from double: u each) multiplies and subtracts (3u of
     * |a c| + |b s|), and mixes the pair's errors with weights |c|, |s| <= 1;
     * the reference itself rounds to float twice (2u |k|). */
    const kvarn_llama_hparams *hp = kvarn_llama_get_hparams(f->m);
    const llama_layer *L = &f->m->layers[0];
    const double u = 1.0 / 16777216.0, gamma = E * u / (1.0 - E * u);
    double *bk = malloc(sizeof(double) * T * kd), *bv = malloc(sizeof(double) * T * kd);
    assert_true(bk && bv);
    double worst = 0, scale = 0, use = 0;
    for (int t = 0; t < T; t++) {
        const float *x = f->m->tok_embd.f32 + (size_t)f->ids[t] * E;
        double ss = 0, h[E];
        for (int i = 0; i < E; i++) ss += (double)x[i] * x[i];
        double r = 1.0 / sqrt(ss / E + hp->rms_eps);
        for (int i = 0; i < E; i++) h[i] = x[i] * r * L->attn_norm[i];
        for (int j = 0; j < kd; j++) {
            double kk = 0, vv = 0, sk = 0, sv = 0;
            const float *wk = L->wqkv.f32 + (size_t)(qd + j) * E, *wv = L->wqkv.f32 + (size_t)(qd + kd + j) * E;
            for (int i = 0; i < E; i++) {
                kk += h[i] * wk[i];
                vv += h[i] * wv[i];
                sk += fabs(h[i] * wk[i]);
                sv += fabs(h[i] * wv[i]);
            }
            k2[(size_t)t * kd + j] = (float)kk;
            v2[(size_t)t * kd + j] = (float)vv;
            bk[(size_t)t * kd + j] = (gamma + 3 * u) * sk; /* before RoPE */
            bv[(size_t)t * kd + j] = (gamma + 3 * u) * sv + u * fabs(vv);
        }
        for (int hh = 0; hh < NKV; hh++)
            for (int i = 0; i < HD / 2; i++) {
                double ang = t * pow((double)hp->rope_theta, -2.0 * i / HD);
                size_t at = (size_t)t * kd + hh * HD + 2 * i;
                float *pr = k2 + at;
                double a = pr[0], b = pr[1], c = cos(ang), sn = sin(ang);
                double ea = bk[at], eb = bk[at + 1];
                pr[0] = (float)(a * c - b * sn);
                pr[1] = (float)(a * sn + b * c);
                bk[at] = fabs(c) * ea + fabs(sn) * eb + 4 * u * (fabs(a * c) + fabs(b * sn)) +
                        2 * u * fabs(pr[0]);
                bk[at + 1] = fabs(sn) * ea + fabs(c) * eb + 4 * u * (fabs(a * sn) + fabs(b * c)) +
                            2 * u * fabs(pr[1]);
            }
    }
    for (size_t i = 0; i < (size_t)T * kd; i++) {
        double ek = fabs(k[i] - k2[i]), ev = fabs(v[i] - v2[i]);
        worst = fmax(worst, fmax(ek, ev));
        scale = fmax(scale, fmax(fabs(k2[i]), fabs(v2[i])));
        use = fmax(use, fmax(ek / bk[i], ev / bv[i]));
        assert_true(ek <= bk[i]);
        assert_true(ev <= bv[i]);
    }
    print_message("read_kv layer 0 vs double recomputation: max|diff| %.2e (max %.2f), "
                  "error/derived bound %.3f\n", worst, scale, use);
    assert_true(scale > 0.1);
    free(bk);
    free(bv);
    /* Layer 1: int4 history changed layer 0's output, so K differs a bit
     * from the exact store's, but not wildly; a slice reads the same rows. */
    assert_int_equal(kvarn_llama_session_read_kv(s, NL - 1, 0, T, k, v), KVARN_OK);
    assert_int_equal(kvarn_llama_session_read_kv(e, NL - 1, 0, T, k2, v2), KVARN_OK);
    double d1 = 0;
    for (size_t i = 0; i < (size_t)T * kd; i++) d1 = fmax(d1, fabs(k[i] - k2[i]));
    assert_true(d1 > 0.0 && d1 < scale);
    assert_int_equal(kvarn_llama_session_read_kv(s, NL - 1, 5, 3, k2, v2), KVARN_OK);
    assert_memory_equal(k2, k + 5 * kd, sizeof(float) * 3 * kd);
    assert_memory_equal(v2, v + 5 * kd, sizeof(float) * 3 * kd);
    /* Errors. */
    assert_int_equal(kvarn_llama_session_read_kv(NULL, 0, 0, 1, k, v), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_llama_session_read_kv(s, NL, 0, 1, k, v), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_llama_session_read_kv(s, -1, 0, 1, k, v), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_llama_session_read_kv(s, 0, T - 2, 3, k, v), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_llama_session_read_kv(s, 0, 0, 0, k, v), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_llama_session_read_kv(s, 0, 0, 1, NULL, v), KVARN_ERR_INVALID_ARG);
    kvarn_llama_session_reset(s);
    assert_int_equal(kvarn_llama_session_read_kv(s, 0, 0, 1, k, v), KVARN_ERR_INVALID_ARG);
    kvarn_llama_session_free(s);
    kvarn_llama_session_free(e);
    o.exact = 0;
    o.keep_kv_f32 = 0;
    assert_int_equal(kvarn_llama_session_create(f->m, &o, &s), KVARN_OK);
    assert_int_equal(kvarn_llama_forward(s, f->ids, 4, KVARN_LLAMA_LOGITS_NONE, NULL, 0), KVARN_OK);
    assert_int_equal(kvarn_llama_session_read_kv(s, 0, 0, 1, k, v), KVARN_ERR_UNSUPPORTED);
    kvarn_llama_session_free(s);
    o.keep_kv_f32 = 2;
    assert_int_equal(kvarn_llama_session_create(f->m, &o, &s), KVARN_ERR_INVALID_ARG);
    free(k); free(v); free(k2); free(v2);
}

/* KVARN_LLAMA_LOGITS_LAST is the last row of _ALL; after a reset the same
 * calls give bit-identical logits (deterministic, nothing left behind). */
static void test_last_and_reset(void **state)
{
    fixture *f = *state;
    kvarn_llama_session_opts o = KVARN_LLAMA_SESSION_OPTS_DEFAULT;
    o.attn_threads = test_threads(1);
    o.format = fmt_of("kvarn_k4v2_g128");
    o.max_tokens = NTOK;
    o.max_chunk = 160;
    kvarn_llama_session *s = NULL;
    assert_int_equal(kvarn_llama_session_create(f->m, &o, &s), KVARN_OK);
    assert_string_equal(kvarn_llama_session_format(s), "kvarn_k4v2_g128");
    float *all = malloc(sizeof(float) * 160 * VOCAB);
    float last[VOCAB], last2[VOCAB];
    assert_int_equal(kvarn_llama_forward(s, f->ids, 160, KVARN_LLAMA_LOGITS_NONE, NULL, 0),
                     KVARN_OK);
    assert_int_equal(kvarn_llama_forward(s, f->ids + 160, 140, KVARN_LLAMA_LOGITS_LAST,
                                         last, VOCAB), KVARN_OK);
    kvarn_llama_session_reset(s);
    assert_int_equal(kvarn_llama_session_pos(s), 0);
    assert_int_equal(kvarn_llama_forward(s, f->ids, 160, KVARN_LLAMA_LOGITS_NONE, NULL, 0),
                     KVARN_OK);
    assert_int_equal(kvarn_llama_forward(s, f->ids + 160, 140, KVARN_LLAMA_LOGITS_ALL,
                                         all, (size_t)140 * VOCAB), KVARN_OK);
    /* Both calls run the same layers on the same tokens (bit-identical
     * hidden states and final RMSNorm); only the output head differs: GEMV
     * (one row) against GEMM (all rows), two fp32 evaluations of the same
     * E-term dot products in different orders: at most 2 gamma_E of
     * sum_i |xn_i w_ji| apart (xn: the normalized last row, which the
     * session still holds). */
    const float *xn = s->xn + (size_t)139 * E;
    const double u = 1.0 / 16777216.0, gamma = E * u / (1.0 - E * u);
    for (int j = 0; j < VOCAB; j++) {
        double l1 = 0;
        for (int i = 0; i < E; i++) l1 += fabs((double)xn[i] * f->m->output.f32[(size_t)j * E + i]);
        assert_true(fabs((double)last[j] - all[(size_t)139 * VOCAB + j]) <= 2 * gamma * l1);
    }
    kvarn_llama_session_reset(s);
    assert_int_equal(kvarn_llama_forward(s, f->ids, 160, KVARN_LLAMA_LOGITS_NONE, NULL, 0),
                     KVARN_OK);
    assert_int_equal(kvarn_llama_forward(s, f->ids + 160, 140, KVARN_LLAMA_LOGITS_LAST,
                                         last2, VOCAB), KVARN_OK);
    assert_memory_equal(last, last2, sizeof last);
    free(all);
    kvarn_llama_session_free(s);
}

static void test_errors(void **state)
{
    fixture *f = *state;
    kvarn_llama_session_opts o = KVARN_LLAMA_SESSION_OPTS_DEFAULT;
    o.attn_threads = test_threads(1);
    kvarn_llama_session *s = NULL;
    /* A format is taken as a row, not a name: one whose fields disagree
     * (a kind beyond the table, a KVarN tile of 96 tokens) is refused. */
    kvarn_format bad_fmt = *fmt_of("int8");
    bad_fmt.kind = KVARN_KIND_COUNT;
    o.format = &bad_fmt;
    assert_int_equal(kvarn_llama_session_create(f->m, &o, &s), KVARN_ERR_INVALID_ARG);
    assert_null(s);
    bad_fmt = *fmt_of("kvarn_k4v2_g128");
    bad_fmt.tile_tokens = 96;
    assert_int_equal(kvarn_llama_session_create(f->m, &o, &s), KVARN_ERR_INVALID_ARG);
    assert_null(s);
    o.format = fmt_of("int8");
    o.max_tokens = 64;
    o.max_chunk = 16;
    assert_int_equal(kvarn_llama_session_create(NULL, &o, &s), KVARN_ERR_INVALID_ARG);
    o.balance_iters = 100;
    assert_int_equal(kvarn_llama_session_create(f->m, &o, &s), KVARN_ERR_INVALID_ARG);
    o.balance_iters = -1;
    assert_int_equal(kvarn_llama_session_create(f->m, &o, &s), KVARN_OK);
    float lg[VOCAB];
    int32_t bad[2] = { 5, VOCAB };
    assert_int_equal(kvarn_llama_forward(s, bad, 2, KVARN_LLAMA_LOGITS_LAST, lg, VOCAB),
                     KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_llama_forward(s, f->ids, 17, KVARN_LLAMA_LOGITS_LAST, lg, VOCAB),
                     KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_llama_forward(s, f->ids, 0, KVARN_LLAMA_LOGITS_LAST, lg, VOCAB),
                     KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_llama_forward(s, f->ids, 2, KVARN_LLAMA_LOGITS_LAST, lg, VOCAB - 1),
                     KVARN_ERR_BUFFER_TOO_SMALL);
    assert_int_equal(kvarn_llama_forward(s, f->ids, 2, KVARN_LLAMA_LOGITS_ALL, lg, VOCAB),
                     KVARN_ERR_BUFFER_TOO_SMALL);
    assert_int_equal(kvarn_llama_session_pos(s), 0);
    for (int p = 0; p < 64; p += 16)
        assert_int_equal(kvarn_llama_forward(s, f->ids + p, 16, KVARN_LLAMA_LOGITS_NONE,
                                             NULL, 0), KVARN_OK);
    assert_int_equal(kvarn_llama_forward(s, f->ids, 1, KVARN_LLAMA_LOGITS_LAST, lg, VOCAB),
                     KVARN_ERR_OUT_OF_BLOCKS);
    assert_int_equal(kvarn_llama_session_pos(s), 64);
    kvarn_llama_session_free(s);
}

/* The session's cache through cache.h (kvarn_llama_session_cache): its
 * geometry is the session's (format, model shape, one sequence of
 * max_tokens), its arena is the plan's kv_bytes, and its counters follow the
 * forward calls: after 300 tokens in 128-token tiles, tile 0 is the fp16
 * sink, tile 1 is quantized (all its tokens committed), tile 2 holds 44
 * tokens in an fp16 tail page and already owns its block (cache.h, "Block
 * accounting"). A reset empties it. Per-token formats: ceil(300 / G) blocks,
 * no pages. An exact session has no cache. */
static void test_session_cache(void **state)
{
    fixture *f = *state;
    kvarn_llama_session_opts o = KVARN_LLAMA_SESSION_OPTS_DEFAULT;
    o.attn_threads = test_threads(1);
    o.format = fmt_of("kvarn_k4v2_g128");
    o.max_tokens = NTOK;
    o.max_chunk = 160;
    kvarn_llama_session_info plan;
    assert_int_equal(kvarn_llama_session_plan(f->m, &o, &plan), KVARN_OK);
    kvarn_llama_session *s = NULL;
    assert_int_equal(kvarn_llama_session_create(f->m, &o, &s), KVARN_OK);
    kvarn_cache *c = kvarn_llama_session_cache(s);
    assert_non_null(c);
    const int seq = kvarn_llama_session_seq(s);
    assert_true(seq >= 0);
    kvarn_cache_info ci;
    assert_int_equal(kvarn_cache_get_info(c, &ci), KVARN_OK);
    assert_string_equal(ci.format.name, "kvarn_k4v2_g128");
    assert_int_equal(ci.n_layers, NL);
    assert_int_equal(ci.n_kv_heads, NKV);
    assert_int_equal(ci.head_dim, HD);
    assert_int_equal(ci.block_size, 128);
    assert_int_equal(ci.sink_tiles, 1);
    assert_int_equal(ci.max_seqs, 1);
    assert_int_equal(ci.max_seq_len, NTOK);
    assert_true(ci.arena_bytes == plan.kv_bytes);

    assert_int_equal(kvarn_llama_forward(s, f->ids, 160, KVARN_LLAMA_LOGITS_NONE, NULL, 0), KVARN_OK);
    assert_int_equal(kvarn_llama_forward(s, f->ids + 160, 140, KVARN_LLAMA_LOGITS_NONE, NULL, 0), KVARN_OK);
    kvarn_cache_seq_info si;
    assert_int_equal(kvarn_cache_seq_get_info(c, seq, &si), KVARN_OK);
    assert_int_equal(si.seq_len, kvarn_llama_session_pos(s));
    assert_int_equal(si.committed_len, NTOK);
    assert_int_equal(si.quantized_tiles, 1);
    assert_int_equal(si.committed_tiles, 2);
    kvarn_cache_stats cs;
    assert_int_equal(kvarn_cache_get_stats(c, &cs), KVARN_OK);
    assert_int_equal(cs.n_seqs, 1);
    assert_true(cs.tokens == NTOK);
    assert_int_equal(cs.blocks_in_use, 2);
    assert_int_equal(cs.pages_in_use, 2);
    assert_true(cs.used_bytes_per_token ==
                (2.0 * (double)ci.block_bytes + 2.0 * (double)ci.page_bytes) / NTOK);
    kvarn_llama_session_reset(s);
    assert_int_equal(kvarn_cache_get_stats(c, &cs), KVARN_OK);
    assert_true(cs.n_seqs == 1 && cs.tokens == 0 && cs.blocks_in_use == 0 && cs.pages_in_use == 0);
    assert_int_equal(kvarn_cache_seq_get_info(c, kvarn_llama_session_seq(s), &si), KVARN_OK);
    assert_int_equal(si.seq_len, 0);
    kvarn_llama_session_free(s);

    o.format = fmt_of("int8");
    assert_int_equal(kvarn_llama_session_create(f->m, &o, &s), KVARN_OK);
    c = kvarn_llama_session_cache(s);
    assert_int_equal(kvarn_cache_get_info(c, &ci), KVARN_OK);
    assert_string_equal(ci.format.name, "int8");
    assert_int_equal(ci.sink_tiles, 0);
    assert_int_equal(kvarn_llama_forward(s, f->ids, 100, KVARN_LLAMA_LOGITS_NONE, NULL, 0), KVARN_OK);
    assert_int_equal(kvarn_cache_get_stats(c, &cs), KVARN_OK);
    assert_int_equal(cs.blocks_in_use, (100 + ci.block_size - 1) / ci.block_size);
    assert_int_equal(cs.pages_in_use, 0);
    kvarn_llama_session_free(s);

    o.exact = 1;
    assert_int_equal(kvarn_llama_session_create(f->m, &o, &s), KVARN_OK);
    assert_null(kvarn_llama_session_cache(s));
    assert_int_equal(kvarn_llama_session_seq(s), -1);
    kvarn_llama_session_free(s);
    assert_null(kvarn_llama_session_cache(NULL));
    assert_int_equal(kvarn_llama_session_seq(NULL), -1);

    /* A hand-made format whose name fills all 32 bytes without a NUL:
     * the session's name is cut to 31 characters, never read past. */
    kvarn_format named = *fmt_of("int8");
    memset(named.name, 'x', sizeof named.name);
    o.exact = 0;
    o.format = &named;
    assert_int_equal(kvarn_llama_session_create(f->m, &o, &s), KVARN_OK);
    assert_int_equal(strlen(kvarn_llama_session_format(s)), sizeof named.name - 1);
    kvarn_llama_session_free(s);
}

/* Sessions on a caller's cache (opts.cache): two sessions take one
 * sequence each of one pool and, fed in turns, give bit for bit the logits
 * of a session with a cache of its own (the same arithmetic on the same
 * values: only the block and page ids differ, and the kernels read through
 * the block table). The pool is the caller's: kv_bytes 0 in the plan, the
 * sessions' tokens in its counters, a third sequence refused when
 * max_seqs = 2, blocks back in the pool when a session is freed, and a
 * forward call that finds no free block fails with the session as before.
 * A cache of another shape, or options the cache decides, are refused. */
static void test_shared_cache(void **state)
{
    fixture *f = *state;
    /* G = 128, NTOK = 300: a sequence holds the sink page, blocks for tiles
     * 1 and 2 and, while tile 2 fills, its page; a 140-token chunk into
     * tile 1 opens tile 2: 3 pages at once. Two sequences: 4 blocks and at
     * most 2 + 3 pages. */
    kvarn_cache_opts co = kvarn_cache_default_opts();
    co.format = *fmt_of("kvarn_k4v2_g128");
    co.n_layers = NL;
    co.n_kv_heads = NKV;
    co.head_dim = HD;
    co.max_seqs = 2;
    co.max_seq_len = NTOK;
    co.n_pages = 5;
    kvarn_cache_info geo;
    assert_int_equal(kvarn_cache_plan(&co, &geo), KVARN_OK); /* budget 0: sizes only */
    co.budget_bytes = 4 * (uint64_t)geo.block_bytes + 5 * (uint64_t)geo.page_bytes;
    kvarn_cache *c = NULL;
    assert_int_equal(kvarn_cache_create(&co, &c), KVARN_OK);

    kvarn_llama_session_opts o = KVARN_LLAMA_SESSION_OPTS_DEFAULT;
    o.attn_threads = test_threads(1);
    o.max_tokens = NTOK;
    o.max_chunk = 160;
    kvarn_llama_session *own = NULL, *a = NULL, *b = NULL, *s3 = (kvarn_llama_session *)f;
    o.format = fmt_of("kvarn_k4v2_g128");
    assert_int_equal(kvarn_llama_session_create(f->m, &o, &own), KVARN_OK);
    o.format = NULL;
    o.cache = c;
    kvarn_llama_session_info info;
    assert_int_equal(kvarn_llama_session_plan(f->m, &o, &info), KVARN_OK);
    assert_true(info.kv_bytes == 0 && info.total_bytes == info.other_bytes);
    assert_string_equal(info.format.name, "kvarn_k4v2_g128");
    assert_int_equal(kvarn_llama_session_create(f->m, &o, &a), KVARN_OK);
    assert_int_equal(kvarn_llama_session_create(f->m, &o, &b), KVARN_OK);
    assert_ptr_equal(kvarn_llama_session_cache(a), c);
    assert_true(kvarn_llama_session_seq(a) != kvarn_llama_session_seq(b));
    assert_int_equal(kvarn_llama_session_create(f->m, &o, &s3), KVARN_ERR_OUT_OF_BLOCKS);
    assert_null(s3);

    /* b reads the text backwards: other tokens in the same pool */
    int32_t rev[NTOK];
    for (int i = 0; i < NTOK; i++) rev[i] = f->ids[NTOK - 1 - i];
    float la[VOCAB], lo[VOCAB], lb[VOCAB];
    const int cut[3] = { 0, 160, NTOK };
    for (int k = 0; k < 2; k++) {
        int n = cut[k + 1] - cut[k];
        assert_int_equal(kvarn_llama_forward(a, f->ids + cut[k], n, KVARN_LLAMA_LOGITS_LAST, la, VOCAB), KVARN_OK);
        assert_int_equal(kvarn_llama_forward(b, rev + cut[k], n, KVARN_LLAMA_LOGITS_LAST, lb, VOCAB), KVARN_OK);
        assert_int_equal(kvarn_llama_forward(own, f->ids + cut[k], n, KVARN_LLAMA_LOGITS_LAST, lo, VOCAB), KVARN_OK);
        assert_memory_equal(la, lo, sizeof la);
    }
    kvarn_cache_stats cs;
    assert_int_equal(kvarn_cache_get_stats(c, &cs), KVARN_OK);
    assert_true(cs.n_seqs == 2 && cs.tokens == 2 * NTOK && cs.blocks_in_use == 4 && cs.pages_in_use == 4);

    /* Freed, a session's blocks and pages return to the pool; the other
     * session goes on. */
    kvarn_llama_session_free(a);
    assert_int_equal(kvarn_cache_get_stats(c, &cs), KVARN_OK);
    assert_true(cs.n_seqs == 1 && cs.blocks_in_use == 2 && cs.pages_in_use == 2);
    /* b's sequence after a reset is empty again, the pool shared as before */
    kvarn_llama_session_reset(b);
    assert_int_equal(kvarn_cache_get_stats(c, &cs), KVARN_OK);
    assert_true(cs.n_seqs == 1 && cs.tokens == 0 && cs.blocks_in_use == 0 && cs.pages_in_use == 0);
    assert_int_equal(kvarn_llama_forward(b, rev, 160, KVARN_LLAMA_LOGITS_NONE, NULL, 0), KVARN_OK);

    /* A pool of one block: tile 1 takes it, tile 2 finds none; the call
     * fails and the session stays at 160 tokens, its cache as it was. */
    kvarn_cache_opts small = co;
    small.max_seqs = 1;
    small.budget_bytes = (uint64_t)geo.block_bytes + 5 * (uint64_t)geo.page_bytes;
    kvarn_cache *c1 = NULL;
    assert_int_equal(kvarn_cache_create(&small, &c1), KVARN_OK);
    kvarn_llama_session_opts o1 = o;
    o1.cache = c1;
    assert_int_equal(kvarn_llama_session_create(f->m, &o1, &a), KVARN_OK);
    assert_int_equal(kvarn_llama_forward(a, f->ids, 160, KVARN_LLAMA_LOGITS_NONE, NULL, 0), KVARN_OK);
    assert_int_equal(kvarn_llama_forward(a, f->ids + 160, 140, KVARN_LLAMA_LOGITS_LAST, la, VOCAB),
                     KVARN_ERR_OUT_OF_BLOCKS);
    assert_int_equal(kvarn_llama_session_pos(a), 160);
    assert_int_equal(kvarn_cache_get_stats(c1, &cs), KVARN_OK);
    assert_true(cs.tokens == 160 && cs.blocks_in_use == 1 && cs.pages_in_use == 2);
    kvarn_llama_session_free(a);
    kvarn_cache_destroy(c1);

    /* what the cache decides, or a shape it does not have: refused */
    kvarn_llama_session_opts bad = o;
    bad.format = fmt_of("kvarn_k4v2_g128");
    assert_int_equal(kvarn_llama_session_create(f->m, &bad, &s3), KVARN_ERR_INVALID_ARG);
    bad = o;
    bad.sink_tiles = 0;
    assert_int_equal(kvarn_llama_session_plan(f->m, &bad, &info), KVARN_ERR_INVALID_ARG);
    bad = o;
    bad.sink_tokens = 16;
    assert_int_equal(kvarn_llama_session_plan(f->m, &bad, &info), KVARN_ERR_INVALID_ARG);
    bad = o;
    bad.exact = 1;
    assert_int_equal(kvarn_llama_session_plan(f->m, &bad, &info), KVARN_ERR_INVALID_ARG);
    bad = o;
    bad.max_tokens = NTOK + 1;
    assert_int_equal(kvarn_llama_session_plan(f->m, &bad, &info), KVARN_ERR_INVALID_ARG);
    kvarn_llama_session_free(b);
    kvarn_llama_session_free(own);
    kvarn_cache_destroy(c);
    co.head_dim = 128;
    co.budget_bytes = 0;
    assert_int_equal(kvarn_cache_plan(&co, &geo), KVARN_OK);
    co.budget_bytes = 4 * (uint64_t)geo.block_bytes + 5 * (uint64_t)geo.page_bytes;
    assert_int_equal(kvarn_cache_create(&co, &c), KVARN_OK);
    bad = o;
    bad.cache = c;
    assert_int_equal(kvarn_llama_session_create(f->m, &bad, &s3), KVARN_ERR_INVALID_ARG);
    assert_null(s3);
    assert_int_equal(kvarn_cache_get_stats(c, &cs), KVARN_OK);
    assert_int_equal(cs.n_seqs, 0);
    kvarn_cache_destroy(c);
}

/* Load options: the weight precision. The fixture's model is fp32; bf16
 * asked for explicitly holds half the bytes
 * (2 per weight instead of 4, exactly), runs with finite logits, and a
 * session of it plans its bf16 activation buffer on top of fp32's. */
static void test_weights_option(void **state)
{
    fixture *f = *state;
    assert_int_equal(kvarn_llama_get_weights(f->m), KVARN_LLAMA_WEIGHTS_FP32);
    kvarn_llama_load_opts lo = KVARN_LLAMA_LOAD_OPTS_DEFAULT;
    kvarn_llama *m = (kvarn_llama *)f; /* must be reset to NULL on error */
    lo.weights = (kvarn_llama_weights)7;
    assert_int_equal(kvarn_llama_load_gguf_with(f->g, &lo, &m), KVARN_ERR_INVALID_ARG);
    assert_null(m);
    /* AUTO reads KVARN_WEIGHTS: anything but fp32 / bf16 is refused. */
    const char *env = getenv("KVARN_WEIGHTS");
    char saved[16] = "";
    if (env) snprintf(saved, sizeof saved, "%s", env);
    lo.weights = KVARN_LLAMA_WEIGHTS_AUTO;
    assert_int_equal(setenv("KVARN_WEIGHTS", "fp64", 1), 0);
    assert_int_equal(kvarn_llama_load_gguf_with(f->g, &lo, &m), KVARN_ERR_INVALID_ARG);
    assert_null(m);
    assert_int_equal(setenv("KVARN_WEIGHTS", "fp32", 1), 0);
    assert_int_equal(kvarn_llama_load_gguf_with(f->g, &lo, &m), KVARN_OK);
    assert_int_equal(kvarn_llama_get_weights(m), KVARN_LLAMA_WEIGHTS_FP32);
    assert_true(kvarn_llama_weight_bytes(m) == kvarn_llama_weight_bytes(f->m));
    kvarn_llama_free(m);
    if (env) assert_int_equal(setenv("KVARN_WEIGHTS", saved, 1), 0);
    else assert_int_equal(unsetenv("KVARN_WEIGHTS"), 0);

    lo.weights = KVARN_LLAMA_WEIGHTS_BF16;
    kvarn_status st = kvarn_llama_load_gguf_with(f->g, &lo, &m);
    if (st == KVARN_ERR_UNSUPPORTED) skip(); /* built without oneDNN */
    assert_int_equal(st, KVARN_OK);
    assert_int_equal(kvarn_llama_get_weights(m), KVARN_LLAMA_WEIGHTS_BF16);
    /* Every weight in 2 bytes (the fp32 model's 4), plus the padding of
     * oneDNN's blocked layout, which rounds each matrix's rows and columns
     * up to its blocks (here 64 x 32: the 300-row head holds 320 rows, 5120
     * bytes more). The padding is oneDNN's choice per CPU, so only bounded:
     * (out + 63)(in + 63) - out in < 64 (out + in + 64) weights per matrix
     * for blocks of at most 64 each way, at 2 bytes (per layer: QKV, output,
     * gate+up, down; then the head). */
    uint64_t b16 = kvarn_llama_weight_bytes(m), b32 = kvarn_llama_weight_bytes(f->m);
    const uint64_t qkv = (NH + 2 * NKV) * HD, qd = NH * HD;
    uint64_t strips = 2u * 64u * (NL * ((qkv + E + 64) + (E + qd + 64) + (2 * FF + E + 64) +
                                        (E + FF + 64)) + (VOCAB + E + 64));
    assert_true(2 * b16 >= b32);
    assert_true(b16 <= b32 / 2 + strips);
    kvarn_llama_session_opts o = KVARN_LLAMA_SESSION_OPTS_DEFAULT;
    o.max_tokens = NTOK;
    o.max_chunk = 64;
    kvarn_llama_session_info i32, i16;
    assert_int_equal(kvarn_llama_session_plan(f->m, &o, &i32), KVARN_OK);
    assert_int_equal(kvarn_llama_session_plan(m, &o, &i16), KVARN_OK);
    /* at least max_chunk rows of the widest matmul input (H D = 256) in bf16 */
    assert_true(i16.other_bytes >= i32.other_bytes + 64u * NH * HD * 2u);
    kvarn_llama_session *s = NULL;
    assert_int_equal(kvarn_llama_session_create(m, &o, &s), KVARN_OK);
    float *lg = malloc(sizeof(float) * 64 * VOCAB);
    assert_non_null(lg);
    assert_int_equal(kvarn_llama_forward(s, f->ids, 64, KVARN_LLAMA_LOGITS_ALL, lg,
                                         (size_t)64 * VOCAB), KVARN_OK);
    assert_int_equal(kvarn_llama_forward(s, f->ids + 64, 1, KVARN_LLAMA_LOGITS_LAST, lg,
                                         VOCAB), KVARN_OK);
    for (int j = 0; j < VOCAB; j++) assert_true(isfinite(lg[j]));
    kvarn_llama_session_free(s);
    kvarn_llama_free(m);

    /* int8: 1 byte a weight and a float scale a row (the fp32 model: 4
     * bytes a weight), plus the blocked layout's padding (the strips above,
     * at half the bytes) and the per-column int32 compensation oneDNN may
     * keep beside s8 x s8 weights (4 bytes x the padded columns, per
     * matrix); the embedding stays plain (looked up, never multiplied). */
    lo.weights = KVARN_LLAMA_WEIGHTS_INT8;
    assert_int_equal(kvarn_llama_load_gguf_with(f->g, &lo, &m), KVARN_OK);
    assert_int_equal(kvarn_llama_get_weights(m), KVARN_LLAMA_WEIGHTS_INT8);
    const uint64_t rows = NL * (qkv + E + 2 * FF + E) + 2 * VOCAB;
    const uint64_t comp = 4u * (NL * (qkv + 64 + E + 64 + 2 * FF + 64 + E + 64) + VOCAB + 64);
    uint64_t b8 = kvarn_llama_weight_bytes(m);
    assert_true(b8 >= b32 / 4 + 4 * rows);
    assert_true(b8 <= b32 / 4 + 4 * rows + strips / 2 + comp);
    assert_int_equal(kvarn_llama_session_create(m, &o, &s), KVARN_OK);
    assert_int_equal(kvarn_llama_forward(s, f->ids, 64, KVARN_LLAMA_LOGITS_ALL, lg,
                                         (size_t)64 * VOCAB), KVARN_OK);
    assert_int_equal(kvarn_llama_forward(s, f->ids + 64, 1, KVARN_LLAMA_LOGITS_LAST, lg,
                                         VOCAB), KVARN_OK);
    for (int j = 0; j < VOCAB; j++) assert_true(isfinite(lg[j]));
    free(lg);
    kvarn_llama_session_free(s);
    kvarn_llama_free(m);
}

/* gguf weights on the tiny file. Kept as blocks: attn_output (Q4_1),
 * ffn_down (Q8_0) and the embedding (Q8_0); the stacks of mixed types
 * (QKV: F16 + Q4_1 + Q8_0, gate/up: Q4_1 + F16) and the F16 head in fp32.
 * Every weight is dequant.c's value (tests/model/test_qgemv.c), so this is
 * the fp32 model with other summation orders: against the fp32 weights'
 * run the bound of test_exact_prefill_decode_chunked holds (2 paths x 11
 * stages x gamma_300 of max|logit|), for one prefill, chunks of 7 (the
 * slab + sgemm path) and decode (the GEMV). Two sessions on two threads
 * share the model, each with 2 GEMV / attention workers: the same bits as
 * one such session alone. AUTO does not pick gguf for this file (F16
 * matrices); KVARN_WEIGHTS=gguf does. */
typedef struct sess_arg {
    const kvarn_llama *m;
    const fixture *f;
    float *out;
} sess_arg;

static void *sess_thread(void *p)
{
    sess_arg *a = p;
    a->out = run_model(a->m, a->f, "kvarn_k4v2_g128", KERNELS, 1, 2);
    return NULL;
}

/* The fixture's model loaded again with weights w (the caller frees it). */
static kvarn_llama *load_with_weights(const fixture *f, kvarn_llama_weights w)
{
    kvarn_llama_load_opts lo = KVARN_LLAMA_LOAD_OPTS_DEFAULT;
    lo.weights = w;
    kvarn_llama *m = NULL;
    assert_int_equal(kvarn_llama_load_gguf_with(f->g, &lo, &m), KVARN_OK);
    return m;
}

static void test_gguf_weights(void **state)
{
    fixture *f = *state;
    kvarn_llama *m = load_with_weights(f, KVARN_LLAMA_WEIGHTS_GGUF);
    kvarn_llama_load_opts lo = KVARN_LLAMA_LOAD_OPTS_DEFAULT; /* the AUTO loads below */
    assert_int_equal(kvarn_llama_get_weights(m), KVARN_LLAMA_WEIGHTS_GGUF);
    assert_non_null(m->layers[0].wo.q);
    assert_non_null(m->layers[0].w_down.q);
    assert_non_null(m->tok_embd.q);
    assert_non_null(m->layers[0].wqkv.f32);
    assert_non_null(m->layers[0].w_gate_up.f32);
    assert_non_null(m->output.f32);
    /* bytes: the fp32 model's, with wo, down and the embedding at their
     * block sizes (Q4_1: 20 bytes, Q8_0: 34 bytes per 32 weights) */
    const uint64_t wo = (uint64_t)E * NH * HD, down = (uint64_t)E * FF, emb = (uint64_t)VOCAB * E;
    uint64_t expect = kvarn_llama_weight_bytes(f->m) - 4 * (NL * (wo + down) + emb) +
                      NL * (wo / 32 * 20 + down / 32 * 34) + emb / 32 * 34;
    assert_true(kvarn_llama_weight_bytes(m) == expect);
    /* the embedding rows are dequant.c's */
    float row[E], ref[E];
    kvarn_llama_hparams const *hp = kvarn_llama_get_hparams(m);
    assert_int_equal(hp->vocab, VOCAB);
    llama_matrix_get_row(&m->tok_embd, 17, row);
    llama_matrix_get_row(&f->m->tok_embd, 17, ref);
    assert_memory_equal(row, ref, sizeof row);

    const double u = 1.0 / 16777216.0, gamma = NTOK * u / (1.0 - NTOK * u);
    const double tol = 2.0 * (5 * NL + 1) * gamma;
    static const int CH[3] = {NTOK, 7, 1};
    for (int i = 0; i < 3; i++) {
        float *a = run(f, NULL, EXACT, CH[i]);
        float *b = run_model(m, f, NULL, EXACT, CH[i], 1);
        double scale = max_abs(a);
        print_message("gguf vs fp32 weights, exact store, chunk %d: max|diff| %.2e (bound %.2e)\n",
                      CH[i], max_diff(a, b), tol * scale);
        assert_true(max_diff(a, b) <= tol * scale);
        free(a);
        free(b);
    }
    /* two sessions on two threads, one model */
    float *alone = run_model(m, f, "kvarn_k4v2_g128", KERNELS, 1, 2);
    sess_arg sa = {m, f, NULL}, sb = {m, f, NULL};
    pthread_t ta, tb;
    assert_int_equal(pthread_create(&ta, NULL, sess_thread, &sa), 0);
    assert_int_equal(pthread_create(&tb, NULL, sess_thread, &sb), 0);
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    assert_true(sa.out && sb.out);
    assert_memory_equal(sa.out, alone, sizeof(float) * NTOK * VOCAB);
    assert_memory_equal(sb.out, alone, sizeof(float) * NTOK * VOCAB);
    free(alone);
    free(sa.out);
    free(sb.out);
    kvarn_llama_free(m);

    /* AUTO: gguf only for a file of blocked matrices on a CPU with the
     * AVX2 / AVX-512 GEMV (KVARN_SIMD=scalar: not), or when named */
    const char *env = getenv("KVARN_WEIGHTS");
    char saved[16] = "";
    if (env) snprintf(saved, sizeof saved, "%s", env);
    lo.weights = KVARN_LLAMA_WEIGHTS_AUTO;
    assert_int_equal(unsetenv("KVARN_WEIGHTS"), 0);
    assert_int_equal(kvarn_llama_load_gguf_with(f->g, &lo, &m), KVARN_OK);
    assert_true(kvarn_llama_get_weights(m) != KVARN_LLAMA_WEIGHTS_GGUF);
    kvarn_llama_free(m);
    wmeta blocked = k_meta;
    blocked.all_blocked = 1;
    buf bf = write_gguf("llama", 0, &blocked);
    kvarn_gguf *gb = NULL;
    assert_int_equal(kvarn_gguf_open_memory(bf.p, bf.n, &gb, NULL, 0), KVARN_OK);
    assert_int_equal(kvarn_llama_load_gguf_with(gb, &lo, &m), KVARN_OK);
    if (kvarn__cpu_level() >= KVARN_CPU_AVX2) {
        assert_int_equal(kvarn_llama_get_weights(m), KVARN_LLAMA_WEIGHTS_GGUF);
        assert_non_null(m->output.q); /* Q4_1 head, Q4_1 + Q8_0 stacks... */
        assert_null(m->layers[0].wqkv.q); /* ...of mixed types: fp32 */
        assert_non_null(m->layers[0].w_gate_up.q); /* Q4_1 + Q4_1 */
    }
    kvarn_llama_free(m);
    levels_iter scalar = levels_hold(levels_index_of("scalar"));
    assert_int_equal(kvarn_llama_load_gguf_with(gb, &lo, &m), KVARN_OK);
    assert_true(kvarn_llama_get_weights(m) != KVARN_LLAMA_WEIGHTS_GGUF);
    kvarn_llama_free(m);
    levels_end(&scalar);
    kvarn_gguf_close(gb);
    free(bf.p);
    assert_int_equal(setenv("KVARN_WEIGHTS", "gguf", 1), 0);
    assert_int_equal(kvarn_llama_load_gguf_with(f->g, &lo, &m), KVARN_OK);
    assert_int_equal(kvarn_llama_get_weights(m), KVARN_LLAMA_WEIGHTS_GGUF);
    kvarn_llama_free(m);
    if (env) assert_int_equal(setenv("KVARN_WEIGHTS", saved, 1), 0);
    else assert_int_equal(unsetenv("KVARN_WEIGHTS"), 0);
}

/* A NaN reaching the cache fails the call with KVARN_ERR_NONFINITE and
 * leaves the session as before: the same tokens then give the logits of a
 * session that never saw the failure. */
static void test_nonfinite_rolls_back(void **state)
{
    fixture *f = *state;
    static const char *formats[] = { "fp16", "int4", "kvarn_k4v2_g128" };
    for (int i = 0; i < 3; i++) {
        kvarn_llama_session_opts o = KVARN_LLAMA_SESSION_OPTS_DEFAULT;
        o.attn_threads = test_threads(1);
        o.format = fmt_of(formats[i]);
        o.max_tokens = NTOK;
        o.max_chunk = 128;
        kvarn_llama_session *a = NULL, *b = NULL;
        assert_int_equal(kvarn_llama_session_create(f->m, &o, &a), KVARN_OK);
        assert_int_equal(kvarn_llama_session_create(f->m, &o, &b), KVARN_OK);
        float la[VOCAB], lb[VOCAB];
        int32_t poison[3] = { f->ids[0], VOCAB - 1, f->ids[1] };
        for (int p = 0; p < 256; p += 128) {
            assert_int_equal(kvarn_llama_forward(a, f->ids + p, 128, KVARN_LLAMA_LOGITS_NONE,
                                                 NULL, 0), KVARN_OK);
            assert_int_equal(kvarn_llama_forward(b, f->ids + p, 128, KVARN_LLAMA_LOGITS_NONE,
                                                 NULL, 0), KVARN_OK);
        }
        assert_int_equal(kvarn_llama_forward(a, poison, 3, KVARN_LLAMA_LOGITS_LAST, la, VOCAB),
                         KVARN_ERR_NONFINITE);
        assert_int_equal(kvarn_llama_session_pos(a), 256);
        assert_int_equal(kvarn_llama_forward(a, f->ids + 256, 44, KVARN_LLAMA_LOGITS_LAST,
                                             la, VOCAB), KVARN_OK);
        assert_int_equal(kvarn_llama_forward(b, f->ids + 256, 44, KVARN_LLAMA_LOGITS_LAST,
                                             lb, VOCAB), KVARN_OK);
        assert_memory_equal(la, lb, sizeof la);
        kvarn_llama_session_free(a);
        kvarn_llama_session_free(b);
    }
}

static void test_bad_files(void **state)
{
    (void)state;
    kvarn_llama *m = NULL;
    assert_int_equal(kvarn_llama_load("/nonexistent/model.gguf", &m), KVARN_ERR_IO);
    assert_null(m);
    assert_int_equal(kvarn_llama_load(NULL, &m), KVARN_ERR_INVALID_ARG);
    const char *arch[2] = { "gpt2", "llama" };
    for (int i = 0; i < 2; i++) {
        /* i = 0: another architecture; i = 1: the last tensor missing. */
        buf b = write_gguf(arch[i], i, &k_meta);
        kvarn_gguf *g = NULL;
        assert_int_equal(kvarn_gguf_open_memory(b.p, b.n, &g, NULL, 0), KVARN_OK);
        assert_int_equal(kvarn_llama_load_gguf(g, &m), KVARN_ERR_BAD_FILE);
        assert_null(m);
        kvarn_gguf_close(g);
        free(b.p);
    }
    /* kvarn_llama_read_hparams names the bad key and its value, and leaves
     * *out as it was: another architecture; head_count_kv 0, and one that
     * does not divide head_count; an odd key_length; context_length 0. */
    struct { const char *arch; wmeta meta; const char *msg; } bad[] = {
        {"gpt2", k_meta, "GGUF key general.architecture = 'gpt2': this runner takes 'llama'"},
        {"llama", {1024, NH, 0, HD, 0},
         "GGUF key llama.attention.head_count_kv = 0: must be >= 1 and divide head_count"},
        {"llama", {1024, NH, NH + 1, HD, 0},
         "GGUF key llama.attention.head_count_kv = " },
        {"llama", {1024, NH, NKV, HD + 1, 0}, "GGUF key llama.attention.key_length = "},
        {"llama", {0, NH, NKV, HD, 0},
         "GGUF key llama.context_length = 0: must be from 1 to 2147483647"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        buf bb = write_gguf(bad[i].arch, 0, &bad[i].meta);
        kvarn_gguf *gg = NULL;
        assert_int_equal(kvarn_gguf_open_memory(bb.p, bb.n, &gg, NULL, 0), KVARN_OK);
        kvarn_llama_hparams hp;
        memset(&hp, 0x5a, sizeof hp);
        char err[200];
        assert_int_equal(kvarn_llama_read_hparams(gg, &hp, err, sizeof err), KVARN_ERR_BAD_FILE);
        print_message("%s\n", err);
        assert_non_null(strstr(err, bad[i].msg));
        for (size_t k = 0; k < sizeof hp; k++) assert_int_equal(((unsigned char *)&hp)[k], 0x5a);
        assert_int_equal(kvarn_llama_read_hparams(gg, &hp, NULL, 0), KVARN_ERR_BAD_FILE);
        assert_int_equal(kvarn_llama_read_hparams(gg, &hp, err, 8), KVARN_ERR_BAD_FILE);
        assert_int_equal(strlen(err), 7); /* cut to fit, terminated */
        assert_int_equal(kvarn_llama_load_gguf(gg, &m), KVARN_ERR_BAD_FILE);
        kvarn_gguf_close(gg);
        free(bb.p);
    }
    {
        buf bb = write_gguf("llama", 0, &k_meta);
        kvarn_gguf *gg = NULL;
        assert_int_equal(kvarn_gguf_open_memory(bb.p, bb.n, &gg, NULL, 0), KVARN_OK);
        kvarn_llama_hparams hp;
        char err[64] = "x";
        assert_int_equal(kvarn_llama_read_hparams(gg, &hp, err, sizeof err), KVARN_OK);
        assert_string_equal(err, "");
        assert_true(hp.n_heads == NH && hp.n_kv_heads == NKV && hp.head_dim == HD &&
                    hp.vocab == VOCAB && hp.hidden == E && hp.n_layers == NL);
        assert_int_equal(kvarn_llama_read_hparams(NULL, &hp, err, sizeof err), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_llama_read_hparams(gg, NULL, err, sizeof err), KVARN_ERR_INVALID_ARG);
        kvarn_gguf_close(gg);
        free(bb.p);
    }
    /* kvarn_llama_check_tensors names the first missing or misshapen
     * tensor (the loader refused both with a bare KVARN_ERR_BAD_FILE) */
    {
        buf bb = write_gguf("llama", 1, &k_meta); /* blk.(NL-1).ffn_down dropped */
        kvarn_gguf *gg = NULL;
        assert_int_equal(kvarn_gguf_open_memory(bb.p, bb.n, &gg, NULL, 0), KVARN_OK);
        kvarn_llama_hparams hp;
        assert_int_equal(kvarn_llama_read_hparams(gg, &hp, NULL, 0), KVARN_OK);
        char err[320], want[200];
        assert_int_equal(kvarn_llama_check_tensors(gg, &hp, err, sizeof err), KVARN_ERR_BAD_FILE);
        print_message("%s\n", err);
        snprintf(want, sizeof want, "GGUF tensor blk.%d.ffn_down.weight is missing (", NL - 1);
        assert_non_null(strstr(err, want));
        kvarn_gguf_close(gg);
        free(bb.p);
    }
    {
        /* attn_k of layer 0 misshapen: its tensor info's ne[0], ne[1]
         * (after the name and n_dims u32) patched to [2 E, NKV HD / 2], as
         * many Q4_1 blocks, so the file stays valid (packed). One row
         * short would leave a gap after it, refused by the reader at open. */
        buf bb = write_gguf("llama", 0, &k_meta);
        const char *name = "blk.0.attn_k.weight";
        size_t len = strlen(name), at = 0;
        for (size_t i = 8; i + len + 20 <= bb.n && !at; i++) {
            uint64_t n8;
            memcpy(&n8, bb.p + i - 8, 8);
            if (n8 == len && memcmp(bb.p + i, name, len) == 0) at = i + len + 4;
        }
        assert_true(at > 0);
        uint64_t ne[2] = {E, NKV * HD - 1};
        memcpy(bb.p + at, ne, 16);
        kvarn_gguf *gg = NULL;
        char oerr[256];
        assert_int_equal(kvarn_gguf_open_memory(bb.p, bb.n, &gg, oerr, sizeof oerr),
                         KVARN_ERR_BAD_FILE);
        assert_non_null(strstr(oerr, "bytes unaccounted for"));
        ne[0] = 2 * E;
        ne[1] = NKV * HD / 2;
        memcpy(bb.p + at, ne, 16);
        assert_int_equal(kvarn_gguf_open_memory(bb.p, bb.n, &gg, NULL, 0), KVARN_OK);
        kvarn_llama_hparams hp;
        assert_int_equal(kvarn_llama_read_hparams(gg, &hp, NULL, 0), KVARN_OK);
        char err[320], want[200];
        assert_int_equal(kvarn_llama_check_tensors(gg, &hp, err, sizeof err), KVARN_ERR_BAD_FILE);
        print_message("%s\n", err);
        snprintf(want, sizeof want,
                 "GGUF tensor blk.0.attn_k.weight has shape [%d, %d]: expected [%d, %d] "
                 "(embedding_length %d, head_count_kv %d x head_dim %d)",
                 2 * E, NKV * HD / 2, E, NKV * HD, E, NKV, HD);
        assert_string_equal(err, want);
        assert_int_equal(kvarn_llama_check_tensors(gg, &hp, NULL, 0), KVARN_ERR_BAD_FILE);
        assert_int_equal(kvarn_llama_check_tensors(gg, &hp, err, 8), KVARN_ERR_BAD_FILE);
        assert_int_equal(strlen(err), 7); /* cut to fit, terminated */
        assert_int_equal(kvarn_llama_check_tensors(NULL, &hp, err, sizeof err), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_llama_check_tensors(gg, NULL, err, sizeof err), KVARN_ERR_INVALID_ARG);
        assert_int_equal(kvarn_llama_load_gguf(gg, &m), KVARN_ERR_BAD_FILE);
        assert_null(m);
        kvarn_gguf_close(gg);
        free(bb.p);
    }
    {
        buf bb = write_gguf("llama", 0, &k_meta);
        kvarn_gguf *gg = NULL;
        assert_int_equal(kvarn_gguf_open_memory(bb.p, bb.n, &gg, NULL, 0), KVARN_OK);
        kvarn_llama_hparams hp;
        assert_int_equal(kvarn_llama_read_hparams(gg, &hp, NULL, 0), KVARN_OK);
        char err[64] = "x";
        assert_int_equal(kvarn_llama_check_tensors(gg, &hp, err, sizeof err), KVARN_OK);
        assert_string_equal(err, "");
        kvarn_gguf_close(gg);
        free(bb.p);
    }
    /* Hyper-parameters whose weight sizes cannot be held: 2^16 heads of
     * 2^16 channels make Q 2^32 rows wide, beyond the int dimensions of a
     * tensor (and wqkv 3 * 2^32 * 128 floats). Refused before the first
     * weight is allocated, not tried as a 6 TiB allocation. */
    wmeta wide = k_meta;
    wide.head_count = wide.head_count_kv = wide.key_length = 1u << 16;
    buf b = write_gguf("llama", 0, &wide);
    kvarn_gguf *g = NULL;
    assert_int_equal(kvarn_gguf_open_memory(b.p, b.n, &g, NULL, 0), KVARN_OK);
    assert_int_equal(kvarn_llama_load_gguf(g, &m), KVARN_ERR_TOO_LARGE);
    assert_null(m);
    kvarn_gguf_close(g);
    free(b.p);
}

/* Contexts at the size limits (issue 8). max_tokens = INT32_MAX, or a GGUF
 * whose llama.context_length is INT32_MAX, used to give a session with a
 * one-block cache (the tile count overflowed int) that failed with "block
 * pool exhausted" after 16 (int8) or 256 (KVarN) tokens. Now such a
 * session is refused at creation with KVARN_ERR_TOO_LARGE and nothing
 * allocated; a context at the limit is a valid plan whose byte counts are
 * the products formed here from the record sizes. */
static void test_context_limits(void **state)
{
    fixture *f = *state;
    static const char *formats[] = { "int8", "kvarn_k4v2_g128", "fp16" };
    kvarn_llama_session *s = (kvarn_llama_session *)f; /* sentinel */
    kvarn_llama_session_info info;
    for (int i = 0; i < 4; i++) {
        kvarn_llama_session_opts o = KVARN_LLAMA_SESSION_OPTS_DEFAULT;
        if (i < 3) o.format = fmt_of(formats[i]);
        else o.exact = 1;
        const int too_long[] = { INT32_MAX, KVARN_CACHE_MAX_SEQ_LEN + 1 };
        for (int j = 0; j < 2; j++) {
            o.max_tokens = too_long[j];
            s = NULL;
            assert_int_equal(kvarn_llama_session_create(f->m, &o, &s), KVARN_ERR_TOO_LARGE);
            assert_null(s);
            assert_int_equal(kvarn_llama_session_plan(f->m, &o, &info), KVARN_ERR_TOO_LARGE);
        }
    }

    /* The same through the model's own context length (max_tokens = 0). */
    wmeta meta = k_meta;
    meta.context_length = (uint32_t)INT32_MAX;
    buf b = write_gguf("llama", 0, &meta);
    kvarn_gguf *g = NULL;
    kvarn_llama *m = NULL;
    assert_int_equal(kvarn_gguf_open_memory(b.p, b.n, &g, NULL, 0), KVARN_OK);
    assert_int_equal(kvarn_llama_load_gguf(g, &m), KVARN_OK);
    assert_int_equal(kvarn_llama_get_hparams(m)->context_length, INT32_MAX);
    for (int i = 0; i < 3; i++) {
        kvarn_llama_session_opts o = KVARN_LLAMA_SESSION_OPTS_DEFAULT;
        o.format = fmt_of(formats[i]);
        s = NULL;
        assert_int_equal(kvarn_llama_session_create(m, &o, &s), KVARN_ERR_TOO_LARGE);
        assert_null(s);
        /* an explicit context below the model's is fine, and runs */
        o.max_tokens = 300;
        assert_int_equal(kvarn_llama_session_create(m, &o, &s), KVARN_OK);
        assert_int_equal(kvarn_llama_forward(s, f->ids, 300, KVARN_LLAMA_LOGITS_NONE, NULL, 0),
                         KVARN_OK);
        kvarn_llama_session_free(s);
    }
    kvarn_llama_free(m);
    kvarn_gguf_close(g);
    free(b.p);

    /* At the limit: a plan, not an allocation. Cache bytes from the record
     * sizes: int8 keeps whole 16-token blocks of NL * NKV token records;
     * KVarN keeps every tile but the sink as a record and holds
     * sink + ceil(max_chunk / G) + 2 fp16 pages of NL * NKV * 2 * G * HD
     * halves; the exact store 2 * NL * NKV * HD floats per token. */
    const uint64_t T = KVARN_CACHE_MAX_SEQ_LEN;
    kvarn_format fmt;
    kvarn_llama_session_opts o = KVARN_LLAMA_SESSION_OPTS_DEFAULT;
    o.max_tokens = (int)T;
    o.format = fmt_of("int8");
    assert_int_equal(kvarn_format_parse("int8", &fmt), KVARN_OK);
    assert_int_equal(kvarn_llama_session_plan(f->m, &o, &info), KVARN_OK);
    assert_int_equal(info.max_tokens, T);
    assert_int_equal(info.max_chunk, 512);
    assert_true(info.kv_bytes == T * NL * NKV * kvarn_record_bytes(&fmt, HD));
    assert_true(info.total_bytes == info.kv_bytes + info.other_bytes);
    /* other: at least the block table (12 bytes per 16-token tile) */
    assert_true(info.other_bytes >= T / 16 * 12);
    o.format = fmt_of("kvarn_k4v2_g128");
    assert_int_equal(kvarn_format_parse("kvarn_k4v2_g128", &fmt), KVARN_OK);
    assert_int_equal(kvarn_llama_session_plan(f->m, &o, &info), KVARN_OK);
    /* staged by default as int8 token records (2 HD + 8 bytes per
     * token-head, K and V), fp16 rows (4 HD) when asked */
    const uint64_t pages = 1 + 512 / 128 + 2;
    assert_true(info.kv_bytes == (T / 128 - 1) * NL * NKV * kvarn_record_bytes(&fmt, HD) +
                                    pages * NL * NKV * 128 * (2 * HD + 8));
    o.staging = KVARN_STAGING_FP16;
    assert_int_equal(kvarn_llama_session_plan(f->m, &o, &info), KVARN_OK);
    assert_true(info.kv_bytes == (T / 128 - 1) * NL * NKV * kvarn_record_bytes(&fmt, HD) +
                                    pages * NL * NKV * 2 * 128 * HD * 2);
    o.staging = -1;
    o.exact = 1;
    assert_int_equal(kvarn_llama_session_plan(f->m, &o, &info), KVARN_OK);
    assert_true(info.kv_bytes == 2 * T * NL * NKV * HD * sizeof(float));
    assert_int_equal(kvarn_llama_session_plan(NULL, &o, &info), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_llama_session_plan(f->m, &o, NULL), KVARN_ERR_INVALID_ARG);
}

/* The plan counts the thread pools a session makes (issue: the session
 * plan omitted the gguf GEMV's pool, src/model/llama_weights.c, and the
 * attention's, llama_kv_paged.c). A counting allocator sees every byte the
 * session takes through it. With the exact store the plan is every byte:
 * allocated == planned. A paged store's cache keeps a few objects the plan
 * does not count yet (the cache's own struct, sequence table and internal
 * scratch: the same for any thread count), so there allocated - planned
 * must not depend on attn_threads: a pool the plan missed adds its bytes to
 * that difference for every thread count but 1 (no pool at 1). Checked for
 * the fp32 model (attention pool only) and gguf weights (both pools). */
typedef struct counted {
    long long live;
} counted;

static void *counted_alloc(void *opaque, size_t bytes)
{
    size_t *h = malloc(bytes + 16); /* 16: keeps max_align_t alignment */
    if (!h) return NULL;
    h[0] = bytes;
    ((counted *)opaque)->live += (long long)bytes;
    return (char *)h + 16;
}

static void counted_free(void *opaque, void *p)
{
    size_t *h = (size_t *)(void *)((char *)p - 16);
    ((counted *)opaque)->live -= (long long)h[0];
    free(h);
}

static void test_plan_counts_thread_pools(void **state)
{
    fixture *f = *state;
    kvarn_llama *gm = load_with_weights(f, KVARN_LLAMA_WEIGHTS_GGUF);
    const kvarn_llama *models[2] = {f->m, gm};
    const char *formats[3] = {"int8", "kvarn_k4v2_g128", NULL /* exact */};
    for (int mi = 0; mi < 2; mi++)
        for (int fi = 0; fi < 3; fi++) {
            for (int t = 1; t <= 4; t++) {
                counted c = {0};
                kvarn_allocator a = {counted_alloc, counted_free, &c};
                kvarn_llama_session_opts o = KVARN_LLAMA_SESSION_OPTS_DEFAULT;
                o.max_tokens = NTOK;
                o.max_chunk = 64;
                o.attn_threads = t;
                o.allocator = &a;
                if (formats[fi]) o.format = fmt_of(formats[fi]);
                else o.exact = 1;
                kvarn_llama_session_info info;
                assert_int_equal(kvarn_llama_session_plan(models[mi], &o, &info), KVARN_OK);
                kvarn_llama_session *s = NULL;
                assert_int_equal(kvarn_llama_session_create(models[mi], &o, &s), KVARN_OK);
                long long gap = c.live - (long long)info.total_bytes;
                print_message("%s weights, %s, %d threads: allocated %lld, planned %llu\n",
                              mi ? "gguf" : "fp32", formats[fi] ? formats[fi] : "exact", t,
                              c.live, (unsigned long long)info.total_bytes);
                /* nothing left out, the paged stores' caches included */
                assert_true(gap == 0);
                kvarn_llama_session_free(s);
                assert_true(c.live == 0);
            }
        }
    kvarn_llama_free(gm);
}

/* kvarn_llama_weights_parse: the four KVARN_WEIGHTS names, nothing else
 * (case-sensitive, no AUTO name), *out untouched on refusal. */
static void test_weights_parse(void **state)
{
    (void)state;
    static const struct { const char *name; kvarn_llama_weights w; } ok[] = {
        {"fp32", KVARN_LLAMA_WEIGHTS_FP32}, {"bf16", KVARN_LLAMA_WEIGHTS_BF16},
        {"int8", KVARN_LLAMA_WEIGHTS_INT8}, {"gguf", KVARN_LLAMA_WEIGHTS_GGUF}};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        kvarn_llama_weights w = KVARN_LLAMA_WEIGHTS_AUTO;
        assert_int_equal(kvarn_llama_weights_parse(ok[i].name, &w), KVARN_OK);
        assert_int_equal(w, ok[i].w);
    }
    static const char *const bad[] = {"", "auto", "INT8", "fp16", "int8 ", "q4_1"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvarn_llama_weights w = KVARN_LLAMA_WEIGHTS_BF16;
        assert_int_equal(kvarn_llama_weights_parse(bad[i], &w), KVARN_ERR_INVALID_ARG);
        assert_int_equal(w, KVARN_LLAMA_WEIGHTS_BF16);
    }
    kvarn_llama_weights w;
    assert_int_equal(kvarn_llama_weights_parse(NULL, &w), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_llama_weights_parse("fp32", NULL), KVARN_ERR_INVALID_ARG);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hparams),
        cmocka_unit_test(test_exact_prefill_decode_chunked),
        cmocka_unit_test(test_fp16_prefill_decode_chunked),
        cmocka_unit_test_teardown(test_kernels_match_exact_chunk, levels_teardown),
        cmocka_unit_test(test_model_kernels_match_exact_chunk),
        cmocka_unit_test(test_all_formats_run),
        cmocka_unit_test(test_last_and_reset),
        cmocka_unit_test(test_read_kv),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_session_cache),
        cmocka_unit_test(test_shared_cache),
        cmocka_unit_test(test_weights_option),
        cmocka_unit_test_teardown(test_gguf_weights, levels_teardown),
        cmocka_unit_test(test_weights_parse),
        cmocka_unit_test(test_plan_counts_thread_pools),
        cmocka_unit_test(test_nonfinite_rolls_back),
        cmocka_unit_test(test_bad_files),
        cmocka_unit_test(test_context_limits),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
