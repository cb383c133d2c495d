/* cli.c -- helpers shared by the kvarn subcommands (see cli.h). */
#include "cli.h"
#include "format_list.h"

#include "kvarn/cache.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

void cli_error(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "kvarn %s: ", cmd);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

int cli_parse_bytes(const char *s, uint64_t *out)
{
    if (s == NULL || *s == '\0') return -1;
    errno = 0;
    char *end;
    double v = strtod(s, &end);
    if (errno || end == s || !(v >= 0) || !isfinite(v)) return -1;
    static const struct { const char *suffix; double mult; } units[] = {
        {"", 1}, {"B", 1},
        {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0},
        {"K", 1024.0}, {"M", 1048576.0}, {"G", 1073741824.0}, {"T", 1099511627776.0},
        {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12},
    };
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        if (strcasecmp(end, units[i].suffix) == 0 && strlen(end) == strlen(units[i].suffix)) {
            double b = v * units[i].mult;
            if (b > 1.8e19) return -1;
            *out = (uint64_t)b;
            return 0;
        }
    }
    return -1;
}

/* What the last failed parse expected, for the "bad value" message. */
static char g_expected[96] = "";

const char *cli_expected(void) { return g_expected; }

void cli_expect(const char *what) { snprintf(g_expected, sizeof g_expected, "%s", what); }

int cli_parse_int(const char *s, long lo, long hi, long *out)
{
    snprintf(g_expected, sizeof g_expected, "an integer from %ld to %ld", lo, hi);
    if (s == NULL || *s == '\0') return -1;
    errno = 0;
    char *end;
    long v = strtol(s, &end, 10);
    if (errno || *end != '\0' || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

int cli_parse_double(const char *s, double *out)
{
    snprintf(g_expected, sizeof g_expected, "a finite number");
    if (s == NULL || *s == '\0') return -1;
    errno = 0;
    char *end;
    double v = strtod(s, &end);
    if (errno || *end != '\0' || !isfinite(v)) return -1;
    *out = v;
    return 0;
}

int cli_parse_formats(const char *cmd, const char *list, kvarn_format *out, int max)
{
    char msg[1024];
    int n = format_list_parse(list, out, max, msg, sizeof msg);
    if (n < 0) cli_error(cmd, "%s", msg);
    return n;
}

int cli_check_tail_tokens(const char *cmd, long tail_tokens, const kvarn_format *fmts, int n)
{
    for (int i = 0; i < n; i++) {
        const long G = fmts[i].tile_tokens;
        if (fmts[i].kind != KVARN_KIND_KVARN || tail_tokens <= 0 || tail_tokens >= G) continue;
        if (G % tail_tokens != 0) {
            cli_error(cmd, "--tail-page-tokens %ld must divide the tile of %s (G = %ld tokens), "
                      "or be 0 or >= G for whole tail pages", tail_tokens, fmts[i].name, G);
            return -1;
        }
    }
    return 0;
}

int cli_kvarn_only_warnings(long sink_tokens, long tail_tokens, const char *staging_name,
                            const kvarn_format *fmts, int n,
                            char out[CLI_KVARN_ONLY_MAX][CLI_WARNING_LEN])
{
    char names[CLI_WARNING_LEN / 2] = "";
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        if (fmts[i].kind == KVARN_KIND_KVARN) return 0; /* the options are used */
        if (at < sizeof names)
            at += (size_t)snprintf(names + at, sizeof names - at, "%s%s", at ? ", " : "",
                                   fmts[i].name);
    }
    int k = 0;
    if (sink_tokens >= 0)
        snprintf(out[k++], CLI_WARNING_LEN, "--sink-tokens %ld does nothing for %s: only KVarN "
                 "formats (kvarn_*) keep a staged sink", sink_tokens, names);
    if (tail_tokens > 0)
        snprintf(out[k++], CLI_WARNING_LEN, "--tail-page-tokens %ld does nothing for %s: only "
                 "KVarN formats (kvarn_*) hold their tail in pages", tail_tokens, names);
    if (staging_name != NULL)
        snprintf(out[k++], CLI_WARNING_LEN, "--kvarn-staging %s does nothing for %s: only "
                 "KVarN formats (kvarn_*) stage tokens", staging_name, names);
    return k;
}

int cli_warn_kvarn_only(const char *cmd, long sink_tokens, long tail_tokens,
                        const char *staging_name, const kvarn_format *fmts, int n)
{
    char w[CLI_KVARN_ONLY_MAX][CLI_WARNING_LEN];
    const int k = cli_kvarn_only_warnings(sink_tokens, tail_tokens, staging_name, fmts, n, w);
    for (int i = 0; i < k; i++) fprintf(stderr, "kvarn %s: warning: %s\n", cmd, w[i]);
    return k;
}

const char *cli_fmt_bytes(double bytes, char *buf, size_t len)
{
    static const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    int i = 0;
    while (bytes >= 1024.0 && i < 6) { bytes /= 1024.0; i++; }
    snprintf(buf, len, i ? "%.1f %s" : "%.0f %s", bytes, u[i]);
    return buf;
}

void cli_missing_model(const char *cmd, const char *path)
{
    cli_error(cmd,
              "model file '%s' not found. Get the evaluation model (SmolLM2-135M-Instruct, "
              "Q4_1 GGUF) with `bash scripts/setup.sh --model`; it lands in "
              "models/SmolLM2-135M-Instruct.Q4_1.gguf. Any llama-architecture GGUF works.",
              path);
}

#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/sysinfo.h>
#endif

int cli_check_model_path(const char *cmd, const char *path)
{
    struct stat sb;
    if (path == NULL || stat(path, &sb) != 0) {
        cli_missing_model(cmd, path ? path : "(none given: use -m MODEL)");
        return -1;
    }
    if (!S_ISREG(sb.st_mode)) {
        cli_error(cmd, "model '%s' is not a regular file (a GGUF file is read with seeks)", path);
        return -1;
    }
    return 0;
}

int cli_model_open(const char *cmd, const char *path, cli_model *m)
{
    memset(m, 0, sizeof *m);
    if (cli_check_model_path(cmd, path)) return -1;
    char err[512] = "";
    kvarn_status st = kvarn_gguf_open(path, &m->gguf, err, sizeof err);
    if (st != KVARN_OK) {
        cli_error(cmd, "cannot read model '%s': %s%s%s", path, kvarn_strerror(st),
                  err[0] ? ": " : "", err);
        return -1;
    }
    /* the metadata first: a bad key is named with its value */
    kvarn_llama_hparams hp;
    st = kvarn_llama_read_hparams(m->gguf, &hp, err, sizeof err);
    /* then the tensors: a missing or misshapen one is named with its shape */
    if (st == KVARN_OK) st = kvarn_llama_check_tensors(m->gguf, &hp, err, sizeof err);
    if (st != KVARN_OK) {
        cli_error(cmd, "cannot load '%s' as a llama model: %s", path, err);
        cli_model_close(m);
        return -1;
    }
    st = kvarn_llama_load_gguf(m->gguf, &m->llama);
    if (st != KVARN_OK) {
        const char *w = getenv("KVARN_WEIGHTS");
        kvarn_llama_weights asked;
        const int named = w && *w;
        if (named && kvarn_llama_weights_parse(w, &asked) != KVARN_OK)
            cli_error(cmd, "cannot load '%s': KVARN_WEIGHTS='%s' is not a weight precision; "
                           "expected fp32, bf16, int8 or gguf (docs/model.md)", path, w);
        else
            cli_error(cmd, "cannot load '%s' as a llama model: %s%s", path, kvarn_strerror(st),
                      !named || st != KVARN_ERR_UNSUPPORTED ? ""
                      : asked == KVARN_LLAMA_WEIGHTS_BF16
                          ? " (KVARN_WEIGHTS=bf16 needs oneDNN and an AVX-512 CPU: docs/model.md)"
                      : asked == KVARN_LLAMA_WEIGHTS_INT8
                          ? " (KVARN_WEIGHTS=int8 needs oneDNN and a CPU with AVX-512 VNNI or "
                            "AVX-VNNI: docs/model.md)"
                          : "");
        cli_model_close(m);
        return -1;
    }
    st = kvarn_tokenizer_from_gguf(m->gguf, &m->tok);
    if (st != KVARN_OK) {
        cli_error(cmd, "cannot build the tokenizer of '%s': %s", path, kvarn_strerror(st));
        cli_model_close(m);
        return -1;
    }
    m->hp = kvarn_llama_get_hparams(m->llama);
    return 0;
}

void cli_model_close(cli_model *m)
{
    kvarn_tokenizer_free(m->tok);
    kvarn_llama_free(m->llama);
    kvarn_gguf_close(m->gguf);
    memset(m, 0, sizeof *m);
}

int cli_read_file(const char *cmd, const char *path, char **data, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        cli_error(cmd, "cannot open '%s': %s", path, strerror(errno));
        return -1;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    while (buf) {
        size_t r = fread(buf + n, 1, cap - n, f);
        n += r;
        if (n < cap) break;
        char *nb = realloc(buf, 2 * cap + 1);
        if (nb == NULL) { free(buf); buf = NULL; break; }
        buf = nb;
        cap *= 2;
    }
    int bad = ferror(f);
    fclose(f);
    if (buf == NULL || bad) {
        free(buf);
        cli_error(cmd, "cannot read '%s'", path);
        return -1;
    }
    buf[n] = '\0';
    *data = buf;
    *len = n;
    return 0;
}

double cli_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double g_progress_last = 0.0;
static int g_progress_open = 0;
static long g_progress_step = 0; /* non-terminal: the last step printed */

void cli_progress(const char *label, long done, long total)
{
    if (isatty(STDERR_FILENO)) {
        double t = cli_now();
        if (done < total && t - g_progress_last < 0.2) return;
        g_progress_last = t;
        int width = 30, fill = total > 0 ? (int)(width * done / total) : width;
        fprintf(stderr, "\r%-24s [", label);
        for (int i = 0; i < width; i++) fputc(i < fill ? '#' : '.', stderr);
        fprintf(stderr, "] %ld/%ld", done, total);
        g_progress_open = 1;
    } else {
        /* a line each time done passes a multiple of ceil(total / 10), and
         * at the end: counted one by one (passkey), the lines are evenly
         * spaced (10 * done / total skipped numbers: 6/12 then 8/12) */
        long unit = total > 10 ? (total + 9) / 10 : 1;
        long step = total > 0 && done < total ? done / unit : LONG_MAX;
        if (step <= g_progress_step) return;
        g_progress_step = step;
        fprintf(stderr, "%s: %ld/%ld\n", label, done, total);
    }
}

void cli_progress_end(void)
{
    if (g_progress_open) fputc('\n', stderr);
    g_progress_open = 0;
    g_progress_step = 0;
}

static kvarn_cache_opts cli_cache_opts(const kvarn_format *f, int layers, int kv_heads,
                                       int head_dim)
{
    kvarn_cache_opts o = kvarn_cache_default_opts();
    o.format = *f;
    o.n_layers = layers;
    o.n_kv_heads = kv_heads;
    o.head_dim = head_dim;
    return o;
}

double cli_kv_bytes_used(const kvarn_format *f, const kvarn_llama_hparams *hp, long n_tokens,
                         int staging)
{
    if (n_tokens < 0 || n_tokens > KVARN_CACHE_MAX_SEQ_LEN) return -1.0;
    kvarn_cache_opts o = cli_cache_opts(f, hp->n_layers, hp->n_kv_heads, hp->head_dim);
    o.staging = staging;
    o.max_seqs = 1;
    o.max_seq_len = n_tokens > 0 ? (int)n_tokens : 1;
    o.budget_bytes = 0; /* sizing: per-sequence numbers only */
    kvarn_cache_capacity cap;
    if (kvarn_cache_capacity_get(&o, 1, (int)n_tokens, &cap) != KVARN_OK) return -1.0;
    return (double)cap.seq_arena_bytes;
}

double cli_session_kv_bytes(kvarn_llama_session *s)
{
    const kvarn_cache *c = kvarn_llama_session_cache(s);
    kvarn_cache_info info;
    kvarn_cache_stats st;
    if (c == NULL || kvarn_cache_get_info(c, &info) != KVARN_OK ||
        kvarn_cache_get_stats(c, &st) != KVARN_OK)
        return -1.0;
    return (double)st.blocks_in_use * (double)info.block_bytes +
           (double)st.pages_in_use * (double)info.page_bytes +
           (double)st.n_seqs * (double)info.sink_bytes;
}

kvarn_status cli_capacity_get(const kvarn_format *f, int layers, int kv_heads, int head_dim,
                              uint64_t budget, int max_seqs, int sink_tokens, int tail_tokens,
                              int staging,
                              const int *lens, int n_lens, cli_capacity *out)
{
    memset(out, 0, sizeof *out);
    if (n_lens < 0 || n_lens > 8) return KVARN_ERR_INVALID_ARG;
    kvarn_cache_opts o = cli_cache_opts(f, layers, kv_heads, head_dim);
    o.max_seqs = max_seqs;
    if (f->kind == KVARN_KIND_KVARN) {
        if (sink_tokens >= 0) {
            o.sink_tokens = sink_tokens; /* S > 0 replaces the sink tiles */
            if (sink_tokens == 0) o.sink_tiles = 0;
        }
        /* T >= G: whole tail pages, the default */
        if (tail_tokens > 0 && tail_tokens < f->tile_tokens) o.tail_page_tokens = tail_tokens;
        o.staging = staging;
    }
    kvarn_cache_opts fit;
    kvarn_cache_capacity cap;
    kvarn_status st = kvarn_cache_fit_budget(&o, budget, &fit);
    if (st == KVARN_OK) {
        st = kvarn_cache_capacity_get(&fit, max_seqs, 0, &cap);
        if (st != KVARN_OK) return st;
        out->fits = 1;
        out->tokens = cap.tokens;
        out->block_size = cap.info.block_size;
    } else if (st == KVARN_ERR_INVALID_ARG) {
        /* the geometry alone, for the G column */
        o.budget_bytes = 0;
        st = kvarn_cache_capacity_get(&o, 1, 0, &cap);
        if (st != KVARN_OK) return st;
        out->block_size = cap.info.block_size;
    } else {
        return st;
    }
    for (int i = 0; i < n_lens; i++) {
        st = kvarn_cache_seqs_fit(&o, budget, lens[i], &out->seqs[i], NULL);
        if (st != KVARN_OK) return st;
    }
    return KVARN_OK;
}

uint64_t cli_machine_memory(void)
{
#ifdef __linux__
    struct sysinfo si;
    if (sysinfo(&si) != 0) return 0;
    return ((uint64_t)si.totalram + (uint64_t)si.totalswap) * (uint64_t)si.mem_unit;
#else
    return 0;
#endif
}

/* "N tokens x L layers x Hk KV heads x D channels in FORMAT" */
static void describe_kv(char *buf, size_t len, long tokens, const kvarn_llama_hparams *hp,
                        const char *format)
{
    snprintf(buf, len, "%ld tokens x %d layers x %d KV heads x %d channels in %s", tokens,
             hp->n_layers, hp->n_kv_heads, hp->head_dim, format);
}

void cli_session_set_sink(kvarn_llama_session_opts *so, long sink_tokens)
{
    if (sink_tokens < 0) return;
    so->sink_tokens = (int)sink_tokens; /* S > 0 replaces the sink tiles */
    if (sink_tokens == 0) so->sink_tiles = 0;
}

int cli_parse_staging(const char *cmd, const char *name, int *staging)
{
    *staging = kvarn_cache_default_opts().staging; /* int8 */
    if (name == NULL) return 0;
    if (kvarn_cache_staging_parse(name, staging) != KVARN_OK) {
        cli_error(cmd, "--kvarn-staging %s: unknown staging format; expected fp16, int8, "
                       "fp8_e4m3 (alias fp8) or int4",
                  name);
        return 2;
    }
    return 0;
}

int cli_session_create(const char *cmd, const cli_model *m, const kvarn_llama_session_opts *so,
                       const char *hint, kvarn_llama_session **out)
{
    *out = NULL;
    const kvarn_llama_hparams *hp = m->hp;
    const char *format = so->exact ? "exact fp32" : so->format ? so->format->name : "fp16";
    const long tokens = so->max_tokens > 0 ? so->max_tokens : hp->context_length;
    char what[256], b1[32], b2[32], b3[32], msg[512];
    describe_kv(what, sizeof what, tokens, hp, format);
    kvarn_llama_session_info info;
    kvarn_status st = kvarn_llama_session_plan(m->llama, so, &info);
    if (st == KVARN_ERR_TOO_LARGE) {
        /* No plan to quote: the K/V alone, at the format's bytes per
         * token-head (K and V, scales, padding), in floating point. */
        kvarn_format fp16;
        const kvarn_format *f = so->format;
        if (f == NULL && kvarn_format_parse("fp16", &fp16) == KVARN_OK) f = &fp16;
        double per = 8.0 * hp->head_dim; /* exact fp32 K and V */
        if (!so->exact) per = kvarn_bytes_per_token_head(f, hp->head_dim);
        double asked = (double)tokens * hp->n_layers * hp->n_kv_heads * per;
        cli_fmt_bytes(asked, b1, sizeof b1);
        if (tokens > KVARN_CACHE_MAX_SEQ_LEN)
            cli_error(cmd, "cannot allocate the KV cache: %s asked for %s; a context holds at "
                      "most %d tokens%s%s", b1, what, KVARN_CACHE_MAX_SEQ_LEN,
                      hint ? "; " : "", hint ? hint : "");
        else
            cli_error(cmd, "cannot allocate the KV cache: %s asked for %s; its buffers would "
                      "not fit in 64 bits%s%s", b1, what, hint ? "; " : "", hint ? hint : "");
        return -1;
    }
    if (st != KVARN_OK) {
        cli_error(cmd, "%s", kvarn_format_explain(st, format, hp->head_dim, msg, sizeof msg));
        return -1;
    }
    cli_fmt_bytes((double)info.total_bytes, b1, sizeof b1);
    cli_fmt_bytes((double)info.kv_bytes, b2, sizeof b2);
    cli_fmt_bytes((double)info.other_bytes, b3, sizeof b3);
    const uint64_t have = cli_machine_memory();
    if (have > 0 && info.total_bytes > have) {
        char b4[32];
        cli_error(cmd, "cannot allocate the KV cache: %s asked for %s (%s of K/V, %s of "
                  "scratch); this machine has %s of memory (RAM + swap)%s%s", b1, what, b2, b3,
                  cli_fmt_bytes((double)have, b4, sizeof b4), hint ? "; " : "", hint ? hint : "");
        return -1;
    }
    st = kvarn_llama_session_create(m->llama, so, out);
    if (st == KVARN_ERR_NOMEM) {
        cli_error(cmd, "cannot allocate the KV cache: %s asked for %s (%s of K/V, %s of "
                  "scratch) and the allocation failed%s%s", b1, what, b2, b3, hint ? "; " : "",
                  hint ? hint : "");
        return -1;
    }
    if (st != KVARN_OK) {
        cli_error(cmd, "%s", kvarn_format_explain(st, format, hp->head_dim, msg, sizeof msg));
        return -1;
    }
    return 0;
}

/* The well-formed UTF-8 sequence at s: its length (1..4) in *n, 1; or
 * the maximal subpart of one (the lead byte and the continuation bytes
 * that could still follow it, Unicode's "U+FFFD substitution of maximal
 * subparts") in *n, 0. */
static int utf8_seq(const unsigned char *s, size_t *n)
{
    const unsigned c = s[0];
    size_t len;
    unsigned lo = 0x80, hi = 0xBF; /* range of the second byte */
    *n = 1;
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        if (c == 0xE0) lo = 0xA0;      /* overlong */
        else if (c == 0xED) hi = 0x9F; /* surrogates */
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        if (c == 0xF0) lo = 0x90;      /* overlong */
        else if (c == 0xF4) hi = 0x8F; /* above U+10FFFF */
    } else
        return 0;
    if (s[1] < lo || s[1] > hi) return 0;
    for (*n = 2; *n < len; ++*n)
        if (s[*n] < 0x80 || s[*n] > 0xBF) return 0; /* NUL ends it here too */
    return 1;
}

char *cli_utf8_valid(const char *s)
{
    const size_t len = strlen(s);
    char *out = malloc(3 * len + 1); /* each byte at most U+FFFD's 3 */
    if (out == NULL) return NULL;
    size_t o = 0, n;
    for (const unsigned char *p = (const unsigned char *)s; *p; p += n) {
        if (utf8_seq(p, &n)) {
            memcpy(out + o, p, n);
            o += n;
        } else {
            memcpy(out + o, "\xEF\xBF\xBD", 3);
            o += 3;
        }
    }
    out[o] = '\0';
    return out;
}
