/*
 * paged_check.c -- the shared check of a paged layer view's arenas
 * (paged_check.h). Layout: include/kvarn/paged.h.
 */
#include "cache/paged_check.h"

#include <stdint.h>

#include "cache/staging.h"
#include "codec/format_kinds.h"
#include "common/checked.h"

kvarn_status kvarn__paged_check_arenas(const kvarn_paged_kv *kv, const kvarn_record_layout *L,
                                       unsigned flags, kvarn_status too_small)
{
    const kvarn_kind_ops *op = kvarn__kind_ops(kv->fmt.kind);
    if (op == NULL || kv->n_blocks < 0 || kv->n_fp16_pages < 0 || kv->sink_tiles < 0 ||
        ((flags & KVARN_PAGED_NEED_BLOCKS) && kv->blocks == NULL))
        return KVARN_ERR_INVALID_ARG;
    const size_t hk = (size_t)kv->n_kv_heads;
    size_t need = L->record_bytes, heads;
    if (!op->per_tile) {
        if (kv->token_record_bytes < L->record_bytes) return too_small;
        if (kvarn__mul_size((size_t)kv->block_size, kv->token_record_bytes, &need))
            return KVARN_ERR_INVALID_ARG;
    }
    if (kvarn__mul_size(hk, kv->record_stride, &heads)) return KVARN_ERR_INVALID_ARG;
    if (kv->record_stride < need || kv->block_stride < heads) return too_small;
    if (!op->per_tile) return kv->staging == KVARN_STAGING_FP16 ? KVARN_OK : KVARN_ERR_INVALID_ARG;
    /* staged tokens: fp16 rows, or token records of the staging's
     * per-token format of at least that format's record bytes (paged.h
     * "Staging") */
    kvarn_format sf;
    const int recs = kvarn__staging_format(kv->staging, &sf);
    if (recs < 0) return KVARN_ERR_INVALID_ARG;
    if (recs > 0) {
        const size_t need_rec = kvarn_record_bytes(&sf, kv->head_dim);
        if (need_rec == 0) return KVARN_ERR_UNSUPPORTED_HEAD_DIM;
        if (kv->staging_record_bytes < need_rec || kv->staging_record_bytes > ((size_t)1 << 20))
            return too_small;
    }
    if (kv->fp16_pages == NULL)
        return (flags & KVARN_PAGED_NEED_PAGES) ? KVARN_ERR_INVALID_ARG : KVARN_OK;
    if (((uintptr_t)kv->fp16_pages % 2) != 0 || kv->page_head_stride % 2 != 0 ||
        kv->page_stride % 2 != 0 || kvarn__mul_size(hk, kv->page_head_stride, &heads))
        return KVARN_ERR_INVALID_ARG;
    if (kv->page_head_stride < kvarn_paged_staging_bytes(kv, kv->block_size) ||
        kv->page_stride < heads)
        return too_small;
    return KVARN_OK;
}
