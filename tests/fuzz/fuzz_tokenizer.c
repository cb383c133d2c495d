/* fuzz_tokenizer.c -- fuzz target for the byte-level BPE tokenizer: any
 * bytes through encode -> decode with a tiny hand-made vocabulary.
 *
 * Input layout (any bytes are valid input):
 *   flags  1 byte: bit 0 pre-tokenizer "smollm" (else "gpt2"),
 *                  bit 1 encode with KVARN_TOKENIZE_SPECIAL,
 *                  bit 2 encode with KVARN_TOKENIZE_ADD_BOS,
 *                  bit 3 a vocabulary without byte 0xFF's token
 *   text   the rest: the text to encode (invalid UTF-8, NULs, control
 *          token texts all allowed)
 * An empty input encodes the empty text with flags 0.
 *
 * Checked on every input: encode succeeds and gives ids inside the
 * vocabulary; the fixed-buffer encoder gives the same ids, and reports
 * BUFFER_TOO_SMALL with the full count one id short; without SPECIAL no
 * control token appears; decode gives back exactly the text (with BOS's text
 * first when asked, and without 0xFF bytes when the vocabulary lacks them);
 * decoding with SKIP_SPECIAL is never longer.
 *
 * kvarn_fuzz_tokenizer returns 0, or a negative number naming the broken
 * invariant. Built by tests/fuzz/test_fuzz_tokenizer.c (cmocka, ctest) and,
 * with -DKVARN_LIBFUZZER, as a libFuzzer target (see tests/fuzz/README.md). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvarn/tokenizer.h"
#include "common/gpt2_bytes.h"

/* Control tokens 0..2, user-defined 3, then byte characters, then merges'
 * results. */
static kvarn_tokenizer *fuzz_build(const char *pre, int drop_ff)
{
    static const char *const merges[] = {
        "\xC4\xA0 t", "h e", "\xC4\xA0 a", "i n", "\xC4\xA0t he", "e r", "1 2", "a a",
        "aa aa", "\xC4\xA0 \xC4\xA0", "\xC4\xA0\xC4\xA0 \xC4\xA0\xC4\xA0", "\xC4\x8A \xC4\x8A",
        "\xC3\xA2 \xC4\xA2", "' s"};
    static const char *const merged[] = {
        "\xC4\xA0t", "he", "\xC4\xA0" "a", "in", "\xC4\xA0the", "er", "12", "aa", "aaaa",
        "\xC4\xA0\xC4\xA0", "\xC4\xA0\xC4\xA0\xC4\xA0\xC4\xA0", "\xC4\x8A\xC4\x8A",
        "\xC3\xA2\xC4\xA2", "'s"};
    enum { N_MERGES = sizeof merges / sizeof merges[0] };
    char bytes[256][4];
    const char *tokens[4 + 256 + N_MERGES];
    int32_t types[4 + 256 + N_MERGES];
    int32_t n = 0;
    tokens[n] = "<|endoftext|>"; types[n++] = KVARN_TOKEN_CONTROL;
    tokens[n] = "<|im_start|>"; types[n++] = KVARN_TOKEN_CONTROL;
    tokens[n] = "<|im_end|>"; types[n++] = KVARN_TOKEN_CONTROL;
    tokens[n] = "@@"; types[n++] = KVARN_TOKEN_USER_DEFINED;
    for (int b = 0; b < 256; b++) {
        if (drop_ff && b == 0xFF) continue;
        memset(bytes[b], 0, 4);
        test_gpt2_byte_char(b, bytes[b]);
        tokens[n] = bytes[b];
        types[n++] = KVARN_TOKEN_NORMAL;
    }
    for (int i = 0; i < N_MERGES; i++) { tokens[n] = merged[i]; types[n++] = KVARN_TOKEN_NORMAL; }
    kvarn_tokenizer_desc d;
    memset(&d, 0, sizeof d);
    d.n_tokens = n;
    d.tokens = tokens;
    d.token_types = types;
    d.n_merges = N_MERGES;
    d.merges = merges;
    d.pre = pre;
    d.bos_id = 1;
    d.eos_id = 2;
    d.pad_id = -1;
    d.unk_id = 0;
    kvarn_tokenizer *t = NULL;
    return kvarn_tokenizer_create(&d, &t) == KVARN_OK ? t : NULL;
}

static int fuzz_check(const kvarn_tokenizer *t, unsigned flags, int drop_ff,
                      const char *text, size_t len)
{
    unsigned ef = ((flags & 2u) ? KVARN_TOKENIZE_SPECIAL : 0u) |
                  ((flags & 4u) ? KVARN_TOKENIZE_ADD_BOS : 0u);
    int32_t *ids = NULL, *ids2 = NULL;
    char *out = NULL, *want = NULL;
    size_t n = 0, m = 0;
    int rc = 0;
    if (kvarn_tokenizer_encode_alloc(t, text, len, ef, &ids, &n) != KVARN_OK) return -1;
    int32_t nv = kvarn_tokenizer_n_vocab(t);
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= nv) { rc = -2; goto out; }
        if (!(ef & KVARN_TOKENIZE_SPECIAL) && !(i == 0 && (ef & KVARN_TOKENIZE_ADD_BOS)) &&
            kvarn_tokenizer_token_type(t, ids[i]) == KVARN_TOKEN_CONTROL) { rc = -3; goto out; }
    }
    ids2 = malloc((n + 1) * sizeof *ids2);
    if (!ids2) goto out;                                   /* OOM: not a bug */
    if (kvarn_tokenizer_encode(t, text, len, ef, ids2, n, &m) != KVARN_OK || m != n ||
        (n && memcmp(ids, ids2, n * sizeof *ids))) { rc = -4; goto out; }
    if (n && (kvarn_tokenizer_encode(t, text, len, ef, ids2, n - 1, &m) !=
              KVARN_ERR_BUFFER_TOO_SMALL || m != n)) { rc = -5; goto out; }

    /* What decoding must give back. */
    size_t wl = 0;
    want = malloc(len + 16);
    if (!want) goto out;
    if (ef & KVARN_TOKENIZE_ADD_BOS) { memcpy(want, "<|im_start|>", 12); wl = 12; }
    for (size_t i = 0; i < len; i++)
        if (!(drop_ff && (uint8_t)text[i] == 0xFF)) want[wl++] = text[i];
    size_t ol = 0;
    out = malloc(wl + 1);
    if (!out) goto out;
    if (kvarn_tokenizer_decode(t, ids, n, 0, out, wl + 1, &ol) != KVARN_OK) { rc = -6; goto out; }
    if (ol != wl || (wl && memcmp(out, want, wl))) { rc = -7; goto out; }
    size_t sl = 0;
    if (kvarn_tokenizer_decode(t, ids, n, KVARN_DETOKENIZE_SKIP_SPECIAL, out, wl + 1, &sl) !=
            KVARN_OK || sl > ol) { rc = -8; goto out; }
    if (wl && kvarn_tokenizer_decode(t, ids, n, 0, out, wl - 1, &ol) !=
                  KVARN_ERR_BUFFER_TOO_SMALL) { rc = -9; goto out; }
out:
    free(ids);
    free(ids2);
    free(out);
    free(want);
    return rc;
}

int kvarn_fuzz_tokenizer(const uint8_t *data, size_t size);

int kvarn_fuzz_tokenizer(const uint8_t *data, size_t size)
{
    unsigned flags = size ? data[0] : 0u;
    const char *text = size ? (const char *)data + 1 : "";
    size_t len = size ? size - 1 : 0;
    int drop_ff = (flags & 8u) != 0;
    kvarn_tokenizer *t = fuzz_build((flags & 1u) ? "smollm" : "gpt2", drop_ff);
    if (!t) return -100;
    int rc = fuzz_check(t, flags, drop_ff, text, len);
    kvarn_tokenizer_free(t);
    return rc;
}

#ifdef KVARN_LIBFUZZER
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (kvarn_fuzz_tokenizer(data, size) != 0) __builtin_trap();
    return 0;
}
#endif
