/*
 * kvarn.c -- the `kvarn` command: dispatch to a subcommand.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "simd_env.h"

typedef struct subcommand {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;
} subcommand;

static const subcommand k_commands[] = {
    {"generate", cmd_generate, "stream text from a model with its KV cache in any format"},
    {"eval", cmd_eval, "quality (KLD, top-1, perplexity), memory and speed per cache format"},
    {"passkey", cmd_passkey, "passkey retrieval accuracy per format beside the fp16 cache's own"},
    {"inspect", cmd_inspect, "bytes per token, multiple of fp16, tokens that fit in a budget"},
};

/* The list of accepted format names ("a, b (alias c), ..."), wrapped at
 * its ", " separators into lines of at most 80 columns, indented by 2. */
static void print_wrapped_names(FILE *f, const char *list)
{
    const int width = 80, indent = 2;
    int col = indent;
    fprintf(f, "%*s", indent, "");
    for (const char *p = list; *p;) {
        const char *sep = strstr(p, ", ");
        int n = sep ? (int)(sep - p) + 1 : (int)strlen(p); /* the item and its comma */
        if (col > indent && col + 1 + n > width) {
            fprintf(f, "\n%*s", indent, "");
            col = indent;
        } else if (col > indent) {
            fputc(' ', f);
            col++;
        }
        fprintf(f, "%.*s", n, p);
        col += n;
        p += sep ? n + 1 : n;
    }
    fputc('\n', f);
}

static void usage(FILE *f)
{
    fprintf(f, "usage: kvarn <command> [options]   (kvarn <command> --help for more)\n\ncommands:\n");
    for (size_t i = 0; i < sizeof k_commands / sizeof k_commands[0]; i++)
        fprintf(f, "  %-9s %s\n", k_commands[i].name, k_commands[i].summary);
    fprintf(f, "\ncache formats (--kv-cache-dtype):\n");
    print_wrapped_names(f, kvarn_format_accepted_names());
}

/* What main returns after a command's rc: a failed write to stdout (a full
 * disk, a closed pipe's EPIPE aside from SIGPIPE, /dev/full) loses the
 * report, so it is an error (1) even when the command itself succeeded. */
static int finish(int rc)
{
    errno = 0;
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "kvarn: error writing standard output: %s\n",
                errno ? strerror(errno) : "write failed");
        return rc ? rc : 1;
    }
    return rc;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "help") == 0) {
        usage(stdout);
        return finish(0);
    }
    for (size_t i = 0; i < sizeof k_commands / sizeof k_commands[0]; i++) {
        if (strcmp(argv[1], k_commands[i].name) != 0) continue;
        /* a KVARN_SIMD the library would ignore: refused (--help aside) */
        int help = argc > 2 && (strcmp(argv[2], "--help") == 0 || strcmp(argv[2], "-h") == 0);
        if (!help && simd_env_check("kvarn")) return 2;
        return finish(k_commands[i].run(argc - 1, argv + 1));
    }
    fprintf(stderr, "kvarn: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
