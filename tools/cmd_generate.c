/*
 * cmd_generate.c -- `kvarn generate`: stream text from a model whose KV
 * cache is in the chosen format; at the end, the cache's bytes against fp16
 * and the speed.
 *
 * Three steps, each its own functions: the options (one table drives
 * getopt_long, the value checks and --help: cli_options.h), the run
 * (prompt or chat turns, the text streamed to stdout, counts and times
 * gathered in gen_stats), and the report of those counts on stderr.
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "cli_options.h"
#include "gen_state.h"

/* ---- options ------------------------------------------------------------ */

typedef struct gen_opts {
    const char *model_path, *prompt, *dtype;
    int chat;
    long n_gen, threads, seed, ctx; /* ctx 0: the model's context length */
    double temp, top_p;
    const char *staging_name; /* --kvarn-staging; NULL: int8 */
    int staging;              /* kvarn_staging parsed from it */
    const char *save_state, *load_state; /* --save-state F, --load-state F */
} gen_opts;

static const gen_opts k_defaults = {
    .dtype = "kvarn_k4v2_g128", .n_gen = 128, .threads = 1, .seed = 1, .temp = 0.7, .top_p = 0.9,
};

#define OPT(f) offsetof(gen_opts, f)
static const cli_option k_options[] = {
    {"model", 'm', CLI_TEXT, OPT(model_path), 0, 0, 0, NULL, NULL},
    {"prompt", 'p', CLI_TEXT, OPT(prompt), 0, 0, 0, "-p PROMPT",
     "complete PROMPT as plain text; with --chat, PROMPT is one user\n"
     "message in the model's chat template"},
    {"chat", 0, CLI_FLAG, OPT(chat), 0, 0, 0, "--chat",
     "without -p: a conversation, one user message per line of stdin"},
    {NULL, 'n', CLI_INT, OPT(n_gen), 1, 1 << 20, 0, "-n N", "tokens to generate per reply (default 128)"},
    {"temp", 0, CLI_REAL, OPT(temp), 0, HUGE_VAL, 0, "--temp T",
     "sampling temperature; 0 = greedy (default 0.7)"},
    {"top-p", 0, CLI_REAL, OPT(top_p), 0, 1, 1, "--top-p P", "nucleus sampling mass (default 0.9)"},
    {"seed", 0, CLI_INT, OPT(seed), 0, 0x7fffffffL, 0, "--seed S", "sampling seed (default 1)"},
    {"kv-cache-dtype", 0, CLI_TEXT, OPT(dtype), 0, 0, 0, "--kv-cache-dtype",
     "cache format (default kvarn_k4v2_g128)"},
    {"threads", 0, CLI_INT, OPT(threads), 1, 256, 0, "--threads T",
     "attention worker threads (default 1)"},
    {"ctx", 0, CLI_INT, OPT(ctx), 1, 0x7fffffffL, 0, "--ctx N",
     "context capacity in tokens, prompt and replies together\n"
     "(alias --max-tokens; default: the model's context length);\n"
     "the KV cache is sized for it at start"},
    {"max-tokens", 0, CLI_INT, OPT(ctx), 1, 0x7fffffffL, 0, NULL, NULL},
    {"kvarn-staging", 0, CLI_TEXT, OPT(staging_name), 0, 0, 0, "--kvarn-staging F",
     CLI_STAGING_HELP},
    {"save-state", 0, CLI_TEXT, OPT(save_state), 0, 0, 0, "--save-state F",
     "at the end, write the sequence to F: its KV cache as held,\n"
     "the token ids, the last logits, the sampler (docs/state.md)"},
    {"load-state", 0, CLI_TEXT, OPT(load_state), 0, 0, 0, "--load-state F",
     "start from the sequence saved in F (same model, format and\n"
     "staging), then feed -p PROMPT if given and generate: the\n"
     "tokens a run that never stopped would have given"},
    {"help", 'h', CLI_HELP, 0, 0, 0, 0, NULL, NULL},
};
#undef OPT

static const cli_command k_command = {
    "generate", k_options, sizeof k_options / sizeof k_options[0],
    "usage: kvarn generate -m MODEL [--kv-cache-dtype NAME]\n"
    "                      (-p PROMPT | --chat [-p PROMPT])\n"
    "                      [-n 128] [--temp 0.7] [--top-p 0.9] [--seed 1]\n"
    "                      [--threads 1] [--ctx N] [--kvarn-staging F]\n"
    "                      [--save-state F] [--load-state F]\n\n",
    "Prints the text as it is generated; then, on stderr, the KV-cache bytes used\n"
    "against an fp16 cache and the prompt and generation speeds.\n",
};

/* What parse_options cannot check alone: the required options and exactly
 * one cache format. 0, or 2 with the message printed. */
static int check_options(gen_opts *o, kvarn_format *fmt)
{
    if (cli_parse_staging("generate", o->staging_name, &o->staging)) return 2;
    if (o->model_path == NULL) { cli_error("generate", "need -m MODEL (see kvarn generate --help)"); return 2; }
    if (o->load_state && o->chat) {
        cli_error("generate", "--load-state continues a plain text: it takes -p PROMPT or no prompt, not --chat");
        return 2;
    }
    if (o->prompt == NULL && !o->chat && !o->load_state) {
        cli_error("generate", "need -p PROMPT or --chat (or --load-state F)");
        return 2;
    }
    /* The same list parser as every other command, then exactly one format. */
    kvarn_format fmts[CLI_MAX_FORMATS];
    int nf = cli_parse_formats("generate", o->dtype, fmts, CLI_MAX_FORMATS);
    if (nf < 0) return 2;
    if (nf != 1) {
        cli_error("generate", "--kv-cache-dtype '%s' names %d cache formats; generate takes one "
                  "(eval and passkey compare several)", o->dtype, nf);
        return 2;
    }
    *fmt = fmts[0];
    cli_warn_kvarn_only("generate", -1, 0, o->staging_name, fmts, 1);
    return 0;
}

/* ---- running ------------------------------------------------------------ */

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

/* What a run measured, for the report. */
typedef struct gen_stats {
    long n_tokens;          /* tokens in the cache at the end */
    double kv_bytes;        /* bytes its cache holds for them */
    long prompt_n, gen_n;   /* tokens fed as prompt / generated one by one */
    double prompt_s, gen_s; /* seconds in the forward calls of each */
} gen_stats;

typedef struct gen_state {
    cli_model *m;
    kvarn_llama_session *sess;
    int max_chunk, max_tokens;
    float *logits;
    cand *scratch;
    uint64_t rng;
    double temp, top_p;
    gen_stats stats;
    int32_t *ids;   /* [max_tokens] every token in the session, for --save-state */
    int n_ids;
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
        memcpy(g->ids + g->n_ids, ids + i, c * sizeof *ids);
        g->n_ids += (int)c;
    }
    g->stats.prompt_s += cli_now() - t0;
    g->stats.prompt_n += (long)n;
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
        g->stats.gen_s += cli_now() - t0;
        g->stats.gen_n++;
        if (st != KVARN_OK) { cli_error("generate", "forward: %s", kvarn_strerror(st)); return -1; }
        g->ids[g->n_ids++] = id;
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

/* One user message in the chat template (with the default system prompt
 * when system is set), fed. */
static int feed_chat_message(gen_state *g, const char *text, const char *system)
{
    kvarn_chat_message msg = {"user", text};
    int32_t *ids = NULL;
    size_t n = 0;
    kvarn_status st = kvarn_tokenizer_encode_chat(g->m->tok, &msg, 1, system, 1, &ids, &n);
    if (st != KVARN_OK) { cli_error("generate", "chat template: %s", kvarn_strerror(st)); return -1; }
    int r = feed(g, ids, n);
    free(ids);
    return r;
}

/* -p PROMPT: one prompt (plain text, or one chat message with --chat), one
 * reply. */
static int run_prompt(gen_state *g, const gen_opts *o)
{
    if (o->chat) return feed_chat_message(g, o->prompt, KVARN_CHAT_SMOLLM2_SYSTEM) || reply(g, o->n_gen);
    int32_t *ids = NULL;
    size_t n = 0;
    /* a prompt after a loaded state continues the text: no BOS */
    unsigned bos = kvarn_tokenizer_add_bos(g->m->tok) && kvarn_llama_session_pos(g->sess) == 0
                       ? KVARN_TOKENIZE_ADD_BOS : 0;
    if (encode_text(g->m, o->prompt, bos, &ids, &n)) return -1;
    int r = -1;
    if (n == 0) cli_error("generate", "the prompt is empty");
    else r = feed(g, ids, n) || reply(g, o->n_gen);
    free(ids);
    return r ? -1 : 0;
}

/* --chat without -p: a conversation, one user message per line of stdin;
 * the template's system prompt comes with the first. */
static int run_chat(gen_state *g, const gen_opts *o)
{
    char line[8192];
    int turn = 0;
    fprintf(stderr, "[chat: one message per line; end with Ctrl-D]\n");
    while (fgets(line, sizeof line, stdin)) {
        line[strcspn(line, "\n")] = '\0';
        if (line[0] == '\0') continue;
        if (turn) {
            /* close the previous assistant message first */
            int32_t *close_ids = NULL;
            size_t close_n = 0;
            if (encode_text(g->m, "<|im_end|>\n", KVARN_TOKENIZE_SPECIAL, &close_ids, &close_n)) return -1;
            int r = feed(g, close_ids, close_n);
            free(close_ids);
            if (r) return -1;
        }
        if (feed_chat_message(g, line, turn ? NULL : KVARN_CHAT_SMOLLM2_SYSTEM) || reply(g, o->n_gen))
            return -1;
        turn++;
    }
    return 0;
}

/* The session (cache in fmt, sized for --ctx) and the sampler's buffers.
 * 0, or -1 with the message printed; gen_free cleans up either way. */
static int gen_init(gen_state *g, cli_model *m, const gen_opts *o, const kvarn_format *fmt)
{
    memset(g, 0, sizeof *g);
    g->m = m;
    g->temp = o->temp;
    g->top_p = o->top_p;
    g->rng = 0x9e3779b97f4a7c15ull ^ (uint64_t)o->seed;
    g->max_chunk = 512;
    g->max_tokens = o->ctx > 0 ? (int)o->ctx : m->hp->context_length;
    kvarn_llama_session_opts so = KVARN_LLAMA_SESSION_OPTS_DEFAULT;
    so.format = fmt;
    so.max_tokens = g->max_tokens;
    so.max_chunk = g->max_chunk;
    so.attn_threads = (int)o->threads;
    so.staging = o->staging;
    if (cli_session_create("generate", m, &so, "lower --ctx", &g->sess)) return -1;
    if (g->max_tokens > m->hp->context_length)
        fprintf(stderr, "[note: --ctx %d is beyond the model's trained context of %d tokens]\n",
                g->max_tokens, m->hp->context_length);
    g->logits = malloc(sizeof(float) * (size_t)m->hp->vocab);
    g->scratch = malloc(sizeof(cand) * (size_t)m->hp->vocab);
    g->ids = malloc(sizeof *g->ids * (size_t)g->max_tokens);
    if (!g->logits || !g->scratch || !g->ids) { cli_error("generate", "out of memory"); return -1; }
    return 0;
}

static void gen_free(gen_state *g)
{
    free(g->logits);
    free(g->scratch);
    free(g->ids);
    kvarn_llama_session_free(g->sess);
}

/* --load-state: the session continues from the saved sequence, with its
 * token ids, last logits and sampler. 0, or -1 with the line printed. */
static int load_state(gen_state *g, const gen_opts *o)
{
    gen_saved sv;
    if (gen_state_load(o->load_state, g->m, g->sess, &sv)) {
        gen_state_free(&sv);
        return -1;
    }
    /* the session took the sequence, so it fits max_tokens */
    memcpy(g->ids, sv.tokens, (size_t)sv.n_tokens * sizeof *g->ids);
    g->n_ids = sv.n_tokens;
    memcpy(g->logits, sv.logits, (size_t)g->m->hp->vocab * sizeof *g->logits);
    g->rng = sv.rng;
    gen_state_free(&sv);
    return 0;
}

static int save_state(gen_state *g, const gen_opts *o)
{
    gen_saved sv;
    memset(&sv, 0, sizeof sv);
    sv.tokens = g->ids;
    sv.n_tokens = g->n_ids;
    sv.logits = g->logits;
    sv.rng = g->rng;
    return gen_state_save(o->save_state, g->m, g->sess, &sv);
}

/* ---- reporting ---------------------------------------------------------- */

/* The token count from which on a cache of fmt (default sink and tail, as
 * generate's session, staged as staging) holds at most the bytes of an fp16 cache of the same
 * tokens (cli_kv_bytes_used of both), searched up to 64 tiles: one more
 * than the last count below that where it holds more. -1 when a size
 * cannot be computed. */
static long fp16_break_even(const kvarn_format *fmt, const kvarn_llama_hparams *hp, int staging)
{
    kvarn_format fp16;
    kvarn_format_parse("fp16", &fp16);
    const long limit = 64L * (fmt->tile_tokens > 0 ? fmt->tile_tokens : 16);
    long last = 0;
    for (long n = 1; n <= limit; n++) {
        double q = cli_kv_bytes_used(fmt, hp, n, staging);
        double b = cli_kv_bytes_used(&fp16, hp, n, KVARN_STAGING_FP16);
        if (q < 0 || b < 0) return -1;
        if (q > b) last = n;
    }
    return last + 1;
}

/* On stderr: the bytes the session's cache holds for its tokens, as a
 * multiple of what an fp16 cache would hold for them (cli_kv_bytes_used),
 * e.g. "KV cache for 9 tokens: 191.2 KiB, 0.53x the size of an fp16 cache
 * (360.0 KiB)"; for KVarN what its staged sink and tail do to that: when the
 * cache is larger than fp16's, that it is and below how many tokens
 * (fp16_break_even), else that short texts gain little; and the prompt and
 * generation speeds. info: the session cache's geometry (sink tokens). */
static void report(const gen_stats *s, const kvarn_format *fmt, const kvarn_llama_hparams *hp,
                   const kvarn_cache_info *info)
{
    kvarn_format fp16;
    kvarn_format_parse("fp16", &fp16);
    double used = s->kv_bytes, base = cli_kv_bytes_used(&fp16, hp, s->n_tokens, KVARN_STAGING_FP16);
    char b1[32], b2[32], ratio[32];
    /* the ratio with enough digits to be on the side of 1 the words say
     * (1.00x for a cache 0.2% larger read as a contradiction) */
    const double x = base > 0 ? used / base : 0.0;
    for (int p = 2; p <= 9; p++) {
        snprintf(ratio, sizeof ratio, "%.*f", p, x);
        const double shown = strtod(ratio, NULL);
        if (base <= 0 || used == base || (used > base ? shown > 1.0 : shown < 1.0)) break;
    }
    fprintf(stderr, "[%s] KV cache for %ld token%s: %s, %sx the size of an fp16 cache (%s)",
            fmt->name, s->n_tokens, s->n_tokens == 1 ? "" : "s", cli_fmt_bytes(used, b1, sizeof b1),
            ratio, cli_fmt_bytes(base, b2, sizeof b2));
    if (fmt->per_tile) {
        const char *st = kvarn_cache_staging_name(info->staging);
        if (st == NULL) st = "fp16";
        const long below = used > base ? fp16_break_even(fmt, hp, info->staging) : -1;
        if (below > 0)
            fprintf(stderr, ": larger than an fp16 cache for so few tokens: the sink (%d "
                    "tokens) and staging tail (up to a %d-token tile), staged %s, dominate; "
                    "from %ld tokens on it is never larger",
                    info->sink_tokens, fmt->tile_tokens, st, below);
        else
            fprintf(stderr, "; the sink (%d tokens) and the last partial tile stay staged %s, "
                    "so short texts gain less", info->sink_tokens, st);
        fprintf(stderr, "; on long contexts %s holds %.2fx as many tokens as fp16 in the same "
                "memory", fmt->name, 4.0 * hp->head_dim / kvarn_bytes_per_token_head(fmt, hp->head_dim));
    }
    fprintf(stderr, "\n[%s] prompt %.1f tok/s, ", fmt->name,
            s->prompt_s > 0 ? s->prompt_n / s->prompt_s : 0.0);
    if (s->gen_n > 0) fprintf(stderr, "generation %.1f tok/s\n", s->gen_s > 0 ? s->gen_n / s->gen_s : 0.0);
    else fprintf(stderr, "no tokens generated\n");
}

int cmd_generate(int argc, char **argv)
{
    gen_opts o = k_defaults;
    int rc = cli_parse_options(&k_command, argc, argv, &o);
    if (rc >= 0) return rc;
    kvarn_format fmt;
    if (check_options(&o, &fmt)) return 2;
    cli_model m;
    if (cli_model_open("generate", o.model_path, &m)) return 1;
    gen_state g;
    rc = 1;
    int ok = gen_init(&g, &m, &o, &fmt) == 0;
    if (ok && o.load_state) {
        ok = load_state(&g, &o) == 0;
        if (!ok) rc = 2; /* another model or format, or a bad file: a usage error */
    }
    if (ok) ok = (o.prompt ? run_prompt(&g, &o) : o.load_state ? reply(&g, o.n_gen) : run_chat(&g, &o)) == 0;
    if (ok && o.save_state) ok = save_state(&g, &o) == 0;
    if (ok) {
        g.stats.n_tokens = kvarn_llama_session_pos(g.sess);
        g.stats.kv_bytes = cli_session_kv_bytes(g.sess);
        kvarn_cache_info info;
        if (kvarn_cache_get_info(kvarn_llama_session_cache(g.sess), &info) != KVARN_OK)
            memset(&info, 0, sizeof info);
        if (g.stats.n_tokens > 0) report(&g.stats, &fmt, m.hp, &info);
        else /* --chat on an empty stdin: no speeds of nothing */
            fprintf(stderr, "[%s] nothing to generate: no message on standard input "
                    "(--chat reads one per line)\n", fmt.name);
        rc = 0;
    }
    gen_free(&g);
    cli_model_close(&m);
    return rc;
}
