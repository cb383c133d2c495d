/*
 * cmd_passkey.c -- `kvarn passkey`: retrieval accuracy per cache format
 * beside the unquantized cache's own (../shared/EVAL.md).
 *
 * Three steps: the options (one table, cli_options.h), the run (passkey.c
 * fills the retrieved-key counts), and the table printed from the counts.
 */
#include <stddef.h>
#include <stdlib.h>

#include "cli_options.h"
#include "passkey.h"

/* ---- options ------------------------------------------------------------ */

typedef struct pk_opts {
    const char *model_path, *dtypes;
    cli_list lengths, depths; /* tokens; percent */
    long trials, chunk, seed, threads;
    long sink_tokens; /* KVarN sink tokens S (0: no sink); -1: the default */
    const char *staging_name; /* --kvarn-staging; NULL: int8 */
} pk_opts;

static const pk_opts k_defaults = {
    .dtypes = "kvarn_k4v2_g128",
    .lengths = {{1024, 2048, 4096, 8192}, 4},
    .depths = {{0, 25, 50, 75, 100}, 5},
    .trials = 1, .chunk = 128, .seed = 1, .threads = 1, .sink_tokens = -1,
};

#define OPT(f) offsetof(pk_opts, f)
static const cli_option k_options[] = {
    {"model", 'm', CLI_TEXT, OPT(model_path), 0, 0, 0, NULL, NULL},
    {"kv-cache-dtype", 0, CLI_TEXT, OPT(dtypes), 0, 0, 0, "--kv-cache-dtype",
     "cache formats, NAME[,NAME...] or all (default kvarn_k4v2_g128)"},
    {"lengths", 0, CLI_LIST, OPT(lengths), 64, 1 << 20, 0, "--lengths L,...",
     "prompt lengths in tokens (default 1024,2048,4096,8192)"},
    {"depths", 0, CLI_LIST, OPT(depths), 0, 100, 0, "--depths P,...",
     "key depths in percent of the prompt (default 0,25,50,75,100)"},
    {"trials", 0, CLI_INT, OPT(trials), 1, 1000, 0, "--trials N", "keys per length and depth (default 1)"},
    {"chunk", 0, CLI_INT, OPT(chunk), 1, 4096, 0, "--chunk N", "prefill chunk in tokens (default 128)"},
    {"seed", 0, CLI_INT, OPT(seed), 0, 0x7fffffffL, 0, "--seed S", "key seed (default 1)"},
    {"threads", 0, CLI_INT, OPT(threads), 1, 256, 0, "--threads T",
     "attention worker threads (default 1)"},
    {"sink-tokens", 0, CLI_INT, OPT(sink_tokens), 0, 1 << 16, 0, "--sink-tokens S",
     "KVarN: first S tokens staged, not encoded (default one\n"
     "tile; 0: no sink)"},
    {"kvarn-staging", 0, CLI_TEXT, OPT(staging_name), 0, 0, 0, "--kvarn-staging F",
     CLI_STAGING_HELP},
    {"help", 'h', CLI_HELP, 0, 0, 0, 0, NULL, NULL},
};
#undef OPT

static const cli_command k_command = {
    "passkey", k_options, sizeof k_options / sizeof k_options[0],
    "usage: kvarn passkey -m MODEL [--kv-cache-dtype NAME[,NAME...]|all]\n"
    "                     [--lengths 1024,2048,4096,8192] [--depths 0,25,50,75,100]\n"
    "                     [--trials 1] [--chunk 128] [--seed 1] [--threads 1]\n"
    "                     [--sink-tokens S] [--kvarn-staging F]\n\n",
    "Hides a random 5-digit key at each depth (percent) of filler text of each\n"
    "length (tokens), feeds the prompt in chunks so the history is read from the\n"
    "cache, and checks the greedy answer. Prints retrieved keys per length for the\n"
    "fp16 cache (the reference) and each format.\n",
};

/* ---- reporting ---------------------------------------------------------- */

/* The table: one row per cache (fp16 reference first), retrieved / tried
 * per length, and the share over all lengths. correct as passkey_run. */
static void passkey_print(const pk_opts *o, const kvarn_format *fmts, int nf, const int *correct)
{
    const int nl = o->lengths.n, per = o->depths.n * (int)o->trials;
    printf("passkey retrieval: %d depth(s) x %ld trial(s) per length, chunk %ld\n", o->depths.n,
           o->trials, o->chunk);
    printf("%-18s", "format");
    for (int l = 0; l < nl; l++) printf(" %9ld", o->lengths.v[l]);
    printf(" %9s\n", "all");
    for (int f = 0; f <= nf; f++) {
        int sum = 0;
        printf("%-18s", f == 0 ? "fp16 (reference)" : fmts[f - 1].name);
        for (int l = 0; l < nl; l++) {
            printf(" %4d/%-4d", correct[f * nl + l], per);
            sum += correct[f * nl + l];
        }
        printf(" %5.1f%%\n", 100.0 * sum / (per * nl));
    }
}

int cmd_passkey(int argc, char **argv)
{
    pk_opts o = k_defaults;
    int rc = cli_parse_options(&k_command, argc, argv, &o);
    if (rc >= 0) return rc;
    if (o.model_path == NULL) { cli_error("passkey", "need -m MODEL (see kvarn passkey --help)"); return 2; }
    kvarn_format fmts[CLI_MAX_FORMATS];
    int nf = cli_parse_formats("passkey", o.dtypes, fmts, CLI_MAX_FORMATS);
    if (nf < 0) return 2;
    int staging;
    if (cli_parse_staging("passkey", o.staging_name, &staging)) return 2;
    cli_warn_kvarn_only("passkey", o.sink_tokens, 0, o.staging_name, fmts, nf);
    cli_model m;
    if (cli_model_open("passkey", o.model_path, &m)) return 1;
    passkey_opts po = {o.lengths.v, o.lengths.n, o.depths.v, o.depths.n, (int)o.trials, o.chunk,
                       (uint64_t)o.seed, (int)o.threads, 0, (int)o.sink_tokens, NULL, staging};
    int *correct = calloc((size_t)(nf + 1) * (size_t)o.lengths.n, sizeof(int));
    rc = 1;
    if (correct == NULL) cli_error("passkey", "out of memory");
    else if (passkey_run(&m, fmts, nf, &po, correct) == 0) {
        passkey_print(&o, fmts, nf, correct);
        rc = 0;
    }
    free(correct);
    cli_model_close(&m);
    return rc;
}
