/*
 * gen_state.h -- the state file of `kvarn generate --save-state F /
 * --load-state F`: the library's sequence stream (include/kvarn/state.h)
 * wrapped with what the command needs to go on: the model's identity, the
 * token ids, the logits of the last token and the sampler's state. Byte
 * layout: docs/state.md "The kvarn generate state file".
 */
#ifndef KVARN_TOOLS_GEN_STATE_H
#define KVARN_TOOLS_GEN_STATE_H

#include <stddef.h>
#include <stdint.h>

#include "cli.h"

/* What a run saves and a later run restores. */
typedef struct gen_saved {
    int32_t *tokens;     /* [n_tokens] every token in the session */
    int n_tokens;
    float *logits;       /* [vocab] logits after the last token */
    uint64_t rng;        /* the sampler's xorshift state */
    uint8_t *stream;     /* the sequence (state.h), stream_bytes */
    size_t stream_bytes;
} gen_saved;

/* Write the session's state to path: tokens, logits and rng from *g (its
 * stream is taken from the session's cache here). 0, or -1 with one line
 * printed ("kvarn generate: --save-state F: ..."). */
int gen_state_save(const char *path, const cli_model *m, kvarn_llama_session *sess,
                   const gen_saved *g);

/* Read path into *g (allocated; gen_state_free) and load its sequence into
 * the session (at position 0). Checks the file (magic, version, CRC-32,
 * size) and that it was saved by this model (architecture, vocab, layers,
 * hidden size, KV heads, head_dim) with this cache format and staging.
 * 0, or -1 with one line printed that says which. */
int gen_state_load(const char *path, const cli_model *m, kvarn_llama_session *sess,
                   gen_saved *g);

void gen_state_free(gen_saved *g);

#endif
