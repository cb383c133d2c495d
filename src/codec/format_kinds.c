/*
 * format_kinds.c -- the table of format kinds: one row of facts and
 * operations per kvarn_kind (format_kinds.h). format.c (names, head_dim,
 * record layout) and codec.c (encode, decode) read the row instead of
 * switching on the kind. Sources: ../shared/spec/KVARN.md (presets, record
 * layout, padding), docs/formats.md (per-token formats).
 */
#include <stdio.h>
#include <string.h>

#include "codec/codec_internal.h"
#include "codec/format_kinds.h"

static int valid_bits(int b) { return b == 2 || b == 4 || b == 8; }
static int valid_tile(int g) { return g == 32 || g == 64 || g == 128; }

/* Parse "kvarn_k{kb}v{vb}_g{G}" strictly: single-digit bits, G in
 * {32, 64, 128}, then nothing, or "c" (the mean-centred variant) and
 * nothing. */
static int parse_kvarn(const char *s, kvarn_format *out)
{
    int kb, vb, g;
    if (strncmp(s, "kvarn_k", 7) != 0) return 0;
    s += 7;
    if (s[0] < '0' || s[0] > '9' || s[1] != 'v') return 0;
    kb = s[0] - '0';
    s += 2;
    if (s[0] < '0' || s[0] > '9' || s[1] != '_' || s[2] != 'g') return 0;
    vb = s[0] - '0';
    s += 3;
    int centred = 0;
    if (strncmp(s, "32", 2) == 0) g = 32, s += 2;
    else if (strncmp(s, "64", 2) == 0) g = 64, s += 2;
    else if (strncmp(s, "128", 3) == 0) g = 128, s += 3;
    else return 0;
    if (s[0] == 'c') centred = 1, s++;
    if (s[0] != '\0') return 0;
    if (!valid_bits(kb) || !valid_bits(vb)) return 0;
    kvarn_format f;
    memset(&f, 0, sizeof f);
    f.kind = KVARN_KIND_KVARN;
    snprintf(f.name, sizeof f.name, "kvarn_k%dv%d_g%d%s", kb, vb, g, centred ? "c" : "");
    f.tile_tokens = g;
    f.key_bits = kb;
    f.value_bits = vb;
    f.per_tile = 1;
    f.centred = centred;
    *out = f;
    return 1;
}

static int is_pow2(size_t x) { return x && (x & (x - 1)) == 0; }

/* KVarN records (../shared/spec/KVARN.md "Record layout"): padded to 8
 * bytes; for D >= 256 further to G times a power of two, so that the bytes
 * per token of a record are a power of two. */
static size_t kvarn_record_bytes_of(size_t payload, size_t D, size_t G)
{
    size_t rec = (payload + 7) & ~(size_t)7;
    if (D >= 256) {
        size_t per_tok = (rec + G - 1) / G;
        while (!is_pow2(per_tok)) per_tok++;
        rec = per_tok * G;
    }
    return rec;
}

/* Per-token kinds serve any even head_dim in [2, 1024] (the stack rows of
 * per_token.c); KVarN D in {64, 128, 256, 512} (the fast Walsh-Hadamard
 * needs a power of two; 512 is upstream's largest; docs/formats.md). */
#define TOKEN_DIMS 2, 1024, 2, 0
#define TOKEN_GEOMETRY(BITS) 0, 1, BITS, BITS, NULL, TOKEN_DIMS
#define META_NONE {0, 0, 0, 0, 0, 0, 0}
/* fp8: one fp16 scale per K row and per V row */
#define META_SCALE {KVARN_META_ONE, 0, 0, 0, KVARN_META_ONE, 0, 0}
/* int: an fp16 scale and zero-point per K row and per V row */
#define META_SCALE_ZERO {KVARN_META_ONE, KVARN_META_ONE, 0, 0, KVARN_META_ONE, KVARN_META_ONE, 0}

/* Indexed by kvarn_kind (designated, so a row cannot land on another kind's
 * index); tests/codec/test_format.c walks it. */
static const kvarn_kind_ops k_kinds[KVARN_KIND_COUNT] = {
    [KVARN_KIND_FP16] = {KVARN_KIND_FP16, "fp16", TOKEN_GEOMETRY(16), META_NONE, NULL, NULL,
                         kvarn__fp16_encode, kvarn__fp16_decode},
    [KVARN_KIND_BF16] = {KVARN_KIND_BF16, "bf16", TOKEN_GEOMETRY(16), META_NONE, NULL, NULL,
                         kvarn__bf16_encode, kvarn__bf16_decode},
    [KVARN_KIND_FP8_E4M3] = {KVARN_KIND_FP8_E4M3, "fp8_e4m3", TOKEN_GEOMETRY(8), META_SCALE,
                             NULL, NULL, kvarn__fp8_e4m3_encode, kvarn__fp8_e4m3_decode},
    [KVARN_KIND_FP8_E5M2] = {KVARN_KIND_FP8_E5M2, "fp8_e5m2", TOKEN_GEOMETRY(8), META_SCALE,
                             NULL, NULL, kvarn__fp8_e5m2_encode, kvarn__fp8_e5m2_decode},
    [KVARN_KIND_INT8] = {KVARN_KIND_INT8, "int8", TOKEN_GEOMETRY(8), META_SCALE_ZERO, NULL, NULL,
                         kvarn__int8_encode, kvarn__int8_decode},
    [KVARN_KIND_INT4] = {KVARN_KIND_INT4, "int4", TOKEN_GEOMETRY(4), META_SCALE_ZERO, NULL, NULL,
                         kvarn__int4_encode, kvarn__int4_decode},
    /* K: codes [D][G] channel-major, a_d, b_d per channel, s_tok per token;
     * V: codes [G][D], s_chan per channel, a_t, b_t per token; centred
     * formats: V's channel means mu_d. */
    [KVARN_KIND_KVARN] = {KVARN_KIND_KVARN, "kvarn", 1, 0, 0, 0, parse_kvarn, 64, 512, 64, 1,
                          {KVARN_META_PER_CHANNEL, KVARN_META_PER_CHANNEL, KVARN_META_PER_TOKEN,
                           KVARN_META_PER_CHANNEL, KVARN_META_PER_TOKEN, KVARN_META_PER_TOKEN,
                           KVARN_META_PER_CHANNEL},
                          kvarn_record_bytes_of, kvarn__tile_workspace_bytes,
                          kvarn__tile_encode, kvarn__tile_decode,
                          1 /* its range checks on loading reject NaN / Inf */},
};

const kvarn_kind_ops *kvarn__kind_ops(kvarn_kind kind)
{
    return (unsigned)kind < KVARN_KIND_COUNT ? &k_kinds[kind] : NULL;
}

int kvarn__format_valid(const kvarn_format *f)
{
    const kvarn_kind_ops *op = f ? kvarn__kind_ops(f->kind) : NULL;
    if (op == NULL) return 0;
    /* A fixed width must match: the kind's codec writes that many bits
     * whatever the format says, and the record layout is sized from the
     * format (a per-token format of the wrong width would be encoded past
     * its record). */
    return (op->tile_tokens ? f->tile_tokens == op->tile_tokens : valid_tile(f->tile_tokens)) &&
           (op->key_bits ? f->key_bits == op->key_bits : valid_bits(f->key_bits)) &&
           (op->value_bits ? f->value_bits == op->value_bits : valid_bits(f->value_bits)) &&
           (f->centred == 0 || (f->centred == 1 && op->meta.v_mu != KVARN_META_NONE));
}
