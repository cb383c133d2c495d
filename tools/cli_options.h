/*
 * cli_options.h -- the one option parser of the kvarn subcommands: each
 * command describes its options in one table (cli_option rows); that table
 * drives getopt_long, the value checks, the error messages and the option
 * lines of --help. The parsed values land in the command's own options
 * struct, at the offsets the rows name.
 */
#ifndef KVARN_TOOLS_CLI_OPTIONS_H
#define KVARN_TOOLS_CLI_OPTIONS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* How an option's value is read and where it is stored (the field at the
 * row's offset in the options struct has the type named here). */
typedef enum cli_arg_kind {
    CLI_HELP,  /* no value: print the usage on stdout and stop (exit 0) */
    CLI_FLAG,  /* no value: int field set to 1 */
    CLI_TEXT,  /* const char * field: the argument as given */
    CLI_INT,   /* long field: a decimal integer in [lo, hi] */
    CLI_REAL,  /* double field: a finite number in [lo, hi] ((lo, hi] when
                  lo_open) */
    CLI_BYTES, /* uint64_t field: a byte size, cli_parse_bytes ("16GiB") */
    CLI_LIST   /* cli_list field: comma-separated integers in [lo, hi], at
                  most CLI_LIST_MAX of them */
} cli_arg_kind;

#define CLI_LIST_MAX 16

/* A CLI_LIST value: v[0..n). */
typedef struct cli_list {
    long v[CLI_LIST_MAX];
    int n;
} cli_list;

/* One row per option name (an alias is a row of its own, without help). */
typedef struct cli_option {
    const char *name;     /* --name; NULL: short only */
    char letter;          /* -letter; 0: long only */
    cli_arg_kind kind;
    size_t field;         /* offsetof(the command's options, the field);
                             unused for CLI_HELP */
    double lo, hi;        /* CLI_INT, CLI_REAL, CLI_LIST: accepted range */
    int lo_open;          /* CLI_REAL: lo itself is refused */
    const char *synopsis; /* --help: first column; NULL: not listed */
    const char *help;     /* --help: text, '\n' between its lines */
} cli_option;

/* A command's options: its name (for "kvarn NAME: ..." messages), its
 * table, and the --help text around the table's lines. */
typedef struct cli_command {
    const char *name;
    const cli_option *options;
    size_t n_options;
    const char *usage;    /* printed first: "usage: kvarn NAME ...\n\n" */
    const char *notes;    /* printed after the option lines; may be NULL */
} cli_command;

/* Print cmd's usage, option lines (synopsis column, then help) and notes to
 * f. */
void cli_print_usage(const cli_command *cmd, FILE *f);

/* Parse argv[1..argc) (argv[0] is the command's name) with getopt_long
 * from cmd's table into opts, which holds the defaults. Options stop at the
 * first non-option, which is refused: commands take no positional
 * arguments. Returns -1 to run, or the exit code with everything printed:
 *   0 after a CLI_HELP option (the usage on stdout);
 *   2 after a usage error, on stderr:
 *     "kvarn NAME: option '-n' needs a value"
 *     "kvarn NAME: unknown option '--bogus'" and the usage
 *     "kvarn NAME: bad value 'x' for --ctx (expected an integer from 2 to
 *      1048576)"
 * A value error leaves the field as it was; earlier options stay set. */
int cli_parse_options(const cli_command *cmd, int argc, char **argv, void *opts);

#endif
