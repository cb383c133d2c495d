/*
 * kernel_avx512_int8.c -- the AVX-512 int8 and int4 per-token tile kernels
 * (attn_avx512_token_int8, attn_avx512_token_int4): K and V in int16 dot
 * products against a query and weights rounded per row
 * (docs/attention-intdot.md "int8: integer dot products"; int4's codes
 * widened to bytes 16 c + 8 first, "int4: its codes widened"), the fp32
 * per-token loop (kernel_avx512.h token_tile_body) where the int32 sums
 * could overflow. Built twice: alone, and by kernel_avx512_vnni.c with
 * KVARN_AVX512_VNNI defined (attn_avx512vnni_token_int8 / _int4:
 * vpdpwssd, and vpdpbusd K on int8 digits); the #ifdef KVARN_AVX512_VNNI
 * blocks hold what only that build has. kernel_avx512.h describes the
 * family.
 */
#include "attn/kernel_avx512.h"

/* ------------------------------------- int8 per-token: int16 dot products
 *
 * The int8 per-token kernel multiplies in int16 (dot_i16: vpmaddwd +
 * vpaddd, or one vpdpwssd in the VNNI build) instead of converting every
 * code to fp32 (docs/attention-intdot.md "int8: integer dot products"):
 *   K: per span and row the query q' (softmax scale folded) is rounded,
 *     q'_d ~ sq qi_d, sq = max_d |q'_d| / I8_QMAX (i8_round_query); the codes
 *     (0..255, zero-extended to words) of 4 tokens x 32 channels meet the
 *     query words of those channels, int32 lanes summed across at the end
 *     (i8_red4 / i8_red16). The codes are centred at 128 in the integer
 *     sum (exact): sum_d qi_d (c_d - 128) = acc_t - 128 sum_d qi_d, so
 *       s_t = scale_t sq (acc_t - 128 sum qi) + (zero_t + 128 scale_t) sum_d q'_d
 *     and the rounding of the query errs by sum_d e_d (c_d - 128), |c - 128|
 *     <= 128 (half what uncentred codes would give).
 *   V: the weights w_t = p_t scale_t of each row are rounded per span,
 *     w_t ~ sw wi_t, sw = max_t w_t / I8_QMAX (i8_round_weights); the codes
 *     of tokens t and t + 1 are interleaved into (c_t, c_t+1) word pairs
 *     per channel and meet the broadcast pair (wi_t, wi_t+1); again
 *     centred: acc_d += sw (sum_t wi_t c_td - 128 sum_t wi_t)
 *                       + sum_t p_t (zero_t + 128 scale_t).
 * Int32 sums: |qi|, |wi| <= 32767 and codes <= 255 give |sum| <= 255 x
 * 32767 x n for n products, < 2^31 - 1 for n <= 257: K needs D <= 256 and
 * V spans of nt <= 256 tokens (i8_ok); the centred sums are smaller still.
 * Exact either way, so the two builds give the same bits.
 *   int4 records: each span's codes c widened to bytes 16 c + 8 (i4_widen)
 *     and taken as int8 codes with scale_t / 16 and zero_t + 7.5 scale_t
 *     (the same values: 16 c + 8 - 128 = 16 (c - 7.5)); bytes <= 248, so
 *     the bounds above hold.
 *   Items of more than one row block (prefill, verification): the VNNI
 *     build transposes a span's K codes once (i8v_transpose_span) instead
 *     of once per row block: the same vectors, the same bits. */

/* The largest int16 query / weight magnitude: 127 x 256 + 127, so that a
 * value also splits into two signed bytes, (v + 128) >> 8 and the rest,
 * for vpdpbusd (i8v_kdots16); 0.4% below 32767, i.e. a step 1.004 times
 * as large. */
#define I8_QMAX 32639.0f

/* A row's slots in its qa scratch (float index) after the rounded query
 * (i8_round_query: 2D bytes of digits or D int16): sq, sum_d qi_d (int32),
 * then per span sw, sum_t wi_t (int32) and the largest visible score;
 * D >= 32 at this level, so all lie below D. */
#define I8_SQ(D) ((D) / 2)
#define I8_QS(D) ((D) / 2 + 1)
#define I8_SW(D) ((D) / 2 + 2)
#define I8_WS(D) ((D) / 2 + 3)
#define I8_MX(D) ((D) / 2 + 4)

/* The VNNI build's K dots where D % 64 == 0 (i8v_kdots16): the codes of 16
 * tokens transposed so that each 32-bit lane is one token (4 channels of
 * it), and vpdpbusd (u8 codes x s8) against the broadcast digit bytes of
 * the query (i8_round_query: qi = 256 hi + lo): no widening to words and
 * no sum across lanes. sum_d qi_d c_d = 256 sum hi c + sum lo c, exact in
 * int32, so the scores are the vpmaddwd build's bits. */
#ifdef KVARN_AVX512_VNNI
#define I8_VNNI_K(D) attn_avx512_int8_vnni_k(D)
#else
#define I8_VNNI_K(D) 0
#endif

/* The driver's prefetch list (attn_prefetch) walked with its cursor in
 * locals: the next line and the end of the current tile, the tile index
 * (attn_prefetch_step keeps its cursor in memory, stores the compiler
 * cannot drop). The lines go to L2 (prefetcht1), not L1: with prefetcht0
 * the int8 record stream stopped at ~8.5 GB/s even with no arithmetic at
 * all (a kernel that only touched the lines: SmolLM2 8k 390 us, fp16 10
 * GB/s), with prefetcht1 12.8 GB/s (262 us); the L1 miss buffers, not
 * DRAM, were the limit (docs/attention-intdot.md "int8: integer dot products").
 * Each listed tile is fetched from the line holding its first byte to the
 * line holding its last, so a block off the 64-byte lines (a malloc'ed
 * arena, 16 bytes past a line, as bench_attn's) is fetched whole: listed
 * as it is, a block of G (2D + 8) bytes (a multiple of 64 for G = 16)
 * left its last line, the last token's V scale and zero-point, to a
 * demand miss at the start of the next span (docs/attention-simd.md "What
 * bounds each kernel"). */
typedef struct i8_pf {
    const attn_prefetch *p;
    const uint8_t *cur, *end;
    int tile;
} i8_pf;

/* The start of the 64-byte line holding p (formed as an integer: the line
 * may start before the arena; a prefetch never faults). */
AI const uint8_t *i8_pf_line(const uint8_t *p)
{
    return (const uint8_t *)((uintptr_t)p & ~(uintptr_t)63);
}

AI void i8_pf_init(i8_pf *f, const attn_prefetch *p)
{
    f->p = p;
    f->tile = p->tile;
    f->cur = f->end = NULL;
    if (p->tile < p->n) {
        f->cur = i8_pf_line(p->base[p->tile] + (size_t)p->line * 64);
        f->end = i8_pf_line(p->base[p->tile] + (size_t)p->lines * 64 + 63);
    }
}

/* Issue up to k prefetches. */
AI void i8_pf_step(i8_pf *f, int k)
{
    for (; k > 0; k--) {
        if (f->cur == f->end) {
            if (f->tile + 1 >= f->p->n) return;
            f->tile++;
            f->cur = i8_pf_line(f->p->base[f->tile]);
            f->end = i8_pf_line(f->p->base[f->tile] + (size_t)f->p->lines * 64 + 63);
        }
        __builtin_prefetch(f->cur, 0, 2); /* prefetcht1: into L2 */
        f->cur += 64;
    }
}

/* Lines still to issue. */
AI int i8_pf_left(const i8_pf *f)
{
    if (f->cur == f->end && f->tile + 1 >= f->p->n) return 0;
    return (int)((f->end - f->cur) / 64) + (f->p->n - f->tile - 1) * f->p->lines;
}

/* a, b, c, d: int32 [16] of tokens 0..3 -> lane 4L + j holds part L
 * (lanes 4L..4L+3 of the input) of token j's sum. */
AI __m512i i8_red4(__m512i a, __m512i b, __m512i c, __m512i d)
{
    const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
}

/* Two i8_red4 results (tokens 0..3 and 4..7) -> 128-bit lane 0: half 1 of
 * tokens 0..3, 1: half 2 of them, 2 and 3: the same for tokens 4..7. */
AI __m512i i8_red8(__m512i x, __m512i y)
{
    return _mm512_add_epi32(_mm512_shuffle_i32x4(x, y, 0x88), _mm512_shuffle_i32x4(x, y, 0xdd));
}

/* Two i8_red8 results (tokens 0..7, 8..15) -> the 16 sums in token order. */
AI __m512i i8_red16(__m512i x, __m512i y)
{
    return _mm512_add_epi32(_mm512_shuffle_i32x4(x, y, 0x88), _mm512_shuffle_i32x4(x, y, 0xdd));
}

/* Row i's query for the int8 kernel: qi_d = rne(q'_d / sq), sq = max_d
 * |q'_d| / I8_QMAX; qi int16 [D] at the start of the row's qa scratch,
 * then sq (float index I8_SQ) and sum_d qi_d (I8_QS, int32). A row whose
 * max |q'_d| is below 2^-100 (or 0) gets qi = 0,
 * sq = 0 (its scores keep only the (zero + 128 scale) sum q' term, off by
 * at most 128 scale sum_d |q'_d| < 2^-85 scale D); else I8_QMAX / max is a
 * normal float and |q'_d I8_QMAX / max| <= I8_QMAX (1 + 2^-23) rounds into
 * int16. */
AI void i8_round_query(attn_rows *r, int i)
{
    const int D = r->D;
    const float *q = r->q + (size_t)i * D;
    float *qa = r->qa + (size_t)i * D;
    int16_t *qi = (int16_t *)(void *)qa;
    __m512 mx = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(q + d)));
    const float qmax = _mm512_reduce_max_ps(mx);
    const int ok = qmax >= 0x1p-100f;
    const __m512 inv = _mm512_set1_ps(ok ? I8_QMAX / qmax : 0.0f);
    __m512i sum = _mm512_setzero_si512();
    for (int d = 0; d < D; d += 16) {
        const __m512i x = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(q + d), inv));
        sum = _mm512_add_epi32(sum, x);
        if (I8_VNNI_K(D)) {
            /* qi = 256 hi + lo, hi = (qi + 128) >> 8 in [-127, 127], lo
             * in [-128, 127]: hi at bytes [0, D) of the row, lo at [D, 2D) */
            const __m512i h = _mm512_srai_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(128)), 8);
            const __m512i l = _mm512_sub_epi32(x, _mm512_slli_epi32(h, 8));
            _mm_storeu_si128((__m128i *)(void *)((int8_t *)qa + d), _mm512_cvtepi32_epi8(h));
            _mm_storeu_si128((__m128i *)(void *)((int8_t *)qa + D + d), _mm512_cvtepi32_epi8(l));
        } else {
            _mm256_storeu_si256((__m256i *)(void *)(qi + d), _mm512_cvtsepi32_epi16(x));
        }
    }
    qa[I8_SQ(D)] = ok ? qmax / I8_QMAX : 0.0f;
    const int32_t s = _mm512_reduce_add_epi32(sum);
    memcpy(qa + I8_QS(D), &s, 4);
}

/* Row i's weights (fp32 s[i][0..nv), zero past the visible positions;
 * wmax their largest, from i8_softmax_fold) to int16 in place, wi_t =
 * rne(w_t / sw), sw = wmax / I8_QMAX: wi at the first bytes of the row
 * (zero up to nv rounded up to 16), sw and sum_t wi_t at I8_SW and I8_WS
 * of the row's qa scratch. Weights are >= 0 (p_t >= 0, scale_t > 0). A
 * row whose largest w_t is below 2^-100 (or 0: nothing visible in the
 * span) gets wi = 0, sw = 0: it drops at most 255 nt 2^-100 from acc,
 * against l >= 1. */
AI void i8_round_weights(attn_rows *r, int i, int nv, float wmax)
{
    float *w = r->s + (size_t)i * r->gs, *qa = r->qa + (size_t)i * r->D;
    int16_t *wi = (int16_t *)(void *)w;
    const int ok = wmax >= 0x1p-100f; /* also false for NaN */
    const __m512 inv = _mm512_set1_ps(ok ? I8_QMAX / wmax : 0.0f);
    __m512i sum = _mm512_setzero_si512();
    for (int t = 0; t < nv; t += 16) {
        const __m512i x = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(lanes(nv - t), w + t), inv));
        sum = _mm512_add_epi32(sum, x);
        _mm256_storeu_si256((__m256i *)(void *)(wi + t), _mm512_cvtsepi32_epi16(x));
    }
    const int32_t ws = _mm512_reduce_add_epi32(sum);
    qa[I8_SW(r->D)] = ok ? wmax / I8_QMAX : 0.0f;
    memcpy(qa + I8_WS(r->D), &ws, 4);
}

/* int32 q . code of the 4 tokens k[0..3] (their K codes) for rows
 * [r0, r0 + RB), as i8_red4 of each row. 32 channels per step: each
 * token's codes zero-extended to words once, one dot_i16 per row and token
 * with the row's query words. */
AI void i8_kdots4(const attn_rows *r, i8_pf *f, const uint8_t *const *k, int r0, int RB, int pf,
                  __m512i *out)
{
    const int D = r->D;
    __m512i acc[4][4];
#pragma GCC unroll 4
    for (int i = 0; i < RB; i++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_si512();
    for (int d = 0; d < D; d += 32) {
        i8_pf_step(f, pf);
        __m512i c[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++)
            c[j] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(const void *)(k[j] + d)));
#pragma GCC unroll 4
        for (int i = 0; i < RB; i++) {
            const __m512i q = _mm512_loadu_si512((const void *)((const int16_t *)(const void *)(r->qa + (size_t)(r0 + i) * D) + d));
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) acc[i][j] = dot_i16(acc[i][j], c[j], q);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < RB; i++) out[i] = i8_red4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
}

#ifdef KVARN_AVX512_VNNI

/* x[0..15]: 16 rows of 16 dwords -> x[k] = dword k of every row, row j in
 * lane j (unpack 32 / 64-bit inside 128-bit lanes, then a 4 x 4 transpose
 * of 128-bit blocks). */
AI void i8_transpose16(__m512i *x)
{
    __m512i t[16], u[16];
#pragma GCC unroll 8
    for (int j = 0; j < 16; j += 2) {
        t[j] = _mm512_unpacklo_epi32(x[j], x[j + 1]);
        t[j + 1] = _mm512_unpackhi_epi32(x[j], x[j + 1]);
    }
    /* u[4Q + m]: 128-bit lane L = dword 4L + m of rows 4Q..4Q+3 */
#pragma GCC unroll 4
    for (int Q = 0; Q < 4; Q++) {
        u[4 * Q + 0] = _mm512_unpacklo_epi64(t[4 * Q], t[4 * Q + 2]);
        u[4 * Q + 1] = _mm512_unpackhi_epi64(t[4 * Q], t[4 * Q + 2]);
        u[4 * Q + 2] = _mm512_unpacklo_epi64(t[4 * Q + 1], t[4 * Q + 3]);
        u[4 * Q + 3] = _mm512_unpackhi_epi64(t[4 * Q + 1], t[4 * Q + 3]);
    }
#pragma GCC unroll 4
    for (int m = 0; m < 4; m++) {
        const __m512i a = u[m], b = u[4 + m], c = u[8 + m], d = u[12 + m];
        const __m512i x0 = _mm512_shuffle_i32x4(a, b, 0x44), x1 = _mm512_shuffle_i32x4(c, d, 0x44);
        const __m512i x2 = _mm512_shuffle_i32x4(a, b, 0xee), x3 = _mm512_shuffle_i32x4(c, d, 0xee);
        x[m] = _mm512_shuffle_i32x4(x0, x1, 0x88);      /* dword m */
        x[4 + m] = _mm512_shuffle_i32x4(x0, x1, 0xdd);  /* dword 4 + m */
        x[8 + m] = _mm512_shuffle_i32x4(x2, x3, 0x88);
        x[12 + m] = _mm512_shuffle_i32x4(x2, x3, 0xdd);
    }
}

/* The K codes of the 16 tokens k[0..15] (a token past the span repeats
 * the last), channels [d, d + 64), transposed (i8_transpose16) into
 * x[0..15]. */
AI void i8v_load16(const uint8_t *const *k, int d, __m512i *x)
{
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) x[j] = _mm512_loadu_si512((const void *)(k[j] + d));
    i8_transpose16(x);
}

/* The span's K codes transposed once (items of more than one row block:
 * each block would transpose them again): 16 tokens' channels [d, d +
 * 64) as i8v_load16 forms them, at kt + (g D + d) 16 bytes for the tokens'
 * group g (tokens 16 g .. 16 g + 15), vector kk 64 bytes further per kk;
 * nt rounded up to 16 tokens of D bytes. */
AI void i8v_transpose_span(const uint8_t *const *ctok, size_t koff, int nt, int D, uint8_t *kt)
{
    for (int t = 0; t < nt; t += 16) {
        const uint8_t *k[16];
        for (int j = 0; j < 16; j++) k[j] = ctok[t + j < nt ? t + j : nt - 1] + koff;
        for (int d = 0; d < D; d += 64) {
            __m512i x[16];
            i8v_load16(k, d, x);
            uint8_t *o = kt + ((size_t)t * D + (size_t)d * 16);
#pragma GCC unroll 16
            for (int kk = 0; kk < 16; kk++) _mm512_storeu_si512((void *)(o + 64 * kk), x[kk]);
        }
    }
}

/* int32 q . code of the 16 tokens k[0..15] for rows [r0, r0 + RB), lane j
 * = token j; kt: NULL, or their codes as i8v_transpose_span left them (the
 * 16 tokens' group). */
AI void i8v_kdots16(const attn_rows *r, i8_pf *f, const uint8_t *const *k, const uint8_t *kt, int r0,
                    int RB, int pf, __m512i *out)
{
    const int D = r->D;
    __m512i hi[4], lo[4];
#pragma GCC unroll 4
    for (int i = 0; i < RB; i++) hi[i] = lo[i] = _mm512_setzero_si512();
    const int pf4 = (pf + 3) / 4; /* spread over the step: a burst stalls */
    for (int d = 0; d < D; d += 64) {
        __m512i x[16];
        if (kt != NULL) {
#pragma GCC unroll 16
            for (int kk = 0; kk < 16; kk++)
                x[kk] = _mm512_loadu_si512((const void *)(kt + (size_t)d * 16 + 64 * kk));
        } else {
            i8v_load16(k, d, x);
        }
#pragma GCC unroll 16
        for (int kk = 0; kk < 16; kk++) {
            if ((kk & 3) == 0) i8_pf_step(f, pf4);
#pragma GCC unroll 4
            for (int i = 0; i < RB; i++) {
                const uint8_t *dg = (const uint8_t *)(const void *)(r->qa + (size_t)(r0 + i) * D);
                hi[i] = dot_u8s8(hi[i], x[kk], _mm512_set1_epi32((int)load_u32(dg + d + 4 * kk)));
                lo[i] = dot_u8s8(lo[i], x[kk], _mm512_set1_epi32((int)load_u32(dg + D + d + 4 * kk)));
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < RB; i++) out[i] = _mm512_add_epi32(_mm512_slli_epi32(hi[i], 8), lo[i]);
}
#endif

/* The raw fp16 (scale, zero) words of K and V of tokens [t, min(t + 16,
 * nt)) into kw[t..], vw[t..] (k_b follows k_a, v_b follows v_a). */
AI void i8_meta_words(const uint8_t *const *tok, const kvarn_record_layout *L, int t, int nt,
                      uint32_t *kw, uint32_t *vw)
{
    const int e = t + 16 < nt ? t + 16 : nt;
    for (int j = t; j < e; j++) {
        memcpy(&kw[j], tok[j] + L->k_a_off, 4);
        memcpy(&vw[j], tok[j] + L->v_a_off, 4);
    }
}

/* Scores of rows [r0, r0 + RB) (RB <= 4) over the span's nt tokens, the
 * codes of token t at ctok[t] + koff, its scale and zero-point in the
 * record tok[t] (L): s[i][t] = scale_t sq_i (acc_t - 128 sum qi) + zc_t
 * qsum_i, zc_t = zero_t + 128 scale_t (int4, codes widened to 16 c + 8:
 * scale_t / 16 for scale_t, zc_t = zero_t + 7.5 scale_t), and the
 * largest score of each row's visible positions
 * (I8_MX of its qa scratch, -inf where none). 16 tokens per step (a token
 * past nt repeats the last one; its score is not stored). The first row
 * block (first != 0) also converts the tokens' scales and zero-points:
 * their raw words, read one step ahead (i8_meta_words, into the zc and vz
 * arrays), become ks = scale_K, zc, vs = scale_V and vz = zero_V + 128
 * scale_V (int4: as zc), zero past nt (up to nt rounded up to 8); later blocks read ks
 * and zc back. */
AI void i8_kblock(attn_rows *r, i8_pf *f, const uint8_t *const *tok, const uint8_t *const *ctok,
                  size_t koff, const uint8_t *kt, const kvarn_record_layout *L, int t0, int nt,
                  int r0, int RB, float *meta, int first, int int4)
{
    const int D = r->D, gs = r->gs, nv = (nt + 7) & ~7;
    /* int4: codes widened to 16 c + 8 (i4_widen), so scale c + zero =
     * (scale / 16) (16 c + 8 - 128) + (zero + 7.5 scale) */
    const __m512 cm = _mm512_set1_ps(int4 ? 0.0625f : 1.0f), cz = _mm512_set1_ps(int4 ? 7.5f : 128.0f);
    float *ks = meta, *zc = ks + gs, *vs = zc + gs, *vz = vs + gs;
    uint32_t *kw = (uint32_t *)(void *)zc, *vw = (uint32_t *)(void *)vz;
    /* half the next span's prefetches, spread over every 32-channel step;
     * i8_vsum issues the rest */
    const int steps = I8_VNNI_K(D) ? (nt + 15) / 16 * (D / 64) : (nt + 3) / 4 * (D / 32);
    const int per = steps > 0 ? (i8_pf_left(f) / 2 + steps - 1) / steps : 0;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 mx[4];
    __m512i va[4], vb[4]; /* visible: va < t0 + t + lane < vb, as offsets from t0 */
#pragma GCC unroll 4
    for (int i = 0; i < RB; i++) {
        mx[i] = _mm512_set1_ps(-INFINITY);
        va[i] = _mm512_set1_epi32(r->lo[r0 + i] - t0 - 1);
        vb[i] = _mm512_set1_epi32(r->hi[r0 + i] - t0 + 1);
    }
    if (first) i8_meta_words(tok, L, 0, nt, kw, vw);
    for (int t = 0; t < nt; t += 16) {
        const __mmask16 in = lanes(nt - t);
        __m512 kst, zct;
        if (first) {
            const __m512i k32 = _mm512_maskz_loadu_epi32(in, kw + t), v32 = _mm512_maskz_loadu_epi32(in, vw + t);
            i8_meta_words(tok, L, t + 16, nt, kw, vw); /* the next step's */
            const __m512 ka = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(k32));
            const __m512 kb = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(k32, 16)));
            const __m512 sa = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v32));
            const __m512 sb = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v32, 16)));
            const __mmask16 keep = lanes(nv - t);
            kst = _mm512_mul_ps(ka, cm); /* exact: a power of two */
            zct = _mm512_fmadd_ps(ka, cz, kb);
            _mm512_mask_storeu_ps(ks + t, keep, kst);
            _mm512_mask_storeu_ps(zc + t, keep, zct);
            _mm512_mask_storeu_ps(vs + t, keep, _mm512_mul_ps(sa, cm));
            _mm512_mask_storeu_ps(vz + t, keep, _mm512_fmadd_ps(sa, cz, sb));
        } else {
            kst = _mm512_maskz_loadu_ps(in, ks + t);
            zct = _mm512_maskz_loadu_ps(in, zc + t);
        }
        __m512i sums[4];
#ifdef KVARN_AVX512_VNNI
        if (I8_VNNI_K(D)) {
            const uint8_t *k[16];
            for (int j = 0; j < 16; j++) k[j] = ctok[t + j < nt ? t + j : nt - 1] + koff;
            i8v_kdots16(r, f, k, kt ? kt + (size_t)t * D : NULL, r0, RB, per, sums);
        } else
#endif
        {
        __m512i h[2][4];
#pragma GCC unroll 2
        for (int half = 0; half < 2; half++) {
            __m512i g[2][4];
#pragma GCC unroll 2
            for (int b = 0; b < 2; b++) {
                const int tb = t + 8 * half + 4 * b;
                const uint8_t *k[4];
                for (int j = 0; j < 4; j++) k[j] = ctok[tb + j < nt ? tb + j : nt - 1] + koff;
                if (tb < nt) {
                    i8_kdots4(r, f, k, r0, RB, per, g[b]);
                } else {
#pragma GCC unroll 4
                    for (int i = 0; i < RB; i++) g[b][i] = _mm512_setzero_si512();
                }
            }
#pragma GCC unroll 4
            for (int i = 0; i < RB; i++) h[half][i] = i8_red8(g[0][i], g[1][i]);
        }
#pragma GCC unroll 4
        for (int i = 0; i < RB; i++) sums[i] = i8_red16(h[0][i], h[1][i]);
        }
        const __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32(t));
#pragma GCC unroll 4
        for (int i = 0; i < RB; i++) {
            const float *qa = r->qa + (size_t)(r0 + i) * D;
            int32_t qs;
            memcpy(&qs, qa + I8_QS(D), 4);
            const __m512i sum = _mm512_sub_epi32(sums[i], _mm512_set1_epi32(128 * qs));
            const __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(qa[I8_SQ(D)]));
            const __m512 s = _mm512_fmadd_ps(kst, a, _mm512_mul_ps(zct, _mm512_set1_ps(r->qsum[r0 + i])));
            _mm512_mask_storeu_ps(r->s + (size_t)(r0 + i) * gs + t, in, s);
            const __mmask16 ok = in & _mm512_cmpgt_epi32_mask(idx, va[i]) & _mm512_cmpgt_epi32_mask(vb[i], idx);
            mx[i] = _mm512_mask_max_ps(mx[i], ok, mx[i], s);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < RB; i++) r->qa[(size_t)(r0 + i) * D + I8_MX(D)] = _mm512_reduce_max_ps(mx[i]);
}

/* Row i's online-softmax step over the span and its V weights, in one
 * pass over the scores (the operations of softmax_row_avx512, then
 * fold_weights, then the max of i8_round_weights, in their order, so the
 * same bits): p_t = exp(s_t - m_new) on the visible positions (0
 * elsewhere), l and acc rescaled, rc[i] = sum_t p_t vz_t, w_t = p_t vs_t
 * in place of s, and max_t w_t returned. The running max comes from
 * i8_kblock (I8_MX). The rescale's expf is skipped when the max did not
 * move (expf(0) = 1). */
AI float i8_softmax_fold(attn_rows *r, int i, int t0, int nt, const float *vs, const float *vz)
{
    const int D = r->D, gs = r->gs, nv = (nt + 7) & ~7;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    float *s = r->s + (size_t)i * gs;
    int a, b;
    if (!attn_row_visible(r, i, t0, nt, &a, &b)) {
        for (int t = 0; t < nv; t += 16) _mm512_mask_storeu_ps(s + t, lanes(nv - t), _mm512_setzero_ps());
        r->rc[i] = 0.0f;
        return 0.0f;
    }
    const __m512i vai = _mm512_set1_epi32(a - 1), vbi = _mm512_set1_epi32(b);
    const float mt = r->qa[(size_t)i * D + I8_MX(D)], m_old = r->m[i];
    const float m_new = mt > m_old ? mt : m_old;
    const float corr = m_old == -INFINITY ? 0.0f : m_new == m_old ? 1.0f : expf(m_old - m_new);
    const __m512 vm = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps(), z = _mm512_setzero_ps(), wmx = _mm512_setzero_ps();
    for (int t = 0; t < nv; t += 16) {
        const __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32(t));
        const __mmask16 ok = _mm512_cmpgt_epi32_mask(idx, vai) & _mm512_cmpgt_epi32_mask(vbi, idx);
        const __mmask16 in = lanes(nv - t);
        const __m512 p = _mm512_maskz_mov_ps(ok, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, s + t), vm)));
        sum = _mm512_add_ps(sum, p);
        z = _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(in, vz + t), z);
        const __m512 w = _mm512_mul_ps(p, _mm512_maskz_loadu_ps(in, vs + t));
        _mm512_mask_storeu_ps(s + t, in, w);
        wmx = _mm512_max_ps(wmx, w);
    }
    r->m[i] = m_new;
    r->psum[i] = _mm512_reduce_add_ps(sum);
    r->l[i] = r->l[i] * corr + r->psum[i];
    r->rc[i] = _mm512_reduce_add_ps(z);
    if (corr != 1.0f) {
        float *acc = r->acc + (size_t)i * D;
        const __m512 vc = _mm512_set1_ps(corr);
        for (int d = 0; d < D; d += 16)
            _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), vc));
    }
    return _mm512_reduce_max_ps(wmx);
}

/* acc[i][d0..d0+32 NH) += sw_i (sum_t wi_t c_td - 128 wsum_i) + pz_i for
 * rows [r0, r0 + RB) (sw_i, wsum_i at I8_SW, I8_WS of the
 * row's qa scratch, pz_i in rc), NH halves of 32 channels (1 or 2). Per token pair
 * and half: the 32 code bytes of t and t + 1 interleaved
 * (vpunpck{l,h}bw) and zero-extended to words (vpmovzxbw), so 32-bit lane
 * m of vector e holds channel ch(e, m) of both tokens: e = 0: m < 8: m,
 * else 8 + m; e = 1: m < 8: 8 + m, else 16 + m (the 128-bit lane shuffles
 * at the end restore the order). */
AI void i8_vsum(attn_rows *r, i8_pf *f, const uint8_t *const *tok, size_t voff, int nt, int r0,
                int RB, int d0, int NH)
{
    const int D = r->D, gs = r->gs;
    __m512i acc[5][4];
#pragma GCC unroll 5
    for (int i = 0; i < RB; i++)
#pragma GCC unroll 4
        for (int e = 0; e < 4; e++) acc[i][e] = _mm512_setzero_si512();
    for (int t = 0; t < nt; t += 2) {
        i8_pf_step(f, 2);
        const uint8_t *a = tok[t] + voff + d0, *b = tok[t + 1 < nt ? t + 1 : t] + voff + d0;
        __m512i c[4];
#pragma GCC unroll 2
        for (int hh = 0; hh < NH; hh++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(const void *)(a + 32 * hh));
            const __m256i y = _mm256_loadu_si256((const __m256i *)(const void *)(b + 32 * hh));
            c[2 * hh] = _mm512_cvtepu8_epi16(_mm256_unpacklo_epi8(x, y));
            c[2 * hh + 1] = _mm512_cvtepu8_epi16(_mm256_unpackhi_epi8(x, y));
        }
#pragma GCC unroll 5
        for (int i = 0; i < RB; i++) {
            int32_t wp;
            memcpy(&wp, (const int16_t *)(const void *)(r->s + (size_t)(r0 + i) * gs) + t, 4);
            const __m512i w = _mm512_set1_epi32(wp);
#pragma GCC unroll 4
            for (int e = 0; e < 2 * NH; e++) acc[i][e] = dot_i16(acc[i][e], c[e], w);
        }
    }
#pragma GCC unroll 5
    for (int i = 0; i < RB; i++) {
        const float *qa = r->qa + (size_t)(r0 + i) * D;
        int32_t ws;
        memcpy(&ws, qa + I8_WS(D), 4);
        const __m512i c128 = _mm512_set1_epi32(128 * ws);
        const __m512 vs = _mm512_set1_ps(qa[I8_SW(D)]), vb = _mm512_set1_ps(r->rc[r0 + i]);
        float *o = r->acc + (size_t)(r0 + i) * D + d0;
#pragma GCC unroll 2
        for (int hh = 0; hh < NH; hh++) {
            const __m512i lo = acc[i][2 * hh], hi = acc[i][2 * hh + 1];
            const __m512i u[2] = {_mm512_shuffle_i32x4(lo, hi, 0x44), _mm512_shuffle_i32x4(lo, hi, 0xee)};
#pragma GCC unroll 2
            for (int k = 0; k < 2; k++) {
                const __m512 x = _mm512_cvtepi32_ps(_mm512_sub_epi32(u[k], c128));
                float *ok = o + 32 * hh + 16 * k;
                _mm512_storeu_ps(ok, _mm512_add_ps(_mm512_loadu_ps(ok), _mm512_fmadd_ps(x, vs, vb)));
            }
        }
    }
}

/* Whether the integer path takes this call: head_dim <= 256 (K sums) and
 * spans of at most 256 tokens (V sums); D % 32 == 0 holds at this level. */
AI int i8_ok(const attn_rows *r, int nt)
{
    return attn_avx512_int8_int16(r->D, nt);
}

/* The int4 records' codes of tokens [0, nt) widened to bytes 16 c + 8 in
 * r->x8 (attn_rows.x8: nt <= I8_SPAN_MAX, D <= 256), token t's K codes
 * at ctok[t], its V codes D bytes after them; returns ctok. Codes are
 * packed low nibble first (record.h): byte j of a row holds codes 2j and
 * 2j + 1; each byte, zero-extended to a word, becomes the byte pair
 * (16 c_2j + 8, 16 c_2j+1 + 8). 16 c + 8 - 128 = 16 (c - 7.5): the int8
 * kernel's centred codes are the int4 codes centred at 7.5, times 16, and
 * |16 c + 8| <= 248 keeps its sums' bounds. */
AI const uint8_t *const *i4_widen(attn_rows *r, const kvarn_record_layout *L,
                                  const uint8_t *const *recs, int nt)
{
    const int D = r->D;
    const uint8_t **ctok = (const uint8_t **)(void *)r->x8;
    uint8_t *x = r->x8 + I8_X8_WIDE(D);
    const __m256i lo4 = _mm256_set1_epi16(0x000f), hi4 = _mm256_set1_epi16(0x00f0);
    const __m256i eight = _mm256_set1_epi16(0x0808);
    for (int t = 0; t < nt; t++) {
        uint8_t *o = x + (size_t)t * 2 * D;
        ctok[t] = o;
        for (int h = 0; h < 2; h++) {
            const uint8_t *c = recs[t] + (h ? L->v_codes_off : L->k_codes_off);
            for (int d = 0; d < D; d += 32) {
                const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(const void *)(c + d / 2)));
                const __m256i y = _mm256_or_si256(
                    _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, lo4), 4),
                                    _mm256_slli_epi16(_mm256_and_si256(w, hi4), 8)),
                    eight);
                _mm256_storeu_si256((__m256i *)(void *)(o + (size_t)h * D + d), y);
            }
        }
    }
    return ctok;
}

/* One span through the integer path: the int8 format's records (codes in
 * place: ctok = recs, koff, voff their offsets), or the int4 format's
 * (int4 = 1: widened by i4_widen, ctok its rows, koff 0, voff D). */
AI void token_int_body(attn_rows *r, const kvarn_record_layout *L, const uint8_t *const *recs,
                       const uint8_t *const *ctok, size_t koff, size_t voff, int t0, int nt,
                       int int4)
{
    const int gs = r->gs, D = r->D;
    float *vs = r->meta + 2 * gs, *vz = vs + gs;
    /* the query does not change over the item's spans: rounded once */
    if (r->qa_ready != ATTN_QA_INT8) {
        for (int i = 0; i < r->n; i++) i8_round_query(r, i);
        r->qa_ready = ATTN_QA_INT8;
    }
    i8_pf pf;
    i8_pf_init(&pf, r->pf);
    /* the VNNI build's K codes transposed once for items of more than one
     * row block (i8v_transpose_span), where the scratch exists */
    const uint8_t *kt = NULL;
#ifdef KVARN_AVX512_VNNI
    if (I8_VNNI_K(D) && r->n > 4 && r->x8 != NULL) {
        uint8_t *o = r->x8 + I8_X8_KT;
        i8v_transpose_span(ctok, koff, nt, D, o);
        kt = o;
    }
#endif
    for (int r0 = 0; r0 < r->n;) {
        const int rb = block_rows(r->n, 4, r0), first = r0 == 0;
#define I8KCALL(N) i8_kblock(r, &pf, recs, ctok, koff, kt, L, t0, nt, r0, N, r->meta, first, int4)
        switch (rb) {
        case 4: I8KCALL(4); break;
        case 3: I8KCALL(3); break;
        case 2: I8KCALL(2); break;
        default: I8KCALL(1); break;
        }
#undef I8KCALL
        r0 += rb;
    }
    /* softmax and the weights p_t scale_t, rounded to int16; the (zero +
     * 128 scale) sum is one constant per row (p is 0 past nt, and so are
     * the scales) */
    const int nv = (nt + 7) & ~7;
    for (int i = 0; i < r->n; i++) i8_round_weights(r, i, nv, i8_softmax_fold(r, i, t0, nt, vs, vz));
    const int NH = D % 64 == 0 ? 2 : 1;
    for (int d0 = 0; d0 < D; d0 += 32 * NH)
        for (int r0 = 0; r0 < r->n;) {
            const int rb = block_rows(r->n, 5, r0);
#define I8VCALL(N) (NH == 2 ? i8_vsum(r, &pf, ctok, voff, nt, r0, N, d0, 2) \
                            : i8_vsum(r, &pf, ctok, voff, nt, r0, N, d0, 1))
            switch (rb) {
            case 5: I8VCALL(5); break;
            case 4: I8VCALL(4); break;
            case 3: I8VCALL(3); break;
            case 2: I8VCALL(2); break;
            default: I8VCALL(1); break;
            }
#undef I8VCALL
            r0 += rb;
        }
    while (i8_pf_left(&pf) > 0) i8_pf_step(&pf, i8_pf_left(&pf)); /* any left over */
    r->pf->tile = r->pf->n; /* all issued */
    r->pf->line = 0;
}

/* The int8 and int4 kernels of this build: the integer path where its
 * conditions hold (i8_ok; int4 also needs the widening scratch r->x8),
 * else the fp32 per-token loop (kernel_avx512.h token_tile_body; the
 * VNNI build's fall back to the plain build's entry, which runs it). */
#ifdef KVARN_AVX512_VNNI
#define I8_ENTRY(NAME) attn_avx512vnni_token_##NAME
#else
#define I8_ENTRY(NAME) attn_avx512_token_##NAME
#endif

/* A span the integer path does not take, in fp32: the plain build's
 * entry runs token_tile_body (the VNNI build calls that entry, so both
 * builds give its bits). */
AI void i8_fp32_span(attn_rows *r, kvarn_kind kind, const kvarn_record_layout *L,
                     const uint8_t *const *rec, int t0, int nt)
{
#ifdef KVARN_AVX512_VNNI
    if (kind == KVARN_KIND_INT8) attn_avx512_token_int8(r, L, rec, t0, nt);
    else attn_avx512_token_int4(r, L, rec, t0, nt);
#else
    r->qa_ready = ATTN_QA_NONE; /* (the fp32 path may use qa) */
    token_tile_body(r, kind, L, rec, t0, nt);
#endif
}

void I8_ENTRY(int8)(attn_rows *r, const kvarn_record_layout *L, const uint8_t *const *rec, int t0,
                    int nt)
{
    if (!i8_ok(r, nt)) i8_fp32_span(r, KVARN_KIND_INT8, L, rec, t0, nt);
    else token_int_body(r, L, rec, rec, L->k_codes_off, L->v_codes_off, t0, nt, 0);
}

void I8_ENTRY(int4)(attn_rows *r, const kvarn_record_layout *L, const uint8_t *const *rec, int t0,
                    int nt)
{
    if (!i8_ok(r, nt) || r->x8 == NULL) i8_fp32_span(r, KVARN_KIND_INT4, L, rec, t0, nt);
    else token_int_body(r, L, rec, i4_widen(r, L, rec, nt), 0, (size_t)r->D, t0, nt, 1);
}
