/*
 * cmd_passkey.c -- `kvarn passkey`: retrieval accuracy per cache format
 * beside the unquantized cache's own (../shared/EVAL.md).
 */
#include <stdlib.h>
#include <string.h>

#include "passkey.h"

static void passkey_usage(FILE *f)
{
    fprintf(f,
            "usage: kvarn passkey -m MODEL [--kv-cache-dtype NAME[,NAME...]|all]\n"
            "                     [--lengths 1024,2048,4096,8192] [--depths 0,25,50,75,100]\n"
            "                     [--trials 1] [--chunk 128] [--seed 1] [--threads 1]\n\n"
            "Hides a random 5-digit key at each depth (percent) of filler text of each\n"
            "length (tokens), feeds the prompt in chunks so the history is read from the\n"
            "cache, and checks the greedy answer. Prints retrieved keys per length for the\n"
            "fp16 cache (the reference) and each format. Default format: kvarn_k4v2_g128.\n");
}

static int parse_list(const char *s, long lo, long hi, long *out, int max)
{
    char what[96];
    snprintf(what, sizeof what, "a comma-separated list of integers from %ld to %ld", lo, hi);
    cli_expect(what);
    int n = 0;
    const char *p = s;
    while (*p) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < lo || v > hi || n == max) return -1;
        out[n++] = v;
        if (*end == ',') end++;
        else if (*end != '\0') return -1;
        p = end;
    }
    return n ? n : -1;
}

int cmd_passkey(int argc, char **argv)
{
    const char *model_path = NULL, *dtypes = "kvarn_k4v2_g128";
    long lengths[16] = {1024, 2048, 4096, 8192}, depths[16] = {0, 25, 50, 75, 100};
    int n_lengths = 4, n_depths = 5;
    long trials = 1, chunk = 128, seed = 1, threads = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) { passkey_usage(stdout); return 0; }
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (v == NULL) { cli_error("passkey", "option '%s' needs a value (or is unknown)", a); return 2; }
        int bad = 0;
        if (strcmp(a, "-m") == 0 || strcmp(a, "--model") == 0) model_path = v;
        else if (strcmp(a, "--kv-cache-dtype") == 0) dtypes = v;
        else if (strcmp(a, "--lengths") == 0) bad = (n_lengths = parse_list(v, 64, 1 << 20, lengths, 16)) < 0;
        else if (strcmp(a, "--depths") == 0) bad = (n_depths = parse_list(v, 0, 100, depths, 16)) < 0;
        else if (strcmp(a, "--trials") == 0) bad = cli_parse_int(v, 1, 1000, &trials);
        else if (strcmp(a, "--chunk") == 0) bad = cli_parse_int(v, 1, 4096, &chunk);
        else if (strcmp(a, "--seed") == 0) bad = cli_parse_int(v, 0, 0x7fffffffL, &seed);
        else if (strcmp(a, "--threads") == 0) bad = cli_parse_int(v, 1, 256, &threads);
        else { cli_error("passkey", "unknown option '%s'", a); passkey_usage(stderr); return 2; }
        if (bad) { cli_error("passkey", "bad value '%s' for %s (expected %s)", v, a, cli_expected()); return 2; }
        i++;
    }
    if (model_path == NULL) { cli_error("passkey", "need -m MODEL (see kvarn passkey --help)"); return 2; }
    kvarn_format fmts[CLI_MAX_FORMATS];
    int nf = cli_parse_formats("passkey", dtypes, fmts, CLI_MAX_FORMATS);
    if (nf < 0) return 2;
    cli_model m;
    if (cli_model_open("passkey", model_path, &m)) return 1;
    passkey_opts o = {lengths, n_lengths, depths, n_depths, (int)trials, chunk, (uint64_t)seed, (int)threads, 0, -1};
    int *correct = calloc((size_t)(nf + 1) * (size_t)n_lengths, sizeof(int));
    int rc = 1;
    if (correct && passkey_run(&m, fmts, nf, &o, correct) == 0) {
        int per = n_depths * (int)trials;
        printf("passkey retrieval: %d depth(s) x %ld trial(s) per length, chunk %ld\n", n_depths, trials, chunk);
        printf("%-18s", "format");
        for (int l = 0; l < n_lengths; l++) printf(" %9ld", lengths[l]);
        printf(" %9s\n", "all");
        for (int f = 0; f <= nf; f++) {
            int sum = 0;
            printf("%-18s", f == 0 ? "fp16 (reference)" : fmts[f - 1].name);
            for (int l = 0; l < n_lengths; l++) {
                printf(" %4d/%-4d", correct[f * n_lengths + l], per);
                sum += correct[f * n_lengths + l];
            }
            printf(" %5.1f%%\n", 100.0 * sum / (per * n_lengths));
        }
        rc = 0;
    }
    free(correct);
    cli_model_close(&m);
    return rc;
}
