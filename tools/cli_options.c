/* cli_options.c -- table-driven option parsing of the subcommands (see
 * cli_options.h). */
#include "cli_options.h"
#include "cli.h"

#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* getopt_long returns LONG_VAL + i for the long name of row i; the short
 * names return their letter. HELP_COLUMN: width of --help's first column. */
enum { LONG_VAL = 256, HELP_COLUMN = 18, MAX_ROWS = 64 };

void cli_print_usage(const cli_command *cmd, FILE *f)
{
    fputs(cmd->usage, f);
    for (size_t i = 0; i < cmd->n_options; i++) {
        const cli_option *r = &cmd->options[i];
        if (r->synopsis == NULL) continue;
        /* a synopsis as wide as the column gets a line of its own */
        if (strlen(r->synopsis) >= HELP_COLUMN) fprintf(f, "%s\n%*s", r->synopsis, HELP_COLUMN, "");
        else fprintf(f, "%-*s", HELP_COLUMN, r->synopsis);
        for (const char *s = r->help; *s; s++) {
            fputc(*s, f);
            if (*s == '\n') fprintf(f, "%*s", HELP_COLUMN, "");
        }
        fputc('\n', f);
    }
    if (cmd->notes) fputs(cmd->notes, f);
}

/* getopt_long's tables from cmd's rows: longs[n + 1] (NULL-ended),
 * shorts[2 + 2 n + 1]. "+": stop at the first non-option; ":": a missing
 * value is reported as ':' (not as an unknown option). */
static void getopt_tables(const cli_command *cmd, struct option *longs, char *shorts)
{
    size_t nl = 0, ns = 0;
    shorts[ns++] = '+';
    shorts[ns++] = ':';
    for (size_t i = 0; i < cmd->n_options; i++) {
        const cli_option *r = &cmd->options[i];
        int has_arg = r->kind == CLI_FLAG || r->kind == CLI_HELP ? no_argument : required_argument;
        if (r->name) longs[nl++] = (struct option){r->name, has_arg, NULL, LONG_VAL + (int)i};
        if (r->letter) {
            shorts[ns++] = r->letter;
            if (has_arg == required_argument) shorts[ns++] = ':';
        }
    }
    longs[nl] = (struct option){NULL, 0, NULL, 0};
    shorts[ns] = '\0';
}

/* The row getopt_long's answer c names, NULL for none; its spelling
 * ("--ctx", "-n") into name[cap]. */
static const cli_option *option_row(const cli_command *cmd, int c, char *name, size_t cap)
{
    if (c >= LONG_VAL && c < LONG_VAL + (int)cmd->n_options) {
        snprintf(name, cap, "--%s", cmd->options[c - LONG_VAL].name);
        return &cmd->options[c - LONG_VAL];
    }
    for (size_t i = 0; i < cmd->n_options; i++)
        if (cmd->options[i].letter && cmd->options[i].letter == c) {
            snprintf(name, cap, "-%c", c);
            return &cmd->options[i];
        }
    return NULL;
}

/* v as a CLI_REAL of row r into *out; -1 (cli_expected() set) when it is
 * no finite number in r's range. */
static int parse_real(const cli_option *r, const char *v, double *out)
{
    double x;
    if (cli_parse_double(v, &x) == 0 && x >= r->lo && x <= r->hi && !(r->lo_open && x == r->lo)) {
        *out = x;
        return 0;
    }
    char what[96];
    if (r->lo_open) snprintf(what, sizeof what, "a number above %g and at most %g", r->lo, r->hi);
    else if (isinf(r->hi)) snprintf(what, sizeof what, "a finite number from %g up", r->lo);
    else snprintf(what, sizeof what, "a number from %g to %g", r->lo, r->hi);
    cli_expect(what);
    return -1;
}

/* v as a CLI_LIST of row r into *out (untouched on error); -1 with
 * cli_expected() set when an item is no integer in range, an item is empty,
 * or there are more than CLI_LIST_MAX. */
static int parse_list(const cli_option *r, const char *v, cli_list *out)
{
    char what[128];
    snprintf(what, sizeof what, "a comma-separated list of at most %d integers from %ld to %ld",
             CLI_LIST_MAX, (long)r->lo, (long)r->hi);
    cli_expect(what);
    cli_list l = {.n = 0};
    for (const char *p = v;;) {
        char *end;
        errno = 0;
        long x = strtol(p, &end, 10);
        if (end == p || errno || x < (long)r->lo || x > (long)r->hi || l.n == CLI_LIST_MAX) return -1;
        l.v[l.n++] = x;
        if (*end == '\0') break;
        if (*end != ',') return -1;
        p = end + 1;
    }
    *out = l;
    return 0;
}

/* Store v into the field of row r of opts. 0, or -1 when v is refused
 * (cli_expected() then says what was expected). */
static int set_option(const cli_option *r, const char *v, void *opts)
{
    char *field = (char *)opts + r->field;
    switch (r->kind) {
    case CLI_HELP: return 0;
    case CLI_FLAG: *(int *)(void *)field = 1; return 0;
    case CLI_TEXT: *(const char **)(void *)field = v; return 0;
    case CLI_INT: return cli_parse_int(v, (long)r->lo, (long)r->hi, (long *)(void *)field);
    case CLI_REAL: return parse_real(r, v, (double *)(void *)field);
    case CLI_BYTES:
        cli_expect("a byte size such as 16GiB, 512MiB or 2GB");
        return cli_parse_bytes(v, (uint64_t *)(void *)field);
    case CLI_LIST: return parse_list(r, v, (cli_list *)(void *)field);
    }
    return -1;
}

/* The usage error for getopt_long's answer c that names no row. */
static void unknown_option(const cli_command *cmd, char **argv)
{
    if (optopt > 0 && optopt < LONG_VAL) cli_error(cmd->name, "unknown option '-%c'", optopt);
    else cli_error(cmd->name, "unknown option '%s'", argv[optind - 1]);
    cli_print_usage(cmd, stderr);
}

int cli_parse_options(const cli_command *cmd, int argc, char **argv, void *opts)
{
    struct option longs[MAX_ROWS + 1];
    char shorts[2 + 2 * MAX_ROWS + 1], name[64];
    if (cmd->n_options > MAX_ROWS) return 2; /* a table too long: a bug here */
    getopt_tables(cmd, longs, shorts);
    opterr = 0;
    optind = 1;
    for (int c; (c = getopt_long(argc, argv, shorts, longs, NULL)) != -1;) {
        if (c == ':') {
            cli_error(cmd->name, "option '%s' needs a value", argv[optind - 1]);
            return 2;
        }
        const cli_option *r = c == '?' ? NULL : option_row(cmd, c, name, sizeof name);
        if (r == NULL) {
            unknown_option(cmd, argv);
            return 2;
        }
        if (r->kind == CLI_HELP) {
            cli_print_usage(cmd, stdout);
            return 0;
        }
        if (set_option(r, optarg, opts)) {
            cli_error(cmd->name, "bad value '%s' for %s (expected %s)", optarg, name, cli_expected());
            return 2;
        }
    }
    if (optind < argc) {
        cli_error(cmd->name, "unexpected argument '%s' (not an option or an option's value)", argv[optind]);
        cli_print_usage(cmd, stderr);
        return 2;
    }
    return -1;
}
