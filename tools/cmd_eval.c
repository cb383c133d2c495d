/*
 * cmd_eval.c -- `kvarn eval`: what each KV-cache format costs in quality and
 * buys in memory and speed, on a real model and text (../shared/EVAL.md).
 *
 * One reference session with the unquantized (fp16) cache and one session
 * per format are fed the same windows of the text in the same chunks, in
 * lockstep: after each chunk every format's next-token distributions are
 * compared with the reference's (KL divergence, top-1 agreement) and scored
 * on the text (perplexity). The last --decode-tokens positions of each
 * window are fed one token at a time and timed: decode speed.
 *
 * Three steps, each its own functions: the options (one table,
 * cli_options.h), the run (eval_run: sessions, the lockstep loop, passkey;
 * its numbers gathered in eval_results) and the report of those results as
 * a table or as JSON.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "cli.h"
#include "cli_options.h"
#include "eval_coverage.h"
#include "eval_stats.h"
#include "passkey.h"

/* ---- options ------------------------------------------------------------ */

typedef struct eval_opts {
    const char *model_path, *text_path, *dtypes, *dump_path;
    long ctx, chunk, windows, decode_tokens, threads, passkey_trials;
    long dump_layers; /* 0: all */
    long sink_tokens; /* KVarN sink tokens S (0: no sink); -1: the default */
    long tail_tokens; /* KVarN tokens per tail page; 0: whole tiles */
    const char *staging_name; /* --kvarn-staging; NULL: int8 */
    int staging;              /* kvarn_staging parsed from it */
    int json;
    int rtn_mse;      /* KVarN: error-minimizing RTN ranges (KVARN_RTN_MSE) */
    int rtn_mse_v;    /* the same for V only (KVARN_RTN_MSE_V) */
} eval_opts;

static const eval_opts k_defaults = {
    .dtypes = "all", .ctx = 2048, .chunk = 128, .windows = 1, .decode_tokens = 320, .threads = 1,
    .sink_tokens = -1,
};

#define OPT(f) offsetof(eval_opts, f)
static const cli_option k_options[] = {
    {"model", 'm', CLI_TEXT, OPT(model_path), 0, 0, 0, NULL, NULL},
    {"file", 'f', CLI_TEXT, OPT(text_path), 0, 0, 0, NULL, NULL},
    {"kv-cache-dtype", 0, CLI_TEXT, OPT(dtypes), 0, 0, 0, "--kv-cache-dtype",
     "cache formats, NAME[,NAME...] or all (default all: the\n"
     "ladder of docs/eval.md)"},
    {"ctx", 0, CLI_INT, OPT(ctx), 2, 1 << 20, 0, "--ctx N", "tokens per window (default 2048)"},
    {"chunk", 0, CLI_INT, OPT(chunk), 1, 4096, 0, "--chunk N", "tokens per forward call (default 128)"},
    {"windows", 0, CLI_INT, OPT(windows), 1, 1 << 20, 0, "--windows N", "windows of the text (default 1)"},
    {"decode-tokens", 0, CLI_INT, OPT(decode_tokens), 0, 1 << 20, 0, "--decode-tokens N",
     "last tokens of a window fed one at a time (default 320)"},
    {"threads", 0, CLI_INT, OPT(threads), 1, 256, 0, "--threads T",
     "attention worker threads (default 1)"},
    {"passkey", 0, CLI_INT, OPT(passkey_trials), 0, 1000, 0, "--passkey N",
     "add passkey retrieval, N keys per depth (default 0: none)"},
    {"sink-tokens", 0, CLI_INT, OPT(sink_tokens), 0, 1 << 16, 0, "--sink-tokens S",
     "KVarN: first S tokens staged, not encoded (default one\ntile)"},
    {"tail-page-tokens", 0, CLI_INT, OPT(tail_tokens), 0, 1024, 0, "--tail-page-tokens T",
     "KVarN: tail pages of T tokens (T divides G;\ndefault 0: a whole tile)"},
    {"kvarn-staging", 0, CLI_TEXT, OPT(staging_name), 0, 0, 0, "--kvarn-staging F",
     CLI_STAGING_HELP},
    {"rtn-mse", 0, CLI_FLAG, OPT(rtn_mse), 0, 0, 0, "--rtn-mse",
     "KVarN: error-minimizing RTN ranges at commit (same\nrecords; default the spec's min/max)"},
    {"rtn-mse-values", 0, CLI_FLAG, OPT(rtn_mse_v), 0, 0, 0, "--rtn-mse-values",
     "KVarN: the same for the values only (keys min/max)"},
    {"json", 0, CLI_FLAG, OPT(json), 0, 0, 0, "--json", "the report as JSON on stdout"},
    {"dump-kv", 0, CLI_TEXT, OPT(dump_path), 0, 0, 0, "--dump-kv FILE",
     "write the reference's fp32 K/V of the first window"},
    {"dump-layers", 0, CLI_INT, OPT(dump_layers), 1, 1 << 20, 0, "--dump-layers N",
     "with --dump-kv: the first N layers (default all)"},
    {"help", 'h', CLI_HELP, 0, 0, 0, 0, NULL, NULL},
};
#undef OPT

static const cli_command k_command = {
    "eval", k_options, sizeof k_options / sizeof k_options[0],
    "usage: kvarn eval -m MODEL -f TEXT [--kv-cache-dtype NAME[,NAME...]|all]\n"
    "                  [--ctx 2048] [--chunk 128] [--windows 1] [--decode-tokens 320]\n"
    "                  [--threads 1] [--passkey N] [--json]\n"
    "                  [--sink-tokens S] [--tail-page-tokens T] [--kvarn-staging F]\n"
    "                  [--rtn-mse|--rtn-mse-values]\n"
    "                  [--dump-kv FILE [--dump-layers N]]\n\n",
    "Feeds windows of --ctx tokens of TEXT through the model in chunks of --chunk\n"
    "tokens (every chunk after the first attends to the cached history, as chunked\n"
    "prefill and decode do), once with the unquantized fp16 cache (the reference)\n"
    "and once per format; the last --decode-tokens tokens of each window are fed one\n"
    "at a time (decode, after the chunked prefill). Prints per format: bytes per\n"
    "token (all layers, K+V, metadata counted; 'eff' is what the session's paged\n"
    "cache holds for its --ctx tokens, staged sink and tail pages counted), the\n"
    "capacity multiple against fp16 (from the record bytes: what long contexts\n"
    "reach), KL divergence of the next-token distribution against the reference\n"
    "over the chunk-fed positions (mean, median, p99, max) and top-1 agreement,\n"
    "the same KLD mean and top-1 over the decoded positions ('dec': what a chat\n"
    "user gets, tokens arriving one at a time), perplexity over all positions and\n"
    "its delta, and decode speed as tokens/s and as a ratio to fp16. Warns on stderr\n"
    "when a column's positions never attend to K/V held in the format (staged sink\n"
    "and tail only: such a column reads about 0; docs/eval.md). --json: the same\n"
    "report as JSON, a column with nothing measured as null, the warnings in lists.\n"
    "--passkey N adds passkey retrieval (docs/eval.md) at length --ctx, depths\n"
    "0/50/100%, N keys per depth, as retrieved/tried beside the fp16 cache's own;\n"
    "--ctx must hold its prompt's intro, key and question (64 tokens for SmolLM2).\n"
    "--sink-tokens S keeps the first S tokens of KVarN caches staged (default: one\n"
    "tile); when S is not a multiple of the tile the rest of that tile is quantized\n"
    "(docs/paged-cache.md \"The sink\"); S = 0: no sink.\n"
    "--tail-page-tokens T holds the uncommitted tail of KVarN caches in pages of\n"
    "T tokens taken on demand instead of a whole tile (same numbers: same records,\n"
    "attention bit for bit; docs/paged-cache.md \"Small tail pages\").\n"
    "--dump-kv FILE writes the reference session's fp32 K (post-RoPE) and V of the\n"
    "first window's tokens, as computed before any cache rounding, in the format of\n"
    "docs/kv-dump.md; --dump-layers N keeps the first N layers (default all).\n",
};

/* ---- running ------------------------------------------------------------ */

/* The warnings eval prints before the run: KVarN-only options with no
 * KVarN format (cli_kvarn_only_warnings, up to 3), the options lowered to
 * fit the text (--ctx, --windows, --decode-tokens: eval_fit, up to 3) and
 * the columns that measure no quantized K/V (eval_coverage.h). */
#define EVAL_MAX_WARNINGS (CLI_KVARN_ONLY_MAX + 3 + EVAL_COVERAGE_MAX)

typedef struct fmt_run {
    kvarn_format fmt;
    kvarn_llama_session *sess;
    eval_stats st;      /* positions fed in chunks (prefill) */
    eval_stats dst;     /* positions fed one token at a time (decode) */
    double decode_s;
    long decode_n;
    double nll;         /* -log p(next token) over every scored position, in
                           position order as the reference's ref_st.nll, so
                           that identical logits give the identical PPL */
    double eff_bpt;     /* bytes per token its cache held at a window's end */
} fmt_run;

/* Everything a run holds: the text, the sessions, the per-chunk buffers and
 * what is accumulated. ctx, chunk, windows, decode_tokens and dump_layers
 * are the options fitted to the text and the model (eval_fit). */
typedef struct eval_run {
    cli_model m;
    int32_t *ids;
    size_t n_ids;
    long ctx, chunk, windows, decode_tokens, dump_layers;
    long asked_chunk, asked_decode_tokens; /* --chunk, --decode-tokens as given */
    kvarn_llama_session *ref;   /* the fp16 reference */
    eval_stats ref_st;
    double ref_decode_s, ref_eff_bpt;
    long ref_decode_n;
    fmt_run *runs;              /* [nf] */
    int nf;
    float *ref_logits, *ref_p, *logits; /* [chunk][V] */
    double *ref_lse;                    /* [chunk] */
    int *ref_top;                       /* [chunk] */
    int pk_correct[CLI_MAX_FORMATS + 1], pk_total; /* row 0: the reference */
    eval_warning warnings[EVAL_MAX_WARNINGS];      /* printed on stderr before the
                                                      run; formats: bit f = runs[f] */
    int n_warnings;
} eval_run;

/* Log-sum-exp of a row of logits. */
static double logsumexp(const float *x, int n)
{
    float mx = x[0];
    for (int i = 1; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    double s = 0.0;
    for (int i = 0; i < n; i++) s += exp((double)(x[i] - mx));
    return (double)mx + log(s);
}

static int argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++) if (x[i] > x[b]) b = i;
    return b;
}

/* Write the K/V dump of docs/kv-dump.md: the first n_layers layers of
 * tokens [0, n_tokens) of a session created with keep_kv_f32. 0 on success. */
static int write_kv_dump(const char *path, const kvarn_llama_session *s,
                         const kvarn_llama_hparams *hp, int n_layers, int n_tokens)
{
    size_t row = (size_t)n_tokens * hp->n_kv_heads * hp->head_dim;
    float *k = malloc(sizeof(float) * row), *v = malloc(sizeof(float) * row);
    FILE *f = fopen(path, "wb");
    int bad = !k || !v || !f;
    if (f == NULL) cli_error("eval", "cannot write '%s'", path);
    else if (bad) cli_error("eval", "out of memory");
    uint8_t head[64];
    memset(head, 0, sizeof head);
    memcpy(head, "KVDUMP1", 8);
    const uint32_t fields[7] = {1, (uint32_t)n_layers, (uint32_t)n_tokens, (uint32_t)hp->n_kv_heads,
                                (uint32_t)hp->head_dim, 0, 1}; /* version .. dtype fp32, flags post-RoPE */
    for (int i = 0; i < 7; i++)
        for (int b = 0; b < 4; b++) head[8 + 4 * i + b] = (uint8_t)(fields[i] >> (8 * b));
    if (!bad && fwrite(head, 1, sizeof head, f) != sizeof head) bad = 1;
    /* All layers' K, then all layers' V (little-endian fp32, as this host). */
    for (int part = 0; part < 2 && !bad; part++)
        for (int l = 0; l < n_layers && !bad; l++) {
            kvarn_status st = kvarn_llama_session_read_kv(s, l, 0, n_tokens, k, v);
            if (st != KVARN_OK) {
                cli_error("eval", "reading K/V of layer %d: %s", l, kvarn_strerror(st));
                bad = 2;
            } else if (fwrite(part ? v : k, sizeof(float), row, f) != row) {
                bad = 1;
            }
        }
    if (f && fclose(f) != 0 && !bad) bad = 1;
    if (bad == 1 && f) cli_error("eval", "writing '%s' failed", path);
    free(k);
    free(v);
    return bad;
}

/* Read and tokenize the text (after checking the model file exists, so a
 * missing model is named first), open the model. 0, or the exit code with
 * the message printed. */
static int eval_load(eval_run *r, const eval_opts *o)
{
    if (cli_check_model_path("eval", o->model_path)) return 1;
    char *text = NULL;
    size_t text_len = 0;
    if (cli_read_file("eval", o->text_path, &text, &text_len)) return 1;
    int rc = 1;
    if (text_len == 0) cli_error("eval", "text file '%s' is empty: nothing to evaluate", o->text_path);
    else if (cli_model_open("eval", o->model_path, &r->m) == 0) rc = 0;
    if (rc == 0) {
        unsigned bos = kvarn_tokenizer_add_bos(r->m.tok) ? KVARN_TOKENIZE_ADD_BOS : 0;
        kvarn_status st = kvarn_tokenizer_encode_alloc(r->m.tok, text, text_len, bos, &r->ids, &r->n_ids);
        if (st != KVARN_OK) {
            cli_error("eval", "tokenizing '%s' failed: %s", o->text_path, kvarn_strerror(st));
            rc = 1;
        } else if (r->n_ids < 2) {
            cli_error("eval", "text '%s' has %zu token(s); need at least 2", o->text_path, r->n_ids);
            rc = 1;
        }
    }
    free(text);
    return rc;
}

/* A warning about the run, no format's columns: printed on stderr and
 * kept in r for the JSON report. */
static void eval_warn(eval_run *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void eval_warn(eval_run *r, const char *fmt, ...)
{
    if (r->n_warnings >= EVAL_MAX_WARNINGS) return;
    eval_warning *to = &r->warnings[r->n_warnings++];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(to->text, sizeof to->text, fmt, ap);
    va_end(ap);
    to->formats = 0;
    fprintf(stderr, "kvarn eval: warning: %s\n", to->text);
}

/* The options fitted to the text and the model: windows of at most the
 * text's tokens, decode and chunk within a window. 0, or 2 (--ctx beyond
 * the model's context, --dump-layers beyond its layers; message printed). */
static int eval_fit(eval_run *r, const eval_opts *o)
{
    const kvarn_llama_hparams *hp = r->m.hp;
    if (o->ctx > hp->context_length) {
        cli_error("eval", "--ctx %ld is longer than the model's context (%d tokens)", o->ctx, hp->context_length);
        return 2;
    }
    r->ctx = (size_t)o->ctx > r->n_ids ? (long)r->n_ids : o->ctx;
    if (r->ctx < o->ctx)
        eval_warn(r, "the text holds %zu tokens: --ctx lowered to %ld", r->n_ids, r->ctx);
    long max_windows = (long)(r->n_ids / (size_t)r->ctx);
    r->windows = o->windows;
    if (r->windows > max_windows) {
        eval_warn(r, "the text holds %zu tokens: --windows lowered to %ld (windows of %ld)",
                  r->n_ids, max_windows, r->ctx);
        r->windows = max_windows;
    }
    r->decode_tokens = o->decode_tokens > r->ctx - 1 ? r->ctx - 1 : o->decode_tokens;
    if (r->decode_tokens < o->decode_tokens)
        eval_warn(r, "--decode-tokens %ld lowered to %ld (--ctx - 1): the chunk-fed "
                  "measurement keeps 1 position per window; raise --ctx or lower --decode-tokens",
                  o->decode_tokens, r->decode_tokens);
    r->chunk = o->chunk > r->ctx ? r->ctx : o->chunk;
    if (o->dump_layers > hp->n_layers) {
        cli_error("eval", "--dump-layers %ld is more than the model's %d layers (1 to %d; default all)",
                  o->dump_layers, hp->n_layers, hp->n_layers);
        return 2;
    }
    r->dump_layers = o->dump_layers == 0 ? hp->n_layers : o->dump_layers;
    if (o->passkey_trials > 0) {
        /* the passkey prompt is --ctx tokens long: it needs room for its
         * fixed part, checked before the run rather than after it */
        const long min = passkey_min_length(&r->m);
        if (min < 0) return 1;
        if (r->ctx < min) {
            cli_error("eval", "--passkey needs --ctx %ld or more (the passkey prompt is --ctx tokens; "
                      "its intro, key and question take %ld)%s", min, min,
                      r->ctx < o->ctx ? ": the text is too short" : "");
            return 2;
        }
    }
    return 0;
}

/* The reference session, one session per format, the accumulators and the
 * per-chunk buffers. 0, or -1 with the message printed. */
static int eval_init(eval_run *r, const eval_opts *o, const kvarn_format *fmts, int nf)
{
    const size_t V = (size_t)r->m.hp->vocab, C = (size_t)r->chunk;
    const size_t positions = (size_t)r->windows * (size_t)r->ctx;
    kvarn_llama_session_opts so = KVARN_LLAMA_SESSION_OPTS_DEFAULT;
    so.max_tokens = (int)r->ctx;
    so.max_chunk = (int)r->chunk;
    so.attn_threads = (int)o->threads;
    so.format = NULL; /* fp16, the reference */
    so.keep_kv_f32 = o->dump_path != NULL;
    if (cli_session_create("eval", &r->m, &so, "lower --ctx", &r->ref)) return -1;
    so.keep_kv_f32 = 0;
    cli_session_set_sink(&so, o->sink_tokens); /* the formats' sessions only */
    so.tail_page_tokens = (int)o->tail_tokens;
    so.rtn_range = o->rtn_mse ? KVARN_RTN_MSE : o->rtn_mse_v ? KVARN_RTN_MSE_V : KVARN_RTN_MINMAX;
    so.staging = o->staging;
    r->runs = calloc((size_t)nf, sizeof *r->runs);
    if (r->runs == NULL) { cli_error("eval", "out of memory"); return -1; }
    r->nf = nf;
    for (int f = 0; f < nf; f++) {
        r->runs[f].fmt = fmts[f];
        so.format = &fmts[f];
        if (cli_session_create("eval", &r->m, &so, "lower --ctx", &r->runs[f].sess)) return -1;
        if (eval_stats_init(&r->runs[f].st, positions) ||
            eval_stats_init(&r->runs[f].dst, (size_t)r->windows * (size_t)r->decode_tokens + 1)) {
            cli_error("eval", "out of memory");
            return -1;
        }
    }
    r->ref_logits = malloc(sizeof(float) * C * V);
    r->ref_p = malloc(sizeof(float) * C * V);
    r->logits = malloc(sizeof(float) * C * V);
    r->ref_lse = malloc(sizeof(double) * C);
    r->ref_top = malloc(sizeof(int) * C);
    if (eval_stats_init(&r->ref_st, positions) || !r->ref_logits || !r->ref_p || !r->logits ||
        !r->ref_lse || !r->ref_top) {
        cli_error("eval", "out of memory");
        return -1;
    }
    return 0;
}

static void eval_free(eval_run *r)
{
    for (int f = 0; f < r->nf; f++) {
        kvarn_llama_session_free(r->runs[f].sess);
        eval_stats_free(&r->runs[f].st);
        eval_stats_free(&r->runs[f].dst);
    }
    free(r->runs);
    eval_stats_free(&r->ref_st);
    kvarn_llama_session_free(r->ref);
    free(r->ref_logits);
    free(r->ref_p);
    free(r->logits);
    free(r->ref_lse);
    free(r->ref_top);
    free(r->ids);
    cli_model_close(&r->m);
}

/* The reference's view of a chunk's n positions: probabilities, log-sum-exp
 * and argmax of each row of ref_logits, and its own NLL of the text. */
static void score_reference(eval_run *r, const int32_t *win, long pos, long n)
{
    const int V = r->m.hp->vocab;
    for (long i = 0; i < n; i++) {
        const float *lg = r->ref_logits + (size_t)i * V;
        float *p = r->ref_p + (size_t)i * V;
        double lse = logsumexp(lg, V);
        for (int v = 0; v < V; v++) p[v] = (float)exp((double)lg[v] - lse);
        r->ref_lse[i] = lse;
        r->ref_top[i] = argmax(lg, V);
        if (pos + i + 1 < r->ctx) eval_stats_add(&r->ref_st, 0.0, 1, lse - (double)lg[win[pos + i + 1]]);
    }
}

/* One format's rows of logits against the reference's: KLD, top-1
 * agreement and NLL per position with a next token, into its prefill or
 * decode accumulator. */
static void score_format(eval_run *r, fmt_run *fr, const int32_t *win, long pos, long n, int decoding)
{
    const int V = r->m.hp->vocab;
    for (long i = 0; i < n && pos + i + 1 < r->ctx; i++) {
        const float *lg = r->logits + (size_t)i * V;
        const float *rl = r->ref_logits + (size_t)i * V;
        const float *p = r->ref_p + (size_t)i * V;
        double lse = logsumexp(lg, V), kld = 0.0;
        /* KL(ref || fmt) = sum p (log p - log q), term by term so that
         * identical logits give exactly 0 */
        for (int v = 0; v < V; v++)
            kld += (double)p[v] * (((double)rl[v] - r->ref_lse[i]) - ((double)lg[v] - lse));
        if (kld < 0.0) kld = 0.0;   /* rounding below zero */
        const double nll = lse - (double)lg[win[pos + i + 1]];
        eval_stats_add(decoding ? &fr->dst : &fr->st, kld, argmax(lg, V) == r->ref_top[i], nll);
        fr->nll += nll;
    }
}

/* Feed tokens win[pos, pos + n) to s with all logits into out, adding the
 * call's seconds to *decode_s (and 1 to *decode_n) when decoding. 0, or -1
 * with the message printed. */
static int eval_forward(eval_run *r, kvarn_llama_session *s, const char *name, const int32_t *win,
                        long pos, long n, float *out, int decoding, double *decode_s, long *decode_n)
{
    double t0 = cli_now();
    kvarn_status st = kvarn_llama_forward(s, win + pos, (int)n, KVARN_LLAMA_LOGITS_ALL, out,
                                          (size_t)r->chunk * (size_t)r->m.hp->vocab);
    double t1 = cli_now();
    if (st != KVARN_OK) {
        cli_error("eval", "forward (%s): %s", name, kvarn_strerror(st));
        return -1;
    }
    if (decoding) {
        *decode_s += t1 - t0;
        (*decode_n)++;
    }
    return 0;
}

/* One step of the lockstep loop: the reference, then every format, fed the
 * same n tokens at pos, and scored. 0, or -1 with the message printed. */
static int eval_step(eval_run *r, const int32_t *win, long pos, long n, int decoding)
{
    if (eval_forward(r, r->ref, "fp16", win, pos, n, r->ref_logits, decoding, &r->ref_decode_s,
                     &r->ref_decode_n))
        return -1;
    score_reference(r, win, pos, n);
    for (int f = 0; f < r->nf; f++) {
        fmt_run *fr = &r->runs[f];
        if (eval_forward(r, fr->sess, fr->fmt.name, win, pos, n, r->logits, decoding, &fr->decode_s,
                         &fr->decode_n))
            return -1;
        score_format(r, fr, win, pos, n, decoding);
    }
    return 0;
}

/* Window w: every session reset, then fed the window in chunks up to the
 * decode part, then one token at a time; afterwards the bytes each cache
 * holds for it, and the first window's K/V dump. 0, or -1 (printed). */
static int eval_window(eval_run *r, const eval_opts *o, long w, long *done)
{
    const int32_t *win = r->ids + (size_t)w * (size_t)r->ctx;
    const long decode_from = r->ctx - r->decode_tokens;
    kvarn_llama_session_reset(r->ref);
    for (int f = 0; f < r->nf; f++) kvarn_llama_session_reset(r->runs[f].sess);
    for (long pos = 0, n; pos < r->ctx; pos += n) {
        int decoding = pos >= decode_from;
        n = decoding ? 1 : r->ctx - pos;
        if (!decoding && n > r->chunk) n = r->chunk;
        if (!decoding && pos + n > decode_from) n = decode_from - pos;
        if (eval_step(r, win, pos, n, decoding)) return -1;
        *done += n;
        cli_progress("kvarn eval", *done, r->windows * r->ctx);
    }
    if (w == 0 && o->dump_path &&
        write_kv_dump(o->dump_path, r->ref, r->m.hp, (int)r->dump_layers, (int)r->ctx))
        return -1;
    /* what each cache holds for the window, staged sink and tail counted */
    r->ref_eff_bpt = cli_session_kv_bytes(r->ref) / (double)r->ctx;
    for (int f = 0; f < r->nf; f++)
        r->runs[f].eff_bpt = cli_session_kv_bytes(r->runs[f].sess) / (double)r->ctx;
    return 0;
}

/* --passkey N: retrieval at length ctx, depths 0/50/100%, N keys each, for
 * the reference (pk_correct[0]) and every format. 0, or -1 (printed). */
static int eval_passkey(eval_run *r, const eval_opts *o)
{
    if (o->passkey_trials <= 0) return 0;
    const long len[1] = {r->ctx}, depth[3] = {0, 50, 100};
    kvarn_format fmts[CLI_MAX_FORMATS];
    for (int f = 0; f < r->nf; f++) fmts[f] = r->runs[f].fmt;
    passkey_opts po = {len, 1, depth, 3, (int)o->passkey_trials, r->chunk, 1, (int)o->threads, 0,
                       (int)o->sink_tokens, "kvarn eval passkey", o->staging};
    if (passkey_run(&r->m, fmts, r->nf, &po, r->pk_correct)) return -1;
    r->pk_total = 3 * (int)o->passkey_trials;
    return 0;
}

/* ---- results ------------------------------------------------------------ */

/* One format's numbers as reported. */
typedef struct eval_row {
    const char *name;
    double bpt, eff;          /* record bytes per token; what its cache held per token */
    eval_summary s, ds;       /* chunk-fed and decoded positions */
    double ppl, tps;          /* over every scored position; decode tokens/s */
    long decode_n;            /* forward calls timed for tps (0: none, tps 0) */
    size_t positions;         /* scored positions, chunk-fed and decoded */
    int passkey;              /* keys retrieved (of passkey_trials) */
    int sink_tokens, tail_page_tokens; /* what its cache uses (kvarn_cache_info) */
} eval_row;

typedef struct eval_results {
    const char *model, *text;
    size_t tokens;
    long ctx, chunk, windows, decode_tokens;
    long sink_tokens, tail_page_tokens; /* the options; sink_tokens -1: not given */
    double ref_bpt, ref_eff, ref_ppl, ref_tps; /* the fp16 reference */
    long ref_decode_n;                         /* forward calls timed for ref_tps */
    int ref_passkey, passkey_trials;
    eval_row rows[CLI_MAX_FORMATS];
    int n;
    const eval_warning *warnings;              /* [n_warnings], the run's */
    int n_warnings;
} eval_results;

/* The run's accumulators summarized (sorts their KLDs). */
static void eval_results_get(eval_run *r, const eval_opts *o, eval_results *res)
{
    const kvarn_llama_hparams *hp = r->m.hp;
    const double token_heads = (double)hp->n_layers * hp->n_kv_heads;
    kvarn_format fp16;
    kvarn_format_parse("fp16", &fp16);
    memset(res, 0, sizeof *res);
    res->model = o->model_path;
    res->text = o->text_path;
    res->tokens = r->n_ids;
    res->ctx = r->ctx;
    res->chunk = r->chunk;
    res->windows = r->windows;
    res->decode_tokens = r->decode_tokens;
    res->sink_tokens = o->sink_tokens;
    res->tail_page_tokens = o->tail_tokens;
    res->ref_bpt = kvarn_bytes_per_token_head(&fp16, hp->head_dim) * token_heads;
    res->ref_eff = r->ref_eff_bpt;
    res->ref_ppl = eval_stats_ppl(&r->ref_st);
    res->ref_tps = r->ref_decode_n ? r->ref_decode_n / r->ref_decode_s : 0.0;
    res->ref_decode_n = r->ref_decode_n;
    res->warnings = r->warnings;
    res->n_warnings = r->n_warnings;
    res->ref_passkey = r->pk_correct[0];
    res->passkey_trials = r->pk_total;
    res->n = r->nf;
    for (int f = 0; f < r->nf; f++) {
        fmt_run *fr = &r->runs[f];
        eval_row *w = &res->rows[f];
        w->name = fr->fmt.name;
        eval_stats_summarize(&fr->st, &w->s);
        eval_stats_summarize(&fr->dst, &w->ds);
        w->bpt = kvarn_bytes_per_token_head(&fr->fmt, hp->head_dim) * token_heads;
        w->eff = fr->eff_bpt;
        w->tps = fr->decode_n ? fr->decode_n / fr->decode_s : 0.0;
        w->decode_n = fr->decode_n;
        /* perplexity over every scored position, chunked and decoded, summed
         * in the reference's order (fmt_run.nll) */
        w->positions = fr->st.n + fr->dst.n;
        w->ppl = w->positions ? exp(fr->nll / (double)w->positions) : 0.0;
        w->passkey = r->pk_correct[f + 1];
        kvarn_cache_info ci;
        if (kvarn_cache_get_info(kvarn_llama_session_cache(fr->sess), &ci) == KVARN_OK) {
            w->sink_tokens = ci.sink_tokens;
            w->tail_page_tokens = ci.tail_page_tokens;
        }
    }
}

/* ---- reporting ---------------------------------------------------------- */

/* The line printed before the run (table mode). */
static void print_header(const eval_run *r, const eval_opts *o)
{
    char decoded[96];
    if (r->decode_tokens > 0)
        snprintf(decoded, sizeof decoded, "last %ld tokens decoded one by one", r->decode_tokens);
    else
        snprintf(decoded, sizeof decoded, "decode skipped (--decode-tokens 0: no dec columns)");
    printf("kvarn eval: %s | text %s (%zu tokens) | %ld window(s) x %ld tokens, chunk %ld, "
           "%s | reference: fp16 cache\n",
           o->model_path, o->text_path, r->n_ids, r->windows, r->ctx, r->chunk, decoded);
    fflush(stdout);
}

/* "3/9", or "-" without passkey trials. */
static const char *passkey_text(int correct, int total, char *buf, size_t len)
{
    if (total) snprintf(buf, len, "%d/%d", correct, total);
    else snprintf(buf, len, "-");
    return buf;
}

/* x with 4 decimals and its sign, "+0.0000" for anything that rounds to
 * zero (printf would write a tiny negative value as "-0.0000"). */
static const char *signed4(double x, char *buf, size_t len)
{
    snprintf(buf, len, "%+.4f", x);
    if (buf[0] == '-' && strspn(buf + 1, "0.") == strlen(buf + 1)) buf[0] = '+';
    return buf;
}

/* The decode speed's two columns: tokens/s and the ratio to fp16's, or
 * "skipped" / "-" without decoded tokens. */
static void speed_text(double tps, double ref_tps, long decode_tokens, char *buf, size_t len)
{
    if (decode_tokens == 0) snprintf(buf, len, "%9s %12s", "skipped", "-");
    else if (tps > 0 && ref_tps > 0) snprintf(buf, len, "%9.1f %11.2fx", tps, tps / ref_tps);
    else snprintf(buf, len, "%9s %12s", "-", "-");
}

static void print_table(const eval_results *res)
{
    char pk[24], speed[48], dppl[32];
    /* cap x fp16 (capacity) from the record bytes: what long contexts
     * reach; eff B/tok adds the staged sink and tail at this --ctx. tok/s x
     * fp16: decode speed against the reference's. */
    printf("%-17s %9s %9s %10s %9s %9s %9s %9s %7s %9s %8s %9s %8s %7s %9s %12s\n", "format", "B/token",
           "eff B/tok", "cap x fp16", "KLD mean", "median", "p99", "max", "top-1", "dec KLD",
           "dec top1", "PPL", "dPPL", "passkey", "dec tok/s", "tok/s x fp16");
    speed_text(res->ref_tps, res->ref_tps, res->decode_tokens, speed, sizeof speed);
    printf("%-17s %9.0f %9.0f %9.2fx %9s %9s %9s %9s %7s %9s %8s %9.4f %8s %7s %s\n",
           "fp16 (reference)", res->ref_bpt, res->ref_eff, 1.0, "-", "-", "-", "-", "-", "-", "-",
           res->ref_ppl, "-", passkey_text(res->ref_passkey, res->passkey_trials, pk, sizeof pk),
           speed);
    for (int f = 0; f < res->n; f++) {
        const eval_row *w = &res->rows[f];
        char dk[16] = "-", dt[16] = "-";
        speed_text(w->tps, res->ref_tps, res->decode_tokens, speed, sizeof speed);
        if (w->ds.n) {
            snprintf(dk, sizeof dk, "%.5f", w->ds.kld_mean);
            snprintf(dt, sizeof dt, "%.2f%%", 100.0 * w->ds.top1);
        }
        printf("%-17s %9.0f %9.0f %9.2fx %9.5f %9.5f %9.5f %9.4f %6.2f%% %9s %8s %9.4f %8s %7s %s\n",
               w->name, w->bpt, w->eff, res->ref_bpt / w->bpt, w->s.kld_mean, w->s.kld_median,
               w->s.kld_p99, w->s.kld_max, 100.0 * w->s.top1, dk, dt, w->ppl,
               signed4(w->ppl - res->ref_ppl, dppl, sizeof dppl),
               passkey_text(w->passkey, res->passkey_trials, pk, sizeof pk), speed);
    }
}

/* JSON members of the --json report; each returns 1 when added, 0 when an
 * allocation failed (o may be NULL: then nothing is added). jopt adds null
 * instead of v when nothing was measured (have = 0). */
static int jnum(cJSON *o, const char *key, double v) { return cJSON_AddNumberToObject(o, key, v) != NULL; }
/* A string as valid UTF-8 (cli_utf8_valid: invalid bytes as U+FFFD). */
static cJSON *jstring(const char *v)
{
    char *u = cli_utf8_valid(v);
    cJSON *t = u ? cJSON_CreateString(u) : NULL;
    free(u);
    return t;
}
static int jstr(cJSON *o, const char *key, const char *v)
{
    cJSON *t = jstring(v);
    if (t == NULL || !cJSON_AddItemToObject(o, key, t)) { cJSON_Delete(t); return 0; }
    return 1;
}
static int jopt(cJSON *o, const char *key, double v, int have)
{
    return have ? jnum(o, key, v) : cJSON_AddNullToObject(o, key) != NULL;
}

/* Array key of the texts of the warnings whose formats include bit f, or
 * of every warning for f < 0. 1 when added, 0 out of memory. */
static int jwarnings(cJSON *o, const char *key, const eval_results *res, int f)
{
    cJSON *a = cJSON_AddArrayToObject(o, key);
    if (a == NULL) return 0;
    for (int i = 0; i < res->n_warnings; i++) {
        if (f >= 0 && !(res->warnings[i].formats >> f & 1)) continue;
        cJSON *t = jstring(res->warnings[i].text);
        if (t == NULL || !cJSON_AddItemToArray(a, t)) {
            cJSON_Delete(t);
            return 0;
        }
    }
    return 1;
}

/* Format f's object of the "formats" array; NULL when out of memory. A
 * column with no position (or no decoded token) behind it is null. */
static cJSON *json_row(const eval_results *res, int f)
{
    const eval_row *w = &res->rows[f];
    const int chunked = w->s.n > 0, decoded = w->ds.n > 0, timed = w->decode_n > 0;
    cJSON *o = cJSON_CreateObject();
    int ok = jstr(o, "format", w->name) & jnum(o, "bytes_per_token", w->bpt) &
             jnum(o, "effective_bytes_per_token", w->eff) &
             jnum(o, "capacity_x_fp16", res->ref_bpt / w->bpt) &
             jnum(o, "effective_x_fp16", res->ref_eff / w->eff) &
             jopt(o, "kld_mean", w->s.kld_mean, chunked) &
             jopt(o, "kld_median", w->s.kld_median, chunked) &
             jopt(o, "kld_p99", w->s.kld_p99, chunked) & jopt(o, "kld_max", w->s.kld_max, chunked) &
             jopt(o, "top1", w->s.top1, chunked) & jnum(o, "ppl", w->ppl) &
             jnum(o, "ppl_delta", w->ppl - res->ref_ppl) & jopt(o, "decode_tok_s", w->tps, timed) &
             jopt(o, "decode_x_fp16", res->ref_tps > 0 ? w->tps / res->ref_tps : 0.0,
                  timed && res->ref_tps > 0) &
             jnum(o, "positions", (double)w->positions) & jnum(o, "chunk_positions", (double)w->s.n) &
             jnum(o, "decode_positions", (double)w->ds.n) &
             jopt(o, "decode_kld_mean", w->ds.kld_mean, decoded) &
             jopt(o, "decode_kld_p99", w->ds.kld_p99, decoded) &
             jopt(o, "decode_top1", w->ds.top1, decoded) & jnum(o, "sink_tokens", w->sink_tokens) &
             jnum(o, "tail_page_tokens", w->tail_page_tokens) &
             jopt(o, "passkey", w->passkey, res->passkey_trials > 0) &
             jopt(o, "passkey_trials", res->passkey_trials, res->passkey_trials > 0) &
             jwarnings(o, "warnings", res, f);
    if (!ok) {
        cJSON_Delete(o);
        return NULL;
    }
    return o;
}

/* The report as one JSON object on stdout. cJSON escapes whatever bytes the
 * paths hold (quotes, backslashes, control characters) and writes NaN/Inf
 * as null; bytes that are not UTF-8 are U+FFFD (jstring). 0, or -1 when out of memory (printed). */
static int print_json(const eval_results *res)
{
    cJSON *root = cJSON_CreateObject(), *ref = cJSON_CreateObject();
    int ok = jstr(root, "model", res->model) & jstr(root, "text", res->text) &
             jnum(root, "tokens", (double)res->tokens) & jnum(root, "ctx", (double)res->ctx) &
             jnum(root, "chunk", (double)res->chunk) & jnum(root, "windows", (double)res->windows) &
             jnum(root, "decode_tokens", (double)res->decode_tokens) &
             jnum(root, "sink_tokens", (double)res->sink_tokens) &
             jnum(root, "tail_page_tokens", (double)res->tail_page_tokens) &
             jwarnings(root, "warnings", res, -1) & jstr(ref, "format", "fp16") &
             jnum(ref, "ppl", res->ref_ppl) &
             jopt(ref, "decode_tok_s", res->ref_tps, res->ref_decode_n > 0) &
             jopt(ref, "passkey", res->ref_passkey, res->passkey_trials > 0) &
             jopt(ref, "passkey_trials", res->passkey_trials, res->passkey_trials > 0);
    if (ref && !cJSON_AddItemToObject(root, "reference", ref)) { cJSON_Delete(ref); ok = 0; }
    cJSON *formats = cJSON_AddArrayToObject(root, "formats");
    ok = ok && ref && formats;
    for (int f = 0; f < res->n && ok; f++) {
        cJSON *o = json_row(res, f);
        if (!o || !cJSON_AddItemToArray(formats, o)) { cJSON_Delete(o); ok = 0; }
    }
    char *text = ok ? cJSON_Print(root) : NULL;
    cJSON_Delete(root);
    if (text == NULL) {
        cli_error("eval", "out of memory writing the JSON report");
        return -1;
    }
    printf("%s\n", text);
    cJSON_free(text);
    return 0;
}

/* ---- the command -------------------------------------------------------- */

/* Before the run: warn on stderr about the columns that would measure no
 * quantized K/V with these options (eval_coverage.h), from each format's
 * session cache; the warnings are kept in r for the JSON report. */
static void eval_warn_coverage(eval_run *r)
{
    kvarn_cache_info infos[CLI_MAX_FORMATS];
    int which[CLI_MAX_FORMATS]; /* infos[i] is runs[which[i]]'s */
    int n = 0;
    for (int f = 0; f < r->nf; f++)
        if (kvarn_cache_get_info(kvarn_llama_session_cache(r->runs[f].sess), &infos[n]) == KVARN_OK)
            which[n++] = f;
    const eval_layout l = {r->ctx, r->chunk, r->decode_tokens, r->asked_chunk, r->asked_decode_tokens};
    eval_warning w[EVAL_COVERAGE_MAX];
    const int nw = eval_coverage_check(&l, infos, n, w);
    for (int i = 0; i < nw && r->n_warnings < EVAL_MAX_WARNINGS; i++) {
        eval_warning *to = &r->warnings[r->n_warnings++];
        memcpy(to->text, w[i].text, sizeof to->text);
        to->formats = 0;
        for (int k = 0; k < n; k++)
            if (w[i].formats >> k & 1) to->formats |= 1ull << which[k];
        fprintf(stderr, "kvarn eval: warning: %s\n", to->text);
    }
}

/* --sink-tokens / --tail-page-tokens / --kvarn-staging with no KVarN
 * format: warned on stderr and kept in r for the JSON report (about no
 * format's columns). */
static void eval_warn_options(eval_run *r, const eval_opts *o, const kvarn_format *fmts, int nf)
{
    char w[CLI_KVARN_ONLY_MAX][CLI_WARNING_LEN];
    const int k = cli_kvarn_only_warnings(o->sink_tokens, o->tail_tokens, o->staging_name, fmts,
                                          nf, w);
    for (int i = 0; i < k && r->n_warnings < EVAL_MAX_WARNINGS; i++) {
        eval_warning *to = &r->warnings[r->n_warnings++];
        snprintf(to->text, sizeof to->text, "%s", w[i]);
        to->formats = 0;
        fprintf(stderr, "kvarn eval: warning: %s\n", to->text);
    }
}

/* Set up, run every window and the passkey trials. 0, or the exit code. */
static int eval_execute(eval_run *r, const eval_opts *o, const kvarn_format *fmts, int nf)
{
    eval_warn_options(r, o, fmts, nf);
    int rc = eval_load(r, o);
    if (rc == 0) rc = eval_fit(r, o);
    if (rc != 0) return rc;
    if (eval_init(r, o, fmts, nf)) return 1;
    r->asked_chunk = o->chunk;
    r->asked_decode_tokens = o->decode_tokens;
    eval_warn_coverage(r);
    if (!o->json) print_header(r, o);
    long done = 0;
    for (long w = 0; w < r->windows; w++)
        if (eval_window(r, o, w, &done)) return 1;
    cli_progress_end();
    return eval_passkey(r, o) ? 1 : 0;
}

int cmd_eval(int argc, char **argv)
{
    eval_opts o = k_defaults;
    int rc = cli_parse_options(&k_command, argc, argv, &o);
    if (rc >= 0) return rc;
    if (o.model_path == NULL || o.text_path == NULL) {
        cli_error("eval", "need -m MODEL and -f TEXT (see kvarn eval --help)");
        return 2;
    }
    if (o.dump_layers != 0 && o.dump_path == NULL) {
        cli_error("eval", "--dump-layers %ld needs --dump-kv FILE (it says how many layers to dump)",
                  o.dump_layers);
        return 2;
    }
    kvarn_format fmts[CLI_MAX_FORMATS];
    int nf = cli_parse_formats("eval", o.dtypes, fmts, CLI_MAX_FORMATS);
    if (nf < 0 || cli_check_tail_tokens("eval", o.tail_tokens, fmts, nf)) return 2;
    if (cli_parse_staging("eval", o.staging_name, &o.staging)) return 2;
    eval_run *r = calloc(1, sizeof *r);
    eval_results *res = malloc(sizeof *res);
    rc = 1;
    if (r == NULL || res == NULL) cli_error("eval", "out of memory");
    else if ((rc = eval_execute(r, &o, fmts, nf)) == 0) {
        eval_results_get(r, &o, res);
        if (o.json) rc = print_json(res) ? 1 : 0;
        else print_table(res);
    }
    cli_progress_end();
    if (r) eval_free(r);
    free(r);
    free(res);
    return rc;
}
