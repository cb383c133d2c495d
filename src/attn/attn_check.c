/*
 * attn_check.c -- the argument checks of the attention entry points (attn.c):
 * the options (with their testing knobs), the paged view (records, blocks,
 * fp16 pages, sink slots, small tail pages) and each sequence's view against
 * it, so that no kernel reads outside what the caller gave. Layout:
 * include/kvarn/paged.h; the arena checks shared with store, commit and
 * CUDA: cache/paged_check.h.
 */
#define KVARN_EXPERIMENTAL_API /* the testing knobs of kvarn_attn_opts */
#include <math.h>
#include <stdint.h>

#include "attn/attn_internal.h"
#include "cache/paged_check.h"
#include "common/checked.h"

/* The experimental knobs (attn.h's testing section); 0 without them. */
int attn_split_k_of(const kvarn_attn_opts *o) { return o->testing ? o->testing->split_k : 0; }
int attn_force_scalar_of(const kvarn_attn_opts *o)
{
    return o->testing ? o->testing->force_scalar : 0;
}

int attn_opts_valid(const kvarn_attn_opts *o)
{
    return isfinite(o->softmax_scale) && o->softmax_scale > 0.0f &&
           o->sliding_window >= 0 && (o->causal == 0 || o->causal == 1) &&
           attn_split_k_of(o) >= 0 && attn_split_k_of(o) <= 1024 &&
           (attn_force_scalar_of(o) == 0 || attn_force_scalar_of(o) == 1) &&
           (o->testing == NULL || o->testing->no_vnni == 0 || o->testing->no_vnni == 1) &&
           (o->testing == NULL || (o->testing->amx >= 0 && o->testing->amx <= 2)) &&
           (o->testing == NULL || o->testing->no_bf16 == 0 || o->testing->no_bf16 == 1) &&
           (o->io_bf16 == 0 || o->io_bf16 == 1);
}

static int n_tiles_of(int seq_len, int G) { return (seq_len + G - 1) / G; }

kvarn_status attn_check_kv(const kvarn_paged_kv *kv, const kvarn_record_layout *L)
{
    /* Records, blocks and fp16 pages (when given; attn_check_seq refuses a
     * page tile without them): the check store, commit and CUDA share
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

kvarn_status attn_check_seq(const kvarn_paged_kv *kv, const kvarn_seq_view *sv)
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
        if (attn_tile_is_page(kv, sv, i)) {
            if (kv->fp16_pages == NULL || id < 0 || id >= kv->n_fp16_pages) return KVARN_ERR_INVALID_ARG;
        } else {
            if (kv->blocks == NULL || id < 0 || id >= kv->n_blocks) return KVARN_ERR_INVALID_ARG;
        }
    }
    return KVARN_OK;
}
