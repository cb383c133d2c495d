/*
 * mla_internal.h -- the byte layout of an MLA record (include/kvarn/mla.h)
 * as offsets, and the carve of the MLA workspace, shared by the codec
 * (src/codec/mla_record.c) and the absorbed attention (src/attn/mla_*.c).
 * Not part of the public contract.
 */
#ifndef KVARN_MLA_INTERNAL_H
#define KVARN_MLA_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "kvarn/mla.h"
#include "kvarn/record.h"

/* Largest n_rows x n_heads of one attention call (the workspace sizes are
 * formed below it without overflow). */
#define KVARN_MLA_MAX_QROWS (1 << 20)
/* Query rows per block of the folded attention kernels (= ATTN_MLA_QB of
 * src/attn/mla_kernels.h, which checks it). */
#define KVARN_MLA_QB 8

typedef struct kvarn_mla_layout {
    int latent_dim, rope_dim, tile_tokens; /* D, R, G */
    int latent_bits, rope_bits;
    kvarn_record_layout lat;   /* the latent part as a KVarN K tile: k_codes,
                                  k_a (a_d), k_b (b_d), k_stok (s_tok_t);
                                  no V fields; record_bytes = rope_off */
    size_t rope_off;           /* r16: fp16 [G][R]; r8: u8 codes [G][R] */
    size_t rope_scale_off;     /* r8: fp16 [G] scale per token (r16: = end) */
    size_t rope_zero_off;      /* r8: fp16 [G] zero-point per token */
    size_t payload_bytes;      /* all fields, before padding */
    size_t record_bytes;       /* padded to a multiple of 8 */
} kvarn_mla_layout;

/* Fill *L for fmt and the dims; errors as kvarn_mla_check_dims. */
kvarn_status kvarn__mla_layout(const kvarn_mla_format *fmt, int latent_dim, int rope_dim,
                               kvarn_mla_layout *L);

/* Decode one record: latent in the ROTATED basis (c_rot = (code a_d + b_d)
 * s_tok_t) [G][D] and rope [G][R] (each may be NULL). L from
 * kvarn__mla_layout. */
void kvarn__mla_decode_rotated(const kvarn_mla_layout *L, const uint8_t *record, float *lat_rot,
                               float *rope);

/* Scratch of one attention call, nq = n_rows n_heads query rows (float
 * arrays, each 64-byte aligned from a 64-byte aligned base):
 *   qr   [nq][D]  the latent queries rotated by H/sqrt(D)
 *   qa   [QB][D]  folded kernels: a block of query rows folded with a_d
 *   acc  [nq][D]  the rotated output accumulators
 *   m, l [nq]     running max and sum of exp of the online softmax
 *   lat  [G][D]   one tile's latent (decoded or tail rows), rotated
 *   rope [G][R]   one tile's rope rows
 *   sc   [QB][G]  a block of query rows' scores / weights over a tile
 *   pw   [QB][G]  folded kernels: the block's softmax weights times s_tok
 * (QB = KVARN_MLA_QB, the folded kernels' block of query rows)
 *   codes [D][G]  bytes: SIMD kernels: a tile's codes, one per byte */
typedef struct kvarn_mla_attn_ws {
    float *qr, *qa, *acc, *m, *l, *lat, *rope, *sc, *pw;
    uint8_t *codes;
} kvarn_mla_attn_ws;

static inline size_t kvarn__mla_round64(size_t n) { return (n + 63) & ~(size_t)63; }

/* Bytes of the attention scratch (+ 64 for the alignment of the base);
 * with base non-NULL also carve it. nq <= KVARN_MLA_MAX_QROWS, D <= 512,
 * G <= 128, R <= 128: no overflow. */
static inline size_t kvarn__mla_attn_ws_carve(int D, int R, int G, int nq, void *base,
                                              kvarn_mla_attn_ws *ws)
{
    const size_t fd = sizeof(float), q = (size_t)nq, d = (size_t)D, g = (size_t)G;
    const size_t qb = KVARN_MLA_QB;
    const size_t sz[10] = {q * d * fd, qb * d * fd, q * d * fd, q * fd, q * fd,
                           g * d * fd, g * (size_t)R * fd, qb * g * fd, qb * g * fd, d * g};
    size_t off[10], total = 0;
    for (int i = 0; i < 10; i++) {
        off[i] = total;
        total += kvarn__mla_round64(sz[i] > 0 ? sz[i] : 1);
    }
    if (base != NULL) {
        uint8_t *b = (uint8_t *)base + ((64 - (uintptr_t)base % 64) % 64);
        float **f[9] = {&ws->qr, &ws->qa, &ws->acc, &ws->m, &ws->l, &ws->lat, &ws->rope, &ws->sc, &ws->pw};
        for (int i = 0; i < 9; i++) *f[i] = (float *)(void *)(b + off[i]);
        ws->codes = b + off[9];
    }
    return total + 64;
}

#endif
