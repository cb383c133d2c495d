/* test_cuda.c -- the CUDA backend (include/kvarn/cuda.h).
 *
 * Host side, run everywhere the backend is built: the served-format table,
 * the paged-cache checks, split-K plans and workspace sizes, and argument
 * validation (nothing is enqueued on bad input; valid calls without a GPU
 * return KVARN_ERR_NO_DEVICE).
 * Device side, run only where the runtime sees a GPU (skipped otherwise,
 * with a message):
 *   - store of per-token formats: records byte-identical to kvarn_encode;
 *   - KVarN store: fp16 pages bit-identical to the CPU Hadamard rotation;
 *     commit: records against kvarn_encode (prerotated) on the same pages,
 *     at most 16 differing codes per 2M codes, scales within rtol 0.02 /
 *     atol 0.1, padding zeroed, two runs bit-identical, untouched blocks;
 *   - attention (decode, split-K, multi-query, sliding window, learned
 *     sinks) against a
 *     double-precision reference over the same records and pages: cosine
 *     >= 0.9999 and relative error < 1e-3 on every query row, outputs
 *     poisoned with NaN before each call;
 *   - CUDA graph capture: store + commit and a split-K attention call,
 *     captured on a stream and replayed, give bit-identical results.
 * Built without the backend (KVARN_CUDA=OFF or no nvcc), the program only
 * reports that it skipped. Without a GPU (or without the backend) it exits
 * with TEST_SKIPPED (77), which ctest reports as skipped. tests/cuda/emu/run.sh runs the device checks
 * against the kernels executed on the CPU (KVARN_CUDA_EMULATED: smaller). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "common/testutil.h"

#ifdef KVARN_HAVE_CUDA

#include <cuda_runtime_api.h>

#include "codec/hadamard.h"
#include "codec/pack.h"
#include "kvarn/cuda.h"
#include "kvarn/kvarn.h"
#include "kvarn/record.h"

/* ------------------------------------------------------------ helpers */

/* tests/cuda/emu runs the kernels on the CPU, one OS thread per GPU thread:
 * smaller problems there. */
#ifdef KVARN_CUDA_EMULATED
#define EMU_SMALL 1
#else
#define EMU_SMALL 0
#endif

static kvarn_format fmt_of(const char *name)
{
    kvarn_format f;
    assert_int_equal(kvarn_format_parse(name, &f), KVARN_OK);
    return f;
}

/* A paged-cache description for format `name`; arenas at blocks/pages. */
static kvarn_paged_kv make_kv(const char *name, int D, int Hk, int G, void *blocks,
                                   int n_blocks, void *pages, int n_pages)
{
    kvarn_paged_kv kv;
    memset(&kv, 0, sizeof kv);
    kv.fmt = fmt_of(name);
    kv.head_dim = D;
    kv.n_kv_heads = Hk;
    kv.block_size = kv.fmt.kind == KVARN_KIND_KVARN ? kv.fmt.tile_tokens : G;
    kv.sink_tiles = kv.fmt.kind == KVARN_KIND_KVARN ? 1 : 0;
    size_t rec = kvarn_record_bytes(&kv.fmt, D);
    if (kv.fmt.kind == KVARN_KIND_KVARN) {
        kv.record_stride = rec;
    } else {
        kv.token_record_bytes = rec;
        kv.record_stride = rec * (size_t)kv.block_size;
    }
    kv.block_stride = kv.record_stride * (size_t)Hk;
    kv.blocks = blocks;
    kv.n_blocks = n_blocks;
    kv.fp16_pages = kv.fmt.kind == KVARN_KIND_KVARN ? pages : NULL;
    kv.n_fp16_pages = kv.fmt.kind == KVARN_KIND_KVARN ? n_pages : 0;
    kvarn_paged_pack_pages(&kv);
    return kv;
}

/* Host addresses standing in for device arenas in the host-only tests
 * (never dereferenced). */
static _Alignas(64) uint8_t fake_arena[64];

static int have_gpu(void)
{
    int n = 0;
    return kvarn_cuda_device_count(&n) == KVARN_OK && n > 0;
}

#define SKIP_WITHOUT_GPU()                                                              \
    do {                                                                                \
        if (!have_gpu()) {                                                              \
            print_message("no CUDA device visible to the runtime: GPU check skipped\n"); \
            skip();                                                                     \
        }                                                                               \
    } while (0)

#define CK(call) assert_int_equal((int)(call), (int)cudaSuccess)

/* The current device's compute capability (major); 0 if it cannot be read. */
static int device_major(void)
{
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
        return 0;
    return major;
}

static void *dev_alloc(size_t n)
{
    void *p = NULL;
    CK(cudaMalloc(&p, n ? n : 16));
    return p;
}

static void *host_alloc(size_t n)
{
    void *p = malloc(n ? n : 16);
    assert_non_null(p);
    return p;
}

static void shuffle(test_rng *rng, int32_t *ids, int n)
{
    for (int i = n - 1; i > 0; i--) {
        int j = (int)test_rng_below(rng, (uint32_t)(i + 1));
        int32_t t = ids[i];
        ids[i] = ids[j];
        ids[j] = t;
    }
}

/* Random activations with per-channel spread and a few outlier channels,
 * like real keys; stored as fp16 [n][Hk][D]. */
static void random_kv(test_rng *rng, uint16_t *out, int n, int Hk, int D, double spread)
{
    double *chan = host_alloc(sizeof(double) * (size_t)Hk * D);
    for (int c = 0; c < Hk * D; c++) {
        chan[c] = exp(spread * test_rng_normal(rng));
        if (test_rng_below(rng, 32) == 0) chan[c] *= 8.0;
    }
    for (int t = 0; t < n; t++)
        for (int c = 0; c < Hk * D; c++)
            out[(size_t)t * Hk * D + c] = kvarn_fp32_to_fp16((float)(chan[c] * test_rng_normal(rng)));
    free(chan);
}

/* --------------------------------------------------------- host side */

static void test_supports(void **state)
{
    (void)state;
    const char *served[] = {"kvarn_k4v2_g128", "kvarn_k4v2_g64", "kvarn_k4v4_g128",
                            "kvarn_k4v4_g64", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2",
                            "int8", "int4"};
    for (size_t i = 0; i < sizeof served / sizeof served[0]; i++)
        for (int D = 64; D <= 512; D *= 2) {
            kvarn_format f = fmt_of(served[i]);
            assert_int_equal(kvarn_cuda_supports(&f, D), KVARN_OK);
        }
    kvarn_format f = fmt_of("kvarn_k2v2_g32");
    assert_int_equal(kvarn_cuda_supports(&f, 128), KVARN_ERR_UNSUPPORTED);
    f = fmt_of("kvarn_k8v8_g128");
    assert_int_equal(kvarn_cuda_supports(&f, 128), KVARN_ERR_UNSUPPORTED);
    f = fmt_of("kvarn_k4v2_g128");
    assert_int_equal(kvarn_cuda_supports(&f, 96), KVARN_ERR_UNSUPPORTED_HEAD_DIM);
    assert_int_equal(kvarn_cuda_supports(&f, 1024), KVARN_ERR_UNSUPPORTED_HEAD_DIM);
    f = fmt_of("int8");
    assert_int_equal(kvarn_cuda_supports(&f, 96), KVARN_ERR_UNSUPPORTED_HEAD_DIM);
    assert_int_equal(kvarn_cuda_supports(&f, 7), KVARN_ERR_UNSUPPORTED_HEAD_DIM);
    assert_int_equal(kvarn_cuda_supports(NULL, 128), KVARN_ERR_INVALID_ARG);
    f.kind = KVARN_KIND_COUNT;
    assert_int_equal(kvarn_cuda_supports(&f, 128), KVARN_ERR_INVALID_ARG);
}

static void test_check_kv(void **state)
{
    (void)state;
    kvarn_paged_kv kv = make_kv("kvarn_k4v2_g128", 128, 8, 0, fake_arena, 10, fake_arena, 4);
    assert_int_equal(kv.record_stride, 13824);
    assert_int_equal(kvarn_cuda_check_kv(&kv), KVARN_OK);
    assert_int_equal(kvarn_cuda_check_kv(NULL), KVARN_ERR_INVALID_ARG);

    kvarn_paged_kv b = kv;
    b.block_size = 64; /* KVarN block size must be the tile size */
    assert_int_equal(kvarn_cuda_check_kv(&b), KVARN_ERR_INVALID_ARG);
    b = kv;
    b.record_stride -= 8;
    assert_int_equal(kvarn_cuda_check_kv(&b), KVARN_ERR_BUFFER_TOO_SMALL);
    b = kv;
    b.block_stride = b.record_stride * 7;
    assert_int_equal(kvarn_cuda_check_kv(&b), KVARN_ERR_BUFFER_TOO_SMALL);
    b = kv;
    b.fp16_pages = NULL;
    assert_int_equal(kvarn_cuda_check_kv(&b), KVARN_ERR_INVALID_ARG);
    b = kv;
    b.n_fp16_pages = 0;
    assert_int_equal(kvarn_cuda_check_kv(&b), KVARN_ERR_INVALID_ARG);
    b = kv;
    b.blocks = fake_arena + 2; /* not 4-byte aligned */
    assert_int_equal(kvarn_cuda_check_kv(&b), KVARN_ERR_INVALID_ARG);
    b = kv;
    b.fp16_pages = (uint16_t *)(void *)(fake_arena + 4); /* not 16-byte aligned */
    assert_int_equal(kvarn_cuda_check_kv(&b), KVARN_ERR_INVALID_ARG);
    /* fp16 page strides (paged.h): a head's K+V tile must fit, the heads
     * must fit in a page, 16-byte steps (the commit reads 16-byte words) */
    b = kv;
    b.page_head_stride -= 16;
    assert_int_equal(kvarn_cuda_check_kv(&b), KVARN_ERR_BUFFER_TOO_SMALL);
    b = kv;
    b.page_stride -= 16;
    assert_int_equal(kvarn_cuda_check_kv(&b), KVARN_ERR_BUFFER_TOO_SMALL);
    b = kv;
    b.page_head_stride += 8;
    assert_int_equal(kvarn_cuda_check_kv(&b), KVARN_ERR_INVALID_ARG);
    b = kv;
    b.page_stride += 32; /* padding between pages is fine */
    b.page_head_stride += 16;
    b.page_stride += (size_t)16 * b.n_kv_heads;
    assert_int_equal(kvarn_cuda_check_kv(&b), KVARN_OK);
    /* Stride products that do not fit size_t are refused (regression: Hk x
     * record_stride and Hk x page_head_stride were unchecked products, so
     * 8 x 2^61 wrapped to 0 and passed every "fits" test). */
    b = kv;
    b.record_stride = (size_t)1 << (sizeof(size_t) * 8 - 3);
    assert_int_equal(kvarn_cuda_check_kv(&b), KVARN_ERR_INVALID_ARG);
    b = kv;
    b.page_head_stride = (size_t)1 << (sizeof(size_t) * 8 - 3);
    assert_int_equal(kvarn_cuda_check_kv(&b), KVARN_ERR_INVALID_ARG);
    b = kv;
    b.n_kv_heads = 0;
    assert_int_equal(kvarn_cuda_check_kv(&b), KVARN_ERR_INVALID_ARG);
    b = kv;
    b.sink_tiles = -1;
    assert_int_equal(kvarn_cuda_check_kv(&b), KVARN_ERR_INVALID_ARG);
    b = kv;
    b.head_dim = 96;
    assert_int_equal(kvarn_cuda_check_kv(&b), KVARN_ERR_UNSUPPORTED_HEAD_DIM);
    b = kv;
    b.sink_partial = 16; /* a sink shorter than a tile: CPU kernels only */
    assert_int_equal(kvarn_cuda_check_kv(&b), KVARN_ERR_UNSUPPORTED);
    b = kv;
    b.tail_page_tokens = 16; /* small tail pages: CPU kernels only */
    assert_int_equal(kvarn_cuda_check_kv(&b), KVARN_ERR_UNSUPPORTED);
    b.tail_page_tokens = b.block_size; /* whole tail pages: served */
    assert_int_equal(kvarn_cuda_check_kv(&b), KVARN_OK);

    kvarn_paged_kv t = make_kv("fp8_e4m3", 64, 3, 16, fake_arena, 10, NULL, 0);
    assert_int_equal(t.token_record_bytes, 132);
    assert_int_equal(kvarn_cuda_check_kv(&t), KVARN_OK);
    b = t;
    b.token_record_bytes = 128;
    assert_int_equal(kvarn_cuda_check_kv(&b), KVARN_ERR_BUFFER_TOO_SMALL);
    b = t;
    b.token_record_bytes = (size_t)1 << (sizeof(size_t) * 8 - 4); /* x 16 tokens wraps */
    assert_int_equal(kvarn_cuda_check_kv(&b), KVARN_ERR_INVALID_ARG);
    b = t;
    b.block_size = 129;
    assert_int_equal(kvarn_cuda_check_kv(&b), KVARN_ERR_INVALID_ARG);
    b = t;
    b.sink_tiles = 1; /* sinks are a KVarN notion */
    assert_int_equal(kvarn_cuda_check_kv(&b), KVARN_ERR_INVALID_ARG);
    b = t;
    b.token_record_bytes = 134; /* not a multiple of 4 */
    assert_int_equal(kvarn_cuda_check_kv(&b), KVARN_ERR_INVALID_ARG);
}

static kvarn_cuda_attn_shape shape_of(int seqs, int Hq, int max_len, int G, int qlen)
{
    kvarn_cuda_attn_shape s;
    memset(&s, 0, sizeof s);
    s.num_seqs = seqs;
    s.num_heads = Hq;
    s.max_blocks_per_seq = (max_len + G - 1) / G + 1;
    s.max_seq_len = max_len;
    s.max_query_len = qlen;
    s.softmax_scale = 0.125f;
    return s;
}

static void test_plan(void **state)
{
    (void)state;
    /* Llama-3-8B shapes: 32 query heads, 8 KV heads, D = 128. */
    kvarn_paged_kv kv = make_kv("kvarn_k4v2_g128", 128, 8, 0, fake_arena, 10, fake_arena, 4);
    kvarn_cuda_attn_plan p;
    memset(&p, 0x5a, sizeof p);

    kvarn_cuda_attn_shape s = shape_of(1, 32, 32768, 128, 1);
    assert_int_equal(kvarn_cuda_attn_plan_make(&kv, &s, 132, &p), KVARN_OK);
    assert_int_equal(p.group_size, 4);
    assert_int_equal(p.row_chunks, 1);
    /* 8 blocks for 264 wanted: ceil(264 / 8) = 33 splits, each 993 tokens. */
    assert_int_equal(p.num_splits, 33);
    assert_int_equal(p.workspace_bytes, (size_t)8 * 33 * 8 * (128 + 2) * 4);

    s = shape_of(64, 32, 32768, 128, 1); /* 512 blocks: no split needed */
    assert_int_equal(kvarn_cuda_attn_plan_make(&kv, &s, 132, &p), KVARN_OK);
    assert_int_equal(p.num_splits, 1);
    assert_int_equal(p.workspace_bytes, 0);

    s = shape_of(1, 32, 131072, 128, 1); /* capped at 64 splits */
    assert_int_equal(kvarn_cuda_attn_plan_make(&kv, &s, 1000, &p), KVARN_OK);
    assert_int_equal(p.num_splits, 64);

    s = shape_of(1, 32, 1000, 128, 1); /* short: at most one split per 256 tokens */
    assert_int_equal(kvarn_cuda_attn_plan_make(&kv, &s, 132, &p), KVARN_OK);
    assert_int_equal(p.num_splits, 3);

    s = shape_of(1, 32, 32768, 128, 1);
    assert_int_equal(kvarn_cuda_attn_plan_make(&kv, &s, 0, &p), KVARN_OK);
    assert_int_equal(p.num_splits, 1);

    s = shape_of(2, 32, 4096, 128, 4); /* 4 queries x 4 heads = 16 rows: 2 chunks */
    assert_int_equal(kvarn_cuda_attn_plan_make(&kv, &s, 0, &p), KVARN_OK);
    assert_int_equal(p.row_chunks, 2);

    /* bad shapes: plan untouched */
    kvarn_cuda_attn_plan before = p;
    kvarn_cuda_attn_shape bad[8];
    for (int i = 0; i < 8; i++) bad[i] = shape_of(2, 32, 4096, 128, 1);
    bad[0].num_seqs = 0;
    bad[1].num_heads = 30; /* not a multiple of 8 */
    bad[2].max_seq_len = bad[2].max_blocks_per_seq * 128 + 1;
    bad[3].max_query_len = 0;
    bad[4].sliding_window = -1;
    bad[5].softmax_scale = 0.0f;
    bad[6].softmax_scale = NAN;
    bad[7].num_seqs = 70000;
    for (int i = 0; i < 8; i++) {
        assert_int_equal(kvarn_cuda_attn_plan_make(&kv, &bad[i], 132, &p), KVARN_ERR_INVALID_ARG);
        assert_memory_equal(&p, &before, sizeof p);
    }
    assert_int_equal(kvarn_cuda_attn_plan_make(&kv, NULL, 132, &p), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cuda_attn_plan_make(&kv, &s, 132, NULL), KVARN_ERR_INVALID_ARG);

    /* Which kernel a plan runs (kvarn_cuda_attn_kernel_info_get): the
     * tensor-core kernel from 32 queries a sequence, KVarN at D 64 and 128
     * only; its rounding stated as bf16, the vector kernel's as fp32. */
    kvarn_cuda_attn_kernel_info info;
    unsetenv("KVARN_CUDA_MATRIX");
    s = shape_of(2, 32, 4096, 128, 32);
    assert_int_equal(kvarn_cuda_attn_plan_make(&kv, &s, 0, &p), KVARN_OK);
    assert_int_equal(kvarn_cuda_attn_kernel_info_get(&kv, &p, &info), KVARN_OK);
    assert_int_equal(info.matrix, 1);
    assert_int_equal(info.matrix_min_queries, 32);
    assert_int_equal(info.matrix_rows, 64);
    assert_int_equal(info.matrix_scores, KVARN_ATTN_ARITH_BF16);
    assert_int_equal(info.matrix_sums, KVARN_ATTN_ARITH_BF16);
    assert_int_equal(info.scores, KVARN_ATTN_ARITH_FP32);
    assert_int_equal(info.sums, KVARN_ATTN_ARITH_FP32);
    /* split-K sized for the tensor-core kernel's blocks (8 chunks each):
     * 1 sequence x 8 KV heads x 16 chunks = 16 blocks -> ceil(264 / 16) =
     * 17 splits; with the kernel off, 128 blocks -> 3 */
    s = shape_of(1, 32, 32768, 128, 32);
    assert_int_equal(kvarn_cuda_attn_plan_make(&kv, &s, 132, &p), KVARN_OK);
    assert_int_equal(p.row_chunks, 16);
    assert_int_equal(p.num_splits, 17);
    assert_int_equal(p.workspace_bytes, (size_t)8 * 16 * 17 * 8 * (128 + 2) * 4);
    setenv("KVARN_CUDA_MATRIX", "0", 1);
    assert_int_equal(kvarn_cuda_attn_plan_make(&kv, &s, 132, &p), KVARN_OK);
    assert_int_equal(p.num_splits, 3);
    assert_int_equal(kvarn_cuda_attn_kernel_info_get(&kv, &p, &info), KVARN_OK);
    assert_int_equal(info.matrix, 0);
    assert_int_equal(info.matrix_scores, KVARN_ATTN_ARITH_FP32);
    unsetenv("KVARN_CUDA_MATRIX");
    s = shape_of(2, 32, 4096, 128, 31); /* verification-sized: the vector kernel */
    assert_int_equal(kvarn_cuda_attn_plan_make(&kv, &s, 0, &p), KVARN_OK);
    assert_int_equal(kvarn_cuda_attn_kernel_info_get(&kv, &p, &info), KVARN_OK);
    assert_int_equal(info.matrix, 0);
    assert_int_equal(info.matrix_rows, 0);
    assert_int_equal(info.matrix_scores, KVARN_ATTN_ARITH_FP32);
    const char *no_matrix[] = {"int8", "kvarn_k4v2_g128"}; /* a per-token format; D 256 */
    for (int i = 0; i < 2; i++) {
        kvarn_paged_kv o = i == 0 ? make_kv("int8", 128, 8, 16, fake_arena, 10, NULL, 0)
                                  : make_kv(no_matrix[i], 256, 8, 0, fake_arena, 10, fake_arena, 4);
        s = shape_of(2, 32, 4096, o.block_size, 64);
        assert_int_equal(kvarn_cuda_attn_plan_make(&o, &s, 0, &p), KVARN_OK);
        assert_int_equal(kvarn_cuda_attn_kernel_info_get(&o, &p, &info), KVARN_OK);
        assert_int_equal(info.matrix, 0);
    }
    s = shape_of(2, 32, 4096, 128, 64);
    assert_int_equal(kvarn_cuda_attn_plan_make(&kv, &s, 0, &p), KVARN_OK);
    kvarn_cuda_attn_kernel_info kept;
    memset(&kept, 0x3c, sizeof kept);
    info = kept;
    kvarn_cuda_attn_plan other = p;
    other.row_chunks = 1; /* not made for this kv and shape */
    assert_int_equal(kvarn_cuda_attn_kernel_info_get(&kv, &other, &info), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cuda_attn_kernel_info_get(&kv, NULL, &info), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cuda_attn_kernel_info_get(NULL, &p, &info), KVARN_ERR_INVALID_ARG);
    assert_memory_equal(&info, &kept, sizeof info);
    assert_int_equal(kvarn_cuda_attn_kernel_info_get(&kv, &p, NULL), KVARN_ERR_INVALID_ARG);

    kvarn_paged_kv u = kv;
    u.fmt = fmt_of("kvarn_k2v2_g32");
    u.block_size = 32;
    u.record_stride = kvarn_record_bytes(&u.fmt, 128);
    u.block_stride = u.record_stride * 8;
    assert_int_equal(kvarn_cuda_attn_plan_make(&u, &s, 132, &p), KVARN_ERR_UNSUPPORTED);
}

static void test_arguments(void **state)
{
    (void)state;
    kvarn_paged_kv kv = make_kv("kvarn_k4v2_g128", 128, 8, 0, fake_arena, 10, fake_arena, 4);
    kvarn_paged_kv tok = make_kv("int8", 128, 8, 16, fake_arena, 10, NULL, 0);
    const void *x = fake_arena;
    const int64_t *slots = (const int64_t *)(const void *)fake_arena;
    const int32_t *ids = (const int32_t *)(const void *)fake_arena;

    /* store */
    assert_int_equal(kvarn_cuda_store(NULL, KVARN_CUDA_F16, x, x, slots, 4, NULL), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cuda_store(&kv, KVARN_CUDA_F16, NULL, x, slots, 4, NULL), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cuda_store(&kv, KVARN_CUDA_F16, x, x, NULL, 4, NULL), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cuda_store(&kv, KVARN_CUDA_F16, x, x, slots, -1, NULL), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cuda_store(&kv, (kvarn_cuda_dtype)7, x, x, slots, 4, NULL), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cuda_store(&kv, KVARN_CUDA_BF16, x, x, slots, 0, NULL), KVARN_OK);

    /* commit */
    kvarn_codec_opts o = KVARN_CODEC_OPTS_DEFAULT;
    assert_int_equal(kvarn_cuda_commit(&kv, NULL, ids, 1, NULL, NULL), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cuda_commit(&kv, ids, ids, -1, NULL, NULL), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cuda_commit(&tok, ids, ids, 1, NULL, NULL), KVARN_ERR_INVALID_ARG);
    o.balance_iters = 65;
    assert_int_equal(kvarn_cuda_commit(&kv, ids, ids, 1, &o, NULL), KVARN_ERR_INVALID_ARG);
    o.balance_iters = 8;
    assert_int_equal(kvarn_cuda_commit(&kv, ids, ids, 0, &o, NULL), KVARN_OK);

    /* attention */
    kvarn_cuda_attn_shape s = shape_of(1, 32, 32768, 128, 1);
    kvarn_cuda_attn_plan p;
    assert_int_equal(kvarn_cuda_attn_plan_make(&kv, &s, 132, &p), KVARN_OK);
    float *f = (float *)(void *)fake_arena;
    kvarn_cuda_attn_args a = {f, f, ids, ids, ids, NULL, NULL};
    assert_int_equal(kvarn_cuda_attention(&kv, &p, &a, fake_arena, p.workspace_bytes - 1, NULL),
                     KVARN_ERR_BUFFER_TOO_SMALL);
    assert_int_equal(kvarn_cuda_attention(&kv, &p, &a, NULL, p.workspace_bytes, NULL),
                     KVARN_ERR_INVALID_ARG);
    kvarn_cuda_attn_args b = a;
    b.committed_tiles = NULL; /* needed for KVarN */
    assert_int_equal(kvarn_cuda_attention(&kv, &p, &b, fake_arena, p.workspace_bytes, NULL),
                     KVARN_ERR_INVALID_ARG);
    b = a;
    b.q = NULL;
    assert_int_equal(kvarn_cuda_attention(&kv, &p, &b, fake_arena, p.workspace_bytes, NULL),
                     KVARN_ERR_INVALID_ARG);
    kvarn_cuda_attn_plan q = p;
    q.group_size = 2; /* not made for this kv */
    assert_int_equal(kvarn_cuda_attention(&kv, &q, &a, fake_arena, p.workspace_bytes, NULL),
                     KVARN_ERR_INVALID_ARG);
    q = p;
    q.workspace_bytes -= 4;
    assert_int_equal(kvarn_cuda_attention(&kv, &q, &a, fake_arena, p.workspace_bytes, NULL),
                     KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_cuda_attention(&kv, NULL, &a, NULL, 0, NULL), KVARN_ERR_INVALID_ARG);

    /* Valid calls: without a GPU they must say so; with one we do not
     * launch on these fake pointers. */
    if (!have_gpu()) {
        int n = -1;
        assert_int_equal(kvarn_cuda_device_count(&n), KVARN_ERR_NO_DEVICE);
        assert_int_equal(n, 0);
        assert_int_equal(kvarn_cuda_store(&kv, KVARN_CUDA_F16, x, x, slots, 4, NULL),
                         KVARN_ERR_NO_DEVICE);
        assert_int_equal(kvarn_cuda_commit(&kv, ids, ids, 1, NULL, NULL), KVARN_ERR_NO_DEVICE);
        assert_int_equal(kvarn_cuda_attention(&kv, &p, &a, fake_arena, p.workspace_bytes, NULL),
                         KVARN_ERR_NO_DEVICE);
        int sms = -1;
        assert_int_equal(kvarn_cuda_sm_count(0, &sms), KVARN_ERR_NO_DEVICE);
        print_message("no CUDA device: valid calls return KVARN_ERR_NO_DEVICE as documented\n");
    }
    assert_int_equal(kvarn_cuda_device_count(NULL), KVARN_ERR_INVALID_ARG);
}

/* ------------------------------------------------------- device side */

/* Per-token formats: one store of scattered slots (with padding) must give
 * the CPU encoder's records byte for byte, and leave other slots alone. */
static void test_gpu_store_per_token(void **state)
{
    (void)state;
    SKIP_WITHOUT_GPU();
    test_rng rng;
    test_rng_seed(&rng, 11);
    const char *kinds[] = {"fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"};
    const int Hk = 2, G = 16, n_blocks = 20, n = EMU_SMALL ? 40 : 200, n_in = n + 8;
    for (size_t fi = 0; fi < sizeof kinds / sizeof kinds[0]; fi++)
        for (int D = 64; D <= 512; D *= 2) {
            kvarn_paged_kv kv = make_kv(kinds[fi], D, Hk, G, NULL, n_blocks, NULL, 0);
            const size_t arena = kv.block_stride * n_blocks, rec = kv.token_record_bytes;
            kv.blocks = dev_alloc(arena);
            CK(cudaMemset(kv.blocks, 0xa5, arena));
            /* n real tokens on distinct random slots, 8 padding rows of NaN */
            int32_t *perm = host_alloc(sizeof(int32_t) * n_blocks * G);
            for (int i = 0; i < n_blocks * G; i++) perm[i] = i;
            shuffle(&rng, perm, n_blocks * G);
            int64_t *slots = host_alloc(sizeof(int64_t) * n_in);
            uint16_t *k = host_alloc(2 * (size_t)n_in * Hk * D), *v = host_alloc(2 * (size_t)n_in * Hk * D);
            random_kv(&rng, k, n_in, Hk, D, 1.0);
            random_kv(&rng, v, n_in, Hk, D, 0.3);
            for (int t = 0, r = 0; t < n_in; t++) {
                slots[t] = (t % 26 == 5) ? -1 : perm[r++];
                if (slots[t] < 0)
                    for (int c = 0; c < Hk * D; c++) k[(size_t)t * Hk * D + c] = v[(size_t)t * Hk * D + c] = 0x7e00;
            }
            const int dtype = (fi + D) % 3 == 0 ? KVARN_CUDA_BF16 : KVARN_CUDA_F16;
            if (dtype == KVARN_CUDA_BF16) /* the same values rounded to bf16 */
                for (size_t c = 0; c < (size_t)n_in * Hk * D; c++) {
                    k[c] = kvarn_fp32_to_bf16(kvarn_fp16_to_fp32(k[c]));
                    v[c] = kvarn_fp32_to_bf16(kvarn_fp16_to_fp32(v[c]));
                }
            void *dk = dev_alloc(2 * (size_t)n_in * Hk * D), *dv = dev_alloc(2 * (size_t)n_in * Hk * D);
            void *ds = dev_alloc(sizeof(int64_t) * n_in);
            CK(cudaMemcpy(dk, k, 2 * (size_t)n_in * Hk * D, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(dv, v, 2 * (size_t)n_in * Hk * D, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(ds, slots, sizeof(int64_t) * n_in, cudaMemcpyHostToDevice));
            assert_int_equal(kvarn_cuda_store(&kv, (kvarn_cuda_dtype)dtype, dk, dv, ds, n_in, NULL), KVARN_OK);
            CK(cudaDeviceSynchronize());
            uint8_t *got = host_alloc(arena);
            CK(cudaMemcpy(got, kv.blocks, arena, cudaMemcpyDeviceToHost));

            uint8_t *want = host_alloc(rec);
            float *kf = host_alloc(sizeof(float) * D), *vf = host_alloc(sizeof(float) * D);
            int bad = 0, written = 0;
            for (int t = 0; t < n_in; t++) {
                if (slots[t] < 0) continue;
                for (int h = 0; h < Hk; h++) {
                    for (int d = 0; d < D; d++) {
                        uint16_t kk = k[((size_t)t * Hk + h) * D + d], vv = v[((size_t)t * Hk + h) * D + d];
                        kf[d] = dtype == KVARN_CUDA_BF16 ? kvarn_bf16_to_fp32(kk) : kvarn_fp16_to_fp32(kk);
                        vf[d] = dtype == KVARN_CUDA_BF16 ? kvarn_bf16_to_fp32(vv) : kvarn_fp16_to_fp32(vv);
                    }
                    assert_int_equal(kvarn_encode(&kv.fmt, D, kf, vf, want, rec, NULL, 0, NULL), KVARN_OK);
                    kvarn_paged_kv host = kv; /* the same layout over the copy */
                    host.blocks = got;
                    const uint8_t *g = kvarn_paged_token_record(&host, (int32_t)(slots[t] / G), h,
                                                                (int)(slots[t] % G));
                    bad += memcmp(g, want, rec) != 0;
                    written++;
                }
            }
            /* slots nobody wrote keep the poison */
            size_t poison = 0;
            for (size_t i = 0; i < arena; i++) poison += got[i] == 0xa5;
            if (bad) print_message("%s D=%d: %d of %d records differ from kvarn_encode\n", kinds[fi], D, bad, written);
            assert_int_equal(bad, 0);
            assert_true(poison >= (size_t)(n_blocks * G * Hk - written) * rec);
            free(perm); free(slots); free(k); free(v); free(got); free(want); free(kf); free(vf);
            CK(cudaFree(dk)); CK(cudaFree(dv)); CK(cudaFree(ds)); CK(cudaFree(kv.blocks));
        }
}

typedef struct kvarn_case { const char *name; int D; } kvarn_case;

static unsigned code_at(const uint8_t *rec, size_t off, size_t row_codes, int bits, int row, int i)
{
    return kvarn_packed_code_at(rec + off + (size_t)row * kvarn_packed_bytes(row_codes, bits), (size_t)i, bits);
}

static int scale_close(const uint8_t *g, const uint8_t *c, size_t bytes)
{
    int bad = 0;
    for (size_t i = 0; i < bytes; i += 2) {
        uint16_t a, b;
        memcpy(&a, g + i, 2);
        memcpy(&b, c + i, 2);
        float x = kvarn_fp16_to_fp32(a), y = kvarn_fp16_to_fp32(b);
        bad += !(fabsf(x - y) <= 0.1f + 0.02f * fabsf(y));
    }
    return bad;
}

/* KVarN: store into pages, commit into records, against the CPU codec. */
static void test_gpu_store_commit_kvarn(void **state)
{
    (void)state;
    SKIP_WITHOUT_GPU();
    const kvarn_case cases[] = {{"kvarn_k4v2_g128", 128}, {"kvarn_k4v4_g128", 128},
                                {"kvarn_k4v2_g64", 64},   {"kvarn_k4v4_g64", 64},
                                {"kvarn_k4v2_g128", 256}, {"kvarn_k4v4_g64", 256},
                                {"kvarn_k4v2_g128", 64},  {"kvarn_k4v2_g128", 512}};
    test_rng rng;
    test_rng_seed(&rng, 12);
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const int D = cases[ci].D, Hk = 2, tiles = EMU_SMALL ? 2 : 32;
        kvarn_paged_kv kv = make_kv(cases[ci].name, D, Hk, 0, NULL, tiles + 5, NULL, tiles + 3);
        const int G = kv.block_size;
        const size_t rec = kvarn_record_bytes(&kv.fmt, D);
        const size_t arena = kv.block_stride * kv.n_blocks;
        const size_t pages_bytes = kv.page_stride * kv.n_fp16_pages;
        kv.blocks = dev_alloc(arena);
        kv.fp16_pages = dev_alloc(pages_bytes);

        const int n = tiles * G, n_in = n + 5;
        int32_t *page_of = host_alloc(sizeof(int32_t) * kv.n_fp16_pages);
        int32_t *block_of = host_alloc(sizeof(int32_t) * kv.n_blocks);
        for (int i = 0; i < kv.n_fp16_pages; i++) page_of[i] = i;
        for (int i = 0; i < kv.n_blocks; i++) block_of[i] = i;
        shuffle(&rng, page_of, kv.n_fp16_pages);
        shuffle(&rng, block_of, kv.n_blocks);
        uint16_t *k = host_alloc(2 * (size_t)n_in * Hk * D), *v = host_alloc(2 * (size_t)n_in * Hk * D);
        random_kv(&rng, k, n_in, Hk, D, 1.0);
        random_kv(&rng, v, n_in, Hk, D, 0.5);
        int64_t *slots = host_alloc(sizeof(int64_t) * n_in);
        for (int t = 0, r = 0; t < n_in; t++) {
            if (t % 97 == 3) { /* padding, NaN activations */
                slots[t] = -1;
                for (int c = 0; c < Hk * D; c++) k[(size_t)t * Hk * D + c] = v[(size_t)t * Hk * D + c] = 0x7e00;
                continue;
            }
            slots[t] = kvarn_paged_slot(page_of[r / G], G, r % G);
            r++;
        }
        int32_t src[tiles + 1], dst[tiles + 1];
        for (int i = 0; i < tiles; i++) { src[i] = page_of[i]; dst[i] = block_of[i]; }
        src[tiles] = -1; /* skipped entry */
        dst[tiles] = block_of[tiles];
        void *dk = dev_alloc(2 * (size_t)n_in * Hk * D), *dv = dev_alloc(2 * (size_t)n_in * Hk * D);
        void *ds = dev_alloc(sizeof(int64_t) * n_in), *dsrc = dev_alloc(sizeof src), *ddst = dev_alloc(sizeof dst);
        CK(cudaMemcpy(dk, k, 2 * (size_t)n_in * Hk * D, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dv, v, 2 * (size_t)n_in * Hk * D, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(ds, slots, sizeof(int64_t) * n_in, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dsrc, src, sizeof src, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(ddst, dst, sizeof dst, cudaMemcpyHostToDevice));

        uint8_t *run[2];
        uint16_t *pages = host_alloc(pages_bytes);
        for (int pass = 0; pass < 2; pass++) {
            CK(cudaMemset(kv.blocks, 0xa5, arena));
            CK(cudaMemset(kv.fp16_pages, 0xff, pages_bytes));
            CK(cudaDeviceSynchronize());
            if (pass == 0) {
                assert_int_equal(kvarn_cuda_store(&kv, KVARN_CUDA_F16, dk, dv, ds, n_in, NULL), KVARN_OK);
                assert_int_equal(kvarn_cuda_commit(&kv, dsrc, ddst, tiles + 1, NULL, NULL), KVARN_OK);
            } else { /* the second run replays a captured CUDA graph */
                cudaStream_t st;
                cudaGraph_t graph;
                cudaGraphExec_t exec;
                CK(cudaStreamCreate(&st));
                CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
                kvarn_status s1 = kvarn_cuda_store(&kv, KVARN_CUDA_F16, dk, dv, ds, n_in, st);
                kvarn_status s2 = kvarn_cuda_commit(&kv, dsrc, ddst, tiles + 1, NULL, st);
                CK(cudaStreamEndCapture(st, &graph));
                assert_int_equal(s1, KVARN_OK);
                assert_int_equal(s2, KVARN_OK);
                CK(cudaGraphInstantiate(&exec, graph, 0));
                CK(cudaGraphLaunch(exec, st));
                CK(cudaStreamSynchronize(st));
                CK(cudaGraphExecDestroy(exec));
                CK(cudaGraphDestroy(graph));
                CK(cudaStreamDestroy(st));
            }
            CK(cudaDeviceSynchronize());
            run[pass] = host_alloc(arena);
            CK(cudaMemcpy(run[pass], kv.blocks, arena, cudaMemcpyDeviceToHost));
        }
        assert_memory_equal(run[0], run[1], arena); /* bit-identical runs */
        CK(cudaMemcpy(pages, kv.fp16_pages, pages_bytes, cudaMemcpyDeviceToHost));

        /* pages: bit-identical to the CPU rotation of the same fp16 input */
        float *row = host_alloc(sizeof(float) * D);
        int page_bad = 0;
        for (int t = 0; t < n_in; t++) {
            if (slots[t] < 0) continue;
            const int64_t p = slots[t] / G, off = slots[t] % G;
            for (int h = 0; h < Hk; h++)
                for (int kvi = 0; kvi < 2; kvi++) {
                    const uint16_t *in = (kvi ? v : k) + ((size_t)t * Hk + h) * D;
                    for (int d = 0; d < D; d++) row[d] = kvarn_fp16_to_fp32(in[d]);
                    kvarn_hadamard_scalar(row, D);
                    kvarn_paged_kv host = kv; /* the same layout over the copy */
                    host.fp16_pages = pages;
                    const uint16_t *pg = (kvi ? kvarn_paged_page_v(&host, (int32_t)p, h)
                                              : kvarn_paged_page_k(&host, (int32_t)p, h)) + off * D;
                    for (int d = 0; d < D; d++) page_bad += pg[d] != kvarn_fp32_to_fp16(row[d]);
                }
        }
        assert_int_equal(page_bad, 0);

        /* records against kvarn_encode (prerotated) on the page values */
        kvarn_record_layout L;
        assert_int_equal(kvarn_record_layout_get(&kv.fmt, D, &L), KVARN_OK);
        const size_t wsb = kvarn_encode_workspace_bytes(&kv.fmt, D);
        void *ws = NULL;
        assert_int_equal(posix_memalign(&ws, 64, wsb), 0);
        float *kf = host_alloc(sizeof(float) * G * D), *vf = host_alloc(sizeof(float) * G * D);
        uint8_t *want = host_alloc(rec);
        kvarn_codec_opts o = KVARN_CODEC_OPTS_DEFAULT;
        o.prerotated = 1;
        long codes = 0, code_bad = 0, scale_bad = 0, pad_bad = 0;
        for (int i = 0; i < tiles; i++)
            for (int h = 0; h < Hk; h++) {
                kvarn_paged_kv host = kv; /* the same layout over the copies */
                host.fp16_pages = pages;
                host.blocks = run[0];
                const uint16_t *pk = kvarn_paged_page_k(&host, src[i], h);
                const uint16_t *pv = kvarn_paged_page_v(&host, src[i], h);
                for (int e = 0; e < G * D; e++) {
                    kf[e] = kvarn_fp16_to_fp32(pk[e]);
                    vf[e] = kvarn_fp16_to_fp32(pv[e]);
                }
                assert_int_equal(kvarn_encode(&kv.fmt, D, kf, vf, want, rec, ws, wsb, &o), KVARN_OK);
                const uint8_t *g = kvarn_paged_record(&host, dst[i], h);
                for (int d = 0; d < D; d++)
                    for (int t = 0; t < G; t++)
                        code_bad += code_at(g, L.k_codes_off, G, L.key_bits, d, t) !=
                                    code_at(want, L.k_codes_off, G, L.key_bits, d, t);
                for (int t = 0; t < G; t++)
                    for (int d = 0; d < D; d++)
                        code_bad += code_at(g, L.v_codes_off, D, L.value_bits, t, d) !=
                                    code_at(want, L.v_codes_off, D, L.value_bits, t, d);
                codes += 2L * G * D;
                scale_bad += scale_close(g + L.k_a_off, want + L.k_a_off, L.k_a_bytes + L.k_b_bytes + L.k_stok_bytes);
                scale_bad += scale_close(g + L.v_schan_off, want + L.v_schan_off,
                                         L.v_schan_bytes + L.v_a_bytes + L.v_b_bytes);
                for (size_t b = L.payload_bytes; b < L.record_bytes; b++) pad_bad += g[b] != 0;
            }
        const long allowed = 16 * ((codes + (1L << 21) - 1) >> 21);
        print_message("%s D=%d: %ld of %ld codes differ from kvarn_encode (allowed %ld), %ld scales off\n",
                      cases[ci].name, D, code_bad, codes, allowed, scale_bad);
        assert_true(code_bad <= allowed);
        assert_int_equal(scale_bad, 0);
        assert_int_equal(pad_bad, 0);
        /* the skipped commit entry and unused blocks keep their poison */
        for (int i = tiles; i < kv.n_blocks; i++) {
            kvarn_paged_kv host = kv;
            host.blocks = run[0];
            const uint8_t *g = kvarn_paged_record(&host, block_of[i], 0);
            for (size_t b = 0; b < kv.block_stride; b++) assert_int_equal(g[b], 0xa5);
        }
        free(ws); free(kf); free(vf); free(want); free(row); free(pages); free(run[0]); free(run[1]);
        free(page_of); free(block_of); free(k); free(v); free(slots);
        CK(cudaFree(dk)); CK(cudaFree(dv)); CK(cudaFree(ds)); CK(cudaFree(dsrc)); CK(cudaFree(ddst));
        CK(cudaFree(kv.blocks)); CK(cudaFree(kv.fp16_pages));
    }
}

/* --------------------------------------------- attention vs reference */

/* K and V (attention basis) of token pos of one sequence, in double:
 * exact (bf16 0), or as the tensor-core kernel holds them (bf16 1:
 * attn_mma.cu, cuda.h kvarn_cuda_attn_kernel_info): a record's key s_tok_t *
 * fmaf(a_d, c_td, b_d) and value fmaf(a_t, c_td, b_t) * s_chan_d in fp32,
 * an fp16 page's rows as fp32, each then rounded to bf16 (nearest even). */
static double bf16_of(float x) { return kvarn_bf16_to_fp32(kvarn_fp32_to_bf16(x)); }

static void ref_kv_at(const kvarn_paged_kv *kv, const uint8_t *blocks, const uint16_t *pages,
                      const int32_t *table, int committed, int h, int pos, int bf16, double *k,
                      double *v)
{
    const int D = kv->head_dim, G = kv->block_size, i = pos / G, t = pos % G;
    const int id = table[i];
    kvarn_paged_kv host = *kv; /* the same layout over the host copies */
    host.blocks = (uint8_t *)(uintptr_t)blocks;
    host.fp16_pages = (uint16_t *)(uintptr_t)pages;
    if (kvarn_paged_tile_is_page(&host, committed, i)) {
        const uint16_t *pk = kvarn_paged_page_k(&host, id, h) + (size_t)t * D;
        const uint16_t *pv = kvarn_paged_page_v(&host, id, h) + (size_t)t * D;
        for (int d = 0; d < D; d++) {
            const float kf = kvarn_fp16_to_fp32(pk[d]), vf = kvarn_fp16_to_fp32(pv[d]);
            k[d] = bf16 ? bf16_of(kf) : kf;
            v[d] = bf16 ? bf16_of(vf) : vf;
        }
        return;
    }
    const uint8_t *rec = kvarn_paged_record(&host, id, h);
    if (kv->fmt.kind != KVARN_KIND_KVARN) {
        float kf[512], vf[512];
        assert_int_equal(kvarn_decode(&kv->fmt, D, kvarn_paged_token_record(&host, id, h, t),
                                      kv->token_record_bytes, kf, vf, 0), KVARN_OK);
        for (int d = 0; d < D; d++) { k[d] = kf[d]; v[d] = vf[d]; }
        return;
    }
    /* KVarN record, spec "Record layout", dequantized in the rotated basis */
    kvarn_record_layout L;
    assert_int_equal(kvarn_record_layout_get(&kv->fmt, D, &L), KVARN_OK);
    uint16_t u;
    memcpy(&u, rec + L.k_stok_off + 2 * t, 2);
    const float stok = kvarn_fp16_to_fp32(u);
    memcpy(&u, rec + L.v_a_off + 2 * t, 2);
    const float at = kvarn_fp16_to_fp32(u);
    memcpy(&u, rec + L.v_b_off + 2 * t, 2);
    const float bt = kvarn_fp16_to_fp32(u);
    for (int d = 0; d < D; d++) {
        uint16_t a16, b16, s16;
        memcpy(&a16, rec + L.k_a_off + 2 * d, 2);
        memcpy(&b16, rec + L.k_b_off + 2 * d, 2);
        memcpy(&s16, rec + L.v_schan_off + 2 * d, 2);
        const float a = kvarn_fp16_to_fp32(a16), b = kvarn_fp16_to_fp32(b16);
        const float sc = kvarn_fp16_to_fp32(s16);
        const unsigned ck = code_at(rec, L.k_codes_off, G, L.key_bits, d, t);
        const unsigned cv = code_at(rec, L.v_codes_off, D, L.value_bits, t, d);
        if (bf16) {
            k[d] = bf16_of(fmaf(a, (float)ck, b) * stok);
            v[d] = bf16_of(fmaf(at, (float)cv, bt) * sc);
        } else {
            k[d] = (ck * (double)a + b) * stok;
            v[d] = (cv * (double)at + bt) * sc;
        }
    }
}

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

/* The tensor-core kernel's output for one query row against an oracle of
 * its stated arithmetic, in the rotated basis. The oracle forms what the
 * kernel forms exactly: q' = bf16(H (q * scale * log2 e)) in fp32 (the
 * store's rotation, bit-identical on the device), keys and values as
 * ref_kv_at (bf16); then scores, weights 2^(s - m) and the output in double.
 * What the kernel does differently, bounded: its fp32 score sums (|err| <=
 * (D + 2) 2^-22 sum_d |q'_d k_td| = delta_t, base 2, allowing for the tensor
 * cores' truncating sums; so a weight's ratio to
 * the sum moves by a factor within 2^(+-2 max delta)); each weight rounded
 * to bf16 for the value product (relative 2^-8); its fp32 exp2 and token
 * sums ((n + 8) 2^-23). Per channel |err_d| <= (2^-8 + 2^(2 max delta) - 1
 * + (n + 8) 2^-23) sum_t w_t |v_td| = B_d. *err and *bound: the norms of the
 * error and of B (the rotation back keeps norms: 2^-20 of the output's norm
 * added for its fp32 rounding). */
static void bf16_oracle(const kvarn_paged_kv *kv, const uint8_t *blocks, const uint16_t *pages,
                        const int32_t *table, int committed, int h, int lo, int pos,
                        const float *q, float softmax_scale, float sink, const float *got,
                        double *err, double *bound)
{
    const int D = kv->head_dim, n = pos - lo + 1;
    float qf[512];
    double kf[512], vf[512];
    const float sl2 = softmax_scale * 1.4426950408889634f; /* api.cu's scale_log2 */
    for (int d = 0; d < D; d++) qf[d] = q[d] * sl2;
    kvarn_hadamard(qf, D);
    for (int d = 0; d < D; d++) qf[d] = kvarn_bf16_to_fp32(kvarn_fp32_to_bf16(qf[d]));
    double *sc = malloc(sizeof(double) * (size_t)n);
    assert_non_null(sc);
    double mx = sink == -INFINITY ? -INFINITY : (double)(sink * 1.4426950408889634f), dmax = 0.0;
    for (int p = lo; p <= pos; p++) {
        ref_kv_at(kv, blocks, pages, table, committed, h, p, 1, kf, vf);
        double dot = 0.0, dabs = 0.0;
        for (int d = 0; d < D; d++) {
            dot += qf[d] * kf[d];
            dabs += fabs(qf[d] * kf[d]);
        }
        sc[p - lo] = dot;
        mx = dot > mx ? dot : mx;
        dmax = dabs > dmax ? dabs : dmax;
    }
    double o[512], wv[512], sum = sink == -INFINITY ? 0.0 : exp2((double)(sink * 1.4426950408889634f) - mx);
    for (int d = 0; d < D; d++) o[d] = wv[d] = 0.0;
    for (int p = lo; p <= pos; p++) {
        ref_kv_at(kv, blocks, pages, table, committed, h, p, 1, kf, vf);
        const double w = exp2(sc[p - lo] - mx);
        sum += w;
        for (int d = 0; d < D; d++) {
            o[d] += w * vf[d];
            wv[d] += w * fabs(vf[d]);
        }
    }
    free(sc);
    const double delta = (D + 2) * ldexp(dmax, -22); /* tensor-core sums may truncate */
    const double f = ldexp(1.0, -8) + (exp2(2 * delta) - 1) + (n + 8) * ldexp(1.0, -23);
    double x[512], e2 = 0.0, b2 = 0.0, o2 = 0.0;
    for (int d = 0; d < D; d++) x[d] = got[d];
    fwht_d(x, D); /* the kernel's output, back into the rotated basis */
    for (int d = 0; d < D; d++) {
        const double od = o[d] / sum, bd = f * wv[d] / sum;
        e2 += (x[d] - od) * (x[d] - od);
        b2 += bd * bd;
        o2 += od * od;
    }
    *err = isfinite(e2) ? sqrt(e2) : INFINITY;
    *bound = sqrt(b2) + ldexp(sqrt(o2), -20);
}

typedef struct attn_case { const char *name; int D, Hk, Hq, G; } attn_case;

static void test_gpu_attention(void **state)
{
    (void)state;
    SKIP_WITHOUT_GPU();
    const attn_case cases[] = {
        {"kvarn_k4v2_g128", 128, 2, 8, 0}, {"kvarn_k4v4_g64", 64, 3, 9, 0},
        {"kvarn_k4v2_g64", 256, 1, 2, 0},  {"kvarn_k4v4_g128", 64, 1, 12, 0},
        {"int8", 128, 2, 8, 16},           {"fp8_e4m3", 64, 3, 9, 32},
        {"int4", 256, 1, 4, 16},           {"fp16", 128, 2, 4, 16},
        {"bf16", 64, 1, 1, 64},            {"fp8_e5m2", 128, 4, 8, 128},
        {"kvarn_k4v2_g128", 512, 2, 4, 0}, {"int8", 512, 1, 2, 16},
        {"kvarn_k4v2_g64", 128, 2, 6, 0}};
    test_rng rng;
    test_rng_seed(&rng, 13);
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const attn_case *c = &cases[ci];
        kvarn_paged_kv kv = make_kv(c->name, c->D, c->Hk, c->G, NULL, 1, NULL, 1);
        const int D = c->D, Hk = c->Hk, Hq = c->Hq, G = kv.block_size;
        const int kvarn = kv.fmt.kind == KVARN_KIND_KVARN;
        enum { S = 5 };
        const int lens[S] = {1, 3 * G + 5, (EMU_SMALL ? 4 : 9) * G, (EMU_SMALL ? 2 : 6) * G + 17, 2 * G};
        const int qlens[S] = {1, 3, 2, 5, 1};
        int tiles[S], committed[S], total_tiles = 0, total_tok = 0, max_len = 0, max_tiles = 0;
        for (int s = 0; s < S; s++) {
            tiles[s] = (lens[s] + G - 1) / G;
            committed[s] = kvarn ? lens[s] / G - (s == 2 ? 1 : 0) : tiles[s]; /* seq 2: a full tile still in fp16 */
            if (committed[s] < 0) committed[s] = 0;
            total_tiles += tiles[s];
            total_tok += lens[s];
            max_len = lens[s] > max_len ? lens[s] : max_len;
            max_tiles = tiles[s] > max_tiles ? tiles[s] : max_tiles;
        }
        kv.n_blocks = total_tiles;
        kv.n_fp16_pages = kvarn ? total_tiles : 0;
        /* arenas the caller owns, padded (paged.h): 64 bytes after each
         * head's record, 128 after a block, 32 after each head's fp16 tile,
         * 64 after a page; the padding holds 0xff (NaN in fp16), so a
         * kernel that read it would show */
        kv.record_stride += 64;
        kv.block_stride = kv.record_stride * (size_t)Hk + 128;
        kv.page_head_stride += 32;
        kv.page_stride = kv.page_head_stride * (size_t)Hk + 64;
        const size_t arena = kv.block_stride * kv.n_blocks;
        const size_t pages_bytes = kvarn ? kv.page_stride * kv.n_fp16_pages : 0;
        kv.blocks = dev_alloc(arena);
        if (kvarn) kv.fp16_pages = dev_alloc(pages_bytes);
        CK(cudaMemset(kv.blocks, 0xff, arena));
        if (kvarn) CK(cudaMemset(kv.fp16_pages, 0xff, pages_bytes));

        /* Every tile gets a page (KVarN) or a block (per-token); committed
         * KVarN tiles then move to a block and the table points there. */
        int32_t *ids = host_alloc(sizeof(int32_t) * total_tiles), *bids = host_alloc(sizeof(int32_t) * total_tiles);
        for (int i = 0; i < total_tiles; i++) ids[i] = bids[i] = i;
        shuffle(&rng, ids, total_tiles);
        shuffle(&rng, bids, total_tiles);
        const int MB = max_tiles + 2;
        int32_t *table = host_alloc(sizeof(int32_t) * S * MB);
        for (int i = 0; i < S * MB; i++) table[i] = -1;
        int64_t *slots = host_alloc(sizeof(int64_t) * total_tok);
        int32_t *src = host_alloc(sizeof(int32_t) * total_tiles), *dst = host_alloc(sizeof(int32_t) * total_tiles);
        int n_commit = 0;
        for (int s = 0, tile0 = 0, tok0 = 0; s < S; s++) {
            for (int i = 0; i < tiles[s]; i++) {
                const int id = ids[tile0 + i];
                table[s * MB + i] = id;
                if (kvarn && i >= kv.sink_tiles && i < committed[s]) {
                    src[n_commit] = id;
                    dst[n_commit++] = bids[tile0 + i];
                    table[s * MB + i] = bids[tile0 + i];
                }
            }
            for (int t = 0; t < lens[s]; t++) slots[tok0 + t] = kvarn_paged_slot(ids[tile0 + t / G], G, t % G);
            tile0 += tiles[s];
            tok0 += lens[s];
        }
        uint16_t *k = host_alloc(2 * (size_t)total_tok * Hk * D), *v = host_alloc(2 * (size_t)total_tok * Hk * D);
        random_kv(&rng, k, total_tok, Hk, D, 1.0);
        random_kv(&rng, v, total_tok, Hk, D, 0.5);
        void *dk = dev_alloc(2 * (size_t)total_tok * Hk * D), *dv = dev_alloc(2 * (size_t)total_tok * Hk * D);
        void *ds = dev_alloc(sizeof(int64_t) * total_tok);
        void *dsrc = dev_alloc(sizeof(int32_t) * total_tiles), *ddst = dev_alloc(sizeof(int32_t) * total_tiles);
        CK(cudaMemcpy(dk, k, 2 * (size_t)total_tok * Hk * D, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dv, v, 2 * (size_t)total_tok * Hk * D, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(ds, slots, sizeof(int64_t) * total_tok, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dsrc, src, sizeof(int32_t) * total_tiles, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(ddst, dst, sizeof(int32_t) * total_tiles, cudaMemcpyHostToDevice));
        assert_int_equal(kvarn_cuda_store(&kv, KVARN_CUDA_F16, dk, dv, ds, total_tok, NULL), KVARN_OK);
        if (kvarn) assert_int_equal(kvarn_cuda_commit(&kv, dsrc, ddst, n_commit, NULL, NULL), KVARN_OK);
        CK(cudaDeviceSynchronize());
        uint8_t *blocks = host_alloc(arena);
        uint16_t *pages = kvarn ? host_alloc(pages_bytes) : NULL;
        CK(cudaMemcpy(blocks, kv.blocks, arena, cudaMemcpyDeviceToHost));
        if (kvarn) CK(cudaMemcpy(pages, kv.fp16_pages, pages_bytes, cudaMemcpyDeviceToHost));

        /* modes 4 and 5 are prefill chunks (32 or more queries in a
         * sequence: the tensor-core kernel where it serves) */
        const int chunk_want[S] = {1, 40, 70, 36, 2};
        int qlens_chunk[S], max_chunk = 0;
        int32_t lens32[S], qsl[S + 1], qsl_chunk[S + 1];
        qsl[0] = qsl_chunk[0] = 0;
        for (int s = 0; s < S; s++) {
            lens32[s] = lens[s];
            qlens_chunk[s] = chunk_want[s] < lens[s] ? chunk_want[s] : lens[s];
            max_chunk = qlens_chunk[s] > max_chunk ? qlens_chunk[s] : max_chunk;
            qsl[s + 1] = qsl[s] + qlens[s];
            qsl_chunk[s + 1] = qsl_chunk[s] + qlens_chunk[s];
        }
        const int total_q = qsl_chunk[S] > qsl[S] ? qsl_chunk[S] : qsl[S];
        float *q = host_alloc(sizeof(float) * total_q * Hq * D), *out = host_alloc(sizeof(float) * total_q * Hq * D);
        for (int i = 0; i < total_q * Hq * D; i++) q[i] = (float)test_rng_normal(&rng);
        void *dtab = dev_alloc(sizeof(int32_t) * S * MB), *dlens = dev_alloc(sizeof lens32);
        void *dcom = dev_alloc(sizeof committed), *dqsl = dev_alloc(sizeof qsl);
        void *dqsl_chunk = dev_alloc(sizeof qsl_chunk);
        float *dq = dev_alloc(sizeof(float) * total_q * Hq * D), *dout = dev_alloc(sizeof(float) * total_q * Hq * D);
        CK(cudaMemcpy(dtab, table, sizeof(int32_t) * S * MB, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dlens, lens32, sizeof lens32, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dcom, committed, sizeof committed, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dqsl, qsl, sizeof qsl, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dqsl_chunk, qsl_chunk, sizeof qsl_chunk, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dq, q, sizeof(float) * total_q * Hq * D, cudaMemcpyHostToDevice));
        /* learned sinks (attn.h kvarn_attn_opts.sinks): none on every third
         * head, else 1..5 (the scores' log-sum-exp is a few units) */
        float *sinks = host_alloc(sizeof(float) * Hq);
        for (int h = 0; h < Hq; h++) sinks[h] = h % 3 == 0 ? -INFINITY : (float)(h % 5) + 1.0f;
        float *dsinks = dev_alloc(sizeof(float) * Hq);
        CK(cudaMemcpy(dsinks, sinks, sizeof(float) * Hq, cudaMemcpyHostToDevice));

        /* mode 0: decode, no split; 1: decode, split-K, sinks; 2:
         * multi-query, sinks; 3: multi-query, sliding window, split-K; 4:
         * prefill chunks, sinks; 5: prefill chunks, sliding window, split-K
         * (4 and 5 where the tensor-core kernel serves the format) */
        for (int mode = 0; mode < 6; mode++) {
            const int multi = mode >= 2, window = mode == 3 || mode == 5 ? G + 7 : 0;
            const int with_sinks = mode == 1 || mode == 2 || mode == 4;
            const int chunk = mode >= 4;
            const int *ql = chunk ? qlens_chunk : qlens, *qs = chunk ? qsl_chunk : qsl;
            kvarn_cuda_attn_shape sh;
            memset(&sh, 0, sizeof sh);
            sh.num_seqs = S;
            sh.num_heads = Hq;
            sh.max_blocks_per_seq = MB;
            sh.max_seq_len = max_len;
            sh.max_query_len = chunk ? max_chunk : multi ? 5 : 1;
            sh.sliding_window = window;
            sh.softmax_scale = 1.0f / sqrtf((float)D);
            kvarn_cuda_attn_plan plan;
            assert_int_equal(kvarn_cuda_attn_plan_make(&kv, &sh, (mode & 1) ? 132 : 0, &plan), KVARN_OK);
            kvarn_cuda_attn_kernel_info info;
            assert_int_equal(kvarn_cuda_attn_kernel_info_get(&kv, &plan, &info), KVARN_OK);
            if (chunk && !info.matrix) continue; /* the vector kernel: modes 2 and 3 */
            if (chunk) assert_true(max_chunk >= 32);
            /* a multi-query call on the tensor cores for its sequences of
             * matrix_min_queries or more: bf16 operands
             * (kvarn_cuda_attn_kernel_info); the error bound below follows */
            const int bf16 = chunk && info.matrix_scores == KVARN_ATTN_ARITH_BF16 &&
                             info.matrix_sums == KVARN_ATTN_ARITH_BF16 && device_major() >= 8;
            double min_cos_m = 1.0, max_rel_m = 0.0; /* the tensor-core rows */
            int rows_m = 0;
            if ((mode & 1) && plan.num_splits == 1) { /* short contexts: split anyway */
                plan.num_splits = mode == 1 ? 3 : 5;
                plan.workspace_bytes = (size_t)S * Hk * plan.row_chunks * plan.num_splits * 8 * (D + 2) * 4;
            }
            assert_true((mode & 1) ? plan.num_splits > 1 : plan.num_splits == 1);
            void *ws = plan.workspace_bytes ? dev_alloc(plan.workspace_bytes) : NULL;
            kvarn_cuda_attn_args args = {dq, dout, dtab, dlens, kvarn ? dcom : NULL,
                                         multi ? (chunk ? dqsl_chunk : dqsl) : NULL,
                                         with_sinks ? dsinks : NULL};
            const int nq_rows = multi ? qs[S] : S;
            CK(cudaMemset(dout, 0xff, sizeof(float) * total_q * Hq * D)); /* NaN poison */
            assert_int_equal(kvarn_cuda_attention(&kv, &plan, &args, ws, plan.workspace_bytes, NULL), KVARN_OK);
            CK(cudaDeviceSynchronize());
            CK(cudaMemcpy(out, dout, sizeof(float) * nq_rows * Hq * D, cudaMemcpyDeviceToHost));

            double min_cos = 1.0, max_rel = 0.0, max_ratio = 0.0;
            double *qr = host_alloc(sizeof(double) * D), *o = host_alloc(sizeof(double) * D);
            double *kd = host_alloc(sizeof(double) * D), *vd = host_alloc(sizeof(double) * D);
            double *sc = host_alloc(sizeof(double) * max_len);
            for (int s = 0; s < S; s++) {
                const int nq = multi ? ql[s] : 1;
                const int on_mma = bf16 && nq >= info.matrix_min_queries;
                for (int j = 0; j < nq; j++) {
                    const int qi = multi ? qs[s] + j : s, pos = lens[s] - nq + j;
                    const int lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
                    for (int h = 0; h < Hq; h++) {
                        const int hk = h / (Hq / Hk);
                        for (int d = 0; d < D; d++) qr[d] = q[((size_t)qi * Hq + h) * D + d];
                        if (kvarn) fwht_d(qr, D);
                        const double sk = with_sinks ? sinks[h] : -INFINITY;
                        double mx = sk, sum = 0.0;
                        for (int p = lo; p <= pos; p++) {
                            ref_kv_at(&kv, blocks, pages, table + s * MB, committed[s], hk, p, 0, kd, vd);
                            double dot = 0.0;
                            for (int d = 0; d < D; d++) dot += qr[d] * kd[d];
                            sc[p] = dot / sqrt((double)D);
                            mx = sc[p] > mx ? sc[p] : mx;
                        }
                        for (int d = 0; d < D; d++) o[d] = 0.0;
                        if (sk != -INFINITY) sum = exp(sk - mx); /* the sink: no value */
                        for (int p = lo; p <= pos; p++) {
                            ref_kv_at(&kv, blocks, pages, table + s * MB, committed[s], hk, p, 0, kd, vd);
                            const double w = exp(sc[p] - mx);
                            sum += w;
                            for (int d = 0; d < D; d++) o[d] += w * vd[d];
                        }
                        for (int d = 0; d < D; d++) o[d] /= sum;
                        /* The tensor-core kernel: an oracle of its stated
                         * arithmetic (kvarn_cuda_attn_kernel_info) and a bound */
                        double err_rot = 0.0, bound_rot = 0.0;
                        if (on_mma)
                            bf16_oracle(&kv, blocks, pages, table + s * MB, committed[s], hk, lo, pos,
                                        q + ((size_t)qi * Hq + h) * D, sh.softmax_scale,
                                        with_sinks ? sinks[h] : -INFINITY,
                                        out + ((size_t)qi * Hq + h) * D, &err_rot, &bound_rot);
                        if (kvarn) fwht_d(o, D);
                        const float *g = out + ((size_t)qi * Hq + h) * D;
                        double dot = 0.0, ng = 0.0, nr = 0.0, ne = 0.0;
                        for (int d = 0; d < D; d++) {
                            dot += g[d] * o[d];
                            ng += (double)g[d] * g[d];
                            nr += o[d] * o[d];
                            ne += (g[d] - o[d]) * (g[d] - o[d]);
                        }
                        assert_true(nr > 0.0); /* never compare zeros */
                        const double cosv = ng > 0.0 ? dot / sqrt(ng * nr) : 0.0;
                        const double rel = isfinite(ne) ? sqrt(ne / nr) : INFINITY;
                        if (on_mma) {
                            const double ratio = err_rot / bound_rot;
                            max_ratio = !(ratio <= max_ratio) ? ratio : max_ratio;
                            min_cos_m = cosv < min_cos_m || cosv != cosv ? cosv : min_cos_m;
                            max_rel_m = !(rel <= max_rel_m) ? rel : max_rel_m;
                            rows_m++;
                        } else {
                            min_cos = cosv < min_cos || cosv != cosv ? cosv : min_cos;
                            max_rel = !(rel <= max_rel) ? rel : max_rel;
                        }
                    }
                }
            }
            if (mode == 1) { /* the same call captured in a CUDA graph: bit-identical output */
                float *again = host_alloc(sizeof(float) * nq_rows * Hq * D);
                cudaStream_t st;
                cudaGraph_t graph;
                cudaGraphExec_t exec;
                CK(cudaStreamCreate(&st));
                CK(cudaMemset(dout, 0xff, sizeof(float) * total_q * Hq * D));
                CK(cudaDeviceSynchronize());
                CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
                kvarn_status cs = kvarn_cuda_attention(&kv, &plan, &args, ws, plan.workspace_bytes, st);
                CK(cudaStreamEndCapture(st, &graph));
                assert_int_equal(cs, KVARN_OK);
                CK(cudaGraphInstantiate(&exec, graph, 0));
                CK(cudaGraphLaunch(exec, st));
                CK(cudaStreamSynchronize(st));
                CK(cudaMemcpy(again, dout, sizeof(float) * nq_rows * Hq * D, cudaMemcpyDeviceToHost));
                assert_memory_equal(again, out, sizeof(float) * nq_rows * Hq * D);
                CK(cudaGraphExecDestroy(exec));
                CK(cudaGraphDestroy(graph));
                CK(cudaStreamDestroy(st));
                free(again);
            }
            print_message("%s D=%d Hq=%d Hk=%d mode %d (splits %d): min cosine %.7f, max rel err %.2e\n",
                          c->name, D, Hq, Hk, mode, plan.num_splits, min_cos, max_rel);
            assert_true(min_cos >= 0.9999);
            assert_true(max_rel < 1e-3);
            if (bf16) {
                print_message("  %d rows on the tensor cores: min cosine %.7f, max rel err %.2e "
                              "against the exact reference; max err / bound %.3f against the "
                              "oracle of its arithmetic\n", rows_m, min_cos_m, max_rel_m, max_ratio);
                assert_true(rows_m > 0);
                assert_true(max_ratio <= 1.0);
            }
            free(qr); free(o); free(kd); free(vd); free(sc);
            if (ws) CK(cudaFree(ws));
        }
        free(ids); free(bids); free(table); free(slots); free(src); free(dst); free(k); free(v);
        free(blocks); free(pages); free(q); free(out); free(sinks);
        CK(cudaFree(dsinks));
        CK(cudaFree(dk)); CK(cudaFree(dv)); CK(cudaFree(ds)); CK(cudaFree(dsrc)); CK(cudaFree(ddst));
        CK(cudaFree(dtab)); CK(cudaFree(dlens)); CK(cudaFree(dcom)); CK(cudaFree(dqsl));
        CK(cudaFree(dqsl_chunk));
        CK(cudaFree(dq)); CK(cudaFree(dout)); CK(cudaFree(kv.blocks));
        if (kvarn) CK(cudaFree(kv.fp16_pages));
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_supports),
        cmocka_unit_test(test_check_kv),
        cmocka_unit_test(test_plan),
        cmocka_unit_test(test_arguments),
        cmocka_unit_test(test_gpu_store_per_token),
        cmocka_unit_test(test_gpu_store_commit_kvarn),
        cmocka_unit_test(test_gpu_attention),
    };
    if (getenv("KVARN_TEST_FILTER")) cmocka_set_test_filter(getenv("KVARN_TEST_FILTER"));
    int fails = cmocka_run_group_tests(tests, NULL, NULL);
    /* The host checks passed but the device ones skipped: say so to ctest. */
    return fails == 0 && !have_gpu() ? TEST_SKIPPED : fails;
}

#else /* !KVARN_HAVE_CUDA */

static void test_cuda_not_built(void **state)
{
    (void)state;
    print_message("built without the CUDA backend (KVARN_CUDA=OFF or no nvcc): skipped\n");
    skip();
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_cuda_not_built)};
    int fails = cmocka_run_group_tests(tests, NULL, NULL);
    return fails == 0 ? TEST_SKIPPED : fails;
}

#endif
