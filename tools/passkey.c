/* passkey.c -- passkey retrieval trials (see passkey.h). */
#include "passkey.h"

#include <stdlib.h>
#include <string.h>

static const char k_intro[] =
    "There is an important info hidden inside a lot of irrelevant text. Find it and "
    "memorize them. I will quiz you about the important information there.";
static const char k_filler[] =
    " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";
static const char k_question[] = " What is the pass key? The pass key is";

#define ANSWER_TOKENS 8

typedef struct piece { int32_t *ids; size_t n; } piece;

static int encode_piece(cli_model *m, const char *text, piece *p)
{
    kvarn_status st = kvarn_tokenizer_encode_alloc(m->tok, text, strlen(text), 0, &p->ids, &p->n);
    if (st != KVARN_OK) { cli_error("passkey", "tokenizing: %s", kvarn_strerror(st)); return -1; }
    return 0;
}

static void append(int32_t *dst, size_t *n, const piece *p)
{
    memcpy(dst + *n, p->ids, p->n * sizeof(int32_t));
    *n += p->n;
}

/* Greedy answer of up to ANSWER_TOKENS tokens after the prompt; 1 if its
 * text holds the key's five digits. */
static int ask(cli_model *m, kvarn_llama_session *s, const int32_t *prompt, size_t n, long chunk,
               const char *key, float *logits, int *ok)
{
    const int V = m->hp->vocab;
    kvarn_llama_session_reset(s);
    for (size_t i = 0; i < n; i += (size_t)chunk) {
        size_t c = n - i < (size_t)chunk ? n - i : (size_t)chunk;
        kvarn_status st = kvarn_llama_forward(s, prompt + i, (int)c, KVARN_LLAMA_LOGITS_LAST, logits, (size_t)V);
        if (st != KVARN_OK) { cli_error("passkey", "forward: %s", kvarn_strerror(st)); return -1; }
    }
    char text[256];
    size_t used = 0;
    for (int t = 0; t < ANSWER_TOKENS; t++) {
        int32_t best = 0;
        for (int v = 1; v < V; v++) if (logits[v] > logits[best]) best = v;
        if (kvarn_tokenizer_is_end_of_generation(m->tok, best)) break;
        size_t len = 0;
        if (kvarn_tokenizer_decode(m->tok, &best, 1, KVARN_DETOKENIZE_SKIP_SPECIAL, text + used,
                                   sizeof text - 1 - used, &len) == KVARN_OK)
            used += len;
        if (t + 1 < ANSWER_TOKENS) {
            kvarn_status st = kvarn_llama_forward(s, &best, 1, KVARN_LLAMA_LOGITS_LAST, logits, (size_t)V);
            if (st != KVARN_OK) { cli_error("passkey", "forward: %s", kvarn_strerror(st)); return -1; }
        }
    }
    text[used] = '\0';
    *ok = strstr(text, key) != NULL;
    return 0;
}

/* The key sentence for key (five digits). */
static void key_sentence(const char *key, char *text, size_t len)
{
    snprintf(text, len, " The pass key is %s. Remember it. %s is the pass key.", key, key);
}

long passkey_min_length(cli_model *m)
{
    piece intro = {0}, kp = {0}, question = {0};
    char key_text[128];
    key_sentence("99999", key_text, sizeof key_text);
    long n = -1;
    if (encode_piece(m, k_intro, &intro) == 0 && encode_piece(m, key_text, &kp) == 0 &&
        encode_piece(m, k_question, &question) == 0)
        n = (long)(intro.n + kp.n + question.n);
    free(intro.ids); free(kp.ids); free(question.ids);
    return n;
}

int passkey_run(cli_model *m, const kvarn_format *fmts, int nf, const passkey_opts *o, int *correct)
{
    long max_len = 0;
    for (int i = 0; i < o->n_lengths; i++) max_len = o->lengths[i] > max_len ? o->lengths[i] : max_len;
    if (max_len + ANSWER_TOKENS > m->hp->context_length) {
        max_len = m->hp->context_length - ANSWER_TOKENS;
        if (!o->quiet)
            fprintf(stderr, "kvarn passkey: lengths above %ld are cut to %ld tokens so that the answer "
                    "(%d tokens) fits in the model's context of %d\n", max_len, max_len, ANSWER_TOKENS,
                    m->hp->context_length);
    }
    int rc = -1;
    piece intro = {0}, filler = {0}, question = {0};
    int32_t *prompt = NULL;
    float *logits = NULL;
    kvarn_llama_session **sess = calloc((size_t)nf + 1, sizeof *sess);
    if (sess == NULL) return -1;
    if (encode_piece(m, k_intro, &intro) || encode_piece(m, k_filler, &filler) ||
        encode_piece(m, k_question, &question))
        goto out;
    prompt = malloc(sizeof(int32_t) * (size_t)(max_len + 64));
    logits = malloc(sizeof(float) * (size_t)m->hp->vocab);
    if (!prompt || !logits) goto out;
    kvarn_llama_session_opts so = KVARN_LLAMA_SESSION_OPTS_DEFAULT;
    so.max_tokens = (int)max_len + ANSWER_TOKENS;
    so.max_chunk = (int)o->chunk;
    so.attn_threads = o->threads;
    cli_session_set_sink(&so, o->sink_tokens);
    so.staging = o->staging;
    for (int f = 0; f <= nf; f++) {
        so.format = f == 0 ? NULL /* fp16, the reference */ : &fmts[f - 1];
        if (cli_session_create("passkey", m, &so, "use shorter lengths", &sess[f])) goto out;
    }
    memset(correct, 0, sizeof(int) * (size_t)(nf + 1) * (size_t)o->n_lengths);
    uint64_t rng = o->seed * 0x9e3779b97f4a7c15ull + 1;
    long total = (long)o->n_lengths * o->n_depths * o->trials * (nf + 1), done = 0;
    for (int li = 0; li < o->n_lengths; li++) {
        for (int di = 0; di < o->n_depths; di++) {
            for (int t = 0; t < o->trials; t++) {
                rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
                char key[8], key_text[128];
                snprintf(key, sizeof key, "%05u", (unsigned)(10000 + rng % 90000));
                key_sentence(key, key_text, sizeof key_text);
                piece kp = {0};
                if (encode_piece(m, key_text, &kp)) goto out;
                long fixed = (long)(intro.n + kp.n + question.n);
                long len = o->lengths[li] < max_len ? o->lengths[li] : max_len;
                if (len < fixed) {
                    /* no filler fits: the prompt would outgrow the sessions */
                    cli_error("passkey", "length %ld is below the %ld tokens of the prompt without "
                              "filler (intro, key, question)", len, fixed);
                    free(kp.ids);
                    goto out;
                }
                long units = (len - fixed) / (long)filler.n;
                long before = (units * o->depths[di] + 50) / 100;
                size_t n = 0;
                append(prompt, &n, &intro);
                for (long u = 0; u < units; u++) {
                    if (u == before) append(prompt, &n, &kp);
                    append(prompt, &n, &filler);
                }
                if (before >= units) append(prompt, &n, &kp);
                append(prompt, &n, &question);
                free(kp.ids);
                for (int f = 0; f <= nf; f++) {
                    int ok = 0;
                    if (ask(m, sess[f], prompt, n, o->chunk, key, logits, &ok)) goto out;
                    correct[f * o->n_lengths + li] += ok;
                    if (!o->quiet) cli_progress(o->progress ? o->progress : "kvarn passkey", ++done, total);
                }
            }
        }
    }
    if (!o->quiet) cli_progress_end();
    rc = 0;
out:
    for (int f = 0; f <= nf; f++) kvarn_llama_session_free(sess[f]);
    free(sess);
    free(intro.ids); free(filler.ids); free(question.ids);
    free(prompt);
    free(logits);
    return rc;
}
