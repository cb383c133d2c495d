/*
 * format_kinds.h -- a format kind (kvarn_kind) as one row of operations:
 * what its names look like, which geometry a format of the kind may have,
 * which head_dim it serves, its record layout, and its encode/decode entry
 * points. The attention tile kernels of each kind are the same row's second
 * half, kept in the attention stage (src/attn/kernel_table.c) because the
 * codec sits below attention in the build (docs/README.md "Code map").
 *
 * Adding a format kind = one row here (format_kinds.c), one row in
 * src/attn/kernel_table.c, its codec and kernel functions, and its CUDA
 * traits (src/cuda/kinds.cuh). No other code switches on kvarn_kind to
 * pick an operation; what still tests the kind asks only "KVarN or not"
 * for the paged structure around the records (sink, fp16 staging pages,
 * commit, the Hadamard basis of attention).
 * Not part of the public contract.
 */
#ifndef KVARN_FORMAT_KINDS_H
#define KVARN_FORMAT_KINDS_H

#include <stddef.h>

#include "kvarn/kvarn.h"
#include "kvarn/record.h"

/* How many fp16 values one metadata field of a record holds (record.h):
 * none, one per record row, one per channel (D), one per token (G). */
typedef enum kvarn_meta_count {
    KVARN_META_NONE = 0,
    KVARN_META_ONE,
    KVARN_META_PER_CHANNEL,
    KVARN_META_PER_TOKEN
} kvarn_meta_count;

/* The metadata fields of a record, in record.h's order. v_mu is the field
 * of a mean-centred format (kvarn_format.centred) only; a kind whose v_mu
 * is KVARN_META_NONE has no centred formats. */
typedef struct kvarn_kind_meta {
    unsigned char k_a, k_b, k_stok, v_schan, v_a, v_b; /* kvarn_meta_count */
    unsigned char v_mu;
} kvarn_kind_meta;

/* Encode one record: k, v fp32 [G][D] token-major (G = 1 for per-token
 * kinds); record >= L->record_bytes; workspace: workspace_bytes(D, G) bytes
 * (unused when that is NULL). Arguments are already checked by kvarn_encode
 * (codec.c), finiteness included unless the row's encode_checks_finite is set. Errors: KVARN_ERR_NONFINITE when a stored
 * fp16 field would overflow (nothing written), KVARN_ERR_UNSUPPORTED_HEAD_DIM. */
typedef kvarn_status (*kvarn_kind_encode_fn)(const kvarn_record_layout *L, const float *k,
                                             const float *v, void *record, void *workspace,
                                             const kvarn_codec_opts *opts);
/* Decode one record to fp32 [G][D]; k_out or v_out may be NULL; flags:
 * KVARN_DECODE_* (kvarn.h). */
typedef kvarn_status (*kvarn_kind_decode_fn)(const kvarn_record_layout *L, const void *record,
                                             float *k_out, float *v_out, unsigned flags);

typedef struct kvarn_kind_ops {
    kvarn_kind kind;           /* the row's own index, checked by the tests */
    const char *name;          /* "fp16", ..., "kvarn": the kind, not a format */
    int per_tile;              /* 1: a record is a tile of G tokens encoded at
                                  once; 0: one token (G = 1) */
    /* Geometry of a format of this kind: fixed values, or 0 for "from the
     * format name" (KVarN: bits in {2, 4, 8}, G in {32, 64, 128}). */
    int tile_tokens, key_bits, value_bits;
    /* A name pattern beyond format.c's fixed names: fills *out and returns 1
     * when name matches; NULL for kinds with fixed names only. */
    int (*parse_name)(const char *name, kvarn_format *out);
    /* The head_dim range: D in [min_head_dim, max_head_dim] and a multiple
     * of head_dim_step; pow2_head_dim: D must also be a power of two. */
    int min_head_dim, max_head_dim, head_dim_step, pow2_head_dim;
    kvarn_kind_meta meta;      /* record layout: fp16 metadata fields */
    /* Record bytes from the payload bytes (padding, record.h); NULL: none. */
    size_t (*record_bytes)(size_t payload, size_t head_dim, size_t tile_tokens);
    /* Encode scratch bytes for D and G; NULL: the kind needs none. */
    size_t (*workspace_bytes)(int head_dim, int tile_tokens);
    kvarn_kind_encode_fn encode;
    kvarn_kind_decode_fn decode;
    /* 1: encode itself rejects NaN / Inf input with KVARN_ERR_NONFINITE
     * (in its first pass over the tile), so kvarn_encode skips its own scan;
     * 0: kvarn_encode scans k and v first. */
    int encode_checks_finite;
} kvarn_kind_ops;

/* The row of a kind; NULL for a value outside [0, KVARN_KIND_COUNT). */
const kvarn_kind_ops *kvarn__kind_ops(kvarn_kind kind);

/* Whether *f is a format its kind's row admits (tile length, bit widths,
 * centred only where the row has a v_mu field; the name is not read). 0
 * for NULL or an unknown kind. */
int kvarn__format_valid(const kvarn_format *f);

#endif
