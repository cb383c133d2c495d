/*
 * eval_coverage.h -- whether the positions `kvarn eval` measures ever attend
 * to K/V that a format's cache holds in that format (quantized or rounded),
 * or only to fp16 and exact K/V. A column of the second kind reads about 0
 * for the format whatever its quality: e.g. --ctx 512 with the default 320
 * decoded tokens leaves the chunk-fed positions of kvarn_k4v2_g128 inside
 * its fp16 sink and tail. eval_coverage_check says so, with what to
 * change; `kvarn eval` prints that on stderr and puts it in its JSON
 * report.
 */
#ifndef KVARN_TOOLS_EVAL_COVERAGE_H
#define KVARN_TOOLS_EVAL_COVERAGE_H

#include <stdint.h>

#include "kvarn/cache.h"

/* How eval feeds one window (the options after eval_fit): ctx tokens,
 * tokens [0, ctx - decode_tokens) in chunks of chunk tokens, the rest one
 * at a time. Position p is scored against token p + 1 (p < ctx - 1).
 * ctx >= 2, 1 <= chunk <= ctx, 0 <= decode_tokens <= ctx - 1.
 * asked_chunk and asked_decode_tokens are the options as given (eval_fit
 * lowers them to fit ctx): a larger --ctx would use those. */
typedef struct eval_layout {
    long ctx, chunk, decode_tokens;
    long asked_chunk, asked_decode_tokens;
} eval_layout;

/* Tokens of a sequence holding n committed tokens that a cache of geometry
 * info keeps in its format: per-token formats all n (each token-head is
 * encoded when written); KVarN the full tiles past the S = info->sink_tokens
 * fp16 sink tokens, floor(n / G) * G - S when positive (a tile is quantized
 * at the commit that follows its last token, docs/paged-cache.md "The life
 * of a token" and "The sink"; the session commits after every forward
 * call). 0 for n <= 0. */
long eval_quantized_tokens(const kvarn_cache_info *info, long n);

/* One warning of eval_coverage_check: its text, one line without the
 * "kvarn eval: warning: " prefix and without a newline, and the formats
 * it concerns (bit f set: infos[f] of the call). */
typedef struct eval_warning {
    char text[2048];
    uint64_t formats;
} eval_warning;

/* At most this many warnings (one per kind below). */
#define EVAL_COVERAGE_MAX 3

/* The warnings about the columns of the formats infos[0..nf) (the geometry
 * of each format's session cache, kvarn_cache_get_info; nf <= 64) that
 * measure no K/V held in the format, into out[0..n); returns n (0 to
 * EVAL_COVERAGE_MAX):
 *   - chunk-fed (KLD mean..max, top-1): a chunk attends to its own K/V
 *     exactly and to the history before its start as the cache holds it,
 *     so these columns measure the format only when some chunk with a
 *     scored position starts after a quantized token;
 *   - decoded (dec KLD, dec top1), KVarN: a decoded token attends to the
 *     committed history and to the fp16 tail, its own included (per-token
 *     formats always hold it encoded);
 *   - decoded, every format: --decode-tokens 1 scores no position.
 * Each of the first two names the formats (and sets their bits) and the
 * smallest --ctx, the largest --decode-tokens, --chunk or --sink-tokens
 * that would measure them; fp16 rows are skipped (they equal the reference
 * by design). The third concerns every format. */
int eval_coverage_check(const eval_layout *l, const kvarn_cache_info *infos, int nf,
                        eval_warning out[EVAL_COVERAGE_MAX]);

#endif
