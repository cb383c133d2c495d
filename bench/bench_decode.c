/*
 * bench_decode.c -- decode speed of a real model per KV-cache format, as a
 * ratio to the fp16 cache measured in the same run (issue: the kvarn
 * command, benchmark). Not a test.
 *
 * For each context length C, one session per format is filled with
 * C - decode*repeat tokens of text (chunked prefill, not timed); then in
 * each of --repeat rounds every format in turn runs --decode single-token
 * forward calls (timed), ending at context C. The median round per format
 * is reported, as tokens/s and as a ratio to the fp16 cache.
 *
 *   bench_decode [-m MODEL] [-f TEXT] [--ctx 512,2048,8192]
 *                [--kv-cache-dtype all|NAME,...] [--decode 16] [--repeat 3]
 *                [--threads 1] [--weights fp32|bf16|int8|gguf[,...]]
 *
 * --weights: load the model once per precision listed (default: as
 * KVARN_WEIGHTS / AUTO choose) and interleave them too, every (weights,
 * format) pair taking its turn in each round; a table per precision, then
 * each one's tokens/s as a ratio to the first listed, same format and
 * context, measured in the same rounds. --threads: the session's
 * attn_threads, which also split the gguf GEMV's rows.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvarn/gguf.h"
#include "kvarn/model.h"
#include "kvarn/tokenizer.h"
#include "format_list.h"
#include "simd_env.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int parse_list(const char *s, long *out, int max)
{
    int n = 0;
    while (*s && n < max) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < 1) return -1;
        out[n++] = v;
        s = *end == ',' ? end + 1 : end;
        if (*end != ',' && *end != '\0') return -1;
    }
    return n;
}

int main(int argc, char **argv)
{
    if (simd_env_check("bench_decode")) return 2; /* KVARN_SIMD names no level */
    const char *model_path = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    const char *text_path = "data/austen/all.txt";
    const char *dtypes = "all";
    long ctxs[8] = {512, 2048, 8192};
    int n_ctx = 3;
    long n_decode = 16, repeat = 3, threads = 1;
    const char *weights_list = NULL;
    static const char usage[] =
        "usage: bench_decode [-m MODEL] [-f TEXT] [--ctx 512,2048,8192]\n"
        "                    [--kv-cache-dtype all|NAME,...] [--decode 16] [--repeat 3]\n"
        "                    [--threads 1] [--weights fp32|bf16|int8|gguf[,...]]\n";
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { fputs(usage, stdout); return 0; }
        if (i + 1 >= argc) {
            fprintf(stderr, "bench_decode: %s needs a value\n%s", a, usage);
            return 2;
        }
        const char *v = argv[i + 1];
        if (!strcmp(a, "-m")) model_path = v;
        else if (!strcmp(a, "-f")) text_path = v;
        else if (!strcmp(a, "--kv-cache-dtype")) dtypes = v;
        else if (!strcmp(a, "--ctx")) { if ((n_ctx = parse_list(v, ctxs, 8)) <= 0) return 2; }
        else if (!strcmp(a, "--decode")) n_decode = atol(v);
        else if (!strcmp(a, "--repeat")) repeat = atol(v);
        else if (!strcmp(a, "--threads")) threads = atol(v);
        else if (!strcmp(a, "--weights")) weights_list = v;
        else { fprintf(stderr, "bench_decode: unknown option %s\n%s", a, usage); return 2; }
    }
    if (n_decode < 1 || repeat < 1 || repeat > 64 || threads < 1) return 2;

    /* formats: fp16 first (the baseline), then the list, through the kvarn
     * command's own list parser (an unknown name or an empty item is an
     * error) */
    kvarn_format fmts[65], listed[64];
    char lerr[1024];
    int n_listed = format_list_parse(dtypes, listed, 64, lerr, sizeof lerr);
    if (n_listed < 0) {
        fprintf(stderr, "bench_decode: --kv-cache-dtype: %s\n", lerr);
        return 2;
    }
    int nf = 0;
    kvarn_format_parse("fp16", &fmts[nf++]);
    for (int i = 0; i < n_listed; i++)
        if (strcmp(listed[i].name, "fp16") != 0) fmts[nf++] = listed[i];

    /* precisions: AUTO alone, or the list */
    static const char *WNAME[] = {"auto", "fp32", "bf16", "int8", "gguf"};
    kvarn_llama_weights wts[8];
    int nw = 0;
    if (!weights_list) wts[nw++] = KVARN_LLAMA_WEIGHTS_AUTO;
    else
        for (const char *p = weights_list; *p && nw < 8;) {
            size_t len = strcspn(p, ",");
            int k = 1;
            while (k < 5 && (strlen(WNAME[k]) != len || strncmp(p, WNAME[k], len))) k++;
            if (k == 5) {
                fprintf(stderr, "bench_decode: --weights takes fp32, bf16, int8, gguf\n");
                return 2;
            }
            wts[nw++] = (kvarn_llama_weights)k;
            p += len + (p[len] == ',');
        }

    char err[256] = "";
    kvarn_gguf *g = NULL;
    kvarn_llama *models[8] = {NULL};
    kvarn_tokenizer *tok = NULL;
    kvarn_status lst = kvarn_gguf_open(model_path, &g, err, sizeof err);
    for (int w = 0; w < nw && lst == KVARN_OK; w++) {
        kvarn_llama_load_opts lo = KVARN_LLAMA_LOAD_OPTS_DEFAULT;
        lo.weights = wts[w];
        lst = kvarn_llama_load_gguf_with(g, &lo, &models[w]);
    }
    if (lst != KVARN_OK || kvarn_tokenizer_from_gguf(g, &tok) != KVARN_OK) {
        fprintf(stderr, "bench_decode: cannot load %s %s %s (bash scripts/setup.sh --model fetches it)\n",
                model_path, err, kvarn_strerror(lst));
        return 1;
    }
    const kvarn_llama_hparams *hp = kvarn_llama_get_hparams(models[0]);
    FILE *f = fopen(text_path, "rb");
    if (f == NULL) { fprintf(stderr, "bench_decode: cannot open %s\n", text_path); return 1; }
    size_t cap = 4u << 20;
    char *text = malloc(cap);
    size_t len = fread(text, 1, cap, f);
    fclose(f);
    int32_t *ids = NULL;
    size_t n_ids = 0;
    if (kvarn_tokenizer_encode_alloc(tok, text, len, 0, &ids, &n_ids) != KVARN_OK) return 1;
    free(text);

    float *logits = malloc(sizeof(float) * (size_t)hp->vocab);
    printf("bench_decode: %s, %ld decode steps x %ld repeats (median), %ld attention thread(s)\n",
           model_path, n_decode, repeat, threads);
    for (int w = 0; w < nw; w++)
        printf("weights: %s, %.0f MB (KVARN_WEIGHTS=fp32|bf16|int8|gguf or --weights chooses)\n",
               WNAME[kvarn_llama_get_weights(models[w])],
               (double)kvarn_llama_weight_bytes(models[w]) / 1e6);
    /* configurations: (weights w, format fi) at index w * nf0 + fi */
    const int nf0 = nf;
    nf = nw * nf0;
    /* tps[fi][c]: decode tokens/s of configuration fi at context c */
    double *tps = calloc((size_t)nf * (size_t)n_ctx, sizeof(double));
    const char **why = calloc((size_t)nf * (size_t)n_ctx, sizeof(char *));
    kvarn_llama_session **sess = calloc((size_t)nf, sizeof *sess);
    double *rt = malloc(sizeof(double) * (size_t)nf * (size_t)repeat);
    for (int c = 0; c < n_ctx; c++) {
        /* Every format is prefilled to the same length, then the formats
         * take turns: round r times n_decode steps of each format in a row,
         * so that load from elsewhere falls on all formats alike. */
        long prefill = ctxs[c] - n_decode * repeat;
        if (prefill < 0 || (size_t)ctxs[c] > n_ids || ctxs[c] > hp->context_length) {
            for (int fi = 0; fi < nf; fi++) why[fi * n_ctx + c] = "n/a";
            continue;
        }
        for (int fi = 0; fi < nf; fi++) {
            kvarn_llama_session_opts so = KVARN_LLAMA_SESSION_OPTS_DEFAULT;
            so.format = &fmts[fi % nf0];
            so.max_tokens = (int)ctxs[c];
            so.max_chunk = 512;
            so.attn_threads = (int)threads;
            kvarn_status st = kvarn_llama_session_create(models[fi / nf0], &so, &sess[fi]);
            for (long p = 0; p < prefill && st == KVARN_OK; p += 512) {
                int n = (int)(prefill - p < 512 ? prefill - p : 512);
                st = kvarn_llama_forward(sess[fi], ids + p, n, KVARN_LLAMA_LOGITS_NONE, NULL, 0);
            }
            if (st != KVARN_OK) why[fi * n_ctx + c] = kvarn_strerror(st);
        }
        for (long r = 0; r < repeat; r++) {
            long pos = prefill + r * n_decode;
            for (int fi = 0; fi < nf; fi++) {
                if (why[fi * n_ctx + c]) continue;
                kvarn_status st = KVARN_OK;
                double t0 = now();
                for (long d = 0; d < n_decode && st == KVARN_OK; d++)
                    st = kvarn_llama_forward(sess[fi], ids + pos + d, 1, KVARN_LLAMA_LOGITS_LAST, logits,
                                             (size_t)hp->vocab);
                rt[fi * repeat + r] = now() - t0;
                if (st != KVARN_OK) why[fi * n_ctx + c] = kvarn_strerror(st);
            }
        }
        for (int fi = 0; fi < nf; fi++) {
            kvarn_llama_session_free(sess[fi]);
            sess[fi] = NULL;
            if (why[fi * n_ctx + c]) continue;
            qsort(rt + fi * repeat, (size_t)repeat, sizeof(double), cmp_d);
            tps[fi * n_ctx + c] = (double)n_decode / rt[fi * repeat + repeat / 2];
        }
        fprintf(stderr, "bench_decode: context %ld done\n", ctxs[c]);
    }
    for (int w = 0; w < nw; w++) {
        if (nw > 1) printf("\nweights %s:\n", WNAME[kvarn_llama_get_weights(models[w])]);
        printf("%-18s", "format \\ context");
        for (int c = 0; c < n_ctx; c++) printf(" %10ld tok/s  x fp16", ctxs[c]);
        printf("\n");
        for (int f0 = 0; f0 < nf0; f0++) {
            int fi = w * nf0 + f0, base = w * nf0; /* fp16 of the same weights */
            printf("%-18s", fmts[f0].name);
            for (int c = 0; c < n_ctx; c++) {
                if (why[fi * n_ctx + c]) printf(" %16s %6s", why[fi * n_ctx + c], "");
                else printf(" %16.1f %5.2fx", tps[fi * n_ctx + c],
                            tps[base * n_ctx + c] > 0 ? tps[fi * n_ctx + c] / tps[base * n_ctx + c]
                                                      : 0.0);
            }
            printf("\n");
        }
    }
    for (int w = 1; w < nw; w++) {
        printf("\nweights %s x %s (same format and context, same rounds):\n",
               WNAME[kvarn_llama_get_weights(models[w])], WNAME[kvarn_llama_get_weights(models[0])]);
        for (int f0 = 0; f0 < nf0; f0++) {
            printf("%-18s", fmts[f0].name);
            for (int c = 0; c < n_ctx; c++) {
                double a = tps[(w * nf0 + f0) * n_ctx + c], b = tps[f0 * n_ctx + c];
                if (a > 0 && b > 0) printf(" %10ld: %5.2fx", ctxs[c], a / b);
                else printf(" %10ld: %6s", ctxs[c], "-");
            }
            printf("\n");
        }
    }
    free(tps);
    free(why);
    free(sess);
    free(rt);
    free(logits);
    free(ids);
    kvarn_tokenizer_free(tok);
    for (int w = 0; w < nw; w++) kvarn_llama_free(models[w]);
    kvarn_gguf_close(g);
    return 0;
}
