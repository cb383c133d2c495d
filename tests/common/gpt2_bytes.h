/* gpt2_bytes.h -- GPT-2's byte -> character table for the tokenizer tests
 * (header only), written here from its definition, not taken from the
 * library: printable Latin-1 bytes stand for themselves, the other 68 get
 * U+0100.. in byte order. */
#ifndef KVARN_TEST_GPT2_BYTES_H
#define KVARN_TEST_GPT2_BYTES_H

#include <stddef.h>
#include <stdint.h>

/* UTF-8 of the character for byte b (0..255) into out; returns its length. */
static inline size_t test_gpt2_byte_char(int b, char out[4])
{
    int next = 0x100;
    uint32_t cp = 0;
    for (int i = 0; i <= b; i++) {
        int keep = (i >= 0x21 && i <= 0x7E) || (i >= 0xA1 && i <= 0xAC) || i >= 0xAE;
        cp = keep ? (uint32_t)i : (uint32_t)next++;
    }
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    out[0] = (char)(0xC0 | (cp >> 6));
    out[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
}

#endif
