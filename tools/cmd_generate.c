/*
 * cmd_generate.c -- `kvarn generate`: stream text from a model whose KV
 * cache is in the chosen format; at the end, the cache's bytes against fp16
 * and the speed.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static void generate_usage(FILE *f)
{
    fprintf(f,
            "usage: kvarn generate -m MODEL [--kv-cache-dtype NAME] (-p PROMPT | --chat [-p PROMPT])\n"
            "                      [-n 128] [--temp 0.7] [--top-p 0.9] [--seed 1] [--threads 1]\n"
            "                      [--ctx N]\n\n"
            "-p PROMPT         complete PROMPT as plain text; with --chat, PROMPT is one user\n"
            "                  message in the model's chat template\n"
            "--chat            without -p: a conversation, one user message per line of stdin\n"
            "-n N              tokens to generate per reply (default 128)\n"
            "--temp T          sampling temperature; 0 = greedy (default 0.7)\n"
            "--top-p P         nucleus sampling mass (default 0.9)\n"
            "--seed S          sampling seed (default 1)\n"
            "--kv-cache-dtype  cache format (default kvarn_k4v2_g128)\n"
            "--threads T       attention worker threads (default 1)\n"
            "--ctx N           context capacity in tokens, prompt and replies together\n"
            "                  (alias --max-tokens; default: the model's context length);\n"
            "                  the KV cache is sized for it at start\n"
            "Prints the text as it is generated; then, on stderr, the KV-cache bytes used\n"
            "against an fp16 cache and the prompt and generation speeds.\n");
}

/* xorshift64* sampler state */
static double rng_uniform(uint64_t *s)
{
    *s ^= *s >> 12; *s ^= *s << 25; *s ^= *s >> 27;
    return (double)((*s * 2685821657736338717ull) >> 11) * (1.0 / 9007199254740992.0);
}

typedef struct cand { float p; int id; } cand;

static int cmp_cand(const void *a, const void *b)
{
    float x = ((const cand *)a)->p, y = ((const cand *)b)->p;
    return (x < y) - (x > y);
}

/* Sample from logits[V] with temperature and top-p; greedy for temp <= 0. */
static int sample(const float *logits, int V, double temp, double top_p, uint64_t *rng, cand *scratch)
{
    int best = 0;
    for (int i = 1; i < V; i++) if (logits[i] > logits[best]) best = i;
    if (temp <= 0.0) return best;
    double sum = 0.0;
    for (int i = 0; i < V; i++) {
        scratch[i].p = (float)exp((double)(logits[i] - logits[best]) / temp);
        scratch[i].id = i;
        sum += scratch[i].p;
    }
    qsort(scratch, (size_t)V, sizeof *scratch, cmp_cand);
    double mass = 0.0;
    int keep = 0;
    while (keep < V && (keep == 0 || mass < top_p * sum)) mass += scratch[keep++].p;
    double r = rng_uniform(rng) * mass;
    for (int i = 0; i < keep; i++) {
        r -= scratch[i].p;
        if (r <= 0.0) return scratch[i].id;
    }
    return scratch[keep - 1].id;
}

typedef struct gen_state {
    cli_model *m;
    kvarn_llama_session *sess;
    int max_chunk, max_tokens;
    float *logits;
    cand *scratch;
    uint64_t rng;
    double temp, top_p;
    double prompt_s, gen_s;
    long prompt_n, gen_n;
} gen_state;

/* Feed ids (in chunks); logits of the last one land in g->logits. */
static int feed(gen_state *g, const int32_t *ids, size_t n)
{
    if ((long)kvarn_llama_session_pos(g->sess) + (long)n > g->max_tokens) {
        cli_error("generate", "the prompt (%zu tokens) does not fit in the context left (%d of %d tokens)",
                  n, g->max_tokens - kvarn_llama_session_pos(g->sess), g->max_tokens);
        return -1;
    }
    double t0 = cli_now();
    for (size_t i = 0; i < n; i += (size_t)g->max_chunk) {
        size_t c = n - i < (size_t)g->max_chunk ? n - i : (size_t)g->max_chunk;
        kvarn_status st = kvarn_llama_forward(g->sess, ids + i, (int)c, KVARN_LLAMA_LOGITS_LAST,
                                              g->logits, (size_t)g->m->hp->vocab);
        if (st != KVARN_OK) { cli_error("generate", "forward: %s", kvarn_strerror(st)); return -1; }
    }
    g->prompt_s += cli_now() - t0;
    g->prompt_n += (long)n;
    return 0;
}

/* Sample up to n tokens, streaming their text to stdout. */
static int reply(gen_state *g, long n)
{
    char piece[256];
    for (long i = 0; i < n; i++) {
        int32_t id = sample(g->logits, g->m->hp->vocab, g->temp, g->top_p, &g->rng, g->scratch);
        if (kvarn_tokenizer_is_end_of_generation(g->m->tok, id)) break;
        size_t len = 0;
        if (kvarn_tokenizer_decode(g->m->tok, &id, 1, KVARN_DETOKENIZE_SKIP_SPECIAL, piece,
                                   sizeof piece, &len) == KVARN_OK)
            fwrite(piece, 1, len, stdout);
        fflush(stdout);
        if (kvarn_llama_session_pos(g->sess) >= g->max_tokens) {
            fprintf(stderr, "\n[context full: %d tokens]\n", g->max_tokens);
            break;
        }
        double t0 = cli_now();
        kvarn_status st = kvarn_llama_forward(g->sess, &id, 1, KVARN_LLAMA_LOGITS_LAST, g->logits,
                                              (size_t)g->m->hp->vocab);
        g->gen_s += cli_now() - t0;
        g->gen_n++;
        if (st != KVARN_OK) { cli_error("generate", "forward: %s", kvarn_strerror(st)); return -1; }
    }
    fputc('\n', stdout);
    fflush(stdout);
    return 0;
}

static int encode_text(cli_model *m, const char *text, unsigned flags, int32_t **ids, size_t *n)
{
    kvarn_status st = kvarn_tokenizer_encode_alloc(m->tok, text, strlen(text), flags, ids, n);
    if (st != KVARN_OK) { cli_error("generate", "tokenizing the prompt: %s", kvarn_strerror(st)); return -1; }
    return 0;
}

int cmd_generate(int argc, char **argv)
{
    const char *model_path = NULL, *prompt = NULL, *dtype = "kvarn_k4v2_g128";
    int chat = 0;
    long n_gen = 128, threads = 1, seed = 1, ctx = 0;
    double temp = 0.7, top_p = 0.9;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) { generate_usage(stdout); return 0; }
        if (strcmp(a, "--chat") == 0) { chat = 1; continue; }
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (v == NULL) { cli_error("generate", "option '%s' needs a value (or is unknown)", a); return 2; }
        int bad = 0;
        if (strcmp(a, "-m") == 0 || strcmp(a, "--model") == 0) model_path = v;
        else if (strcmp(a, "-p") == 0 || strcmp(a, "--prompt") == 0) prompt = v;
        else if (strcmp(a, "--kv-cache-dtype") == 0) dtype = v;
        else if (strcmp(a, "-n") == 0) bad = cli_parse_int(v, 1, 1 << 20, &n_gen);
        else if (strcmp(a, "--threads") == 0) bad = cli_parse_int(v, 1, 256, &threads);
        else if (strcmp(a, "--ctx") == 0 || strcmp(a, "--max-tokens") == 0)
            bad = cli_parse_int(v, 1, 0x7fffffffL, &ctx);
        else if (strcmp(a, "--seed") == 0) bad = cli_parse_int(v, 0, 0x7fffffffL, &seed);
        else if (strcmp(a, "--temp") == 0) bad = cli_parse_double(v, &temp) || temp < 0;
        else if (strcmp(a, "--top-p") == 0) bad = cli_parse_double(v, &top_p) || top_p <= 0 || top_p > 1;
        else { cli_error("generate", "unknown option '%s'", a); generate_usage(stderr); return 2; }
        if (bad) { cli_error("generate", "bad value '%s' for %s (expected %s)", v, a, cli_expected()); return 2; }
        i++;
    }
    if (model_path == NULL) { cli_error("generate", "need -m MODEL (see kvarn generate --help)"); return 2; }
    if (prompt == NULL && !chat) { cli_error("generate", "need -p PROMPT or --chat"); return 2; }
    /* The same list parser as every other command, then exactly one format. */
    kvarn_format fmts[CLI_MAX_FORMATS];
    int nf = cli_parse_formats("generate", dtype, fmts, CLI_MAX_FORMATS);
    if (nf < 0) return 2;
    if (nf != 1) {
        cli_error("generate", "--kv-cache-dtype '%s' names %d cache formats; generate takes one "
                  "(eval and passkey compare several)", dtype, nf);
        return 2;
    }
    const kvarn_format fmt = fmts[0];
    kvarn_status st;
    cli_model m;
    if (cli_model_open("generate", model_path, &m)) return 1;
    int rc = 1;
    gen_state g;
    memset(&g, 0, sizeof g);
    g.m = &m;
    g.temp = temp;
    g.top_p = top_p;
    g.rng = 0x9e3779b97f4a7c15ull ^ (uint64_t)seed;
    g.max_chunk = 512;
    g.max_tokens = ctx > 0 ? (int)ctx : m.hp->context_length;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    kvarn_llama_session_opts so = KVARN_LLAMA_SESSION_OPTS_DEFAULT;
    so.cache_format = fmt.name;
    so.max_tokens = g.max_tokens;
    so.max_chunk = g.max_chunk;
    so.attn_threads = (int)threads;
    if (cli_session_create("generate", &m, &so, "lower --ctx", &g.sess)) goto out;
    if (g.max_tokens > m.hp->context_length)
        fprintf(stderr, "[note: --ctx %d is beyond the model's trained context of %d tokens]\n",
                g.max_tokens, m.hp->context_length);
    g.logits = malloc(sizeof(float) * (size_t)m.hp->vocab);
    g.scratch = malloc(sizeof(cand) * (size_t)m.hp->vocab);
    if (!g.logits || !g.scratch) { cli_error("generate", "out of memory"); goto out; }
    unsigned bos = kvarn_tokenizer_add_bos(m.tok) ? KVARN_TOKENIZE_ADD_BOS : 0;

    if (prompt != NULL) {
        if (chat) {
            kvarn_chat_message msg = {"user", prompt};
            st = kvarn_tokenizer_encode_chat(m.tok, &msg, 1, KVARN_CHAT_SMOLLM2_SYSTEM, 1, &ids, &n_ids);
            if (st != KVARN_OK) { cli_error("generate", "chat template: %s", kvarn_strerror(st)); goto out; }
        } else if (encode_text(&m, prompt, bos, &ids, &n_ids)) {
            goto out;
        }
        if (n_ids == 0) { cli_error("generate", "the prompt is empty"); goto out; }
        if (feed(&g, ids, n_ids) || reply(&g, n_gen)) goto out;
    } else {
        /* A conversation: one user message per line of stdin. */
        char line[8192];
        int turn = 0;
        fprintf(stderr, "[chat: one message per line; end with Ctrl-D]\n");
        while (fgets(line, sizeof line, stdin)) {
            line[strcspn(line, "\n")] = '\0';
            if (line[0] == '\0') continue;
            free(ids);
            ids = NULL;
            kvarn_chat_message msg = {"user", line};
            int32_t *turn_ids = NULL;
            size_t turn_n = 0;
            st = kvarn_tokenizer_encode_chat(m.tok, &msg, 1, turn ? NULL : KVARN_CHAT_SMOLLM2_SYSTEM, 1,
                                             &turn_ids, &turn_n);
            if (st != KVARN_OK) { cli_error("generate", "chat template: %s", kvarn_strerror(st)); goto out; }
            if (turn) {
                /* close the previous assistant message first */
                int32_t *close_ids = NULL;
                size_t close_n = 0;
                if (encode_text(&m, "<|im_end|>\n", KVARN_TOKENIZE_SPECIAL, &close_ids, &close_n)) {
                    free(turn_ids);
                    goto out;
                }
                int r = feed(&g, close_ids, close_n);
                free(close_ids);
                if (r) { free(turn_ids); goto out; }
            }
            int r = feed(&g, turn_ids, turn_n);
            free(turn_ids);
            if (r || reply(&g, n_gen)) goto out;
            turn++;
        }
    }
    {
        long n_tok = kvarn_llama_session_pos(g.sess);
        kvarn_format fp16;
        kvarn_format_parse("fp16", &fp16);
        double used = cli_kv_bytes_used(&fmt, m.hp, n_tok), base = cli_kv_bytes_used(&fp16, m.hp, n_tok);
        char b1[32], b2[32];
        fprintf(stderr, "[%s] KV cache for %ld tokens: %s; an fp16 cache: %s (%.0f%% of it)", fmt.name,
                n_tok, cli_fmt_bytes(used, b1, sizeof b1), cli_fmt_bytes(base, b2, sizeof b2),
                base > 0 ? 100.0 * used / base : 0.0);
        if (fmt.per_tile)
            fprintf(stderr, "; the first %d-token tile (sink) and the last partial tile stay fp16, so "
                    "short texts gain little; %s reaches %.2fx the fp16 capacity on long contexts",
                    fmt.tile_tokens, fmt.name, 4.0 * m.hp->head_dim / kvarn_bytes_per_token_head(&fmt, m.hp->head_dim));
        fprintf(stderr, "\n[%s] prompt %.1f tok/s, generation %.1f tok/s\n", fmt.name,
                g.prompt_s > 0 ? g.prompt_n / g.prompt_s : 0.0, g.gen_s > 0 ? g.gen_n / g.gen_s : 0.0);
    }
    rc = 0;
out:
    free(ids);
    free(g.logits);
    free(g.scratch);
    kvarn_llama_session_free(g.sess);
    cli_model_close(&m);
    return rc;
}
