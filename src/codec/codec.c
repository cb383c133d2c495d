/*
 * codec.c -- kvarn_encode / kvarn_decode: argument checks shared by every
 * format, then the entry point of the format kind's row (format_kinds.h).
 */
#include <string.h>

#include "codec/codec_internal.h"
#include "codec/fp_convert.h"
#include "codec/format_kinds.h"

size_t kvarn_encode_workspace_bytes(const kvarn_format *fmt, int head_dim)
{
    if (kvarn_format_check_head_dim(fmt, head_dim) != KVARN_OK) return 0;
    const kvarn_kind_ops *op = kvarn__kind_ops(fmt->kind);
    return op->workspace_bytes ? op->workspace_bytes(head_dim, fmt->tile_tokens) : 0;
}

kvarn_status kvarn_encode(const kvarn_format *fmt, int head_dim,
                          const float *k, const float *v,
                          void *record, size_t record_size,
                          void *workspace, size_t workspace_size,
                          const kvarn_codec_opts *opts)
{
    if (fmt == NULL || k == NULL || v == NULL || record == NULL)
        return KVARN_ERR_INVALID_ARG;
    kvarn_codec_opts o = KVARN_CODEC_OPTS_DEFAULT;
    if (opts) o = *opts;
    if (o.balance_iters < 0 || o.balance_iters > 64 ||
        (o.rtn_range < KVARN_RTN_MINMAX || o.rtn_range > KVARN_RTN_MSE_V))
        return KVARN_ERR_INVALID_ARG;

    kvarn_record_layout L;
    kvarn_status st = kvarn_record_layout_get(fmt, head_dim, &L);
    if (st != KVARN_OK) return st;
    if (record_size < L.record_bytes) return KVARN_ERR_BUFFER_TOO_SMALL;

    /* the layout call checked the format: its row exists */
    const kvarn_kind_ops *op = kvarn__kind_ops(fmt->kind);
    size_t n = (size_t)head_dim * (size_t)fmt->tile_tokens;
    /* A kind whose encoder rejects NaN / Inf itself (KVarN: its range
     * checks while loading the tile) is not scanned here, except before a
     * workspace error, so that NaN / Inf input still gives
     * KVARN_ERR_NONFINITE first, whatever the kind. */
    if (!op->encode_checks_finite && (!kvarn__all_finite(k, n) || !kvarn__all_finite(v, n)))
        return KVARN_ERR_NONFINITE;
    if (op->workspace_bytes) {
        size_t need = op->workspace_bytes(head_dim, fmt->tile_tokens);
        if (workspace == NULL || workspace_size < need) {
            if (op->encode_checks_finite && (!kvarn__all_finite(k, n) || !kvarn__all_finite(v, n)))
                return KVARN_ERR_NONFINITE;
            return KVARN_ERR_BUFFER_TOO_SMALL;
        }
    }
    return op->encode(&L, k, v, record, workspace, &o);
}

kvarn_status kvarn_decode(const kvarn_format *fmt, int head_dim,
                          const void *record, size_t record_size,
                          float *k_out, float *v_out, unsigned flags)
{
    if (fmt == NULL || record == NULL) return KVARN_ERR_INVALID_ARG;
    kvarn_record_layout L;
    kvarn_status st = kvarn_record_layout_get(fmt, head_dim, &L);
    if (st != KVARN_OK) return st;
    if (record_size < L.record_bytes) return KVARN_ERR_BUFFER_TOO_SMALL;
    return kvarn__kind_ops(fmt->kind)->decode(&L, record, k_out, v_out, flags);
}
