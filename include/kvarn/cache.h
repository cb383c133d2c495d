/*
 * cache.h -- the paged, quantized KV cache (vLLM PagedAttention vocabulary).
 *
 * One kvarn_cache holds the K/V of every layer of one model for many
 * sequences. It fills the views of include/kvarn/paged.h (kvarn_paged_kv per
 * layer, kvarn_seq_view per sequence), which is where the paged layout is
 * written down; this header says how the cache manages it. Design notes and
 * the life of a token: docs/paged-cache.md. Source for the KVarN parts:
 * ../shared/spec/KVARN.md "The fp16 tail and the sink".
 *
 * Terms
 *   G        block size in tokens (tokens per tile). KVarN: = the format's
 *            tile_tokens. Per-token formats: a setting (default 16, vLLM's
 *            default block size; any value in [1, 1024]).
 *   tile i   tokens [i*G, (i+1)*G) of a sequence.
 *   block    one slot of the quantized arena: for every layer and KV head the
 *            record(s) of one tile. Block ids are shared by all layers, as in
 *            vLLM: block b exists in every layer.
 *   page     one slot of the fp16 page pool: for every layer and KV head the
 *            fp16 K and V [G][D] of one tile. Page ids are shared by all
 *            layers too. KVarN only (per-token formats have no pages).
 *   sink     the first sink_tiles tiles of a KVarN sequence: kept in fp16
 *            pages for good, never quantized. A sink of S tokens
 *            (opts.sink_tokens) that is not a whole number of tiles keeps
 *            the last S mod G of them in the sequence's fp16 sink slot
 *            while their tile is quantized as usual (paged.h).
 *   tail     the KVarN tiles after the quantized ones: fp16 pages that
 *            receive new tokens, already rotated by H/sqrt(D). With
 *            opts.tail_page_tokens = T < G the tail is held in small pages
 *            of T tokens instead, taken when a token first lands in one
 *            (reserve) and released at commit / truncate / free (paged.h
 *            "Small tail pages").
 *   commit   quantizing a full tail tile (all G tokens final) into its block
 *            with kvarn_encode(prerotated = 1), in every layer at once.
 *
 * Memory (all allocated in kvarn_cache_create; see docs/paged-cache.md)
 *   quantized arena  [layer][block][kv_head] records, block_stride =
 *                    Hk * record_stride bytes (paged.h's packed layout).
 *   fp16 page pool   [layer][page][kv_head][K,V][G][D] uint16 (IEEE half):
 *                    paged.h's packed pages (kvarn_paged_pack_pages).
 *   per sequence     its block table and bookkeeping, allocated by
 *                    kvarn_cache_seq_create / _fork for max_seq_len tokens,
 *                    so reserve/write/commit/truncate never allocate.
 *
 * Block accounting (KVarN). A non-sink tile takes its block when its first
 * token is reserved, and also a page while it is in the tail; commit writes
 * the record into that already-owned block and releases the page. So commit
 * never runs out of blocks and capacity in tokens is n_blocks * G (plus the
 * sink tiles, which live in pages). Sink tiles take a page only. Pages are
 * the staging overhead, counted in kvarn_cache_stats.arena_bytes_per_token
 * and in kvarn_cache_capacity_get, which says what a cache really holds.
 * Per-token formats: a tile takes one block; records are written at once.
 *
 * The block table of a sequence (what attention and an engine read) maps
 * tile i to a PAGE id when i < sink_tiles or i >= committed_tiles, else to a
 * BLOCK id (paged.h). For per-token formats every entry is a block id.
 *
 * Order of calls for one model step of one sequence (n new tokens):
 *   1. kvarn_cache_reserve(c, seq, n)       allocate for all layers; atomic:
 *                                            on KVARN_ERR_OUT_OF_BLOCKS nothing
 *                                            changed. seq_len grows by n.
 *   2. for each layer l:
 *        kvarn_cache_write(c, seq, l, pos, n, k, v)   pos = old seq_len
 *        (or kvarn_cache_write_exact for a prefill chunk: its whole tiles
 *        are encoded from the exact K/V rather than from their staged copy)
 *        (attention for layer l may now read the views)
 *   3. kvarn_cache_commit(c, seq, committed_len)  quantize every full KVarN
 *                                            tile below committed_len (=
 *                                            seq_len minus tokens still being
 *                                            verified), in all layers.
 *   Rollback of rejected draft tokens: kvarn_cache_truncate(c, seq, len).
 *
 * Truncate into a quantized tile: REFUSED with KVARN_ERR_STATE. A committed
 * tile is final by definition (the caller declared its tokens accepted), and
 * keeping an fp16 copy of every committed tile to re-open it would cost the
 * fp16 page pool as much memory as the quantized arena saves. Truncating
 * anywhere in the sink or the tail is exact (the dropped fp16 tokens are
 * simply overwritten later). Per-token formats never refuse.
 *
 * Prefix sharing: kvarn_cache_seq_fork makes a child that shares every block
 * and page of its parent (reference counts). The first reserve that touches
 * a shared tile copies it (copy-on-write: a shared page is copied in all
 * layers; a shared block of an uncommitted tile is replaced by a fresh one;
 * a shared per-token block is copied). kvarn_cache_seq_free returns to the
 * pools only blocks and pages no other sequence holds.
 *
 * Threads: a kvarn_cache is not thread-safe; calls on one cache must not
 * overlap (kvarn_cache_read and _commit use the cache's scratch buffers).
 * Several threads may read the views at once (attention) while no call that
 * changes the cache runs.
 * Views hold borrowed pointers. The arena pointers of a layer view are valid
 * until kvarn_cache_destroy. A sequence's block table pointer stays valid
 * until that sequence is freed, but its entries, seq_len and committed_tiles
 * describe the sequence as it was: take a fresh kvarn_seq_view after every
 * reserve, commit or truncate of it.
 *
 * Every function that can fail returns a kvarn_status; on any error the
 * cache is unchanged (output buffers of kvarn_cache_read may be partly
 * written). Hostile arguments (NULL, bad or freed sequence id, layer out of
 * range, n < 0, positions outside the sequence) give KVARN_ERR_INVALID_ARG.
 */
#ifndef KVARN_CACHE_H
#define KVARN_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "kvarn/alloc.h"
#include "kvarn/kvarn.h"
#include "kvarn/paged.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvarn_cache kvarn_cache;

/* Most tokens one sequence may hold (max_seq_len), 2^30: token positions,
 * tile counts and block/page ids are int32 and stay far from INT32_MAX. A
 * cache also has at most 2^30 blocks and 2^30 pages. */
#define KVARN_CACHE_MAX_SEQ_LEN (1 << 30)

/* Most layers (n_layers) and KV heads per layer (n_kv_heads) of a cache:
 * more is KVARN_ERR_INVALID_ARG from kvarn_cache_create / _plan. */
#define KVARN_CACHE_MAX_LAYERS 4096
#define KVARN_CACHE_MAX_KV_HEADS 4096

/* ------------------------------------------------------------------------ */
/* Creation                                                                 */
/* ------------------------------------------------------------------------ */

/* Settings. Start from kvarn_cache_default_opts() and set the model's
 * numbers; fields marked "0 = auto" pick a documented default. */
typedef struct kvarn_cache_opts {
    kvarn_format format;    /* cache format (kvarn_format_parse) */
    int n_layers;           /* layers, 1 to KVARN_CACHE_MAX_LAYERS */
    int n_kv_heads;         /* Hk, KV heads per layer, 1 to
                               KVARN_CACHE_MAX_KV_HEADS */
    int head_dim;           /* D, must pass kvarn_format_check_head_dim */
    int block_size;         /* G in tokens. KVarN: 0 or the format's
                               tile_tokens. Per-token formats: 0 = 16, else
                               [1, 1024]. */
    int sink_tiles;         /* KVarN: fp16 sink tiles per sequence, >= 0
                               (default 1). Per-token formats: ignored, they
                               have no sink (always 0). */
    uint64_t budget_bytes;  /* bytes for the quantized arena plus the fp16
                               page pool and sink slots (all layers), an
                               upper bound: blocks
                               beyond 2^30 are not made. Bookkeeping (block
                               tables, refcounts, scratch) is not counted. */
    int max_seqs;           /* live sequences at once, >= 1 (default 64) */
    int max_seq_len;        /* tokens per sequence, at most
                               KVARN_CACHE_MAX_SEQ_LEN; 0 = auto: every block
                               and every sink tile, i.e. (n_blocks +
                               sink_tiles) * G, capped at
                               KVARN_CACHE_MAX_SEQ_LEN. Sets the size of each
                               sequence's block table (12 bytes per tile). */
    int n_pages;            /* KVarN fp16 pages; 0 = auto: max_seqs *
                               (sink_tiles + 1) + ceil(max_seqs / 8) (each
                               sequence its sink and tail tile, and a shared
                               reserve of one page per 8 sequences for
                               tokens in flight across a tile boundary,
                               e.g. draft tokens being verified).
                               Every token waits in a page until its tile is
                               committed, so a chunk of n tokens (a prefill)
                               needs about ceil(n / G) + 1 pages of its own
                               until the commit that follows it: size n_pages
                               for the largest chunks in flight.
                               Per-token formats: must be 0. */
    int balance_iters;      /* KVarN variance-normalization iterations at
                               commit (kvarn_codec_opts), default 8 */
    const kvarn_allocator *allocator; /* every allocation of the cache (its
                               arenas, tables, scratch, each sequence's block
                               table at seq create/fork) goes through it;
                               copied, must outlive the cache; NULL (default)
                               = malloc/free (alloc.h) */
    int sink_tokens;        /* KVarN: S, the attention-sink tokens of a
                               sequence kept in fp16, in [1, 1024 * G]; 0
                               (default) = sink_tiles * G. When set it
                               replaces sink_tiles: floor(S / G) whole sink
                               tiles live in pages for good, and when S is
                               not a multiple of G the remaining r = S mod G
                               tokens of the next tile are kept in a sink
                               slot of r tokens per sequence (allocated for
                               max_seqs sequences, n_layers * Hk * 2 * r * D
                               * 2 bytes each, from budget_bytes) while that
                               tile is quantized as usual (paged.h "Sink
                               shorter than a tile"). S = k * G is exactly
                               sink_tiles = k. Per-token formats: ignored. */
    int tail_page_tokens;   /* KVarN: T, tokens per fp16 tail page. 0
                               (default) or G: a whole tile per tail page (one
                               pool of pages for sink and tail). 0 < T < G, T
                               dividing G: the tail lives in small pages of T
                               tokens from a pool of their own (paged.h "Small
                               tail pages"); whole pages hold the sink tiles
                               only. Per-token formats: ignored. */
    int n_tail_pages;       /* small tail pages (0 < T < G); 0 = auto:
                               (max_seqs + ceil(max_seqs / 8)) * G / T, the
                               bound that lets every live sequence fill its
                               tail tile to G tokens before its commit (a
                               sequence holds at most G / T small pages
                               between commits when it commits every full
                               tile) plus the same shared reserve as the
                               whole pages; the same bytes as one whole tail
                               page per sequence. Fewer (e.g. sized for the
                               sequences' mean tail) buys blocks with the
                               difference, and a reserve then fails with
                               KVARN_ERR_OUT_OF_BLOCKS when they run out.
                               Must be 0 when T is 0 or G. */
    int rtn_range;          /* KVarN: the RTN range of every commit
                               (kvarn_codec_opts.rtn_range, kvarn.h):
                               KVARN_RTN_MINMAX (0, default, the spec's) or
                               KVARN_RTN_MSE (error-minimizing; same record
                               layout, read by the same kernels) */
    int staging;            /* KVarN: how staged tokens are held
                               (kvarn_staging, paged.h):
                               KVARN_STAGING_INT8 (the default of
                               kvarn_cache_default_opts: decode KLD 0.97x
                               of fp16 staging's for 53% of its bytes,
                               docs/capacity.md "Staging below fp16"),
                               _FP8_E4M3, _INT4: records of that per-token
                               format (its own codec on the rotated
                               vectors; bytes per token-head 2D + 8,
                               2D + 4, D + 8); KVARN_STAGING_FP16 (0, the
                               spec's fp16 tail and sink): rotated fp16
                               rows, 4D bytes. For every staged token: the
                               sink tiles, the tail (whole or small pages),
                               the sink slots. Commit decodes the staged
                               tile to fp32 and encodes it as usual;
                               attention reads the staged tokens with that
                               format's token kernels. The CUDA kernels
                               read fp16 staging only. Another value:
                               KVARN_ERR_INVALID_ARG. Per-token formats:
                               ignored (nothing is staged;
                               kvarn_cache_info.staging is fp16). */
} kvarn_cache_opts;

/* The defaults: format kvarn_k4v2_g128, block_size 0 (auto), sink_tiles 1
 * (sink_tokens 0: one whole sink tile, the spec's default),
 * max_seqs 64, max_seq_len 0 (auto), n_pages 0 (auto), balance_iters 8,
 * tail_page_tokens 0 (whole tail pages: with the auto pool small pages
 * cost the same bytes; see docs/paged-cache.md "Small tail pages"),
 * n_tail_pages 0, rtn_range KVARN_RTN_MINMAX, staging KVARN_STAGING_INT8
 * (staged tokens as int8 records; KVARN_STAGING_FP16 is the spec's fp16
 * sink and tail, the one the CUDA kernels read);
 * n_layers, n_kv_heads, head_dim, budget_bytes are 0 and must be set. */
kvarn_cache_opts kvarn_cache_default_opts(void);

/* The staging format named `name` (kvarn_cache_opts.staging): "fp16" ->
 * KVARN_STAGING_FP16, "int8" -> KVARN_STAGING_INT8, "fp8_e4m3" ->
 * KVARN_STAGING_FP8_E4M3, "int4" -> KVARN_STAGING_INT4, into *out; an
 * alias kvarn_format_parse gives one of those per-token formats names the
 * same staging ("fp8" -> KVARN_STAGING_FP8_E4M3).
 * Errors: KVARN_ERR_INVALID_ARG (NULL, another name; *out unchanged). */
kvarn_status kvarn_cache_staging_parse(const char *name, int *out);

/* The name of a staging format ("fp16", "int8", "fp8_e4m3", "int4"; a
 * record staging is named after its per-token format), or NULL for a
 * value that is no kvarn_staging. */
const char *kvarn_cache_staging_name(int staging);

/* Create a cache: checks opts, splits budget_bytes into n_pages staging
 * pages (page bytes = n_layers * Hk * kvarn_paged_staging_bytes(G), paged.h:
 * fp16 rows or G staged token records), n_tail_pages small tail pages
 * (tail_page_bytes = n_layers * Hk * kvarn_paged_staging_bytes(T)), the
 * sink slots, and as many blocks as the rest holds (block bytes = n_layers
 * * Hk * record_stride), allocates both arenas (zeroed) and the bookkeeping.
 * Every size is computed in 64 bits with checked products before anything
 * is allocated.
 * Errors: KVARN_ERR_INVALID_ARG (NULL, bad numbers, a budget too small for
 * the pages plus one block, an allocator with only one of alloc/free set),
 * KVARN_ERR_UNSUPPORTED_HEAD_DIM,
 * KVARN_ERR_TOO_LARGE (max_seq_len above KVARN_CACHE_MAX_SEQ_LEN, more than
 * 2^30 pages, or a byte size -- page bytes x n_pages, an arena, one
 * sequence's block table -- that overflows 64 bits or size_t),
 * KVARN_ERR_NOMEM. *out is set only on success; on error nothing stays
 * allocated. */
kvarn_status kvarn_cache_create(const kvarn_cache_opts *opts, kvarn_cache **out);

/* Free everything. NULL is fine. Views into the cache become invalid. */
void kvarn_cache_destroy(kvarn_cache *c);

/* Fixed geometry of a cache. */
typedef struct kvarn_cache_info {
    kvarn_format format;
    int n_layers, n_kv_heads, head_dim;
    int block_size;             /* G, tokens */
    int sink_tiles;             /* 0 for per-token formats */
    int n_blocks;               /* quantized arena slots (each in every layer) */
    int n_pages;                /* fp16 pages (each in every layer) */
    int max_seqs, max_seq_len;  /* sequences, tokens */
    size_t record_stride;       /* bytes per (block, kv head) */
    size_t block_stride;        /* bytes per block in one layer */
    size_t token_record_bytes;  /* per-token formats: bytes per token-head; 0 for KVarN */
    size_t block_bytes;         /* bytes of one block, all layers */
    size_t page_bytes;          /* bytes of one page, all layers */
    uint64_t arena_bytes;       /* n_blocks * block_bytes + n_pages * page_bytes
                                   + n_tail_pages * tail_page_bytes
                                   + max_seqs * sink_bytes */
    uint64_t capacity_tokens;   /* n_blocks * G: tokens the quantized arena
                                   holds, all sequences together (sink tiles
                                   live in pages and come on top) */
    int sink_tokens;            /* S: sink_tiles * G + sink_partial tokens */
    int sink_partial;           /* r = S mod G: tokens of tile sink_tiles kept
                                   in a sink slot once it is quantized */
    size_t sink_bytes;          /* bytes of one sequence's sink slot, all
                                   layers (n_layers * Hk * 2 * r * D * 2);
                                   max_seqs slots are in arena_bytes */
    int tail_page_tokens;       /* T: tokens per tail page (KVarN: G for
                                   whole tail pages; 0 for per-token) */
    int n_tail_pages;           /* small tail pages (0 unless 0 < T < G) */
    size_t tail_page_bytes;     /* bytes of one small tail page, all layers
                                   (n_layers * Hk * 2 * T * D * 2); 0 unless
                                   0 < T < G; n_tail_pages of them are in
                                   arena_bytes */
    int staging;                /* kvarn_staging of the pages, small tail
                                   pages and sink slots (their bytes above
                                   are in that format: 4D per token-head
                                   for fp16, else staging_record_bytes) */
    size_t staging_record_bytes;/* staging other than fp16: bytes of one
                                   staged token record, kvarn_record_bytes
                                   of its per-token format (int8 2D + 8,
                                   fp8_e4m3 2D + 4, int4 D + 8); 0 for
                                   fp16 */
} kvarn_cache_info;

kvarn_status kvarn_cache_get_info(const kvarn_cache *c, kvarn_cache_info *out);

/* Work out what kvarn_cache_create(opts) would build, without allocating:
 * fills *out exactly as kvarn_cache_get_info would (n_blocks, n_pages,
 * block_bytes, page_bytes, ...), e.g. to size budget_bytes for a wanted
 * number of blocks. budget_bytes = 0 is accepted here (only here) and gives
 * n_blocks = 0 with every per-block and per-page size filled in. A plan
 * that succeeds is one kvarn_cache_create can build if arena_bytes (plus
 * max_seqs block tables) can be allocated.
 * Errors: as kvarn_cache_create, except KVARN_ERR_NOMEM. */
kvarn_status kvarn_cache_plan(const kvarn_cache_opts *opts, kvarn_cache_info *out);

/* What a cache built from some opts holds: the one capacity computation
 * that kvarn inspect, generate's memory line, the eval ladder and
 * bench_capacity report (docs/capacity.md "How capacity is computed").
 *
 * The fill it describes: sequences are grown one token at a time, each
 * reserve followed by the write of every layer and a commit of the whole
 * sequence (committed_len = seq_len, the decode steady state), so a full
 * non-sink tile holds a block only and a partial one a block and a page.
 * Opening a non-sink tile needs one free page even when that tile is then
 * filled and committed at once (its tokens wait in the page meanwhile). */
typedef struct kvarn_cache_capacity {
    kvarn_cache_info info;   /* kvarn_cache_plan(opts) */
    uint64_t books_bytes;    /* bytes besides the two arenas that
                                kvarn_cache_create and max_seqs sequences
                                allocate: the cache struct, id pools (8 bytes
                                per block and per page), max_seqs block
                                tables (12 bytes per tile of max_seq_len, 1
                                per tile and layer, plus 4 per layer each),
                                commit/read scratch, and
                                the alignment slack of the arenas and the
                                scratch: exactly what the allocator is asked
                                for besides the arenas' n_blocks * block_bytes
                                + n_pages * page_bytes */
    uint64_t total_bytes;    /* info.arena_bytes + books_bytes: every byte
                                the cache and max_seqs sequences ask the
                                allocator for */
    uint64_t tokens;         /* tokens n_seqs sequences hold together when
                                each is filled as far as it goes, one after
                                the other (max_seq_len, blocks and pages
                                limit it); one more token into any of them
                                fails with KVARN_ERR_OUT_OF_BLOCKS */
    int seq_blocks;          /* blocks one sequence of seq_len tokens holds */
    int seq_pages;           /* fp16 pages it holds (sink tiles, and a
                                partial tail tile when T = G) */
    int seq_tail_pages;      /* small tail pages it holds (0 < T < G):
                                ceil((seq_len mod G) / T) past the sink */
    int seqs;                /* sequences of seq_len tokens held at once
                                (grown one after the other): the most k <=
                                max_seqs with k * seq_blocks <= n_blocks and
                                k * seq_pages (+ 1 page to open the last
                                tile when it ends full) <= n_pages, and with
                                small tail pages (k - 1) * seq_tail_pages +
                                the most the last one held while growing
                                (G / T once a non-sink tile filled, before
                                its commit) <= n_tail_pages; 0 when seq_len
                                > max_seq_len */
    uint64_t seq_arena_bytes;/* arena bytes one such sequence holds:
                                seq_blocks * block_bytes + seq_pages *
                                page_bytes + seq_tail_pages *
                                tail_page_bytes + info.sink_bytes (its sink
                                slot) */
} kvarn_cache_capacity;

/* Fill *out for the cache kvarn_cache_create(opts) would build, n_seqs
 * concurrent sequences (1 <= n_seqs <= opts->max_seqs) and a sequence
 * length seq_len in tokens (>= 0). No allocation. budget_bytes = 0 is
 * accepted as in kvarn_cache_plan (no blocks: tokens and seqs count only
 * what pages hold, the per-sequence fields are filled).
 * Errors: KVARN_ERR_INVALID_ARG (NULL, n_seqs or seq_len out of range),
 * errors of kvarn_cache_plan (KVARN_ERR_INVALID_ARG when the budget does
 * not even hold the fp16 pages plus one block). */
kvarn_status kvarn_cache_capacity_get(const kvarn_cache_opts *opts, int n_seqs,
                                      int seq_len, kvarn_cache_capacity *out);

/* Set out->budget_bytes (the arenas' share) to the largest value whose
 * total_bytes (arenas plus bookkeeping, kvarn_cache_capacity) stays within
 * total_budget bytes; every other field is copied from opts. This is how
 * "fits in N bytes" is meant everywhere in kvarn: all memory counted.
 * Errors: KVARN_ERR_INVALID_ARG (NULL, or total_budget too small for the
 * pages, one block and the bookkeeping), errors of kvarn_cache_plan. */
kvarn_status kvarn_cache_fit_budget(const kvarn_cache_opts *opts, uint64_t total_budget,
                                    kvarn_cache_opts *out);

/* How many requests of seq_len tokens fit in total_budget bytes (all memory
 * counted): the largest k such that the cache made from opts with
 * max_seqs = k, max_seq_len = seq_len and kvarn_cache_fit_budget holds k
 * sequences of seq_len at once (kvarn_cache_capacity.seqs >= k). *k = 0
 * when not even one fits. When out_opts is not NULL it receives those opts
 * (undefined when *k = 0). seq_len in [1, KVARN_CACHE_MAX_SEQ_LEN]; k is
 * searched in [1, 10^6]. No allocation.
 * Errors: KVARN_ERR_INVALID_ARG (NULL, seq_len out of range, bad opts),
 * KVARN_ERR_UNSUPPORTED_HEAD_DIM, KVARN_ERR_TOO_LARGE. */
kvarn_status kvarn_cache_seqs_fit(const kvarn_cache_opts *opts, uint64_t total_budget,
                                  int seq_len, int *k, kvarn_cache_opts *out_opts);

/* ------------------------------------------------------------------------ */
/* Sequences                                                                */
/* ------------------------------------------------------------------------ */

/* Make an empty sequence; its id (in [0, max_seqs)) goes to *seq. Allocates
 * its block table (max_seq_len / G entries) unless it takes the slot of a
 * freed sequence, which keeps its table: after a kvarn_cache_seq_free, one
 * create never fails for memory.
 * Errors: KVARN_ERR_INVALID_ARG, KVARN_ERR_OUT_OF_BLOCKS (max_seqs sequences
 * are live), KVARN_ERR_NOMEM. */
kvarn_status kvarn_cache_seq_create(kvarn_cache *c, int *seq);

/* Make a child of parent that shares all of its blocks and pages (each
 * reference count + 1) and has its length, committed state and written
 * lengths; its id goes to *child. Nothing is copied until a reserve touches
 * a shared tile (copy-on-write), except the parent's sink slot (a sink
 * shorter than a tile whose tile is quantized: sink_bytes, per sequence).
 * Errors: as kvarn_cache_seq_create, and KVARN_ERR_INVALID_ARG for a bad
 * parent. */
kvarn_status kvarn_cache_seq_fork(kvarn_cache *c, int parent, int *child);

/* Drop the sequence: every block and page it holds loses one reference and
 * returns to its pool when no sequence holds it any more. The id becomes
 * free for reuse; its block table's memory stays with the slot for the next
 * sequence (freed by kvarn_cache_destroy). Errors: KVARN_ERR_INVALID_ARG (bad or freed id). */
kvarn_status kvarn_cache_seq_free(kvarn_cache *c, int seq);

/* State of a sequence. */
typedef struct kvarn_cache_seq_info {
    int seq_len;          /* tokens reserved (the sequence length) */
    int n_tiles;          /* ceil(seq_len / G): entries of the block table */
    int committed_tiles;  /* as kvarn_seq_view (tiles [sink_tiles,
                             committed_tiles) are quantized) */
    int quantized_tiles;  /* tiles quantized (KVarN); 0 for per-token */
    int committed_len;    /* the largest committed_len passed to commit,
                             clamped by truncate, in tokens */
    int frozen_len;       /* tokens that truncate may not cut: the end of the
                             last quantized tile (0 when none, and always 0
                             for per-token formats) */
} kvarn_cache_seq_info;

kvarn_status kvarn_cache_seq_get_info(const kvarn_cache *c, int seq,
                                      kvarn_cache_seq_info *out);

/* ------------------------------------------------------------------------ */
/* Appending: reserve, write per layer, commit                              */
/* ------------------------------------------------------------------------ */

/* Grow the sequence by n_new tokens (n_new >= 0) for all layers: new tiles
 * get their page (KVarN) and block (non-sink tiles), and the tile that
 * receives the first new token is made private if it is shared
 * (copy-on-write). Nothing is written; seq_len becomes seq_len + n_new and
 * the new tokens' contents are undefined until written.
 * Errors: KVARN_ERR_INVALID_ARG; KVARN_ERR_OUT_OF_BLOCKS when the free blocks
 * or pages do not suffice or seq_len + n_new > max_seq_len. Atomic: on any
 * error no block, page, refcount or length changed. */
kvarn_status kvarn_cache_reserve(kvarn_cache *c, int seq, int n_new);

/* Store K and V of tokens [pos, pos + n) of one layer.
 *   k, v   fp32 [n][Hk][D] (token-major, then KV head, then channel), as a
 *          model produces them; K post-RoPE.
 * KVarN: each token-head vector is rotated by H/sqrt(D) and stored as fp16
 * in its tile's page (sink or tail). Per-token formats: each token-head is
 * encoded at once into its record (kvarn_encode) in its block.
 * Requires pos + n <= seq_len (reserve first), pos >= frozen_len (quantized
 * tiles are final), and pos <= this layer's written length (no gaps: tokens
 * are written in order; rewriting tokens already written is allowed).
 * Errors: KVARN_ERR_INVALID_ARG (NULL, bad seq/layer, n < 0, range outside
 * [0, seq_len)); KVARN_ERR_STATE (pos < frozen_len, a gap, or a target tile
 * shared with another sequence: fork between reserve and write);
 * KVARN_ERR_NONFINITE (NaN/Inf in k or v, or a KVarN value beyond the fp16
 * range after rotation). On error nothing was written. No allocation. */
kvarn_status kvarn_cache_write(kvarn_cache *c, int seq, int layer, int pos,
                               int n, const float *k, const float *v);

/* kvarn_cache_write (same arguments, shapes, checks and errors), and for
 * KVarN also the direct path of whole tiles: every non-sink tile that lies
 * entirely inside [pos, pos + n) (a prefill chunk that brings all G of its
 * tokens) has its record encoded now, in this layer, for every KV head,
 * straight from these k, v: kvarn_encode(prerotated = 0) of the exact fp32
 * tile, bit for bit ../shared/spec/KVARN.md "Store pipeline for one full
 * tile" on the model's values, into the tile's block. kvarn_cache_commit
 * then keeps that record instead of encoding the tile from its staged copy
 * (fp16 rows or int8/fp8/int4 token records, which would round the tokens
 * twice). The tokens are staged as kvarn_cache_write stages them too:
 * until the commit, attention and kvarn_cache_read see the tile staged.
 * The record stands until the tile is written again in this layer (any
 * write into it, kvarn_cache_write or this), the sequence is truncated into
 * or below it, or it is committed; a fork shares it with the child. Use it
 * for tokens that are final (a prefill chunk); draft tokens may be written
 * this way too, since truncating them drops their records, but a tile is
 * only committed once its tokens are accepted (kvarn_cache_commit).
 * Per-token formats: the same as kvarn_cache_write.
 * Errors: those of kvarn_cache_write. On error nothing was written. No
 * allocation. */
kvarn_status kvarn_cache_write_exact(kvarn_cache *c, int seq, int layer, int pos,
                                     int n, const float *k, const float *v);

/* Declare tokens [0, committed_len) final and quantize (KVarN) every
 * non-sink tile that lies entirely below committed_len and is not yet
 * quantized: for every layer and KV head kvarn_encode(prerotated = 1) reads
 * the staged page (as fp32) and writes the record into the tile's block
 * (a layer whose record kvarn_cache_write_exact already wrote from the
 * exact K/V keeps that record); then
 * the tile's page is released and its block table entry becomes the block
 * id. Sink tiles stay fp16. Per-token formats: records are final when
 * written, so this only records committed_len.
 * committed_len may be below an earlier one (no-op for those tokens).
 * Errors: KVARN_ERR_INVALID_ARG (bad seq, committed_len < 0 or > seq_len);
 * KVARN_ERR_STATE (some layer has not written all of [0, committed_len));
 * errors of kvarn_encode. All-or-nothing: if any tile of any layer fails, no
 * tile is marked quantized and no page is released. No allocation. */
kvarn_status kvarn_cache_commit(kvarn_cache *c, int seq, int committed_len);

/* Shorten the sequence to new_len tokens (0 <= new_len <= seq_len): tiles
 * past ceil(new_len / G) lose their page and block references; written and
 * committed lengths are clamped. Exact for tokens in the sink or the tail
 * (rollback of rejected draft tokens).
 * Errors: KVARN_ERR_INVALID_ARG; KVARN_ERR_STATE when new_len < frozen_len
 * (it would cut into a quantized tile: refused, see the top of this file). */
kvarn_status kvarn_cache_truncate(kvarn_cache *c, int seq, int new_len);

/* ------------------------------------------------------------------------ */
/* What attention and engines read                                          */
/* ------------------------------------------------------------------------ */

/* Fill *out with layer's paged K/V as include/kvarn/paged.h describes it
 * (pointers into the arenas, valid for the cache's lifetime).
 * Errors: KVARN_ERR_INVALID_ARG (NULL, layer out of [0, n_layers)). */
kvarn_status kvarn_cache_layer_view(const kvarn_cache *c, int layer,
                                    kvarn_paged_kv *out);

/* Fill *out with the sequence's block table, seq_len, committed_tiles, sink
 * slot and (small tail pages) the ids of its tail's small pages as paged.h
 * describes them. The table and tail_pages pointers are borrowed (see the
 * top).
 * Errors: KVARN_ERR_INVALID_ARG. */
kvarn_status kvarn_cache_seq_view(const kvarn_cache *c, int seq,
                                  kvarn_seq_view *out);

/* The block table alone, as vLLM passes it: *table = int32 [*n_tiles] ids
 * (page ids for sink and tail tiles of KVarN, block ids otherwise; -1 for
 * tail tiles held in small tail pages, whose ids kvarn_cache_seq_view's
 * tail_pages gives).
 * Errors: KVARN_ERR_INVALID_ARG. */
kvarn_status kvarn_cache_block_table(const kvarn_cache *c, int seq,
                                     const int32_t **table, int *n_tiles);

/* Slot mapping of tokens [pos, pos + n): slots[j] = id * G + offset of token
 * pos + j, where id names where a write lands: the page for KVarN (sink or
 * tail), the block for per-token formats; for a tail token held in a small
 * tail page q, q * T + its offset in that page (paged.h). int64 like vLLM's slot_mapping.
 * Errors: KVARN_ERR_INVALID_ARG (range outside [0, seq_len), NULL);
 * KVARN_ERR_STATE (a token lies in a quantized tile: it has no slot). */
kvarn_status kvarn_cache_slot_mapping(const kvarn_cache *c, int seq, int pos,
                                      int n, int64_t *slots);

/* Read back tokens [pos, pos + n) of one layer as fp32 [n][Hk][D] (same
 * layout as kvarn_cache_write takes): quantized tiles and per-token records
 * are decoded with kvarn_decode, fp16 pages are widened; for KVarN the result
 * is rotated back to the original basis unless flags has
 * KVARN_DECODE_ROTATED (then it is what attention sees). k or v may be NULL.
 * Tokens reserved but not yet written read as whatever the slot holds.
 * Errors: KVARN_ERR_INVALID_ARG; errors of kvarn_decode. Uses the cache's
 * scratch (hence not const); no allocation. */
kvarn_status kvarn_cache_read(kvarn_cache *c, int seq, int layer, int pos,
                              int n, float *k, float *v, unsigned flags);

/* ------------------------------------------------------------------------ */
/* Counters                                                                 */
/* ------------------------------------------------------------------------ */

typedef struct kvarn_cache_stats {
    int n_seqs;              /* live sequences */
    int blocks_total, blocks_in_use, blocks_free;
    int blocks_shared;       /* blocks held by two or more sequences */
    int pages_total, pages_in_use, pages_free;
    int pages_shared;
    int tail_pages_total, tail_pages_in_use, tail_pages_free; /* small tail
                                pages (0 unless 0 < T < G) */
    int tail_pages_shared;
    int64_t tokens;          /* sum of seq_len over live sequences (a shared
                                prefix counts once per sequence) */
    double record_bytes_per_token;  /* quantized bytes per token, all layers
                                       and KV heads: block_bytes / G */
    double arena_bytes_per_token;   /* staging counted: arena_bytes /
                                       capacity_tokens */
    double used_bytes_per_token;    /* (blocks_in_use * block_bytes +
                                       pages_in_use * page_bytes +
                                       tail_pages_in_use * tail_page_bytes +
                                       n_seqs * sink_bytes) / tokens;
                                       0 when tokens == 0 */
} kvarn_cache_stats;

kvarn_status kvarn_cache_get_stats(const kvarn_cache *c, kvarn_cache_stats *out);

#ifdef __cplusplus
}
#endif

#endif /* KVARN_CACHE_H */

/* ======================================================================== */
/* EXPERIMENTAL / TESTING API                                               */
/* ======================================================================== */
/* Seen only by code that defines KVARN_EXPERIMENTAL_API before including
 * this header (the tests do). For tests and debugging, not for production:
 * may change or vanish in any release. */
#if defined(KVARN_EXPERIMENTAL_API) && !defined(KVARN_CACHE_H_EXPERIMENTAL)
#define KVARN_CACHE_H_EXPERIMENTAL

#ifdef __cplusplus
extern "C" {
#endif

/* Reference count of a block or page id (how many sequences hold it), or
 * -1 for an id out of range or a NULL cache. */
int kvarn_cache_block_refs(const kvarn_cache *c, int32_t block);
int kvarn_cache_page_refs(const kvarn_cache *c, int32_t page);
int kvarn_cache_tail_page_refs(const kvarn_cache *c, int32_t page);

#ifdef __cplusplus
}
#endif

#endif /* KVARN_EXPERIMENTAL_API */
