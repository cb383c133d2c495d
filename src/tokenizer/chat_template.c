/*
 * chat_template.c -- the ChatML prompt text of instruct models, as
 * SmolLM2-Instruct's tokenizer.chat_template renders it:
 *   {% if first message is not system %}<|im_start|>system\n{default}<|im_end|>\n
 *   per message: <|im_start|>{role}\n{content}<|im_end|>\n
 *   {% if add_generation_prompt %}<|im_start|>assistant\n
 */
#include <string.h>

#include "kvarn/tokenizer.h"

/* Append s to out at *pos when it fits; *pos always advances. */
static void put(char *out, size_t cap, size_t *pos, const char *s)
{
    size_t l = strlen(s);
    if (*pos + l <= cap && l) memcpy(out + *pos, s, l);
    *pos += l;
}

static void put_message(char *out, size_t cap, size_t *pos, const char *role,
                        const char *content)
{
    put(out, cap, pos, "<|im_start|>");
    put(out, cap, pos, role);
    put(out, cap, pos, "\n");
    put(out, cap, pos, content);
    put(out, cap, pos, "<|im_end|>\n");
}

kvarn_status kvarn_chat_format_chatml(const kvarn_chat_message *msgs, size_t n,
                                      const char *default_system,
                                      int add_generation_prompt, char *out,
                                      size_t cap, size_t *out_len)
{
    if (out_len) *out_len = 0;
    if (!out_len || (!msgs && n > 0) || (!out && cap > 0)) return KVARN_ERR_INVALID_ARG;
    for (size_t i = 0; i < n; i++)
        if (!msgs[i].role || !msgs[i].content || !msgs[i].role[0])
            return KVARN_ERR_INVALID_ARG;
    /* Two passes: measure with no room, then write if everything fits, so
     * that a short buffer is left untouched. */
    for (int pass = 0; pass < 2; pass++) {
        size_t room = pass ? cap : 0, pos = 0;
        if (default_system && (n == 0 || strcmp(msgs[0].role, "system")))
            put_message(out, room, &pos, "system", default_system);
        for (size_t i = 0; i < n; i++) put_message(out, room, &pos, msgs[i].role, msgs[i].content);
        if (add_generation_prompt) put(out, room, &pos, "<|im_start|>assistant\n");
        if (pass == 0) {
            *out_len = pos;
            if (pos >= cap) return KVARN_ERR_BUFFER_TOO_SMALL;
        } else {
            out[pos] = '\0';
        }
    }
    return KVARN_OK;
}
