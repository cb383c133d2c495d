/*
 * llama_logits.c -- test helper for test_llama_logits.py: run the C llama
 * runner on a list of token ids and write every position's logits.
 *
 *   llama_logits MODEL FORMAT CHUNK IDS.bin OUT.bin [MAX_CHUNK]
 *
 * FORMAT is a cache format name, that name + ":xc" (the exact-chunk path:
 * the chunk over its own fp32 K/V, history decoded from the cache), or
 * "exact" (fp32 K/V store, no cache); CHUNK is the
 * number of tokens per forward call (1 = token-by-token decode; the last
 * chunk may be shorter). IDS.bin holds int32 token ids; OUT.bin receives
 * float32 [n_ids][vocab]. Exit status 0 on success, else a message on
 * stderr.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvarn/model.h"

static int fail(const char *what, kvarn_status st)
{
    fprintf(stderr, "llama_logits: %s: %s\n", what, kvarn_strerror(st));
    return 1;
}

int main(int argc, char **argv)
{
    if (argc < 6) {
        fprintf(stderr, "usage: llama_logits MODEL FORMAT CHUNK IDS.bin OUT.bin\n");
        return 2;
    }
    int chunk = atoi(argv[3]);
    FILE *f = fopen(argv[4], "rb");
    if (!f || chunk < 1) {
        fprintf(stderr, "llama_logits: cannot read %s\n", argv[4]);
        return 2;
    }
    fseek(f, 0, SEEK_END);
    long bytes = ftell(f);
    fseek(f, 0, SEEK_SET);
    int n = (int)(bytes / 4);
    int32_t *ids = malloc(sizeof(int32_t) * (n > 0 ? n : 1));
    if (!ids || fread(ids, 4, (size_t)n, f) != (size_t)n) {
        fprintf(stderr, "llama_logits: short read\n");
        return 2;
    }
    fclose(f);

    kvarn_llama *m = NULL;
    kvarn_status st = kvarn_llama_load(argv[1], &m);
    if (st != KVARN_OK) return fail("load", st);
    const kvarn_llama_hparams *hp = kvarn_llama_get_hparams(m);
    kvarn_llama_session_opts o = KVARN_LLAMA_SESSION_OPTS_DEFAULT;
    char fmt[64];
    snprintf(fmt, sizeof fmt, "%s", argv[2]);
    char *colon = strchr(fmt, ':');
    if (colon && strcmp(colon, ":xc") == 0) {
        *colon = 0;
        o.exact_chunk = 1;
    }
    kvarn_format cache_fmt;
    if (strcmp(fmt, "exact") == 0) {
        o.exact = 1;
    } else {
        st = kvarn_format_parse(fmt, &cache_fmt);
        if (st != KVARN_OK) return fail("format", st);
        o.format = &cache_fmt;
    }
    o.max_tokens = n;
    o.max_chunk = chunk;
    kvarn_llama_session *s = NULL;
    st = kvarn_llama_session_create(m, &o, &s);
    if (st != KVARN_OK) return fail("session", st);
    size_t V = (size_t)hp->vocab;
    float *logits = malloc(sizeof(float) * (size_t)n * V);
    if (!logits) return 2;
    for (int p = 0; p < n; p += chunk) {
        int c = n - p < chunk ? n - p : chunk;
        st = kvarn_llama_forward(s, ids + p, c, KVARN_LLAMA_LOGITS_ALL,
                                 logits + (size_t)p * V, (size_t)c * V);
        if (st != KVARN_OK) return fail("forward", st);
    }
    FILE *o_f = fopen(argv[5], "wb");
    if (!o_f || fwrite(logits, sizeof(float) * V, (size_t)n, o_f) != (size_t)n) {
        fprintf(stderr, "llama_logits: cannot write %s\n", argv[5]);
        return 2;
    }
    fclose(o_f);
    free(logits);
    free(ids);
    kvarn_llama_session_free(s);
    kvarn_llama_free(m);
    return 0;
}
