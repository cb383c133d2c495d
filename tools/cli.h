/*
 * cli.h -- small helpers shared by the kvarn subcommands: option parsing,
 * byte sizes, format lists, errors on stderr.
 */
#ifndef KVARN_TOOLS_CLI_H
#define KVARN_TOOLS_CLI_H

#include <stdint.h>
#include <stdio.h>

#include "kvarn/kvarn.h"

#define CLI_MAX_FORMATS 64

/* Every subcommand: argc/argv start at the subcommand's own name. Returns the
 * process exit code (0 ok, 1 runtime error, 2 usage error). */
int cmd_inspect(int argc, char **argv);
int cmd_generate(int argc, char **argv);
int cmd_eval(int argc, char **argv);
int cmd_passkey(int argc, char **argv);

/* Print "kvarn <cmd>: message" on stderr. */
void cli_error(const char *cmd, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Parse "16GiB", "512MiB", "2GB", "1000000" into bytes. 0 on success. */
int cli_parse_bytes(const char *s, uint64_t *out);

/* Parse a non-negative integer / a double with range checks. 0 on success. */
int cli_parse_int(const char *s, long lo, long hi, long *out);
int cli_parse_double(const char *s, double *out);
/* What the last cli_parse_int / cli_parse_double call expected, in words
 * ("an integer from 1 to 4096"), for error messages. */
const char *cli_expected(void);
void cli_expect(const char *what);

/* Parse "NAME,NAME,..." or "all" into formats with format_list_parse
 * (format_list.h: the one list parser of every command and benchmark). On a
 * bad list prints its message ("kvarn CMD: ...", with the accepted names)
 * and returns -1; else the count (>= 1). */
int cli_parse_formats(const char *cmd, const char *list, kvarn_format *out, int max);

/* --tail-page-tokens T against the chosen formats: 0, or T >= a KVarN
 * format's tile G (whole pages), or T dividing G. Else prints why and
 * returns -1 (a usage error: exit 2). */
int cli_check_tail_tokens(const char *cmd, long tail_tokens, const kvarn_format *fmts, int n);

/* Bytes of one warning text of cli_kvarn_only_warnings. */
#define CLI_WARNING_LEN 512

/* The options that only KVarN caches use, given with no KVarN format among
 * fmts[0..n): --sink-tokens S (S >= 0; S < 0: not given),
 * --tail-page-tokens T (T > 0; 0: not given) and --kvarn-staging NAME
 * (staging_name; NULL: not given). Per-token formats ignore them
 * (kvarn_cache_opts), so each given one is a warning: its text into out[i]
 * ("--sink-tokens 16 does nothing for int8: only KVarN formats (kvarn_*)
 * keep an fp16 sink"; no prefix, no newline). Returns the number of
 * warnings, 0 to CLI_KVARN_ONLY_MAX. */
#define CLI_KVARN_ONLY_MAX 3
int cli_kvarn_only_warnings(long sink_tokens, long tail_tokens, const char *staging_name,
                            const kvarn_format *fmts, int n,
                            char out[CLI_KVARN_ONLY_MAX][CLI_WARNING_LEN]);

/* cli_kvarn_only_warnings printed on stderr, "kvarn CMD: warning: TEXT"
 * a line. Returns their number. */
int cli_warn_kvarn_only(const char *cmd, long sink_tokens, long tail_tokens,
                        const char *staging_name, const kvarn_format *fmts, int n);

/* Human-readable bytes ("12.3 MiB") into buf. */
const char *cli_fmt_bytes(double bytes, char *buf, size_t len);

/* The message printed when a model file is missing: how to get one. */
void cli_missing_model(const char *cmd, const char *path);

/* 0 when path names a regular file; else prints the missing-model message
 * (absent) or "is not a regular file" (a directory, a FIFO that would block
 * the open, a device) and returns -1. Opens nothing. */
int cli_check_model_path(const char *cmd, const char *path);


/* ---- model loading shared by generate / eval / passkey ------------------ */
#include "kvarn/gguf.h"
#include "kvarn/model.h"
#include "kvarn/tokenizer.h"

typedef struct cli_model {
    kvarn_gguf *gguf;
    kvarn_llama *llama;
    kvarn_tokenizer *tok;
    const kvarn_llama_hparams *hp;
} cli_model;

/* Open a GGUF, load the llama weights and the tokenizer. Prints a clear
 * message (how to get the model if the file is missing) and returns -1 on
 * failure; 0 on success. */
int cli_model_open(const char *cmd, const char *path, cli_model *m);
void cli_model_close(cli_model *m);

/* --sink-tokens S into session options: S > 0 keeps S fp16 sink tokens
 * (sink_tokens; KVarN only, cache.h), S = 0 no sink at all (sink_tiles 0),
 * S < 0 leaves the default sink (one tile). */
void cli_session_set_sink(kvarn_llama_session_opts *so, long sink_tokens);

/* The help line of --kvarn-staging, the same in every command. */
#define CLI_STAGING_HELP                                                                    \
    "KVarN: staged tokens (sink, tail) as int8 records\n(default), fp16 (the spec's), "       \
    "fp8_e4m3 (alias\nfp8) or int4"

/* --kvarn-staging NAME (NULL: not given, int8, the cache default; kvarn_cache_staging_parse:
 * fp16, int8, fp8_e4m3 or its alias fp8, int4) into *staging
 * (kvarn_cache_opts.staging). 0, or 2 with the usage error printed. */
int cli_parse_staging(const char *cmd, const char *name, int *staging);

/* Create a session of m with so, saying clearly what did not fit when it
 * cannot be made: plans it first (kvarn_llama_session_plan) and refuses,
 * without allocating, a context beyond the library's limits or one whose
 * memory exceeds this machine's (RAM + swap); on an allocation failure
 * names the bytes asked for. The messages read "cannot allocate the KV
 * cache: 12.0 GiB asked for N tokens x L layers x Hk KV heads x D channels
 * in FORMAT (...)" and end with hint (e.g. "lower --ctx"). 0 on success;
 * -1 with the message printed. */
int cli_session_create(const char *cmd, const cli_model *m, const kvarn_llama_session_opts *so,
                       const char *hint, kvarn_llama_session **out);

/* Bytes of memory this machine has (RAM + swap), 0 when unknown. */
uint64_t cli_machine_memory(void);

/* Read a whole file into a malloc'ed NUL-terminated buffer. -1 on error
 * (message printed). */
int cli_read_file(const char *cmd, const char *path, char **data, size_t *len);

/* Monotonic seconds. */
/* s as valid UTF-8 (malloc'd; NULL when out of memory): what is not a
 * well-formed UTF-8 sequence (stray continuation or 0xC0/0xC1/0xF5..0xFF
 * bytes, truncated, overlong or surrogate sequences, code points above
 * U+10FFFF) becomes U+FFFD, one per maximal subpart (as Python's
 * decode("utf-8", "replace")). For JSON: paths are bytes, JSON strings
 * are Unicode. */
char *cli_utf8_valid(const char *s);

double cli_now(void);

/* Progress on stderr: "\r[label] done/total" at most every 0.2 s when
 * stderr is a terminal; otherwise a line each time done passes a multiple
 * of ceil(total / 10), and one at done == total. cli_progress_end ends the
 * line (and starts the next count afresh). */
void cli_progress(const char *label, long done, long total);
void cli_progress_end(void);

/* Bytes of the paged cache's arenas that one sequence of n_tokens would
 * hold in format f for the model (all layers and KV heads, K and V, as a
 * cache keeps it with its default settings but staging, a kvarn_staging
 * (cache.h), every full tile committed): the library's
 * kvarn_cache_capacity_get seq_arena_bytes, for a cache no session has
 * (generate's fp16 comparison). -1 on a format the model's head_dim does
 * not take or n_tokens out of [0, 2^30]. */
double cli_kv_bytes_used(const kvarn_format *f, const kvarn_llama_hparams *hp, long n_tokens,
                         int staging);

/* Bytes the session's cache holds now for its tokens (all layers and KV
 * heads, K and V): blocks and fp16 pages in use times their bytes, and
 * its sequences' sink slots (a sink shorter than a tile), from
 * kvarn_cache_get_stats and kvarn_cache_get_info of
 * kvarn_llama_session_cache(s). -1 for a session without a cache. */
double cli_session_kv_bytes(kvarn_llama_session *s);

/* What a cache in a byte budget holds, all memory counted (the library's
 * kvarn_cache_fit_budget, kvarn_cache_capacity_get, kvarn_cache_seqs_fit):
 * tokens of a cache for max_seqs sequences (its default settings otherwise:
 * KVarN sink_tokens S when S >= 0, 0 meaning no sink; tail pages of T
 * tokens when 0 < T < G, cache.h tail_page_tokens), and for each of
 * lens[0..n_lens) the requests of that length that fit. */
typedef struct cli_capacity {
    int block_size;     /* G, tokens */
    int fits;           /* 0: the budget does not hold max_seqs' fp16 pages
                           plus one block (tokens is then 0) */
    uint64_t tokens;
    int seqs[8];        /* per lens[i] */
} cli_capacity;
kvarn_status cli_capacity_get(const kvarn_format *f, int layers, int kv_heads, int head_dim,
                              uint64_t budget, int max_seqs, int sink_tokens, int tail_tokens,
                              int staging,
                              const int *lens, int n_lens, cli_capacity *out);

#endif
