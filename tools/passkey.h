/*
 * passkey.h -- passkey retrieval (../shared/EVAL.md "Passkey retrieval"):
 * a random 5-digit key hidden at a depth of filler text of a given length;
 * the model, fed the prompt in chunks (so the history is read from the
 * quantized cache), must say the key. Shared by `kvarn passkey` and
 * `kvarn eval --passkey`.
 */
#ifndef KVARN_TOOLS_PASSKEY_H
#define KVARN_TOOLS_PASSKEY_H

#include "cli.h"

typedef struct passkey_opts {
    const long *lengths; int n_lengths; /* prompt lengths in tokens */
    const long *depths; int n_depths;   /* key depth in percent, 0..100 */
    int trials;                         /* keys per (length, depth) */
    long chunk;                         /* prefill chunk, tokens */
    uint64_t seed;
    int threads;
    int quiet;                          /* no progress on stderr */
    int sink_tokens;                    /* KVarN sink tokens S (0: no
                                           sink); -1: the default sink */
    const char *progress;               /* progress label; NULL: "kvarn passkey" */
    int staging;                        /* kvarn_staging of the formats' sessions
                                           (KVARN_STAGING_FP16 is 0: set it) */
} passkey_opts;

/* The shortest length passkey_run takes for m's tokenizer: the tokens of
 * the prompt without filler (intro, key sentence, question). -1 after
 * printing an error. */
long passkey_min_length(cli_model *m);

/* Run every (length, depth, trial) for the reference fp16 cache (row 0 of
 * correct) and for each of the nf formats (rows 1..nf).
 * correct: [(nf + 1) * n_lengths] counts of retrieved keys, of
 * n_depths * trials each. Returns 0, or -1 after printing an error. */
int passkey_run(cli_model *m, const kvarn_format *fmts, int nf, const passkey_opts *o, int *correct);

#endif
