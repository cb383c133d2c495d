/*
 * tokenize_cli.c -- the C side of tests/cli/test_tokenizer.py (built by
 * that test against libkvarn.a; not part of the CMake build).
 *
 *   tokenize_cli MODEL.gguf lines      stdin: one text per line, as hex of
 *                                      its bytes, prefixed "S " (encode with
 *                                      KVARN_TOKENIZE_SPECIAL) or "P "
 *                                      (plain). stdout per line: the ids,
 *                                      space-separated, a tab, and the hex of
 *                                      decode(ids).
 *   tokenize_cli MODEL.gguf file PATH  encode the whole file once (plain);
 *                                      prints "<bytes> <tokens> <seconds>".
 *   tokenize_cli MODEL.gguf chat       prints the ids of a fixed two-message
 *                                      chat by both routes (text + SPECIAL,
 *                                      and kvarn_tokenizer_encode_chat), one
 *                                      line each.
 * Exit status 0 on success, 1 on any error (message on stderr).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvarn/gguf.h"
#include "kvarn/tokenizer.h"

static int hexval(int c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static int fail(const char *what, kvarn_status st)
{
    fprintf(stderr, "tokenize_cli: %s: %s\n", what, kvarn_strerror(st));
    return 1;
}

static void print_ids(const int32_t *ids, size_t n)
{
    for (size_t i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
    printf("\n");
}

static int run_lines(const kvarn_tokenizer *tok)
{
    size_t cap = 0;
    char *line = NULL;
    ssize_t got;
    while ((got = getline(&line, &cap, stdin)) >= 0) {
        while (got > 0 && (line[got - 1] == '\n' || line[got - 1] == '\r')) got--;
        if (got < 2) continue;
        unsigned flags = line[0] == 'S' ? KVARN_TOKENIZE_SPECIAL : 0;
        size_t nhex = (size_t)got - 2, n = nhex / 2;
        char *text = malloc(n + 1);
        if (!text) return fail("malloc", KVARN_ERR_NOMEM);
        for (size_t i = 0; i < n; i++) {
            int hi = hexval((unsigned char)line[2 + 2 * i]);
            int lo = hexval((unsigned char)line[3 + 2 * i]);
            if (hi < 0 || lo < 0) { free(text); return fail("bad hex", KVARN_ERR_INVALID_ARG); }
            text[i] = (char)(hi * 16 + lo);
        }
        int32_t *ids;
        size_t n_ids, out_len;
        kvarn_status st = kvarn_tokenizer_encode_alloc(tok, text, n, flags, &ids, &n_ids);
        free(text);
        if (st != KVARN_OK) return fail("encode", st);
        for (size_t i = 0; i < n_ids; i++) printf(i ? " %d" : "%d", ids[i]);
        st = kvarn_tokenizer_decode(tok, ids, n_ids, 0, NULL, 0, &out_len);
        char *dec = malloc(out_len + 1);
        if (dec && (st == KVARN_OK || st == KVARN_ERR_BUFFER_TOO_SMALL))
            st = kvarn_tokenizer_decode(tok, ids, n_ids, 0, dec, out_len, &out_len);
        free(ids);
        if (!dec || st != KVARN_OK) { free(dec); return fail("decode", st); }
        printf("\t");
        for (size_t i = 0; i < out_len; i++) printf("%02x", (unsigned char)dec[i]);
        printf("\n");
        free(dec);
    }
    free(line);
    return 0;
}

static int run_file(const kvarn_tokenizer *tok, const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) return fail(path, KVARN_ERR_IO);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc(size > 0 ? (size_t)size : 1);
    if (!buf || fread(buf, 1, (size_t)size, f) != (size_t)size) {
        fclose(f);
        free(buf);
        return fail(path, KVARN_ERR_IO);
    }
    fclose(f);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int32_t *ids;
    size_t n_ids;
    kvarn_status st = kvarn_tokenizer_encode_alloc(tok, buf, (size_t)size, 0, &ids, &n_ids);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    free(buf);
    if (st != KVARN_OK) return fail("encode", st);
    free(ids);
    printf("%ld %zu %.3f\n", size, n_ids,
           (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
    return 0;
}

static int run_chat(const kvarn_tokenizer *tok)
{
    const kvarn_chat_message msgs[] = {
        {"user", "What is the capital of France?"},
        {"assistant", "Paris, since 987."},
        {"user", "And of Spain?\n"},
    };
    char text[1024];
    size_t len, n_ids;
    kvarn_status st = kvarn_chat_format_chatml(msgs, 3, KVARN_CHAT_SMOLLM2_SYSTEM, 1,
                                               text, sizeof text, &len);
    if (st != KVARN_OK) return fail("chat format", st);
    int32_t *ids;
    if ((st = kvarn_tokenizer_encode_alloc(tok, text, len, KVARN_TOKENIZE_SPECIAL, &ids,
                                           &n_ids)) != KVARN_OK)
        return fail("encode", st);
    print_ids(ids, n_ids);
    free(ids);
    if ((st = kvarn_tokenizer_encode_chat(tok, msgs, 3, KVARN_CHAT_SMOLLM2_SYSTEM, 1, &ids,
                                          &n_ids)) != KVARN_OK)
        return fail("encode_chat", st);
    print_ids(ids, n_ids);
    free(ids);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: tokenize_cli MODEL.gguf lines|file PATH|chat\n");
        return 2;
    }
    char err[256];
    kvarn_gguf *g;
    kvarn_status st = kvarn_gguf_open(argv[1], &g, err, sizeof err);
    if (st != KVARN_OK) {
        fprintf(stderr, "tokenize_cli: %s: %s\n", argv[1], err);
        return 1;
    }
    kvarn_tokenizer *tok;
    st = kvarn_tokenizer_from_gguf(g, &tok);
    if (st != KVARN_OK) {
        kvarn_gguf_close(g);
        return fail("tokenizer", st);
    }
    int rc;
    if (!strcmp(argv[2], "lines")) rc = run_lines(tok);
    else if (!strcmp(argv[2], "file") && argc > 3) rc = run_file(tok, argv[3]);
    else if (!strcmp(argv[2], "chat")) rc = run_chat(tok);
    else rc = 2;
    kvarn_tokenizer_free(tok);
    kvarn_gguf_close(g);
    return rc;
}
