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
            "                     [--budget 16GiB]\n\n"
            "Prints, for each format: record bytes per (tile, KV head), bytes per token\n"
            "(all layers and KV heads, K and V, metadata and padding counted), the\n"
            "capacity multiple against fp16, and the tokens whose KV cache fits in the\n"
            "budget (whole tiles). -m reads the shape from a llama GGUF's metadata (the weights\n"
            "are not loaded). Default formats: all; default budget: 16GiB.\n");
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

    kvarn_format fp16;
    kvarn_format_parse("fp16", &fp16);
    double fp16_tok = kvarn_bytes_per_token_head(&fp16, (int)head_dim) * layers * kv_heads;
    char b1[32], b2[32];
    printf("shape: %ld layers x %ld KV heads x head_dim %ld; budget %s\n",
           layers, kv_heads, head_dim, cli_fmt_bytes((double)budget, b1, sizeof b1));
    printf("%-18s %4s %12s %14s %9s %14s\n", "format", "G", "record B", "bytes/token", "x fp16", "tokens fit");
    int rc = 0;
    for (int i = 0; i < n; i++) {
        kvarn_status st = kvarn_format_check_head_dim(&fmts[i], (int)head_dim);
        if (st != KVARN_OK) {
            char msg[512];
            cli_error("inspect", "%s", kvarn_format_explain(st, fmts[i].name, (int)head_dim, msg, sizeof msg));
            rc = 1;
            continue;
        }
        double tok = kvarn_bytes_per_token_head(&fmts[i], (int)head_dim) * layers * kv_heads;
        uint64_t fit = kvarn_capacity_tokens(&fmts[i], (int)head_dim, (int)layers, (int)kv_heads, budget);
        printf("%-18s %4d %12zu %14s %8.2fx %14llu\n", fmts[i].name, fmts[i].tile_tokens,
               kvarn_record_bytes(&fmts[i], (int)head_dim), cli_fmt_bytes(tok, b2, sizeof b2),
               fp16_tok / tok, (unsigned long long)fit);
    }
    return rc;
}
