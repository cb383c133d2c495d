/* eval_coverage.c -- see eval_coverage.h. */
#include "eval_coverage.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* Append to w->text, printf-style (cut at its size). */
static void put(eval_warning *w, const char *fmt, ...)
{
    size_t at = strlen(w->text);
    if (at + 1 >= sizeof w->text) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->text + at, sizeof w->text - at, fmt, ap);
    va_end(ap);
}

long eval_quantized_tokens(const kvarn_cache_info *info, long n)
{
    if (n <= 0) return 0;
    if (!info->format.per_tile) return n;
    const long G = info->block_size;
    long q = n / G * G - info->sink_tokens;
    return q > 0 ? q : 0;
}

/* The first token from which a chunk start sees quantized history: 1 for
 * per-token formats, else the end of the first tile past the sink,
 * (floor(S / G) + 1) * G. */
static long first_quantized_end(const kvarn_cache_info *info)
{
    if (!info->format.per_tile) return 1;
    const long G = info->block_size;
    return ((long)info->sink_tokens / G + 1) * G;
}

/* Tokens [0, measured_end) are the chunk-fed positions scored: those before
 * the decode part, and never the window's last token. */
static long chunk_measured_end(long ctx, long decode_tokens)
{
    return ctx - (decode_tokens > 1 ? decode_tokens : 1);
}

/* The start of the last chunk (of chunk tokens) holding a position below
 * measured_end >= 1. */
static long last_chunk_start(long measured_end, long chunk)
{
    return (measured_end - 1) / chunk * chunk;
}

/* The formats' names, comma-separated, into buf[len]. */
static void add_name(char *buf, size_t len, const char *name)
{
    size_t at = strlen(buf);
    snprintf(buf + at, len - at, "%s%s", at ? ", " : "", name);
}

/* The KVarN formats' sink: the largest sink S' < base that would make
 * floor(c / G) * G > S' (base = floor(c / G) * G, the tiles a chunk start
 * c or decoded position sees); -1 when no S' helps some affected format
 * (a per-token format, or base 0). */
static long sink_fix(long cur, const kvarn_cache_info *info, long base)
{
    if (cur < 0 || !info->format.per_tile || base < 1) return -1;
    long s = base - 1;
    return cur == 0x7fffffffL || s < cur ? s : cur;
}

static void put_fixes(eval_warning *w, long ctx_min, long decode_max, long chunk_max, long sink_max)
{
    put(w, " To measure them: --ctx %ld or more", ctx_min);
    if (decode_max >= 1) put(w, ", or --decode-tokens %ld or less", decode_max);
    if (chunk_max >= 1) put(w, ", or --chunk %ld or less", chunk_max);
    if (sink_max >= 0) put(w, ", or --sink-tokens %ld or less", sink_max);
    put(w, ".");
}

/* The chunk-fed columns: 1 and *w filled when some format's measure
 * nothing quantized, else 0. */
static int warn_chunk_fed(const eval_layout *l, const kvarn_cache_info *infos, int nf,
                          eval_warning *w)
{
    const long end = chunk_measured_end(l->ctx, l->decode_tokens);
    const long c_last = last_chunk_start(end, l->chunk);
    char names[512] = "";
    long ctx_min = 0, decode_max = 0x7fffffffL, chunk_max = 0x7fffffffL, sink_max = 0x7fffffffL;
    int any_kvarn = 0;
    for (int f = 0; f < nf; f++) {
        const kvarn_cache_info *in = &infos[f];
        if (in->format.kind == KVARN_KIND_FP16 || eval_quantized_tokens(in, c_last) > 0) continue;
        add_name(names, sizeof names, in->format.name);
        w->formats |= 1ull << f;
        any_kvarn |= in->format.per_tile;
        /* the first chunk start past the first quantized token, with the
         * chunk a longer window would use (the one asked for) */
        const long q0 = first_quantized_end(in);
        const long asked = l->asked_chunk > 0 ? l->asked_chunk : l->chunk;
        const long c_star = (q0 + asked - 1) / asked * asked;
        const long d = l->asked_decode_tokens > 1 ? l->asked_decode_tokens : 1;
        if (c_star + 1 + d > ctx_min) ctx_min = c_star + 1 + d;
        /* at this --ctx and --chunk: decode fewer tokens */
        const long c_here = (q0 + l->chunk - 1) / l->chunk * l->chunk;
        const long dm = l->ctx - c_here - 1;
        if (dm < decode_max) decode_max = dm;
        /* at this --ctx and --decode-tokens: smaller chunks */
        long cm = 0;
        for (long c = l->chunk - 1; c >= 1 && cm == 0; c--)
            if (eval_quantized_tokens(in, last_chunk_start(end, c)) > 0) cm = c;
        if (cm < chunk_max) chunk_max = cm;
        const long G = in->block_size;
        sink_max = sink_fix(sink_max, in, in->format.per_tile ? c_last / G * G : 0);
    }
    if (names[0] == '\0') return 0;
    put(w, "the chunk-fed columns (KLD mean, median, p99, max, top-1) of %s "
           "measure no quantized K/V, so they read about 0: the last chunk with a scored "
           "position starts at token %ld%s, and no token before it is held in the format (a "
           "chunk attends to its own K/V exactly%s).",
           names, c_last, c_last == 0 ? " (one chunk: --ctx minus --decode-tokens is at most "
                                        "--chunk)" : "",
           any_kvarn ? "; KVarN keeps the sink tokens and the tail tile, until its last token "
                       "arrives, in fp16" : "");
    put_fixes(w, ctx_min, decode_max, chunk_max, sink_max == 0x7fffffffL ? -1 : sink_max);
    return 1;
}

/* The decoded columns: KVarN formats whose decoded positions see only the
 * sink and the tail (per-token formats hold each decoded token encoded). */
static int warn_decoded(const eval_layout *l, const kvarn_cache_info *infos, int nf,
                        eval_warning *w)
{
    if (l->decode_tokens < 2) return 0;
    const long last = l->ctx - 2; /* the last decoded position scored */
    char names[512] = "";
    long ctx_min = 0, sink_max = 0x7fffffffL;
    for (int f = 0; f < nf; f++) {
        const kvarn_cache_info *in = &infos[f];
        if (!in->format.per_tile || eval_quantized_tokens(in, last) > 0) continue;
        add_name(names, sizeof names, in->format.name);
        w->formats |= 1ull << f;
        /* position p sees tiles below floor(p / G) * G; p = ctx - 2 */
        if (first_quantized_end(in) + 2 > ctx_min) ctx_min = first_quantized_end(in) + 2;
        sink_max = sink_fix(sink_max, in, last / in->block_size * in->block_size);
    }
    if (names[0] == '\0') return 0;
    put(w, "the decoded columns (dec KLD, dec top1) of %s measure no "
           "quantized K/V, so they read about 0: up to the window's last token every token is "
           "held in fp16 (the sink tokens, and the tail tile until its last token arrives).",
           names);
    put_fixes(w, ctx_min, 0, 0, sink_max == 0x7fffffffL ? -1 : sink_max);
    return 1;
}

int eval_coverage_check(const eval_layout *l, const kvarn_cache_info *infos, int nf,
                        eval_warning out[EVAL_COVERAGE_MAX])
{
    if (nf > 64) nf = 64; /* formats are bits of a uint64_t */
    memset(out, 0, EVAL_COVERAGE_MAX * sizeof *out);
    int n = 0;
    n += warn_chunk_fed(l, infos, nf, &out[n]);
    n += warn_decoded(l, infos, nf, &out[n]);
    if (l->decode_tokens == 1) {
        put(&out[n], "--decode-tokens 1 scores no decoded position (the window's last token has "
                     "no next token to predict), so the dec KLD and dec top1 columns read '-': "
                     "use --decode-tokens 2 or more (0 skips decoding).");
        out[n].formats = nf == 64 ? ~0ull : (1ull << nf) - 1; /* every format's */
        n++;
    }
    return n;
}
