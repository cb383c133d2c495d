/* per_token.c -- placeholder until the per-token codecs land. */
#include "codec/codec_internal.h"
kvarn_status kvarn__token_encode(kvarn_kind kind, const kvarn_record_layout *L,
                                 const float *k, const float *v, void *record)
{ return KVARN_ERR_UNSUPPORTED; }
kvarn_status kvarn__token_decode(kvarn_kind kind, const kvarn_record_layout *L,
                                 const void *record, float *k_out, float *v_out)
{ return KVARN_ERR_UNSUPPORTED; }
