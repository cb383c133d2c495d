/*
 * test_fault_injection.c -- out-of-memory faults injected through the
 * caller's allocator (include/kvarn/alloc.h), as SQLite's test suite does.
 *
 * A counting allocator refuses allocation number N (transient: only that
 * one; persistent: that one and every later one). Each creating operation
 * runs with N = 1, 2, ... until it gets through without a refusal; every
 * refused run must return KVARN_ERR_NOMEM, leave nothing allocated (the
 * allocator counts outstanding blocks; ASan/LSan checks the C library's),
 * and leave the objects it was given as they were (a cache's info, stats,
 * block tables and contents; a tokenizer's encodings). Every free must hand
 * back a pointer this allocator returned (a header magic says so).
 *
 * Operations: cache create (three formats) and sequence create/fork;
 * reserve/write/commit/read/truncate and the forward pass never allocate;
 * the thread pool; GGUF open (memory and file); model load (a tiny llama
 * GGUF with a tokenizer, written here, like test_llama.c's); tokenizer load
 * and encode; session create (paged formats, exact, threads, K/V copy) and
 * a session reset that must not need memory. The real SmolLM2 file, when
 * present, is opened and its tokenizer loaded under the same loop, and its
 * model load is failed at its first, middle and last allocation.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "common/gpt2_bytes.h"
#include "common/testutil.h"
#include "kvarn/alloc.h"
#include "kvarn/attn.h"
#include "kvarn/cache.h"
#include "kvarn/gguf.h"
#include "kvarn/model.h"
#include "kvarn/tokenizer.h"
#include "gguf/gguf_writer.h"

/* ------------------------------------------------------------------------ */
/* The fault-injecting allocator                                            */
/* ------------------------------------------------------------------------ */

#define FA_MAGIC 0x6b7661726e616c6cULL /* "kvarnall" */
#define FA_HEADER 16 /* keeps malloc's 16-byte alignment */

typedef struct fault_alloc {
    long calls;     /* alloc calls since the last fa_arm */
    long fail_at;   /* refuse call number fail_at (1-based); 0 = never */
    int persistent; /* also refuse every call after fail_at */
    long refused;   /* calls refused since the last fa_arm */
    long live;      /* blocks handed out and not yet freed */
    long bad_frees; /* frees of pointers this allocator did not return */
} fault_alloc;

static void *fa_alloc(void *opaque, size_t bytes)
{
    fault_alloc *fa = opaque;
    long n = ++fa->calls;
    if (bytes == 0) fa->bad_frees++; /* the contract: never 0 bytes */
    if (fa->fail_at > 0 && (n == fa->fail_at || (fa->persistent && n > fa->fail_at))) {
        fa->refused++;
        return NULL;
    }
    if (bytes > SIZE_MAX - FA_HEADER) return NULL;
    uint8_t *p = malloc(bytes + FA_HEADER);
    if (!p) return NULL;
    uint64_t magic = FA_MAGIC;
    memcpy(p, &magic, sizeof magic);
    fa->live++;
    return p + FA_HEADER;
}

static void fa_free(void *opaque, void *ptr)
{
    fault_alloc *fa = opaque;
    if (ptr == NULL) { /* the contract: never NULL */
        fa->bad_frees++;
        return;
    }
    uint8_t *p = (uint8_t *)ptr - FA_HEADER;
    uint64_t magic;
    memcpy(&magic, p, sizeof magic);
    if (magic != FA_MAGIC) {
        fa->bad_frees++;
        return;
    }
    memset(p, 0, sizeof magic);
    fa->live--;
    free(p);
}

/* Start counting calls afresh; refuse call fail_at (0 = none). */
static void fa_arm(fault_alloc *fa, long fail_at, int persistent)
{
    fa->calls = 0;
    fa->refused = 0;
    fa->fail_at = fail_at;
    fa->persistent = persistent;
}

static kvarn_allocator fa_allocator(fault_alloc *fa)
{
    kvarn_allocator a = { fa_alloc, fa_free, fa };
    return a;
}

/* One creating operation under test: run it with allocator a; on success it
 * keeps what it made in ctx and undo releases that. check (may be NULL) is
 * called after every refused run to compare the objects the operation was
 * given with their state before. */
typedef struct fault_op {
    const char *name;
    kvarn_status (*run)(void *ctx, const kvarn_allocator *a);
    void (*undo)(void *ctx);
    void (*check)(void *ctx);
    void *ctx;
    /* PCRE2 may swallow a refusal (a failed JIT compile falls back to the
     * interpreter): a run with a refusal may then succeed. */
    int may_absorb;
} fault_op;

/* The loop. Returns the allocations a clean run makes. */
static long fault_loop(const fault_op *op, fault_alloc *fa)
{
    kvarn_allocator a = fa_allocator(fa);
    long clean = -1;
    for (int persistent = 0; persistent <= 1; persistent++) {
        for (long n = 1;; n++) {
            const long live0 = fa->live;
            fa_arm(fa, n, persistent);
            kvarn_status st = op->run(op->ctx, &a);
            const long calls = fa->calls, refused = fa->refused;
            fa_arm(fa, 0, 0);
            if (refused == 0) {
                /* Call n was never reached: the operation is done. */
                if (st != KVARN_OK)
                    fail_msg("%s: status %d without a refused allocation", op->name, st);
                op->undo(op->ctx);
                assert_int_equal(fa->live, live0);
                if (clean < 0) clean = calls;
                assert_int_equal(calls, clean); /* deterministic */
                break;
            }
            if (st == KVARN_OK) {
                if (!op->may_absorb)
                    fail_msg("%s: allocation %ld refused (%s) but the call succeeded",
                             op->name, n, persistent ? "persistent" : "transient");
                op->undo(op->ctx);
                assert_int_equal(fa->live, live0);
                continue;
            }
            if (st != KVARN_ERR_NOMEM)
                fail_msg("%s: allocation %ld refused (%s): status %d (%s), not NOMEM",
                         op->name, n, persistent ? "persistent" : "transient", st,
                         kvarn_strerror(st));
            if (fa->live != live0)
                fail_msg("%s: allocation %ld refused (%s): %ld blocks leaked", op->name, n,
                         persistent ? "persistent" : "transient", fa->live - live0);
            if (op->check) op->check(op->ctx);
            assert_true(n < 100000);
        }
    }
    assert_int_equal(fa->bad_frees, 0);
    assert_true(clean >= 1); /* the operation allocates through the hook */
    return clean;
}

/* ------------------------------------------------------------------------ */
/* The cache                                                                */
/* ------------------------------------------------------------------------ */

enum { CL = 2, CHK = 2, CD = 64 }; /* cache layers, KV heads, head_dim */

static kvarn_cache_opts cache_opts(const char *format)
{
    kvarn_cache_opts o = kvarn_cache_default_opts();
    assert_int_equal(kvarn_format_parse(format, &o.format), KVARN_OK);
    o.n_layers = CL;
    o.n_kv_heads = CHK;
    o.head_dim = CD;
    o.max_seqs = 4;
    o.budget_bytes = 4u << 20;
    return o;
}

typedef struct cache_ctx {
    kvarn_cache_opts o;
    kvarn_cache *c;
} cache_ctx;

static kvarn_status cache_run(void *vctx, const kvarn_allocator *a)
{
    cache_ctx *x = vctx;
    kvarn_cache_opts o = x->o;
    o.allocator = a;
    return kvarn_cache_create(&o, &x->c);
}

static void cache_undo(void *vctx)
{
    cache_ctx *x = vctx;
    kvarn_cache_destroy(x->c);
    x->c = NULL;
}

static void test_cache_create(void **state)
{
    (void)state;
    static const char *formats[] = { "fp16", "int8", "kvarn_k4v2_g128" };
    for (size_t f = 0; f < sizeof formats / sizeof *formats; f++) {
        fault_alloc fa = { 0 };
        cache_ctx x = { cache_opts(formats[f]), NULL };
        fault_op op = { "kvarn_cache_create", cache_run, cache_undo, NULL, &x, 0 };
        long n = fault_loop(&op, &fa);
        /* The cache, two arenas (one for per-token formats), the sequence
         * slots, three scratch buffers, two id pools: at least 7. */
        assert_true(n >= 7);
        assert_int_equal(fa.live, 0);
    }
}

/* Everything a sequence operation could disturb. */
#define SNAP_MAX_SEQS 4
#define SNAP_TOKENS 300
typedef struct cache_snap {
    kvarn_cache_info info;
    kvarn_cache_stats stats;
    int live[SNAP_MAX_SEQS];
    kvarn_cache_seq_info seq[SNAP_MAX_SEQS];
    int32_t table[SNAP_MAX_SEQS][64];
    float k[SNAP_MAX_SEQS][CL][SNAP_TOKENS * CHK * CD];
} cache_snap;

static void snap_take(kvarn_cache *c, cache_snap *s)
{
    memset(s, 0, sizeof *s);
    assert_int_equal(kvarn_cache_get_info(c, &s->info), KVARN_OK);
    assert_int_equal(kvarn_cache_get_stats(c, &s->stats), KVARN_OK);
    assert_true(s->info.max_seqs <= SNAP_MAX_SEQS);
    for (int q = 0; q < s->info.max_seqs; q++) {
        if (kvarn_cache_seq_get_info(c, q, &s->seq[q]) != KVARN_OK) continue;
        s->live[q] = 1;
        const int32_t *t;
        int nt;
        assert_int_equal(kvarn_cache_block_table(c, q, &t, &nt), KVARN_OK);
        assert_true(nt <= 64);
        memcpy(s->table[q], t, sizeof(int32_t) * (size_t)nt);
        int len = s->seq[q].seq_len;
        assert_true(len <= SNAP_TOKENS);
        for (int l = 0; l < CL && len > 0; l++)
            assert_int_equal(kvarn_cache_read(c, q, l, 0, len, s->k[q][l], NULL, 0), KVARN_OK);
    }
}

/* Random K/V of n tokens, [n][CHK][CD]. */
static void fill_kv(test_rng *r, float *k, float *v, int n)
{
    for (int i = 0; i < n * CHK * CD; i++) {
        k[i] = (float)test_rng_normal(r);
        v[i] = (float)test_rng_normal(r);
    }
}

enum { PARENT_LEN = 300 };

/* A cache made through fa holding one sequence of 300 tokens (KVarN: the
 * sink, a quantized tile, a partial tail; 290 after a truncate), appended
 * while every allocation is refused: reserve, write, commit, truncate and
 * read never allocate. k, v: [PARENT_LEN][CHK][CD] scratch. */
static kvarn_cache *parent_cache(const char *format, fault_alloc *fa, kvarn_allocator *a,
                                 float *k, float *v, int *parent)
{
    kvarn_cache_opts o = cache_opts(format);
    if (strncmp(format, "kvarn", 5) == 0) o.n_pages = 16;
    o.allocator = a;
    kvarn_cache *c = NULL;
    assert_int_equal(kvarn_cache_create(&o, &c), KVARN_OK);
    assert_int_equal(kvarn_cache_seq_create(c, parent), KVARN_OK);
    const long live = fa->live;
    fa_arm(fa, 1, 1);
    test_rng r;
    test_rng_seed(&r, 7);
    fill_kv(&r, k, v, PARENT_LEN);
    const int s0 = *parent, N = PARENT_LEN;
    assert_int_equal(kvarn_cache_reserve(c, s0, N), KVARN_OK);
    for (int l = 0; l < CL; l++)
        assert_int_equal(kvarn_cache_write(c, s0, l, 0, N, k, v), KVARN_OK);
    assert_int_equal(kvarn_cache_commit(c, s0, N - 20), KVARN_OK);
    assert_int_equal(kvarn_cache_truncate(c, s0, N - 10), KVARN_OK);
    assert_int_equal(kvarn_cache_read(c, s0, 1, 0, N - 10, k, v, 0), KVARN_OK);
    assert_int_equal(fa->calls, 0);
    assert_int_equal(fa->live, live);
    fa_arm(fa, 0, 0);
    return c;
}

static void test_cache_sequences(void **state)
{
    (void)state;
    static const char *formats[] = { "int4", "kvarn_k4v2_g128" };
    float *k = malloc(sizeof(float) * PARENT_LEN * CHK * CD);
    float *v = malloc(sizeof(float) * PARENT_LEN * CHK * CD);
    cache_snap *before = malloc(sizeof *before), *after = malloc(sizeof *after);
    assert_non_null(k);
    assert_non_null(v);
    assert_non_null(before);
    assert_non_null(after);
    for (size_t f = 0; f < sizeof formats / sizeof *formats; f++) {
        fault_alloc fa = { 0 };
        kvarn_allocator a = fa_allocator(&fa);

        /* Create and fork with allocation n refused, each on a fresh cache
         * (a freed slot keeps its block table, so a second run on the same
         * cache would not allocate at all). */
        for (int fork = 0; fork <= 1; fork++) {
            for (int persistent = 0; persistent <= 1; persistent++) {
                for (long n = 1;; n++) {
                    int s0;
                    kvarn_cache *c = parent_cache(formats[f], &fa, &a, k, v, &s0);
                    const long live = fa.live;
                    snap_take(c, before);
                    int id = -7;
                    fa_arm(&fa, n, persistent);
                    kvarn_status st = fork ? kvarn_cache_seq_fork(c, s0, &id)
                                           : kvarn_cache_seq_create(c, &id);
                    const long refused = fa.refused, calls = fa.calls;
                    fa_arm(&fa, 0, 0);
                    if (refused == 0) {
                        assert_int_equal(st, KVARN_OK);
                        assert_int_equal(calls, 1); /* the block table */
                        assert_int_equal(fa.live, live + 1);
                        kvarn_cache_destroy(c);
                        assert_int_equal(fa.live, 0);
                        break;
                    }
                    assert_int_equal(st, KVARN_ERR_NOMEM);
                    assert_int_equal(id, -7);
                    assert_int_equal(fa.live, live);
                    snap_take(c, after);
                    assert_memory_equal(before, after, sizeof *before);
                    kvarn_cache_destroy(c);
                    assert_int_equal(fa.live, 0);
                }
            }
        }

        /* A child made, written into (copy-on-write of the shared tail)
         * and committed with every allocation refused after the fork. */
        int s0, s1, s2 = -1;
        kvarn_cache *c = parent_cache(formats[f], &fa, &a, k, v, &s0);
        assert_int_equal(kvarn_cache_seq_fork(c, s0, &s1), KVARN_OK);
        fa_arm(&fa, 1, 1);
        assert_int_equal(kvarn_cache_reserve(c, s1, 8), KVARN_OK);
        for (int l = 0; l < CL; l++)
            assert_int_equal(kvarn_cache_write(c, s1, l, PARENT_LEN - 10, 8, k, v), KVARN_OK);
        assert_int_equal(kvarn_cache_commit(c, s1, PARENT_LEN - 2), KVARN_OK);
        assert_int_equal(fa.calls, 0);

        /* A sequence made after a free needs no memory: a session reset
         * (free + create) cannot fail. */
        assert_int_equal(kvarn_cache_seq_free(c, s1), KVARN_OK);
        assert_int_equal(kvarn_cache_seq_create(c, &s2), KVARN_OK);
        assert_int_equal(s2, s1);
        assert_int_equal(fa.refused, 0);
        fa_arm(&fa, 0, 0);
        kvarn_cache_destroy(c);
        assert_int_equal(fa.live, 0);
        assert_int_equal(fa.bad_frees, 0);
    }
    free(before);
    free(after);
    free(k);
    free(v);
}

/* ------------------------------------------------------------------------ */
/* Thread pool                                                              */
/* ------------------------------------------------------------------------ */

typedef struct pool_ctx {
    kvarn_thread_pool *p;
} pool_ctx;

static kvarn_status pool_run(void *vctx, const kvarn_allocator *a)
{
    return kvarn_thread_pool_create_ex(4, a, &((pool_ctx *)vctx)->p);
}

static void pool_undo(void *vctx)
{
    pool_ctx *x = vctx;
    assert_int_equal(kvarn_thread_pool_size(x->p), 4);
    kvarn_thread_pool_destroy(x->p);
    x->p = NULL;
}

static void test_thread_pool(void **state)
{
    (void)state;
    fault_alloc fa = { 0 };
    pool_ctx x = { NULL };
    fault_op op = { "kvarn_thread_pool_create_ex", pool_run, pool_undo, NULL, &x, 0 };
    assert_int_equal(fault_loop(&op, &fa), 2); /* the pool, its thread table */
}

/* ------------------------------------------------------------------------ */
/* A tiny llama GGUF with a tokenizer                                       */
/* ------------------------------------------------------------------------ */

enum { NL = 2, E = 64, NH = 2, NKV = 1, HD = 64, FF = 96, CTX = 512 };
#define N_MERGES 3
static const char *const k_merges[N_MERGES] = { "h e", "l l", "he ll" };
static const char *const k_merged[N_MERGES] = { "he", "ll", "hell" };
#define VOCAB (3 + 256 + N_MERGES)

static void kv_u32(gw *w, const char *key, uint32_t v)
{
    gw_key(w, key, 4);
    gw_u32(w, v);
}

static void kv_f32(gw *w, const char *key, float v)
{
    gw_key(w, key, 6);
    gw_f32(w, v);
}

static void kv_str(gw *w, const char *key, const char *v)
{
    gw_key(w, key, 8);
    gw_str(w, v);
}

/* The vocabulary: 3 control tokens, the 256 byte characters, the merges. */
static void vocab_text(int32_t id, char out[32], int32_t *type)
{
    static const char *const ctl[3] = { "<|endoftext|>", "<|im_start|>", "<|im_end|>" };
    memset(out, 0, 32);
    *type = 1; /* NORMAL */
    if (id < 3) {
        snprintf(out, 32, "%s", ctl[id]);
        *type = 3; /* CONTROL */
    } else if (id < 3 + 256) {
        test_gpt2_byte_char(id - 3, out);
    } else {
        snprintf(out, 32, "%s", k_merged[id - 3 - 256]);
    }
}

static gw tiny_gguf(void)
{
    test_rng r;
    test_rng_seed(&r, 99);
    enum { NT = 3 + 9 * NL };
    gw_tensor t[NT];
    char names[NT][48];
    float *data[NT];
    int nt = 0;
#define TENSOR(nm, in, out)                                                        \
    do {                                                                           \
        snprintf(names[nt], sizeof names[nt], "%s", (nm));                         \
        size_t cnt = (size_t)(in) * (size_t)((out) ? (out) : 1);                   \
        data[nt] = malloc(sizeof(float) * cnt);                                    \
        assert_non_null(data[nt]);                                                 \
        for (size_t i = 0; i < cnt; i++)                                           \
            data[nt][i] = (out) ? 0.2f * (float)test_rng_normal(&r) : 1.0f;        \
        t[nt] = (gw_tensor){ names[nt], (out) ? 2u : 1u, { (uint64_t)(in),         \
                             (uint64_t)((out) ? (out) : 1), 1, 1 }, 0,             \
                             (const uint8_t *)data[nt], sizeof(float) * cnt };     \
        nt++;                                                                      \
    } while (0)
    TENSOR("token_embd.weight", E, VOCAB);
    TENSOR("output_norm.weight", E, 0);
    TENSOR("output.weight", E, VOCAB);
    for (int l = 0; l < NL; l++) {
        char nm[48];
#define LT(suffix, in, out)                                         \
        snprintf(nm, sizeof nm, "blk.%d." suffix ".weight", l);     \
        TENSOR(nm, in, out)
        LT("attn_norm", E, 0);
        LT("attn_q", E, NH * HD);
        LT("attn_k", E, NKV * HD);
        LT("attn_v", E, NKV * HD);
        LT("attn_output", NH * HD, E);
        LT("ffn_norm", E, 0);
        LT("ffn_gate", E, FF);
        LT("ffn_up", E, FF);
        LT("ffn_down", FF, E);
#undef LT
    }
#undef TENSOR
    assert_int_equal(nt, NT);

    gw w = { 0 };
    gw_header(&w, 3, NT, 17);
    kv_str(&w, "general.architecture", "llama");
    kv_u32(&w, "llama.block_count", NL);
    kv_u32(&w, "llama.embedding_length", E);
    kv_u32(&w, "llama.feed_forward_length", FF);
    kv_u32(&w, "llama.attention.head_count", NH);
    kv_u32(&w, "llama.attention.head_count_kv", NKV);
    kv_u32(&w, "llama.attention.key_length", HD);
    kv_u32(&w, "llama.context_length", CTX);
    kv_f32(&w, "llama.rope.freq_base", 10000.0f);
    kv_f32(&w, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    kv_str(&w, "tokenizer.ggml.model", "gpt2");
    kv_str(&w, "tokenizer.ggml.pre", "smollm");
    gw_key(&w, "tokenizer.ggml.tokens", 9);
    gw_u32(&w, 8);
    gw_u64(&w, VOCAB);
    for (int32_t i = 0; i < VOCAB; i++) {
        char s[32];
        int32_t ty;
        vocab_text(i, s, &ty);
        gw_str(&w, s);
    }
    gw_key(&w, "tokenizer.ggml.token_type", 9);
    gw_u32(&w, 5);
    gw_u64(&w, VOCAB);
    for (int32_t i = 0; i < VOCAB; i++) {
        char s[32];
        int32_t ty;
        vocab_text(i, s, &ty);
        gw_u32(&w, (uint32_t)ty);
    }
    gw_key(&w, "tokenizer.ggml.merges", 9);
    gw_u32(&w, 8);
    gw_u64(&w, N_MERGES);
    for (int i = 0; i < N_MERGES; i++) gw_str(&w, k_merges[i]);
    kv_u32(&w, "tokenizer.ggml.bos_token_id", 1);
    kv_u32(&w, "tokenizer.ggml.eos_token_id", 2);
    gw_tensors(&w, t, NT, 32);
    for (int i = 0; i < NT; i++) free(data[i]);
    return w;
}

/* ------------------------------------------------------------------------ */
/* GGUF open, model load, tokenizer                                         */
/* ------------------------------------------------------------------------ */

typedef struct file_ctx {
    gw file;
    const char *path;      /* the same bytes on disk, or NULL */
    const kvarn_gguf *g;   /* opened without an allocator */
    kvarn_gguf *og;        /* made by a run */
    kvarn_llama *m;
    kvarn_tokenizer *t;
} file_ctx;

static kvarn_status open_mem_run(void *vctx, const kvarn_allocator *a)
{
    file_ctx *x = vctx;
    char err[256];
    kvarn_status st = kvarn_gguf_open_memory_ex(x->file.buf, x->file.len, a, &x->og, err,
                                                sizeof err);
    /* A refusal is named in the message. */
    if (st == KVARN_ERR_NOMEM) assert_non_null(strstr(err, "out of memory"));
    if (st != KVARN_OK) assert_null(x->og);
    return st;
}

static kvarn_status open_file_run(void *vctx, const kvarn_allocator *a)
{
    file_ctx *x = vctx;
    kvarn_status st = kvarn_gguf_open_ex(x->path, a, &x->og, NULL, 0);
    if (st != KVARN_OK) assert_null(x->og);
    return st;
}

static void open_undo(void *vctx)
{
    file_ctx *x = vctx;
    assert_true(kvarn_gguf_tensor_count(x->og) > 0);
    kvarn_gguf_close(x->og);
    x->og = NULL;
}

static kvarn_status load_run(void *vctx, const kvarn_allocator *a)
{
    file_ctx *x = vctx;
    kvarn_status st = x->path ? kvarn_llama_load_ex(x->path, a, &x->m)
                              : kvarn_llama_load_gguf_ex(x->g, a, &x->m);
    if (st != KVARN_OK) assert_null(x->m);
    return st;
}

static void load_undo(void *vctx)
{
    file_ctx *x = vctx;
    assert_non_null(kvarn_llama_get_hparams(x->m));
    kvarn_llama_free(x->m);
    x->m = NULL;
}

static kvarn_status tok_gguf_run(void *vctx, const kvarn_allocator *a)
{
    file_ctx *x = vctx;
    kvarn_status st = kvarn_tokenizer_from_gguf_ex(x->g, a, &x->t);
    if (st != KVARN_OK) assert_null(x->t);
    return st;
}

static void tok_undo(void *vctx)
{
    file_ctx *x = vctx;
    assert_true(kvarn_tokenizer_n_vocab(x->t) > 0);
    kvarn_tokenizer_free(x->t);
    x->t = NULL;
}

/* A temporary file with the bytes of w; *path receives its name. */
static void write_temp(const gw *w, char *path, size_t cap)
{
    const char *dir = getenv("TMPDIR");
    snprintf(path, cap, "%s/kvarn_fault_XXXXXX", dir && dir[0] ? dir : "/tmp");
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(w->buf, 1, w->len, f), w->len);
    assert_int_equal(fclose(f), 0);
}

static void test_gguf_model_tokenizer_load(void **state)
{
    (void)state;
    fault_alloc fa = { 0 };
    file_ctx x = { tiny_gguf(), NULL, NULL, NULL, NULL, NULL };
    kvarn_gguf *g = NULL;
    assert_int_equal(kvarn_gguf_open_memory(x.file.buf, x.file.len, &g, NULL, 0), KVARN_OK);
    x.g = g;

    fault_op op = { "kvarn_gguf_open_memory_ex", open_mem_run, open_undo, NULL, &x, 0 };
    /* The handle, the key table and its sorted index, the tensor table and
     * its sorted index, and the two string arrays. */
    assert_int_equal(fault_loop(&op, &fa), 7);

    op = (fault_op){ "kvarn_llama_load_gguf_ex", load_run, load_undo, NULL, &x, 0 };
    /* The model, the row buffer, 3 whole-model tensors, the layer table, 6
     * per layer (fp32 weights: ctest sets KVARN_WEIGHTS=fp32). */
    assert_int_equal(fault_loop(&op, &fa), 1 + 1 + 3 + 1 + 6 * NL);
    /* bf16 and int8 weights: the same, plus the blocked copy of every
     * multiplied matrix (and int8's row scales); each refusal NOMEM, no
     * leak (skipped where the build has no oneDNN). gguf weights: one
     * allocation per matrix, blocks or fp32, as fp32's. */
    const char *wname[2] = { "bf16", "int8" }, *env = getenv("KVARN_WEIGHTS");
    char saved[16] = "";
    if (env) snprintf(saved, sizeof saved, "%s", env);
    assert_int_equal(setenv("KVARN_WEIGHTS", "gguf", 1), 0);
    op = (fault_op){ "kvarn_llama_load_gguf_ex (gguf)", load_run, load_undo, NULL, &x, 0 };
    assert_int_equal(fault_loop(&op, &fa), 1 + 1 + 3 + 1 + 6 * NL);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(setenv("KVARN_WEIGHTS", wname[i], 1), 0);
        kvarn_llama *probe = NULL;
        kvarn_status pst = kvarn_llama_load_gguf(g, &probe);
        kvarn_llama_free(probe);
        if (pst == KVARN_ERR_UNSUPPORTED) continue;
        assert_int_equal(pst, KVARN_OK);
        op = (fault_op){ "kvarn_llama_load_gguf_ex (bf16/int8)", load_run, load_undo, NULL, &x, 0 };
        assert_true(fault_loop(&op, &fa) > 1 + 1 + 3 + 1 + 6 * NL);
    }
    if (env) assert_int_equal(setenv("KVARN_WEIGHTS", saved, 1), 0);
    else assert_int_equal(unsetenv("KVARN_WEIGHTS"), 0);

    op = (fault_op){ "kvarn_tokenizer_from_gguf_ex", tok_gguf_run, tok_undo, NULL, &x, 1 };
    fault_loop(&op, &fa);

    char path[512];
    write_temp(&x.file, path, sizeof path);
    x.path = path;
    op = (fault_op){ "kvarn_gguf_open_ex", open_file_run, open_undo, NULL, &x, 0 };
    assert_int_equal(fault_loop(&op, &fa), 7);
    op = (fault_op){ "kvarn_llama_load_ex", load_run, load_undo, NULL, &x, 0 };
    /* The file's index (freed at the end of the load), then the model. */
    assert_int_equal(fault_loop(&op, &fa), 7 + 1 + 1 + 3 + 1 + 6 * NL);
    assert_int_equal(unlink(path), 0);

    kvarn_gguf_close(g);
    gw_free(&x.file);
    assert_int_equal(fa.live, 0);
}

/* Encoding: scratch and results come from the tokenizer's allocator. */
typedef struct enc_ctx {
    const kvarn_tokenizer *t;
    int mode;               /* 0: encode (fixed array), 1: encode_alloc, 2: chat */
    const char *text;
    int32_t want[256];
    size_t n_want;
    int32_t *ids;
    size_t n;
    fault_alloc *fa;
} enc_ctx;

static kvarn_status enc_run(void *vctx, const kvarn_allocator *a)
{
    (void)a;
    enc_ctx *x = vctx;
    kvarn_status st;
    x->ids = NULL;
    x->n = 0;
    if (x->mode == 0) {
        static int32_t out[256];
        st = kvarn_tokenizer_encode(x->t, x->text, strlen(x->text), KVARN_TOKENIZE_SPECIAL,
                                    out, 256, &x->n);
        if (st == KVARN_OK) {
            assert_int_equal(x->n, x->n_want);
            assert_memory_equal(out, x->want, sizeof(int32_t) * x->n);
        }
        return st;
    }
    if (x->mode == 1) {
        st = kvarn_tokenizer_encode_alloc(x->t, x->text, strlen(x->text),
                                          KVARN_TOKENIZE_SPECIAL, &x->ids, &x->n);
    } else {
        kvarn_chat_message msg = { "user", "hello hello, 1234567 <|im_end|> well" };
        st = kvarn_tokenizer_encode_chat(x->t, &msg, 1, "be brief", 1, &x->ids, &x->n);
    }
    if (st != KVARN_OK) {
        assert_null(x->ids);
        assert_int_equal(x->n, 0);
    }
    return st;
}

static void enc_undo(void *vctx)
{
    enc_ctx *x = vctx;
    if (x->mode == 1) {
        assert_int_equal(x->n, x->n_want);
        assert_memory_equal(x->ids, x->want, sizeof(int32_t) * x->n);
    }
    if (x->ids) {
        kvarn_allocator a = fa_allocator(x->fa);
        a.free(a.opaque, x->ids); /* the tokenizer's allocator made it */
    }
    x->ids = NULL;
}

/* The tokenizer is as it was: it still encodes the text the same. */
static void enc_check(void *vctx)
{
    enc_ctx *x = vctx;
    int32_t out[256];
    size_t n = 0;
    assert_int_equal(kvarn_tokenizer_encode(x->t, x->text, strlen(x->text),
                                            KVARN_TOKENIZE_SPECIAL, out, 256, &n), KVARN_OK);
    assert_int_equal(n, x->n_want);
    assert_memory_equal(out, x->want, sizeof(int32_t) * n);
}

static void test_tokenizer_create_encode(void **state)
{
    (void)state;
    fault_alloc fa = { 0 };
    kvarn_allocator a = fa_allocator(&fa);
    char texts[VOCAB][32];
    const char *ptrs[VOCAB];
    int32_t types[VOCAB];
    for (int32_t i = 0; i < VOCAB; i++) {
        vocab_text(i, texts[i], &types[i]);
        ptrs[i] = texts[i];
    }
    kvarn_tokenizer_desc d;
    memset(&d, 0, sizeof d);
    d.n_tokens = VOCAB;
    d.tokens = ptrs;
    d.token_types = types;
    d.n_merges = N_MERGES;
    d.merges = k_merges;
    d.pre = "smollm";
    d.bos_id = 1;
    d.eos_id = 2;
    d.pad_id = d.unk_id = -1;

    kvarn_tokenizer *t = NULL;
    assert_int_equal(kvarn_tokenizer_create_ex(&d, &a, &t), KVARN_OK);
    assert_int_equal(fa.bad_frees, 0);

    /* A text of many pieces, a long one (the BPE scratch grows past its
     * first 64 symbols), digits (smollm splits them) and a control token. */
    enc_ctx x = { t, 0, NULL, { 0 }, 0, NULL, 0, &fa };
    x.text = "hello hell<|im_end|>o 12345 well!! "
             "hellohellohellohellohellohellohellohellohellohellohellohellohellohello";
    /* The reference encoding, by a tokenizer without an allocator. */
    kvarn_tokenizer *ref = NULL;
    assert_int_equal(kvarn_tokenizer_create(&d, &ref), KVARN_OK);
    assert_int_equal(kvarn_tokenizer_encode(ref, x.text, strlen(x.text), KVARN_TOKENIZE_SPECIAL,
                                            x.want, 256, &x.n_want), KVARN_OK);
    assert_true(x.n_want > 10);
    kvarn_tokenizer_free(ref);

    for (int mode = 0; mode < 3; mode++) {
        x.mode = mode;
        fault_op op = { "kvarn_tokenizer_encode", enc_run, enc_undo, enc_check, &x, 1 };
        long n = fault_loop(&op, &fa);
        assert_true(n >= 1);   /* at least the match scratch */
    }
    kvarn_tokenizer_free(t);
    assert_int_equal(fa.live, 0);
    assert_int_equal(fa.bad_frees, 0);
}

/* ------------------------------------------------------------------------ */
/* Sessions                                                                 */
/* ------------------------------------------------------------------------ */

typedef struct sess_ctx {
    const kvarn_llama *m;
    kvarn_llama_session_opts o;
    kvarn_llama_session *s;
} sess_ctx;

static kvarn_status sess_run(void *vctx, const kvarn_allocator *a)
{
    sess_ctx *x = vctx;
    kvarn_llama_session_opts o = x->o;
    o.allocator = a;
    kvarn_status st = kvarn_llama_session_create(x->m, &o, &x->s);
    if (st != KVARN_OK) assert_null(x->s);
    return st;
}

static void sess_undo(void *vctx)
{
    sess_ctx *x = vctx;
    assert_int_equal(kvarn_llama_session_pos(x->s), 0);
    kvarn_llama_session_free(x->s);
    x->s = NULL;
}

/* Logits of the last token after feeding ids in chunks of 40. */
static void feed(kvarn_llama_session *s, const int32_t *ids, int n, float *logits)
{
    for (int p = 0; p < n; p += 40) {
        int c = n - p < 40 ? n - p : 40;
        assert_int_equal(kvarn_llama_forward(s, ids + p, c, KVARN_LLAMA_LOGITS_LAST, logits,
                                             VOCAB), KVARN_OK);
    }
}

/* Every case of test_session on model m: creation refused at each
 * allocation in turn, then forward calls and resets that allocate nothing. */
static void session_cases(const kvarn_llama *m, const int32_t *ids)
{
    /* shared: the sessions take sequences of one cache made here (without
     * the test allocator): a refused create leaves no sequence behind. */
    struct { const char *fmt; int exact, threads, keep, exact_chunk, shared; } cases[] = {
        { "fp16", 0, 1, 0, 0, 0 },
        { "kvarn_k4v2_g128", 0, 1, 1, 0, 0 },
        { "kvarn_k4v2_g128", 0, 2, 0, 1, 0 },
        { "int8", 0, 3, 0, 0, 0 },
        { NULL, 1, 1, 0, 0, 0 },
        { "kvarn_k4v2_g128", 0, 2, 0, 0, 1 },
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        fault_alloc fa = { 0 };
        kvarn_llama_session_opts o = KVARN_LLAMA_SESSION_OPTS_DEFAULT;
        kvarn_format fmt;
        if (cases[c].fmt) {
            assert_int_equal(kvarn_format_parse(cases[c].fmt, &fmt), KVARN_OK);
            o.format = &fmt;
        }
        kvarn_cache *shared = NULL;
        kvarn_cache_stats cs;
        if (cases[c].shared) {
            /* two sequences of 256 tokens: 2 blocks each, and the sink,
             * tail and one opening page each, in 64-token chunks */
            kvarn_cache_opts co = kvarn_cache_default_opts();
            co.format = fmt;
            co.n_layers = NL;
            co.n_kv_heads = NKV;
            co.head_dim = HD;
            co.max_seqs = 2;
            co.max_seq_len = 256;
            co.n_pages = 6;
            kvarn_cache_info geo;
            assert_int_equal(kvarn_cache_plan(&co, &geo), KVARN_OK);
            co.budget_bytes = 4 * (uint64_t)geo.block_bytes + 6 * (uint64_t)geo.page_bytes;
            assert_int_equal(kvarn_cache_create(&co, &shared), KVARN_OK);
            o.format = NULL;
            o.cache = shared;
        }
        o.exact = cases[c].exact;
        o.attn_threads = cases[c].threads;
        o.keep_kv_f32 = cases[c].keep;
        o.exact_chunk = cases[c].exact_chunk;
        o.max_tokens = 256;
        o.max_chunk = 64;
        sess_ctx x = { m, o, NULL };
        fault_op op = { "kvarn_llama_session_create", sess_run, sess_undo, NULL, &x, 0 };
        fault_loop(&op, &fa);
        if (shared) {
            assert_int_equal(kvarn_cache_get_stats(shared, &cs), KVARN_OK);
            assert_int_equal(cs.n_seqs, 0);
        }

        /* The same logits as a session without an allocator (the same
         * arithmetic in the same order: bit for bit), with every allocation
         * refused once the session exists: a forward pass and a reset never
         * allocate. */
        kvarn_llama_session *ref = NULL, *s = NULL;
        assert_int_equal(kvarn_llama_session_create(m, &o, &ref), KVARN_OK);
        kvarn_allocator a = fa_allocator(&fa);
        o.allocator = &a;
        assert_int_equal(kvarn_llama_session_create(m, &o, &s), KVARN_OK);
        static float want[VOCAB], got[VOCAB];
        feed(ref, ids, 200, want);
        fa_arm(&fa, 1, 1);
        feed(s, ids, 200, got);
        assert_memory_equal(want, got, sizeof want);
        kvarn_llama_session_reset(s);
        assert_int_equal(kvarn_llama_session_pos(s), 0);
        feed(s, ids, 200, got);
        assert_memory_equal(want, got, sizeof want);
        assert_int_equal(fa.calls - fa.refused, 0);
        assert_int_equal(fa.refused, 0);
        fa_arm(&fa, 0, 0);
        kvarn_llama_session_free(s);
        kvarn_llama_session_free(ref);
        assert_int_equal(fa.live, 0);
        assert_int_equal(fa.bad_frees, 0);
        if (shared) {
            assert_int_equal(kvarn_cache_get_stats(shared, &cs), KVARN_OK);
            assert_true(cs.n_seqs == 0 && cs.blocks_in_use == 0 && cs.pages_in_use == 0);
            kvarn_cache_destroy(shared);
        }
    }
}

static void test_session(void **state)
{
    (void)state;
    gw file = tiny_gguf();
    kvarn_gguf *g = NULL;
    kvarn_llama *m = NULL;
    assert_int_equal(kvarn_gguf_open_memory(file.buf, file.len, &g, NULL, 0), KVARN_OK);
    assert_int_equal(kvarn_llama_load_gguf(g, &m), KVARN_OK);
    /* and the same cases on gguf weights (their sessions add the GEMV's
     * slab and thread pool) */
    kvarn_llama *mg = NULL;
    kvarn_llama_load_opts lo = KVARN_LLAMA_LOAD_OPTS_DEFAULT;
    lo.weights = KVARN_LLAMA_WEIGHTS_GGUF;
    assert_int_equal(kvarn_llama_load_gguf_with(g, &lo, &mg), KVARN_OK);
    int32_t ids[200];
    test_rng r;
    test_rng_seed(&r, 5);
    for (int i = 0; i < 200; i++) ids[i] = (int32_t)test_rng_below(&r, VOCAB);
    session_cases(m, ids);
    session_cases(mg, ids);
    kvarn_llama_free(m);
    kvarn_llama_free(mg);
    kvarn_gguf_close(g);
    gw_free(&file);
}

/* ------------------------------------------------------------------------ */
/* The real model (skipped when models/ has not been fetched)               */
/* ------------------------------------------------------------------------ */

static void test_real_model(void **state)
{
    (void)state;
    const char *src = getenv("KVARN_SOURCE_DIR");
    char path[1024];
    snprintf(path, sizeof path, "%s/models/SmolLM2-135M-Instruct.Q4_1.gguf",
             src ? src : ".");
    if (access(path, R_OK) != 0) {
        print_message("skipped: %s not found (scripts/setup.sh --model)\n", path);
        skip();
    }
    fault_alloc fa = { 0 };
    file_ctx x = { { 0 }, path, NULL, NULL, NULL, NULL };
    fault_op op = { "kvarn_gguf_open_ex (SmolLM2)", open_file_run, open_undo, NULL, &x, 0 };
    /* The handle, two tables, two sorted indexes, one per string array. */
    assert_true(fault_loop(&op, &fa) >= 7);

    kvarn_gguf *g = NULL;
    assert_int_equal(kvarn_gguf_open(path, &g, NULL, 0), KVARN_OK);
    x.g = g;
    op = (fault_op){ "kvarn_tokenizer_from_gguf_ex (SmolLM2)", tok_gguf_run, tok_undo, NULL,
                     &x, 1 };
    fault_loop(&op, &fa);

    /* A whole loop would dequantize the weights ~200 times; refuse the
     * first, a middle and the last allocation of the load instead. */
    kvarn_allocator a = fa_allocator(&fa);
    fa_arm(&fa, 0, 0);
    kvarn_llama *m = NULL;
    assert_int_equal(kvarn_llama_load_gguf_ex(g, &a, &m), KVARN_OK);
    const long total = fa.calls;
    /* The model, the row buffer, output_norm, tok_embd, output unless tied
     * to tok_embd, the layer table, 6 per layer (fp32 weights: ctest sets
     * KVARN_WEIGHTS=fp32). */
    const kvarn_llama_hparams *hp = kvarn_llama_get_hparams(m);
    assert_int_equal(total, 1 + 3 + (hp->tied_output ? 0 : 1) + 1 + 6 * hp->n_layers);
    kvarn_llama_free(m);
    assert_int_equal(fa.live, 0);
    const long at[3] = { 1, total / 2, total };
    for (int i = 0; i < 3; i++) {
        fa_arm(&fa, at[i], 0);
        m = NULL;
        assert_int_equal(kvarn_llama_load_gguf_ex(g, &a, &m), KVARN_ERR_NOMEM);
        assert_null(m);
        assert_int_equal(fa.live, 0);
    }
    fa_arm(&fa, 0, 0);
    kvarn_gguf_close(g);
    assert_int_equal(fa.bad_frees, 0);
}

/* ------------------------------------------------------------------------ */
/* The allocator argument itself                                            */
/* ------------------------------------------------------------------------ */

static void test_half_allocator_refused(void **state)
{
    (void)state;
    fault_alloc fa = { 0 };
    kvarn_allocator half = { fa_alloc, NULL, &fa };
    kvarn_cache_opts o = cache_opts("int8");
    o.allocator = &half;
    kvarn_cache *c = (kvarn_cache *)&fa;
    assert_int_equal(kvarn_cache_create(&o, &c), KVARN_ERR_INVALID_ARG);
    kvarn_thread_pool *p = NULL;
    assert_int_equal(kvarn_thread_pool_create_ex(2, &half, &p), KVARN_ERR_INVALID_ARG);
    assert_null(p);
    kvarn_gguf *g = NULL;
    static const uint8_t junk[4] = { 'G', 'G', 'U', 'F' };
    assert_int_equal(kvarn_gguf_open_memory_ex(junk, 4, &half, &g, NULL, 0),
                     KVARN_ERR_INVALID_ARG);
    assert_int_equal(fa.calls, 0);
    /* Both NULL is the C library's: works. */
    kvarn_allocator none = { NULL, NULL, NULL };
    o.allocator = &none;
    c = NULL;
    assert_int_equal(kvarn_cache_create(&o, &c), KVARN_OK);
    kvarn_cache_destroy(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_half_allocator_refused),
        cmocka_unit_test(test_cache_create),
        cmocka_unit_test(test_cache_sequences),
        cmocka_unit_test(test_thread_pool),
        cmocka_unit_test(test_gguf_model_tokenizer_load),
        cmocka_unit_test(test_tokenizer_create_encode),
        cmocka_unit_test(test_session),
        cmocka_unit_test(test_real_model),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
