/*
 * state.h -- save one sequence of a kvarn_cache (cache.h) as a byte stream
 * and restore it as a new sequence, in the same cache or another one made
 * with the same options: llama.cpp's slot save/restore. A restored sequence
 * holds the same bytes as the saved one (quantized records, staged tokens,
 * sink slot, the exact records not yet committed), so every read, every
 * attention call and every later write and commit on it give bit for bit
 * what the saved sequence would have given. Nothing is decoded or encoded
 * again.
 *
 * The stream (docs/state.md "Byte layout", the table of every field):
 *   header   128 bytes, little-endian fixed-width fields: magic "KVARNSEQ",
 *            layout version (KVARN_SEQ_STATE_VERSION), header bytes, the
 *            canonical format name (32 bytes, NUL-padded), head_dim,
 *            n_kv_heads, n_layers, block size G (tokens), sink tiles, the
 *            partial sink r (tokens), staging, RTN range, balance
 *            iterations, seq_len, committed_len, quantized tiles (tokens
 *            and tiles of the sequence), payload bytes, and a CRC-32
 *            (zlib's crc32) over the header (with the CRC field zero) and
 *            the payload.
 *   payload  the sequence's bytes as the cache holds them, in the order
 *            docs/state.md "Payload" gives: the quantized records per
 *            (layer, tile, KV head); the staged tokens (sink and tail) per
 *            (layer, token, KV head); the sink slot per (layer, KV head);
 *            per (tail tile, layer) a mark byte and, when 1, that layer's
 *            records written from the exact K/V (kvarn_cache_write_exact)
 *            and not yet committed. Per-token formats: the token records
 *            per (layer, token, KV head).
 * The stream does not depend on tail_page_tokens, n_blocks, n_pages,
 * max_seqs or the sequence's block ids: a cache that differs only in those
 * restores it.
 *
 * Errors are kvarn_status values (kvarn.h); on any error the cache is
 * exactly as before the call (no sequence, block, page or reference count
 * changed). Hostile streams are refused, never trusted: every length is
 * checked against the bytes given before it is used.
 */
#ifndef KVARN_STATE_H
#define KVARN_STATE_H

#include <stddef.h>
#include <stdint.h>

#include "kvarn/cache.h"
#include "kvarn/kvarn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The layout version this build writes and reads, and its header size in
 * bytes (docs/state.md). */
#define KVARN_SEQ_STATE_VERSION 1
#define KVARN_SEQ_STATE_HEADER_BYTES 128

/* What a stream's header says (kvarn_cache_seq_state_peek). */
typedef struct kvarn_seq_state_info {
    uint32_t version;         /* layout version */
    char format[32];          /* canonical format name (kvarn_format.name) */
    int head_dim, n_kv_heads, n_layers;
    int block_size;           /* G, tokens per tile / block */
    int sink_tiles;           /* whole fp16 sink tiles */
    int sink_partial;         /* r, sink tokens of tile sink_tiles (tokens) */
    int staging;              /* kvarn_staging of the staged tokens */
    int rtn_range;            /* KVARN_RTN_MINMAX or KVARN_RTN_MSE */
    int balance_iters;        /* KVarN variance-normalization iterations */
    int seq_len;              /* tokens in the sequence */
    int committed_len;        /* tokens declared final (cache.h) */
    int quantized_tiles;      /* KVarN tiles quantized (0 for per-token) */
    uint64_t payload_bytes;   /* bytes after the header */
    uint64_t total_bytes;     /* header + payload: the stream's length */
    const char *mismatch;     /* with a cache: NULL when the stream was
                                 saved from a cache of the same settings,
                                 else the first field that differs, one of
                                 "format", "head_dim", "n_kv_heads",
                                 "n_layers", "block_size", "sink_tiles",
                                 "sink_partial", "staging", "rtn_range",
                                 "balance_iters" (a static string) */
} kvarn_seq_state_info;

/* Bytes kvarn_cache_seq_save writes for sequence seq now, into *bytes
 * (header included). Grows with the sequence: call it right before saving.
 * Errors: KVARN_ERR_INVALID_ARG (NULL, bad or freed seq);
 * KVARN_ERR_STATE (some layer has not written all of the sequence's
 * seq_len tokens: a step between reserve and its writes);
 * KVARN_ERR_TOO_LARGE (beyond size_t). */
kvarn_status kvarn_cache_seq_state_size(const kvarn_cache *c, int seq, size_t *bytes);

/* Write sequence seq's state (the stream above) into buf, which holds cap
 * bytes; *written receives its length (kvarn_cache_seq_state_size). A
 * forked sequence is saved in full (its shared blocks and pages included).
 * The cache is not changed.
 * Errors: those of kvarn_cache_seq_state_size; KVARN_ERR_BUFFER_TOO_SMALL
 * when cap is below that length (nothing written, *written set to the
 * length needed). */
kvarn_status kvarn_cache_seq_save(const kvarn_cache *c, int seq, void *buf, size_t cap,
                                  size_t *written);

/* Read a stream's header (len bytes at buf) into *out without restoring
 * anything: the checks kvarn_cache_seq_restore makes first, in its order,
 * with the same statuses. c may be NULL (no comparison with a cache; then
 * out->mismatch is NULL). *out is filled as far as the header could be
 * read (zeroed first).
 * Errors: KVARN_ERR_INVALID_ARG (NULL buf with len > 0, NULL out);
 * KVARN_ERR_BAD_FILE (no "KVARNSEQ" magic, a header size or a reserved
 * field this version does not write); KVARN_ERR_TRUNCATED (len below the
 * header, or below header + payload bytes); KVARN_ERR_BAD_VERSION (another
 * layout version); KVARN_ERR_BAD_FILE (bytes after the payload);
 * KVARN_ERR_CHECKSUM (the CRC-32 does not match); KVARN_ERR_MISMATCH (c
 * given and out->mismatch names the field that differs). */
kvarn_status kvarn_cache_seq_state_peek(const kvarn_cache *c, const void *buf, size_t len,
                                        kvarn_seq_state_info *out);

/* Make a new sequence of c holding the state in buf (len bytes, the whole
 * stream): its id goes to *seq_out. The sequence has its own blocks and
 * pages (a saved fork restores as a private copy), the saved seq_len,
 * committed_len and quantized tiles, every layer written up to seq_len.
 * Errors: those of kvarn_cache_seq_state_peek (with c); KVARN_ERR_BAD_FILE
 * (lengths that contradict each other or the cache -- a quantized tile
 * past seq_len, committed_len outside [frozen, seq_len] --, a payload of
 * another length than those fields give, a mark byte other than 0 or 1);
 * KVARN_ERR_NONFINITE (an fp16, bf16 or fp8 value of the payload that is
 * NaN or Inf: a cache never holds one); KVARN_ERR_OUT_OF_BLOCKS (seq_len
 * above the cache's max_seq_len, not enough free blocks, pages or small
 * tail pages, or max_seqs sequences live); KVARN_ERR_NOMEM (the new
 * sequence's block table). On error *seq_out is untouched and the cache
 * unchanged. */
kvarn_status kvarn_cache_seq_restore(kvarn_cache *c, const void *buf, size_t len, int *seq_out);

#ifdef __cplusplus
}
#endif

#endif /* KVARN_STATE_H */
