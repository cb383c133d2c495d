/*
 * attn.c -- the attention entry points: argument checks, the work plan
 * (items and split-K chunks), the per-item loop over tiles, the
 * log-sum-exp merge of split chunks, and the final normalization and
 * inverse Hadamard rotation. The per-tile math lives in kernel_ref.c,
 * kernel_avx2.c and the kernel_avx512*.c files, reached through kernel_table.c. Layout: include/kvarn/paged.h; method: docs/attention.md;
 * source: ../shared/spec/KVARN.md "Attention over records", "The fp16 tail
 * and the sink".
 */
#define KVARN_EXPERIMENTAL_API /* the testing knobs of kvarn_attn_opts */
#include <math.h>
#include <string.h>

#include "attn/attn_internal.h"
#include "cache/paged_check.h"
#include "cache/staging.h"
#include "codec/fp_convert.h"
#include "codec/hadamard.h"
#include "common/checked.h"
#include "common/cpu.h"

/* Query rows (query tokens x GQA heads) one work item carries at most. */
#define ROWS_TARGET 256
/* Per-token formats: one kernel call takes a span of whole blocks of at
 * least this many tokens, to spread the per-call softmax work. */
#define SPAN_TOKENS 128 /* and SPAN_TOKENS <= ATTN_PREFETCH_MAX */
/* Auto split-K keeps at least this many tokens in a chunk. */
#define SPLIT_MIN_TOKENS 512
#define ALIGN_F 16 /* floats: 64-byte alignment of every scratch array */

/* ---------------------------------------------------------------- plan */

typedef struct attn_item {
    int seq, kvh;
    int q0, nq;            /* queries [q0, q0 + nq) of the sequence's chunk */
    int tile0, tile1;      /* tiles [tile0, tile1) this item reads */
    int chunk, n_chunks;   /* split-K: this chunk of n_chunks */
    size_t partial;        /* split: float offset of its (m, l, acc) rows */
} attn_item;

typedef struct attn_geom {
    int D, G, Hk, Hq, group, qblock, rows_max;
    int span_tiles;        /* tiles per kernel call (per-token formats) */
    int gs;                /* row stride of the scores: span tokens, rounded */
    int is_kvarn;
    size_t thread_floats;  /* per-worker scratch */
    size_t mat_floats;     /* its part for the matrix kernel (0: none) */
    size_t tail_floats;    /* its last part: K and V fp16 [G][D] of a tail
                              tile gathered from small tail pages (0 when the
                              view has none) */
    size_t max_items, max_groups, partial_floats;
    size_t ws_bytes;       /* the whole workspace a call needs */
} attn_geom;

static size_t round_f(size_t n) { return (n + ALIGN_F - 1) / ALIGN_F * ALIGN_F; }
/* The same in 64 bits for the checked sizes, for n < 2^63. */
static uint64_t round_u64(uint64_t n) { return (n + ALIGN_F - 1) / ALIGN_F * ALIGN_F; }

/* Per-worker scratch in floats, checked (common/checked.h): 0 when the sum
 * fits, 1 when it overflows. */
static int thread_scratch_floats(int rows, int D, int gs_, uint64_t mat, uint64_t tail,
                                 size_t *out)
{
    /* rows < 2^31, D <= 1024 (format check), gs <= 4103: no term can come
     * near 2^63, so the roundings cannot wrap; the products and the sum are
     * checked all the same. */
    const uint64_t R = (uint64_t)rows, gs = (uint64_t)gs_;
    uint64_t rd, rs, sum = 0;
    int bad = kvarn__mul_u64(R, (uint64_t)D, &rd) | kvarn__mul_u64(R, gs, &rs);
    if (bad) return 1;
    const uint64_t t[7] = {
        3 * round_u64(rd),                                /* q, acc, qa */
        round_u64(rs),                                    /* s */
        7 * round_u64(R),                  /* qsum, m, l, rc, lo, hi, psum */
        round_u64(3 * (uint64_t)D + 4 * gs),              /* tile metadata */
        round_u64(gs * sizeof(void *) / sizeof(float)),   /* token pointers */
        mat,                          /* the matrix kernel's unpacked codes */
        tail,                                  /* gathered tail tile, last */
    };
    for (int i = 0; i < 7; i++) bad |= kvarn__add_u64(sum, t[i], &sum);
    return bad | kvarn__u64_to_size(sum, out);
}

/* The experimental knobs (attn.h's testing section); 0 without them. */
static int split_k_of(const kvarn_attn_opts *o) { return o->testing ? o->testing->split_k : 0; }
static int force_scalar_of(const kvarn_attn_opts *o)
{
    return o->testing ? o->testing->force_scalar : 0;
}

static int opts_valid(const kvarn_attn_opts *o)
{
    return isfinite(o->softmax_scale) && o->softmax_scale > 0.0f &&
           o->sliding_window >= 0 && (o->causal == 0 || o->causal == 1) &&
           split_k_of(o) >= 0 && split_k_of(o) <= 1024 &&
           (force_scalar_of(o) == 0 || force_scalar_of(o) == 1) &&
           (o->testing == NULL || o->testing->no_vnni == 0 || o->testing->no_vnni == 1) &&
           (o->testing == NULL || (o->testing->amx >= 0 && o->testing->amx <= 2));
}

/* Geometry and workspace bounds; 0 on success, else a status. */
static kvarn_status make_geom(const kvarn_paged_kv *kv, int n_q_heads, int max_seqs,
                              int max_total_q, int n_threads,
                              const kvarn_attn_opts *o, attn_geom *g)
{
    kvarn_status st = kvarn_format_check_head_dim(&kv->fmt, kv->head_dim);
    if (st != KVARN_OK) return st;
    if (kv->n_kv_heads < 1 || n_q_heads < 1 || n_q_heads % kv->n_kv_heads != 0 ||
        max_seqs < 0 || max_total_q < 0 || n_threads < 1 || !opts_valid(o))
        return KVARN_ERR_INVALID_ARG;
    memset(g, 0, sizeof *g);
    g->D = kv->head_dim;
    g->G = kv->block_size;
    g->Hk = kv->n_kv_heads;
    g->Hq = n_q_heads;
    g->group = n_q_heads / kv->n_kv_heads;
    g->is_kvarn = kv->fmt.kind == KVARN_KIND_KVARN;
    if (g->G < 1 || g->G > 4096 || (g->is_kvarn && g->G != kv->fmt.tile_tokens))
        return KVARN_ERR_INVALID_ARG;
    g->span_tiles = g->is_kvarn || g->G >= SPAN_TOKENS ? 1 : SPAN_TOKENS / g->G;
    g->gs = (g->span_tiles * g->G + 7) / 8 * 8;
    g->qblock = g->group >= ROWS_TARGET ? 1 : ROWS_TARGET / g->group;
    int qb = g->qblock < (max_total_q > 0 ? max_total_q : 1) ? g->qblock
                                                            : (max_total_q > 0 ? max_total_q : 1);
    g->rows_max = qb * g->group;
    /* Every count below is formed in 64 bits with checked products: a
     * geometry whose workspace (or query array) does not fit size_t is
     * refused here, never wrapped into a small size. */
    /* small tail pages: K and V fp16 [G][D], i.e. G * D floats (G <= 4096,
     * D <= 1024), gathered per tail tile (item_task) */
    g->tail_floats = kvarn_paged_small_tail(kv) ? round_f((size_t)g->G * (size_t)g->D) : 0;
    /* the matrix kernel's codes, bf16 [2][D][G] (D G floats), wherever a
     * work item may take it: independent of the CPU */
    g->mat_floats = g->is_kvarn && g->rows_max >= ATTN_MATRIX_MIN_ROWS &&
                            attn_matrix_geometry(g->D, g->G)
                        ? round_f((size_t)g->D * (size_t)g->G)
                        : 0;
    int bad = thread_scratch_floats(g->rows_max, g->D, g->gs, g->mat_floats, g->tail_floats,
                                    &g->thread_floats);
    uint64_t q_floats, base, split_chunks = 0, partial;
    bad |= kvarn__mul3_u64((uint64_t)max_total_q, (uint64_t)n_q_heads, (uint64_t)g->D, &q_floats);
    bad |= kvarn__mul_u64((uint64_t)g->Hk,
                          (uint64_t)max_seqs + kvarn__ceil_div_u64((uint64_t)max_total_q,
                                                                   (uint64_t)g->qblock),
                          &base);
    /* Items: forced split s: at most base * s. Auto (plan()): unsplit, at
     * most base; split only when n_base < 4 * threads, into fewer than
     * n_base + 4 * threads < 8 * threads chunks. */
    if (split_k_of(o) >= 2) bad |= kvarn__mul_u64(base, (uint64_t)split_k_of(o), &split_chunks);
    else if (split_k_of(o) == 0) split_chunks = 8 * (uint64_t)n_threads;
    uint64_t items;
    bad |= kvarn__add_u64(base, split_chunks, &items);
    bad |= kvarn__mul3_u64(split_chunks, (uint64_t)g->rows_max, (uint64_t)g->D + 2, &partial);
    size_t sz;
    bad |= kvarn__u64_to_size(q_floats, &sz);
    bad |= kvarn__u64_to_size(items, &g->max_items);
    bad |= kvarn__u64_to_size(base, &g->max_groups);
    bad |= kvarn__u64_to_size(partial, &g->partial_floats);
    if (bad) return KVARN_ERR_TOO_LARGE;
    /* Workspace bytes: alignment slack, per-worker scratch, the item list,
     * the group list and the split-K partials (carved in this order).
     * base <= 2^63 (Hk < 2^31 times a sum < 2^32), so base + 1 and its
     * rounding cannot wrap. */
    uint64_t t, ws = 64;
    bad |= kvarn__mul3_u64((uint64_t)n_threads, g->thread_floats, sizeof(float), &t);
    bad |= kvarn__add_u64(ws, t, &ws);
    bad |= kvarn__mul_u64(items, sizeof(attn_item), &t);
    bad |= kvarn__mul_u64(round_u64(t / sizeof(float) + 1), sizeof(float), &t);
    bad |= kvarn__add_u64(ws, t, &ws);
    bad |= kvarn__mul_u64(round_u64(base + 1), sizeof(float), &t);
    bad |= kvarn__add_u64(ws, t, &ws);
    bad |= kvarn__mul_u64(partial, sizeof(float), &t);
    bad |= kvarn__add_u64(ws, t, &ws);
    bad |= kvarn__u64_to_size(ws, &g->ws_bytes);
    return bad ? KVARN_ERR_TOO_LARGE : KVARN_OK;
}

static size_t workspace_bytes(const attn_geom *g, int n_threads)
{
    (void)n_threads; /* counted by make_geom */
    return g->ws_bytes;
}

static kvarn_attn_opts opts_or_default(const kvarn_attn_opts *opts, int head_dim)
{
    if (opts) return *opts;
    kvarn_attn_opts o = KVARN_ATTN_OPTS_DEFAULT(0.0f);
    o.softmax_scale = head_dim > 0 ? (float)(1.0 / sqrt((double)head_dim)) : 1.0f;
    return o;
}

size_t kvarn_attn_workspace_bytes(const kvarn_paged_kv *kv, int n_q_heads,
                                  int max_seqs, int max_total_q,
                                  int n_threads, const kvarn_attn_opts *opts)
{
    if (kv == NULL) return 0;
    kvarn_attn_opts o = opts_or_default(opts, kv->head_dim);
    attn_geom g;
    if (make_geom(kv, n_q_heads, max_seqs, max_total_q, n_threads, &o, &g) != KVARN_OK) return 0;
    return workspace_bytes(&g, n_threads);
}

/* ----------------------------------------------------------- dispatch */

/* The kernels of this format kind and head_dim at the SIMD level
 * kvarn__cpu_level() reports (capped by KVARN_SIMD, common/cpu.h), read from
 * the kind's row (kernel_table.c): a level whose head_dim multiple (AVX-512
 * 32, AVX2 16) does not divide D runs the next lower one. */
static int top_level_of(const kvarn_attn_opts *o)
{
    return force_scalar_of(o) ? KVARN_CPU_SCALAR : (int)kvarn__cpu_level();
}

/* The VNNI builds of the AVX-512 KVarN and int8 kernels run where the CPU
 * has VNNI (same results; the testing knob no_vnni keeps the vpmaddwd
 * builds). */
static int vnni_of(const kvarn_attn_opts *o)
{
    return !(o->testing && o->testing->no_vnni) && kvarn__cpu_avx512_vnni();
}

/* The matrix kernel of KVarN records (kernel_amx.c) a call runs for items
 * of ATTN_MATRIX_MIN_ROWS rows or more: 1 AMX tiles, 2 emulated (the
 * testing knob amx = 2, or KVARN_AMX=emulate: its rounding measured on any
 * CPU, docs/attention-matrix.md), 0 none (knob amx = 1, force_scalar, no
 * AMX). */
static int amx_of(const kvarn_attn_opts *o)
{
    const int knob = o->testing ? o->testing->amx : 0;
    if (knob == 2) return 2;
    if (knob == 1 || force_scalar_of(o)) return 0;
    return (int)kvarn__cpu_amx(); /* 0 none, 1 tiles, 2 emulated */
}

/* The matrix kernel for a KVarN format of tiles of G tokens at head_dim D
 * (NULL: none). */
static attn_matrix_tile_fn matrix_kernel(const kvarn_attn_opts *o, kvarn_kind kind, int D, int G)
{
    if (kind != KVARN_KIND_KVARN || !attn_matrix_geometry(D, G)) return NULL;
    switch (amx_of(o)) {
    case 1: return attn_amx_kvarn_tile;
    case 2: return attn_amxemu_kvarn_tile;
    default: return NULL;
    }
}

static void pick_kernels(const kvarn_attn_opts *o, kvarn_kind kind, int head_dim, int G,
                         attn_kernels *out)
{
    (void)attn_select_kernels(kind, head_dim, top_level_of(o), out); /* kind checked by make_geom */
    const int vnni = vnni_of(o);
    if (vnni && out->kvarn_tile == attn_avx512_kvarn_tile) out->kvarn_tile = attn_avx512vnni_kvarn_tile;
    if (vnni && out->token_tile == attn_avx512_token_int8) out->token_tile = attn_avx512vnni_token_int8;
    out->kvarn_matrix = matrix_kernel(o, kind, head_dim, G);
}

const char *kvarn_attn_kernel_name(const kvarn_attn_opts *opts)
{
    if (opts != NULL && force_scalar_of(opts)) return attn_level_row_of(KVARN_CPU_SCALAR)->name;
    return attn_level_row_of((int)kvarn__cpu_level())->name;
}

kvarn_status kvarn_attn_kernel_info_get(const kvarn_format *fmt, int head_dim, int staging,
                                        const kvarn_attn_opts *opts,
                                        kvarn_attn_kernel_info *out)
{
    if (fmt == NULL || out == NULL || (opts != NULL && !opts_valid(opts)))
        return KVARN_ERR_INVALID_ARG;
    kvarn_record_layout L;
    kvarn_status st = kvarn_record_layout_get(fmt, head_dim, &L);
    if (st != KVARN_OK) return st;
    kvarn_format sf;
    const int staged = fmt->kind == KVARN_KIND_KVARN ? kvarn__staging_format(staging, &sf) : 0;
    if (staged < 0) return KVARN_ERR_INVALID_ARG;
    const attn_kind_row *row = attn_kind_row_of(fmt->kind);
    if (row == NULL) return KVARN_ERR_INVALID_ARG;
    const kvarn_attn_opts o = opts ? *opts : (kvarn_attn_opts)KVARN_ATTN_OPTS_DEFAULT(1.0f);
    const int top = top_level_of(&o), vnni = vnni_of(&o);
    kvarn_attn_kernel_info info;
    attn_kernels k;
    info.level = attn_level_row_of(attn_select_kernels_from(row, head_dim, top, &k))->name;
    attn_select_arith_from(row, fmt, head_dim, top, vnni, &info.scores, &info.sums);
    info.staged_scores = info.scores;
    info.staged_sums = info.sums;
    info.matrix = NULL;
    info.matrix_rows = 0;
    info.matrix_scores = info.matrix_sums = KVARN_ATTN_ARITH_FP32;
    const attn_matrix_tile_fn mk = matrix_kernel(&o, fmt->kind, head_dim, fmt->tile_tokens);
    if (mk != NULL) {
        info.matrix = mk == attn_amxemu_kvarn_tile ? "amx-bf16-emulated" : "amx-bf16";
        info.matrix_rows = ATTN_MATRIX_MIN_ROWS;
        info.matrix_scores = info.matrix_sums = KVARN_ATTN_ARITH_BF16X2;
    }
    if (fmt->kind == KVARN_KIND_KVARN) {
        /* fp16 staging: the fp16 page kernel (fp32 arithmetic) */
        info.staged_scores = info.staged_sums = KVARN_ATTN_ARITH_FP32;
        if (staged > 0)
            attn_select_arith_from(attn_kind_row_of(sf.kind), &sf, head_dim, top, vnni,
                                   &info.staged_scores, &info.staged_sums);
    }
    *out = info;
    return KVARN_OK;
}

/* ------------------------------------------------------- validation */

static int n_tiles_of(int seq_len, int G) { return (seq_len + G - 1) / G; }

/* Whether tile i of a sequence is an fp16 page (KVarN sink or tail). */
static int tile_is_page(const kvarn_paged_kv *kv, const kvarn_seq_view *sv, int i)
{
    return kvarn_paged_tile_is_page(kv, sv->committed_tiles, i);
}

static kvarn_status check_kv(const kvarn_paged_kv *kv, const kvarn_record_layout *L)
{
    /* Records, blocks and fp16 pages (when given; check_seq refuses a page
     * tile without them): the check store, commit and CUDA share
     * (cache/paged_check.h), products checked. */
    kvarn_status st = kvarn__paged_check_arenas(kv, L, 0, KVARN_ERR_INVALID_ARG);
    if (st != KVARN_OK) return st;
    const size_t hk = (size_t)kv->n_kv_heads;
    /* Sink shorter than a tile (paged.h): r in [0, G), KVarN only; slots
     * of K+V [r][D] fp16 per head, 2-byte aligned. */
    if (kv->sink_partial < 0 || kv->sink_partial >= kv->block_size ||
        (kv->sink_partial > 0 && kv->fmt.kind != KVARN_KIND_KVARN))
        return KVARN_ERR_INVALID_ARG;
    /* Small tail pages (paged.h): 0 < T < G, T dividing G, KVarN only;
     * small pages of K+V [T][D] fp16 per head, 2-byte aligned. */
    if (kv->tail_page_tokens < 0 || kv->tail_page_tokens > kv->block_size ||
        (kv->tail_page_tokens > 0 && kv->fmt.kind != KVARN_KIND_KVARN) ||
        (kv->tail_page_tokens > 0 && kv->block_size % kv->tail_page_tokens != 0))
        return KVARN_ERR_INVALID_ARG;
    if (kvarn_paged_small_tail(kv) && kv->fp16_tail_pages != NULL) {
        uint64_t heads;
        if (kv->n_tail_pages < 0 ||
            kv->tail_page_head_stride <
                kvarn_paged_staging_bytes(kv, kv->tail_page_tokens) ||
            kv->tail_page_head_stride % 2 != 0 || kv->tail_page_stride % 2 != 0 ||
            ((uintptr_t)kv->fp16_tail_pages % 2) != 0 ||
            kvarn__mul_u64(hk, kv->tail_page_head_stride, &heads) ||
            kv->tail_page_stride < heads)
            return KVARN_ERR_INVALID_ARG;
    }
    if (kv->sink_partial > 0 && kv->fp16_sinks != NULL) {
        uint64_t heads;
        if (kv->n_sink_slots < 0 ||
            kv->sink_head_stride < kvarn_paged_staging_bytes(kv, kv->sink_partial) ||
            kv->sink_head_stride % 2 != 0 || kv->sink_stride % 2 != 0 ||
            ((uintptr_t)kv->fp16_sinks % 2) != 0 ||
            kvarn__mul_u64(hk, kv->sink_head_stride, &heads) || kv->sink_stride < heads)
            return KVARN_ERR_INVALID_ARG;
    }
    return KVARN_OK;
}

static kvarn_status check_seq(const kvarn_paged_kv *kv, const kvarn_seq_view *sv)
{
    if (sv->seq_len < 0) return KVARN_ERR_INVALID_ARG;
    int G = kv->block_size, nt = n_tiles_of(sv->seq_len, G);
    if (nt > 0 && sv->block_table == NULL) return KVARN_ERR_INVALID_ARG;
    if (kv->fmt.kind == KVARN_KIND_KVARN) {
        /* Quantized tiles must be complete: committed_tiles * G <= seq_len. */
        if (sv->committed_tiles < 0 || sv->committed_tiles > nt) return KVARN_ERR_INVALID_ARG;
        if (sv->committed_tiles > kv->sink_tiles &&
            (int64_t)sv->committed_tiles * G > sv->seq_len)
            return KVARN_ERR_INVALID_ARG;
    }
    /* a quantized partial sink tile reads the sequence's sink slot */
    if (nt > 0 && kvarn_paged_tile_sink_tokens(kv, sv->committed_tiles, kv->sink_tiles) > 0 &&
        kv->sink_tiles < nt &&
        (kv->fp16_sinks == NULL || sv->sink_slot < 0 || sv->sink_slot >= kv->n_sink_slots))
        return KVARN_ERR_INVALID_ARG;
    /* small tail pages: every id the tail's tokens need (paged.h) */
    if (kvarn_paged_small_tail(kv)) {
        const int64_t a = kvarn_paged_tail_start(kv, sv->committed_tiles);
        const int64_t n_small = sv->seq_len > a ? (sv->seq_len - a + kv->tail_page_tokens - 1) /
                                                      kv->tail_page_tokens
                                                : 0;
        if (n_small > 0 && (sv->tail_pages == NULL || kv->fp16_tail_pages == NULL))
            return KVARN_ERR_INVALID_ARG;
        for (int64_t j = 0; j < n_small; j++)
            if (sv->tail_pages[j] < 0 || sv->tail_pages[j] >= kv->n_tail_pages)
                return KVARN_ERR_INVALID_ARG;
    }
    for (int i = 0; i < nt; i++) {
        int32_t id = sv->block_table[i];
        if (kvarn_paged_tile_in_tail_pages(kv, sv->committed_tiles, i)) continue;
        if (tile_is_page(kv, sv, i)) {
            if (kv->fp16_pages == NULL || id < 0 || id >= kv->n_fp16_pages) return KVARN_ERR_INVALID_ARG;
        } else {
            if (kv->blocks == NULL || id < 0 || id >= kv->n_blocks) return KVARN_ERR_INVALID_ARG;
        }
    }
    return KVARN_OK;
}

/* ----------------------------------------------------------- the run */

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
    float *thread_scratch;
    attn_item *items;
    int n_items;
    int *groups;               /* split: index of each group's first chunk */
    int n_groups;
    float *partials;
} attn_run;

static int q_start(const attn_run *run, int s) { return run->qsl ? run->qsl[s] : s; }
static int q_len(const attn_run *run, int s) { return run->qsl ? run->qsl[s + 1] - run->qsl[s] : 1; }

/* Visible positions [lo, hi] of query qi (of q_len) of a sequence. */
static void query_limits(const attn_run *run, int seq_len, int ql, int qi, int32_t *lo, int32_t *hi)
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

/* Tiles that any query in [q0, q0 + nq) may see. */
static void item_tiles(const attn_run *run, int s, int q0, int nq, int *t0, int *t1)
{
    const kvarn_seq_view *sv = &run->seqs[s];
    int32_t lo0, hi0, lo1, hi1;
    query_limits(run, sv->seq_len, q_len(run, s), q0, &lo0, &hi0);
    query_limits(run, sv->seq_len, q_len(run, s), q0 + nq - 1, &lo1, &hi1);
    int lo = lo0 < lo1 ? lo0 : lo1, hi = hi0 > hi1 ? hi0 : hi1;
    if (hi < lo) { *t0 = *t1 = 0; return; }
    *t0 = lo / run->g.G;
    *t1 = hi / run->g.G + 1;
}

/* Build the item list: (sequence, KV head, query block) base items, each
 * split into chunks of whole tiles when split-K applies. Deterministic:
 * depends only on the shapes, the options and the thread count. */
static int plan(attn_run *run, int n_seqs, int n_threads)
{
    const attn_geom *g = &run->g;
    int n_base = 0;
    for (int s = 0; s < n_seqs; s++) {
        int ql = q_len(run, s);
        if (ql > 0 && run->seqs[s].seq_len > 0) n_base += g->Hk * ((ql + g->qblock - 1) / g->qblock);
    }
    int want = 1;
    const int split_k = split_k_of(&run->o);
    if (split_k >= 2) want = split_k;
    else if (split_k == 0 && n_threads > 1 && n_base > 0 && n_base < 4 * n_threads)
        want = (4 * n_threads + n_base - 1) / n_base; /* ~4 chunks per worker */
    int min_tiles = split_k >= 2 ? 1 : (SPLIT_MIN_TOKENS + g->G - 1) / g->G;

    int n = 0, ng = 0;
    size_t poff = 0;
    for (int s = 0; s < n_seqs; s++) {
        int ql = q_len(run, s);
        if (ql <= 0 || run->seqs[s].seq_len <= 0) continue;
        for (int q0 = 0; q0 < ql; q0 += g->qblock) {
            int nq = ql - q0 < g->qblock ? ql - q0 : g->qblock;
            int t0, t1;
            item_tiles(run, s, q0, nq, &t0, &t1);
            int span = t1 - t0, nc = want;
            if (nc > span / min_tiles) nc = span / min_tiles;
            if (nc < 1) nc = 1;
            for (int h = 0; h < g->Hk; h++) {
                /* The bounds of make_geom hold by construction; checked anyway
                 * so that a mistake there can never write past the workspace. */
                size_t prow = (size_t)nq * g->group * ((size_t)g->D + 2);
                if ((size_t)n + (size_t)nc > g->max_items || (nc > 1 && (size_t)ng >= g->max_groups) ||
                    (nc > 1 && poff + (size_t)nc * prow > g->partial_floats))
                    return 0;
                if (nc > 1) run->groups[ng++] = n;
                for (int c = 0; c < nc; c++) {
                    attn_item *it = &run->items[n++];
                    it->seq = s;
                    it->kvh = h;
                    it->q0 = q0;
                    it->nq = nq;
                    /* chunk c gets tiles [t0 + span*c/nc, t0 + span*(c+1)/nc) */
                    it->tile0 = t0 + (int)((int64_t)span * c / nc);
                    it->tile1 = t0 + (int)((int64_t)span * (c + 1) / nc);
                    it->chunk = c;
                    it->n_chunks = nc;
                    it->partial = 0;
                    if (nc > 1) {
                        it->partial = poff;
                        poff += prow;
                    }
                }
            }
        }
    }
    run->n_items = n;
    run->n_groups = ng;
    return 1;
}

/* Scratch arrays of one worker. */
/* The channel means of a mean-centred record (record.h V mu_d): every
 * token's value is V'[t] + mu, so the tile adds sum_t p_t (V'[t] + mu) =
 * (what the kernel added) + psum * mu to each row's acc, psum the row's sum
 * of this tile's weights (0 for a row that sees none of it), in the same
 * online-softmax scale as acc after the kernel's update. Once per tile,
 * here rather than in every kernel: D multiply-adds per row against the
 * kernel's D G. r->meta (the kernel's scratch, free again) holds mu. */
static void add_value_means(attn_rows *r, const kvarn_record_layout *L, const uint8_t *rec)
{
    const int D = r->D;
    float *mu = r->meta;
    const uint8_t *m16 = rec + L->v_mu_off;
    for (int d = 0; d < D; d++) { /* the inline conversion: vectorized */
        uint16_t h;
        memcpy(&h, m16 + 2 * (size_t)d, 2);
        mu[d] = kvarn__fp16_to_f32(h);
    }
    for (int i = 0; i < r->n; i++) {
        const float p = r->psum[i];
        float *acc = r->acc + (size_t)i * D;
        if (p != 0.0f)
            for (int d = 0; d < D; d++) acc[d] += p * mu[d];
    }
}

static attn_rows rows_of(const attn_run *run, int worker, int n)
{
    const attn_geom *g = &run->g;
    float *f = run->thread_scratch + (size_t)worker * g->thread_floats;
    size_t R = (size_t)g->rows_max;
    attn_rows r;
    r.n = n;
    r.D = g->D;
    r.G = g->G;
    r.gs = g->gs;
    float *q = f; f += round_f(R * g->D);
    r.q = q;
    r.acc = f; f += round_f(R * g->D);
    r.qa = f; f += round_f(R * g->D);
    r.qa_ready = 0;
    r.s = f; f += round_f(R * (size_t)r.gs);
    float *qsum = f; f += round_f(R);
    r.qsum = qsum;
    r.m = f; f += round_f(R);
    r.l = f; f += round_f(R);
    r.rc = f; f += round_f(R);
    r.lo = (int32_t *)f; f += round_f(R);
    r.hi = (int32_t *)f; f += round_f(R);
    r.psum = f; f += round_f(R);
    r.meta = f; f += round_f(3 * (size_t)g->D + 4 * (size_t)g->gs);
    r.tok = (const uint8_t **)f;
    f += round_f((size_t)g->gs * sizeof(void *) / sizeof(float));
    r.mat = g->mat_floats ? (uint16_t *)f : NULL;
    r.pf = NULL; /* set by item_task */
    return r;
}

/* The learned sink logit of query head `head` (opts.sinks), -inf for none. */
static float sink_of(const attn_run *run, int head)
{
    return run->o.sinks ? run->o.sinks[head] : -INFINITY;
}

/* Write one finished row of query head `head`: o = acc / l in the kernel
 * basis, rotated back for KVarN; zero when the row saw no token. With the
 * caller's lse array, also its log-sum-exp m + ln l (scores include the
 * softmax scale; the Hadamard rotation leaves them unchanged), -inf when
 * the row saw no token. A learned sink s (finite) is merged here, once, as
 * one more (max, sum) part with no value: m' = max(m, s), l' = l e^(m - m')
 * + e^(s - m'), o = acc e^(m - m') / l', lse = m' + ln l' (s alone, and o
 * zero, for a row that saw no token). Without one (-inf) the arithmetic
 * is the plain call's. */
static void finish_row(const attn_run *run, int head, const float *acc, float m, float l,
                       float *o, float *lse)
{
    const int D = run->g.D;
    const float s = sink_of(run, head);
    if (s != -INFINITY) {
        const float mm = l > 0.0f && m > s ? m : s;
        const float w = l > 0.0f ? expf(m - mm) : 0.0f;
        const float ls = l * w + expf(s - mm);
        if (lse) *lse = mm + logf(ls);
        const float c = w / ls;
        for (int d = 0; d < D; d++) o[d] = acc[d] * c;
        if (run->g.is_kvarn && l > 0.0f) kvarn_hadamard(o, D);
        return;
    }
    if (lse) *lse = l > 0.0f ? m + logf(l) : -INFINITY;
    if (l > 0.0f) {
        float inv = 1.0f / l;
        for (int d = 0; d < D; d++) o[d] = acc[d] * inv;
        if (run->g.is_kvarn) kvarn_hadamard(o, D);
    } else {
        for (int d = 0; d < D; d++) o[d] = 0.0f;
    }
}

static float *out_row(const attn_run *run, int s, int qi, int head)
{
    return run->out + ((size_t)(q_start(run, s) + qi) * run->g.Hq + head) * run->g.D;
}

static float *lse_at(const attn_run *run, int s, int qi, int head)
{
    return run->lse ? run->lse + (size_t)(q_start(run, s) + qi) * run->g.Hq + head : NULL;
}

/* Staged token records (paged.h "Staging"), pointers in r->tok[0, nt) for
 * positions [t0, t0 + nt): one token-kernel call of the staging's
 * per-token format, as for a block of that format. The AVX-512 int8 kernel
 * keeps its rounded query in r->qa across calls (qa_ready), where the
 * KVarN kernels keep theirs: the flag is cleared on both sides of the
 * call. */
static void staged_tile(const attn_run *run, attn_rows *r, int t0, int nt)
{
    r->qa_ready = 0;
    run->stage_set.token_tile(r, &run->Ls, r->tok, t0, nt);
    r->qa_ready = 0;
}

static void item_task(void *ctx, int task, int worker)
{
    const attn_run *run = ctx;
    const attn_item *it = &run->items[task];
    const attn_geom *g = &run->g;
    const kvarn_paged_kv *kv = run->kv;
    const kvarn_seq_view *sv = &run->seqs[it->seq];
    const int D = g->D, G = g->G, n = it->nq * g->group, ql = q_len(run, it->seq);
    attn_rows r = rows_of(run, worker, n);
    float *q = (float *)r.q, *qsum = (float *)r.qsum;
    int32_t *lo = (int32_t *)r.lo, *hi = (int32_t *)r.hi;

    /* Rows: query-major, then the heads of the GQA group. */
    for (int qi = 0; qi < it->nq; qi++) {
        for (int j = 0; j < g->group; j++) {
            int row = qi * g->group + j, head = it->kvh * g->group + j;
            const float *src = run->q + ((size_t)(q_start(run, it->seq) + it->q0 + qi) * g->Hq + head) * D;
            float *dst = q + (size_t)row * D, sum = 0.0f;
            for (int d = 0; d < D; d++) dst[d] = src[d] * run->o.softmax_scale;
            if (g->is_kvarn) kvarn_hadamard(dst, D);
            for (int d = 0; d < D; d++) sum += dst[d];
            qsum[row] = sum;
            query_limits(run, sv->seq_len, ql, it->q0 + qi, &lo[row], &hi[row]);
            r.m[row] = -INFINITY;
            r.l[row] = 0.0f;
        }
    }
    memset(r.acc, 0, (size_t)n * D * sizeof(float));

    const size_t tile_bytes = g->is_kvarn ? run->L.record_bytes : (size_t)G * kv->token_record_bytes;
    const int step = g->span_tiles;
    attn_prefetch pf;
    /* KVarN records of a caller's arena off the 64-byte lines are listed
     * from their first line (attn_prefetch_base); the per-token formats'
     * blocks are listed as they are. */
    const int line_aligned =
        !g->is_kvarn || (((uintptr_t)kv->blocks | kv->block_stride | kv->record_stride) & 63) == 0;
    pf.lines = attn_prefetch_lines(tile_bytes, line_aligned);
    r.pf = &pf;
    for (int tile = it->tile0; tile < it->tile1;) {
        int end = tile + step < it->tile1 ? tile + step : it->tile1;
        /* The next tiles' records are elsewhere in the arena: the kernel
         * fetches them while it computes this one (attn_internal.h). */
        pf.n = pf.tile = pf.line = 0;
        for (int nx = end; nx < end + step && nx < it->tile1 && kv->blocks; nx++) {
            if (tile_is_page(kv, sv, nx)) continue;
            pf.base[pf.n++] = attn_prefetch_base(kvarn_paged_record(kv, sv->block_table[nx], it->kvh),
                                                 line_aligned);
        }
        int t0 = tile * G, nt = sv->seq_len - t0 < G ? sv->seq_len - t0 : G;
        int32_t id = sv->block_table[tile];
        const int staged = run->staged;
        if (staged && kvarn_paged_tile_in_tail_pages(kv, sv->committed_tiles, tile)) {
            /* records in small tail pages: pointers in token order */
            const int T = kv->tail_page_tokens;
            const int64_t a = kvarn_paged_tail_start(kv, sv->committed_tiles);
            for (int j = 0; j < nt; j++) {
                const int64_t off = t0 + j - a;
                r.tok[j] = kvarn_paged_tail_rec(kv, sv->tail_pages[off / T], it->kvh,
                                                (int)(off % T));
            }
            staged_tile(run, &r, t0, nt);
        } else if (staged && tile_is_page(kv, sv, tile)) {
            for (int j = 0; j < nt; j++) r.tok[j] = kvarn_paged_page_rec(kv, id, it->kvh, j);
            staged_tile(run, &r, t0, nt);
        } else if (kvarn_paged_tile_in_tail_pages(kv, sv->committed_tiles, tile)) {
            /* A tail tile in small pages (paged.h): its nt rows gathered
             * into the worker's scratch in token order, then the same
             * kernel call as for a whole page holding those rows, so the
             * result is the same bit for bit (one online-softmax step per
             * tile, not one per small page). */
            const int T = kv->tail_page_tokens;
            const int64_t a = kvarn_paged_tail_start(kv, sv->committed_tiles);
            uint16_t *gk = (uint16_t *)(run->thread_scratch + (size_t)worker * g->thread_floats +
                                        (g->thread_floats - g->tail_floats));
            uint16_t *gv = gk + (size_t)G * D;
            const size_t row_bytes = (size_t)D * sizeof(uint16_t);
            for (int j = 0; j < nt;) {
                const int64_t off = t0 + j - a;
                const int32_t sp = sv->tail_pages[off / T];
                const int r0 = (int)(off % T), cnt = T - r0 < nt - j ? T - r0 : nt - j;
                memcpy(gk + (size_t)j * D, kvarn_paged_tail_k(kv, sp, it->kvh) + (size_t)r0 * D,
                       (size_t)cnt * row_bytes);
                memcpy(gv + (size_t)j * D, kvarn_paged_tail_v(kv, sp, it->kvh) + (size_t)r0 * D,
                       (size_t)cnt * row_bytes);
                j += cnt;
            }
            run->kern->fp16_tile(&r, gk, gv, t0, nt);
        } else if (tile_is_page(kv, sv, tile)) {
            run->kern->fp16_tile(&r, kvarn_paged_page_k(kv, id, it->kvh),
                                 kvarn_paged_page_v(kv, id, it->kvh), t0, nt);
        } else if (g->is_kvarn) {
            const int ns = kvarn_paged_tile_sink_tokens(kv, sv->committed_tiles, tile);
            if (ns > 0) {
                /* Partial sink tile (paged.h): tokens [t0, t0 + ns) from the
                 * fp16 slot, the rest from the record with the rows'
                 * first visible position raised past the sink (the masking
                 * a sliding window starting inside a tile uses). */
                if (staged) {
                    for (int j = 0; j < ns; j++)
                        r.tok[j] = kvarn_paged_sink_rec(kv, sv->sink_slot, it->kvh, j);
                    staged_tile(run, &r, t0, ns);
                } else {
                    run->kern->fp16_tile(&r, kvarn_paged_sink_k(kv, sv->sink_slot, it->kvh),
                                         kvarn_paged_sink_v(kv, sv->sink_slot, it->kvh), t0, ns);
                }
                for (int row = 0; row < n; row++)
                    if (lo[row] < t0 + ns) lo[row] = t0 + ns;
            }
            const uint8_t *rec = kvarn_paged_record(kv, id, it->kvh);
            if (run->L.v_mu_bytes) memset(r.psum, 0, (size_t)n * sizeof(float));
            if (run->kern->kvarn_matrix && n >= ATTN_MATRIX_MIN_ROWS && r.mat)
                run->kern->kvarn_matrix(&r, &run->L, rec, t0, nt, run->kern->kvarn_tile);
            else
                run->kern->kvarn_tile(&r, &run->L, rec, t0, nt);
            if (run->L.v_mu_bytes) add_value_means(&r, &run->L, rec);
            if (ns > 0)
                for (int qi = 0; qi < it->nq; qi++)
                    for (int j = 0; j < g->group; j++)
                        query_limits(run, sv->seq_len, ql, it->q0 + qi,
                                     &lo[qi * g->group + j], &hi[qi * g->group + j]);
        } else {
            /* A span of whole blocks; only a sequence's last block is partial. */
            int span = 0;
            for (int i = tile; i < end; i++) {
                int cnt = sv->seq_len - i * G < G ? sv->seq_len - i * G : G;
                for (int j = 0; j < cnt; j++)
                    r.tok[span++] = kvarn_paged_token_record(kv, sv->block_table[i], it->kvh, j);
            }
            run->kern->token_tile(&r, &run->L, r.tok, t0, span);
            tile = end;
            continue;
        }
        tile++;
    }

    if (it->n_chunks > 1) {
        float *p = run->partials + it->partial;
        for (int row = 0; row < n; row++) {
            p[0] = r.m[row];
            p[1] = r.l[row];
            memcpy(p + 2, r.acc + (size_t)row * D, (size_t)D * sizeof(float));
            p += D + 2;
        }
        return;
    }
    for (int qi = 0; qi < it->nq; qi++)
        for (int j = 0; j < g->group; j++) {
            int row = qi * g->group + j;
            finish_row(run, it->kvh * g->group + j, r.acc + (size_t)row * D, r.m[row], r.l[row],
                       out_row(run, it->seq, it->q0 + qi, it->kvh * g->group + j),
                       lse_at(run, it->seq, it->q0 + qi, it->kvh * g->group + j));
        }
}

/* Merge the chunks of one split group in chunk order (log-sum-exp). */
static void merge_task(void *ctx, int task, int worker)
{
    const attn_run *run = ctx;
    const attn_item *first = &run->items[run->groups[task]];
    const int D = run->g.D, group = run->g.group, nc = first->n_chunks;
    attn_rows r = rows_of(run, worker, first->nq * group);
    for (int row = 0; row < first->nq * group; row++) {
        size_t off = (size_t)row * (D + 2);
        float m = -INFINITY;
        for (int c = 0; c < nc; c++) {
            float mc = run->partials[first[c].partial + off];
            m = mc > m ? mc : m;
        }
        float l = 0.0f, *acc = r.acc;
        for (int d = 0; d < D; d++) acc[d] = 0.0f;
        if (m != -INFINITY) {
            for (int c = 0; c < nc; c++) {
                const float *p = run->partials + first[c].partial + off;
                if (p[0] == -INFINITY) continue;
                float w = expf(p[0] - m);
                l += p[1] * w;
                for (int d = 0; d < D; d++) acc[d] += p[2 + d] * w;
            }
        }
        int qi = row / group, j = row % group;
        finish_row(run, first->kvh * group + j, acc, m, l, out_row(run, first->seq, first->q0 + qi, first->kvh * group + j),
                   lse_at(run, first->seq, first->q0 + qi, first->kvh * group + j));
    }
}

static kvarn_status attn_common(const kvarn_paged_kv *kv, const kvarn_seq_view *seqs,
                                int n_seqs, const int32_t *qsl, int n_q_heads,
                                const float *q, float *out, float *lse,
                                const kvarn_attn_opts *opts,
                                kvarn_thread_pool *pool, void *workspace,
                                size_t workspace_size)
{
    if (kv == NULL || q == NULL || out == NULL || n_seqs < 0 || (n_seqs > 0 && seqs == NULL))
        return KVARN_ERR_INVALID_ARG;
    attn_run run;
    memset(&run, 0, sizeof run);
    run.kv = kv;
    run.seqs = seqs;
    run.qsl = qsl;
    run.q = q;
    run.out = out;
    run.lse = lse;
    run.o = opts_or_default(opts, kv->head_dim);
    int total_q = n_seqs;
    if (qsl) {
        if (qsl[0] != 0) return KVARN_ERR_INVALID_ARG;
        for (int s = 0; s < n_seqs; s++)
            if (qsl[s + 1] < qsl[s]) return KVARN_ERR_INVALID_ARG;
        total_q = qsl[n_seqs];
    }
    int n_threads = kvarn_thread_pool_size(pool);
    kvarn_status st = make_geom(kv, n_q_heads, n_seqs, total_q, n_threads, &run.o, &run.g);
    if (st != KVARN_OK) return st;
    st = kvarn_record_layout_get(&kv->fmt, kv->head_dim, &run.L);
    if (st != KVARN_OK) return st;
    st = check_kv(kv, &run.L);
    if (st != KVARN_OK) return st;
    for (int s = 0; s < n_seqs; s++) {
        st = check_seq(kv, &seqs[s]);
        if (st != KVARN_OK) return st;
        /* Causal multi-query: the queries are the sequence's last tokens.
         * Decode and non-causal queries may come after every key. */
        if (qsl && run.o.causal && q_len(&run, s) > seqs[s].seq_len)
            return KVARN_ERR_INVALID_ARG;
    }
    if (!kvarn__all_finite(q, (size_t)total_q * n_q_heads * kv->head_dim)) return KVARN_ERR_NONFINITE;
    if (run.o.sinks) /* -inf: no sink; NaN, +inf: refused */
        for (int h = 0; h < n_q_heads; h++)
            if (isnan(run.o.sinks[h]) || run.o.sinks[h] == INFINITY) return KVARN_ERR_NONFINITE;
    size_t need = workspace_bytes(&run.g, n_threads);
    if (workspace == NULL || workspace_size < need) return KVARN_ERR_BUFFER_TOO_SMALL;

    /* Carve the workspace (64-byte aligned). */
    uintptr_t base = ((uintptr_t)workspace + 63) & ~(uintptr_t)63;
    float *f = (float *)base;
    run.thread_scratch = f;
    f += (size_t)n_threads * run.g.thread_floats;
    run.items = (attn_item *)f;
    f += round_f(run.g.max_items * sizeof(attn_item) / sizeof(float) + 1);
    run.groups = (int *)f;
    f += round_f(run.g.max_groups + 1);
    run.partials = f;
    pick_kernels(&run.o, kv->fmt.kind, kv->head_dim, kv->block_size, &run.kern_set);
    run.kern = &run.kern_set;
    kvarn_format sf;
    if (kvarn__staging_format(kv->staging, &sf) > 0) {
        /* check_kv accepted the view: KVarN, a record of the staging's
         * per-token format per staged token */
        st = kvarn_record_layout_get(&sf, kv->head_dim, &run.Ls);
        if (st != KVARN_OK) return st;
        pick_kernels(&run.o, sf.kind, kv->head_dim, kv->block_size, &run.stage_set);
        run.staged = 1;
    }

    if (!plan(&run, n_seqs, n_threads)) return KVARN_ERR_BUFFER_TOO_SMALL;

    /* Sequences with no context: zero output, lse -inf, or the head's sink
     * logit (finish_row) (decode, and non-causal multi-query; causal has
     * q_len <= seq_len = 0). */
    for (int s = 0; s < n_seqs; s++) {
        if (seqs[s].seq_len != 0) continue;
        size_t rows = (size_t)q_len(&run, s) * n_q_heads;
        memset(out + (size_t)q_start(&run, s) * n_q_heads * kv->head_dim, 0,
               rows * kv->head_dim * sizeof(float));
        if (lse)
            for (size_t i = 0; i < rows; i++)
                lse[(size_t)q_start(&run, s) * n_q_heads + i] = sink_of(&run, (int)(i % n_q_heads));
    }

    attn_pool_run(pool, item_task, &run, run.n_items);
    attn_pool_run(pool, merge_task, &run, run.n_groups);
    return KVARN_OK;
}

kvarn_status kvarn_attn_decode(const kvarn_paged_kv *kv, const kvarn_seq_view *seqs,
                               int n_seqs, int n_q_heads, const float *q, float *out,
                               const kvarn_attn_opts *opts, kvarn_thread_pool *pool,
                               void *workspace, size_t workspace_size)
{
    return attn_common(kv, seqs, n_seqs, NULL, n_q_heads, q, out, NULL, opts, pool,
                       workspace, workspace_size);
}

kvarn_status kvarn_attn_decode_lse(const kvarn_paged_kv *kv, const kvarn_seq_view *seqs,
                                   int n_seqs, int n_q_heads, const float *q, float *out,
                                   float *lse, const kvarn_attn_opts *opts,
                                   kvarn_thread_pool *pool, void *workspace,
                                   size_t workspace_size)
{
    return attn_common(kv, seqs, n_seqs, NULL, n_q_heads, q, out, lse, opts, pool,
                       workspace, workspace_size);
}

kvarn_status kvarn_attn_multi(const kvarn_paged_kv *kv, const kvarn_seq_view *seqs,
                              int n_seqs, const int32_t *query_start_loc, int n_q_heads,
                              const float *q, float *out, const kvarn_attn_opts *opts,
                              kvarn_thread_pool *pool, void *workspace,
                              size_t workspace_size)
{
    if (query_start_loc == NULL) return KVARN_ERR_INVALID_ARG;
    return attn_common(kv, seqs, n_seqs, query_start_loc, n_q_heads, q, out, NULL, opts,
                       pool, workspace, workspace_size);
}

kvarn_status kvarn_attn_multi_lse(const kvarn_paged_kv *kv, const kvarn_seq_view *seqs,
                                  int n_seqs, const int32_t *query_start_loc,
                                  int n_q_heads, const float *q, float *out, float *lse,
                                  const kvarn_attn_opts *opts, kvarn_thread_pool *pool,
                                  void *workspace, size_t workspace_size)
{
    if (query_start_loc == NULL) return KVARN_ERR_INVALID_ARG;
    return attn_common(kv, seqs, n_seqs, query_start_loc, n_q_heads, q, out, lse, opts,
                       pool, workspace, workspace_size);
}
