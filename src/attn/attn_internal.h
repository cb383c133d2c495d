/*
 * attn_internal.h -- what the attention driver (attn.c, attn_check.c,
 * attn_plan.c, attn_dispatch.c), the thread pool and the per-ISA tile
 * kernels (kernel_ref.c, kernel_avx2.c, the kernel_avx512*.c files) share.
 * Not part of the public contract.
 */
#ifndef KVARN_ATTN_INTERNAL_H
#define KVARN_ATTN_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "codec/hadamard.h"
#include "kvarn/attn.h"
#include "kvarn/kvarn.h"
#include "kvarn/paged.h"
#include "kvarn/record.h"

/* ---- thread pool (thread_pool.c) ---- */

/* One task: index in [0, n_tasks), worker in [0, pool size). */
typedef void (*attn_task_fn)(void *ctx, int task, int worker);

/* Run fn for every task index on the pool's workers and the calling thread;
 * returns when all are done. pool NULL: all on the calling thread. */
void attn_pool_run(kvarn_thread_pool *pool, attn_task_fn fn, void *ctx, int n_tasks);

/* Bytes kvarn_thread_pool_create_ex(n_threads, allocator, ...) takes from
 * its allocator (the pool and its thread table; the threads' stacks are the
 * C library's, alloc.h); 0 for n_threads outside [1, 256]. For the memory
 * plans of the objects that own a pool (kvarn_llama_session_plan). */
size_t kvarn__thread_pool_bytes(int n_threads);

/* ---- software prefetch of the next tiles ----
 * Records of consecutive tiles sit anywhere in the arena (shuffled block
 * ids), so the hardware prefetcher restarts at every block. The driver
 * lists the next tiles; the kernels issue a few prefetches per step of
 * their score loop (AVX-512: and of their V loop; attn_prefetch_step),
 * spreading the misses over the computation instead of stalling on a
 * burst. */
#define ATTN_PREFETCH_MAX 128
typedef struct attn_prefetch {
    const uint8_t *base[ATTN_PREFETCH_MAX]; /* tiles to fetch */
    int n;                                  /* tiles listed */
    int lines;                              /* 64-byte lines per tile */
    int tile, line;                         /* cursor */
} attn_prefetch;

/* Issue up to k prefetches from the cursor: attn_prefetch_step into every
 * cache level (prefetcht0), attn_prefetch_step_l2 into L2 and below
 * (prefetcht1; the AVX-512 KVarN int16 loops, kernel_avx512_kvarn.c). */
#define ATTN_PREFETCH_STEP_FN(NAME, LOCALITY)                                      \
    static inline void NAME(attn_prefetch *p, int k)                               \
    {                                                                              \
        while (k-- > 0 && p->tile < p->n) {                                        \
            __builtin_prefetch(p->base[p->tile] + (size_t)p->line * 64, 0, LOCALITY); \
            if (++p->line == p->lines) {                                           \
                p->line = 0;                                                       \
                p->tile++;                                                         \
            }                                                                      \
        }                                                                          \
    }
ATTN_PREFETCH_STEP_FN(attn_prefetch_step, 3)
ATTN_PREFETCH_STEP_FN(attn_prefetch_step_l2, 2)
#undef ATTN_PREFETCH_STEP_FN

/* Lines to list per record of `bytes` bytes (> 0), and the address to list
 * for a record at rec. Records on 64-byte lines (line_aligned != 0: the
 * arena and both strides multiples of 64, as kvarn_cache's are) are listed
 * as they are; else every record is listed from the start of the line
 * holding its first byte, one line more, so that the line holding its last
 * bytes is fetched too (KVarN: V b_t, which the kernel reads first thing).
 * The listed address is formed as an integer: it may lie before the arena,
 * and a prefetch never faults. */
static inline int attn_prefetch_lines(size_t bytes, int line_aligned)
{
    return (int)((bytes + 63) / 64) + (line_aligned ? 0 : 1);
}
static inline const uint8_t *attn_prefetch_base(const uint8_t *rec, int line_aligned)
{
    return line_aligned ? rec : (const uint8_t *)((uintptr_t)rec & ~(uintptr_t)63);
}

/* Lines still to issue. */
static inline int attn_prefetch_left(const attn_prefetch *p)
{
    return p->tile >= p->n ? 0 : (p->n - p->tile) * p->lines - p->line;
}

/* attn_rows.qa_ready's values. */
enum { ATTN_QA_NONE = 0, ATTN_QA_INT8 = 1, ATTN_QA_BF16 = 2, ATTN_QA_BF16X2 = 3 };

/* ---- the running state of one work item ----
 * n query rows (row = one query token of one query head of the GQA group)
 * against one KV head. The kernels process one tile at a time: scores into
 * s, then the online-softmax update (m, l, acc rescale, s becomes the
 * weights p), then acc += p . V. acc stays in the kernel's basis (rotated
 * for KVarN) and in natural channel order. */
typedef struct attn_rows {
    int n;              /* rows */
    int D;              /* head_dim */
    int G;              /* tokens per tile */
    int gs;             /* row stride of s: the longest span of tokens one
                           kernel call takes, rounded up to a multiple of 8 */
    const float *q;     /* [n][D] query * softmax_scale (rotated for KVarN) */
    const float *qsum;  /* [n] sum_d q[r][d] (per-token zero-point folding) */
    const int32_t *lo;  /* [n] first visible position of each row */
    const int32_t *hi;  /* [n] last visible position (hi < lo: none) */
    float *acc;         /* [n][D] unnormalized output */
    float *m;           /* [n] running max score (-inf before any token) */
    float *l;           /* [n] running sum of exp(score - m) */
    float *qa;          /* scratch [n][D] (query with a_d folded in) */
    int qa_ready;       /* what qa holds for the rest of the item, set by
                           the kernel that wrote it (0 from rows_of, per
                           item: nothing): ATTN_QA_INT8 the AVX-512 int8
                           kernel's rounded query, ATTN_QA_BF16 /
                           ATTN_QA_BF16X2 the matrix kernels' bf16
                           query (kernel_amx.c rows_query: the records'
                           and the per-token spans') */
    float *s;           /* scratch [n][gs] scores, then weights */
    float *rc;          /* scratch [n] a per-row constant */
    float *psum;        /* [n] each row's sum of the last tile's softmax
                           weights (the tile's term of l), written by every
                           online-softmax update; the driver reads it after
                           a mean-centred record (attn.c add_value_means) */
    float *meta;        /* scratch: 3D + 4gs floats of tile metadata */
    const uint8_t **tok; /* scratch [gs] per-token record pointers */
    attn_prefetch *pf;   /* the next tiles to prefetch while this one runs */
    uint16_t *mat;       /* scratch for the matrix kernel, bf16: a tile's
                            codes unpacked [2][D][G], then the rows' folded
                            queries [rows][D] and weights [rows][G]
                            (rows: the row arrays' length, a multiple of
                            16), and for the int8 format's blocks the
                            weights' second bf16 halves after them, of the
                            same shape (per-token spans keep their query
                            in qa: kernel_amx.c token_span); the AVX-512
                            KVarN kernel's packed code vectors of a tile
                            (3 D G bytes, kernel_avx512_kvarn.c kv_pack_k,
                            kv_pack_v); the vector kernels' fp32 codes of
                            a per-token span or fp16 page, [2][D][up to
                            attn_token_matrix_span(gs)] floats
                            (kernel_avx2.c tm_span, kernel_avx512.h
                            tm_span_f32; every format kind's calls of 16
                            rows or more, attn_plan.c), so no kernel may keep anything
                            there across a tile kernel's call; NULL where the call's geometry takes none
                            (attn_matrix_geometry) */
    uint8_t *x8;         /* scratch for the AVX-512 int8 and int4
                            integer path (kernel_avx512_int8.c; parts:
                            I8_X8_KT, I8_X8_WIDE): NULL where the call
                            reads no int8 or int4 records, or D > 256
                            (attn_plan.c) */
} attn_rows;

/* Row i's visible positions within a span of nt tokens starting at
 * position t0, as span offsets [*a, *b) (lo[i] .. hi[i] clipped to the
 * span). Returns 0 when none is visible (then *a >= *b). */
static inline int attn_row_visible(const attn_rows *r, int i, int t0, int nt, int *a, int *b)
{
    int lo = r->lo[i] - t0, hi = r->hi[i] - t0 + 1;
    if (lo < 0) lo = 0;
    if (hi > nt) hi = nt;
    *a = lo;
    *b = hi;
    return lo < hi;
}

/* ---- tile kernels ----
 * t0: position of the tile's first token; nt: tokens present in the tile
 * (1..G; G for committed KVarN records). */

/* fp16 page: K, V fp16 [G][D] token-major (only the first nt read). */
typedef void (*attn_fp16_tile_fn)(attn_rows *r, const uint16_t *k, const uint16_t *v,
                                  int t0, int nt);
/* A tile record (KVarN, record.h), nt = G. */
typedef void (*attn_record_tile_fn)(attn_rows *r, const kvarn_record_layout *L,
                                    const uint8_t *rec, int t0, int nt);
/* Per-token records: a span of nt consecutive tokens (one or more blocks),
 * token j's record at rec[j] (nt <= gs). */
typedef void (*attn_token_tile_fn)(attn_rows *r, const kvarn_record_layout *L,
                                   const uint8_t *const *rec, int t0, int nt);

/* The matrix kernel of KVarN records (kernel_amx.c): prefill chunks and
 * verification, items of at least ATTN_MATRIX_MIN_ROWS rows, on AMX-BF16
 * tiles; fallback is the level's record kernel, which it runs instead for
 * a tile outside its conditions (kernel_amx.c). */
typedef void (*attn_matrix_tile_fn)(attn_rows *r, const kvarn_record_layout *L,
                                    const uint8_t *rec, int t0, int nt,
                                    attn_record_tile_fn fallback);
#define ATTN_MATRIX_MIN_ROWS 16
/* The AVX-512 KVarN kernel forms a tile's code vectors once for items of
 * at least this many rows (kernel_avx512_kvarn.c kv_pack_k, kv_pack_v: in
 * r->mat, there from ATTN_MATRIX_MIN_ROWS rows). Measured there: below it
 * the packing costs more than it saves. */
#define ATTN_PACK_MIN_ROWS 40
_Static_assert(ATTN_PACK_MIN_ROWS >= ATTN_MATRIX_MIN_ROWS, "r->mat exists from ATTN_MATRIX_MIN_ROWS rows");
/* The vector kernels convert a per-token span's (or fp16 page's) codes to
 * fp32 once, K channel-major, for items of at least this many rows
 * (kernel_avx2.c tm_span, kernel_avx512.h tm_span_f32; in r->mat).
 * Measured (docs/attention-simd.md): 6 queries in GQA groups of 3 and 4
 * (18 and 24 rows) gain from it already. */
#define ATTN_SPAN_F32_MIN_ROWS 16
_Static_assert(ATTN_SPAN_F32_MIN_ROWS >= ATTN_MATRIX_MIN_ROWS, "r->mat exists from ATTN_MATRIX_MIN_ROWS rows");
/* The staged tokens of a KVarN view take the matrix kernel in items of at
 * least this many query tokens (prefill chunks: 512 rows / the GQA group,
 * 32 or more up to a group of 16), not in verification's 1 + K: there the
 * staged tail holds most of the attention, and the int16 kernel's query
 * (2^-16 of the row's largest) keeps verification as close to plain decode
 * as before (test_spec_decode's near-tie rule; one bf16, 2^-8, moved a
 * k4v4_g64 run past it). */
#define ATTN_STAGED_MATRIX_MIN_QUERIES 32
_Static_assert(ATTN_STAGED_MATRIX_MIN_QUERIES >= ATTN_MATRIX_MIN_ROWS,
               "attn.c staged_tile: the query count implies the matrix kernel's rows");
#define ATTN_MATRIX_MAX_D 512
#define ATTN_MATRIX_MAX_G 128
/* The geometries the matrix kernel takes: head_dim D a multiple of 32 up
 * to ATTN_MATRIX_MAX_D, tiles of G tokens a multiple of 32 (KVarN's 32, 64
 * and 128). The one statement of it (attn_plan.c's geometry, attn_dispatch.c's kernels and kernel info). */
/* The per-token kinds whose codes are exact in bf16 (fp8 E4M3 and E5M2,
 * bf16): the matrix kernels take their blocks uncentred (kernel_amx.c
 * token_tile_fp8_*, _bf16; attn_dispatch.c picks them, attn_plan.c sizes
 * their scratch). */
static inline int attn_kind_bf16_exact(kvarn_kind k)
{
    return k == KVARN_KIND_FP8_E4M3 || k == KVARN_KIND_FP8_E5M2 || k == KVARN_KIND_BF16;
}

static inline int attn_matrix_geometry(int D, int G)
{
    return D % 32 == 0 && D <= ATTN_MATRIX_MAX_D && G % 32 == 0 && G >= 32 && G <= ATTN_MATRIX_MAX_G;
}
void attn_amx_kvarn_tile(attn_rows *r, const kvarn_record_layout *L, const uint8_t *rec, int t0,
                         int nt, attn_record_tile_fn fallback);
/* The same products over per-token int8 or int4 records (kernel_amx.c:
 * a KVarN view's staged tokens, the int4 and int8 formats' blocks; below,
 * the fp8 and bf16 formats'), token j's
 * record at rec[j], nt <= gs, in spans of attn_token_matrix_span(gs);
 * fallback (the level's token kernel) runs a span outside its
 * conditions. */
typedef void (*attn_token_matrix_fn)(attn_rows *r, const kvarn_record_layout *L,
                                     const uint8_t *const *rec, int t0, int nt,
                                     attn_token_tile_fn fallback);
/* Tokens per span of the per-token matrix kernel for a call whose scores
 * have row stride gs: a multiple of 32 up to ATTN_MATRIX_MAX_G (0: none;
 * attn_plan.c sizes its scratch by it). */
static inline int attn_token_matrix_span(int gs)
{
    const int g = gs & ~31;
    return g < ATTN_MATRIX_MAX_G ? g : ATTN_MATRIX_MAX_G;
}
void attn_amx_token_tile(attn_rows *r, const kvarn_record_layout *L, const uint8_t *const *rec,
                         int t0, int nt, attn_token_tile_fn fallback);
void attn_amxemu_token_tile(attn_rows *r, const kvarn_record_layout *L,
                            const uint8_t *const *rec, int t0, int nt,
                            attn_token_tile_fn fallback);
/* The same with the query and the weights as two bf16 each
 * (KVARN_ATTN_ARITH_BF16X2): the int8 format's blocks; its scratch
 * (attn_plan.c) holds the second halves too. */
void attn_amx_token_tile_x2(attn_rows *r, const kvarn_record_layout *L, const uint8_t *const *rec,
                            int t0, int nt, attn_token_tile_fn fallback);
void attn_amxemu_token_tile_x2(attn_rows *r, const kvarn_record_layout *L,
                               const uint8_t *const *rec, int t0, int nt,
                               attn_token_tile_fn fallback);
/* The same products over the fp8 (E4M3, E5M2) and bf16 formats' blocks
 * (their codes exact in bf16; KVARN_ATTN_ARITH_BF16 as for int4), with
 * the tiles and emulated. */
void attn_amx_token_tile_fp8_e4m3(attn_rows *r, const kvarn_record_layout *L,
                                  const uint8_t *const *rec, int t0, int nt,
                                  attn_token_tile_fn fallback);
void attn_amx_token_tile_fp8_e5m2(attn_rows *r, const kvarn_record_layout *L,
                                  const uint8_t *const *rec, int t0, int nt,
                                  attn_token_tile_fn fallback);
void attn_amx_token_tile_bf16(attn_rows *r, const kvarn_record_layout *L,
                              const uint8_t *const *rec, int t0, int nt,
                              attn_token_tile_fn fallback);
void attn_amxemu_token_tile_fp8_e4m3(attn_rows *r, const kvarn_record_layout *L,
                                     const uint8_t *const *rec, int t0, int nt,
                                     attn_token_tile_fn fallback);
void attn_amxemu_token_tile_fp8_e5m2(attn_rows *r, const kvarn_record_layout *L,
                                     const uint8_t *const *rec, int t0, int nt,
                                     attn_token_tile_fn fallback);
void attn_amxemu_token_tile_bf16(attn_rows *r, const kvarn_record_layout *L,
                                 const uint8_t *const *rec, int t0, int nt,
                                 attn_token_tile_fn fallback);
/* The same with the tiles emulated in C (kernel_amx_emu.c): any CPU. */
void attn_amxemu_kvarn_tile(attn_rows *r, const kvarn_record_layout *L, const uint8_t *rec,
                            int t0, int nt, attn_record_tile_fn fallback);

/* The kernels one attention call runs, picked from the tables of
 * kernel_table.c for its format kind, head_dim and SIMD level
 * (attn_select_kernels). kvarn_tile is set for per-tile kinds, token_tile
 * for per-token kinds, the other one is NULL. */
typedef struct attn_kernels {
    const char *name;                 /* the SIMD level's name ("avx2") */
    attn_fp16_tile_fn fp16_tile;
    attn_record_tile_fn kvarn_tile;
    attn_token_tile_fn token_tile;
    attn_matrix_tile_fn kvarn_matrix; /* NULL: none (attn_dispatch.c attn_pick_kernels) */
    attn_token_matrix_fn token_matrix; /* per-token records: a KVarN view's
                                          int8/int4 staging, the int4, int8,
                                          fp8 and bf16 formats' blocks;
                                          NULL: none */
} attn_kernels;

/* Row-block dispatch of the SIMD kernels: CALL(R) with R = rb as a
 * compile-time constant, for rb in 1..6 (AVX2, and the AVX-512 kernels whose
 * register budget allows 6 rows) or 1..8 (the other AVX-512 kernels);
 * rb < 1 takes 1. */
#define ATTN_RB_SWITCH6(rb, CALL)          \
    switch (rb) {                          \
    case 6: CALL(6); break;                \
    case 5: CALL(5); break;                \
    case 4: CALL(4); break;                \
    case 3: CALL(3); break;                \
    case 2: CALL(2); break;                \
    default: CALL(1); break;               \
    }

#define ATTN_RB_SWITCH8(rb, CALL)          \
    switch (rb) {                          \
    case 8: CALL(8); break;                \
    case 7: CALL(7); break;                \
    default: ATTN_RB_SWITCH6(rb, CALL)     \
    }

/* SIMD levels, indexed by kvarn_cpu_level (common/cpu.h). */
#define ATTN_LEVELS 3

/* One SIMD level: its name, the head_dim multiple its kernels need, its
 * fp16 page kernel (every kind's sink and tail pages). */
typedef struct attn_level_row {
    const char *name;
    int head_dim_multiple;
    attn_fp16_tile_fn fp16_tile;
} attn_level_row;

/* The arithmetic of a kind's kernel at one level (kvarn_attn_kernel_info,
 * attn.h): *scores for q.k, *sums for p.v, for a format of the kind at
 * head_dim D; vnni: the level's VNNI build runs (AVX-512 only). */
typedef void (*attn_arith_fn)(const kvarn_format *fmt, int D, int vnni,
                              kvarn_attn_arith *scores, kvarn_attn_arith *sums);

/* The attention half of a format kind's row (the codec half is
 * src/codec/format_kinds.h): its tile kernel per SIMD level (index
 * kvarn_cpu_level), token_tile for per-token kinds, record_tile for
 * per-tile kinds. The scalar entry is mandatory; NULL at a higher level
 * means that level has no kernel of its own for the kind and runs the next
 * lower level's; arith likewise per level: the arithmetic of that level's
 * kernel for a format and head_dim. */
typedef struct attn_kind_row {
    kvarn_kind kind;                  /* the row's own index */
    attn_token_tile_fn token_tile[ATTN_LEVELS];
    attn_record_tile_fn record_tile[ATTN_LEVELS];
    attn_arith_fn arith[ATTN_LEVELS]; /* NULL: fp32 products and sums (the
                                         reference's, in another order) */
} attn_kind_row;

/* When the AVX-512 kernels multiply in integers (kernel_avx512_kvarn.c and
 * kernel_avx512_int8.c run their integer loops exactly under these,
 * kernel_table.c reports them): the one statement of those conditions.
 *   KVarN K (kv_kdots4_128_i16): 4-bit codes of 128-token tiles, D <= 256
 *     (int32 sums of D products stay exact); at run time a tile keeps fp32
 *     for all its rows where any row's max |q_d a_d| is below 2^-100, and
 *     runs the AVX2 kernel (both halves fp32) where any |q_d a_d| >= 2^80
 *     (2- and 4-bit K).
 *   KVarN V (kv_vsum2_i16): 2-bit codes of 128-token tiles, D % 64 == 0
 *     (64 channels a pass); the VNNI build's weights are u8 (kv_vsum2_u8)
 *     where every a_t of the tile is >= 0.
 *   int8 per-token K and V (token_int_body): D <= 256 and spans of at most
 *     256 tokens (exact int32 sums); the VNNI build's K is vpdpbusd on
 *     int8 digits where D % 64 == 0 (i8v_kdots16).
 *   int4 per-token K and V (token_int_body): the int8 conditions, on the
 *     codes widened to bytes 16 c + 8 (i4_widen). */
/* The longest span the int8 kernel's integer path takes (and the int4
 * path's widened codes hold: attn_rows.x8). */
#define I8_SPAN_MAX 256
/* attn_rows.x8's parts (byte offsets): a span's record pointers
 * [I8_SPAN_MAX], then the VNNI build's K codes transposed once per span
 * (kernel_avx512_int8.c i8v_transpose_span: I8_SPAN_MAX D bytes), then
 * the int4 codes widened to bytes ([nt][2][D], i4_widen; int4 records
 * only). */
#define I8_X8_KT ((size_t)I8_SPAN_MAX * sizeof(void *))
#define I8_X8_WIDE(D) (I8_X8_KT + (size_t)I8_SPAN_MAX * (size_t)(D))
static inline int attn_avx512_kvarn_k_int16(int key_bits, int tile_tokens, int D)
{
    return key_bits == 4 && tile_tokens == 128 && D <= 256;
}
static inline int attn_avx512_kvarn_v_int16(int value_bits, int tile_tokens, int D)
{
    return value_bits == 2 && tile_tokens == 128 && D % 64 == 0;
}
static inline int attn_avx512_int8_int16(int D, int span_tokens)
{
    return D <= 256 && span_tokens <= I8_SPAN_MAX;
}
static inline int attn_avx512_int8_vnni_k(int D) { return D % 64 == 0; }

/* The row of a SIMD level (NULL outside [0, ATTN_LEVELS)) and of a kind
 * (NULL outside [0, KVARN_KIND_COUNT)); kernel_table.c. */
const attn_level_row *attn_level_row_of(int level);
const attn_kind_row *attn_kind_row_of(kvarn_kind kind);

/* Fill *out with the kernels of `row` for head_dim D at the highest SIMD
 * level <= top whose head_dim multiple divides D; each entry NULL at that
 * level is taken from the next lower level that has one. Returns the level
 * picked (out->name is its name). */
int attn_select_kernels_from(const attn_kind_row *row, int head_dim, int top,
                             attn_kernels *out);
/* The arithmetic of the kernel attn_select_kernels_from picks from `row`
 * for fmt at head_dim D under top (the level its kernel comes from, NULL
 * arith: fp32); vnni as for attn_arith_fn. */
void attn_select_arith_from(const attn_kind_row *row, const kvarn_format *fmt, int head_dim,
                            int top, int vnni, kvarn_attn_arith *scores,
                            kvarn_attn_arith *sums);
/* The same for kind's row of the table. Returns -1 (out untouched) for a
 * kind with no row. */
int attn_select_kernels(kvarn_kind kind, int head_dim, int top, attn_kernels *out);

/* The entry points each kernel file exports to the tables (LV: ref, avx2,
 * avx512); one token kernel per per-token kind, one record kernel for
 * KVarN (specialized inside on the bit widths). */
#define ATTN_DECLARE_KERNELS(LV)                                                         \
    void attn_##LV##_fp16_tile(attn_rows *r, const uint16_t *k, const uint16_t *v,       \
                               int t0, int nt);                                          \
    void attn_##LV##_kvarn_tile(attn_rows *r, const kvarn_record_layout *L,              \
                                const uint8_t *rec, int t0, int nt);                     \
    ATTN_DECLARE_TOKEN(LV, fp16) ATTN_DECLARE_TOKEN(LV, bf16)                            \
    ATTN_DECLARE_TOKEN(LV, fp8_e4m3) ATTN_DECLARE_TOKEN(LV, fp8_e5m2)                    \
    ATTN_DECLARE_TOKEN(LV, int8) ATTN_DECLARE_TOKEN(LV, int4)
#define ATTN_DECLARE_TOKEN(LV, KIND)                                                     \
    void attn_##LV##_token_##KIND(attn_rows *r, const kvarn_record_layout *L,            \
                                  const uint8_t *const *rec, int t0, int nt);
/* Scalar reference kernels (kernel_ref.c): the oracle and the fallback. */
ATTN_DECLARE_KERNELS(ref)
/* AVX2/FMA/F16C kernels (kernel_avx2.c); they need D % 16 == 0. */
ATTN_DECLARE_KERNELS(avx2)
/* AVX-512 F/BW/VL (+FMA/F16C) kernels (kernel_avx512.c, KVarN:
 * kernel_avx512_kvarn.c, int8 and int4: kernel_avx512_int8.c); they need
 * D % 32 == 0 (KVarN tiles of a length not a multiple of 32 go to the AVX2
 * kernel). */
ATTN_DECLARE_KERNELS(avx512)
#undef ATTN_DECLARE_KERNELS
#undef ATTN_DECLARE_TOKEN
/* The AVX-512 KVarN record kernel built with AVX512-VNNI
 * (kernel_avx512_vnni.c, from kernel_avx512_kvarn.c): same contract and
 * results as attn_avx512_kvarn_tile; only on CPUs with VNNI
 * (kvarn__cpu_avx512_vnni). */
void attn_avx512vnni_kvarn_tile(attn_rows *r, const kvarn_record_layout *L, const uint8_t *rec,
                                int t0, int nt);
/* The AVX-512 int8 per-token kernel built with AVX512-VNNI (the same file,
 * from kernel_avx512_int8.c; its int16 dot products are vpdpwssd): same
 * contract and the same bits as attn_avx512_token_int8; only on CPUs with
 * VNNI. */
void attn_avx512vnni_token_int8(attn_rows *r, const kvarn_record_layout *L,
                                const uint8_t *const *rec, int t0, int nt);
/* The same for the int4 per-token kernel (attn_avx512_token_int4: the
 * int8 kernel's loops over the codes widened to bytes). */
void attn_avx512vnni_token_int4(attn_rows *r, const kvarn_record_layout *L,
                                const uint8_t *const *rec, int t0, int nt);

/* The AVX-512 fp8 (E4M3, E5M2) and bf16 per-token kernels with the spans
 * of items of ATTN_SPAN_F32_MIN_ROWS rows or more on AVX512-BF16 (kernel_avx512_bf16.c: vdpbf16ps against a bf16 query and
 * bf16 weights); the fp32 path (attn_avx512_token_*) otherwise. Only on
 * CPUs with AVX512-BF16 (kvarn__cpu_avx512_bf16). */
void attn_avx512bf16_token_fp8_e4m3(attn_rows *r, const kvarn_record_layout *L,
                                    const uint8_t *const *rec, int t0, int nt);
void attn_avx512bf16_token_fp8_e5m2(attn_rows *r, const kvarn_record_layout *L,
                                    const uint8_t *const *rec, int t0, int nt);
void attn_avx512bf16_token_bf16(attn_rows *r, const kvarn_record_layout *L,
                                const uint8_t *const *rec, int t0, int nt);

/* Scalar online-softmax step shared by the reference kernels: mask s[r][t]
 * to the row's visible positions, update m and l, rescale acc, and turn s
 * into the weights exp(s - m). */
void attn_softmax_update_ref(attn_rows *r, int t0, int nt);

/* ---- one attention call ----
 * attn.c runs it (the entry points, the loop over the tiles of a work
 * item, the split-K merge); attn_check.c checks its arguments;
 * attn_plan.c sizes its workspace and plans its work items;
 * attn_dispatch.c picks its kernels. */

#define ATTN_ALIGN_F 16 /* floats: 64-byte alignment of every scratch array */

/* n floats rounded up to ATTN_ALIGN_F. */
static inline size_t attn_round_f(size_t n)
{
    return (n + ATTN_ALIGN_F - 1) / ATTN_ALIGN_F * ATTN_ALIGN_F;
}

/* One work item: the query block of one sequence against one KV head,
 * or one split-K chunk of it (attn_plan). */
typedef struct attn_item {
    int seq, kvh;
    int q0, nq;            /* queries [q0, q0 + nq) of the sequence's chunk */
    int tile0, tile1;      /* tiles [tile0, tile1) this item reads */
    int chunk, n_chunks;   /* split-K: this chunk of n_chunks */
    size_t partial;        /* split: float offset of its (m, l, acc) rows */
} attn_item;

/* The geometry of a call and the bounds of its workspace (attn_make_geom). */
typedef struct attn_geom {
    int D, G, Hk, Hq, group, qblock, rows_max;
    int qblock_few;        /* queries of an item where a call has few
                              (attn_plan.c ROWS_FEW), <= qblock */
    int rows_alloc;        /* rows of each per-row scratch array: rows_max,
                              rounded up to whole blocks of 16 where the
                              matrix kernel may run (its tiles take 16) */
    int span_tiles;        /* tiles per kernel call (per-token formats) */
    int gs;                /* row stride of the scores: span tokens, rounded */
    int is_kvarn;
    size_t thread_floats;  /* per-worker scratch */
    size_t mat_floats;     /* its part for the matrix kernel and the
                              vector kernels' fp32 span codes (r->mat;
                              0: none) */
    size_t x8_floats;      /* its part for the int8 / int4 integer path
                              (attn_rows.x8; 0: none) */
    size_t tail_floats;    /* its last part: K and V fp16 [G][D] of a tail
                              tile gathered from small tail pages (0 when the
                              view has none) */
    size_t max_items, max_groups, partial_floats;
    size_t ws_bytes;       /* the whole workspace a call needs */
} attn_geom;

/* One call: its arguments, geometry, kernels and carved workspace; its
 * tasks (attn.c item_task, merge_task) read it and write only their own
 * outputs. */
typedef struct attn_run {
    const kvarn_paged_kv *kv;
    const kvarn_seq_view *seqs;
    const int32_t *qsl;        /* NULL: decode (one query per sequence) */
    const float *q;
    float *out;
    float *lse;                /* NULL, or [total_q][Hq] log-sum-exp */
    kvarn_attn_opts o;
    attn_geom g;
    kvarn_record_layout L;
    const attn_kernels *kern;  /* &kern_set */
    attn_kernels kern_set;
    /* Staging as records (paged.h "Staging"): the token kernels and record
     * layout of the staging's per-token format, which read the staged
     * tokens */
    attn_kernels stage_set;
    kvarn_record_layout Ls;
    int staged;                /* 1: staged tokens are records (stage_set) */
    kvarn_hadamard_fn rotate;  /* KVarN: the query's and output's rotation
                                  (kvarn__hadamard_pick, once a call) */
    float *thread_scratch;
    attn_item *items;
    int n_items;
    int *groups;               /* split: index of each group's first chunk */
    int n_groups;
    float *partials;
} attn_run;

/* The first query of sequence s in the call's query array, and its count. */
static inline int attn_q_start(const attn_run *run, int s) { return run->qsl ? run->qsl[s] : s; }
static inline int attn_q_len(const attn_run *run, int s)
{
    return run->qsl ? run->qsl[s + 1] - run->qsl[s] : 1;
}

/* Visible positions [lo, hi] of query qi (of ql) of a sequence. */
static inline void attn_query_limits(const attn_run *run, int seq_len, int ql, int qi,
                                     int32_t *lo, int32_t *hi)
{
    int h = run->o.causal ? seq_len - ql + qi : seq_len - 1;
    int l = 0;
    if (run->o.sliding_window > 0) {
        int anchor = run->o.causal ? h : seq_len - 1;
        l = anchor - run->o.sliding_window + 1;
        if (l < 0) l = 0;
    }
    *lo = l;
    *hi = h;
}

/* Whether tile i of a sequence is an fp16 page (KVarN sink or tail). */
static inline int attn_tile_is_page(const kvarn_paged_kv *kv, const kvarn_seq_view *sv, int i)
{
    return kvarn_paged_tile_is_page(kv, sv->committed_tiles, i);
}

/* The experimental knobs of opts (attn.h's testing section), 0 without
 * them (attn_check.c). */
int attn_split_k_of(const kvarn_attn_opts *o);
int attn_force_scalar_of(const kvarn_attn_opts *o);

/* 1 when opts are valid: a finite positive softmax scale, a window >= 0,
 * causal 0 or 1, the testing knobs in range (attn_check.c). */
int attn_opts_valid(const kvarn_attn_opts *o);

/* The paged view, with its record layout L: arenas, strides, sink slots
 * and small tail pages (attn_check.c). KVARN_ERR_INVALID_ARG when not. */
kvarn_status attn_check_kv(const kvarn_paged_kv *kv, const kvarn_record_layout *L);

/* One sequence of a call against the view that attn_check_kv accepted:
 * its length, committed tiles, block table, sink slot and small tail
 * pages (attn_check.c). KVARN_ERR_INVALID_ARG when not. */
kvarn_status attn_check_seq(const kvarn_paged_kv *kv, const kvarn_seq_view *sv);

/* *opts, or the defaults with the softmax scale 1 / sqrt(head_dim)
 * (attn_plan.c). */
kvarn_attn_opts attn_opts_or_default(const kvarn_attn_opts *opts, int head_dim);

/* The geometry and workspace bounds of a call of at most max_seqs
 * sequences and max_total_q queries on n_threads workers into *g; KVARN_OK,
 * KVARN_ERR_INVALID_ARG or KVARN_ERR_TOO_LARGE (attn_plan.c). */
kvarn_status attn_make_geom(const kvarn_paged_kv *kv, int n_q_heads, int max_seqs,
                            int max_total_q, int n_threads, const kvarn_attn_opts *o,
                            attn_geom *g);

/* The workspace bytes a call of geometry g needs (attn_plan.c). */
size_t attn_workspace_bytes(const attn_geom *g, int n_threads);

/* Fill run->items and run->groups from the shapes of run (attn_plan.c);
 * 0 when they would not fit the workspace attn_make_geom sized. */
int attn_plan(attn_run *run, int n_seqs, int n_threads);

/* The kernels of format kind `kind` at head_dim and tile G a call with
 * options o runs, into *out (attn_dispatch.c). */
void attn_pick_kernels(const kvarn_attn_opts *o, kvarn_kind kind, int head_dim, int G, int staged,
                       attn_kernels *out);

#endif
