/*
 * attn_plan.c -- the size and the work plan of one attention call: its
 * geometry (query rows per work item, kernel spans, per-worker scratch) and
 * workspace bytes, every count checked in 64 bits (common/checked.h), and
 * the list of work items (sequence, KV head, query block, split-K chunk of
 * whole tiles) the workers of attn.c take. Deterministic: the plan depends
 * only on the shapes, the options and the thread count. Method:
 * docs/attention.md "Threads and split-K".
 */
#include <math.h>
#include <string.h>

#include "attn/attn_internal.h"
#include "cache/staging.h"
#include "common/checked.h"

/* Query rows (query tokens x GQA heads) one work item carries at most
 * (for a GQA group of at most 512 heads), where a call has enough items for
 * its threads (attn_plan). 512 rows keep a 128-query chunk (the vLLM
 * plug-in's per-tile groups, docs/vllm.md "A step") one item for groups
 * up to 4: each record tile is then dequantized and its metadata read once
 * per chunk and KV head, not twice as with 256 rows
 * (docs/attention-matrix.md "Speed and quality"). */
#define ROWS_TARGET 512
/* ... and in a call with fewer than 4 such items per thread (more than one
 * thread): the items of ROWS_TARGET's earlier value, so that such a call
 * is planned as before (its items, their split-K chunks), the work shared
 * out over more items. */
#define ROWS_FEW 256
/* Per-token formats: one kernel call takes a span of whole blocks of at
 * least this many tokens, to spread the per-call softmax work. */
#define SPAN_TOKENS 128 /* and SPAN_TOKENS <= ATTN_PREFETCH_MAX */
/* Auto split-K keeps at least this many tokens in a chunk. */
#define SPLIT_MIN_TOKENS 512

/* attn_round_f in 64 bits for the checked sizes, for n < 2^63. */
static uint64_t round_u64(uint64_t n)
{
    return (n + ATTN_ALIGN_F - 1) / ATTN_ALIGN_F * ATTN_ALIGN_F;
}

/* Per-worker scratch in floats, checked (common/checked.h): 0 when the sum
 * fits, 1 when it overflows. */
static int thread_scratch_floats(int rows, int D, int gs_, uint64_t mat, uint64_t x8,
                                 uint64_t tail, size_t *out)
{
    /* rows < 2^31, D <= 1024 (format check), gs <= 4103: no term can come
     * near 2^63, so the roundings cannot wrap; the products and the sum are
     * checked all the same. */
    const uint64_t R = (uint64_t)rows, gs = (uint64_t)gs_;
    uint64_t rd, rs, sum = 0;
    int bad = kvarn__mul_u64(R, (uint64_t)D, &rd) | kvarn__mul_u64(R, gs, &rs);
    if (bad) return 1;
    const uint64_t t[8] = {
        3 * round_u64(rd),                                /* q, acc, qa */
        round_u64(rs),                                    /* s */
        7 * round_u64(R),                  /* qsum, m, l, rc, lo, hi, psum */
        round_u64(3 * (uint64_t)D + 4 * gs),              /* tile metadata */
        round_u64(gs * sizeof(void *) / sizeof(float)),   /* token pointers */
        mat,                          /* the matrix kernel's unpacked codes */
        x8,                /* the int8 / int4 integer path's (attn_rows.x8) */
        tail,                                  /* gathered tail tile, last */
    };
    for (int i = 0; i < 8; i++) bad |= kvarn__add_u64(sum, t[i], &sum);
    return bad | kvarn__u64_to_size(sum, out);
}

/* Geometry and workspace bounds; 0 on success, else a status. */
kvarn_status attn_make_geom(const kvarn_paged_kv *kv, int n_q_heads, int max_seqs,
                            int max_total_q, int n_threads,
                            const kvarn_attn_opts *o, attn_geom *g)
{
    kvarn_status st = kvarn_format_check_head_dim(&kv->fmt, kv->head_dim);
    if (st != KVARN_OK) return st;
    if (kv->n_kv_heads < 1 || n_q_heads < 1 || n_q_heads % kv->n_kv_heads != 0 ||
        max_seqs < 0 || max_total_q < 0 || n_threads < 1 || !attn_opts_valid(o))
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
    g->qblock_few = g->group >= ROWS_FEW ? 1 : ROWS_FEW / g->group; /* <= qblock */
    int qb = g->qblock < (max_total_q > 0 ? max_total_q : 1) ? g->qblock
                                                            : (max_total_q > 0 ? max_total_q : 1);
    g->rows_max = qb * g->group;
    /* Every count below is formed in 64 bits with checked products: a
     * geometry whose workspace (or query array) does not fit size_t is
     * refused here, never wrapped into a small size. */
    /* small tail pages: K and V fp16 [G][D], i.e. G * D floats (G <= 4096,
     * D <= 1024), gathered per tail tile (item_task) */
    g->tail_floats = kvarn_paged_small_tail(kv) ? attn_round_f((size_t)g->G * (size_t)g->D) : 0;
    /* the matrix kernel's codes, bf16 [2][D][G] (D G floats), wherever a
     * work item may take it: independent of the CPU, */
    /* (KVarN: G tokens a tile; the int4, int8, fp8 and bf16 formats'
     * per-token blocks: spans of attn_token_matrix_span(gs)) */
    const int mG = g->is_kvarn ? g->G : attn_token_matrix_span(g->gs);
    const int x2 = kv->fmt.kind == KVARN_KIND_INT8; /* two bf16 halves */
    /* (every kind's items of that many rows take r->mat: the vector
     * kernels' span codes as fp32, below; the matrix kernels' kinds) */
    const int mat = g->rows_max >= ATTN_MATRIX_MIN_ROWS && attn_matrix_geometry(g->D, mG);
    const kvarn_kind fk = kv->fmt.kind;
    const int mat_kind = g->is_kvarn || fk == KVARN_KIND_INT4 || x2 || attn_kind_bf16_exact(fk);
    g->rows_alloc = mat && mat_kind ? (g->rows_max + 15) / 16 * 16 : g->rows_max;
    /* and the rows' weights, bf16 [rows][G] (rows_alloc <= 512 for
     * groups up to 512, D <= 512, G <= 128), twice for the int8 format (kernel_amx.c token_span),
     * beside room for bf16 [rows][D] that no kernel uses since the
     * queries moved into the rows' qa (kernel_amx.c rows_query): kept, so
     * that kvarn_attn_workspace_bytes did not change with it */
    g->mat_floats = mat && mat_kind ? attn_round_f((size_t)g->D * (size_t)mG + (size_t)(x2 ? 2 : 1) * (size_t)g->rows_alloc *
                                                                       ((size_t)g->D + (size_t)mG) / 2)
                        : 0;
    /* the vector kernels' K and V codes of a per-token span as fp32,
     * [2][D][mG] (kernel_avx2.c tm_span, kernel_avx512.h tm_span_f32),
     * in the same scratch */
    if (mat && g->mat_floats < attn_round_f(2 * (size_t)g->D * (size_t)mG))
        g->mat_floats = attn_round_f(2 * (size_t)g->D * (size_t)mG);
    /* The AVX-512 int8 / int4 integer path's scratch (attn_rows.x8),
     * wherever int8 or int4 records are read (the formats' blocks, a KVarN
     * view's int8 or int4 staging), independent of the CPU: a span's
     * record pointers and K codes transposed once, and for int4 its
     * tokens' K and V codes widened to bytes, for spans of up to
     * I8_SPAN_MAX tokens at the head_dim the integer path takes */
    kvarn_format sf;
    const kvarn_kind rk = g->is_kvarn ? (kvarn__staging_format(kv->staging, &sf) > 0 ? sf.kind : KVARN_KIND_FP16)
                                      : kv->fmt.kind;
    const size_t xs = (size_t)(g->gs < I8_SPAN_MAX ? g->gs : I8_SPAN_MAX);
    g->x8_floats = (rk == KVARN_KIND_INT8 || rk == KVARN_KIND_INT4) && attn_avx512_int8_int16(g->D, 1)
                       ? attn_round_f((I8_X8_WIDE(g->D) + (rk == KVARN_KIND_INT4 ? 2 * (size_t)g->D * xs : 0) + 3) / 4)
                       : 0;
    int bad = thread_scratch_floats(g->rows_alloc, g->D, g->gs, g->mat_floats, g->x8_floats,
                                    g->tail_floats, &g->thread_floats);
    uint64_t q_floats, base, split_chunks = 0, partial;
    bad |= kvarn__mul3_u64((uint64_t)max_total_q, (uint64_t)n_q_heads, (uint64_t)g->D, &q_floats);
    bad |= kvarn__mul_u64((uint64_t)g->Hk,
                          (uint64_t)max_seqs + kvarn__ceil_div_u64((uint64_t)max_total_q,
                                                                   (uint64_t)g->qblock_few),
                          &base);
    /* Items: forced split s: at most base * s. Auto (attn_plan()): unsplit,
     * at most base (counted with qblock_few <= qblock, the smaller of the
     * items attn_plan may take); split only when n_base < 4 * threads,
     * into fewer than n_base + 4 * threads < 8 * threads chunks. */
    const int split_k = attn_split_k_of(o);
    if (split_k >= 2) bad |= kvarn__mul_u64(base, (uint64_t)split_k, &split_chunks);
    else if (split_k == 0) split_chunks = 8 * (uint64_t)n_threads;
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

size_t attn_workspace_bytes(const attn_geom *g, int n_threads)
{
    (void)n_threads; /* counted by attn_make_geom */
    return g->ws_bytes;
}

kvarn_attn_opts attn_opts_or_default(const kvarn_attn_opts *opts, int head_dim)
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
    kvarn_attn_opts o = attn_opts_or_default(opts, kv->head_dim);
    attn_geom g;
    if (attn_make_geom(kv, n_q_heads, max_seqs, max_total_q, n_threads, &o, &g) != KVARN_OK)
        return 0;
    return attn_workspace_bytes(&g, n_threads);
}

/* Tiles that any query in [q0, q0 + nq) may see. */
static void item_tiles(const attn_run *run, int s, int q0, int nq, int *t0, int *t1)
{
    const kvarn_seq_view *sv = &run->seqs[s];
    int32_t lo0, hi0, lo1, hi1;
    attn_query_limits(run, sv->seq_len, attn_q_len(run, s), q0, &lo0, &hi0);
    attn_query_limits(run, sv->seq_len, attn_q_len(run, s), q0 + nq - 1, &lo1, &hi1);
    int lo = lo0 < lo1 ? lo0 : lo1, hi = hi0 > hi1 ? hi0 : hi1;
    if (hi < lo) { *t0 = *t1 = 0; return; }
    *t0 = lo / run->g.G;
    *t1 = hi / run->g.G + 1;
}

/* The call's base items (sequence, KV head, block of qblock queries),
 * counted in 64 bits. */
static int64_t base_items(const attn_run *run, int n_seqs, int qblock)
{
    int64_t n = 0;
    for (int s = 0; s < n_seqs; s++) {
        const int64_t ql = attn_q_len(run, s);
        if (ql > 0 && run->seqs[s].seq_len > 0) n += (int64_t)run->g.Hk * ((ql + qblock - 1) / qblock);
    }
    return n;
}

/* Build the item list: (sequence, KV head, query block) base items, each
 * split into chunks of whole tiles when split-K applies. Deterministic:
 * depends only on the shapes, the options and the thread count. */
int attn_plan(attn_run *run, int n_seqs, int n_threads)
{
    const attn_geom *g = &run->g;
    /* Items of g->qblock queries, or of g->qblock_few where the larger
     * ones are fewer than 4 per thread (ROWS_FEW) */
    const int64_t n_big = base_items(run, n_seqs, g->qblock);
    const int qblock = n_threads == 1 || n_big >= 4 * (int64_t)n_threads ? g->qblock : g->qblock_few;
    const int64_t n_base = qblock == g->qblock ? n_big : base_items(run, n_seqs, qblock);
    int want = 1;
    const int split_k = attn_split_k_of(&run->o);
    if (split_k >= 2) want = split_k;
    else if (split_k == 0 && n_threads > 1 && n_base > 0 && n_base < 4 * (int64_t)n_threads)
        want = (int)((4 * (int64_t)n_threads + n_base - 1) / n_base); /* ~4 chunks per worker */
    int min_tiles = split_k >= 2 ? 1 : (SPLIT_MIN_TOKENS + g->G - 1) / g->G;

    int n = 0, ng = 0;
    size_t poff = 0;
    for (int s = 0; s < n_seqs; s++) {
        int ql = attn_q_len(run, s);
        if (ql <= 0 || run->seqs[s].seq_len <= 0) continue;
        for (int64_t q0l = 0; q0l < ql; q0l += qblock) { /* 64 bits: ql near 2^31 */
            const int q0 = (int)q0l;
            int nq = ql - q0 < qblock ? ql - q0 : qblock;
            int t0, t1;
            item_tiles(run, s, q0, nq, &t0, &t1);
            int span = t1 - t0, nc = want;
            if (nc > span / min_tiles) nc = span / min_tiles;
            if (nc < 1) nc = 1;
            for (int h = 0; h < g->Hk; h++) {
                /* The bounds of attn_make_geom hold by construction; checked anyway
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
