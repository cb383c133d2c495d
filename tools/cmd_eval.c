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
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "cli.h"
#include "eval_stats.h"
#include "passkey.h"

static void eval_usage(FILE *f)
{
    fprintf(f,
            "usage: kvarn eval -m MODEL -f TEXT [--kv-cache-dtype NAME[,NAME...]|all]\n"
            "                  [--ctx 2048] [--chunk 128] [--windows 1] [--decode-tokens 320]\n"
            "                  [--threads 1] [--passkey N] [--sink-tokens S] [--json]\n"
            "                  [--dump-kv FILE [--dump-layers N]]\n\n"
            "Feeds windows of --ctx tokens of TEXT through the model in chunks of --chunk\n"
            "tokens (every chunk after the first attends to the cached history, as chunked\n"
            "prefill and decode do), once with the unquantized fp16 cache (the reference)\n"
            "and once per format; the last --decode-tokens tokens of each window are fed one\n"
            "at a time (decode, after the chunked prefill). Prints per format: bytes per\n"
            "token (all layers, K+V, metadata counted; 'eff' is what the paged cache holds\n"
            "for one sequence of --ctx tokens, fp16 sink and tail pages counted), the\n"
            "capacity multiple against fp16 (from the record bytes: what long contexts\n"
            "reach), KL divergence of the next-token distribution against the reference\n"
            "over the chunk-fed positions (mean, median, p99, max) and top-1 agreement,\n"
            "the same KLD mean and top-1 over the decoded positions ('dec': what a chat\n"
            "user gets, tokens arriving one at a time), perplexity over all positions and\n"
            "its delta, and decode speed as tokens/s and as a ratio to fp16.\n"
            "Default formats: all (the ladder of ../shared/EVAL.md).\n"
            "--passkey N adds passkey retrieval (../shared/EVAL.md) at length --ctx, depths\n"
            "0/50/100%%, N keys per depth, as retrieved/tried beside the fp16 cache's own.\n"
            "--sink-tokens S keeps the first S tokens of KVarN caches in fp16 (default: one\n"
            "tile); when S is not a multiple of the tile the rest of that tile is quantized\n"
            "(docs/paged-cache.md \"The sink\").\n"
            "--dump-kv FILE writes the reference session's fp32 K (post-RoPE) and V of the\n"
            "first window's tokens, as computed before any cache rounding, in the format of\n"
            "docs/kv-dump.md; --dump-layers N keeps the first N layers (default all).\n");
}

typedef struct fmt_run {
    kvarn_format fmt;
    kvarn_llama_session *sess;
    eval_stats st;      /* positions fed in chunks (prefill) */
    eval_stats dst;     /* positions fed one token at a time (decode) */
    double decode_s;
    long decode_n;
} fmt_run;

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

/* JSON members of the --json report; each returns 1 when added, 0 when an
 * allocation failed (o may be NULL: then nothing is added). */
static int jnum(cJSON *o, const char *key, double v) { return cJSON_AddNumberToObject(o, key, v) != NULL; }
static int jstr(cJSON *o, const char *key, const char *v) { return cJSON_AddStringToObject(o, key, v) != NULL; }

static double effective_bytes_per_token(const kvarn_format *f, const kvarn_llama_hparams *hp, int ctx,
                                        int sink_tokens)
{
    return cli_kv_bytes_used(f, hp, ctx, sink_tokens) / ctx;
}

int cmd_eval(int argc, char **argv)
{
    const char *model_path = NULL, *text_path = NULL, *dtypes = "all", *dump_path = NULL;
    long ctx = 2048, chunk = 128, windows = 1, decode_tokens = 320, threads = 1, dump_layers = 0,
         passkey_trials = 0, sink_tokens = -1;
    int json = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) { eval_usage(stdout); return 0; }
        if (strcmp(a, "--json") == 0) { json = 1; continue; }
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (v == NULL) { cli_error("eval", "option '%s' needs a value (or is unknown)", a); return 2; }
        int bad = 0;
        if (strcmp(a, "-m") == 0 || strcmp(a, "--model") == 0) model_path = v;
        else if (strcmp(a, "-f") == 0 || strcmp(a, "--file") == 0) text_path = v;
        else if (strcmp(a, "--kv-cache-dtype") == 0) dtypes = v;
        else if (strcmp(a, "--ctx") == 0) bad = cli_parse_int(v, 2, 1 << 20, &ctx);
        else if (strcmp(a, "--chunk") == 0) bad = cli_parse_int(v, 1, 4096, &chunk);
        else if (strcmp(a, "--windows") == 0) bad = cli_parse_int(v, 1, 1 << 20, &windows);
        else if (strcmp(a, "--decode-tokens") == 0) bad = cli_parse_int(v, 0, 1 << 20, &decode_tokens);
        else if (strcmp(a, "--threads") == 0) bad = cli_parse_int(v, 1, 256, &threads);
        else if (strcmp(a, "--passkey") == 0) bad = cli_parse_int(v, 0, 1000, &passkey_trials);
        else if (strcmp(a, "--sink-tokens") == 0) bad = cli_parse_int(v, 0, 1 << 16, &sink_tokens);
        else if (strcmp(a, "--dump-kv") == 0) dump_path = v;
        else if (strcmp(a, "--dump-layers") == 0) bad = cli_parse_int(v, 1, 1 << 20, &dump_layers);
        else { cli_error("eval", "unknown option '%s'", a); eval_usage(stderr); return 2; }
        if (bad) { cli_error("eval", "bad value '%s' for %s (expected %s)", v, a, cli_expected()); return 2; }
        i++;
    }
    if (model_path == NULL || text_path == NULL) {
        cli_error("eval", "need -m MODEL and -f TEXT (see kvarn eval --help)");
        return 2;
    }
    kvarn_format fmts[CLI_MAX_FORMATS];
    int nf = cli_parse_formats("eval", dtypes, fmts, CLI_MAX_FORMATS);
    if (nf < 0) return 2;

    FILE *probe = fopen(model_path, "rb");
    if (probe == NULL) {
        cli_missing_model("eval", model_path);
        return 1;
    }
    fclose(probe);
    char *text = NULL;
    size_t text_len = 0;
    if (cli_read_file("eval", text_path, &text, &text_len)) return 1;
    if (text_len == 0) {
        cli_error("eval", "text file '%s' is empty: nothing to evaluate", text_path);
        free(text);
        return 1;
    }
    cli_model m;
    if (cli_model_open("eval", model_path, &m)) { free(text); return 1; }
    const kvarn_llama_hparams *hp = m.hp;
    int rc = 1;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    fmt_run *runs = NULL;
    kvarn_llama_session *ref = NULL;
    float *ref_logits = NULL, *logits = NULL;
    double *ref_lse = NULL;
    float *ref_p = NULL;
    int *ref_top = NULL;
    eval_stats ref_st;
    memset(&ref_st, 0, sizeof ref_st);

    kvarn_status st = kvarn_tokenizer_encode_alloc(m.tok, text, text_len,
        kvarn_tokenizer_add_bos(m.tok) ? KVARN_TOKENIZE_ADD_BOS : 0, &ids, &n_ids);
    if (st != KVARN_OK) { cli_error("eval", "tokenizing '%s' failed: %s", text_path, kvarn_strerror(st)); goto out; }
    if (n_ids < 2) { cli_error("eval", "text '%s' has %zu token(s); need at least 2", text_path, n_ids); goto out; }
    if (ctx > hp->context_length) {
        cli_error("eval", "--ctx %ld is longer than the model's context (%d tokens)", ctx, hp->context_length);
        rc = 2;
        goto out;
    }
    if ((size_t)ctx > n_ids) ctx = (long)n_ids;
    long max_windows = (long)(n_ids / (size_t)ctx);
    if (windows > max_windows) {
        fprintf(stderr, "kvarn eval: the text holds %zu tokens: %ld window(s) of %ld\n", n_ids, max_windows, ctx);
        windows = max_windows;
    }
    if (decode_tokens > ctx - 1) decode_tokens = ctx - 1;
    if (chunk > ctx) chunk = ctx;

    const int V = hp->vocab;
    kvarn_llama_session_opts so = KVARN_LLAMA_SESSION_OPTS_DEFAULT;
    so.max_tokens = (int)ctx;
    so.max_chunk = (int)chunk;
    so.attn_threads = (int)threads;
    so.cache_format = "fp16";
    so.keep_kv_f32 = dump_path != NULL;
    if (cli_session_create("eval", &m, &so, "lower --ctx", &ref)) goto out;
    so.keep_kv_f32 = 0;
    if (dump_layers == 0 || dump_layers > hp->n_layers) dump_layers = hp->n_layers;
    runs = calloc((size_t)nf, sizeof *runs);
    if (runs == NULL) goto out;
    for (int f = 0; f < nf; f++) {
        runs[f].fmt = fmts[f];
        so.cache_format = fmts[f].name;
        if (sink_tokens >= 0) {
            /* S = 0: no sink at all (sink_tiles 0); S > 0 replaces the tiles */
            so.sink_tokens = (int)sink_tokens;
            if (sink_tokens == 0) so.sink_tiles = 0;
        }
        if (cli_session_create("eval", &m, &so, "lower --ctx", &runs[f].sess)) goto out;
        if (eval_stats_init(&runs[f].st, (size_t)windows * (size_t)ctx) ||
            eval_stats_init(&runs[f].dst, (size_t)windows * (size_t)decode_tokens + 1)) goto out;
    }
    if (eval_stats_init(&ref_st, (size_t)windows * (size_t)ctx)) goto out;
    ref_logits = malloc(sizeof(float) * (size_t)chunk * V);
    ref_p = malloc(sizeof(float) * (size_t)chunk * V);
    logits = malloc(sizeof(float) * (size_t)chunk * V);
    ref_lse = malloc(sizeof(double) * (size_t)chunk);
    ref_top = malloc(sizeof(int) * (size_t)chunk);
    if (!ref_logits || !ref_p || !logits || !ref_lse || !ref_top) {
        cli_error("eval", "out of memory");
        goto out;
    }
    if (!json)
        printf("kvarn eval: %s | text %s (%zu tokens) | %ld window(s) x %ld tokens, chunk %ld, "
               "last %ld tokens decoded one by one | reference: fp16 cache\n",
               model_path, text_path, n_ids, windows, ctx, chunk, decode_tokens);
    fflush(stdout);

    long total_steps = windows * ctx, done = 0;
    double ref_decode_s = 0.0;
    long ref_decode_n = 0;
    for (long w = 0; w < windows; w++) {
        const int32_t *win = ids + (size_t)w * (size_t)ctx;
        kvarn_llama_session_reset(ref);
        for (int f = 0; f < nf; f++) kvarn_llama_session_reset(runs[f].sess);
        long pos = 0;
        while (pos < ctx) {
            long n = ctx - pos;
            long decode_from = ctx - decode_tokens;
            int decoding = pos >= decode_from;
            if (decoding) n = 1;
            else {
                if (n > chunk) n = chunk;
                if (pos + n > decode_from) n = decode_from - pos;
            }
            double t0 = cli_now();
            st = kvarn_llama_forward(ref, win + pos, (int)n, KVARN_LLAMA_LOGITS_ALL,
                                     ref_logits, (size_t)chunk * V);
            double t1 = cli_now();
            if (st != KVARN_OK) { cli_error("eval", "forward (fp16): %s", kvarn_strerror(st)); goto out; }
            if (decoding) { ref_decode_s += t1 - t0; ref_decode_n++; }
            for (long i = 0; i < n; i++) {
                const float *lg = ref_logits + (size_t)i * V;
                float *p = ref_p + (size_t)i * V;
                double lse = logsumexp(lg, V);
                for (int v = 0; v < V; v++) p[v] = (float)exp((double)lg[v] - lse);
                ref_lse[i] = lse;
                ref_top[i] = argmax(lg, V);
                if (pos + i + 1 < ctx) eval_stats_add(&ref_st, 0.0, 1, lse - (double)lg[win[pos + i + 1]]);
            }
            for (int f = 0; f < nf; f++) {
                t0 = cli_now();
                st = kvarn_llama_forward(runs[f].sess, win + pos, (int)n, KVARN_LLAMA_LOGITS_ALL,
                                         logits, (size_t)chunk * V);
                t1 = cli_now();
                if (st != KVARN_OK) {
                    cli_error("eval", "forward (%s): %s", runs[f].fmt.name, kvarn_strerror(st));
                    goto out;
                }
                if (decoding) { runs[f].decode_s += t1 - t0; runs[f].decode_n++; }
                for (long i = 0; i < n && pos + i + 1 < ctx; i++) {
                    const float *lg = logits + (size_t)i * V;
                    const float *rl = ref_logits + (size_t)i * V;
                    const float *p = ref_p + (size_t)i * V;
                    double lse = logsumexp(lg, V), kld = 0.0;
                    /* KL(ref || fmt) = sum p (log p - log q), term by term so
                     * that identical logits give exactly 0 */
                    for (int v = 0; v < V; v++)
                        kld += (double)p[v] * (((double)rl[v] - ref_lse[i]) - ((double)lg[v] - lse));
                    if (kld < 0.0) kld = 0.0;   /* rounding below zero */
                    eval_stats_add(decoding ? &runs[f].dst : &runs[f].st, kld,
                                   argmax(lg, V) == ref_top[i], lse - (double)lg[win[pos + i + 1]]);
                }
            }
            pos += n;
            done += n;
            cli_progress("kvarn eval", done, total_steps);
        }
        if (w == 0 && dump_path && write_kv_dump(dump_path, ref, hp, (int)dump_layers, (int)ctx)) goto out;
    }
    cli_progress_end();

    /* Passkey retrieval: row 0 the fp16 reference, rows 1..nf the formats. */
    int pk_correct[CLI_MAX_FORMATS + 1] = {0}, pk_total = 0;
    if (passkey_trials > 0) {
        const long pk_len[1] = {ctx}, pk_depth[3] = {0, 50, 100};
        passkey_opts po = {pk_len, 1, pk_depth, 3, (int)passkey_trials, chunk, 1, (int)threads, 0, (int)sink_tokens};
        if (passkey_run(&m, fmts, nf, &po, pk_correct)) goto out;
        pk_total = 3 * (int)passkey_trials;
    }
    char pk_text[CLI_MAX_FORMATS + 1][24];
    for (int f = 0; f <= nf; f++) {
        if (pk_total) snprintf(pk_text[f], sizeof pk_text[f], "%d/%d", pk_correct[f], pk_total);
        else snprintf(pk_text[f], sizeof pk_text[f], "-");
    }

    kvarn_format fp16;
    kvarn_format_parse("fp16", &fp16);
    double fp16_bpt = effective_bytes_per_token(&fp16, hp, (int)ctx, -1);
    double fp16_bpt_rec = kvarn_bytes_per_token_head(&fp16, hp->head_dim) * hp->n_layers * hp->n_kv_heads;
    double ref_ppl = eval_stats_ppl(&ref_st);
    double ref_tps = ref_decode_n ? ref_decode_n / ref_decode_s : 0.0;
    cJSON *jroot = NULL, *jformats = NULL;
    int jok = 1;
    if (json) {
        /* cJSON escapes whatever bytes the paths hold (quotes, backslashes,
         * control characters) and writes NaN/Inf as null. */
        jroot = cJSON_CreateObject();
        cJSON *jref = cJSON_CreateObject();
        jok = jstr(jroot, "model", model_path) & jstr(jroot, "text", text_path) &
              jnum(jroot, "tokens", (double)n_ids) & jnum(jroot, "ctx", (double)ctx) &
              jnum(jroot, "chunk", (double)chunk) & jnum(jroot, "windows", (double)windows) &
              jnum(jroot, "decode_tokens", (double)decode_tokens) &
              jnum(jroot, "sink_tokens", (double)sink_tokens) & jstr(jref, "format", "fp16") &
              jnum(jref, "ppl", ref_ppl) & jnum(jref, "decode_tok_s", ref_tps) &
              jnum(jref, "passkey", pk_correct[0]) & jnum(jref, "passkey_trials", pk_total);
        if (jref && !cJSON_AddItemToObject(jroot, "reference", jref)) { cJSON_Delete(jref); jok = 0; }
        jformats = cJSON_AddArrayToObject(jroot, "formats");
        jok = jok && jref && jformats;
    } else {
        printf("%-17s %9s %9s %7s %9s %9s %9s %9s %7s %9s %7s %9s %8s %7s %9s %7s\n", "format", "B/token",
               "eff B/tok", "x fp16", "KLD mean", "median", "p99", "max", "top-1", "dec KLD", "dec top1",
               "PPL", "dPPL", "passkey", "dec tok/s", "x fp16");
        /* x fp16 (capacity) from the record bytes: what long contexts reach;
         * eff B/tok adds the fp16 sink and tail at this --ctx. */
        printf("%-17s %9.0f %9.0f %6.2fx %9s %9s %9s %9s %7s %9s %7s %9.4f %8s %7s %9.1f %6.2fx\n",
               "fp16 (reference)", fp16_bpt_rec, fp16_bpt, 1.0, "-", "-", "-", "-", "-", "-", "-", ref_ppl,
               "-", pk_text[0], ref_tps, 1.0);
    }
    for (int f = 0; f < nf; f++) {
        eval_summary s, ds;
        eval_stats_summarize(&runs[f].st, &s);
        eval_stats_summarize(&runs[f].dst, &ds);
        double bpt = kvarn_bytes_per_token_head(&runs[f].fmt, hp->head_dim) * hp->n_layers * hp->n_kv_heads;
        double eff = effective_bytes_per_token(&runs[f].fmt, hp, (int)ctx, (int)sink_tokens);
        double tps = runs[f].decode_n ? runs[f].decode_n / runs[f].decode_s : 0.0;
        /* perplexity over every scored position, chunked and decoded */
        size_t n_all = runs[f].st.n + runs[f].dst.n;
        double ppl = n_all ? exp((runs[f].st.nll + runs[f].dst.nll) / (double)n_all) : 0.0;
        if (json) {
            cJSON *o = cJSON_CreateObject();
            int ok = jstr(o, "format", runs[f].fmt.name) & jnum(o, "bytes_per_token", bpt) &
                     jnum(o, "effective_bytes_per_token", eff) &
                     jnum(o, "capacity_x_fp16", fp16_bpt_rec / bpt) &
                     jnum(o, "effective_x_fp16", fp16_bpt / eff) & jnum(o, "kld_mean", s.kld_mean) &
                     jnum(o, "kld_median", s.kld_median) & jnum(o, "kld_p99", s.kld_p99) &
                     jnum(o, "kld_max", s.kld_max) & jnum(o, "top1", s.top1) & jnum(o, "ppl", ppl) &
                     jnum(o, "ppl_delta", ppl - ref_ppl) & jnum(o, "decode_tok_s", tps) &
                     jnum(o, "decode_x_fp16", ref_tps > 0 ? tps / ref_tps : 0.0) &
                     jnum(o, "positions", (double)n_all) & jnum(o, "chunk_positions", (double)s.n) &
                     jnum(o, "decode_positions", (double)ds.n) &
                     jnum(o, "decode_kld_mean", ds.kld_mean) & jnum(o, "decode_kld_p99", ds.kld_p99) &
                     jnum(o, "decode_top1", ds.top1) & jnum(o, "passkey", pk_correct[f + 1]) &
                     jnum(o, "passkey_trials", pk_total);
            if (!ok || !cJSON_AddItemToArray(jformats, o)) { cJSON_Delete(o); jok = 0; }
        } else {
            char speed[48] = "        -       -";
            if (tps > 0 && ref_tps > 0) snprintf(speed, sizeof speed, "%9.1f %6.2fx", tps, tps / ref_tps);
            char dk[16] = "-", dt[16] = "-";
            if (ds.n) {
                snprintf(dk, sizeof dk, "%.5f", ds.kld_mean);
                snprintf(dt, sizeof dt, "%.2f%%", 100.0 * ds.top1);
            }
            printf("%-17s %9.0f %9.0f %6.2fx %9.5f %9.5f %9.5f %9.4f %6.2f%% %9s %7s %9.4f %+8.4f %7s %s\n",
                   runs[f].fmt.name, bpt, eff, fp16_bpt_rec / bpt, s.kld_mean, s.kld_median, s.kld_p99,
                   s.kld_max, 100.0 * s.top1, dk, dt, ppl, ppl - ref_ppl, pk_text[f + 1], speed);
        }
    }
    if (json) {
        char *report = jok ? cJSON_Print(jroot) : NULL;
        cJSON_Delete(jroot);
        if (report == NULL) {
            cli_error("eval", "out of memory writing the JSON report");
            goto out;
        }
        printf("%s\n", report);
        cJSON_free(report);
    }
    rc = 0;
out:
    cli_progress_end();
    if (runs) {
        for (int f = 0; f < nf; f++) {
            kvarn_llama_session_free(runs[f].sess);
            eval_stats_free(&runs[f].st);
            eval_stats_free(&runs[f].dst);
        }
        free(runs);
    }
    eval_stats_free(&ref_st);
    kvarn_llama_session_free(ref);
    free(ref_logits); free(ref_p); free(logits); free(ref_lse); free(ref_top);
    free(ids);
    free(text);
    cli_model_close(&m);
    return rc;
}
