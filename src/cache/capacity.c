/*
 * capacity.c -- the budget plan of a kvarn_cache and what it holds: opts
 * checked and the byte budget split into fp16 pages, small tail pages, sink
 * slots and quantized blocks (kvarn__cache_geometry, kvarn_cache_plan; no
 * allocation), every byte kvarn_cache_create and the sequences will ask for
 * (kvarn_cache_capacity_get), and the searches over budgets
 * (kvarn_cache_fit_budget, kvarn_cache_seqs_fit). docs/capacity.md "How
 * capacity is computed", docs/paged-cache.md "Capacity".
 */
#include <limits.h>
#include <string.h>

#include "cache/cache_internal.h"
#include "cache/staging.h"
#include "common/checked.h"

#define DEFAULT_PER_TOKEN_BLOCK 16   /* vLLM's default block size */
#define MAX_BLOCK_SIZE 1024
#define MAX_IDS (1 << 30)            /* block/page ids stay far from INT32_MAX */

_Static_assert(KVARN_CACHE_MAX_SEQ_LEN <= INT_MAX - MAX_BLOCK_SIZE,
               "max_tiles * G must fit an int");

/* Bytes of one sequence's bookkeeping (seq_open in sequence.c): the block
 * table, tile -> block and tile -> page arrays of max_tiles int32 each, the
 * small tail page array of max_tiles * per_tile int32 (per_tile = G / T with
 * small tail pages, else 0), the written length of every layer, and for
 * KVarN (marks = 1) one byte per tile and layer (the exact-record marks,
 * kvarn_seq.exact; per-token formats have none). */
static int seq_bytes(uint64_t max_tiles, uint64_t per_tile, uint64_t n_layers, int marks,
                     size_t *out)
{
    uint64_t tables, small, written, exact, total;
    int bad = kvarn__mul3_u64(3, max_tiles, sizeof(int32_t), &tables);
    bad |= kvarn__mul3_u64(per_tile, max_tiles, sizeof(int32_t), &small);
    bad |= kvarn__add_u64(tables, small, &tables);
    bad |= kvarn__mul_u64(n_layers, sizeof(int), &written);
    bad |= kvarn__add_u64(tables, written, &total);
    /* the exact-record marks, one byte per tile and layer (kvarn_seq) */
    bad |= kvarn__mul_u64(marks ? max_tiles : 0, n_layers, &exact);
    bad |= kvarn__add_u64(total, exact, &total);
    return bad | kvarn__u64_to_size(total, out);
}

/* Check opts and work out the geometry into *info (no allocation). Every
 * count and byte size is formed in 64 bits with checked products
 * (common/checked.h); one that does not fit, or an arena or a sequence's
 * bookkeeping larger than size_t, is KVARN_ERR_TOO_LARGE here, before
 * kvarn_cache_create allocates anything.
 * sizing = 1: budget_bytes 0 is accepted and gives n_blocks 0 (see
 * kvarn_cache_plan). */
kvarn_status kvarn__cache_geometry(const kvarn_cache_opts *o, kvarn_cache_info *info,
                                   kvarn_record_layout *layout, int sizing)
{
    memset(info, 0, sizeof *info);
    if (o->n_layers < 1 || o->n_kv_heads < 1 || o->max_seqs < 1 ||
        o->max_seq_len < 0 || o->n_pages < 0 || o->block_size < 0 ||
        o->n_layers > KVARN_CACHE_MAX_LAYERS || o->n_kv_heads > KVARN_CACHE_MAX_KV_HEADS ||
        o->max_seqs > 1000000 ||
        o->balance_iters < 0 || o->balance_iters > 64 ||
        (o->rtn_range < KVARN_RTN_MINMAX || o->rtn_range > KVARN_RTN_MSE_V))
        return KVARN_ERR_INVALID_ARG;
    kvarn_status st = kvarn_record_layout_get(&o->format, o->head_dim, layout);
    if (st != KVARN_OK) return st;

    const int is_kvarn = o->format.kind == KVARN_KIND_KVARN;
    int G, sink, part = 0, T = 0, small = 0;
    if (is_kvarn) {
        G = o->format.tile_tokens;
        if (o->block_size != 0 && o->block_size != G) return KVARN_ERR_INVALID_ARG;
        if (o->sink_tokens < 0 || o->sink_tokens > 1024 * G) return KVARN_ERR_INVALID_ARG;
        if (o->sink_tokens > 0) {
            /* S tokens: whole sink tiles, then r tokens kept in a slot */
            sink = o->sink_tokens / G;
            part = o->sink_tokens % G;
        } else {
            if (o->sink_tiles < 0 || o->sink_tiles > 1024) return KVARN_ERR_INVALID_ARG;
            sink = o->sink_tiles;
        }
        /* tail pages of T tokens: T divides G; 0 or G = whole pages */
        if (o->tail_page_tokens < 0 || o->tail_page_tokens > G ||
            (o->tail_page_tokens > 0 && G % o->tail_page_tokens != 0))
            return KVARN_ERR_INVALID_ARG;
        T = o->tail_page_tokens ? o->tail_page_tokens : G;
        small = T < G;
    } else {
        G = o->block_size ? o->block_size : DEFAULT_PER_TOKEN_BLOCK;
        if (G > MAX_BLOCK_SIZE) return KVARN_ERR_INVALID_ARG;
        if (o->n_pages != 0) return KVARN_ERR_INVALID_ARG;
        sink = 0;
    }
    /* staged tokens: fp16 rows or records of the staging's per-token
     * format (paged.h "Staging"); per-token formats stage nothing */
    kvarn_format sf;
    const int stage_recs = kvarn__staging_format(o->staging, &sf);
    if (stage_recs < 0) return KVARN_ERR_INVALID_ARG;
    uint64_t stage_rec = 0; /* bytes of one staged token record */
    if (is_kvarn && stage_recs) {
        stage_rec = kvarn_record_bytes(&sf, o->head_dim);
        if (stage_rec == 0) return KVARN_ERR_UNSUPPORTED_HEAD_DIM;
    }
    /* Token positions and ids are int32: a sequence longer than this, or
     * more pages than ids, cannot be held (not clamped: the caller asked
     * for it). */
    if (o->n_tail_pages < 0 || (!small && o->n_tail_pages != 0)) return KVARN_ERR_INVALID_ARG;
    if (o->max_seq_len > KVARN_CACHE_MAX_SEQ_LEN || o->n_pages > MAX_IDS ||
        o->n_tail_pages > MAX_IDS)
        return KVARN_ERR_TOO_LARGE;

    const uint64_t L = (uint64_t)o->n_layers, H = (uint64_t)o->n_kv_heads;
    const uint64_t D = (uint64_t)o->head_dim;
    int bad = 0;
    uint64_t record_stride, token_record = 0;
    if (is_kvarn) {
        record_stride = layout->record_bytes;
    } else {
        token_record = layout->record_bytes;
        bad |= kvarn__mul_u64((uint64_t)G, token_record, &record_stride);
    }
    uint64_t block_stride, block_bytes, page_bytes = 0, tail_page_bytes = 0;
    bad |= kvarn__mul_u64(H, record_stride, &block_stride);
    bad |= kvarn__mul_u64(L, block_stride, &block_bytes);
    /* bytes of one staged token-head: K and V, D fp16 each, or one token
     * record of the staging's format (paged.h "Staging") */
    const uint64_t stage_tok = stage_rec ? stage_rec : 2 * D * sizeof(uint16_t);
    /* G staged tokens per layer and KV head */
    if (is_kvarn) bad |= kvarn__mul3_u64(L * H, (uint64_t)G, stage_tok, &page_bytes);
    if (small) bad |= kvarn__mul3_u64(L * H, (uint64_t)T, stage_tok, &tail_page_bytes);

    uint64_t n_pages = (uint64_t)o->n_pages, n_tail = (uint64_t)o->n_tail_pages;
    const uint64_t S = (uint64_t)o->max_seqs, reserve = kvarn__ceil_div_u64(S, 8);
    if (is_kvarn && n_pages == 0) {
        /* auto: each sequence its sink and one tail page, and a shared
         * reserve of one page per 8 sequences for tokens in flight across
         * a tile boundary (a verified draft or a chunk not yet committed);
         * with small tail pages the whole pages hold the sink only */
        n_pages = small ? S * (uint64_t)sink : S * (uint64_t)(sink + 1) + reserve;
    }
    if (small && n_tail == 0) {
        /* auto: G / T small pages per sequence (a tail tile filled to G
         * tokens before its commit) and the reserve, in small pages */
        n_tail = (S + reserve) * (uint64_t)(G / T); /* <= 2^21 * 2^10 */
    }
    if (n_pages > MAX_IDS || n_tail > MAX_IDS) return KVARN_ERR_TOO_LARGE;
    uint64_t page_total, tail_total, sink_bytes = 0, sink_total = 0, fixed_total;
    bad |= kvarn__mul_u64(n_pages, page_bytes, &page_total);
    bad |= kvarn__mul_u64(n_tail, tail_page_bytes, &tail_total);
    bad |= kvarn__add_u64(page_total, tail_total, &page_total);
    /* the sink slots: K and V, r x D fp16 each, per layer and KV head, one
     * slot per sequence */
    if (part > 0) {
        bad |= kvarn__mul3_u64(L * H, (uint64_t)part, stage_tok, &sink_bytes);
        bad |= kvarn__mul_u64((uint64_t)o->max_seqs, sink_bytes, &sink_total);
    }
    bad |= kvarn__add_u64(page_total, sink_total, &fixed_total);
    if (bad) return KVARN_ERR_TOO_LARGE;

    uint64_t n_blocks = 0;
    if (!(sizing && o->budget_bytes == 0)) {
        if (o->budget_bytes < fixed_total || o->budget_bytes - fixed_total < block_bytes)
            return KVARN_ERR_INVALID_ARG;
        n_blocks = (o->budget_bytes - fixed_total) / block_bytes;
    }
    /* budget_bytes is an upper bound: a budget beyond MAX_IDS blocks buys
     * MAX_IDS blocks (info.n_blocks and arena_bytes say so). */
    if (n_blocks > MAX_IDS) n_blocks = MAX_IDS;

    uint64_t max_len = (uint64_t)o->max_seq_len;
    if (max_len == 0) {
        /* auto: every block and every sink tile, as far as the limit goes */
        max_len = (n_blocks + (uint64_t)sink) * (uint64_t)G; /* < 2^41 */
        if (max_len > KVARN_CACHE_MAX_SEQ_LEN) max_len = KVARN_CACHE_MAX_SEQ_LEN;
    }

    /* What kvarn_cache_create allocates must be expressible as size_t:
     * both arenas (plus the 64 bytes of alignment slack arena64 adds) and
     * one sequence's bookkeeping. */
    uint64_t block_total, arena_bytes, slack;
    bad |= kvarn__mul_u64(n_blocks, block_bytes, &block_total);
    bad |= kvarn__add_u64(block_total, fixed_total, &arena_bytes);
    size_t sz, sb;
    bad |= kvarn__add_u64(block_total, 64, &slack) | kvarn__u64_to_size(slack, &sz);
    bad |= kvarn__add_u64(page_total, 64, &slack) | kvarn__u64_to_size(slack, &sz);
    bad |= kvarn__add_u64(sink_total, 64, &slack) | kvarn__u64_to_size(slack, &sz);
    bad |= kvarn__u64_to_size(sink_bytes, &sb);
    bad |= seq_bytes(kvarn__ceil_div_u64(max_len, (uint64_t)G), small ? (uint64_t)(G / T) : 0, L,
                     is_kvarn, &sz);
    size_t rs, bs, bb, pb, tb;
    bad |= kvarn__u64_to_size(record_stride, &rs) | kvarn__u64_to_size(block_stride, &bs);
    bad |= kvarn__u64_to_size(block_bytes, &bb) | kvarn__u64_to_size(page_bytes, &pb);
    bad |= kvarn__u64_to_size(tail_page_bytes, &tb);
    if (bad) return KVARN_ERR_TOO_LARGE;

    info->format = o->format;
    info->n_layers = o->n_layers;
    info->n_kv_heads = o->n_kv_heads;
    info->head_dim = o->head_dim;
    info->block_size = G;
    info->sink_tiles = sink;
    info->n_blocks = (int)n_blocks;
    info->n_pages = (int)n_pages;
    info->max_seqs = o->max_seqs;
    info->max_seq_len = (int)max_len;
    info->record_stride = rs;
    info->block_stride = bs;
    info->token_record_bytes = (size_t)token_record;
    info->block_bytes = bb;
    info->page_bytes = pb;
    info->arena_bytes = arena_bytes;
    info->capacity_tokens = n_blocks * (uint64_t)G;
    info->sink_tokens = sink * G + part; /* <= 1024 * G <= 2^17 */
    info->sink_partial = part;
    info->sink_bytes = sb;
    info->tail_page_tokens = T;
    info->n_tail_pages = (int)n_tail;
    info->tail_page_bytes = tb;
    info->staging = is_kvarn ? o->staging : KVARN_STAGING_FP16; /* per-token: none staged */
    info->staging_record_bytes = (size_t)stage_rec;
    return KVARN_OK;
}

kvarn_status kvarn_cache_plan(const kvarn_cache_opts *opts, kvarn_cache_info *out)
{
    if (opts == NULL || out == NULL) return KVARN_ERR_INVALID_ARG;
    kvarn_cache_info info;
    kvarn_record_layout layout;
    kvarn_status st = kvarn__cache_geometry(opts, &info, &layout, 1);
    if (st == KVARN_OK) *out = info;
    return st;
}

/* What alloc64 (cache.c) asks the allocator for: rounded to 64 bytes, plus the
 * alignment slack and the saved pointer of kvarn__malloc_aligned. */
static uint64_t aligned_bytes(uint64_t b)
{
    return b ? ((b + 63) & ~(uint64_t)63) + 64 + sizeof(void *) : 0;
}

/* Tokens one sequence reaches in the fill of kvarn_cache_capacity (grown a
 * token at a time, committed as it goes) with *B free blocks, *P free pages
 * and *TP free small tail pages, at most max_len tokens; takes what it holds
 * from them. */
static uint64_t fill_one(const kvarn_cache_info *in, uint64_t max_len, uint64_t *B, uint64_t *P,
                         uint64_t *TP)
{
    const uint64_t G = (uint64_t)in->block_size;
    if (in->format.kind != KVARN_KIND_KVARN) {
        uint64_t len = *B * G < max_len ? *B * G : max_len;
        *B -= kvarn__ceil_div_u64(len, G);
        return len;
    }
    const uint64_t S = (uint64_t)in->sink_tiles;
    /* the sink: one page per tile, never released */
    uint64_t sink_len = (S < *P ? S : *P) * G;
    if (sink_len > max_len) sink_len = max_len;
    *P -= kvarn__ceil_div_u64(sink_len, G);
    if (sink_len < S * G || sink_len == max_len || *B == 0) return sink_len;
    const uint64_t rest = max_len - sink_len;
    if (in->n_tail_pages > 0) {
        /* small tail pages of T tokens: a tile is filled G / T pages deep
         * before its commit gives them back, so full tiles need that many
         * free; with fewer, the first tile fills as far as the pages go */
        const uint64_t T = (uint64_t)in->tail_page_tokens, Q = G / T;
        if (*TP < Q) {
            uint64_t n = *TP * T < rest ? *TP * T : rest; /* < G */
            if (n == 0) return sink_len;
            *B -= 1;
            *TP -= kvarn__ceil_div_u64(n, T);
            return sink_len + n;
        }
        uint64_t full = rest / G < *B ? rest / G : *B;
        *B -= full;
        uint64_t len = sink_len + full * G;
        if (full == rest / G && rest % G != 0 && *B > 0) {
            /* a partial tail tile keeps its block and its small pages */
            *B -= 1;
            *TP -= kvarn__ceil_div_u64(rest % G, T);
            len = max_len;
        }
        return len;
    }
    if (*P == 0) return sink_len;
    /* full tiles: a block each (the page they wait in comes back at commit) */
    uint64_t full = rest / G < *B ? rest / G : *B;
    *B -= full;
    uint64_t len = sink_len + full * G;
    if (full == rest / G && rest % G != 0 && *B > 0) {
        /* a partial tail tile keeps its block and its page */
        *B -= 1;
        *P -= 1;
        len = max_len;
    }
    return len;
}

kvarn_status kvarn_cache_capacity_get(const kvarn_cache_opts *opts, int n_seqs,
                                      int seq_len, kvarn_cache_capacity *out)
{
    if (opts == NULL || out == NULL || n_seqs < 1 || n_seqs > opts->max_seqs || seq_len < 0)
        return KVARN_ERR_INVALID_ARG;
    kvarn_cache_capacity cap;
    memset(&cap, 0, sizeof cap);
    kvarn_record_layout layout;
    kvarn_status st = kvarn__cache_geometry(opts, &cap.info, &layout, 1);
    if (st != KVARN_OK) return st;
    const kvarn_cache_info *in = &cap.info;
    const uint64_t G = (uint64_t)in->block_size, S = (uint64_t)in->sink_tiles;
    const uint64_t NB = (uint64_t)in->n_blocks, NP = (uint64_t)in->n_pages;
    const uint64_t NTP = (uint64_t)in->n_tail_pages;
    const uint64_t Q = NTP ? G / (uint64_t)in->tail_page_tokens : 0; /* small pages per tile */
    const uint64_t L = (uint64_t)in->n_layers, max_seqs = (uint64_t)in->max_seqs;
    const int is_kvarn = in->format.kind == KVARN_KIND_KVARN;

    /* Bookkeeping: what kvarn_cache_create and max_seqs seq_create
     * allocate besides the arenas (the 64 alignment bytes of each arena
     * included). kvarn__cache_geometry checked each term; the sum of these
     * few is far below 2^64 (max_seqs <= 10^6, a table < 2^34 bytes). */
    const uint64_t max_tiles = kvarn__ceil_div_u64((uint64_t)in->max_seq_len, G);
    const uint64_t GD = G * (uint64_t)in->head_dim;
    const uint64_t ws = kvarn_encode_workspace_bytes(&in->format, in->head_dim);
    uint64_t books = sizeof(kvarn_cache) + max_seqs * sizeof(kvarn_seq) + 8 * (NB + NP + NTP) +
                     max_seqs * ((3 + Q) * max_tiles * sizeof(int32_t) + L * sizeof(int) +
                                 (is_kvarn ? max_tiles * L : 0)) +
                     2 * aligned_bytes(GD * sizeof(float)) +
                     aligned_bytes((uint64_t)in->head_dim * sizeof(float)) +
                     aligned_bytes(ws) + (NB ? 64 : 0) + (NP ? 64 : 0) + (NTP ? 64 : 0) +
                     (in->sink_bytes ? 64 : 0);
    cap.books_bytes = books;
    if (kvarn__add_u64(in->arena_bytes, books, &cap.total_bytes)) return KVARN_ERR_TOO_LARGE;

    /* the fill of n_seqs sequences, one after the other */
    uint64_t B = NB, P = NP, TP = NTP;
    for (int i = 0; i < n_seqs; i++)
        cap.tokens += fill_one(in, (uint64_t)in->max_seq_len, &B, &P, &TP);

    /* one sequence of seq_len tokens */
    const uint64_t nt = kvarn__ceil_div_u64((uint64_t)seq_len, G);
    uint64_t sb, sp, open = 0, stp = 0, peak = 0;
    if (is_kvarn && NTP > 0) {
        /* small tail pages: the sink in whole pages, the partial tail tile
         * in ceil((seq_len mod G) / T) small pages, and while growing up
         * to G / T of them once a non-sink tile filled */
        const uint64_t T = (uint64_t)in->tail_page_tokens;
        sb = nt > S ? nt - S : 0;
        sp = nt < S ? nt : S;
        stp = nt > S ? kvarn__ceil_div_u64((uint64_t)seq_len % G, T) : 0;
        peak = (uint64_t)seq_len / G > S ? Q : stp;
    } else if (is_kvarn) {
        sb = nt > S ? nt - S : 0;
        sp = (nt < S ? nt : S) + (nt > S && (uint64_t)seq_len % G != 0);
        open = nt > S && (uint64_t)seq_len % G == 0;
    } else {
        sb = nt;
        sp = 0;
    }
    cap.seq_blocks = (int)sb;   /* <= 2^30 tiles: seq_len is an int */
    cap.seq_pages = (int)sp;
    cap.seq_tail_pages = (int)stp; /* <= G / T <= 1024 */
    /* a KVarN sequence also holds its sink slot (r > 0; 0 bytes else) */
    cap.seq_arena_bytes = sb * (uint64_t)in->block_bytes + sp * (uint64_t)in->page_bytes +
                          stp * (uint64_t)in->tail_page_bytes +
                          (is_kvarn ? (uint64_t)in->sink_bytes : 0);
    uint64_t k = 0;
    if (seq_len <= in->max_seq_len) {
        k = max_seqs;
        if (sb > 0 && NB / sb < k) k = NB / sb;
        if (sp + open > 0) {
            /* k * sp + open <= NP */
            uint64_t kp = NP >= open ? (NP - open) / (sp ? sp : 1) : 0;
            if (sp == 0 && NP < open) kp = 0;
            if (sp == 0 && NP >= open) kp = k;
            if (kp < k) k = kp;
        }
        if (peak > 0) {
            /* (k - 1) * stp + peak <= NTP, peak >= stp */
            uint64_t kt = NTP < peak ? 0 : (stp ? 1 + (NTP - peak) / stp : k);
            if (kt < k) k = kt;
        }
    }
    cap.seqs = (int)k;
    *out = cap;
    return KVARN_OK;
}

kvarn_status kvarn_cache_fit_budget(const kvarn_cache_opts *opts, uint64_t total_budget,
                                    kvarn_cache_opts *out)
{
    if (opts == NULL || out == NULL) return KVARN_ERR_INVALID_ARG;
    /* b -> total_bytes(b) is non-decreasing (blocks and their bookkeeping
     * grow with the arenas' share b), and the plan refuses a b below the
     * pages plus one block with KVARN_ERR_INVALID_ARG. So "b is too small
     * to plan, or its total fits" holds exactly for b up to the largest
     * share that fits: bisect for it over (0, total_budget]. (Giving the
     * overshoot back step by step stalls when it is smaller than the
     * slack inside the last block: no block is dropped.) */
    kvarn_cache_opts o = *opts;
    kvarn_cache_capacity cap;
    o.budget_bytes = total_budget;
    if (total_budget == 0) return KVARN_ERR_INVALID_ARG; /* 0 means "sizing" to the plan */
    kvarn_status st = kvarn_cache_capacity_get(&o, 1, 0, &cap);
    if (st != KVARN_OK) return st; /* bad opts, or not even the whole budget plans */
    if (cap.total_bytes <= total_budget) {
        *out = o;
        return KVARN_OK;
    }
    uint64_t lo = 0, hi = total_budget; /* holds at lo (0: vacuously), not at hi */
    while (hi - lo > 1) {
        const uint64_t mid = lo + (hi - lo) / 2;
        o.budget_bytes = mid;
        st = kvarn_cache_capacity_get(&o, 1, 0, &cap);
        if (st != KVARN_OK && st != KVARN_ERR_INVALID_ARG) return st;
        if (st == KVARN_ERR_INVALID_ARG || cap.total_bytes <= total_budget)
            lo = mid;
        else
            hi = mid;
    }
    if (lo == 0) return KVARN_ERR_INVALID_ARG;
    o.budget_bytes = lo;
    st = kvarn_cache_capacity_get(&o, 1, 0, &cap);
    if (st != KVARN_OK) return st; /* too small to plan: nothing fits */
    *out = o;
    return KVARN_OK;
}

/* Does a cache of k sequences of seq_len fit total_budget (all counted)? */
static kvarn_status seqs_pred(const kvarn_cache_opts *opts, uint64_t total_budget, int seq_len,
                              int k, int *yes, kvarn_cache_opts *fitted)
{
    kvarn_cache_opts o = *opts;
    o.max_seqs = k;
    o.max_seq_len = seq_len;
    *yes = 0;
    kvarn_status st = kvarn_cache_fit_budget(&o, total_budget, fitted);
    if (st == KVARN_ERR_INVALID_ARG) return KVARN_OK; /* does not fit at all */
    if (st != KVARN_OK) return st;
    kvarn_cache_capacity cap;
    st = kvarn_cache_capacity_get(fitted, 1, seq_len, &cap);
    if (st != KVARN_OK) return st;
    *yes = cap.seqs >= k;
    return KVARN_OK;
}

kvarn_status kvarn_cache_seqs_fit(const kvarn_cache_opts *opts, uint64_t total_budget,
                                  int seq_len, int *k, kvarn_cache_opts *out_opts)
{
    if (opts == NULL || k == NULL || seq_len < 1 || seq_len > KVARN_CACHE_MAX_SEQ_LEN)
        return KVARN_ERR_INVALID_ARG;
    /* the opts themselves must be sound: a plan of one sequence, budget 0 */
    kvarn_cache_opts probe = *opts;
    probe.max_seqs = 1;
    probe.max_seq_len = seq_len;
    probe.budget_bytes = 0;
    kvarn_cache_info pi;
    kvarn_status st = kvarn_cache_plan(&probe, &pi);
    if (st != KVARN_OK) return st;
    /* fits(k) is monotone: more sequences take more pages, blocks and
     * tables from the same budget. Binary search for the last k that fits. */
    kvarn_cache_opts best, tmp;
    memset(&best, 0, sizeof best);
    int lo = 0, hi = 1000000, yes;
    while (lo < hi) {
        int mid = lo + (hi - lo + 1) / 2;
        st = seqs_pred(opts, total_budget, seq_len, mid, &yes, &tmp);
        if (st != KVARN_OK) return st;
        if (yes) {
            lo = mid;
            best = tmp;
        } else {
            hi = mid - 1;
        }
    }
    *k = lo;
    if (out_opts != NULL && lo > 0) *out_opts = best;
    return KVARN_OK;
}
