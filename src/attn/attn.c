/*
 * attn.c -- the attention entry points: one call checked (attn_check.c),
 * sized and planned (attn_plan.c) with its kernels picked
 * (attn_dispatch.c), then run: the per-item loop over tiles, the
 * log-sum-exp merge of split chunks, and the final normalization and
 * inverse Hadamard rotation. The per-tile math lives in kernel_ref.c,
 * kernel_avx2.c and the kernel_avx512*.c files, reached through
 * kernel_table.c. Layout: include/kvarn/paged.h; method: docs/attention.md;
 * source: ../shared/spec/KVARN.md "Attention over records", "The fp16 tail
 * and the sink".
 */
#include <math.h>
#include <string.h>

#include "attn/attn_internal.h"
#include "cache/staging.h"
#include "codec/fp_convert.h"
#include "codec/hadamard.h"

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

/* Scratch arrays of one worker. */
static attn_rows rows_of(const attn_run *run, int worker, int n)
{
    const attn_geom *g = &run->g;
    float *f = run->thread_scratch + (size_t)worker * g->thread_floats;
    size_t R = (size_t)g->rows_alloc;
    attn_rows r;
    r.n = n;
    r.D = g->D;
    r.G = g->G;
    r.gs = g->gs;
    float *q = f; f += attn_round_f(R * g->D);
    r.q = q;
    r.acc = f; f += attn_round_f(R * g->D);
    r.qa = f; f += attn_round_f(R * g->D);
    r.qa_ready = ATTN_QA_NONE;
    r.s = f; f += attn_round_f(R * (size_t)r.gs);
    float *qsum = f; f += attn_round_f(R);
    r.qsum = qsum;
    r.m = f; f += attn_round_f(R);
    r.l = f; f += attn_round_f(R);
    r.rc = f; f += attn_round_f(R);
    r.lo = (int32_t *)f; f += attn_round_f(R);
    r.hi = (int32_t *)f; f += attn_round_f(R);
    r.psum = f; f += attn_round_f(R);
    r.meta = f; f += attn_round_f(3 * (size_t)g->D + 4 * (size_t)g->gs);
    r.tok = (const uint8_t **)f;
    f += attn_round_f((size_t)g->gs * sizeof(void *) / sizeof(float));
    r.mat = g->mat_floats ? (uint16_t *)f : NULL;
    f += g->mat_floats;
    r.x8 = g->x8_floats ? (uint8_t *)f : NULL;
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
static void finish_row(const attn_run *run, int head, float *acc, float m, float l, size_t out,
                       float *lse)
{
    const int D = run->g.D;
    const float s = sink_of(run, head);
    float *o = acc; /* o in place of acc (free after this) */
    if (s != -INFINITY) {
        const float mm = l > 0.0f && m > s ? m : s;
        const float w = l > 0.0f ? expf(m - mm) : 0.0f;
        const float ls = l * w + expf(s - mm);
        if (lse) *lse = mm + logf(ls);
        const float c = w / ls;
        for (int d = 0; d < D; d++) o[d] = acc[d] * c;
        if (run->g.is_kvarn && l > 0.0f) run->rotate(o, D);
    } else {
        if (lse) *lse = l > 0.0f ? m + logf(l) : -INFINITY;
        if (l > 0.0f) {
            float inv = 1.0f / l;
            for (int d = 0; d < D; d++) o[d] = acc[d] * inv;
            if (run->g.is_kvarn) run->rotate(o, D);
        } else {
            for (int d = 0; d < D; d++) o[d] = 0.0f;
        }
    }
    /* the caller's out: fp32, or bf16 rounded once (opts.io_bf16) */
    if (run->o.io_bf16) {
        uint16_t *dst = (uint16_t *)run->out + out;
        for (int d = 0; d < D; d++) dst[d] = kvarn__bf16_from_f32(o[d]);
    } else {
        memcpy((float *)run->out + out, o, (size_t)D * sizeof(float));
    }
}

/* Element offset of output row (sequence s, query qi, head) in out. */
static size_t out_row(const attn_run *run, int s, int qi, int head)
{
    return ((size_t)(attn_q_start(run, s) + qi) * run->g.Hq + head) * run->g.D;
}

static float *lse_at(const attn_run *run, int s, int qi, int head)
{
    return run->lse ? run->lse + (size_t)(attn_q_start(run, s) + qi) * run->g.Hq + head : NULL;
}

/* Staged token records (paged.h "Staging"), pointers in r->tok[0, nt) for
 * positions [t0, t0 + nt): one token-kernel call of the staging's
 * per-token format, as for a block of that format, or, for items of
 * ATTN_STAGED_MATRIX_MIN_QUERIES query tokens or more (prefill chunks)
 * where the records' matrix kernel runs, its per-token form
 * (kernel_amx.c). The AVX-512 int8 kernel and the matrix kernels keep
 * their rounded query in r->qa across calls (qa_ready says whose), where
 * the KVarN vector kernels keep theirs per tile: the flag is cleared on
 * both sides of the call (the records' matrix kernel then forms its bf16
 * query again). */
static void staged_tile(const attn_run *run, attn_rows *r, int t0, int nt)
{
    r->qa_ready = ATTN_QA_NONE;
    /* (that many query tokens are ATTN_MATRIX_MIN_ROWS rows or more:
     * attn_internal.h) */
    if (run->kern->kvarn_matrix && run->stage_set.token_matrix && r->mat &&
        r->n / run->g.group >= ATTN_STAGED_MATRIX_MIN_QUERIES)
        run->stage_set.token_matrix(r, &run->Ls, r->tok, t0, nt, run->stage_set.token_tile);
    else
        run->stage_set.token_tile(r, &run->Ls, r->tok, t0, nt);
    r->qa_ready = ATTN_QA_NONE;
}

static void item_task(void *ctx, int task, int worker)
{
    const attn_run *run = ctx;
    const attn_item *it = &run->items[task];
    const attn_geom *g = &run->g;
    const kvarn_paged_kv *kv = run->kv;
    const kvarn_seq_view *sv = &run->seqs[it->seq];
    const int D = g->D, G = g->G, n = it->nq * g->group, ql = attn_q_len(run, it->seq);
    attn_rows r = rows_of(run, worker, n);
    float *q = (float *)r.q, *qsum = (float *)r.qsum;
    int32_t *lo = (int32_t *)r.lo, *hi = (int32_t *)r.hi;

    /* Rows: query-major, then the heads of the GQA group. */
    for (int qi = 0; qi < it->nq; qi++) {
        for (int j = 0; j < g->group; j++) {
            int row = qi * g->group + j, head = it->kvh * g->group + j;
            const size_t src = ((size_t)(attn_q_start(run, it->seq) + it->q0 + qi) * g->Hq + head) * D;
            float *dst = q + (size_t)row * D, sum = 0.0f;
            if (run->o.io_bf16) {
                const uint16_t *q16 = (const uint16_t *)run->q + src;
                for (int d = 0; d < D; d++) dst[d] = kvarn__bf16_to_f32(q16[d]) * run->o.softmax_scale;
            } else {
                const float *q32 = run->q + src;
                for (int d = 0; d < D; d++) dst[d] = q32[d] * run->o.softmax_scale;
            }
            if (g->is_kvarn) run->rotate(dst, D);
            for (int d = 0; d < D; d++) sum += dst[d];
            qsum[row] = sum;
            attn_query_limits(run, sv->seq_len, ql, it->q0 + qi, &lo[row], &hi[row]);
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
            if (attn_tile_is_page(kv, sv, nx)) continue;
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
        } else if (staged && attn_tile_is_page(kv, sv, tile)) {
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
        } else if (attn_tile_is_page(kv, sv, tile)) {
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
                        attn_query_limits(run, sv->seq_len, ql, it->q0 + qi,
                                          &lo[qi * g->group + j], &hi[qi * g->group + j]);
        } else {
            /* A span of whole blocks; only a sequence's last block is partial. */
            int span = 0;
            for (int i = tile; i < end; i++) {
                int cnt = sv->seq_len - i * G < G ? sv->seq_len - i * G : G;
                for (int j = 0; j < cnt; j++)
                    r.tok[span++] = kvarn_paged_token_record(kv, sv->block_table[i], it->kvh, j);
            }
            if (run->kern->token_matrix && n >= ATTN_MATRIX_MIN_ROWS && r.mat)
                run->kern->token_matrix(&r, &run->L, r.tok, t0, span, run->kern->token_tile);
            else
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

/* Whether none of the n bf16 values is NaN or Inf (exponent all ones). */
static int bf16_all_finite(const uint16_t *x, size_t n)
{
    int ok = 1;
    for (size_t i = 0; i < n; i++) ok &= (x[i] & 0x7f80u) != 0x7f80u;
    return ok;
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
    run.o = attn_opts_or_default(opts, kv->head_dim);
    int total_q = n_seqs;
    if (qsl) {
        if (qsl[0] != 0) return KVARN_ERR_INVALID_ARG;
        for (int s = 0; s < n_seqs; s++)
            if (qsl[s + 1] < qsl[s]) return KVARN_ERR_INVALID_ARG;
        total_q = qsl[n_seqs];
    }
    int n_threads = kvarn_thread_pool_size(pool);
    kvarn_status st = attn_make_geom(kv, n_q_heads, n_seqs, total_q, n_threads, &run.o, &run.g);
    if (st != KVARN_OK) return st;
    st = kvarn_record_layout_get(&kv->fmt, kv->head_dim, &run.L);
    if (st != KVARN_OK) return st;
    st = attn_check_kv(kv, &run.L);
    if (st != KVARN_OK) return st;
    for (int s = 0; s < n_seqs; s++) {
        st = attn_check_seq(kv, &seqs[s]);
        if (st != KVARN_OK) return st;
        /* Causal multi-query: the queries are the sequence's last tokens.
         * Decode and non-causal queries may come after every key. */
        if (qsl && run.o.causal && attn_q_len(&run, s) > seqs[s].seq_len)
            return KVARN_ERR_INVALID_ARG;
    }
    const size_t q_elems = (size_t)total_q * n_q_heads * kv->head_dim;
    /* (io_bf16 is 0 or 1: attn_make_geom checked the options) */
    if (run.o.io_bf16 ? !bf16_all_finite((const uint16_t *)(const void *)q, q_elems)
                      : !kvarn__all_finite(q, q_elems))
        return KVARN_ERR_NONFINITE;
    if (run.o.sinks) /* -inf: no sink; NaN, +inf: refused */
        for (int h = 0; h < n_q_heads; h++)
            if (isnan(run.o.sinks[h]) || run.o.sinks[h] == INFINITY) return KVARN_ERR_NONFINITE;
    size_t need = attn_workspace_bytes(&run.g, n_threads);
    if (workspace == NULL || workspace_size < need) return KVARN_ERR_BUFFER_TOO_SMALL;

    /* Carve the workspace (64-byte aligned). */
    uintptr_t base = ((uintptr_t)workspace + 63) & ~(uintptr_t)63;
    float *f = (float *)base;
    run.thread_scratch = f;
    f += (size_t)n_threads * run.g.thread_floats;
    run.items = (attn_item *)f;
    f += attn_round_f(run.g.max_items * sizeof(attn_item) / sizeof(float) + 1);
    run.groups = (int *)f;
    f += attn_round_f(run.g.max_groups + 1);
    run.partials = f;
    run.rotate = kvarn__hadamard_pick(kv->head_dim);
    attn_pick_kernels(&run.o, kv->fmt.kind, kv->head_dim, kv->block_size, 0, &run.kern_set);
    run.kern = &run.kern_set;
    kvarn_format sf;
    if (kvarn__staging_format(kv->staging, &sf) > 0) {
        /* attn_check_kv accepted the view: KVarN, a record of the staging's
         * per-token format per staged token */
        st = kvarn_record_layout_get(&sf, kv->head_dim, &run.Ls);
        if (st != KVARN_OK) return st;
        attn_pick_kernels(&run.o, sf.kind, kv->head_dim, kv->block_size, 1, &run.stage_set);
        run.staged = 1;
    }

    if (!attn_plan(&run, n_seqs, n_threads)) return KVARN_ERR_BUFFER_TOO_SMALL;

    /* Sequences with no context: zero output, lse -inf, or the head's sink
     * logit (finish_row) (decode, and non-causal multi-query; causal has
     * attn_q_len <= seq_len = 0). */
    for (int s = 0; s < n_seqs; s++) {
        if (seqs[s].seq_len != 0) continue;
        size_t rows = (size_t)attn_q_len(&run, s) * n_q_heads;
        const size_t esz = run.o.io_bf16 ? sizeof(uint16_t) : sizeof(float);
        memset((char *)out + (size_t)attn_q_start(&run, s) * n_q_heads * kv->head_dim * esz, 0,
               rows * kv->head_dim * esz);
        if (lse)
            for (size_t i = 0; i < rows; i++)
                lse[(size_t)attn_q_start(&run, s) * n_q_heads + i] = sink_of(&run, (int)(i % n_q_heads));
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
