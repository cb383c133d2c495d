/*
 * codec_internal.h -- entry points shared inside src/codec (and read by the
 * cache and attention stages). Not part of the public contract.
 */
#ifndef KVARN_CODEC_INTERNAL_H
#define KVARN_CODEC_INTERNAL_H

#include "kvarn/kvarn.h"
#include "kvarn/record.h"

/* KVarN tile codec (src/codec/kvarn_tile.c). k, v: fp32 [G][D]. The
 * arguments are already validated by kvarn_encode/kvarn_decode. */
size_t kvarn__tile_workspace_bytes(int head_dim, int tile_tokens);
kvarn_status kvarn__tile_encode(const kvarn_record_layout *L, const float *k,
                                const float *v, void *record, void *workspace,
                                const kvarn_codec_opts *opts);
kvarn_status kvarn__tile_decode(const kvarn_record_layout *L, const void *record,
                                float *k_out, float *v_out, unsigned flags);

/* Per-token formats (src/codec/per_token.c). k, v: fp32 [D] of one token. */
kvarn_status kvarn__token_encode(kvarn_kind kind, const kvarn_record_layout *L,
                                 const float *k, const float *v, void *record);
kvarn_status kvarn__token_decode(kvarn_kind kind, const kvarn_record_layout *L,
                                 const void *record, float *k_out, float *v_out);

#endif
