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

/* Per-token formats (src/codec/per_token.c), one encode/decode pair per
 * kind, in the signatures of format_kinds.h (the rows' entry points).
 * k, v: fp32 [D] of one token; workspace, opts and flags are not read. */
#define KVARN_TOKEN_CODEC_DECL(NAME)                                                       \
    kvarn_status kvarn__##NAME##_encode(const kvarn_record_layout *L, const float *k,      \
                                        const float *v, void *record, void *workspace,     \
                                        const kvarn_codec_opts *opts);                     \
    kvarn_status kvarn__##NAME##_decode(const kvarn_record_layout *L, const void *record,  \
                                        float *k_out, float *v_out, unsigned flags);
KVARN_TOKEN_CODEC_DECL(fp16)
KVARN_TOKEN_CODEC_DECL(bf16)
KVARN_TOKEN_CODEC_DECL(fp8_e4m3)
KVARN_TOKEN_CODEC_DECL(fp8_e5m2)
KVARN_TOKEN_CODEC_DECL(int8)
KVARN_TOKEN_CODEC_DECL(int4)
#undef KVARN_TOKEN_CODEC_DECL

#endif
