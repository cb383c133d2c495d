/*
 * cmd_inspect.c -- `kvarn inspect`: what a cache format costs per token and
 * how many tokens fit in a memory budget, for a model's shape.
 */
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static void inspect_usage(FILE *f)
{
    fprintf(f,
            "usage: kvarn inspect --kv-cache-dtype NAME[,NAME...|all]\n"
            "                     (-m MODEL | --layers L --kv-heads H --head-dim D)\n"
            "                     [--budget 16GiB] [--max-seqs 64]\n\n"
            "Prints, for each format: the block size G, the record bytes per token (all\n"
            "layers and KV heads, K and V, metadata and padding counted) and the multiple\n"
            "against fp16 they give long contexts; then what a paged cache in the budget\n"
            "really holds, every byte counted (records, fp16 sink and tail pages, block\n"
            "tables, pools; kvarn_cache_capacity_get): the tokens a cache for --max-seqs\n"
            "sequences holds, and how many requests of 2k / 8k / 32k tokens fit at once.\n"
            "-m reads the shape from a llama GGUF's metadata (the weights are not loaded).\n"
            "Default formats: all; default budget: 16GiB; default --max-seqs: 64.\n");
}

/* The KV shape of a llama GGUF from its metadata alone. */
static int read_shape(const char *path, long *layers, long *kv_heads, long *head_dim)
{
    FILE *probe = fopen(path, "rb");
    if (probe == NULL) {
        cli_missing_model("inspect", path);
        return -1;
    }
    fclose(probe);
    kvarn_gguf *g = NULL;
    char err[256] = "";
    kvarn_status st = kvarn_gguf_open(path, &g, err, sizeof err);
    if (st != KVARN_OK) {
        cli_error("inspect", "cannot read '%s': %s%s%s", path, kvarn_strerror(st), err[0] ? ": " : "", err);
        return -1;
    }
    uint32_t nl = 0, nh = 0, nkv = 0, emb = 0;
    if (kvarn_gguf_get_u32(g, "llama.block_count", &nl) != KVARN_OK ||
        kvarn_gguf_get_u32(g, "llama.attention.head_count", &nh) != KVARN_OK ||
        kvarn_gguf_get_u32(g, "llama.embedding_length", &emb) != KVARN_OK || nh == 0) {
        cli_error("inspect", "'%s' is not a llama GGUF (llama.block_count, .attention.head_count, "
                  ".embedding_length needed)", path);
        kvarn_gguf_close(g);
        return -1;
    }
    if (kvarn_gguf_get_u32(g, "llama.attention.head_count_kv", &nkv) != KVARN_OK) nkv = nh;
    uint32_t kdim = 0;
    if (kvarn_gguf_get_u32(g, "llama.attention.key_length", &kdim) != KVARN_OK) kdim = emb / nh;
    kvarn_gguf_close(g);
    *layers = nl;
    *kv_heads = nkv;
    *head_dim = kdim;
    return 0;
}

int cmd_inspect(int argc, char **argv)
{
    const char *dtypes = NULL, *model_path = NULL;
    long layers = 0, kv_heads = 0, head_dim = 0;
    uint64_t budget = 16ull << 30;
    long max_seqs = 64;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = (i + 1 < argc) ? argv[i + 1] : NULL;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            inspect_usage(stdout);
            return 0;
        }
        if (val == NULL) {
            cli_error("inspect", "option '%s' needs a value (or is unknown)", a);
            return 2;
        }
        if (strcmp(a, "--kv-cache-dtype") == 0) dtypes = val;
        else if (strcmp(a, "-m") == 0 || strcmp(a, "--model") == 0) model_path = val;
        else if (strcmp(a, "--layers") == 0) {
            if (cli_parse_int(val, 1, 100000, &layers)) { cli_error("inspect", "bad --layers '%s'", val); return 2; }
        } else if (strcmp(a, "--kv-heads") == 0) {
            if (cli_parse_int(val, 1, 100000, &kv_heads)) { cli_error("inspect", "bad --kv-heads '%s'", val); return 2; }
        } else if (strcmp(a, "--head-dim") == 0) {
            if (cli_parse_int(val, 1, 100000, &head_dim)) { cli_error("inspect", "bad --head-dim '%s'", val); return 2; }
        } else if (strcmp(a, "--max-seqs") == 0) {
            if (cli_parse_int(val, 1, 1000000, &max_seqs)) { cli_error("inspect", "bad --max-seqs '%s'", val); return 2; }
        } else if (strcmp(a, "--budget") == 0) {
            if (cli_parse_bytes(val, &budget)) { cli_error("inspect", "bad --budget '%s' (e.g. 16GiB, 512MiB, 2GB)", val); return 2; }
        } else {
            cli_error("inspect", "unknown option '%s'", a);
            inspect_usage(stderr);
            return 2;
        }
        i++;
    }
    if (dtypes == NULL) dtypes = "all";
    if (model_path != NULL && read_shape(model_path, &layers, &kv_heads, &head_dim)) return 1;
    if (layers == 0 || kv_heads == 0 || head_dim == 0) {
        cli_error("inspect", "give -m MODEL or the model shape: --layers L --kv-heads H --head-dim D");
        return 2;
    }
    kvarn_format fmts[CLI_MAX_FORMATS];
    int n = cli_parse_formats("inspect", dtypes, fmts, CLI_MAX_FORMATS);
    if (n < 0) return 2;

    const int lens[3] = {2048, 8192, 32768};
    kvarn_format fp16;
    kvarn_format_parse("fp16", &fp16);
    char b1[32], b2[32];
    printf("shape: %ld layers x %ld KV heads x head_dim %ld; budget %s, all memory counted "
           "(records, fp16 sink and tail pages, tables)\n",
           layers, kv_heads, head_dim, cli_fmt_bytes((double)budget, b1, sizeof b1));
    printf("%-18s %4s %12s %9s %12s %8s %8s %8s %8s\n", "format", "G", "bytes/token", "x fp16",
           "tokens fit", "x fp16", "2k seqs", "8k seqs", "32k seqs");
    printf("%-18s %4s %12s %9s %12s %8s %8s %8s %8s\n", "", "", "(records)", "(records)",
           "", "(tokens)", "", "", "");
    double fp16_tok = kvarn_bytes_per_token_head(&fp16, (int)head_dim) * layers * kv_heads;
    cli_capacity base;
    int have_base = cli_capacity_get(&fp16, (int)layers, (int)kv_heads, (int)head_dim, budget,
                                     (int)max_seqs, lens, 3, &base) == KVARN_OK;
    int rc = 0, refused = 0;
    for (int i = 0; i < n; i++) {
        kvarn_status st = kvarn_format_check_head_dim(&fmts[i], (int)head_dim);
        if (st != KVARN_OK) {
            char msg[512];
            cli_error("inspect", "%s", kvarn_format_explain(st, fmts[i].name, (int)head_dim, msg, sizeof msg));
            rc = 1;
            continue;
        }
        double tok = kvarn_bytes_per_token_head(&fmts[i], (int)head_dim) * layers * kv_heads;
        cli_capacity cc;
        st = cli_capacity_get(&fmts[i], (int)layers, (int)kv_heads, (int)head_dim, budget,
                              (int)max_seqs, lens, 3, &cc);
        if (st != KVARN_OK) {
            char msg[512];
            cli_error("inspect", "%s", kvarn_format_explain(st, fmts[i].name, (int)head_dim, msg, sizeof msg));
            rc = 1;
            continue;
        }
        char tokens[32], ratio[32];
        if (cc.fits) snprintf(tokens, sizeof tokens, "%llu", (unsigned long long)cc.tokens);
        else snprintf(tokens, sizeof tokens, "-");
        if (cc.fits && have_base && base.fits && base.tokens > 0)
            snprintf(ratio, sizeof ratio, "%.2fx", (double)cc.tokens / (double)base.tokens);
        else snprintf(ratio, sizeof ratio, "-");
        refused |= !cc.fits;
        printf("%-18s %4d %12s %8.2fx %12s %8s %8d %8d %8d\n", fmts[i].name, cc.block_size,
               cli_fmt_bytes(tok, b2, sizeof b2), fp16_tok / tok, tokens, ratio, cc.seqs[0],
               cc.seqs[1], cc.seqs[2]);
    }
    printf("tokens fit: what a cache for %ld sequences (--max-seqs) holds, filled one after "
           "another; Nk seqs: requests of N*1024 tokens that fit at once in a cache sized for "
           "them\n", max_seqs);
    if (refused)
        printf("-: the budget does not hold the fp16 pages of %ld sequences plus one block "
               "(a cache created so is refused); lower --max-seqs\n", max_seqs);
    return rc;
}
