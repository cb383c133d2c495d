/*
 * kernel_avx512_kvarn.c -- the AVX-512 KVarN record tile kernel
 * (attn_avx512_kvarn_tile): channel-major codes converted with no shift and
 * no table (unpack16_pow2), specialized on the bit widths; 4-bit K and
 * 2-bit V of 128-token tiles in int16 (docs/attention-intdot.md "Integer
 * (int16) dot products"). Built twice: alone, and by kernel_avx512_vnni.c
 * with KVARN_AVX512_VNNI defined (attn_avx512vnni_kvarn_tile: vpdpwssd,
 * and u8 weights for 2-bit V); the #ifdef KVARN_AVX512_VNNI blocks hold
 * what only that build has. kernel_avx512.h describes the family.
 * Rows go through a tile in blocks of up to 6 (kv_block), start to end;
 * items of ATTN_PACK_MIN_ROWS rows or more (prefill chunks) first form the
 * tile's 4-bit K and 2-bit V code vectors once (kv_pack_k, kv_pack_v), so
 * each block only multiplies. The same bits either way.
 */
#include "attn/kernel_avx512.h"

/* --------------------------------------------------------- KVarN codes */

/* fp16 [n] (n % 16 == 0) at a possibly unaligned byte address -> fp32. */
static void fp16_array(const uint8_t *src, int n, float *dst)
{
    for (int i = 0; i < n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + 2 * i))));
}

AI uint64_t load_u64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* Natural token (or channel) i sits in lane KPERM_INV[i] of the 4-bit
 * order of unpack16_pow2 (below). */
#define KPERM_INV _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)

/* The KVarN kernels' code -> float without a shift or a table: each lane
 * masks its code IN PLACE in a broadcast word and converts the masked
 * integer, code * 2^(bits * k), to float (vpandq with a broadcast operand,
 * vcvtudq2ps). The conversion runs on the FP add pipes, not on the FMA
 * pipes the shift and the table lookup (vpsrlvq, vpermps) share on AMD Zen
 * 4. The power of two is fixed per lane and is undone once per row and
 * tile (pow2_unscale), so every product and sum is the old one times an
 * exact power of two: the same bits unless a value falls out of the normal
 * fp32 range (below 2^-126, or above 2^98 before the 2^-30 of the last
 * lane is undone), far outside the range of attention scores and weights.
 *   4-bit, 16 codes i0..i0+15 (i0 % 16 == 0) from one 64-bit word: lane 2k
 *     holds code i0+k, lane 2k+1 code i0+8+k, both times 16^k (KPERM_INV
 *     restores the order);
 *   2-bit, 16 codes from one 32-bit word: lane k holds code i0+k times 4^k
 *     (natural order);
 *   8-bit: as unpack16 (times 1). */
AI __m512 unpack16_pow2(const uint8_t *row, int i0, int bits)
{
    if (bits == 4) {
        const __m512i mask = _mm512_setr_epi32(0xf, 0xf, 0xf0, 0xf0, 0xf00, 0xf00, 0xf000, 0xf000,
                                                0xf0000, 0xf0000, 0xf00000, 0xf00000, 0xf000000,
                                                0xf000000, (int)0xf0000000u, (int)0xf0000000u);
        __m512i w = _mm512_set1_epi64((long long)load_u64(row + i0 / 2));
        return _mm512_cvtepu32_ps(_mm512_and_si512(w, mask));
    } else if (bits == 2) {
        const __m512i mask = _mm512_setr_epi32(0x3, 0xc, 0x30, 0xc0, 0x300, 0xc00, 0x3000, 0xc000,
                                                0x30000, 0xc0000, 0x300000, 0xc00000, 0x3000000,
                                                0xc000000, 0x30000000, (int)0xc0000000u);
        __m512i w = _mm512_set1_epi32((int)load_u32(row + i0 / 4));
        return _mm512_cvtepu32_ps(_mm512_and_si512(w, mask));
    }
    return unpack16(row, i0, bits);
}

/* Per lane, the inverse of unpack16_pow2's power of two (exact). */
AI __m512 pow2_unscale(int bits)
{
    const float a = 1.0f / 16, b = a / 16, c = b / 16, d = c / 16, e = d / 16, f = e / 16, g = f / 16;
    const float u = 1.0f / 4, v = u / 4, w = v / 4, x = w / 4, y = x / 4, z = y / 4, o = z / 4;
    if (bits == 4) return _mm512_setr_ps(1, 1, a, a, b, b, c, c, d, d, e, e, f, f, g, g);
    if (bits == 2)
        return _mm512_setr_ps(1, u, v, w, x, y, z, o, o / 4, o / 16, o / 64, o / 256, o / 1024,
                              o / 4096, o / 16384, o / 65536);
    return _mm512_set1_ps(1.0f);
}

/* --------------------------------------------------------- KVarN records */

/* Scores of tokens [tb, tb + 32) for rows [r0, r0 + RB):
 * s = s_tok * (sum_d qa[r][d] code[d][t] + rc[r]). */
AI void kv_kdots(attn_rows *r, const uint8_t *kc, size_t krow, int kb, const float *stok,
                 int r0, int RB, int tb, int pf_shift)
{
    const int D = r->D, gs = r->gs;
    __m512 acc[8][2];
#pragma GCC unroll 8
    for (int i = 0; i < RB; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int d = 0; d < D; d++) {
        if ((d & ((1 << pf_shift) - 1)) == 0) attn_prefetch_step(r->pf, 1);
        const uint8_t *row = kc + (size_t)d * krow;
        __m512 c0 = unpack16_pow2(row, tb, kb), c1 = unpack16_pow2(row, tb + 16, kb);
#pragma GCC unroll 8
        for (int i = 0; i < RB; i++) {
            __m512 w = _mm512_set1_ps(r->qa[(size_t)(r0 + i) * D + d]);
            acc[i][0] = _mm512_fmadd_ps(w, c0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(w, c1, acc[i][1]);
        }
    }
    const __m512 s0 = _mm512_loadu_ps(stok + tb), s1 = _mm512_loadu_ps(stok + tb + 16);
#pragma GCC unroll 8
    for (int i = 0; i < RB; i++) {
        if (kb != 8) {
            acc[i][0] = _mm512_mul_ps(acc[i][0], pow2_unscale(kb));
            acc[i][1] = _mm512_mul_ps(acc[i][1], pow2_unscale(kb));
        }
        if (kb == 4) {
            acc[i][0] = _mm512_permutexvar_ps(KPERM_INV, acc[i][0]);
            acc[i][1] = _mm512_permutexvar_ps(KPERM_INV, acc[i][1]);
        }
        __m512 c = _mm512_set1_ps(r->rc[r0 + i]);
        float *s = r->s + (size_t)(r0 + i) * gs + tb;
        _mm512_storeu_ps(s, _mm512_mul_ps(s0, _mm512_add_ps(acc[i][0], c)));
        _mm512_storeu_ps(s + 16, _mm512_mul_ps(s1, _mm512_add_ps(acc[i][1], c)));
    }
}

/* 4-bit K codes of a 128-token tile: each channel row is 64 bytes, one
 * 512-bit load; 32-bit lane m holds tokens 8m..8m+7, token 8m + j in
 * nibble j. Vector j (j = 0..7) masks nibble j in place and converts
 * (unpack16_pow2's scheme): lane m = code of token 8m + j times 16^j. Half
 * h takes j = 4h..4h+3: 4 vectors of 16 tokens, so up to 6 rows keep 24
 * accumulators. Against kv_kdots one load per channel replaces four 64-bit
 * broadcasts, and each broadcast query value feeds 4 FMAs instead of 2.
 * Every token's sum still runs over d = 0..D-1 in order, and 16^-j is
 * applied once per row and vector, so the scores are the same bits as
 * kv_kdots's. The raw sums go to the row's s in this permuted order
 * (vector j at s + 16j: lane 2k holds token 16k + j, lane 2k + 1 token
 * 16k + 8 + j); kv_kfinish128 restores the token order. */
AI void kv_kdots4_128(attn_rows *r, const uint8_t *kc, int r0, int RB, int h, int pf_shift)
{
    const int D = r->D, gs = r->gs;
    __m512i mask[4];
    float unscale[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        mask[j] = _mm512_set1_epi32((int)(0xfu << (4 * (4 * h + j))));
        unscale[j] = 1.0f / (float)(1u << (4 * (4 * h + j)));
    }
    __m512 acc[8][4];
#pragma GCC unroll 8
    for (int i = 0; i < RB; i++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
    for (int d = 0; d < D; d++) {
        if ((d & ((1 << pf_shift) - 1)) == 0) attn_prefetch_step(r->pf, 1);
        const __m512i w = _mm512_loadu_si512((const void *)(kc + (size_t)d * 64));
        __m512 c[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) c[j] = _mm512_cvtepu32_ps(_mm512_and_si512(w, mask[j]));
#pragma GCC unroll 8
        for (int i = 0; i < RB; i++) {
            __m512 q = _mm512_set1_ps(r->qa[(size_t)(r0 + i) * D + d]);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) acc[i][j] = _mm512_fmadd_ps(q, c[j], acc[i][j]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < RB; i++) {
        float *s = r->s + (size_t)(r0 + i) * gs + 64 * h;
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++)
            _mm512_storeu_ps(s + 16 * j, _mm512_mul_ps(acc[i][j], _mm512_set1_ps(unscale[j])));
    }
}

/* One row of kv_kdots4_128's raw sums (vector j at s + 16j: 64-bit pair k
 * holds tokens 16k + j, 16k + 8 + j) back in token order, scaled as in
 * kv_kdots: s[t] = s_tok[t] * (sum + c). Transposing the 8 x 8 matrix of
 * 64-bit pairs gives, for each k, tokens 16k..16k+15 in the order 0, 8, 1,
 * 9, ..., 7, 15, which KPERM_INV undoes. When the row sees the whole tile
 * the online-softmax step and the folding of a_t, b_t follow on the scores
 * in registers: s becomes the weights p_t a_t, rc[i] the row's sum_t p_t b_t;
 * else s holds the scores for the general step. */
/* Whether row i sees every position of the 128-token tile at t0. */
AI int kv_sees_tile(const attn_rows *r, int i, int t0)
{
    return r->lo[i] <= t0 && r->hi[i] >= t0 + 127;
}

AI void kv_kfinish128(attn_rows *r, int i, int t0, const float *stok, const float *va,
                      const float *vbias)
{
    float *s = r->s + (size_t)i * r->gs;
    const float c = r->rc[i];
    __m512d v[8], u[8], x[4], y[4];
    for (int j = 0; j < 8; j++) v[j] = _mm512_castps_pd(_mm512_loadu_ps(s + 16 * j));
    for (int j = 0; j < 8; j += 2) {
        u[j] = _mm512_unpacklo_pd(v[j], v[j + 1]);     /* pairs 0, 2, 4, 6 of j, j+1 */
        u[j + 1] = _mm512_unpackhi_pd(v[j], v[j + 1]); /* pairs 1, 3, 5, 7 */
    }
    /* x: even pairs (lo: 0 and 4 after the next step; hi: 2 and 6), from
     * vectors 0-3 and 4-7; y: the odd pairs likewise */
    x[0] = _mm512_shuffle_f64x2(u[0], u[2], 0x88);
    x[1] = _mm512_shuffle_f64x2(u[4], u[6], 0x88);
    x[2] = _mm512_shuffle_f64x2(u[0], u[2], 0xdd);
    x[3] = _mm512_shuffle_f64x2(u[4], u[6], 0xdd);
    y[0] = _mm512_shuffle_f64x2(u[1], u[3], 0x88);
    y[1] = _mm512_shuffle_f64x2(u[5], u[7], 0x88);
    y[2] = _mm512_shuffle_f64x2(u[1], u[3], 0xdd);
    y[3] = _mm512_shuffle_f64x2(u[5], u[7], 0xdd);
    __m512d t[8];
    t[0] = _mm512_shuffle_f64x2(x[0], x[1], 0x88);
    t[4] = _mm512_shuffle_f64x2(x[0], x[1], 0xdd);
    t[2] = _mm512_shuffle_f64x2(x[2], x[3], 0x88);
    t[6] = _mm512_shuffle_f64x2(x[2], x[3], 0xdd);
    t[1] = _mm512_shuffle_f64x2(y[0], y[1], 0x88);
    t[5] = _mm512_shuffle_f64x2(y[0], y[1], 0xdd);
    t[3] = _mm512_shuffle_f64x2(y[2], y[3], 0x88);
    t[7] = _mm512_shuffle_f64x2(y[2], y[3], 0xdd);
    const __m512 vc = _mm512_set1_ps(c);
    __m512 sc[8];
    for (int k = 0; k < 8; k++) {
        __m512 a = _mm512_permutexvar_ps(KPERM_INV, _mm512_castpd_ps(t[k]));
        sc[k] = _mm512_mul_ps(_mm512_loadu_ps(stok + 16 * k), _mm512_add_ps(a, vc));
    }
    if (!kv_sees_tile(r, i, t0)) {
        /* part of the tile hidden: the general masked step follows */
        for (int k = 0; k < 8; k++) _mm512_storeu_ps(s + 16 * k, sc[k]);
        return;
    }
    /* The whole tile visible (decode, and every full tile of a prefill
     * row): softmax_row_avx512 and fold_weights on the scores still in
     * registers, the same operations in the same order, so the same bits. */
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int k = 0; k < 8; k++) mx = _mm512_max_ps(mx, sc[k]);
    float mt = _mm512_reduce_max_ps(mx), m_old = r->m[i];
    float m_new = mt > m_old ? mt : m_old;
    /* an unchanged max (most tiles of a decode) skips the call: expf(0) = 1 */
    float corr = m_old == -INFINITY ? 0.0f : m_new == m_old ? 1.0f : expf(m_old - m_new);
    const __m512 vm = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps(), z = _mm512_setzero_ps();
    for (int k = 0; k < 8; k++) {
        __m512 p = exp512(_mm512_sub_ps(sc[k], vm));
        sum = _mm512_add_ps(sum, p);
        z = _mm512_fmadd_ps(p, _mm512_loadu_ps(vbias + 16 * k), z);
        _mm512_storeu_ps(s + 16 * k, _mm512_mul_ps(p, _mm512_loadu_ps(va + 16 * k)));
    }
    r->m[i] = m_new;
    r->psum[i] = _mm512_reduce_add_ps(sum);
    r->l[i] = r->l[i] * corr + r->psum[i];
    if (corr != 1.0f) {
        float *acc = r->acc + (size_t)i * r->D;
        const __m512 vcorr = _mm512_set1_ps(corr);
        for (int d = 0; d < r->D; d += 16)
            _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), vcorr));
    }
    r->rc[i] = _mm512_reduce_add_ps(z); /* the row's sum_t p_t b_t */
}

/* tmp = sum_t w[r][t] code[t][d0..d0+16 NV); acc += s_chan * (tmp + pb[r]),
 * NV = 2 or 4 vectors of 16 channels (4: each broadcast weight feeds 4
 * FMAs). Codes by unpack16_pow2: the sums run in the lanes' order (4-bit:
 * that of KPERM_INV) times a power of two per lane, undone once per row;
 * each channel's sum runs over t in order, as before. */
AI void kv_vsum(attn_rows *r, const uint8_t *vc, size_t vrow, int vb, int G,
                const float *schan, const float *pb, int r0, int RB, int d0, int NV)
{
    const int D = r->D, gs = r->gs;
    __m512 acc[8][4];
#pragma GCC unroll 8
    for (int i = 0; i < RB; i++)
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++) acc[i][j] = _mm512_setzero_ps();
    for (int t = 0; t < G; t++) {
        attn_prefetch_step(r->pf, 1);
        const uint8_t *row = vc + (size_t)t * vrow;
        __m512 c[4];
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++) c[j] = unpack16_pow2(row, d0 + 16 * j, vb);
#pragma GCC unroll 8
        for (int i = 0; i < RB; i++) {
            __m512 w = _mm512_set1_ps(r->s[(size_t)(r0 + i) * gs + t]);
#pragma GCC unroll 4
            for (int j = 0; j < NV; j++) acc[i][j] = _mm512_fmadd_ps(w, c[j], acc[i][j]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < RB; i++) {
        float *a = r->acc + (size_t)(r0 + i) * D + d0;
        __m512 b = _mm512_set1_ps(pb[r0 + i]);
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++) {
            __m512 x = acc[i][j];
            if (vb != 8) x = _mm512_mul_ps(x, pow2_unscale(vb));
            if (vb == 4) x = _mm512_permutexvar_ps(KPERM_INV, x);
            _mm512_storeu_ps(a + 16 * j, _mm512_fmadd_ps(_mm512_loadu_ps(schan + d0 + 16 * j),
                                                         _mm512_add_ps(x, b), _mm512_loadu_ps(a + 16 * j)));
        }
    }
}

/* ------------------------------------- integer (int16) dot products, KVarN
 * The k4 g128 scores and the 2-bit V sums of D % 64 == 0 run as exact
 * int32 sums of int16 x int16 products (vpmaddwd, AVX-512BW: 32 products
 * per instruction, two channels or two tokens per 32-bit lane) against a
 * query / weights rounded to int16 once per row and tile:
 *   qa_d ~ sq qi_d, sq = max_d |qa_d| / 32767;  w_t ~ sw wi_t, sw = max_t |w_t| / 32767.
 * docs/attention-intdot.md "Integer (int16) dot products" gives the error bounds
 * (score error at most 15 D sq / 2 s_tok_t over a tile's 4-bit K; V error
 * at most 3 G sw / 2 s_chan_d) and the measurements. */

/* Round row i's qa (fp32 [D], in r->qa) to int16 in place: qi_d at the
 * first 2D bytes of the row, sq at float index D / 2. Returns sq. The
 * caller has checked 2^-100 <= max_d |qa_d| < 2^80, so 32767 / max is a
 * normal float; |qa_d * inv| <= 32767 (1 + 2^-23) rounds into int16. */
AI void kv_round_query(attn_rows *r, int i)
{
    const int D = r->D;
    float *qa = r->qa + (size_t)i * D;
    int16_t *qi = (int16_t *)(void *)qa;
    __m512 mx = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(qa + d)));
    const float qmax = _mm512_reduce_max_ps(mx);
    const __m512 inv = _mm512_set1_ps(32767.0f / qmax);
    /* in order of d: the int16 written at bytes [2d, 2d + 32) never
     * overwrite floats not yet read (bytes [4d, ...)) */
    for (int d = 0; d < D; d += 16) {
        __m512i x = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(qa + d), inv));
        _mm256_storeu_si256((__m256i *)(void *)(qi + d), _mm512_cvtepi32_epi16(x));
    }
    qa[D / 2] = qmax / 32767.0f;
}

/* The four code vectors kv_kdots4_128_i16 multiplies for channels d,
 * d + 1 (d even) of half h: lane m of c[j] holds, as (low, high) int16,
 * the codes of token 8m + 4h + j of channels d and d + 1, times 16 for
 * j = 1 (nibble 1 masked in place). */
AI void kv_k4pair_codes(const uint8_t *kc, int d, int h, __m512i c[4])
{
    const __m512i m0 = _mm512_set1_epi32(0x000f000f), m1 = _mm512_set1_epi32(0x00f000f0);
    const __m512i w0 = _mm512_loadu_si512((const void *)(kc + (size_t)d * 64));
    const __m512i w1 = _mm512_loadu_si512((const void *)(kc + (size_t)d * 64 + 64));
    const __m512i x = h == 0 ? _mm512_mask_blend_epi16(0xaaaaaaaau, w0, _mm512_slli_epi32(w1, 16))
                             : _mm512_mask_blend_epi16(0xaaaaaaaau, _mm512_srli_epi32(w0, 16), w1);
    c[0] = _mm512_and_si512(x, m0);
    c[1] = _mm512_and_si512(x, m1);
    c[2] = _mm512_and_si512(_mm512_srli_epi16(x, 8), m0);
    c[3] = _mm512_srli_epi16(x, 12);
}

/* The end of kv_kdots4_128_i16 and kv_kdots4_128_pk for row i of half h:
 * the int32 sums a[j] times sq (and 1/16 for j = 1) to s in kv_kdots4_128's
 * order, for kv_kfinish128. The sums come by value: an accumulator array
 * passed by address stays in memory through the loop (GCC 12). */
AI void kv_kstore_i16(attn_rows *r, int i, int h, __m512i a0, __m512i a1, __m512i a2, __m512i a3)
{
    const int D = r->D;
    const float sq = r->qa[(size_t)i * D + D / 2];
    float *s = r->s + (size_t)i * r->gs + 64 * h;
    const __m512 v0 = _mm512_set1_ps(sq), v1 = _mm512_set1_ps(sq * 0.0625f);
    _mm512_storeu_ps(s, _mm512_mul_ps(_mm512_cvtepi32_ps(a0), v0));
    _mm512_storeu_ps(s + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(a1), v1));
    _mm512_storeu_ps(s + 32, _mm512_mul_ps(_mm512_cvtepi32_ps(a2), v0));
    _mm512_storeu_ps(s + 48, _mm512_mul_ps(_mm512_cvtepi32_ps(a3), v0));
}
#define KV_KSTORE_ROWS(r, acc, r0, RB, h)                                                     \
    _Pragma("GCC unroll 6") for (int i_ = 0; i_ < (RB); i_++)                                 \
        kv_kstore_i16(r, (r0) + i_, h, acc[i_][0], acc[i_][1], acc[i_][2], acc[i_][3])

/* kv_kdots4_128 with the int16 query of kv_round_query: half h of the tile
 * (tokens 8m + 4h + j, j = 0..3, lane m of vector j), two channels per
 * step. With w0, w1 the 64-byte rows of channels d, d + 1 (32-bit lane m:
 * tokens 8m..8m+7 of the channel, token 8m + j in nibble j), the 16-bit
 * word h of w0's lane m and word h of w1's are blended into one lane (low:
 * channel d, high: channel d + 1), so nibble j of both words is token
 * 8m + 4h + j of the two channels, the pair vpmaddwd multiplies with the
 * broadcast (qi_d, qi_{d+1}). Nibble 0 is masked in place (code), nibble 1
 * in place (16 x code: the 16 is undone in fp32 after the sum, exact),
 * nibbles 2 and 3 shifted down. Int32 sums: |qi| <= 32767, codes <= 240,
 * D / 2 pairs: D 32767 240 < 2^31 - 1 for D <= 256 (the caller's check).
 * The sums, times sq (and 1/16 for j = 1), go to s in kv_kdots4_128's
 * order for kv_kfinish128. pf_l2: the prefetches into L2
 * (attn_prefetch_step_l2), else into L1. */
AI void kv_kdots4_128_i16(attn_rows *r, const uint8_t *kc, int r0, int RB, int h, int pf_shift,
                          int pf_l2)
{
    const int D = r->D;
    __m512i acc[6][4];
#pragma GCC unroll 6
    for (int i = 0; i < RB; i++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_si512();
    for (int d = 0; d < D; d += 2) {
        if ((d & ((1 << pf_shift) - 1)) == 0) {
            if (pf_l2)
                attn_prefetch_step_l2(r->pf, 1);
            else
                attn_prefetch_step(r->pf, 1);
        }
        __m512i c[4];
        kv_k4pair_codes(kc, d, h, c);
#pragma GCC unroll 6
        for (int i = 0; i < RB; i++) {
            int32_t qp;
            memcpy(&qp, (const int16_t *)(const void *)(r->qa + (size_t)(r0 + i) * D) + d, 4);
            const __m512i q = _mm512_set1_epi32(qp);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) acc[i][j] = dot_i16(acc[i][j], c[j], q);
        }
    }
    KV_KSTORE_ROWS(r, acc, r0, RB, h);
}

/* Round row i's weights (fp32 s[i][0..G), G even) to int16 in place: wi_t
 * at the first 2G bytes of the row, sw at float index G / 2. A row whose
 * largest |w_t| is below 2^-100 (or 0: no visible position in the tile)
 * gets wi = 0, sw = 0: it drops at most 3 G 2^-100 s_chan_d from acc,
 * against l >= 1. */
AI void kv_round_weights(attn_rows *r, int i, int G)
{
    float *w = r->s + (size_t)i * r->gs;
    int16_t *wi = (int16_t *)(void *)w;
    __m512 mx = _mm512_setzero_ps();
    for (int t = 0; t < G; t += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(w + t)));
    const float wmax = _mm512_reduce_max_ps(mx);
    const int ok = wmax >= 0x1p-100f; /* also false for NaN */
    const __m512 inv = _mm512_set1_ps(ok ? 32767.0f / wmax : 0.0f);
    for (int t = 0; t < G; t += 16) {
        __m512i x = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(w + t), inv));
        _mm256_storeu_si256((__m256i *)(void *)(wi + t), _mm512_cvtepi32_epi16(x));
    }
    w[G / 2] = ok ? wmax / 32767.0f : 0.0f;
}

/* The end of kv_vsum2_i16, kv_vsum2_u8 and kv_vsum2_u8_pk for row i: lane
 * k of a[j] holds the int32 sum of channel d0 + 4k + j (times 4^j where
 * pow4: codes masked in place); times sw (the row's float at G / 2 of s),
 * 4^-j where pow4, two rounds of 4 x 4 transposes (inside 128-bit lanes,
 * then of 128-bit lanes) put channels d0 + 16b.. in vector b; then acc +=
 * s_chan (sum + pb), as kv_vsum. The sums come by value (kv_kstore_i16). */
AI void kv_vsum_epilogue(attn_rows *r, int i, const __m512i a[4], const float *schan,
                         const float *pb, int d0, int G, int pow4)
{
    const float sw = r->s[(size_t)i * r->gs + G / 2];
    __m512 v[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
        v[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(a[j]), _mm512_set1_ps(pow4 ? sw / (float)(1 << (2 * j)) : sw));
    __m512 t0 = _mm512_unpacklo_ps(v[0], v[1]), t1 = _mm512_unpackhi_ps(v[0], v[1]);
    __m512 t2 = _mm512_unpacklo_ps(v[2], v[3]), t3 = _mm512_unpackhi_ps(v[2], v[3]);
    __m512 u0 = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t2)));
    __m512 u1 = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t2)));
    __m512 u2 = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t1), _mm512_castps_pd(t3)));
    __m512 u3 = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t1), _mm512_castps_pd(t3)));
    /* u_k, 128-bit lane b: channels 16b + 4k .. 16b + 4k + 3 */
    __m512 x0 = _mm512_shuffle_f32x4(u0, u1, 0x44), x1 = _mm512_shuffle_f32x4(u2, u3, 0x44);
    __m512 x2 = _mm512_shuffle_f32x4(u0, u1, 0xee), x3 = _mm512_shuffle_f32x4(u2, u3, 0xee);
    __m512 o[4];
    o[0] = _mm512_shuffle_f32x4(x0, x1, 0x88);
    o[1] = _mm512_shuffle_f32x4(x0, x1, 0xdd);
    o[2] = _mm512_shuffle_f32x4(x2, x3, 0x88);
    o[3] = _mm512_shuffle_f32x4(x2, x3, 0xdd);
    float *acc_o = r->acc + (size_t)i * r->D + d0;
    const __m512 b = _mm512_set1_ps(pb[i]);
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++)
        _mm512_storeu_ps(acc_o + 16 * k, _mm512_fmadd_ps(_mm512_loadu_ps(schan + d0 + 16 * k),
                                                         _mm512_add_ps(o[k], b), _mm512_loadu_ps(acc_o + 16 * k)));
}
#define KV_VSUM_EPILOGUE_ROWS(acc, pow4)                                                          \
    _Pragma("GCC unroll 6") for (int i_ = 0; i_ < RB; i_++) {                                     \
        const __m512i a_[4] = {acc[i_][0], acc[i_][1], acc[i_][2], acc[i_][3]};                   \
        kv_vsum_epilogue(r, r0 + i_, a_, schan, pb, d0, G, pow4);                                 \
    }

/* kv_vsum for 2-bit V codes with the int16 weights of kv_round_weights:
 * channels d0..d0+63 (16 bytes of each token row), two tokens per step.
 * The 16 bytes of tokens t and t + 1 are interleaved (byte k of t, byte k
 * of t + 1) and zero-extended to words, so 32-bit lane k holds byte k of
 * token t (low word) and of token t + 1 (high word); byte k holds channels
 * d0 + 4k + j at bits 2j, masked in place (4^j x code, undone in fp32
 * after the sum). vpmaddwd with the broadcast (wi_t, wi_{t+1}). Int32
 * sums: |wi| <= 32767, codes <= 192, G / 2 pairs: G 32767 192 < 2^31 - 1
 * for G <= 128. Then acc += s_chan (sw sum + pb), as kv_vsum. */
AI void kv_vsum2_i16(attn_rows *r, const uint8_t *vc, size_t vrow, int G, const float *schan,
                     const float *pb, int r0, int RB, int d0)
{
    const int gs = r->gs;
    __m512i acc[6][4];
#pragma GCC unroll 6
    for (int i = 0; i < RB; i++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_si512();
    for (int t = 0; t < G; t += 2) {
        attn_prefetch_step_l2(r->pf, 2);
        const uint8_t *row = vc + (size_t)t * vrow + d0 / 4;
        const __m128i a = _mm_loadu_si128((const __m128i *)(const void *)row);
        const __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(row + vrow));
        const __m256i ab = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(a, b)),
                                                   _mm_unpackhi_epi8(a, b), 1);
        const __m512i x = _mm512_cvtepu8_epi16(ab);
        __m512i c[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) c[j] = _mm512_and_si512(x, _mm512_set1_epi32(0x00030003 << (2 * j)));
#pragma GCC unroll 6
        for (int i = 0; i < RB; i++) {
            int32_t wp;
            memcpy(&wp, (const int16_t *)(const void *)(r->s + (size_t)(r0 + i) * gs) + t, 4);
            const __m512i w = _mm512_set1_epi32(wp);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) acc[i][j] = dot_i16(acc[i][j], c[j], w);
        }
    }
    KV_VSUM_EPILOGUE_ROWS(acc, 1)
}

#ifdef KVARN_AVX512_VNNI
/* ------------------------------------- u8 weights for 2-bit V (VNNI build)
 * vpdpbusd multiplies 64 u8 x s8 pairs per instruction (4 per 32-bit lane,
 * summed into it, exact int32), twice vpdpwssd's 32. The weights w_t = p_t
 * a_t are never negative where every a_t of the tile is >= 0 (p_t >= 0),
 * so they are rounded to u8 per row and tile, w_t ~ sw wi_t, sw = max_t w_t
 * / 255, and the 2-bit codes (0..3) are the s8 side. Rounding error: that
 * of the int16 weights with 255 for 32767 (docs/attention-intdot.md "u8
 * weights"; measured on SmolLM2: KLD within the spread of the fp32
 * kernels'). A tile with a negative or NaN a_t (no encoder writes one)
 * keeps the int16 loop. */

/* Round row i's weights (fp32 s[i][0..G), all >= 0 or NaN, G % 16 == 0)
 * to u8 in place: wi_t at the first G bytes of the row, sw at float index
 * G / 2; a row whose largest w_t is below 2^-100 (or NaN: no visible
 * position, or non-finite input) gets wi = 0, sw = 0, as kv_round_weights.
 * 0 <= w_t 255 / max <= 255 (1 + 2^-23) rounds into [0, 255]. */
AI void kv_round_weights_u8(attn_rows *r, int i, int G)
{
    float *w = r->s + (size_t)i * r->gs;
    uint8_t *wi = (uint8_t *)(void *)w;
    __m512 mx = _mm512_setzero_ps();
    for (int t = 0; t < G; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(w + t));
    const float wmax = _mm512_reduce_max_ps(mx);
    const int ok = wmax >= 0x1p-100f; /* also false for NaN */
    const __m512 inv = _mm512_set1_ps(ok ? 255.0f / wmax : 0.0f);
    /* bytes [t, t + 16) are written after floats [t, t + 16) (bytes [4t,
     * 4t + 64)) are read: nothing unread is overwritten */
    for (int t = 0; t < G; t += 16) {
        __m512i x = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(w + t), inv));
        _mm_storeu_si128((__m128i *)(void *)(wi + t), _mm512_cvtusepi32_epi8(_mm512_max_epi32(x, _mm512_setzero_si512())));
    }
    w[G / 2] = ok ? wmax / 255.0f : 0.0f;
}

/* The four code vectors kv_vsum2_u8 multiplies for tokens t..t+3 and
 * channels d0..d0+63: byte k' of 32-bit lane k of c[j] is the code (0..3)
 * of token t + k' at channel d0 + 4k + j. */
AI void kv_v2quad_codes(const uint8_t *vc, size_t vrow, int t, int d0, __m512i c[4])
{
    const __m512i m3 = _mm512_set1_epi8(3);
    const uint8_t *row = vc + (size_t)t * vrow + d0 / 4;
    const __m128i a = _mm_loadu_si128((const __m128i *)(const void *)row);
    const __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(row + vrow));
    const __m128i e = _mm_loadu_si128((const __m128i *)(const void *)(row + 2 * vrow));
    const __m128i f = _mm_loadu_si128((const __m128i *)(const void *)(row + 3 * vrow));
    const __m128i ablo = _mm_unpacklo_epi8(a, b), abhi = _mm_unpackhi_epi8(a, b);
    const __m128i eflo = _mm_unpacklo_epi8(e, f), efhi = _mm_unpackhi_epi8(e, f);
    const __m256i lo = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi16(ablo, eflo)),
                                               _mm_unpackhi_epi16(ablo, eflo), 1);
    const __m256i hi = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi16(abhi, efhi)),
                                               _mm_unpackhi_epi16(abhi, efhi), 1);
    const __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    c[0] = _mm512_and_si512(x, m3);
    c[1] = _mm512_and_si512(_mm512_srli_epi32(x, 2), m3);
    c[2] = _mm512_and_si512(_mm512_srli_epi32(x, 4), m3);
    c[3] = _mm512_and_si512(_mm512_srli_epi32(x, 6), m3);
}

/* kv_vsum2_i16 with the u8 weights of kv_round_weights_u8, four tokens a
 * step: the 16 code bytes (channels d0..d0+63) of tokens t..t+3
 * interleaved byte by byte (vpunpck{l,h}bw, then {l,h}wd), so 32-bit lane
 * k holds byte k of the four tokens; channel d0 + 4k + j is bits 2j of each
 * byte, shifted down and masked (s8: 0..3); vpdpbusd with the broadcast
 * (wi_t..wi_{t+3}). Int32 sums: G 255 3 < 2^31. The lanes' channel order
 * and the epilogue are kv_vsum2_i16's (without its 4^j). */
AI void kv_vsum2_u8(attn_rows *r, const uint8_t *vc, size_t vrow, int G, const float *schan,
                    const float *pb, int r0, int RB, int d0)
{
    const int gs = r->gs;
    __m512i acc[6][4];
#pragma GCC unroll 6
    for (int i = 0; i < RB; i++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_si512();
    for (int t = 0; t < G; t += 4) {
        attn_prefetch_step_l2(r->pf, 4); /* kv_vsum2_i16's 2 per token pair */
        __m512i c[4];
        kv_v2quad_codes(vc, vrow, t, d0, c);
#pragma GCC unroll 6
        for (int i = 0; i < RB; i++) {
            int32_t wp;
            memcpy(&wp, (const uint8_t *)(const void *)(r->s + (size_t)(r0 + i) * gs) + t, 4);
            const __m512i w = _mm512_set1_epi32(wp);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) acc[i][j] = dot_u8s8(acc[i][j], w, c[j]);
        }
    }
    KV_VSUM_EPILOGUE_ROWS(acc, 0)
}

/* 1 when every a_t of the tile (va, fp32 [G], G % 16 == 0) is >= 0 (false
 * for NaN): the weights p_t a_t are then never negative. */
AI int kv_va_nonneg(const float *va, int G)
{
    __mmask16 bad = 0;
    for (int t = 0; t < G; t += 16)
        bad |= _mm512_cmp_ps_mask(_mm512_loadu_ps(va + t), _mm512_setzero_ps(), _CMP_NGE_UQ);
    return bad == 0;
}
#define KV_U8_OK(va, G) kv_va_nonneg(va, G)
#define KV_ROUND_U8(i) kv_round_weights_u8(r, i, G)
#define KV_VSUM_U8(N) kv_vsum2_u8(r, vc, vrow, G, schan, pb, r0, N, d0)
#define KV_VSUM_U8_PK(N) kv_vsum2_u8_pk##N(r, t->vp, G, schan, pb, r0, d0)
#define KV_PACK_V(vp) kv_pack_v(vc, vrow, G, D, vp)
#else
/* the vpmaddwd build has no vpdpbusd: int16 weights throughout */
#define KV_U8_OK(va, G) 0
#define KV_ROUND_U8(i) ((void)0)
#define KV_VSUM_U8(N) ((void)0)
#define KV_VSUM_U8_PK(N) ((void)0)
#define KV_PACK_V(vp) ((void)(vp))
#endif

/* ---------------------------------- packed codes (items of many rows)
 * Items of ATTN_PACK_MIN_ROWS rows or more (prefill chunks, verification of
 * wide GQA groups) form the code vectors of kv_kdots4_128_i16 and
 * kv_vsum2_u8 once per tile, into r->mat (kv_pack_k, kv_pack_v); each
 * block of rows then multiplies them with broadcast queries / weights
 * alone (kv_kdots4_128_pk, kv_vsum2_u8_pk): per step 4 loads, 6
 * broadcasts and 24 dot products, without the loads and unpacking of the
 * codes in every block. The int32 sums are exact, so scores and sums are the same bits
 * as the unpacked loops'. */

/* Where packing pays (ATTN_PACK_MIN_ROWS): bench_attn --contexts 4096
 * --batches 1 --staging int8, kvarn_k4v2_g128, one thread on AMD Zen 4:
 * packed against unpacked 5-6% slower at 18-24 rows (6 queries, SmolLM2
 * and Llama heads), even at 33-44, 1-4% faster from 48 rows up, 3-5% at
 * 384-2048. */

AI int32_t load_i32(const void *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* K: kp[h][p][j] = kv_k4pair_codes(kc, 2p, h)[j], h < 2, p < D / 2 (256 D
 * bytes); the next tiles' prefetches spread over the D steps, into L2
 * where pf_l2 (as kv_kdots4_128_i16's), else into every level. */
AI void kv_pack_k(attn_rows *r, const uint8_t *kc, __m512i *kp, int pf_l2)
{
    const int D = r->D, per = (attn_prefetch_left(r->pf) + D - 1) / D;
    for (int h = 0; h < 2; h++)
        for (int d = 0; d < D; d += 2) {
            if (pf_l2)
                attn_prefetch_step_l2(r->pf, per);
            else
                attn_prefetch_step(r->pf, per);
            __m512i c[4];
            kv_k4pair_codes(kc, d, h, c);
            __m512i *o = kp + ((size_t)h * (size_t)(D / 2) + (size_t)(d / 2)) * 4;
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) _mm512_storeu_si512((void *)(o + j), c[j]);
        }
}

/* kv_kdots4_128_i16 on kv_pack_k's vectors (half h). */
AI void kv_kdots4_128_pk(attn_rows *r, const __m512i *kp, int r0, int RB, int h)
{
    const int D = r->D;
    const uint8_t *q[6];
    __m512i acc[6][4];
#pragma GCC unroll 6
    for (int i = 0; i < RB; i++) {
        q[i] = (const uint8_t *)(const void *)(r->qa + (size_t)(r0 + i) * D);
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_si512();
    }
    const __m512i *k = kp + (size_t)h * (size_t)(D / 2) * 4;
    for (int p = 0; p < D / 2; p++, k += 4) {
        __m512i c[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) c[j] = _mm512_loadu_si512((const void *)(k + j));
#pragma GCC unroll 6
        for (int i = 0; i < RB; i++) {
            const __m512i qb = _mm512_set1_epi32(load_i32(q[i] + 4 * p)); /* (qi_2p, qi_2p+1) */
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) acc[i][j] = dot_i16(acc[i][j], c[j], qb);
        }
    }
    KV_KSTORE_ROWS(r, acc, r0, RB, h);
}

#ifdef KVARN_AVX512_VNNI
/* V: vp[g][u][j] = kv_v2quad_codes(vc, vrow, 4u, 64g)[j], g < D / 64, u <
 * G / 4 (G D bytes). */
AI void kv_pack_v(const uint8_t *vc, size_t vrow, int G, int D, __m512i *vp)
{
    for (int d0 = 0; d0 < D; d0 += 64)
        for (int t = 0; t < G; t += 4) {
            __m512i c[4];
            kv_v2quad_codes(vc, vrow, t, d0, c);
            __m512i *o = vp + ((size_t)(d0 / 64) * (size_t)(G / 4) + (size_t)(t / 4)) * 4;
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) _mm512_storeu_si512((void *)(o + j), c[j]);
        }
}

/* kv_vsum2_u8 on kv_pack_v's vectors (channels d0..d0+63). */
AI void kv_vsum2_u8_pk(attn_rows *r, const __m512i *vp, int G, const float *schan, const float *pb,
                       int r0, int RB, int d0)
{
    const int gs = r->gs;
    const uint8_t *w[6];
    __m512i acc[6][4];
#pragma GCC unroll 6
    for (int i = 0; i < RB; i++) {
        w[i] = (const uint8_t *)(const void *)(r->s + (size_t)(r0 + i) * gs);
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_si512();
    }
    const __m512i *v = vp + (size_t)(d0 / 64) * (size_t)(G / 4) * 4;
    for (int t = 0; t < G; t += 4, v += 4) {
        __m512i c[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) c[j] = _mm512_loadu_si512((const void *)(v + j));
#pragma GCC unroll 6
        for (int i = 0; i < RB; i++) {
            const __m512i wb = _mm512_set1_epi32(load_i32(w[i] + t)); /* (wi_t..wi_t+3) */
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) acc[i][j] = dot_u8s8(acc[i][j], wb, c[j]);
        }
    }
    KV_VSUM_EPILOGUE_ROWS(acc, 0)
}
#endif

/* The packed loops out of line, one per row count (the tile body is tens
 * of kilobytes of code; inlined there the loops took 1-3% more time in
 * bench_attn --queries 512 on AMD Zen 4). Items of ATTN_PACK_MIN_ROWS
 * rows come in balanced blocks of 5 or 6 (block_rows), so only those two;
 * kv_block takes the unpacked loops for any other count. */
_Static_assert(ATTN_PACK_MIN_ROWS >= 20, "blocks of 5 or 6 rows: ceil(n / 6) blocks of n >= 20 rows");
#ifdef KVARN_AVX512_VNNI
#define KV_PK_V_FN(N)                                                                                \
    static __attribute__((noinline)) void kv_vsum2_u8_pk##N(attn_rows *r, const __m512i *vp, int G,  \
                                                            const float *schan, const float *pb,     \
                                                            int r0, int d0)                          \
    {                                                                                                \
        kv_vsum2_u8_pk(r, vp, G, schan, pb, r0, N, d0);                                              \
    }
#else
#define KV_PK_V_FN(N)
#endif
#define KV_PK_FN(N)                                                                                  \
    static __attribute__((noinline)) void kv_kdots4_128_pk##N(attn_rows *r, const __m512i *kp,       \
                                                              int r0, int h)                         \
    {                                                                                                \
        kv_kdots4_128_pk(r, kp, r0, N, h);                                                           \
    }                                                                                                \
    KV_PK_V_FN(N)
KV_PK_FN(5)
KV_PK_FN(6)
#undef KV_PK_FN
#undef KV_PK_V_FN

/* One tile's record fields and the kernel's choices for it
 * (kvarn_tile_body), for kv_block. */
typedef struct kv_tile {
    const uint8_t *kc, *vc; /* K codes (channel-major), V codes (token-major) */
    size_t krow, vrow;      /* bytes per K channel row, per V token row */
    int kb, vb, G, t0;      /* bit widths, tile tokens, the tile's first position */
    int k128, kint, vint, u8, nv, pf_shift;
    const __m512i *kp, *vp; /* kv_pack_k's, kv_pack_v's vectors, or NULL */
} kv_tile;

/* Rows [r0, r0 + RB) through one tile: int16 query (kint), scores
 * (kv_kdots4_128[_i16] then kv_kfinish128, or kv_kdots), the online
 * softmax and weights p_t a_t for rows kv_kfinish128 left, the weights'
 * int16/u8 rounding (vint) and the value sums, 64 channels (or 32) a pass.
 * The metadata in r->meta, qa and rc of the rows are kvarn_tile_body's.
 * RB <= 6 (<= 8 where !k128, !vint and nv == 2). */
AI void kv_block(attn_rows *r, const kv_tile *t, int r0, int RB)
{
    const int D = r->D, G = t->G, gs = r->gs;
    const float *schan = r->meta + 2 * D, *stok = schan + D, *va = stok + gs, *vbias = va + gs;
    const uint8_t *vc = t->vc; /* for KV_VSUM_U8 */
    const size_t vrow = t->vrow;
    (void)vc, (void)vrow;
    /* 7 and 8 rows only where !k128, !vint and nv == 2 (kvarn_tile_body);
     * R6 keeps the 6-row loops' instances in bounds */
    const int R6 = RB > 6 ? 6 : RB;
    for (int i = r0; t->kint && i < r0 + RB; i++) kv_round_query(r, i);
    if (t->k128) {
        for (int h = 0; h < 2; h++) {
            if (t->kp && R6 == 6)
                kv_kdots4_128_pk6(r, t->kp, r0, h);
            else if (t->kp && R6 == 5)
                kv_kdots4_128_pk5(r, t->kp, r0, h);
            else if (t->kint)
                kv_kdots4_128_i16(r, t->kc, r0, R6, h, t->pf_shift, t->vint);
            else
                kv_kdots4_128(r, t->kc, r0, R6, h, t->pf_shift);
        }
        for (int i = r0; i < r0 + RB; i++) kv_kfinish128(r, i, t->t0, stok, va, vbias);
    } else {
        for (int tb = 0; tb < G; tb += 32) kv_kdots(r, t->kc, t->krow, t->kb, stok, r0, RB, tb, t->pf_shift);
    }
    /* Weights p_t * a_t; the b_t sum is one constant per row. */
    float *pb = r->rc;
    for (int i = r0; i < r0 + RB; i++) {
        if (t->k128 && kv_sees_tile(r, i, t->t0)) continue; /* done by kv_kfinish128 */
        softmax_row_avx512(r, i, t->t0, G);
        pb[i] = fold_weights(r->s + (size_t)i * gs, va, vbias, G);
    }
    if (t->vint) {
        for (int i = r0; i < r0 + RB; i++) {
            if (t->u8)
                KV_ROUND_U8(i);
            else
                kv_round_weights(r, i, G);
        }
        for (int d0 = 0; d0 < D; d0 += 64) {
            if (t->vp && R6 == 6)
                KV_VSUM_U8_PK(6);
            else if (t->vp && R6 == 5)
                KV_VSUM_U8_PK(5);
            else if (t->u8)
                KV_VSUM_U8(R6);
            else
                kv_vsum2_i16(r, t->vc, t->vrow, G, schan, pb, r0, R6, d0);
        }
        return;
    }
    for (int d0 = 0; d0 < D; d0 += 16 * t->nv) {
        if (t->nv == 4)
            kv_vsum(r, t->vc, t->vrow, t->vb, G, schan, pb, r0, R6, d0, 4);
        else
            kv_vsum(r, t->vc, t->vrow, t->vb, G, schan, pb, r0, RB, d0, 2);
    }
}

AI void kvarn_tile_body(attn_rows *r, const kvarn_record_layout *L, const uint8_t *rec,
                        int t0, int kb, int vb)
{
    const int D = r->D, G = L->tile_tokens, gs = r->gs;
    float *ka = r->meta, *kbias = ka + D, *schan = kbias + D;
    float *stok = schan + D, *va = stok + gs, *vbias = va + gs;
    fp16_array(rec + L->k_a_off, D, ka);
    fp16_array(rec + L->k_b_off, D, kbias);
    fp16_array(rec + L->k_stok_off, G, stok);
    fp16_array(rec + L->v_schan_off, D, schan);
    fp16_array(rec + L->v_a_off, G, va);
    fp16_array(rec + L->v_b_off, G, vbias);
    const uint8_t *kc = rec + L->k_codes_off, *vc = rec + L->v_codes_off;
    const size_t krow = (size_t)G * kb / 8, vrow = (size_t)D * vb / 8;

    /* Fold a_d into the query once per tile; the b_d sum is one constant. */
    __m512 qmax = _mm512_setzero_ps();
    float row_min = INFINITY; /* the smallest row maximum of |qa_d| */
    for (int i = 0; i < r->n; i++) {
        const float *q = r->q + (size_t)i * D;
        float *qa = r->qa + (size_t)i * D;
        __m512 c = _mm512_setzero_ps(), rmax = _mm512_setzero_ps();
        for (int d = 0; d < D; d += 16) {
            __m512 qv = _mm512_loadu_ps(q + d), x = _mm512_mul_ps(qv, _mm512_loadu_ps(ka + d));
            _mm512_storeu_ps(qa + d, x);
            rmax = _mm512_max_ps(rmax, _mm512_abs_ps(x));
            c = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kbias + d), c);
        }
        qmax = _mm512_max_ps(qmax, rmax);
        const float m = _mm512_reduce_max_ps(rmax);
        row_min = m < row_min ? m : row_min;
        r->rc[i] = _mm512_reduce_add_ps(c);
    }
    /* The K sums run times up to 2^28 (4-bit) or 2^30 (2-bit codes,
     * unpack16_pow2): with |qa_d| < 2^80 every product is below 2^112 and a
     * sum of D <= 1024 of them below 2^122, far from the fp32 overflow at
     * 2^128. Queries beyond (no real model's) take the AVX2 kernel, whose
     * sums are the reference's. (V needs no such check: its weights p_t a_t
     * are at most 65504 < 2^16.) */
    if (kb != 8 && !(_mm512_reduce_max_ps(qmax) < 0x1p80f)) {
        attn_avx2_kvarn_tile(r, L, rec, t0, G);
        return;
    }
    /* The next tiles' prefetches (kv_block): where both loops run
     * in int16 (kint and vint: the k4v2 g128 presets) the prefetches go to
     * L2 (prefetcht1, attn_prefetch_step_l2): the Llama-3-8B call at 8k
     * took 3-5% less time than with prefetcht0 on AMD Zen 4, while the fp32
     * loops of k4v4 g128 and k4v2 g64 took 4-10% more (docs/attention-simd.md,
     * "Prefetch into L2"). */
    const int k128 = kb == 4 && G == 128; /* kv_kdots4_128's case */
    /* int16 query (kv_kdots4_128_i16): every row's max |qa_d| at least
     * 2^-100 (so 32767 / max is finite; all-zero and tiny query rows keep
     * fp32), D <= 256 (exact int32 sums); the 2^80 cap is checked above */
    const int kint = attn_avx512_kvarn_k_int16(kb, G, D) && row_min >= 0x1p-100f;
    /* int16 weights (kv_vsum2_i16): 2-bit V of 128-token tiles, 64
     * channels per pass */
    const int vint = attn_avx512_kvarn_v_int16(vb, G, D);
    /* u8 weights (kv_vsum2_u8) in the VNNI build where every a_t >= 0 */
    const int u8 = vint && KV_U8_OK(va, G);
    /* Blocks of up to 6 rows (8 where every loop takes 8: fp32 K of other
     * tiles and 32 channels a V pass) go through the tile start to end
     * (kv_block): the rows' int16 query, scores, softmax, weights and
     * sums, so that their scores and accumulators stay in L1 with the
     * tile's codes. Every row's operations are those of one pass per step
     * over all rows (the earlier order), so the same bits. The next tiles'
     * prefetches: one every 2^pf_shift channels of every block's score
     * loop (about half of them), the rest in the V loops; with packed K
     * codes all of them in kv_pack_k, with packed V codes alone (tiles of
     * 2- or 8-bit K) the V half at the tile's end. */
    const int nv = D % 64 == 0 ? 4 : 2;
    const int max_rb = !k128 && !vint && nv == 2 ? 8 : 6;
    const int nblk = (r->n + max_rb - 1) / max_rb;
    const int steps = nblk * (k128 ? 2 : G / 32) * D, left = attn_prefetch_left(r->pf);
    int pf_shift = 0;
    while (pf_shift < 6 && (steps >> (pf_shift + 1)) >= (left + 1) / 2) pf_shift++;
    /* packed codes (kv_pack_k, kv_pack_v) for items of ATTN_PACK_MIN_ROWS
     * rows or more, in the matrix kernels' scratch (r->mat: there where the
     * call may have items of ATTN_MATRIX_MIN_ROWS rows and its geometry
     * takes the matrix kernel, attn_plan.c; at least 4 D G bytes; K takes
     * 2 D G, V D G, G = 128 both) */
    __m512i *kp = NULL, *vp = NULL;
    if (r->mat && r->n >= ATTN_PACK_MIN_ROWS) {
        __m512i *m = (__m512i *)(void *)r->mat;
        if (k128 && kint) {
            kp = m;
            kv_pack_k(r, kc, kp, vint);
        }
        if (u8) {
            vp = m + (size_t)D * (size_t)G / 32;
            KV_PACK_V(vp);
        }
    }
    kv_tile t = {kc, vc, krow, vrow, kb, vb, G, t0, k128, kint, vint, u8, nv, pf_shift, kp, vp};
    for (int r0 = 0; r0 < r->n;) {
        int rb = block_rows(r->n, max_rb, r0);
#define BCALL(N) kv_block(r, &t, r0, N)
        ATTN_RB_SWITCH8(rb, BCALL)
#undef BCALL
        r0 += rb;
    }
    if (vint)
        attn_prefetch_step_l2(r->pf, attn_prefetch_left(r->pf)); /* any left over */
    else
        attn_prefetch_step(r->pf, attn_prefetch_left(r->pf));
}

/* Specializations on the bit widths, so the unpacking's branches fold away. */
#define KVARN_TILE(KB, VB)                                                                  \
    static void kvarn_tile_k##KB##v##VB(attn_rows *r, const kvarn_record_layout *L,         \
                                        const uint8_t *rec, int t0)                         \
    {                                                                                       \
        kvarn_tile_body(r, L, rec, t0, KB, VB);                                             \
    }
KVARN_TILE(4, 2)
KVARN_TILE(4, 4)
KVARN_TILE(2, 2)
KVARN_TILE(2, 4)
KVARN_TILE(4, 8)
KVARN_TILE(8, 8)
KVARN_TILE(2, 8)
KVARN_TILE(8, 2)
KVARN_TILE(8, 4)

#ifdef KVARN_AVX512_VNNI
void attn_avx512vnni_kvarn_tile(attn_rows *r, const kvarn_record_layout *L, const uint8_t *rec,
                                int t0, int nt)
#else
void attn_avx512_kvarn_tile(attn_rows *r, const kvarn_record_layout *L, const uint8_t *rec,
                            int t0, int nt)
#endif
{
    /* committed records are full (nt == G); tiles of 32+ tokens */
    if (L->tile_tokens % 32 != 0) {
        attn_avx2_kvarn_tile(r, L, rec, t0, nt);
        return;
    }
    switch (L->key_bits * 10 + L->value_bits) {
    case 42: kvarn_tile_k4v2(r, L, rec, t0); break;
    case 44: kvarn_tile_k4v4(r, L, rec, t0); break;
    case 22: kvarn_tile_k2v2(r, L, rec, t0); break;
    case 24: kvarn_tile_k2v4(r, L, rec, t0); break;
    case 48: kvarn_tile_k4v8(r, L, rec, t0); break;
    case 88: kvarn_tile_k8v8(r, L, rec, t0); break;
    case 28: kvarn_tile_k2v8(r, L, rec, t0); break;
    case 82: kvarn_tile_k8v2(r, L, rec, t0); break;
    case 84: kvarn_tile_k8v4(r, L, rec, t0); break;
    default: attn_ref_kvarn_tile(r, L, rec, t0, nt); break;
    }
}
