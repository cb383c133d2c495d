/*
 * tokenizer.h -- the byte-level BPE tokenizer of GPT-2-style vocabularies
 * (GGUF tokenizer.ggml.model = "gpt2", as SmolLM2 uses), built from the
 * vocabulary, merges and token types a GGUF file stores, and the ChatML chat
 * prompt of instruct models.
 *
 * Encoding a text (docs/tokenizer.md):
 *   1. special tokens: the texts of control tokens (token type 3, e.g.
 *      "<|im_start|>", "<|im_end|>", "<|endoftext|>") are matched literally
 *      when KVARN_TOKENIZE_SPECIAL is given; user-defined tokens (type 4)
 *      always are. Leftmost match first, the longest one at a position.
 *      The text between them is encoded by steps 2-4, each stretch on its
 *      own.
 *   2. pre-tokenization (PCRE2, UTF-8 mode) splits a stretch into pieces:
 *      "gpt2"   the GPT-2 pattern
 *               's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *      "smollm" first every numeric character (\p{N}) is a piece of its
 *               own, then the GPT-2 pattern runs on the text between them.
 *      \s is the Unicode White_Space set, as HF tokenizers' ByteLevel sees it.
 *   3. each byte of a piece becomes the vocabulary token of its GPT-2
 *      byte-to-unicode character (bytes 0x21-0x7E, 0xA1-0xAC, 0xAE-0xFF map
 *      to the same code point, the other 68 bytes to U+0100.. in order).
 *   4. BPE: the adjacent pair with the lowest merge rank (position in
 *      tokenizer.ggml.merges) is merged first, the leftmost one on ties,
 *      until no pair has a merge.
 * Invalid UTF-8 in the input is not an error: every byte that is not part
 * of a well-formed UTF-8 sequence (RFC 3629: no overlong forms, surrogates
 * or code points above U+10FFFF) becomes a piece of its own and is encoded
 * by its byte token. A byte whose character is not in the vocabulary
 * (SmolLM2 lacks 21 of the 256: 0x04 0x06 0x13 0x14 0x16 0x1D 0xC0 0xC1
 * 0xF1 0xF2 0xF5-0xFF) is dropped, as HF tokenizers and llama.cpp do. So
 * decode(encode(bytes)) == bytes for any bytes the vocabulary covers, and
 * otherwise equals them with the uncovered bytes removed.
 *
 * Decoding maps every token back to bytes: normal tokens through the inverse
 * byte mapping, control and user-defined tokens as their text (control ones
 * may be skipped), byte tokens "<0xAB>" as that byte, unused tokens as
 * nothing.
 *
 * A kvarn_tokenizer is immutable after creation (it owns its compiled
 * PCRE2 patterns; no global state), so any number of threads may encode and
 * decode with one tokenizer at the same time. Nothing prints or aborts;
 * errors are kvarn_status values.
 */
#ifndef KVARN_TOKENIZER_H
#define KVARN_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "kvarn/alloc.h"
#include "kvarn/kvarn.h"
#include "kvarn/gguf.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Token types, numbered as GGUF tokenizer.ggml.token_type stores them. */
typedef enum kvarn_token_type {
    KVARN_TOKEN_UNDEFINED = 0,
    KVARN_TOKEN_NORMAL = 1,        /* byte-level text, decoded byte by byte */
    KVARN_TOKEN_UNKNOWN = 2,       /* the unknown token; decodes to its text */
    KVARN_TOKEN_CONTROL = 3,       /* "<|im_start|>" etc.; matched only with
                                      KVARN_TOKENIZE_SPECIAL */
    KVARN_TOKEN_USER_DEFINED = 4,  /* literal text, always matched */
    KVARN_TOKEN_UNUSED = 5,        /* never produced; decodes to nothing */
    KVARN_TOKEN_BYTE = 6           /* "<0xAB>": one raw byte */
} kvarn_token_type;

/* Everything a tokenizer is built from, as plain arrays (the GGUF metadata
 * of the same names). The tokenizer copies what it needs: the arrays may be
 * freed once kvarn_tokenizer_create returns. */
typedef struct kvarn_tokenizer_desc {
    int32_t n_tokens;             /* vocabulary size, >= 1 */
    const char *const *tokens;    /* [n_tokens] token texts (byte-level
                                     alphabet); token id = index */
    const size_t *token_lens;     /* [n_tokens] bytes of each text, or NULL:
                                     the texts are NUL-terminated */
    const int32_t *token_types;   /* [n_tokens] kvarn_token_type values, or
                                     NULL: all NORMAL; others read as NORMAL */
    int32_t n_merges;             /* >= 0 */
    const char *const *merges;    /* [n_merges] "left right" (one space;
                                     rank = index, lower merges first) */
    const size_t *merge_lens;     /* [n_merges] bytes, or NULL: NUL-terminated */
    const char *pre;              /* pre-tokenizer: "smollm" or "gpt2" (alias
                                     "gpt-2"); NULL means "gpt2" */
    int32_t bos_id, eos_id, pad_id, unk_id; /* -1 when absent */
    int add_bos;                  /* the model wants BOS before a text
                                     (tokenizer.ggml.add_bos_token) */
} kvarn_tokenizer_desc;

/* An immutable tokenizer. Opaque. */
typedef struct kvarn_tokenizer kvarn_tokenizer;

/* Build a tokenizer from plain arrays.
 * Rules: token texts may repeat (the first id wins when text is looked up);
 * a merge whose left, right or concatenated text is not a token, or whose
 * line has no space, is ignored (llama.cpp does the same), and a repeated
 * merge keeps its first (lowest) rank. Bytes whose character (step 3
 * above) is not a token are dropped when encoding (unk_id is not used).
 *   out  receives the tokenizer; set to NULL on any error.
 * Errors: KVARN_ERR_INVALID_ARG (NULL desc/out/arrays, n_tokens < 1,
 * n_merges < 0, a special id outside [-1, n_tokens)),
 * KVARN_ERR_UNSUPPORTED (pre-tokenizer name not served),
 * KVARN_ERR_NOMEM (also when PCRE2 cannot compile its patterns). */
kvarn_status kvarn_tokenizer_create(const kvarn_tokenizer_desc *desc,
                                    kvarn_tokenizer **out);

/* The same with allocator (copied; must outlive the tokenizer; NULL =
 * malloc/free, alloc.h): the tokenizer's tables, PCRE2's compiled patterns
 * and match data, every encode call's scratch and the arrays that
 * kvarn_tokenizer_encode_alloc / _encode_chat return are allocated through
 * it. Errors as kvarn_tokenizer_create, and KVARN_ERR_INVALID_ARG for an
 * allocator with only one of alloc/free set. */
kvarn_status kvarn_tokenizer_create_ex(const kvarn_tokenizer_desc *desc,
                                       const kvarn_allocator *allocator,
                                       kvarn_tokenizer **out);

/* Build the tokenizer of a GGUF file from tokenizer.ggml.model (must be
 * "gpt2"), .tokens, .merges, .token_type (optional), .pre (optional,
 * default "gpt2"), .bos_token_id / .eos_token_id / .padding_token_id /
 * .unknown_token_id (optional), .add_bos_token (optional, default 0).
 * Errors: KVARN_ERR_INVALID_ARG (NULL), KVARN_ERR_UNSUPPORTED (another
 * tokenizer model, or pre-tokenizer), KVARN_ERR_BAD_FILE (a key missing or
 * of the wrong type, arrays of mismatched length, an id out of range),
 * KVARN_ERR_NOMEM; and those of kvarn_tokenizer_create. */
kvarn_status kvarn_tokenizer_from_gguf(const kvarn_gguf *g,
                                       kvarn_tokenizer **out);

/* The same through allocator, as kvarn_tokenizer_create_ex (the temporary
 * arrays read from the file too). */
kvarn_status kvarn_tokenizer_from_gguf_ex(const kvarn_gguf *g,
                                          const kvarn_allocator *allocator,
                                          kvarn_tokenizer **out);

/* Free. NULL is allowed. */
void kvarn_tokenizer_free(kvarn_tokenizer *tok);

/* ------------------------------------------------------------------------ */
/* Encoding and decoding                                                    */
/* ------------------------------------------------------------------------ */

#define KVARN_TOKENIZE_SPECIAL 1u   /* match control token texts in the text
                                       (chat prompts); off: they are text */
#define KVARN_TOKENIZE_ADD_BOS 2u   /* put bos_id first (if the vocabulary
                                       has one) */

/* Encode len bytes of text (any bytes; need not be NUL-terminated) into
 * token ids.
 *   ids      output, room for max_ids ids (may be NULL when max_ids is 0).
 *   n_ids    receives the number of ids of the whole text, also when they
 *            do not fit (so a call with max_ids = 0 measures).
 * Errors: KVARN_ERR_INVALID_ARG (NULL tok or n_ids, NULL text with len > 0,
 * unknown flags), KVARN_ERR_BUFFER_TOO_SMALL (more than max_ids ids: the
 * first max_ids are written), KVARN_ERR_NOMEM (scratch for a piece),
 * KVARN_ERR_UNSUPPORTED (PCRE2 gave up on a match, e.g. a resource limit).
 * Time is about linear in len (a piece of n bytes costs O(n log n)). */
kvarn_status kvarn_tokenizer_encode(const kvarn_tokenizer *tok,
                                    const char *text, size_t len,
                                    unsigned flags, int32_t *ids,
                                    size_t max_ids, size_t *n_ids);

/* The same into a new array allocated with the tokenizer's allocator:
 * *ids holds *n_ids ids; release it with free() (a tokenizer made without
 * an allocator) or with that allocator's free; *ids is NULL when there are
 * none. On error *ids is NULL and
 * *n_ids 0. Errors as kvarn_tokenizer_encode, less BUFFER_TOO_SMALL. */
kvarn_status kvarn_tokenizer_encode_alloc(const kvarn_tokenizer *tok,
                                          const char *text, size_t len,
                                          unsigned flags, int32_t **ids,
                                          size_t *n_ids);

#define KVARN_DETOKENIZE_SKIP_SPECIAL 1u /* control and unknown-type tokens
                                            decode to nothing */

/* Decode n ids to bytes (not NUL-terminated; the bytes of a token may end
 * in the middle of a UTF-8 character, which the next token completes).
 *   out      output, cap bytes (may be NULL when cap is 0).
 *   out_len  receives the byte length of the whole decoding.
 * Errors: KVARN_ERR_INVALID_ARG (NULL tok or out_len, NULL ids with n > 0,
 * an id outside [0, n_vocab), unknown flags; nothing written),
 * KVARN_ERR_BUFFER_TOO_SMALL (more than cap bytes; nothing written). */
kvarn_status kvarn_tokenizer_decode(const kvarn_tokenizer *tok,
                                    const int32_t *ids, size_t n,
                                    unsigned flags, char *out, size_t cap,
                                    size_t *out_len);

/* ------------------------------------------------------------------------ */
/* The vocabulary                                                           */
/* ------------------------------------------------------------------------ */

/* Vocabulary size (number of token ids). 0 for NULL. */
int32_t kvarn_tokenizer_n_vocab(const kvarn_tokenizer *tok);

/* Special ids as given at creation; -1 when absent (or tok is NULL). */
int32_t kvarn_tokenizer_bos(const kvarn_tokenizer *tok);
int32_t kvarn_tokenizer_eos(const kvarn_tokenizer *tok);
int32_t kvarn_tokenizer_pad(const kvarn_tokenizer *tok);
int32_t kvarn_tokenizer_unk(const kvarn_tokenizer *tok);
/* 1 if the model wants BOS before a text (add_bos), else 0. */
int kvarn_tokenizer_add_bos(const kvarn_tokenizer *tok);

/* Pre-tokenizer name in use ("smollm" or "gpt2"). */
const char *kvarn_tokenizer_pre(const kvarn_tokenizer *tok);

/* The stored text of token id (byte-level alphabet, as in the vocabulary;
 * NUL-terminated, *len bytes without the NUL when len is not NULL), or
 * NULL for an id out of range. Valid until kvarn_tokenizer_free. */
const char *kvarn_tokenizer_token_text(const kvarn_tokenizer *tok,
                                       int32_t id, size_t *len);

/* Type of token id; KVARN_TOKEN_UNDEFINED for an id out of range. */
kvarn_token_type kvarn_tokenizer_token_type(const kvarn_tokenizer *tok,
                                            int32_t id);

/* Id of the token whose stored text is exactly len bytes of text, or -1.
 * Byte-level alphabet: " world" is stored as "\xC4\xA0world" ("Ġworld"). */
int32_t kvarn_tokenizer_find(const kvarn_tokenizer *tok, const char *text,
                             size_t len);

/* 1 if generation should stop at id: the eos id, or a control token whose
 * text is "<|im_end|>", "<|endoftext|>" or "<|eot_id|>". Else 0. */
int kvarn_tokenizer_is_end_of_generation(const kvarn_tokenizer *tok,
                                         int32_t id);

/* ------------------------------------------------------------------------ */
/* Chat prompts (ChatML, as SmolLM2-Instruct's tokenizer.chat_template)     */
/* ------------------------------------------------------------------------ */

/* One message: role ("system", "user", "assistant") and content, both
 * NUL-terminated UTF-8. */
typedef struct kvarn_chat_message {
    const char *role;
    const char *content;
} kvarn_chat_message;

/* The system prompt SmolLM2-Instruct's template inserts when the first
 * message is not a system message. */
#define KVARN_CHAT_SMOLLM2_SYSTEM \
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

/* Build the ChatML prompt text of n messages:
 *   [<|im_start|>system\n{default_system}<|im_end|>\n]   only if
 *          default_system is not NULL and msgs[0].role is not "system"
 *   <|im_start|>{role}\n{content}<|im_end|>\n            per message
 *   <|im_start|>assistant\n                              if
 *          add_generation_prompt
 * Encode the result with KVARN_TOKENIZE_SPECIAL. (Content that itself holds
 * "<|im_end|>" is then read as that token; kvarn_tokenizer_encode_chat
 * avoids this.)
 *   out      cap bytes; receives the text and a terminating NUL.
 *   out_len  receives the text's length in bytes (without the NUL), also
 *            when it does not fit.
 * Errors: KVARN_ERR_INVALID_ARG (NULL msgs with n > 0, NULL role or
 * content, empty role, NULL out_len, NULL out with cap > 0),
 * KVARN_ERR_BUFFER_TOO_SMALL (cap < length + 1; nothing written). */
kvarn_status kvarn_chat_format_chatml(const kvarn_chat_message *msgs,
                                      size_t n, const char *default_system,
                                      int add_generation_prompt, char *out,
                                      size_t cap, size_t *out_len);

/* Encode the same prompt straight to ids, with "<|im_start|>" and
 * "<|im_end|>" as their control tokens and every role and content encoded
 * as plain text (special texts inside them are not matched). The ids equal
 * those of encoding kvarn_chat_format_chatml's text with
 * KVARN_TOKENIZE_SPECIAL whenever no content holds a special token's text.
 *   ids, n_ids  a new array and its length, allocated and released as
 *               kvarn_tokenizer_encode_alloc's.
 * Errors: as kvarn_chat_format_chatml and kvarn_tokenizer_encode_alloc;
 * KVARN_ERR_UNSUPPORTED if the vocabulary has no "<|im_start|>" or
 * "<|im_end|>" token. */
kvarn_status kvarn_tokenizer_encode_chat(const kvarn_tokenizer *tok,
                                         const kvarn_chat_message *msgs,
                                         size_t n, const char *default_system,
                                         int add_generation_prompt,
                                         int32_t **ids, size_t *n_ids);

#ifdef __cplusplus
}
#endif

#endif /* KVARN_TOKENIZER_H */
