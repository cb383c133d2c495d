/*
 * tokenizer_internal.h -- pieces of the byte-level BPE tokenizer shared by
 * src/tokenizer/tokenizer.c (vocabulary, BPE, decode), pretokenize.c (PCRE2
 * pre-tokenization), tokenizer_gguf.c and chat_template.c. Not installed.
 */
#ifndef KVARN_TOKENIZER_INTERNAL_H
#define KVARN_TOKENIZER_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "kvarn/kvarn.h"
#include "common/alloc_internal.h"

/* A compiled pre-tokenizer (owns its PCRE2 code objects). Immutable after
 * creation; split() may run on it from many threads, each with its own
 * match scratch. */
typedef struct kvarn_pretok kvarn_pretok;

/* Compile the pre-tokenizer named name ("smollm", "gpt2", "gpt-2"; NULL
 * means "gpt2"). Errors: KVARN_ERR_UNSUPPORTED (other names),
 * KVARN_ERR_NOMEM (allocation or PCRE2 compile failure). */
kvarn_status kvarn_pretok_create(const char *name, const kvarn_allocator *alloc,
                                 kvarn_pretok **out);
void kvarn_pretok_free(kvarn_pretok *p);

/* Canonical name: "smollm" or "gpt2". */
const char *kvarn_pretok_name(const kvarn_pretok *p);

/* Per-call match scratch (a PCRE2 match data block). NULL on no memory. */
void *kvarn_pretok_scratch_create(const kvarn_pretok *p);
void kvarn_pretok_scratch_free(void *scratch);

/* Called once per piece, in text order; a non-OK return stops the split
 * and is returned by it. */
typedef kvarn_status (*kvarn_pretok_piece_fn)(void *ctx, const uint8_t *piece,
                                              size_t len);

/* Split len bytes of text (any bytes) into pieces whose concatenation is
 * the text: maximal well-formed UTF-8 runs are split by the pattern(s),
 * every other byte is a piece of its own.
 * Errors: KVARN_ERR_UNSUPPORTED (PCRE2 match error such as a resource
 * limit) or whatever fn returns. */
kvarn_status kvarn_pretok_split(const kvarn_pretok *p, void *scratch,
                                const char *text, size_t len,
                                kvarn_pretok_piece_fn fn, void *ctx);

/* Length in bytes (1-4) of the well-formed UTF-8 sequence at s (n bytes
 * available), or 0 if the bytes there do not start one (RFC 3629). */
size_t kvarn_utf8_seq_len(const uint8_t *s, size_t n);

/* The GPT-2 byte-to-unicode table: code point of the character standing
 * for byte b (bytes 0x21-0x7E, 0xA1-0xAC, 0xAE-0xFF map to themselves, the
 * other 68 bytes to 0x100, 0x101, ... in byte order). */
void kvarn_gpt2_byte_chars(uint32_t cp[256]);

#endif /* KVARN_TOKENIZER_INTERNAL_H */
