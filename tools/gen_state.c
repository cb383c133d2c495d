/*
 * gen_state.c -- `kvarn generate`'s state file (gen_state.h): the model's
 * identity, the token ids, the last logits and the sampler's state, then
 * the library's sequence stream (kvarn_cache_seq_save). Layout:
 * docs/state.md "The kvarn generate state file".
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "gen_state.h"
#include "kvarn/state.h"

static const char k_magic[8] = {'K', 'V', 'A', 'R', 'N', 'G', 'E', 'N'};

enum { F_VERSION = 8, F_HEADER = 12, F_ARCH = 16, F_VOCAB = 48, F_LAYERS = 52, F_HIDDEN = 56,
       F_KV_HEADS = 60, F_HEAD_DIM = 64, F_TOKENS = 68, F_RNG = 72, F_STREAM = 80, F_CRC = 88,
       F_END = 96, F_VERSION_1 = 1 };

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void put64(uint8_t *p, uint64_t v)
{
    put32(p, (uint32_t)v);
    put32(p + 4, (uint32_t)(v >> 32));
}

static uint64_t get64(const uint8_t *p)
{
    return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32;
}

/* The model's identity fields of the header: architecture (NUL-padded),
 * vocab, layers, hidden size, KV heads, head_dim. */
static void identity(const cli_model *m, uint8_t *h)
{
    kvarn_gguf_str a = {NULL, 0};
    memset(h + F_ARCH, 0, 32);
    if (kvarn_gguf_get_string(m->gguf, "general.architecture", &a) == KVARN_OK && a.ptr)
        memcpy(h + F_ARCH, a.ptr, a.len < 31 ? (size_t)a.len : 31);
    const int v[] = {m->hp->vocab, m->hp->n_layers, m->hp->hidden, m->hp->n_kv_heads,
                     m->hp->head_dim};
    for (int i = 0; i < 5; i++) put32(h + F_VOCAB + 4 * i, (uint32_t)v[i]);
}

/* CRC-32 of the header (CRC field zero), the tokens and the logits. */
static uint32_t file_crc(const uint8_t *b, size_t n)
{
    uint8_t h[F_END];
    memcpy(h, b, F_END);
    put32(h + F_CRC, 0);
    uLong crc = crc32_z(crc32_z(0L, Z_NULL, 0), h, F_END);
    return (uint32_t)crc32_z(crc, b + F_END, n - F_END);
}

int gen_state_save(const char *path, const cli_model *m, kvarn_llama_session *sess,
                   const gen_saved *g)
{
    kvarn_cache *c = kvarn_llama_session_cache(sess);
    const int seq = kvarn_llama_session_seq(sess);
    size_t sb = 0;
    kvarn_status st = kvarn_cache_seq_state_size(c, seq, &sb);
    if (st != KVARN_OK) {
        cli_error("generate", "--save-state %s: %s", path, kvarn_strerror(st));
        return -1;
    }
    const size_t V = (size_t)m->hp->vocab, head = F_END + 4 * (size_t)g->n_tokens + 4 * V;
    uint8_t *b = calloc(1, head + sb);
    if (b == NULL) {
        cli_error("generate", "--save-state %s: out of memory", path);
        return -1;
    }
    memcpy(b, k_magic, sizeof k_magic);
    put32(b + F_VERSION, F_VERSION_1);
    put32(b + F_HEADER, F_END);
    identity(m, b);
    put32(b + F_TOKENS, (uint32_t)g->n_tokens);
    put64(b + F_RNG, g->rng);
    put64(b + F_STREAM, sb);
    for (int i = 0; i < g->n_tokens; i++) put32(b + F_END + 4 * (size_t)i, (uint32_t)g->tokens[i]);
    for (size_t i = 0; i < V; i++) {
        uint32_t u;
        memcpy(&u, &g->logits[i], 4);
        put32(b + F_END + 4 * (size_t)g->n_tokens + 4 * i, u);
    }
    put32(b + F_CRC, file_crc(b, head));
    size_t w = 0;
    st = kvarn_cache_seq_save(c, seq, b + head, sb, &w);
    FILE *f = st == KVARN_OK ? fopen(path, "wb") : NULL;
    int rc = 0;
    if (st != KVARN_OK) {
        cli_error("generate", "--save-state %s: %s", path, kvarn_strerror(st));
        rc = -1;
    } else if (f == NULL || fwrite(b, 1, head + sb, f) != head + sb) {
        cli_error("generate", "--save-state %s: cannot write: %s", path, strerror(errno));
        rc = -1;
    }
    if (f != NULL && fclose(f) != 0 && rc == 0) {
        cli_error("generate", "--save-state %s: cannot write: %s", path, strerror(errno));
        rc = -1;
    }
    free(b);
    return rc;
}

/* The whole file, malloc'ed, or NULL with the line printed. */
static uint8_t *read_all(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        cli_error("generate", "--load-state %s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    size_t cap = 1 << 16, len = 0;
    uint8_t *b = malloc(cap);
    while (b != NULL) {
        len += fread(b + len, 1, cap - len, f);
        if (len < cap) break;
        uint8_t *nb = realloc(b, cap * 2);
        if (nb == NULL) free(b);
        b = nb;
        cap *= 2;
    }
    const int bad = ferror(f);
    fclose(f);
    if (b == NULL || bad) {
        cli_error("generate", "--load-state %s: cannot read it", path);
        free(b);
        return NULL;
    }
    *n = len;
    return b;
}

/* The file's own part: magic, version, size, CRC, model identity. 0, or
 * -1 with the line printed. */
static int check_file(const char *path, const cli_model *m, const uint8_t *b, size_t n)
{
    if (n < sizeof k_magic || memcmp(b, k_magic, sizeof k_magic) != 0) {
        cli_error("generate", "--load-state %s: not a kvarn generate state file", path);
        return -1;
    }
    if (n < F_END) {
        cli_error("generate", "--load-state %s: truncated (%zu bytes)", path, n);
        return -1;
    }
    if (get32(b + F_VERSION) != F_VERSION_1 || get32(b + F_HEADER) != F_END) {
        cli_error("generate", "--load-state %s: layout version %u, this kvarn reads %d", path,
                  get32(b + F_VERSION), F_VERSION_1);
        return -1;
    }
    const uint64_t nt = get32(b + F_TOKENS), V = (uint64_t)m->hp->vocab;
    const uint64_t want = F_END + 4 * nt + 4 * V + get64(b + F_STREAM);
    uint8_t id[F_END];
    identity(m, id);
    if (memcmp(b + F_ARCH, id + F_ARCH, F_TOKENS - F_ARCH) != 0) {
        cli_error("generate", "--load-state %s: saved by another model (%.31s, %u layers, "
                  "vocab %u; this model: %.31s, %d layers, vocab %d)", path,
                  (const char *)b + F_ARCH, get32(b + F_LAYERS), get32(b + F_VOCAB),
                  (const char *)id + F_ARCH, m->hp->n_layers, m->hp->vocab);
        return -1;
    }
    if (get64(b + F_STREAM) > ((uint64_t)1 << 62) || (uint64_t)n < want) {
        cli_error("generate", "--load-state %s: truncated (%zu of %llu bytes)", path, n,
                  (unsigned long long)want);
        return -1;
    }
    if ((uint64_t)n > want || file_crc(b, (size_t)(want - get64(b + F_STREAM))) != get32(b + F_CRC)) {
        cli_error("generate", "--load-state %s: corrupted (checksum mismatch)", path);
        return -1;
    }
    return 0;
}

/* One line for a stream the session's cache refused. */
static void stream_error(const char *path, kvarn_llama_session *sess, const uint8_t *s,
                         size_t n, kvarn_status st)
{
    kvarn_seq_state_info info;
    const kvarn_cache *c = kvarn_llama_session_cache(sess);
    kvarn_cache_info ci;
    memset(&ci, 0, sizeof ci);
    kvarn_cache_get_info(c, &ci);
    if (st == KVARN_ERR_MISMATCH && kvarn_cache_seq_state_peek(c, s, n, &info) == st) {
        if (strcmp(info.mismatch, "format") == 0)
            cli_error("generate", "--load-state %s: saved with --kv-cache-dtype %s; this run "
                      "uses %s", path, info.format, ci.format.name);
        else if (strcmp(info.mismatch, "staging") == 0)
            cli_error("generate", "--load-state %s: saved with --kvarn-staging %s; this run "
                      "uses %s", path, kvarn_cache_staging_name(info.staging),
                      kvarn_cache_staging_name(ci.staging));
        else
            cli_error("generate", "--load-state %s: saved from a cache whose %s differs from "
                      "this run's", path, info.mismatch);
        return;
    }
    cli_error("generate", "--load-state %s: %s", path, kvarn_strerror(st));
}

int gen_state_load(const char *path, const cli_model *m, kvarn_llama_session *sess,
                   gen_saved *g)
{
    memset(g, 0, sizeof *g);
    size_t n = 0;
    uint8_t *b = read_all(path, &n);
    if (b == NULL || check_file(path, m, b, n)) {
        free(b);
        return -1;
    }
    const size_t nt = get32(b + F_TOKENS), V = (size_t)m->hp->vocab;
    g->n_tokens = (int)nt;
    g->tokens = malloc(4 * (nt ? nt : 1));
    g->logits = malloc(4 * V);
    g->rng = get64(b + F_RNG);
    g->stream_bytes = (size_t)get64(b + F_STREAM);
    if (g->tokens == NULL || g->logits == NULL) {
        cli_error("generate", "--load-state %s: out of memory", path);
        free(b);
        return -1;
    }
    for (size_t i = 0; i < nt; i++) g->tokens[i] = (int32_t)get32(b + F_END + 4 * i);
    for (size_t i = 0; i < V; i++) {
        const uint32_t u = get32(b + F_END + 4 * nt + 4 * i);
        memcpy(&g->logits[i], &u, 4);
    }
    const uint8_t *s = b + F_END + 4 * nt + 4 * V;
    kvarn_status st = kvarn_llama_session_load_state(sess, s, g->stream_bytes);
    if (st == KVARN_OK && kvarn_llama_session_pos(sess) != g->n_tokens) {
        const int pos = kvarn_llama_session_pos(sess);
        kvarn_llama_session_reset(sess);
        cli_error("generate", "--load-state %s: %d token ids for a sequence of %d tokens", path,
                  g->n_tokens, pos);
        free(b);
        return -1;
    }
    if (st != KVARN_OK) {
        stream_error(path, sess, s, g->stream_bytes, st);
        free(b);
        return -1;
    }
    free(b);
    return 0;
}

void gen_state_free(gen_saved *g)
{
    free(g->tokens);
    free(g->logits);
    memset(g, 0, sizeof *g);
}
