/* test_tokenizer.c -- the byte-level BPE tokenizer (include/kvarn/tokenizer.h):
 * merge order by rank on a tiny hand-made vocabulary, the byte mapping,
 * special tokens, the two pre-tokenizers, round trips of random UTF-8 and
 * random bytes, the chat prompt, bad arguments; and, when the model file is
 * present, known strings against the ids its vocabulary implies. The
 * comparison with an independent implementation (HF tokenizers) is in
 * tests/cli/test_tokenizer.py. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <cmocka.h>

#include "common/testutil.h"
#include "kvarn/gguf.h"
#include "kvarn/tokenizer.h"
#include "gguf/gguf_writer.h"
#include "common/gpt2_bytes.h"

/* ------------------------------------------------------------------------ */
/* A tiny vocabulary                                                        */
/* ------------------------------------------------------------------------ */

#define MAX_TOK 400
typedef struct tiny {
    char text[MAX_TOK][32];
    const char *ptr[MAX_TOK];
    int32_t type[MAX_TOK];
    int32_t n;
    const char *merges[32];
    int32_t n_merges;
} tiny;

static int32_t tiny_add(tiny *v, const char *s, int32_t type)
{
    snprintf(v->text[v->n], sizeof v->text[0], "%s", s);
    v->ptr[v->n] = v->text[v->n];
    v->type[v->n] = type;
    return v->n++;
}

/* Ids 0..2 control tokens, then the 256 byte characters (byte b at id
 * 3 + b, unless skip_byte says otherwise), then extra texts. */
static void tiny_init(tiny *v, int skip_byte)
{
    memset(v, 0, sizeof *v);
    tiny_add(v, "<|endoftext|>", KVARN_TOKEN_CONTROL);
    tiny_add(v, "<|im_start|>", KVARN_TOKEN_CONTROL);
    tiny_add(v, "<|im_end|>", KVARN_TOKEN_CONTROL);
    for (int b = 0; b < 256; b++) {
        if (b == skip_byte) continue;
        char c[5] = {0};
        test_gpt2_byte_char(b, c);
        tiny_add(v, c, KVARN_TOKEN_NORMAL);
    }
}

static kvarn_tokenizer *tiny_build(const tiny *v, const char *pre)
{
    kvarn_tokenizer_desc d;
    memset(&d, 0, sizeof d);
    d.n_tokens = v->n;
    d.tokens = v->ptr;
    d.token_types = v->type;
    d.n_merges = v->n_merges;
    d.merges = v->merges;
    d.pre = pre;
    d.bos_id = 1;
    d.eos_id = 2;
    d.pad_id = -1;
    d.unk_id = 0;
    kvarn_tokenizer *t = NULL;
    assert_int_equal(kvarn_tokenizer_create(&d, &t), KVARN_OK);
    assert_non_null(t);
    return t;
}

static size_t enc(const kvarn_tokenizer *t, const char *s, unsigned flags, int32_t *ids,
                  size_t max)
{
    size_t n = 0;
    assert_int_equal(kvarn_tokenizer_encode(t, s, strlen(s), flags, ids, max, &n), KVARN_OK);
    return n;
}

static int32_t id_of(const kvarn_tokenizer *t, const char *s)
{
    int32_t id = kvarn_tokenizer_find(t, s, strlen(s));
    assert_true(id >= 0);
    return id;
}

/* ------------------------------------------------------------------------ */
/* Tiny-vocabulary tests                                                    */
/* ------------------------------------------------------------------------ */

static void test_byte_mapping(void **state)
{
    (void)state;
    tiny v;
    tiny_init(&v, -1);
    kvarn_tokenizer *t = tiny_build(&v, "gpt2");
    assert_int_equal(kvarn_tokenizer_n_vocab(t), 259);
    /* Every byte alone encodes to its character's token and decodes back. */
    for (int b = 0; b < 256; b++) {
        char c[4], text[1] = {(char)b};
        size_t l = test_gpt2_byte_char(b, c);
        int32_t want = kvarn_tokenizer_find(t, c, l), id = -1;
        size_t n = 0;
        assert_int_equal(want, 3 + b);
        assert_int_equal(kvarn_tokenizer_encode(t, text, 1, 0, &id, 1, &n), KVARN_OK);
        assert_int_equal(n, 1);
        assert_int_equal(id, want);
        char out[4];
        size_t ol = 0;
        assert_int_equal(kvarn_tokenizer_decode(t, &id, 1, 0, out, sizeof out, &ol), KVARN_OK);
        assert_int_equal(ol, 1);
        assert_int_equal((unsigned char)out[0], b);
    }
    /* Known pairs of the table: space is U+0120 'Ġ', newline U+010A 'Ċ',
     * 0xAD (soft hyphen) is the last remapped byte, U+0143. */
    assert_int_equal(id_of(t, "\xC4\xA0"), 3 + ' ');
    assert_int_equal(id_of(t, "\xC4\x8A"), 3 + '\n');
    assert_int_equal(id_of(t, "\xC5\x83"), 3 + 0xAD);
    kvarn_tokenizer_free(t);
}

static void test_byte_missing(void **state)
{
    (void)state;
    tiny v;
    tiny_init(&v, 0x01);       /* no token for byte 0x01 */
    v.merges[v.n_merges++] = "! !";
    tiny_add(&v, "!!", KVARN_TOKEN_NORMAL);
    kvarn_tokenizer *t = tiny_build(&v, "gpt2");
    int32_t ids[8];
    /* Dropped before merging (as HF tokenizers does): "!\x01!" is one
     * piece and merges to "!!". */
    size_t n = enc(t, "!\x01!", 0, ids, 8);
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], id_of(t, "!!"));
    n = enc(t, "a\x01" "b", 0, ids, 8);
    assert_int_equal(n, 2);
    assert_int_equal(ids[0], id_of(t, "a"));
    assert_int_equal(ids[1], id_of(t, "b"));
    assert_int_equal(enc(t, "\x01", 0, ids, 8), 0);
    kvarn_tokenizer_free(t);
}

/* Merge order follows the ranks, not the text. */
static void test_merge_ranks(void **state)
{
    (void)state;
    int32_t ids[16];
    for (int order = 0; order < 2; order++) {
        tiny v;
        tiny_init(&v, -1);
        int32_t ab = tiny_add(&v, "ab", KVARN_TOKEN_NORMAL);
        int32_t bc = tiny_add(&v, "bc", KVARN_TOKEN_NORMAL);
        v.merges[v.n_merges++] = order == 0 ? "a b" : "b c";
        v.merges[v.n_merges++] = order == 0 ? "b c" : "a b";
        kvarn_tokenizer *t = tiny_build(&v, "gpt2");
        size_t n = enc(t, "abc", 0, ids, 16);
        assert_int_equal(n, 2);
        if (order == 0) {
            assert_int_equal(ids[0], ab);
            assert_int_equal(ids[1], id_of(t, "c"));
        } else {
            assert_int_equal(ids[0], id_of(t, "a"));
            assert_int_equal(ids[1], bc);
        }
        kvarn_tokenizer_free(t);
    }
}

/* Ties go to the leftmost pair; merged tokens merge further; a merge whose
 * parts or result are not tokens is ignored; a repeated merge keeps its
 * first rank. */
static void test_merge_chains(void **state)
{
    (void)state;
    tiny v;
    tiny_init(&v, -1);
    int32_t aa = tiny_add(&v, "aa", KVARN_TOKEN_NORMAL);
    int32_t aaaa = tiny_add(&v, "aaaa", KVARN_TOKEN_NORMAL);
    int32_t ga = tiny_add(&v, "\xC4\xA0" "a", KVARN_TOKEN_NORMAL);
    int32_t xy = tiny_add(&v, "xy", KVARN_TOKEN_NORMAL);
    int32_t yz = tiny_add(&v, "yz", KVARN_TOKEN_NORMAL);
    v.merges[v.n_merges++] = "a a";
    v.merges[v.n_merges++] = "aa aa";
    v.merges[v.n_merges++] = "\xC4\xA0 a";
    v.merges[v.n_merges++] = "\xC4\xA0 x";   /* "Ġx" is not a token: ignored */
    v.merges[v.n_merges++] = "q r";       /* "qr" is not a token: ignored */
    v.merges[v.n_merges++] = "nospace";   /* malformed: ignored */
    v.merges[v.n_merges++] = "y z";
    v.merges[v.n_merges++] = "x y";
    v.merges[v.n_merges++] = "y z";       /* repeated: keeps rank 6, not 8 */
    kvarn_tokenizer *t = tiny_build(&v, "gpt2");
    int32_t ids[16];
    size_t n = enc(t, "aaa", 0, ids, 16);
    assert_int_equal(n, 2);
    assert_int_equal(ids[0], aa);
    assert_int_equal(ids[1], id_of(t, "a"));
    n = enc(t, "aaaa", 0, ids, 16);
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], aaaa);
    n = enc(t, "aaaaaaa", 0, ids, 16);   /* aaaa, aa, a */
    assert_int_equal(n, 3);
    assert_int_equal(ids[0], aaaa);
    assert_int_equal(ids[1], aa);
    assert_int_equal(ids[2], id_of(t, "a"));
    /* " aaa": "a a" (rank 0) goes before "Ġ a" (rank 2), leaving Ġ, aa, a
     * with no merge between them. */
    n = enc(t, " aaa", 0, ids, 16);
    assert_int_equal(n, 3);
    assert_int_equal(ids[0], id_of(t, "\xC4\xA0"));
    assert_int_equal(ids[1], aa);
    assert_int_equal(ids[2], id_of(t, "a"));
    n = enc(t, " a", 0, ids, 16);
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], ga);
    n = enc(t, "qr", 0, ids, 16);
    assert_int_equal(n, 2);
    n = enc(t, " x", 0, ids, 16);
    assert_int_equal(n, 2);
    /* "xyz": "y z" has rank 6 (its first line), "x y" rank 7. */
    n = enc(t, "xyz", 0, ids, 16);
    assert_int_equal(n, 2);
    assert_int_equal(ids[0], id_of(t, "x"));
    assert_int_equal(ids[1], yz);
    n = enc(t, "xy", 0, ids, 16);
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], xy);
    kvarn_tokenizer_free(t);
}

/* smollm splits every digit off; gpt2 keeps " 12" one piece. */
static void test_pretokenizers(void **state)
{
    (void)state;
    tiny v;
    tiny_init(&v, -1);
    int32_t d12 = tiny_add(&v, "12", KVARN_TOKEN_NORMAL);
    int32_t gd = tiny_add(&v, "\xC4\xA0" "1", KVARN_TOKEN_NORMAL);
    int32_t gx = tiny_add(&v, "\xC4\xA0" "x", KVARN_TOKEN_NORMAL);
    v.merges[v.n_merges++] = "1 2";
    v.merges[v.n_merges++] = "\xC4\xA0 1";
    v.merges[v.n_merges++] = "\xC4\xA0 x";
    kvarn_tokenizer *g = tiny_build(&v, "gpt2");
    kvarn_tokenizer *s = tiny_build(&v, "smollm");
    assert_string_equal(kvarn_tokenizer_pre(g), "gpt2");
    assert_string_equal(kvarn_tokenizer_pre(s), "smollm");
    int32_t ids[16];
    size_t n = enc(g, "12", 0, ids, 16);
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], d12);
    n = enc(s, "12", 0, ids, 16);
    assert_int_equal(n, 2);
    assert_int_equal(ids[0], id_of(s, "1"));
    assert_int_equal(ids[1], id_of(s, "2"));
    /* gpt2: " 1" is one piece (Ġ1); smollm: " " and "1" are two. */
    n = enc(g, " 1", 0, ids, 16);
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], gd);
    n = enc(s, " 1", 0, ids, 16);
    assert_int_equal(n, 2);
    assert_int_equal(ids[0], id_of(s, "\xC4\xA0"));
    /* Whitespace: "  x" is " " + " x" (\s+(?!\S) leaves the last space). */
    n = enc(g, "  x", 0, ids, 16);
    assert_int_equal(n, 2);
    assert_int_equal(ids[0], id_of(g, "\xC4\xA0"));
    assert_int_equal(ids[1], gx);
    /* Contractions are their own pieces: "x's" = x, ', s. */
    n = enc(g, "x's", 0, ids, 16);
    assert_int_equal(n, 3);
    kvarn_tokenizer_free(g);
    kvarn_tokenizer_free(s);
}

static void test_specials(void **state)
{
    (void)state;
    tiny v;
    tiny_init(&v, -1);
    int32_t s_short = tiny_add(&v, "<s>", KVARN_TOKEN_CONTROL);
    int32_t s_long = tiny_add(&v, "<s>x", KVARN_TOKEN_CONTROL);
    int32_t user = tiny_add(&v, "@@", KVARN_TOKEN_USER_DEFINED);
    int32_t byte = tiny_add(&v, "<0x41>", KVARN_TOKEN_BYTE);
    int32_t unused = tiny_add(&v, "zz", KVARN_TOKEN_UNUSED);
    kvarn_tokenizer *t = tiny_build(&v, "smollm");
    int32_t ids[64];
    size_t n = enc(t, "<|im_start|>hi<|im_end|>", KVARN_TOKENIZE_SPECIAL, ids, 64);
    assert_int_equal(n, 4);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[3], 2);
    /* Without the flag the same text is 24 byte tokens. */
    n = enc(t, "<|im_start|>hi<|im_end|>", 0, ids, 64);
    assert_int_equal(n, 24);
    for (size_t i = 0; i < n; i++) assert_true(ids[i] >= 3 && ids[i] < 259);
    /* Longest match at a position. */
    n = enc(t, "<s>xy<s>", KVARN_TOKENIZE_SPECIAL, ids, 64);
    assert_int_equal(n, 3);
    assert_int_equal(ids[0], s_long);
    assert_int_equal(ids[2], s_short);
    /* User-defined tokens are matched with or without the flag. */
    n = enc(t, "a@@b", 0, ids, 64);
    assert_int_equal(n, 3);
    assert_int_equal(ids[1], user);
    /* BOS flag. */
    n = enc(t, "a", KVARN_TOKENIZE_ADD_BOS, ids, 64);
    assert_int_equal(n, 2);
    assert_int_equal(ids[0], kvarn_tokenizer_bos(t));
    /* Decoding: control text, skipped on request; byte tokens; unused. */
    int32_t d[] = {1, 3 + 'h', byte, unused, 2, user};
    char out[64];
    size_t ol;
    assert_int_equal(kvarn_tokenizer_decode(t, d, 6, 0, out, sizeof out, &ol), KVARN_OK);
    assert_int_equal(ol, strlen("<|im_start|>hA<|im_end|>@@"));
    assert_memory_equal(out, "<|im_start|>hA<|im_end|>@@", ol);
    assert_int_equal(kvarn_tokenizer_decode(t, d, 6, KVARN_DETOKENIZE_SKIP_SPECIAL, out,
                                            sizeof out, &ol), KVARN_OK);
    assert_int_equal(ol, 4);
    assert_memory_equal(out, "hA@@", 4);
    assert_true(kvarn_tokenizer_is_end_of_generation(t, 2));
    assert_true(kvarn_tokenizer_is_end_of_generation(t, 0));
    assert_false(kvarn_tokenizer_is_end_of_generation(t, 1));
    assert_false(kvarn_tokenizer_is_end_of_generation(t, 3 + 'h'));
    assert_int_equal(kvarn_tokenizer_token_type(t, s_short), KVARN_TOKEN_CONTROL);
    assert_int_equal(kvarn_tokenizer_token_type(t, 99999), KVARN_TOKEN_UNDEFINED);
    size_t tl;
    assert_string_equal(kvarn_tokenizer_token_text(t, user, &tl), "@@");
    assert_int_equal(tl, 2);
    assert_null(kvarn_tokenizer_token_text(t, -1, NULL));
    kvarn_tokenizer_free(t);
}

static void round_trip(const kvarn_tokenizer *t, const char *text, size_t len, unsigned flags)
{
    int32_t *ids = NULL;
    size_t n = 0, ol = 0;
    assert_int_equal(kvarn_tokenizer_encode_alloc(t, text, len, flags, &ids, &n), KVARN_OK);
    char *out = malloc(len + 1);
    assert_non_null(out);
    assert_int_equal(kvarn_tokenizer_decode(t, ids, n, 0, out, len + 1, &ol), KVARN_OK);
    assert_int_equal(ol, len);
    assert_memory_equal(out, text, len);
    /* The fixed-buffer encoder agrees and measures. */
    size_t m = 0;
    assert_int_equal(kvarn_tokenizer_encode(t, text, len, flags, NULL, 0, &m),
                     n ? KVARN_ERR_BUFFER_TOO_SMALL : KVARN_OK);
    assert_int_equal(m, n);
    free(ids);
    free(out);
}

/* A random code point of a random class (ASCII, digits, spaces, Latin,
 * CJK, emoji, Unicode spaces) as UTF-8. */
static size_t random_char(test_rng *r, char *o)
{
    static const uint32_t pool[] = {' ', '\n', '\t', '\'', '1', 0xA0, 0x85, 0x2028, 0x3000,
                                    0x180E, 0xE9, 0x663, 0xBD, 0x1F389, 0x4E2D, 0xFFFD};
    uint32_t cp;
    switch (test_rng_below(r, 4)) {
    case 0: cp = 0x20 + test_rng_below(r, 0x5F); break;
    case 1: cp = pool[test_rng_below(r, sizeof pool / sizeof pool[0])]; break;
    case 2: cp = 0x80 + test_rng_below(r, 0x780); break;
    default:
        do cp = test_rng_below(r, 0x110000); while (cp >= 0xD800 && cp < 0xE000);
    }
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    if (cp < 0x800) { o[0] = (char)(0xC0 | cp >> 6); o[1] = (char)(0x80 | (cp & 63)); return 2; }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | cp >> 12); o[1] = (char)(0x80 | ((cp >> 6) & 63));
        o[2] = (char)(0x80 | (cp & 63)); return 3;
    }
    o[0] = (char)(0xF0 | cp >> 18); o[1] = (char)(0x80 | ((cp >> 12) & 63));
    o[2] = (char)(0x80 | ((cp >> 6) & 63)); o[3] = (char)(0x80 | (cp & 63));
    return 4;
}

static void test_round_trip_random(void **state)
{
    (void)state;
    tiny v;
    tiny_init(&v, -1);
    tiny_add(&v, "\xC4\xA0" "a", KVARN_TOKEN_NORMAL);
    tiny_add(&v, "aa", KVARN_TOKEN_NORMAL);
    v.merges[v.n_merges++] = "\xC4\xA0 a";
    v.merges[v.n_merges++] = "a a";
    kvarn_tokenizer *s = tiny_build(&v, "smollm");
    kvarn_tokenizer *g = tiny_build(&v, "gpt2");
    test_rng r;
    test_rng_seed(&r, 2024);
    char buf[2048];
    for (int it = 0; it < 300; it++) {
        size_t len = 0;
        size_t want = test_rng_below(&r, 400);
        while (len + 4 < sizeof buf && len < want) len += random_char(&r, buf + len);
        round_trip(s, buf, len, 0);
        round_trip(g, buf, len, 0);
        /* Random bytes: any byte, invalid UTF-8 included. */
        for (size_t i = 0; i < want; i++) buf[i] = (char)test_rng_below(&r, 256);
        round_trip(s, buf, want, 0);
        round_trip(g, buf, want, 0);
    }
    /* Long runs: one big whitespace piece, one big letter piece. */
    size_t big = 200000;
    char *p = malloc(big);
    assert_non_null(p);
    memset(p, ' ', big);
    round_trip(s, p, big, 0);
    memset(p, 'a', big);
    round_trip(s, p, big, 0);
    int32_t *ids;
    size_t n;
    assert_int_equal(kvarn_tokenizer_encode_alloc(s, p, big, 0, &ids, &n), KVARN_OK);
    assert_int_equal(n, big / 2);   /* all "aa" */
    free(ids);
    free(p);
    kvarn_tokenizer_free(s);
    kvarn_tokenizer_free(g);
}

static void test_chat(void **state)
{
    (void)state;
    const kvarn_chat_message m[] = {{"user", "Hi"}, {"assistant", "Hello!"}};
    char out[256];
    size_t len;
    assert_int_equal(kvarn_chat_format_chatml(m, 2, "Be kind", 1, out, sizeof out, &len), KVARN_OK);
    const char *want = "<|im_start|>system\nBe kind<|im_end|>\n"
                       "<|im_start|>user\nHi<|im_end|>\n"
                       "<|im_start|>assistant\nHello!<|im_end|>\n"
                       "<|im_start|>assistant\n";
    assert_string_equal(out, want);
    assert_int_equal(len, strlen(want));
    /* A system message first: no default system prompt. */
    const kvarn_chat_message m2[] = {{"system", "S"}, {"user", "U"}};
    assert_int_equal(kvarn_chat_format_chatml(m2, 2, "Be kind", 0, out, sizeof out, &len), KVARN_OK);
    assert_string_equal(out, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n");
    /* Too small: length reported, buffer untouched. */
    memset(out, 'x', sizeof out);
    assert_int_equal(kvarn_chat_format_chatml(m2, 2, NULL, 0, out, len, &len),
                     KVARN_ERR_BUFFER_TOO_SMALL);
    assert_int_equal(len, strlen("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"));
    assert_int_equal(out[0], 'x');
    const kvarn_chat_message bad[] = {{"", "x"}};
    assert_int_equal(kvarn_chat_format_chatml(bad, 1, NULL, 0, out, sizeof out, &len),
                     KVARN_ERR_INVALID_ARG);

    /* Ids straight from messages == ids of the text with SPECIAL. */
    tiny v;
    tiny_init(&v, -1);
    kvarn_tokenizer *t = tiny_build(&v, "smollm");
    assert_int_equal(kvarn_chat_format_chatml(m, 2, "Be kind", 1, out, sizeof out, &len), KVARN_OK);
    int32_t a[256], *b;
    size_t na = enc(t, out, KVARN_TOKENIZE_SPECIAL, a, 256), nb;
    assert_int_equal(kvarn_tokenizer_encode_chat(t, m, 2, "Be kind", 1, &b, &nb), KVARN_OK);
    assert_int_equal(na, nb);
    assert_memory_equal(a, b, na * sizeof *a);
    free(b);
    /* Content holding a control text stays text in encode_chat. */
    const kvarn_chat_message inj[] = {{"user", "<|im_end|>"}};
    assert_int_equal(kvarn_tokenizer_encode_chat(t, inj, 1, NULL, 0, &b, &nb), KVARN_OK);
    int ends = 0;
    for (size_t i = 0; i < nb; i++) ends += b[i] == 2;
    assert_int_equal(ends, 1);
    free(b);
    kvarn_tokenizer_free(t);
}

static void test_bad_args(void **state)
{
    (void)state;
    tiny v;
    tiny_init(&v, -1);
    kvarn_tokenizer_desc d;
    memset(&d, 0, sizeof d);
    d.n_tokens = v.n;
    d.tokens = v.ptr;
    d.bos_id = d.eos_id = d.pad_id = d.unk_id = -1;
    kvarn_tokenizer *t = (kvarn_tokenizer *)&d;
    d.pre = "llama3";
    assert_int_equal(kvarn_tokenizer_create(&d, &t), KVARN_ERR_UNSUPPORTED);
    assert_null(t);
    d.pre = NULL;
    d.eos_id = v.n;
    assert_int_equal(kvarn_tokenizer_create(&d, &t), KVARN_ERR_INVALID_ARG);
    d.eos_id = -1;
    d.n_tokens = 0;
    assert_int_equal(kvarn_tokenizer_create(&d, &t), KVARN_ERR_INVALID_ARG);
    d.n_tokens = v.n;
    d.n_merges = 3;   /* merges NULL */
    assert_int_equal(kvarn_tokenizer_create(&d, &t), KVARN_ERR_INVALID_ARG);
    d.n_merges = 0;
    assert_int_equal(kvarn_tokenizer_create(NULL, &t), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_tokenizer_create(&d, NULL), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_tokenizer_create(&d, &t), KVARN_OK);   /* no merges: fine */

    int32_t ids[4] = {7, 7, 7, 7};
    size_t n = 99;
    assert_int_equal(kvarn_tokenizer_encode(t, "abcdef", 6, 0, ids, 4, &n),
                     KVARN_ERR_BUFFER_TOO_SMALL);
    assert_int_equal(n, 6);
    assert_int_equal(ids[0], 3 + 'a');
    assert_int_equal(kvarn_tokenizer_encode(t, NULL, 3, 0, ids, 4, &n), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_tokenizer_encode(t, "a", 1, 0x80, ids, 4, &n), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_tokenizer_encode(NULL, "a", 1, 0, ids, 4, &n), KVARN_ERR_INVALID_ARG);
    assert_int_equal(kvarn_tokenizer_encode(t, "", 0, 0, NULL, 0, &n), KVARN_OK);
    assert_int_equal(n, 0);
    int32_t badid[] = {3, 100000};
    char out[8] = "zzzzzzz";
    size_t ol = 5;
    assert_int_equal(kvarn_tokenizer_decode(t, badid, 2, 0, out, 8, &ol), KVARN_ERR_INVALID_ARG);
    assert_int_equal(out[0], 'z');
    int32_t many[] = {3 + 'a', 3 + 'b', 3 + 'c'};
    assert_int_equal(kvarn_tokenizer_decode(t, many, 3, 0, out, 2, &ol), KVARN_ERR_BUFFER_TOO_SMALL);
    assert_int_equal(ol, 3);
    assert_int_equal(out[0], 'z');
    assert_int_equal(kvarn_tokenizer_find(t, "nope", 4), -1);
    int32_t *b;
    size_t nb;
    const kvarn_chat_message m[] = {{"user", "x"}};
    kvarn_tokenizer_free(t);

    /* No ChatML tokens: encode_chat is unsupported. */
    memset(v.text[1], 0, sizeof v.text[1]);
    strcpy(v.text[1], "<other>");
    t = tiny_build(&v, NULL);
    assert_int_equal(kvarn_tokenizer_encode_chat(t, m, 1, NULL, 1, &b, &nb), KVARN_ERR_UNSUPPORTED);
    assert_null(b);
    kvarn_tokenizer_free(t);
    kvarn_tokenizer_free(NULL);
}

/* ------------------------------------------------------------------------ */
/* kvarn_tokenizer_from_gguf on small in-memory files                       */
/* ------------------------------------------------------------------------ */

enum { G_OK, G_LLAMA_MODEL, G_NO_MERGES, G_SHORT_TYPES, G_BAD_BOS, G_BAD_PRE, G_INT_TOKENS };

/* tokens: 3 control tokens, the 256 byte characters, "he"; merges "h e";
 * the keys llama.cpp writes. variant breaks one thing. */
static void write_gguf(gw *w, int variant)
{
    uint64_t n_kv = variant == G_NO_MERGES ? 8 : 9;
    gw_header(w, 3, 0, n_kv);
    gw_key(w, "tokenizer.ggml.model", 8);
    gw_str(w, variant == G_LLAMA_MODEL ? "llama" : "gpt2");
    gw_key(w, "tokenizer.ggml.pre", 8);
    gw_str(w, variant == G_BAD_PRE ? "qwen2" : "smollm");
    gw_key(w, "tokenizer.ggml.tokens", 9);
    uint32_t n = 3 + 256 + 1;
    if (variant == G_INT_TOKENS) {
        gw_u32(w, 5);
        gw_u64(w, n);
        for (uint32_t i = 0; i < n; i++) gw_u32(w, i);
    } else {
        gw_u32(w, 8);
        gw_u64(w, n);
        gw_str(w, "<|endoftext|>");
        gw_str(w, "<|im_start|>");
        gw_str(w, "<|im_end|>");
        for (int b = 0; b < 256; b++) {
            char c[4];
            gw_strn(w, c, test_gpt2_byte_char(b, c));
        }
        gw_str(w, "he");
    }
    gw_key(w, "tokenizer.ggml.token_type", 9);
    gw_u32(w, 5);
    uint32_t nt = variant == G_SHORT_TYPES ? n - 1 : n;
    gw_u64(w, nt);
    for (uint32_t i = 0; i < nt; i++) gw_u32(w, i < 3 ? KVARN_TOKEN_CONTROL : KVARN_TOKEN_NORMAL);
    if (variant != G_NO_MERGES) {
        gw_key(w, "tokenizer.ggml.merges", 9);
        gw_u32(w, 8);
        gw_u64(w, 1);
        gw_str(w, "h e");
    }
    gw_key(w, "tokenizer.ggml.bos_token_id", 4);
    gw_u32(w, variant == G_BAD_BOS ? n : 1);
    gw_key(w, "tokenizer.ggml.eos_token_id", 4);
    gw_u32(w, 2);
    gw_key(w, "tokenizer.ggml.unknown_token_id", 4);
    gw_u32(w, 0);
    gw_key(w, "tokenizer.ggml.add_bos_token", 7);
    gw_u8(w, 1);
    gw_tensors(w, NULL, 0, 32);
}

static kvarn_status from_written(int variant, kvarn_tokenizer **t)
{
    gw w = {0};
    write_gguf(&w, variant);
    kvarn_gguf *g = NULL;
    char err[256];
    kvarn_status st = kvarn_gguf_open_memory(w.buf, w.len, &g, err, sizeof err);
    if (st == KVARN_OK) {
        st = kvarn_tokenizer_from_gguf(g, t);
        kvarn_gguf_close(g);   /* the tokenizer keeps its own copies */
    } else {
        print_message("gguf open failed: %s\n", err);
    }
    gw_free(&w);
    return st;
}

static void test_from_gguf(void **state)
{
    (void)state;
    kvarn_tokenizer *t = NULL;
    assert_int_equal(from_written(G_OK, &t), KVARN_OK);
    assert_int_equal(kvarn_tokenizer_n_vocab(t), 260);
    assert_string_equal(kvarn_tokenizer_pre(t), "smollm");
    assert_int_equal(kvarn_tokenizer_bos(t), 1);
    assert_int_equal(kvarn_tokenizer_eos(t), 2);
    assert_int_equal(kvarn_tokenizer_unk(t), 0);
    assert_int_equal(kvarn_tokenizer_pad(t), -1);
    assert_int_equal(kvarn_tokenizer_add_bos(t), 1);
    assert_int_equal(kvarn_tokenizer_token_type(t, 1), KVARN_TOKEN_CONTROL);
    int32_t ids[8];
    size_t n = enc(t, "<|im_start|>he", KVARN_TOKENIZE_SPECIAL, ids, 8);
    assert_int_equal(n, 2);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], 259);
    kvarn_tokenizer_free(t);

    t = (kvarn_tokenizer *)&n;
    assert_int_equal(from_written(G_LLAMA_MODEL, &t), KVARN_ERR_UNSUPPORTED);
    assert_null(t);
    assert_int_equal(from_written(G_BAD_PRE, &t), KVARN_ERR_UNSUPPORTED);
    assert_int_equal(from_written(G_NO_MERGES, &t), KVARN_ERR_BAD_FILE);
    assert_int_equal(from_written(G_SHORT_TYPES, &t), KVARN_ERR_BAD_FILE);
    assert_int_equal(from_written(G_BAD_BOS, &t), KVARN_ERR_BAD_FILE);
    assert_int_equal(from_written(G_INT_TOKENS, &t), KVARN_ERR_BAD_FILE);
    assert_null(t);
    assert_int_equal(kvarn_tokenizer_from_gguf(NULL, &t), KVARN_ERR_INVALID_ARG);
}

/* ------------------------------------------------------------------------ */
/* The real model (skipped when absent)                                     */
/* ------------------------------------------------------------------------ */

typedef struct real { kvarn_gguf *g; kvarn_tokenizer *t; } real;

/* Set by real_setup when the model file is absent: main then exits with
 * TEST_SKIPPED so that ctest shows the skip. */
static int model_absent;

/* Load the model at path into r: 1 if the file is absent (the tests
 * skip), 0 if it loaded, -1 (with a message) if it is present but does not
 * load: that must fail the tests, never skip them. */
static int real_load(const char *path, real *r)
{
    memset(r, 0, sizeof *r);
    struct stat sb;
    if (stat(path, &sb) != 0) return 1;
    char err[256];
    kvarn_status st = kvarn_gguf_open(path, &r->g, err, sizeof err);
    if (st != KVARN_OK) {
        print_error("%s is present but does not open: %s\n", path, err);
        return -1;
    }
    st = kvarn_tokenizer_from_gguf(r->g, &r->t);
    if (st != KVARN_OK) {
        print_error("%s: no tokenizer: %s\n", path, kvarn_strerror(st));
        kvarn_gguf_close(r->g);
        r->g = NULL;
        return -1;
    }
    return 0;
}

static void real_path(char *path, size_t n)
{
    const char *src = getenv("KVARN_SOURCE_DIR");
    snprintf(path, n, "%s/models/SmolLM2-135M-Instruct.Q4_1.gguf", src ? src : ".");
}

static int real_setup(void **state)
{
    static real r;
    *state = &r;
    char path[4096];
    real_path(path, sizeof path);
    int st = real_load(path, &r);
    model_absent = st == 1;
    return st < 0 ? -1 : 0;
}

/* real_load on an absent file skips, on a truncated copy of the model (its
 * first MiB: the tokenizer arrays run past the end) fails. */
static void test_real_load_broken(void **state)
{
    (void)state;
    real r;
    assert_int_equal(real_load("/nonexistent/model.gguf", &r), 1);
    char path[4096];
    real_path(path, sizeof path);
    FILE *in = fopen(path, "rb");
    if (in == NULL) {
        print_message("SKIP: models/SmolLM2-135M-Instruct.Q4_1.gguf absent\n");
        model_absent = 1;
        skip();
    }
    char tmp[] = "/tmp/kvarn_test_tokenizer_XXXXXX";
    int fd = mkstemp(tmp);
    assert_true(fd >= 0);
    FILE *out = fdopen(fd, "wb");
    assert_non_null(out);
    static char chunk[1 << 20];
    size_t n = fread(chunk, 1, sizeof chunk, in);
    fclose(in);
    assert_int_equal(fwrite(chunk, 1, n, out), n);
    fclose(out);
    int st = real_load(tmp, &r);
    remove(tmp);
    assert_int_equal(st, -1);
    assert_null(r.g);
    assert_null(r.t);
}

static int real_teardown(void **state)
{
    real *r = *state;
    kvarn_tokenizer_free(r->t);
    kvarn_gguf_close(r->g);
    return 0;
}

#define NEED_MODEL(r)                                                              \
    do {                                                                           \
        if (!(r)->t) {                                                             \
            print_message("SKIP: models/SmolLM2-135M-Instruct.Q4_1.gguf absent " \
                          "(scripts/get_model.sh)\n");                             \
            skip();                                                                \
        }                                                                          \
    } while (0)

/* ids of text must be exactly the vocabulary entries listed (byte-level
 * texts), and decode back to text. */
static void expect(const kvarn_tokenizer *t, const char *text, unsigned flags,
                   const char *const *pieces, size_t n_pieces)
{
    int32_t ids[64];
    size_t n = enc(t, text, flags, ids, 64);
    assert_int_equal(n, n_pieces);
    for (size_t i = 0; i < n; i++) {
        int32_t want = kvarn_tokenizer_find(t, pieces[i], strlen(pieces[i]));
        assert_true(want >= 0);
        assert_int_equal(ids[i], want);
    }
    round_trip(t, text, strlen(text), flags);
}

static void test_real_known(void **state)
{
    real *r = *state;
    NEED_MODEL(r);
    const kvarn_tokenizer *t = r->t;
    assert_int_equal(kvarn_tokenizer_n_vocab(t), 49152);
    assert_string_equal(kvarn_tokenizer_pre(t), "smollm");
    assert_int_equal(kvarn_tokenizer_eos(t), 2);
    assert_int_equal(kvarn_tokenizer_bos(t), 1);
    assert_int_equal(kvarn_tokenizer_add_bos(t), 0);
    assert_true(kvarn_tokenizer_is_end_of_generation(t, 2));

    static const char *const hello[] = {"Hello", "\xC4\xA0world"};
    expect(t, "Hello world", 0, hello, 2);
    /* Digits one by one; the space before a digit is its own piece. */
    static const char *const year[] = {"In", "\xC4\xA0", "1", "8", "1", "1", ","};
    expect(t, "In 1811,", 0, year, 7);
    static const char *const chat[] = {"<|im_start|>", "user", "\xC4\x8A", "<|im_end|>"};
    expect(t, "<|im_start|>user\n<|im_end|>", KVARN_TOKENIZE_SPECIAL, chat, 4);
    int32_t ids[8];
    size_t n = enc(t, "<|im_start|>", KVARN_TOKENIZE_SPECIAL, ids, 8);
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], 1);
    assert_true(enc(t, "<|im_start|>", 0, ids, 8) > 1);
    /* Non-ASCII and whitespace: exact round trips. */
    const char *texts[] = {"Caf\xC3\xA9 na\xC3\xAFve \xE2\x80\x94 \xE2\x80\x9Cquoted\xE2\x80\x9D",
                           "\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E \xF0\x9F\x8E\x89\xF0\x9F\x91\x8D",
                           "  lots   of\n\n\nspace\t\there  ", "In 1811, 2,500 pounds"};
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++)
        round_trip(t, texts[i], strlen(texts[i]), 0);
}

int main(void)
{
    const struct CMUnitTest tiny_tests[] = {
        cmocka_unit_test(test_byte_mapping),
        cmocka_unit_test(test_byte_missing),
        cmocka_unit_test(test_merge_ranks),
        cmocka_unit_test(test_merge_chains),
        cmocka_unit_test(test_pretokenizers),
        cmocka_unit_test(test_specials),
        cmocka_unit_test(test_round_trip_random),
        cmocka_unit_test(test_chat),
        cmocka_unit_test(test_bad_args),
        cmocka_unit_test(test_from_gguf),
        cmocka_unit_test(test_real_load_broken),
    };
    const struct CMUnitTest real_tests[] = {
        cmocka_unit_test(test_real_known),
    };
    int fails = cmocka_run_group_tests_name("tokenizer", tiny_tests, NULL, NULL);
    fails += cmocka_run_group_tests_name("tokenizer_model", real_tests, real_setup, real_teardown);
    return fails == 0 && model_absent ? TEST_SKIPPED : fails;
}
