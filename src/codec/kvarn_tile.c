/* kvarn_tile.c -- placeholder until the KVarN tile codec lands. */
#include "codec/codec_internal.h"
size_t kvarn__tile_workspace_bytes(int head_dim, int tile_tokens) { return 16; }
kvarn_status kvarn__tile_encode(const kvarn_record_layout *L, const float *k,
                                const float *v, void *record, void *workspace,
                                const kvarn_codec_opts *opts)
{ return KVARN_ERR_UNSUPPORTED; }
kvarn_status kvarn__tile_decode(const kvarn_record_layout *L, const void *record,
                                float *k_out, float *v_out, unsigned flags)
{ return KVARN_ERR_UNSUPPORTED; }
