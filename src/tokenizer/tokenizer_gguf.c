/*
 * tokenizer_gguf.c -- build the byte-level BPE tokenizer from a GGUF file's
 * tokenizer.ggml.* metadata (llama.cpp's GGUF key names): gather the
 * arrays as plain views and hand them to kvarn_tokenizer_create.
 */
#include <stdlib.h>
#include <string.h>

#include "kvarn/gguf.h"
#include "kvarn/tokenizer.h"
#include "common/alloc_internal.h"

/* An optional token id: -1 when the key is absent. */
static kvarn_status optional_id(const kvarn_gguf *g, const char *key, int32_t n,
                                int32_t *out)
{
    *out = -1;
    if (kvarn_gguf_find_key(g, key) < 0) return KVARN_OK;
    int32_t v;
    if (kvarn_gguf_get_i32(g, key, &v) != KVARN_OK || v < 0 || v >= n)
        return KVARN_ERR_BAD_FILE;
    *out = v;
    return KVARN_OK;
}

/* Views of a string array's elements as pointer + length arrays. */
static kvarn_status string_array(const kvarn_gguf *g, const char *key,
                                 const kvarn_allocator *al, const char ***ptrs,
                                 size_t **lens, int32_t *n)
{
    kvarn_gguf_array a;
    if (kvarn_gguf_get_array(g, key, &a) != KVARN_OK || a.type != KVARN_GGUF_STRING ||
        a.n > (uint64_t)INT32_MAX)
        return KVARN_ERR_BAD_FILE;
    *n = (int32_t)a.n;
    *ptrs = kvarn__malloc(al, a.n ? a.n : 1, sizeof **ptrs);
    *lens = kvarn__malloc(al, a.n ? a.n : 1, sizeof **lens);
    if (!*ptrs || !*lens) return KVARN_ERR_NOMEM;
    for (uint64_t i = 0; i < a.n; i++) {
        kvarn_gguf_str s;
        if (kvarn_gguf_array_string(g, key, i, &s) != KVARN_OK || s.len > SIZE_MAX / 4)
            return KVARN_ERR_BAD_FILE;
        (*ptrs)[i] = s.ptr;
        (*lens)[i] = (size_t)s.len;
    }
    return KVARN_OK;
}

kvarn_status kvarn_tokenizer_from_gguf(const kvarn_gguf *g, kvarn_tokenizer **out)
{
    return kvarn_tokenizer_from_gguf_ex(g, NULL, out);
}

kvarn_status kvarn_tokenizer_from_gguf_ex(const kvarn_gguf *g, const kvarn_allocator *allocator,
                                          kvarn_tokenizer **out)
{
    if (!out) return KVARN_ERR_INVALID_ARG;
    *out = NULL;
    kvarn_allocator alloc;
    if (!g || kvarn__alloc_init(&alloc, allocator) != KVARN_OK) return KVARN_ERR_INVALID_ARG;

    kvarn_gguf_str model;
    if (kvarn_gguf_get_string(g, "tokenizer.ggml.model", &model) != KVARN_OK)
        return KVARN_ERR_BAD_FILE;
    if (!kvarn_gguf_str_eq(model, "gpt2")) return KVARN_ERR_UNSUPPORTED;

    kvarn_tokenizer_desc d;
    memset(&d, 0, sizeof d);
    const char **tokens = NULL, **merges = NULL;
    size_t *token_lens = NULL, *merge_lens = NULL;
    int32_t *types = NULL;
    char *pre = NULL;
    kvarn_status st = string_array(g, "tokenizer.ggml.tokens", &alloc, &tokens, &token_lens,
                                   &d.n_tokens);
    if (st == KVARN_OK && d.n_tokens < 1) st = KVARN_ERR_BAD_FILE;
    if (st == KVARN_OK)
        st = string_array(g, "tokenizer.ggml.merges", &alloc, &merges, &merge_lens, &d.n_merges);

    if (st == KVARN_OK && kvarn_gguf_find_key(g, "tokenizer.ggml.token_type") >= 0) {
        kvarn_gguf_array a;
        if (kvarn_gguf_get_array(g, "tokenizer.ggml.token_type", &a) != KVARN_OK ||
            a.n != (uint64_t)d.n_tokens)
            st = KVARN_ERR_BAD_FILE;
        else if (!(types = kvarn__malloc(&alloc, (size_t)d.n_tokens, sizeof *types)))
            st = KVARN_ERR_NOMEM;
        for (int32_t i = 0; st == KVARN_OK && i < d.n_tokens; i++) {
            int64_t v;
            if (kvarn_gguf_array_i64(g, "tokenizer.ggml.token_type", (uint64_t)i, &v) != KVARN_OK)
                st = KVARN_ERR_BAD_FILE;
            else
                types[i] = v >= 0 && v <= KVARN_TOKEN_BYTE ? (int32_t)v : KVARN_TOKEN_NORMAL;
        }
    }

    if (st == KVARN_OK && kvarn_gguf_find_key(g, "tokenizer.ggml.pre") >= 0) {
        kvarn_gguf_str s;
        if (kvarn_gguf_get_string(g, "tokenizer.ggml.pre", &s) != KVARN_OK || s.len > 256)
            st = KVARN_ERR_BAD_FILE;
        else if (!(pre = kvarn__malloc(&alloc, (size_t)s.len + 1, 1)))
            st = KVARN_ERR_NOMEM;
        else if (memchr(s.ptr, '\0', (size_t)s.len))
            st = KVARN_ERR_UNSUPPORTED;   /* no served name holds a NUL */
        else
            st = kvarn_gguf_str_copy(s, pre, (size_t)s.len + 1);
    }

    if (st == KVARN_OK) st = optional_id(g, "tokenizer.ggml.bos_token_id", d.n_tokens, &d.bos_id);
    if (st == KVARN_OK) st = optional_id(g, "tokenizer.ggml.eos_token_id", d.n_tokens, &d.eos_id);
    if (st == KVARN_OK) st = optional_id(g, "tokenizer.ggml.padding_token_id", d.n_tokens, &d.pad_id);
    if (st == KVARN_OK) st = optional_id(g, "tokenizer.ggml.unknown_token_id", d.n_tokens, &d.unk_id);
    if (st == KVARN_OK && kvarn_gguf_find_key(g, "tokenizer.ggml.add_bos_token") >= 0 &&
        kvarn_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &d.add_bos) != KVARN_OK)
        st = KVARN_ERR_BAD_FILE;

    if (st == KVARN_OK) {
        d.tokens = tokens;
        d.token_lens = token_lens;
        d.token_types = types;
        d.merges = merges;
        d.merge_lens = merge_lens;
        d.pre = pre;
        st = kvarn_tokenizer_create_ex(&d, &alloc, out);
    }
    kvarn__free(&alloc, tokens);
    kvarn__free(&alloc, token_lens);
    kvarn__free(&alloc, merges);
    kvarn__free(&alloc, merge_lens);
    kvarn__free(&alloc, types);
    kvarn__free(&alloc, pre);
    return st;
}
