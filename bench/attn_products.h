/* attn_products.h -- the two products of a prefill or verification
 * attention call through a well-kept matrix library, for bench_attn
 * --products (header only: every bench .c file is a program).
 *
 * Issue 44 asks whether oneDNN (Debian's libdnnl-dev 2.6) or libxsmm
 * (libxsmm-dev 1.17) should do the products of kvarn's many-row attention
 * instead of its own kernels, measured "at these sizes": for each sequence,
 * KV head and G-token tile, with R = queries x (Hq / Hk) rows (the GQA
 * group's rows share the tile),
 *
 *     S[R][G]  = Q[R][D] . K^T        (scores)
 *     O[R][D] += P[R][G] . V[G][D]    (values)
 *
 * This times those products alone: no dequantization, no softmax, no
 * scaling, every row over every tile (a causal call skips the masked part
 * of its last tiles: a chunk of 512 rows at 4,096 tokens does ~6% fewer
 * products). So a library's time here is a lower bound of an attention
 * built on it; kvarn's row in the same run is its whole fused call.
 *
 * The operands are as a cache could hold them for that library, one
 * primitive or kernel made once a shape, then called per tile:
 *   onednn-bf16  Q, P bf16 row-major; K, V bf16 row-major ([G][D]);
 *                fp32 S and O (O accumulated by a sum post-op)
 *   onednn-int8  Q, P u8; K, V s8; int32 S and O
 *   libxsmm-bf16 K as channel pairs, V as token pairs (its VNNI layout
 *                for the left operand); fp32 S and O (beta 1 for O)
 *   libxsmm-int8 K, V s8 in its VNNI layout (quads along the inner
 *                dimension), Q, P u8; int32 S and O
 * The K/V working set is cycled like bench_attn's layers (--working-set).
 * Values are random; the times do not depend on them.
 *
 * Threads: one. bench_attn --products sets OMP_NUM_THREADS=1 (oneDNN's
 * OpenMP), so both libraries run on the calling thread, timed by its CPU
 * clock as bench_attn's one-thread rows are.
 */
#ifndef KVARN_BENCH_ATTN_PRODUCTS_H
#define KVARN_BENCH_ATTN_PRODUCTS_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef KVARN_BENCH_DNNL
#include <oneapi/dnnl/dnnl.h>
#endif
#ifdef KVARN_BENCH_LIBXSMM
#include <libxsmm.h>
#endif

enum { PROD_ONEDNN_BF16, PROD_ONEDNN_INT8, PROD_LIBXSMM_BF16, PROD_LIBXSMM_INT8, PROD_COUNT };

/* Whether library kind k multiplies int8 operands (else bf16). */
static inline int prod_is_int8(int k)
{
    return k == PROD_ONEDNN_INT8 || k == PROD_LIBXSMM_INT8;
}

static const char *const prod_names[PROD_COUNT] = {"onednn-bf16", "onednn-int8", "libxsmm-bf16",
                                                   "libxsmm-int8"};

typedef struct prod_shape {
    int batch, Hk, D, G;
    int R;          /* rows per (sequence, KV head): queries x Hq / Hk */
    int n_tiles;    /* tiles per sequence: ceil(ctx / G) */
    int n_copies;   /* copies of the K/V, cycled call by call */
} prod_shape;

static double prod_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The calling thread's CPU time, as bench_attn's one-thread rows: both
 * libraries run on the calling thread here (OMP_NUM_THREADS=1). */
static double prod_cpu(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Bytes of K and V one call reads (elem bytes each). */
static double prod_kv_bytes(const prod_shape *s, int elem)
{
    return 2.0 * s->batch * s->Hk * (double)s->n_tiles * s->G * s->D * elem;
}

typedef struct prod_bufs {
    uint8_t *kv;            /* [copies][batch][Hk][tiles] x (K tile, V tile) */
    size_t tile_bytes;      /* one K (or V) tile */
    uint8_t *q, *p;         /* [R][D], [R][G] */
    uint8_t *s, *o;         /* [R][G], [R][D], 4-byte elements */
} prod_bufs;

static int prod_alloc(prod_bufs *b, const prod_shape *s, int elem)
{
    memset(b, 0, sizeof *b);
    b->tile_bytes = (size_t)s->G * s->D * elem;
    const size_t n_tiles = (size_t)s->n_copies * s->batch * s->Hk * s->n_tiles;
    b->kv = malloc(2 * n_tiles * b->tile_bytes);
    b->q = malloc((size_t)s->R * s->D * elem);
    b->p = malloc((size_t)s->R * s->G * elem);
    b->s = malloc((size_t)s->R * s->G * 4);
    b->o = malloc((size_t)s->R * s->D * 4);
    if (!b->kv || !b->q || !b->p || !b->s || !b->o) return -1;
    /* small values of either type: bf16 0.5..0.996 (0x3f00..0x3f7f, little
     * endian), s8/u8 0..63 */
    uint64_t x = 0x2545f4914f6cdd1dull;
    const size_t nkv = 2 * n_tiles * b->tile_bytes;
    for (size_t i = 0; i < nkv; i++) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        b->kv[i] = elem == 2 ? (uint8_t)((i & 1) ? 0x3f : (x & 0x7f)) : (uint8_t)(x & 0x3f);
    }
    for (size_t i = 0; i < (size_t)s->R * s->D * elem; i++)
        b->q[i] = elem == 2 ? (uint8_t)((i & 1) ? 0x3f : 0x90) : (uint8_t)(i % 61);
    for (size_t i = 0; i < (size_t)s->R * s->G * elem; i++)
        b->p[i] = elem == 2 ? (uint8_t)((i & 1) ? 0x3f : 0x10) : (uint8_t)(i % 53);
    memset(b->o, 0, (size_t)s->R * s->D * 4);
    return 0;
}

static void prod_free(prod_bufs *b)
{
    free(b->kv); free(b->q); free(b->p); free(b->s); free(b->o);
    memset(b, 0, sizeof *b);
}

static uint8_t *prod_tile(const prod_bufs *b, const prod_shape *s, int copy, int seq, int h, int t,
                          int v)
{
    size_t i = (((size_t)copy * s->batch + seq) * s->Hk + h) * s->n_tiles + t;
    return b->kv + (2 * i + (size_t)v) * b->tile_bytes;
}

/* Calls tile(ctx, K tile, V tile) for every sequence, KV head and tile of
 * one call, the K/V copy changing call by call, until min_time has passed
 * (4 calls and every copy at least); returns the fastest call after the
 * first (warm-up), in thread CPU seconds, or -1 when tile fails. */
static double prod_loop(const prod_shape *s, const prod_bufs *b, double min_time,
                        int (*tile)(void *ctx, const uint8_t *k, const uint8_t *v), void *ctx)
{
    double best = 1e30, t0 = prod_now();
    int calls = 0;
    while (calls < 4 || prod_now() - t0 < min_time || calls <= s->n_copies) {
        const int copy = calls % s->n_copies;
        double t1 = prod_cpu();
        for (int seq = 0; seq < s->batch; seq++)
            for (int h = 0; h < s->Hk; h++)
                for (int t = 0; t < s->n_tiles; t++)
                    if (tile(ctx, prod_tile(b, s, copy, seq, h, t, 0), prod_tile(b, s, copy, seq, h, t, 1)))
                        return -1.0;
        t1 = prod_cpu() - t1;
        if (calls > 0 && t1 < best) best = t1;
        calls++;
    }
    return best;
}

#ifdef KVARN_BENCH_DNNL
typedef struct dn_ctx {
    dnnl_memory_t mk, mv;
    dnnl_primitive_t mm1, mm2;
    dnnl_stream_t strm;
    dnnl_exec_arg_t a1x[3], a2x[3];
} dn_ctx;

static int dn_tile(void *p, const uint8_t *k, const uint8_t *v)
{
    dn_ctx *c = p;
    return dnnl_memory_set_data_handle(c->mk, (void *)k) != dnnl_success ||
           dnnl_memory_set_data_handle(c->mv, (void *)v) != dnnl_success ||
           dnnl_primitive_execute(c->mm1, c->strm, 3, c->a1x) != dnnl_success ||
           dnnl_primitive_execute(c->mm2, c->strm, 3, c->a2x) != dnnl_success ||
           dnnl_stream_wait(c->strm) != dnnl_success;
}

#define PROD_DN(call) do { if ((call) != dnnl_success) return -1.0; } while (0)

/* One call's products through oneDNN matmul primitives; returns the best
 * wall time of the timed calls (s), or -1 where oneDNN refuses. */
static double prod_onednn(const prod_shape *s, int int8, double min_time)
{
    const int elem = int8 ? 1 : 2;
    const dnnl_data_type_t at = int8 ? dnnl_u8 : dnnl_bf16, wt = int8 ? dnnl_s8 : dnnl_bf16,
                           dt = int8 ? dnnl_s32 : dnnl_f32;
    prod_bufs b;
    if (prod_alloc(&b, s, elem) != 0) { prod_free(&b); return -1.0; }
    dnnl_engine_t eng;
    dnnl_stream_t strm;
    PROD_DN(dnnl_engine_create(&eng, dnnl_cpu, 0));
    PROD_DN(dnnl_stream_create(&strm, eng, dnnl_stream_default_flags));
    /* scores: [R][D] x [D][G] (K row-major [G][D] is the "ba" layout of
     * [D][G]); values: [R][G] x [G][D], summed into O */
    dnnl_memory_desc_t qd, kd, sd, pd_, vd, od;
    dnnl_dims_t dq = {s->R, s->D}, dk = {s->D, s->G}, ds = {s->R, s->G}, dv = {s->G, s->D},
                dout = {s->R, s->D};
    PROD_DN(dnnl_memory_desc_init_by_tag(&qd, 2, dq, at, dnnl_ab));
    PROD_DN(dnnl_memory_desc_init_by_tag(&kd, 2, dk, wt, dnnl_ba));
    PROD_DN(dnnl_memory_desc_init_by_tag(&sd, 2, ds, dt, dnnl_ab));
    PROD_DN(dnnl_memory_desc_init_by_tag(&pd_, 2, ds, at, dnnl_ab));
    PROD_DN(dnnl_memory_desc_init_by_tag(&vd, 2, dv, wt, dnnl_ab));
    PROD_DN(dnnl_memory_desc_init_by_tag(&od, 2, dout, dt, dnnl_ab));
    dnnl_matmul_desc_t m1, m2;
    PROD_DN(dnnl_matmul_desc_init(&m1, &qd, &kd, NULL, &sd));
    PROD_DN(dnnl_matmul_desc_init(&m2, &pd_, &vd, NULL, &od));
    dnnl_primitive_attr_t a2;
    dnnl_post_ops_t po;
    PROD_DN(dnnl_primitive_attr_create(&a2));
    PROD_DN(dnnl_post_ops_create(&po));
    PROD_DN(dnnl_post_ops_append_sum(po, 1.0f));
    PROD_DN(dnnl_primitive_attr_set_post_ops(a2, po));
    dnnl_primitive_desc_t p1, p2;
    PROD_DN(dnnl_primitive_desc_create(&p1, &m1, NULL, eng, NULL));
    PROD_DN(dnnl_primitive_desc_create(&p2, &m2, a2, eng, NULL));
    dnnl_primitive_t mm1, mm2;
    PROD_DN(dnnl_primitive_create(&mm1, p1));
    PROD_DN(dnnl_primitive_create(&mm2, p2));
    dnnl_memory_t mq, mk, ms, mp, mv, mo;
    PROD_DN(dnnl_memory_create(&mq, &qd, eng, b.q));
    PROD_DN(dnnl_memory_create(&mk, &kd, eng, b.kv));
    PROD_DN(dnnl_memory_create(&ms, &sd, eng, b.s));
    PROD_DN(dnnl_memory_create(&mp, &pd_, eng, b.p));
    PROD_DN(dnnl_memory_create(&mv, &vd, eng, b.kv));
    PROD_DN(dnnl_memory_create(&mo, &od, eng, b.o));
    dn_ctx c = {mk, mv, mm1, mm2, strm,
                {{DNNL_ARG_SRC, mq}, {DNNL_ARG_WEIGHTS, mk}, {DNNL_ARG_DST, ms}},
                {{DNNL_ARG_SRC, mp}, {DNNL_ARG_WEIGHTS, mv}, {DNNL_ARG_DST, mo}}};
    const double best = prod_loop(s, &b, min_time, dn_tile, &c);
    dnnl_memory_destroy(mq); dnnl_memory_destroy(mk); dnnl_memory_destroy(ms);
    dnnl_memory_destroy(mp); dnnl_memory_destroy(mv); dnnl_memory_destroy(mo);
    dnnl_primitive_destroy(mm1); dnnl_primitive_destroy(mm2);
    dnnl_primitive_desc_destroy(p1); dnnl_primitive_desc_destroy(p2);
    dnnl_post_ops_destroy(po); dnnl_primitive_attr_destroy(a2);
    dnnl_stream_destroy(strm); dnnl_engine_destroy(eng);
    prod_free(&b);
    return best;
}
#endif

#ifdef KVARN_BENCH_LIBXSMM
typedef struct xs_ctx {
    int int8;
    libxsmm_subimmfunction is, io;
    libxsmm_bsmmfunction bs, bo;
    const prod_bufs *b;
} xs_ctx;

static int xs_tile(void *p, const uint8_t *k, const uint8_t *v)
{
    const xs_ctx *c = p;
    if (c->int8) {
        c->is((const char *)k, c->b->q, (int *)c->b->s);
        c->io((const char *)v, c->b->p, (int *)c->b->o);
    } else {
        c->bs((const libxsmm_bfloat16 *)k, (const libxsmm_bfloat16 *)c->b->q, (float *)c->b->s);
        c->bo((const libxsmm_bfloat16 *)v, (const libxsmm_bfloat16 *)c->b->p, (float *)c->b->o);
    }
    return 0;
}

/* One call's products through libxsmm's JIT kernels (column-major: the
 * scores as S^T[G][R] = K[G][D] . Q^T[D][R], the values as O^T[D][R] +=
 * V^T[D][G] . P^T[G][R]); -1 where it generates no kernel for the shape. */
static double prod_libxsmm(const prod_shape *s, int int8, double min_time)
{
    const int elem = int8 ? 1 : 2;
    const libxsmm_blasint G = s->G, D = s->D, R = s->R;
    /* the left operand in VNNI layout (pairs of bf16 / quads of int8 along
     * k): libxsmm 1.17 makes no int8 kernel without it */
    const int f_s = LIBXSMM_GEMM_FLAG_VNNI_A | (int8 ? LIBXSMM_GEMM_FLAG_B_UNSIGNED : 0);
    const int f_o = f_s;
    prod_bufs b;
    if (prod_alloc(&b, s, elem) != 0) { prod_free(&b); return -1.0; }
    const int ia = 1, i0 = 0, i1 = 1;
    const float fa = 1.0f, f0 = 0.0f, f1 = 1.0f;
    libxsmm_subimmfunction is = NULL, io = NULL;
    libxsmm_bsmmfunction bs = NULL, bo = NULL;
    if (int8) {
        is = libxsmm_subimmdispatch(G, R, D, &G, &D, &G, &ia, &i0, &f_s, NULL);
        io = libxsmm_subimmdispatch(D, R, G, &D, &G, &D, &ia, &i1, &f_o, NULL);
    } else {
        bs = libxsmm_bsmmdispatch(G, R, D, &G, &D, &G, &fa, &f0, &f_s, NULL);
        bo = libxsmm_bsmmdispatch(D, R, G, &D, &G, &D, &fa, &f1, &f_o, NULL);
    }
    if (int8 ? (is == NULL || io == NULL) : (bs == NULL || bo == NULL)) {
        prod_free(&b);
        return -1.0;
    }
    xs_ctx c = {int8, is, io, bs, bo, &b};
    const double best = prod_loop(s, &b, min_time, xs_tile, &c);
    prod_free(&b);
    return best;
}
#endif

/* Best time (s) of one call's products by library kind k; -1 where that
 * library is not built in (CMakeLists.txt finds libdnnl-dev and
 * libxsmm-dev) or makes no kernel for the shape. */
static double prod_time(int k, const prod_shape *s, double min_time)
{
    (void)s; (void)min_time;
#ifdef KVARN_BENCH_DNNL
    if (k == PROD_ONEDNN_BF16 || k == PROD_ONEDNN_INT8) return prod_onednn(s, prod_is_int8(k), min_time);
#endif
#ifdef KVARN_BENCH_LIBXSMM
    if (k == PROD_LIBXSMM_BF16 || k == PROD_LIBXSMM_INT8)
        return prod_libxsmm(s, prod_is_int8(k), min_time);
#endif
    return -1.0;
}

#endif
