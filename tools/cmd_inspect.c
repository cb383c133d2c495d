/*
 * cmd_inspect.c -- `kvarn inspect`: what a cache format costs per token and
 * how many tokens fit in a memory budget, for a model's shape.
 *
 * Three steps: the options (one table, cli_options.h), the run (each
 * format's record bytes and what a paged cache in the budget holds, from
 * the cache API: cli_capacity_get), and the table printed from those rows.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "cli_options.h"

/* ---- options ------------------------------------------------------------ */

typedef struct inspect_opts {
    const char *dtypes, *model_path;
    long layers, kv_heads, head_dim; /* 0: not given */
    uint64_t budget;                 /* bytes */
    long max_seqs;
    long sink_tokens;                /* KVarN sink tokens S; -1: the default */
    long tail_tokens;                /* KVarN tokens per tail page; 0: whole tiles */
    const char *staging_name;        /* --kvarn-staging; NULL: int8 */
    int staging;                     /* kvarn_staging parsed from it */
} inspect_opts;

static const inspect_opts k_defaults = {.dtypes = "all", .budget = 16ull << 30, .max_seqs = 64,
                                        .sink_tokens = -1};

#define OPT(f) offsetof(inspect_opts, f)
static const cli_option k_options[] = {
    {"kv-cache-dtype", 0, CLI_TEXT, OPT(dtypes), 0, 0, 0, "--kv-cache-dtype",
     "cache formats, NAME[,NAME...] or all (default all)"},
    {"model", 'm', CLI_TEXT, OPT(model_path), 0, 0, 0, "-m MODEL",
     "read the shape from a llama GGUF's metadata (the weights are\nnot loaded)"},
    {"layers", 0, CLI_INT, OPT(layers), 1, KVARN_CACHE_MAX_LAYERS, 0, "--layers L", "the shape without a model: layers,"},
    {"kv-heads", 0, CLI_INT, OPT(kv_heads), 1, KVARN_CACHE_MAX_KV_HEADS, 0, "--kv-heads H", "KV heads per layer"},
    {"head-dim", 0, CLI_INT, OPT(head_dim), 1, 1024, 0, "--head-dim D", "and channels per head"},
    {"budget", 0, CLI_BYTES, OPT(budget), 0, 0, 0, "--budget B",
     "memory for the cache, all of it counted (default 16GiB)"},
    {"max-seqs", 0, CLI_INT, OPT(max_seqs), 1, 1000000, 0, "--max-seqs N",
     "sequences the cache is made for (default 64)"},
    {"sink-tokens", 0, CLI_INT, OPT(sink_tokens), 0, 1 << 16, 0, "--sink-tokens S",
     "KVarN: first S tokens staged, not encoded (default one\ntile; 0: no sink)"},
    {"tail-page-tokens", 0, CLI_INT, OPT(tail_tokens), 0, 1024, 0, "--tail-page-tokens T",
     "KVarN: tail pages of T tokens taken on demand\n(T divides G; default 0: a whole tile per page)"},
    {"kvarn-staging", 0, CLI_TEXT, OPT(staging_name), 0, 0, 0, "--kvarn-staging F",
     CLI_STAGING_HELP},
    {"help", 'h', CLI_HELP, 0, 0, 0, 0, NULL, NULL},
};
#undef OPT

static const cli_command k_command = {
    "inspect", k_options, sizeof k_options / sizeof k_options[0],
    "usage: kvarn inspect (-m MODEL | --layers L --kv-heads H --head-dim D)\n"
    "                     [--kv-cache-dtype NAME[,NAME...]|all]\n"
    "                     [--budget 16GiB] [--max-seqs 64] [--sink-tokens S]\n"
    "                     [--tail-page-tokens T] [--kvarn-staging F]\n\n",
    "Prints, for each format: the block size G, the record bytes per token (all\n"
    "layers and KV heads, K and V, metadata and padding counted) and the multiple\n"
    "against fp16 they give long contexts; then what a paged cache in the budget\n"
    "really holds, every byte counted (records, staged sink and tail pages, block\n"
    "tables, pools; kvarn_cache_capacity_get): the tokens a cache for --max-seqs\n"
    "sequences holds, and how many requests of 2k / 8k / 32k tokens fit at once.\n",
};

/* The KV shape of a llama GGUF from its metadata (kvarn_llama_read_hparams:
 * a bad key is named with its value). */
static int read_shape(const char *path, long *layers, long *kv_heads, long *head_dim)
{
    if (cli_check_model_path("inspect", path)) return -1;
    kvarn_gguf *g = NULL;
    char err[256] = "";
    kvarn_status st = kvarn_gguf_open(path, &g, err, sizeof err);
    if (st != KVARN_OK) {
        cli_error("inspect", "cannot read '%s': %s%s%s", path, kvarn_strerror(st), err[0] ? ": " : "", err);
        return -1;
    }
    kvarn_llama_hparams hp;
    st = kvarn_llama_read_hparams(g, &hp, err, sizeof err);
    kvarn_gguf_close(g);
    if (st != KVARN_OK) {
        cli_error("inspect", "cannot read '%s' as a llama model: %s", path, err);
        return -1;
    }
    *layers = hp.n_layers;
    *kv_heads = hp.n_kv_heads;
    *head_dim = hp.head_dim;
    return 0;
}

/* The shape from -m or the three numbers. 0, or the exit code with the
 * message printed. */
static int resolve_shape(inspect_opts *o)
{
    if (o->model_path != NULL && read_shape(o->model_path, &o->layers, &o->kv_heads, &o->head_dim))
        return 1;
    if (o->layers == 0 || o->kv_heads == 0 || o->head_dim == 0) {
        cli_error("inspect", "give -m MODEL or the model shape: --layers L --kv-heads H --head-dim D");
        return 2;
    }
    return 0;
}

/* ---- running ------------------------------------------------------------ */

enum { N_LENS = 3 };
static const int k_lens[N_LENS] = {2048, 8192, 32768};

/* One format's numbers (ok = 0: refused for this shape, message printed). */
typedef struct inspect_row {
    kvarn_format fmt;
    int ok;
    double token_bytes;  /* record bytes per token, all layers and KV heads */
    cli_capacity cap;    /* what a cache in the budget holds */
} inspect_row;

typedef struct inspect_report {
    double fp16_token_bytes;
    cli_capacity fp16;   /* the fp16 cache in the same budget */
    int have_fp16;
    inspect_row rows[CLI_MAX_FORMATS];
    int n;
} inspect_report;

/* Fill one row; 0, or -1 with the reason printed (head_dim not served, a
 * geometry the cache refuses). */
static int inspect_format(const inspect_opts *o, const kvarn_format *f, inspect_row *row)
{
    char msg[512];
    memset(row, 0, sizeof *row);
    row->fmt = *f;
    kvarn_status st = kvarn_format_check_head_dim(f, (int)o->head_dim);
    if (st == KVARN_OK)
        st = cli_capacity_get(f, (int)o->layers, (int)o->kv_heads, (int)o->head_dim, o->budget,
                              (int)o->max_seqs, (int)o->sink_tokens, (int)o->tail_tokens,
                              o->staging, k_lens,
                              N_LENS, &row->cap);
    if (st != KVARN_OK) {
        cli_error("inspect", "%s", kvarn_format_explain(st, f->name, (int)o->head_dim, msg, sizeof msg));
        return -1;
    }
    row->token_bytes = kvarn_bytes_per_token_head(f, (int)o->head_dim) * o->layers * o->kv_heads;
    row->ok = 1;
    return 0;
}

/* Every format's row and the fp16 baseline. 0, or 1 when a format was
 * refused (the others are still filled). */
static int inspect_run(const inspect_opts *o, const kvarn_format *fmts, int n, inspect_report *r)
{
    kvarn_format fp16;
    kvarn_format_parse("fp16", &fp16);
    r->fp16_token_bytes = kvarn_bytes_per_token_head(&fp16, (int)o->head_dim) * o->layers * o->kv_heads;
    r->have_fp16 = cli_capacity_get(&fp16, (int)o->layers, (int)o->kv_heads, (int)o->head_dim,
                                    o->budget, (int)o->max_seqs, -1, 0, 0, k_lens, N_LENS,
                                    &r->fp16) == KVARN_OK;
    int rc = 0;
    r->n = n;
    for (int i = 0; i < n; i++)
        if (inspect_format(o, &fmts[i], &r->rows[i])) rc = 1;
    return rc;
}

/* ---- reporting ---------------------------------------------------------- */

static void inspect_print(const inspect_opts *o, const inspect_report *r)
{
    char b1[32], b2[32];
    printf("shape: %ld layers x %ld KV heads x head_dim %ld; budget %s, all memory counted "
           "(records, %s sink and tail pages, tables)\n",
           o->layers, o->kv_heads, o->head_dim, cli_fmt_bytes((double)o->budget, b1, sizeof b1),
           kvarn_cache_staging_name(o->staging));
    int any_kvarn = 0; /* the line is about KVarN rows only */
    for (int i = 0; i < r->n; i++) any_kvarn |= r->rows[i].fmt.kind == KVARN_KIND_KVARN;
    if (any_kvarn && (o->sink_tokens >= 0 || o->tail_tokens > 0)) {
        char sk[48] = "default (one tile)", tl[48] = "a whole tile";
        if (o->sink_tokens >= 0) snprintf(sk, sizeof sk, "%ld", o->sink_tokens);
        if (o->tail_tokens > 0) snprintf(tl, sizeof tl, "%ld tokens", o->tail_tokens);
        printf("KVarN: sink tokens %s, tail pages of %s\n", sk, tl);
    }
    /* cap x fp16: fp16's record bytes per token over the format's (what
     * long contexts reach; eval's column of the same name); fit x fp16: the
     * tokens fit over fp16's in the same budget, every byte counted. */
    printf("%-18s %4s %12s %11s %12s %11s %8s %8s %9s\n", "format", "G", "bytes/token",
           "cap x fp16", "tokens fit", "fit x fp16", "2k seqs", "8k seqs", "32k seqs");
    int refused = 0;
    for (int i = 0; i < r->n; i++) {
        const inspect_row *w = &r->rows[i];
        if (!w->ok) continue;
        const cli_capacity *cc = &w->cap;
        char tokens[32] = "-", ratio[32] = "-";
        if (cc->fits) snprintf(tokens, sizeof tokens, "%llu", (unsigned long long)cc->tokens);
        if (cc->fits && r->have_fp16 && r->fp16.fits && r->fp16.tokens > 0)
            snprintf(ratio, sizeof ratio, "%.2fx", (double)cc->tokens / (double)r->fp16.tokens);
        refused |= !cc->fits;
        printf("%-18s %4d %12s %10.2fx %12s %11s %8d %8d %9d\n", w->fmt.name, cc->block_size,
               cli_fmt_bytes(w->token_bytes, b2, sizeof b2), r->fp16_token_bytes / w->token_bytes,
               tokens, ratio, cc->seqs[0], cc->seqs[1], cc->seqs[2]);
    }
    printf("tokens fit: what a cache for %ld sequences (--max-seqs) holds, filled one after "
           "another; Nk seqs: requests of N*1024 tokens that fit at once in a cache sized for "
           "them\n", o->max_seqs);
    if (refused)
        printf("-: the budget does not hold the smallest such cache (one block plus the "
               "bookkeeping, and for KVarN the staged sink and tail pages of %ld sequences): a "
               "cache created so is refused; raise --budget (or lower --max-seqs for KVarN)\n",
               o->max_seqs);
}

int cmd_inspect(int argc, char **argv)
{
    inspect_opts o = k_defaults;
    int rc = cli_parse_options(&k_command, argc, argv, &o);
    if (rc >= 0) return rc;
    if ((rc = resolve_shape(&o)) != 0) return rc;
    kvarn_format fmts[CLI_MAX_FORMATS];
    int n = cli_parse_formats("inspect", o.dtypes, fmts, CLI_MAX_FORMATS);
    if (n < 0 || cli_check_tail_tokens("inspect", o.tail_tokens, fmts, n)) return 2;
    if (cli_parse_staging("inspect", o.staging_name, &o.staging)) return 2;
    cli_warn_kvarn_only("inspect", o.sink_tokens, o.tail_tokens, o.staging_name, fmts, n);
    inspect_report *r = malloc(sizeof *r);
    if (r == NULL) {
        cli_error("inspect", "out of memory");
        return 1;
    }
    rc = inspect_run(&o, fmts, n, r);
    int any = 0; /* a table only when some format has a row */
    for (int i = 0; i < n; i++) any |= r->rows[i].ok;
    if (any) inspect_print(&o, r);
    free(r);
    return rc;
}
