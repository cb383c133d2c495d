/*
 * tokenizer.c -- byte-level BPE (GPT-2 style) over a GGUF vocabulary: the
 * vocabulary and merge tables, special-token matching, BPE by merge rank,
 * and decoding. Pre-tokenization is in pretokenize.c. The algorithm is in
 * include/kvarn/tokenizer.h and docs/tokenizer.md.
 *
 * Tables are open-addressing hash maps with linear probing, sized to a
 * power of two at least twice the entry count:
 *   token map  token text -> id (lookup of merge results, of the byte
 *              characters and kvarn_tokenizer_find)
 *   merge map  (left id, right id) -> (rank, merged id); BPE itself works
 *              on ids only and never touches strings.
 */
#include <stdlib.h>
#include <string.h>

#include "kvarn/tokenizer.h"
#include "tokenizer/tokenizer_internal.h"

typedef struct merge_slot {
    uint64_t key;          /* left << 32 | right; EMPTY_KEY when free */
    int32_t rank;
    int32_t id;            /* token id of the merged text */
} merge_slot;

#define EMPTY_KEY UINT64_MAX

typedef struct special_entry {
    uint8_t first;         /* first byte of the text */
    size_t len;            /* bytes of the text, >= 1 */
    int32_t id;
} special_entry;

struct kvarn_tokenizer {
    kvarn_allocator alloc; /* the tokenizer, its tables, PCRE2's memory, and
                              encode scratch and results (alloc.h) */
    int32_t n_vocab;
    char *text;            /* every token text, each followed by a NUL */
    size_t *text_off;      /* [n_vocab + 1]; text of id i at text_off[i],
                              text_off[i+1] - text_off[i] - 1 bytes */
    uint8_t *type;         /* [n_vocab] kvarn_token_type */
    char *dec;             /* decoded bytes of every token, back to back */
    size_t *dec_off;       /* [n_vocab + 1] */

    int32_t *tok_slots;    /* token map: id or -1 */
    size_t tok_mask;
    merge_slot *merge_slots;
    size_t merge_mask;

    int32_t byte_id[256];  /* token of each byte's character, or -1: the
                              vocabulary cannot represent that byte */

    special_entry *specials; /* control and user-defined tokens, sorted by
                                first byte, then longest first */
    size_t n_specials;
    uint32_t special_start[257]; /* specials with first byte b:
                                    [special_start[b], special_start[b+1]) */

    int32_t bos, eos, pad, unk;
    int add_bos;
    int32_t im_start, im_end;
    kvarn_pretok *pretok;
};

/* ------------------------------------------------------------------------ */
/* Hash maps                                                                */
/* ------------------------------------------------------------------------ */

static uint64_t hash_bytes(const char *s, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;               /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)s[i]) * 0x100000001b3ull;
    return h ^ (h >> 29);
}

static uint64_t hash_pair(uint64_t key)
{
    key *= 0x9e3779b97f4a7c15ull;
    return key ^ (key >> 31);
}

static size_t table_size(size_t entries)
{
    size_t n = 16;
    while (n < 2 * entries) n *= 2;
    return n;
}

static const char *tok_str(const kvarn_tokenizer *t, int32_t id, size_t *len)
{
    *len = t->text_off[id + 1] - t->text_off[id] - 1;
    return t->text + t->text_off[id];
}

int32_t kvarn_tokenizer_find(const kvarn_tokenizer *t, const char *s, size_t n)
{
    if (!t || (!s && n > 0)) return -1;
    for (size_t i = hash_bytes(s, n) & t->tok_mask;; i = (i + 1) & t->tok_mask) {
        int32_t id = t->tok_slots[i];
        if (id < 0) return -1;
        size_t l;
        const char *ts = tok_str(t, id, &l);
        if (l == n && (n == 0 || !memcmp(ts, s, n))) return id;
    }
}

/* Insert id unless its text is already present (the first id wins). */
static void tok_insert(kvarn_tokenizer *t, int32_t id)
{
    size_t n;
    const char *s = tok_str(t, id, &n);
    for (size_t i = hash_bytes(s, n) & t->tok_mask;; i = (i + 1) & t->tok_mask) {
        int32_t cur = t->tok_slots[i];
        if (cur < 0) { t->tok_slots[i] = id; return; }
        size_t l;
        const char *cs = tok_str(t, cur, &l);
        if (l == n && (n == 0 || !memcmp(cs, s, n))) return;
    }
}

static const merge_slot *merge_find(const kvarn_tokenizer *t, int32_t a, int32_t b)
{
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    for (size_t i = hash_pair(key) & t->merge_mask;; i = (i + 1) & t->merge_mask) {
        const merge_slot *m = &t->merge_slots[i];
        if (m->key == key) return m;
        if (m->key == EMPTY_KEY) return NULL;
    }
}

/* Insert unless the pair is present (a repeated merge keeps its first rank). */
static void merge_insert(kvarn_tokenizer *t, int32_t a, int32_t b, int32_t rank,
                         int32_t id)
{
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    for (size_t i = hash_pair(key) & t->merge_mask;; i = (i + 1) & t->merge_mask) {
        merge_slot *m = &t->merge_slots[i];
        if (m->key == key) return;
        if (m->key == EMPTY_KEY) { m->key = key; m->rank = rank; m->id = id; return; }
    }
}

/* ------------------------------------------------------------------------ */
/* Construction                                                             */
/* ------------------------------------------------------------------------ */

static size_t put_utf8(uint32_t cp, char *out)
{
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    out[0] = (char)(0xE0 | (cp >> 12));           /* the table stays < 0x144 */
    out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[2] = (char)(0x80 | (cp & 0x3F));
    return 3;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

/* Decoded bytes of one token into out (at most its text length); returns
 * the count. Normal tokens go through the inverse byte mapping; a character
 * outside it (or a malformed byte) is kept as it is. */
static size_t decode_token(const char *s, size_t n, kvarn_token_type type,
                           const int16_t *inv, char *out)
{
    switch (type) {
    case KVARN_TOKEN_UNUSED: return 0;
    case KVARN_TOKEN_CONTROL:
    case KVARN_TOKEN_UNKNOWN:
    case KVARN_TOKEN_USER_DEFINED:
        memcpy(out, s, n);
        return n;
    case KVARN_TOKEN_BYTE:
        if (n == 6 && !memcmp(s, "<0x", 3) && s[5] == '>' && hexval(s[3]) >= 0 &&
            hexval(s[4]) >= 0) {
            out[0] = (char)(hexval(s[3]) * 16 + hexval(s[4]));
            return 1;
        }
        memcpy(out, s, n);
        return n;
    default: break;
    }
    size_t o = 0;
    const uint8_t *u = (const uint8_t *)s;
    for (size_t i = 0; i < n;) {
        size_t l = kvarn_utf8_seq_len(u + i, n - i);
        if (l == 0) { out[o++] = s[i++]; continue; }
        uint32_t cp = u[i];
        if (l == 2) cp = (uint32_t)(u[i] & 0x1F) << 6 | (u[i + 1] & 0x3F);
        else if (l == 3)
            cp = (uint32_t)(u[i] & 0x0F) << 12 | (uint32_t)(u[i + 1] & 0x3F) << 6 |
                 (u[i + 2] & 0x3F);
        if (l <= 3 && cp < 0x144 && inv[cp] >= 0) {
            out[o++] = (char)inv[cp];
        } else {
            memcpy(out + o, s + i, l);
            o += l;
        }
        i += l;
    }
    return o;
}

static int special_cmp(const void *pa, const void *pb)
{
    const special_entry *a = pa, *b = pb;
    if (a->first != b->first) return a->first < b->first ? -1 : 1;
    if (a->len != b->len) return a->len > b->len ? -1 : 1;   /* longest first */
    return a->id < b->id ? -1 : a->id > b->id;
}

static kvarn_status build_vocab(kvarn_tokenizer *t, const kvarn_tokenizer_desc *d)
{
    int32_t n = d->n_tokens;
    size_t total = 0;
    for (int32_t i = 0; i < n; i++) {
        if (!d->tokens[i]) return KVARN_ERR_INVALID_ARG;
        size_t l = d->token_lens ? d->token_lens[i] : strlen(d->tokens[i]);
        if (l > SIZE_MAX / 2 - total) return KVARN_ERR_INVALID_ARG;
        total += l + 1;
    }
    t->text = kvarn__malloc(&t->alloc, total, 1);
    t->dec = kvarn__malloc(&t->alloc, total, 1);
    t->text_off = kvarn__malloc(&t->alloc, (size_t)n + 1, sizeof *t->text_off);
    t->dec_off = kvarn__malloc(&t->alloc, (size_t)n + 1, sizeof *t->dec_off);
    t->type = kvarn__malloc(&t->alloc, (size_t)n, 1);
    size_t slots = table_size((size_t)n);
    t->tok_slots = kvarn__malloc(&t->alloc, slots, sizeof *t->tok_slots);
    if (!t->text || !t->dec || !t->text_off || !t->dec_off || !t->type || !t->tok_slots)
        return KVARN_ERR_NOMEM;
    t->tok_mask = slots - 1;
    memset(t->tok_slots, 0xff, slots * sizeof *t->tok_slots);   /* all -1 */

    uint32_t cp[256];
    int16_t inv[0x144];
    kvarn_gpt2_byte_chars(cp);
    for (int i = 0; i < 0x144; i++) inv[i] = -1;
    for (int b = 0; b < 256; b++) inv[cp[b]] = (int16_t)b;

    size_t off = 0, doff = 0;
    size_t n_special = 0;
    for (int32_t i = 0; i < n; i++) {
        size_t l = d->token_lens ? d->token_lens[i] : strlen(d->tokens[i]);
        int32_t ty = d->token_types ? d->token_types[i] : KVARN_TOKEN_NORMAL;
        if (ty < KVARN_TOKEN_UNDEFINED || ty > KVARN_TOKEN_BYTE) ty = KVARN_TOKEN_NORMAL;
        t->type[i] = (uint8_t)ty;
        t->text_off[i] = off;
        if (l) memcpy(t->text + off, d->tokens[i], l);
        t->text[off + l] = '\0';
        t->dec_off[i] = doff;
        doff += decode_token(t->text + off, l, (kvarn_token_type)ty, inv, t->dec + doff);
        off += l + 1;
        if ((ty == KVARN_TOKEN_CONTROL || ty == KVARN_TOKEN_USER_DEFINED) && l > 0)
            n_special++;
    }
    t->text_off[n] = off;
    t->dec_off[n] = doff;
    for (int32_t i = 0; i < n; i++) tok_insert(t, i);

    /* Special tokens, bucketed by first byte for a cheap scan of the text. */
    if (n_special) {
        t->specials = kvarn__malloc(&t->alloc, n_special, sizeof *t->specials);
        if (!t->specials) return KVARN_ERR_NOMEM;
        for (int32_t i = 0; i < n; i++) {
            size_t l;
            const char *s = tok_str(t, i, &l);
            if ((t->type[i] == KVARN_TOKEN_CONTROL || t->type[i] == KVARN_TOKEN_USER_DEFINED) && l)
                t->specials[t->n_specials++] = (special_entry){(uint8_t)s[0], l, i};
        }
        qsort(t->specials, t->n_specials, sizeof *t->specials, special_cmp);
    }
    size_t k = 0;
    for (int b = 0; b <= 256; b++) {
        while (k < t->n_specials && t->specials[k].first < b) k++;
        t->special_start[b] = (uint32_t)k;
    }

    /* The token standing for each byte (step 3 of the encoder); -1 for a
     * byte the vocabulary lacks (SmolLM2 lacks 21, e.g. 0x04, 0xC0, 0xFF). */
    for (int b = 0; b < 256; b++) {
        char buf[4];
        size_t l = put_utf8(cp[b], buf);
        t->byte_id[b] = kvarn_tokenizer_find(t, buf, l);
    }
    return KVARN_OK;
}

static kvarn_status build_merges(kvarn_tokenizer *t, const kvarn_tokenizer_desc *d)
{
    size_t slots = table_size((size_t)d->n_merges);
    t->merge_slots = kvarn__malloc(&t->alloc, slots, sizeof *t->merge_slots);
    if (!t->merge_slots) return KVARN_ERR_NOMEM;
    t->merge_mask = slots - 1;
    for (size_t i = 0; i < slots; i++) t->merge_slots[i].key = EMPTY_KEY;

    char *buf = NULL;
    size_t cap = 0;
    for (int32_t r = 0; r < d->n_merges; r++) {
        const char *m = d->merges[r];
        if (!m) { kvarn__free(&t->alloc, buf); return KVARN_ERR_INVALID_ARG; }
        size_t l = d->merge_lens ? d->merge_lens[r] : strlen(m);
        /* Split at the first space after the first byte (a left part of
         * one space stays possible, as in llama.cpp). */
        const char *sp = l > 1 ? memchr(m + 1, ' ', l - 1) : NULL;
        if (!sp) continue;
        size_t la = (size_t)(sp - m), lb = l - la - 1;
        int32_t a = kvarn_tokenizer_find(t, m, la);
        int32_t b = kvarn_tokenizer_find(t, sp + 1, lb);
        if (a < 0 || b < 0) continue;
        if (la + lb > cap) {
            size_t nc = (la + lb) * 2;
            char *nb = kvarn__realloc(&t->alloc, buf, cap, nc);
            if (!nb) { kvarn__free(&t->alloc, buf); return KVARN_ERR_NOMEM; }
            buf = nb;
            cap = nc;
        }
        memcpy(buf, m, la);
        memcpy(buf + la, sp + 1, lb);
        int32_t id = kvarn_tokenizer_find(t, buf, la + lb);
        if (id < 0) continue;
        merge_insert(t, a, b, r, id);
    }
    kvarn__free(&t->alloc, buf);
    return KVARN_OK;
}

void kvarn_tokenizer_free(kvarn_tokenizer *t)
{
    if (!t) return;
    kvarn__free(&t->alloc, t->text);
    kvarn__free(&t->alloc, t->text_off);
    kvarn__free(&t->alloc, t->type);
    kvarn__free(&t->alloc, t->dec);
    kvarn__free(&t->alloc, t->dec_off);
    kvarn__free(&t->alloc, t->tok_slots);
    kvarn__free(&t->alloc, t->merge_slots);
    kvarn__free(&t->alloc, t->specials);
    kvarn_pretok_free(t->pretok);
    const kvarn_allocator a = t->alloc;
    kvarn__free(&a, t);
}

static int valid_special(int32_t id, int32_t n) { return id >= -1 && id < n; }

kvarn_status kvarn_tokenizer_create(const kvarn_tokenizer_desc *d, kvarn_tokenizer **out)
{
    return kvarn_tokenizer_create_ex(d, NULL, out);
}

kvarn_status kvarn_tokenizer_create_ex(const kvarn_tokenizer_desc *d,
                                       const kvarn_allocator *allocator,
                                       kvarn_tokenizer **out)
{
    if (!out) return KVARN_ERR_INVALID_ARG;
    *out = NULL;
    kvarn_allocator alloc;
    if (kvarn__alloc_init(&alloc, allocator) != KVARN_OK) return KVARN_ERR_INVALID_ARG;
    if (!d || d->n_tokens < 1 || !d->tokens || d->n_merges < 0 ||
        (d->n_merges > 0 && !d->merges) || !valid_special(d->bos_id, d->n_tokens) ||
        !valid_special(d->eos_id, d->n_tokens) || !valid_special(d->pad_id, d->n_tokens) ||
        !valid_special(d->unk_id, d->n_tokens))
        return KVARN_ERR_INVALID_ARG;

    kvarn_tokenizer *t = kvarn__calloc(&alloc, 1, sizeof *t);
    if (!t) return KVARN_ERR_NOMEM;
    t->alloc = alloc;
    t->n_vocab = d->n_tokens;
    t->bos = d->bos_id;
    t->eos = d->eos_id;
    t->pad = d->pad_id;
    t->unk = d->unk_id;
    t->add_bos = d->add_bos != 0;
    kvarn_status st = kvarn_pretok_create(d->pre, &t->alloc, &t->pretok);
    if (st == KVARN_OK) st = build_vocab(t, d);
    if (st == KVARN_OK) st = build_merges(t, d);
    if (st != KVARN_OK) {
        kvarn_tokenizer_free(t);
        return st;
    }
    t->im_start = kvarn_tokenizer_find(t, "<|im_start|>", 12);
    t->im_end = kvarn_tokenizer_find(t, "<|im_end|>", 10);
    *out = t;
    return KVARN_OK;
}

/* ------------------------------------------------------------------------ */
/* Encoding                                                                 */
/* ------------------------------------------------------------------------ */

/* Where ids go: a caller's fixed array (count past it) or a growing one. */
typedef struct sink {
    int32_t *ids;
    size_t cap, n;
    int grow;
    const kvarn_allocator *alloc; /* the tokenizer's, when grow */
} sink;

static kvarn_status sink_push(sink *s, int32_t id)
{
    if (s->n == s->cap && s->grow) {
        size_t nc = s->cap ? s->cap * 2 : 256;
        int32_t *ni = kvarn__realloc(s->alloc, s->ids, s->cap * sizeof *ni, nc * sizeof *ni);
        if (!ni) return KVARN_ERR_NOMEM;
        s->ids = ni;
        s->cap = nc;
    }
    if (s->n < s->cap) s->ids[s->n] = id;
    s->n++;
    return KVARN_OK;
}

/* Scratch of the BPE of one piece of n bytes: symbols as a linked list in
 * place (sym[i] the token id, DEAD once merged into its left neighbour),
 * and a binary min-heap of candidate merges keyed rank << 32 | left
 * position, so the lowest rank and then the leftmost pair comes first. */
typedef struct bpe_work {
    int32_t *sym, *prev, *next;
    uint64_t *heap;
    size_t cap;            /* symbols the arrays hold (heap: 3 * cap) */
} bpe_work;

#define DEAD INT32_MIN

static kvarn_status work_reserve(const kvarn_allocator *al, bpe_work *w, size_t n)
{
    if (n <= w->cap) return KVARN_OK;
    size_t nc = w->cap ? w->cap : 64;
    while (nc < n) nc *= 2;
    const size_t oc = w->cap; /* each array holds oc entries (heap 3 * oc) */
    int32_t *a = kvarn__realloc(al, w->sym, oc * sizeof *a, nc * sizeof *a);
    if (!a) return KVARN_ERR_NOMEM;
    w->sym = a;
    if (!(a = kvarn__realloc(al, w->prev, oc * sizeof *a, nc * sizeof *a))) return KVARN_ERR_NOMEM;
    w->prev = a;
    if (!(a = kvarn__realloc(al, w->next, oc * sizeof *a, nc * sizeof *a))) return KVARN_ERR_NOMEM;
    w->next = a;
    uint64_t *h = kvarn__realloc(al, w->heap, 3 * oc * sizeof *h, 3 * nc * sizeof *h);
    if (!h) return KVARN_ERR_NOMEM;
    w->heap = h;
    w->cap = nc;
    return KVARN_OK;
}

static void heap_push(uint64_t *h, size_t *n, uint64_t v)
{
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (h[p] <= v) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = v;
}

static uint64_t heap_pop(uint64_t *h, size_t *n)
{
    uint64_t top = h[0], v = h[--*n];
    size_t i = 0, m = *n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= m) break;
        if (c + 1 < m && h[c + 1] < h[c]) c++;
        if (v <= h[c]) break;
        h[i] = h[c];
        i = c;
    }
    if (m) h[i] = v;
    return top;
}

typedef struct encode_ctx {
    const kvarn_tokenizer *tok;
    bpe_work work;
    sink out;
    void *scratch;
} encode_ctx;

static void push_pair(const kvarn_tokenizer *t, bpe_work *w, size_t *hn, int32_t left)
{
    int32_t right = w->next[left];
    if (right < 0) return;
    const merge_slot *m = merge_find(t, w->sym[left], w->sym[right]);
    if (m) heap_push(w->heap, hn, (uint64_t)(uint32_t)m->rank << 32 | (uint32_t)left);
}

/* BPE of one piece (kvarn_pretok_piece_fn). A byte without a token is
 * dropped before merging, as HF tokenizers' BPE does without an unknown
 * token (llama.cpp drops it too). */
static kvarn_status encode_piece(void *vctx, const uint8_t *p, size_t len)
{
    encode_ctx *c = vctx;
    const kvarn_tokenizer *t = c->tok;
    if (len == 1) return t->byte_id[p[0]] < 0 ? KVARN_OK : sink_push(&c->out, t->byte_id[p[0]]);
    if (len > (size_t)INT32_MAX) return KVARN_ERR_NOMEM;   /* positions are int32 */
    bpe_work *w = &c->work;
    kvarn_status st = work_reserve(&t->alloc, w, len);
    if (st != KVARN_OK) return st;
    size_t n = 0;
    for (size_t i = 0; i < len; i++)
        if (t->byte_id[p[i]] >= 0) w->sym[n++] = t->byte_id[p[i]];
    if (n == 0) return KVARN_OK;
    for (size_t i = 0; i < n; i++) {
        w->prev[i] = (int32_t)i - 1;
        w->next[i] = i + 1 < n ? (int32_t)i + 1 : -1;
    }
    size_t hn = 0;
    for (size_t i = 0; i + 1 < n; i++) push_pair(t, w, &hn, (int32_t)i);
    while (hn) {
        uint64_t top = heap_pop(w->heap, &hn);
        int32_t left = (int32_t)(uint32_t)top, rank = (int32_t)(top >> 32);
        if (w->sym[left] == DEAD) continue;
        int32_t right = w->next[left];
        if (right < 0) continue;
        const merge_slot *m = merge_find(t, w->sym[left], w->sym[right]);
        if (!m || m->rank != rank) continue;   /* stale: a neighbour changed */
        w->sym[left] = m->id;
        w->sym[right] = DEAD;
        w->next[left] = w->next[right];
        if (w->next[right] >= 0) w->prev[w->next[right]] = left;
        if (w->prev[left] >= 0) push_pair(t, w, &hn, w->prev[left]);
        push_pair(t, w, &hn, left);
    }
    for (int32_t i = 0; i >= 0; i = w->next[i])
        if ((st = sink_push(&c->out, w->sym[i])) != KVARN_OK) return st;
    return KVARN_OK;
}

static kvarn_status encode_plain(encode_ctx *c, const char *s, size_t n)
{
    if (n == 0) return KVARN_OK;
    return kvarn_pretok_split(c->tok->pretok, c->scratch, s, n, encode_piece, c);
}

/* Special-token matching (leftmost, then longest), plain text in between. */
static kvarn_status encode_text(encode_ctx *c, const char *text, size_t len,
                                unsigned flags)
{
    const kvarn_tokenizer *t = c->tok;
    const uint8_t *u = (const uint8_t *)text;
    size_t seg = 0;
    kvarn_status st;
    for (size_t i = 0; i < len && t->n_specials;) {
        uint32_t a = t->special_start[u[i]], b = t->special_start[u[i] + 1];
        int32_t hit = -1;
        size_t hit_len = 0;
        for (uint32_t k = a; k < b; k++) {
            const special_entry *e = &t->specials[k];
            if (e->len > len - i) continue;
            if (t->type[e->id] == KVARN_TOKEN_CONTROL && !(flags & KVARN_TOKENIZE_SPECIAL))
                continue;
            if (!memcmp(text + i, t->text + t->text_off[e->id], e->len)) {
                hit = e->id;
                hit_len = e->len;
                break;
            }
        }
        if (hit < 0) { i++; continue; }
        if ((st = encode_plain(c, text + seg, i - seg)) != KVARN_OK) return st;
        if ((st = sink_push(&c->out, hit)) != KVARN_OK) return st;
        i += hit_len;
        seg = i;
    }
    return encode_plain(c, text + seg, len - seg);
}

static kvarn_status ctx_init(encode_ctx *c, const kvarn_tokenizer *t)
{
    memset(c, 0, sizeof *c);
    c->tok = t;
    c->scratch = kvarn_pretok_scratch_create(t->pretok);
    return c->scratch ? KVARN_OK : KVARN_ERR_NOMEM;
}

static void ctx_release(encode_ctx *c)
{
    const kvarn_allocator *a = &c->tok->alloc;
    kvarn__free(a, c->work.sym);
    kvarn__free(a, c->work.prev);
    kvarn__free(a, c->work.next);
    kvarn__free(a, c->work.heap);
    kvarn_pretok_scratch_free(c->scratch);
}

kvarn_status kvarn_tokenizer_encode(const kvarn_tokenizer *t, const char *text,
                                    size_t len, unsigned flags, int32_t *ids,
                                    size_t max_ids, size_t *n_ids)
{
    if (n_ids) *n_ids = 0;
    if (!t || !n_ids || (!text && len > 0) || (!ids && max_ids > 0) ||
        (flags & ~(KVARN_TOKENIZE_SPECIAL | KVARN_TOKENIZE_ADD_BOS)))
        return KVARN_ERR_INVALID_ARG;
    encode_ctx c;
    kvarn_status st = ctx_init(&c, t);
    if (st == KVARN_OK) {
        c.out = (sink){ids, max_ids, 0, 0, NULL};
        if ((flags & KVARN_TOKENIZE_ADD_BOS) && t->bos >= 0) st = sink_push(&c.out, t->bos);
        if (st == KVARN_OK) st = encode_text(&c, text, len, flags);
    }
    ctx_release(&c);
    if (st != KVARN_OK) return st;
    *n_ids = c.out.n;
    return c.out.n > max_ids ? KVARN_ERR_BUFFER_TOO_SMALL : KVARN_OK;
}

kvarn_status kvarn_tokenizer_encode_alloc(const kvarn_tokenizer *t, const char *text,
                                          size_t len, unsigned flags, int32_t **ids,
                                          size_t *n_ids)
{
    if (ids) *ids = NULL;
    if (n_ids) *n_ids = 0;
    if (!t || !ids || !n_ids || (!text && len > 0) ||
        (flags & ~(KVARN_TOKENIZE_SPECIAL | KVARN_TOKENIZE_ADD_BOS)))
        return KVARN_ERR_INVALID_ARG;
    encode_ctx c;
    kvarn_status st = ctx_init(&c, t);
    c.out = (sink){NULL, 0, 0, 1, &t->alloc};
    if (st == KVARN_OK && (flags & KVARN_TOKENIZE_ADD_BOS) && t->bos >= 0)
        st = sink_push(&c.out, t->bos);
    if (st == KVARN_OK) st = encode_text(&c, text, len, flags);
    ctx_release(&c);
    if (st != KVARN_OK) {
        kvarn__free(&t->alloc, c.out.ids);
        return st;
    }
    *ids = c.out.ids;
    *n_ids = c.out.n;
    return KVARN_OK;
}

/* ChatML straight to ids (declared in tokenizer.h; the text form is in
 * chat_template.c). Segments: <|im_start|> "role\ncontent" <|im_end|> "\n". */
static kvarn_status chat_message(encode_ctx *c, const char *role, const char *content)
{
    const kvarn_tokenizer *t = c->tok;
    size_t lr = strlen(role), lc = strlen(content);
    char *buf = kvarn__malloc(&t->alloc, lr + 1 + lc + 1, 1);
    if (!buf) return KVARN_ERR_NOMEM;
    memcpy(buf, role, lr);
    buf[lr] = '\n';
    memcpy(buf + lr + 1, content, lc);
    kvarn_status st = sink_push(&c->out, t->im_start);
    if (st == KVARN_OK) st = encode_text(c, buf, lr + 1 + lc, 0);
    kvarn__free(&t->alloc, buf);
    if (st == KVARN_OK) st = sink_push(&c->out, t->im_end);
    if (st == KVARN_OK) st = encode_text(c, "\n", 1, 0);
    return st;
}

kvarn_status kvarn_tokenizer_encode_chat(const kvarn_tokenizer *t,
                                         const kvarn_chat_message *msgs, size_t n,
                                         const char *default_system,
                                         int add_generation_prompt, int32_t **ids,
                                         size_t *n_ids)
{
    if (ids) *ids = NULL;
    if (n_ids) *n_ids = 0;
    if (!t || !ids || !n_ids || (!msgs && n > 0)) return KVARN_ERR_INVALID_ARG;
    for (size_t i = 0; i < n; i++)
        if (!msgs[i].role || !msgs[i].content || !msgs[i].role[0])
            return KVARN_ERR_INVALID_ARG;
    if (t->im_start < 0 || t->im_end < 0) return KVARN_ERR_UNSUPPORTED;
    encode_ctx c;
    kvarn_status st = ctx_init(&c, t);
    c.out = (sink){NULL, 0, 0, 1, &t->alloc};
    if (st == KVARN_OK && default_system && (n == 0 || strcmp(msgs[0].role, "system")))
        st = chat_message(&c, "system", default_system);
    for (size_t i = 0; i < n && st == KVARN_OK; i++)
        st = chat_message(&c, msgs[i].role, msgs[i].content);
    if (st == KVARN_OK && add_generation_prompt) {
        st = sink_push(&c.out, t->im_start);
        if (st == KVARN_OK) st = encode_text(&c, "assistant\n", 10, 0);
    }
    ctx_release(&c);
    if (st != KVARN_OK) {
        kvarn__free(&t->alloc, c.out.ids);
        return st;
    }
    *ids = c.out.ids;
    *n_ids = c.out.n;
    return KVARN_OK;
}

/* ------------------------------------------------------------------------ */
/* Decoding                                                                 */
/* ------------------------------------------------------------------------ */

static int skipped(const kvarn_tokenizer *t, int32_t id, unsigned flags)
{
    return (flags & KVARN_DETOKENIZE_SKIP_SPECIAL) &&
           (t->type[id] == KVARN_TOKEN_CONTROL || t->type[id] == KVARN_TOKEN_UNKNOWN);
}

kvarn_status kvarn_tokenizer_decode(const kvarn_tokenizer *t, const int32_t *ids,
                                    size_t n, unsigned flags, char *out, size_t cap,
                                    size_t *out_len)
{
    if (out_len) *out_len = 0;
    if (!t || !out_len || (!ids && n > 0) || (!out && cap > 0) ||
        (flags & ~KVARN_DETOKENIZE_SKIP_SPECIAL))
        return KVARN_ERR_INVALID_ARG;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_vocab) return KVARN_ERR_INVALID_ARG;
        if (!skipped(t, ids[i], flags)) total += t->dec_off[ids[i] + 1] - t->dec_off[ids[i]];
    }
    *out_len = total;
    if (total > cap) return KVARN_ERR_BUFFER_TOO_SMALL;
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        if (skipped(t, ids[i], flags)) continue;
        size_t l = t->dec_off[ids[i] + 1] - t->dec_off[ids[i]];
        if (l) memcpy(out + o, t->dec + t->dec_off[ids[i]], l);
        o += l;
    }
    return KVARN_OK;
}

/* ------------------------------------------------------------------------ */
/* Queries                                                                  */
/* ------------------------------------------------------------------------ */

int32_t kvarn_tokenizer_n_vocab(const kvarn_tokenizer *t) { return t ? t->n_vocab : 0; }
int32_t kvarn_tokenizer_bos(const kvarn_tokenizer *t) { return t ? t->bos : -1; }
int32_t kvarn_tokenizer_eos(const kvarn_tokenizer *t) { return t ? t->eos : -1; }
int32_t kvarn_tokenizer_pad(const kvarn_tokenizer *t) { return t ? t->pad : -1; }
int32_t kvarn_tokenizer_unk(const kvarn_tokenizer *t) { return t ? t->unk : -1; }
int kvarn_tokenizer_add_bos(const kvarn_tokenizer *t) { return t ? t->add_bos : 0; }

const char *kvarn_tokenizer_pre(const kvarn_tokenizer *t)
{
    return t ? kvarn_pretok_name(t->pretok) : "gpt2";
}

const char *kvarn_tokenizer_token_text(const kvarn_tokenizer *t, int32_t id, size_t *len)
{
    if (!t || id < 0 || id >= t->n_vocab) return NULL;
    size_t l;
    const char *s = tok_str(t, id, &l);
    if (len) *len = l;
    return s;
}

kvarn_token_type kvarn_tokenizer_token_type(const kvarn_tokenizer *t, int32_t id)
{
    if (!t || id < 0 || id >= t->n_vocab) return KVARN_TOKEN_UNDEFINED;
    return (kvarn_token_type)t->type[id];
}

int kvarn_tokenizer_is_end_of_generation(const kvarn_tokenizer *t, int32_t id)
{
    if (!t || id < 0 || id >= t->n_vocab) return 0;
    if (id == t->eos) return 1;
    if (t->type[id] != KVARN_TOKEN_CONTROL) return 0;
    static const char *const k_end[] = {"<|im_end|>", "<|endoftext|>", "<|eot_id|>"};
    size_t l;
    const char *s = tok_str(t, id, &l);
    for (size_t i = 0; i < sizeof k_end / sizeof k_end[0]; i++)
        if (l == strlen(k_end[i]) && !memcmp(s, k_end[i], l)) return 1;
    return 0;
}
