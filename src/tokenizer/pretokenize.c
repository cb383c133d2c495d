/*
 * pretokenize.c -- pre-tokenization of GPT-2-style byte-level BPE: split a
 * text into the pieces BPE then works on, with PCRE2 (8-bit, UTF mode, JIT
 * when available). See include/kvarn/tokenizer.h for the patterns and
 * docs/tokenizer.md for why \s is spelled out as a class.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tokenizer_internal.h"

/* Unicode White_Space (the set HF tokenizers' regex engine and Python's
 * str.isspace agree on), written out so that the pieces do not depend on
 * how this PCRE2 build reads \s (with PCRE2_UCP it would add U+180E). */
#define WS "\\t\\n\\x0B\\f\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}" \
           "\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"

/* 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static const char k_gpt2_pattern[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^" WS "\\p{L}\\p{N}]+"
    "|[" WS "]+(?![^" WS "])|[" WS "]+";

/* smollm: every numeric character on its own, before the GPT-2 pattern. */
static const char k_digit_pattern[] = "\\p{N}";

struct kvarn_pretok {
    kvarn_allocator alloc;  /* the tokenizer's (alloc.h) */
    pcre2_general_context *gctx; /* PCRE2's memory through alloc; NULL when
                                    alloc is malloc/free */
    int split_digits;       /* 1 for smollm */
    pcre2_code *words;      /* the GPT-2 pattern */
    pcre2_code *digits;     /* \p{N}, or NULL */
};

size_t kvarn_utf8_seq_len(const uint8_t *s, size_t n)
{
    if (n == 0) return 0;
    uint8_t c = s[0];
    if (c < 0x80) return 1;
    size_t len;
    uint8_t lo = 0x80, hi = 0xBF;      /* allowed range of the second byte */
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c == 0xE0) { len = 3; lo = 0xA0; }          /* no overlongs */
    else if (c >= 0xE1 && c <= 0xEC) len = 3;
    else if (c == 0xED) { len = 3; hi = 0x9F; }          /* no surrogates */
    else if (c >= 0xEE && c <= 0xEF) len = 3;
    else if (c == 0xF0) { len = 4; lo = 0x90; }          /* no overlongs */
    else if (c >= 0xF1 && c <= 0xF3) len = 4;
    else if (c == 0xF4) { len = 4; hi = 0x8F; }          /* <= U+10FFFF */
    else return 0;                     /* continuation byte, C0, C1, F5-FF */
    if (n < len) return 0;
    if (s[1] < lo || s[1] > hi) return 0;
    for (size_t i = 2; i < len; i++)
        if (s[i] < 0x80 || s[i] > 0xBF) return 0;
    return len;
}

void kvarn_gpt2_byte_chars(uint32_t cp[256])
{
    uint32_t next = 0x100;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) ||
                        (b >= 0xAE && b <= 0xFF);
        cp[b] = printable ? (uint32_t)b : next++;
    }
}

/* PCRE2's memory callbacks: data is the pretokenizer's kvarn_allocator. */
static void *pcre_alloc(PCRE2_SIZE bytes, void *data)
{
    return kvarn__malloc(data, bytes, 1);
}

static void pcre_free(void *ptr, void *data)
{
    kvarn__free(data, ptr);
}

static pcre2_code *compile(const char *pattern, pcre2_compile_context *cctx)
{
    int errcode;
    PCRE2_SIZE erroff;
    pcre2_code *code = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED,
                                     PCRE2_UTF | PCRE2_NO_UTF_CHECK, &errcode,
                                     &erroff, cctx);
    if (code) (void)pcre2_jit_compile(code, PCRE2_JIT_COMPLETE); /* optional */
    return code;
}

kvarn_status kvarn_pretok_create(const char *name, const kvarn_allocator *alloc,
                                 kvarn_pretok **out)
{
    if (!out) return KVARN_ERR_INVALID_ARG;
    *out = NULL;
    int split_digits;
    if (!name || !strcmp(name, "gpt2") || !strcmp(name, "gpt-2")) split_digits = 0;
    else if (!strcmp(name, "smollm")) split_digits = 1;
    else return KVARN_ERR_UNSUPPORTED;

    kvarn_pretok *p = kvarn__calloc(alloc, 1, sizeof *p);
    if (!p) return KVARN_ERR_NOMEM;
    p->alloc = *alloc;
    p->split_digits = split_digits;
    pcre2_compile_context *cctx = NULL;
    if (p->alloc.alloc) {
        p->gctx = pcre2_general_context_create(pcre_alloc, pcre_free, &p->alloc);
        if (p->gctx) cctx = pcre2_compile_context_create(p->gctx);
        if (!cctx) {
            kvarn_pretok_free(p);
            return KVARN_ERR_NOMEM;
        }
    }
    p->words = compile(k_gpt2_pattern, cctx);
    if (split_digits && p->words) p->digits = compile(k_digit_pattern, cctx);
    pcre2_compile_context_free(cctx);
    if (!p->words || (split_digits && !p->digits)) {
        kvarn_pretok_free(p);
        return KVARN_ERR_NOMEM;
    }
    *out = p;
    return KVARN_OK;
}

void kvarn_pretok_free(kvarn_pretok *p)
{
    if (!p) return;
    pcre2_code_free(p->words);
    pcre2_code_free(p->digits);
    pcre2_general_context_free(p->gctx);
    const kvarn_allocator a = p->alloc;
    kvarn__free(&a, p);
}

const char *kvarn_pretok_name(const kvarn_pretok *p)
{
    return p->split_digits ? "smollm" : "gpt2";
}

void *kvarn_pretok_scratch_create(const kvarn_pretok *p)
{
    /* Both patterns have no capture groups: one ovector pair suffices. */
    return pcre2_match_data_create(1, p->gctx);
}

void kvarn_pretok_scratch_free(void *scratch)
{
    pcre2_match_data_free((pcre2_match_data *)scratch);
}

/* GPT-2 pattern over s[0..n), a well-formed UTF-8 subject on its own (the
 * lookahead (?!\S) sees its end as the end of text, as HF's sequence of
 * pre-tokenizers does). Text no alternative matches (none should) becomes
 * a piece too, so no byte is ever lost. */
static kvarn_status split_words(const kvarn_pretok *p, pcre2_match_data *md,
                                const uint8_t *s, size_t n,
                                kvarn_pretok_piece_fn fn, void *ctx)
{
    size_t off = 0;
    while (off < n) {
        int rc = pcre2_match(p->words, s, n, off, PCRE2_NO_UTF_CHECK, md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) return fn(ctx, s + off, n - off);
        if (rc < 0) return rc == PCRE2_ERROR_NOMEMORY ? KVARN_ERR_NOMEM : KVARN_ERR_UNSUPPORTED;
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t b = ov[0], e = ov[1];
        kvarn_status st;
        if (b > off && (st = fn(ctx, s + off, b - off)) != KVARN_OK) return st;
        if (e == b) {          /* empty match: take one character */
            size_t l = kvarn_utf8_seq_len(s + b, n - b);
            e = b + (l ? l : 1);
        }
        if ((st = fn(ctx, s + b, e - b)) != KVARN_OK) return st;
        off = e;
    }
    return KVARN_OK;
}

/* One well-formed UTF-8 run. */
static kvarn_status split_valid(const kvarn_pretok *p, pcre2_match_data *md,
                                const uint8_t *s, size_t n,
                                kvarn_pretok_piece_fn fn, void *ctx)
{
    if (!p->split_digits) return split_words(p, md, s, n, fn, ctx);
    size_t off = 0;
    while (off < n) {
        int rc = pcre2_match(p->digits, s, n, off, PCRE2_NO_UTF_CHECK, md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) return rc == PCRE2_ERROR_NOMEMORY ? KVARN_ERR_NOMEM : KVARN_ERR_UNSUPPORTED;
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t b = ov[0], e = ov[1];
        if (e <= b) return KVARN_ERR_UNSUPPORTED; /* \p{N} is never empty */
        kvarn_status st;
        if (b > off && (st = split_words(p, md, s + off, b - off, fn, ctx)) != KVARN_OK)
            return st;
        if ((st = fn(ctx, s + b, e - b)) != KVARN_OK) return st;
        off = e;
    }
    return off < n ? split_words(p, md, s + off, n - off, fn, ctx) : KVARN_OK;
}

kvarn_status kvarn_pretok_split(const kvarn_pretok *p, void *scratch,
                                const char *text, size_t len,
                                kvarn_pretok_piece_fn fn, void *ctx)
{
    const uint8_t *s = (const uint8_t *)text;
    pcre2_match_data *md = scratch;
    size_t i = 0;
    while (i < len) {
        size_t run = i;
        size_t l;
        while (run < len && (l = kvarn_utf8_seq_len(s + run, len - run)) > 0)
            run += l;
        kvarn_status st;
        if (run > i && (st = split_valid(p, md, s + i, run - i, fn, ctx)) != KVARN_OK)
            return st;
        if (run < len && (st = fn(ctx, s + run, 1)) != KVARN_OK) /* bad byte */
            return st;
        i = run + 1;
    }
    return KVARN_OK;
}
