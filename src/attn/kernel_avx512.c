/*
 * kernel_avx512.c -- AVX-512 (F/BW/VL + FMA/F16C) tile kernels of the
 * attention. Same math, same folding and same order of tiles as
 * kernel_ref.c (the oracle) and kernel_avx2.c; the order of the fp32
 * sums inside a tile differs, and the int16 products below. Chosen at run time by attn.c when
 * kvarn__cpu_level() reports AVX-512 and D % 32 == 0 (codec/cpu.h).
 *
 * The structure follows kernel_avx2.c with 16-lane vectors and 32
 * registers:
 *   token-major K (fp16 pages, per-token formats): 4 tokens x up to 5 rows
 *     of 16-channel partial dots (20 accumulators), reduced at the end;
 *   KVarN K (channel-major codes): 32 tokens x up to 8 rows (16
 *     accumulators; 4-bit K of 128-token tiles: 64 tokens x up to 6 rows),
 *     codes unpacked once per channel for all rows, the broadcast of
 *     (q_d * a_d) embedded in the FMA;
 *   KVarN V: 64 channels x up to 6 rows (D % 64 == 0) or 32 x up to 8;
 *   token-major V (fp16 pages, per-token formats): 32 channels x up to 8
 *     rows.
 * KVarN codes become floats with no shift and no table (unpack16_pow2):
 * each lane masks its code in place in a broadcast word and converts
 * code * 2^(bits * k), the power of two undone once per row and tile, so
 * the conversion runs on the FP add pipes beside the FMAs. Per-token int4
 * codes use a table lookup (vpermps reads the low 4 bits of each lane)
 * after a broadcast and a variable shift; 8-bit codes zero-extension and
 * conversion.
 * fp16/bf16/fp8 as in kernel_avx2.c.
 * The online-softmax step masks positions with 16-bit lane masks.
 * 4-bit K and 2-bit V of 128-token KVarN tiles are multiplied in int16
 * (vpmaddwd; one vpdpwssd in the VNNI build, kernel_avx512_vnni.c, whose
 * V takes vpdpbusd against u8 weights instead) against a query / weights
 * rounded to int16 (u8) per row and tile, and so are the int8
 * per-token codes (token_int8_body, at the end; vpdpbusd on transposed K
 * codes in the VNNI build): the only places the SIMD kernels' arithmetic
 * differs from the reference by more than the order of fp32 sums;
 * docs/attention-intdot.md "Integer (int16) dot products" and "int8: integer dot
 * products" bound the error.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "attn/attn_internal.h"

#define AI static inline __attribute__((always_inline))

/* ------------------------------------------------------------ helpers */

/* exp(x) for x <= 0, as exp256 in kernel_avx2.c: 2^n * P(r), Cody-Waite
 * reduction, degree-7 Taylor polynomial (relative error < 2e-7). */
AI __m512 exp512(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* Lanes [0, n) of a 16-lane mask (n clamped to 0..16). */
AI __mmask16 lanes(int n)
{
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}

AI uint32_t load_u32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

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

/* Code -> float by table: vpermps takes the low 4 bits of each 32-bit
 * index, so a lane whose low 4 bits hold the code (4-bit), or the code plus
 * 4 x the next code (2-bit), looks its value up with no mask and no
 * int -> float conversion. */
AI __m512 code_table(int bits)
{
    return bits == 4 ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                     : _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
}

/* 16 consecutive codes i0..i0+15 (i0 % 16 == 0) of a packed row -> floats,
 * in natural order. */
AI __m512 unpack16(const uint8_t *row, int i0, int bits)
{
    if (bits == 4) {
        /* lanes 0-7 take the first 32-bit word, lanes 8-15 the second */
        const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        const __m512i sh = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
        __m512i w = _mm512_permutexvar_epi32(
            idx, _mm512_castsi128_si512(_mm_loadl_epi64((const __m128i *)(row + i0 / 2))));
        return _mm512_permutexvar_ps(_mm512_srlv_epi32(w, sh), code_table(4));
    } else if (bits == 2) {
        const __m512i sh = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        __m512i w = _mm512_set1_epi32((int)load_u32(row + i0 / 4));
        return _mm512_permutexvar_ps(_mm512_srlv_epi32(w, sh), code_table(2));
    } else { /* 8 */
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + i0))));
    }
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

/* 16 elements d..d+15 (d % 16 == 0) of a per-token code array, before
 * scale and zero-point (E4M3: 2^-8 times the value). */
AI __m512 load16(kvarn_kind kind, const uint8_t *codes, int d)
{
    switch (kind) {
    case KVARN_KIND_FP16:
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(codes + 2 * d)));
    case KVARN_KIND_BF16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(codes + 2 * d))), 16));
    case KVARN_KIND_FP8_E4M3: {
        __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(codes + d)));
        __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7f)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8));
        return _mm512_cvtph_ps(h);
    }
    case KVARN_KIND_FP8_E5M2: {
        __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(codes + d)));
        return _mm512_cvtph_ps(_mm256_slli_epi16(x, 8));
    }
    case KVARN_KIND_INT8:
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + d))));
    case KVARN_KIND_INT4:
        return unpack16(codes, d, 4);
    default:
        return _mm512_setzero_ps();
    }
}

/* Split n rows into balanced blocks of at most max_rb rows. */
AI int block_rows(int n, int max_rb, int r0)
{
    int rest = n - r0;
    int left = (rest + max_rb - 1) / max_rb; /* blocks still to go */
    return (rest + left - 1) / left;
}

/* ------------------------------------------------- online softmax step */

/* As softmax_update_avx2: s holds whole 8-float vectors up to nt rounded
 * up to 8 (the row stride gs is a multiple of 8), so the last 16-lane step
 * is masked to that length. */
static void softmax_row_avx512(attn_rows *r, int i, int t0, int nt)
{
    const int D = r->D, gs = r->gs, nv = (nt + 7) & ~7;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    {
        float *s = r->s + (size_t)i * gs;
        int a, b;
        if (!attn_row_visible(r, i, t0, nt, &a, &b)) {
            for (int t = 0; t < nv; t += 16) _mm512_mask_storeu_ps(s + t, lanes(nv - t), _mm512_setzero_ps());
            return;
        }
        const __m512i va = _mm512_set1_epi32(a - 1), vb = _mm512_set1_epi32(b);
        __m512 mx = ninf;
        for (int t = 0; t < nv; t += 16) {
            __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32(t));
            __mmask16 ok = _mm512_cmpgt_epi32_mask(idx, va) & _mm512_cmpgt_epi32_mask(vb, idx);
            mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(ninf, ok, s + t));
        }
        float mt = _mm512_reduce_max_ps(mx), m_old = r->m[i];
        float m_new = mt > m_old ? mt : m_old;
        float corr = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
        const __m512 vm = _mm512_set1_ps(m_new);
        __m512 sum = _mm512_setzero_ps();
        for (int t = 0; t < nv; t += 16) {
            __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32(t));
            __mmask16 ok = _mm512_cmpgt_epi32_mask(idx, va) & _mm512_cmpgt_epi32_mask(vb, idx);
            const __mmask16 in = lanes(nv - t);
            __m512 p = _mm512_maskz_mov_ps(ok, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, s + t), vm)));
            _mm512_mask_storeu_ps(s + t, in, p);
            sum = _mm512_add_ps(sum, p);
        }
        r->m[i] = m_new;
        r->psum[i] = _mm512_reduce_add_ps(sum);
    r->l[i] = r->l[i] * corr + r->psum[i];
        if (corr != 1.0f) {
            float *acc = r->acc + (size_t)i * D;
            const __m512 vc = _mm512_set1_ps(corr);
            for (int d = 0; d < D; d += 16)
                _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), vc));
        }
    }
}

#ifndef KVARN_AVX512_VNNI /* the VNNI build holds only the KVarN record kernel */
static void softmax_update_avx512(attn_rows *r, int t0, int nt)
{
    for (int i = 0; i < r->n; i++) softmax_row_avx512(r, i, t0, nt);
}

void attn_avx512_softmax_update(attn_rows *r, int t0, int nt) { softmax_update_avx512(r, t0, nt); }

#endif

/* p[t] *= scale[t] for t < nv, and return sum_t p[t] * bias[t] (the
 * per-row constant of the zero-points / KVarN b_t). */
AI float fold_weights(float *p, const float *scale, const float *bias, int nv)
{
    __m512 z = _mm512_setzero_ps();
    for (int t = 0; t < nv; t += 16) {
        const __mmask16 in = lanes(nv - t);
        __m512 pv = _mm512_maskz_loadu_ps(in, p + t);
        if (bias) z = _mm512_fmadd_ps(pv, _mm512_maskz_loadu_ps(in, bias + t), z);
        _mm512_mask_storeu_ps(p + t, in, _mm512_mul_ps(pv, _mm512_maskz_loadu_ps(in, scale + t)));
    }
    return _mm512_reduce_add_ps(z);
}

/* ------------------------------------------- token-major K: dot products */

/* Lanes 8..15 (AVX-512F only; extractf32x8 would need DQ). */
AI __m256 hi8(__m512 a)
{
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
}

/* Sum of the 16 lanes of each of a, b, c, d -> 4 floats. */
AI __m128 hsum4x16(__m512 a, __m512 b, __m512 c, __m512 d)
{
    __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), hi8(a));
    __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), hi8(b));
    __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), hi8(c));
    __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), hi8(d));
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Scores of tokens [t, t + TB) for rows [r0, r0 + RB): raw q . code.
 * TB 4 (or 1 for the tail), RB <= 5: 20 accumulators, 4 codes, 1 query. */
AI void tm_dots(const attn_rows *r, kvarn_kind kind, const uint8_t *const *tok, size_t koff,
                int r0, int RB, int t, int TB, int pf_per_step, float out[5][4])
{
    const int D = r->D;
    __m512 acc[5][4];
#pragma GCC unroll 5
    for (int i = 0; i < RB; i++)
#pragma GCC unroll 4
        for (int j = 0; j < TB; j++) acc[i][j] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) {
        attn_prefetch_step(r->pf, pf_per_step);
        __m512 kv[4];
#pragma GCC unroll 4
        for (int j = 0; j < TB; j++) kv[j] = load16(kind, tok[t + j] + koff, d);
#pragma GCC unroll 5
        for (int i = 0; i < RB; i++) {
            __m512 qv = _mm512_loadu_ps(r->q + (size_t)(r0 + i) * D + d);
#pragma GCC unroll 4
            for (int j = 0; j < TB; j++) acc[i][j] = _mm512_fmadd_ps(qv, kv[j], acc[i][j]);
        }
    }
#pragma GCC unroll 5
    for (int i = 0; i < RB; i++) {
        if (TB == 4) {
            _mm_storeu_ps(out[i], hsum4x16(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
        } else {
            out[i][0] = _mm512_reduce_add_ps(acc[i][0]);
        }
    }
}

/* One block of rows [r0, r0 + RB) over all nt tokens. */
AI void tm_block(attn_rows *r, kvarn_kind kind, const uint8_t *const *tok, size_t koff, int nt,
                 int r0, int RB)
{
    float out[5][4];
    int t = 0;
    /* half the next tiles' prefetches, spread over every 16-channel step;
     * tm_vsum issues the rest, one per token */
    const int steps = nt / 4 * (r->D / 16);
    const int per = steps > 0 ? (attn_prefetch_left(r->pf) / 2 + steps - 1) / steps : 0;
    for (; t + 4 <= nt; t += 4) {
        tm_dots(r, kind, tok, koff, r0, RB, t, 4, per, out);
#pragma GCC unroll 5
        for (int i = 0; i < RB; i++)
            for (int j = 0; j < 4; j++) r->s[(size_t)(r0 + i) * r->gs + t + j] = out[i][j];
    }
    for (; t < nt; t++) {
        tm_dots(r, kind, tok, koff, r0, RB, t, 1, 0, out);
#pragma GCC unroll 5
        for (int i = 0; i < RB; i++) r->s[(size_t)(r0 + i) * r->gs + t] = out[i][0];
    }
}

/* s[r][t] = kscale[t] * (q . code_t) + kzero[t] * qsum[r] for t < nt
 * (kscale NULL: 1, kzero NULL: 0). Each code is converted once per block
 * of up to 5 rows. */
AI void tm_scores(attn_rows *r, kvarn_kind kind, const uint8_t *const *tok, size_t koff, int nt,
                  const float *kscale, const float *kzero)
{
    for (int r0 = 0; r0 < r->n;) {
        int rb = block_rows(r->n, 5, r0);
        switch (rb) {
        case 5: tm_block(r, kind, tok, koff, nt, r0, 5); break;
        case 4: tm_block(r, kind, tok, koff, nt, r0, 4); break;
        case 3: tm_block(r, kind, tok, koff, nt, r0, 3); break;
        case 2: tm_block(r, kind, tok, koff, nt, r0, 2); break;
        default: tm_block(r, kind, tok, koff, nt, r0, 1); break;
        }
        r0 += rb;
    }
    if (kscale == NULL) return;
    /* Whole 8-float vectors: kscale/kzero are zero past nt, the softmax
     * masks s there. */
    const int nv = (nt + 7) & ~7;
    for (int i = 0; i < r->n; i++) {
        float *s = r->s + (size_t)i * r->gs;
        const __m512 qs = _mm512_set1_ps(kzero ? r->qsum[i] : 0.0f);
        for (int t = 0; t < nv; t += 16) {
            const __mmask16 in = lanes(nv - t);
            __m512 z = kzero ? _mm512_mul_ps(_mm512_maskz_loadu_ps(in, kzero + t), qs) : _mm512_setzero_ps();
            _mm512_mask_storeu_ps(s + t, in, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(in, kscale + t),
                                                             _mm512_maskz_loadu_ps(in, s + t), z));
        }
    }
}

/* ------------------------------------------------ token-major V: sums */

/* acc[r][d0..d0+32) += sum_t w[r][t] * v_t[d0..d0+32) (+ bias[r]) for rows
 * [r0, r0 + RB), tokens t < nt. */
AI void tm_vsum(attn_rows *r, kvarn_kind kind, const uint8_t *const *tok, size_t voff, int nt,
                int r0, int RB, int d0, const float *bias)
{
    const int D = r->D, gs = r->gs;
    __m512 acc[8][2];
#pragma GCC unroll 8
    for (int i = 0; i < RB; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int t = 0; t < nt; t++) {
        attn_prefetch_step(r->pf, 1);
        const uint8_t *vp = tok[t] + voff;
        __m512 c0 = load16(kind, vp, d0), c1 = load16(kind, vp, d0 + 16);
#pragma GCC unroll 8
        for (int i = 0; i < RB; i++) {
            __m512 w = _mm512_set1_ps(r->s[(size_t)(r0 + i) * gs + t]);
            acc[i][0] = _mm512_fmadd_ps(w, c0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(w, c1, acc[i][1]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < RB; i++) {
        float *a = r->acc + (size_t)(r0 + i) * D + d0;
        __m512 b = _mm512_set1_ps(bias ? bias[r0 + i] : 0.0f);
        _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_add_ps(acc[i][0], b)));
        _mm512_storeu_ps(a + 16, _mm512_add_ps(_mm512_loadu_ps(a + 16), _mm512_add_ps(acc[i][1], b)));
    }
}

AI void tm_values(attn_rows *r, kvarn_kind kind, const uint8_t *const *tok, size_t voff, int nt,
                  const float *bias)
{
    for (int d0 = 0; d0 < r->D; d0 += 32)
        for (int r0 = 0; r0 < r->n;) {
            int rb = block_rows(r->n, 8, r0);
#define VTCALL(N) tm_vsum(r, kind, tok, voff, nt, r0, N, d0, bias)
            ATTN_RB_SWITCH8(rb, VTCALL)
#undef VTCALL
            r0 += rb;
        }
    attn_prefetch_step(r->pf, attn_prefetch_left(r->pf)); /* any left over */
}

#ifndef KVARN_AVX512_VNNI
/* ---------------------------------------------------------- fp16 pages */

void attn_avx512_fp16_tile(attn_rows *r, const uint16_t *k, const uint16_t *v, int t0, int nt)
{
    /* Token t's K row; its V row is at the same place in the V half. */
    for (int t = 0; t < nt; t++) r->tok[t] = (const uint8_t *)(k + (size_t)t * r->D);
    tm_scores(r, KVARN_KIND_FP16, r->tok, 0, nt, NULL, NULL);
    softmax_update_avx512(r, t0, nt);
    tm_values(r, KVARN_KIND_FP16, r->tok, (size_t)((const uint8_t *)v - (const uint8_t *)k), nt, NULL);
}

/* ----------------------------------------------------- per-token blocks */

#define TOKEN_TILE(NAME, KIND)                                                        \
    void attn_avx512_token_##NAME(attn_rows *r, const kvarn_record_layout *L,         \
                     const uint8_t *const *rec, int t0, int nt)                       \
    {                                                                                 \
        token_tile_body(r, KIND, L, rec, t0, nt);                                     \
    }

AI void token_tile_body(attn_rows *r, kvarn_kind kind, const kvarn_record_layout *L,
                        const uint8_t *const *recs, int t0, int nt)
{
    const int gs = r->gs;
    float *ks = r->meta, *kz = ks + gs, *vs = kz + gs, *vz = vs + gs;
    const int has_zero = L->k_b_bytes != 0, has_scale = L->k_a_bytes != 0;
    /* E4M3 codes load as 2^-8 times their value: fold 2^8 into the scale. */
    const float fix = kind == KVARN_KIND_FP8_E4M3 ? 256.0f : 1.0f;
    if (has_scale) {
        /* The fp16 scale (and zero-point, next to it) of every token, as
         * raw 32-bit words in kz / vz, then converted 16 tokens at a time. */
        uint32_t *kw = (uint32_t *)(void *)kz, *vw = (uint32_t *)(void *)vz;
        if (has_zero) {
            for (int t = 0; t < nt; t++) {
                memcpy(&kw[t], recs[t] + L->k_a_off, 4); /* k_b follows k_a */
                memcpy(&vw[t], recs[t] + L->v_a_off, 4); /* v_b follows v_a */
            }
        } else {
            for (int t = 0; t < nt; t++) {
                uint16_t a, b;
                memcpy(&a, recs[t] + L->k_a_off, 2);
                memcpy(&b, recs[t] + L->v_a_off, 2);
                kw[t] = a;
                vw[t] = b;
            }
        }
        for (int t = nt; t < gs; t++) kw[t] = vw[t] = 0u;
        const __m512 vfix = _mm512_set1_ps(fix);
        for (int t = 0; t < gs; t += 16) {
            const __mmask16 in = lanes(gs - t);
            __m512i k32 = _mm512_maskz_loadu_epi32(in, kw + t), v32 = _mm512_maskz_loadu_epi32(in, vw + t);
            __m512 ka = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(k32));
            __m512 kb = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(k32, 16)));
            __m512 va = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v32));
            __m512 vb = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v32, 16)));
            _mm512_mask_storeu_ps(ks + t, in, _mm512_mul_ps(ka, vfix));
            _mm512_mask_storeu_ps(kz + t, in, kb);
            _mm512_mask_storeu_ps(vs + t, in, _mm512_mul_ps(va, vfix));
            _mm512_mask_storeu_ps(vz + t, in, vb);
        }
    }
    tm_scores(r, kind, recs, L->k_codes_off, nt, has_scale ? ks : NULL, has_zero ? kz : NULL);
    softmax_update_avx512(r, t0, nt);
    float *pz = r->rc;
    if (has_scale) {
        /* Weights p_t * scale_t; the zero-point sum is one constant per row
         * (p is 0 past nt, and so are the scales). */
        const int nv = (nt + 7) & ~7;
        for (int i = 0; i < r->n; i++)
            pz[i] = fold_weights(r->s + (size_t)i * gs, vs, has_zero ? vz : NULL, nv);
    }
    tm_values(r, kind, recs, L->v_codes_off, nt, has_zero ? pz : NULL);
}

TOKEN_TILE(fp16, KVARN_KIND_FP16)
TOKEN_TILE(bf16, KVARN_KIND_BF16)
TOKEN_TILE(fp8_e4m3, KVARN_KIND_FP8_E4M3)
TOKEN_TILE(fp8_e5m2, KVARN_KIND_FP8_E5M2)
/* int8: attn_avx512_token_int8 at the end of the file (integer dot products) */
TOKEN_TILE(int4, KVARN_KIND_INT4)

#endif /* !KVARN_AVX512_VNNI */

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

/* acc + the pairwise sums of a x b (16-bit lanes, int32 sums; exact in the
 * kernels' ranges): vpmaddwd + vpaddd, or one vpdpwssd in the VNNI build
 * (kernel_avx512_vnni.c, run when the CPU has AVX512-VNNI; the same
 * results bit for bit). */
AI __m512i dot_i16(__m512i acc, __m512i a, __m512i b)
{
#ifdef KVARN_AVX512_VNNI
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

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
    const int D = r->D, gs = r->gs;
    const __m512i m0 = _mm512_set1_epi32(0x000f000f), m1 = _mm512_set1_epi32(0x00f000f0);
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
        const __m512i w0 = _mm512_loadu_si512((const void *)(kc + (size_t)d * 64));
        const __m512i w1 = _mm512_loadu_si512((const void *)(kc + (size_t)d * 64 + 64));
        const __m512i x = h == 0 ? _mm512_mask_blend_epi16(0xaaaaaaaau, w0, _mm512_slli_epi32(w1, 16))
                                 : _mm512_mask_blend_epi16(0xaaaaaaaau, _mm512_srli_epi32(w0, 16), w1);
        __m512i c[4];
        c[0] = _mm512_and_si512(x, m0);
        c[1] = _mm512_and_si512(x, m1);
        c[2] = _mm512_and_si512(_mm512_srli_epi16(x, 8), m0);
        c[3] = _mm512_srli_epi16(x, 12);
#pragma GCC unroll 6
        for (int i = 0; i < RB; i++) {
            int32_t qp;
            memcpy(&qp, (const int16_t *)(const void *)(r->qa + (size_t)(r0 + i) * D) + d, 4);
            const __m512i q = _mm512_set1_epi32(qp);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) acc[i][j] = dot_i16(acc[i][j], c[j], q);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < RB; i++) {
        const float sq = r->qa[(size_t)(r0 + i) * D + D / 2];
        float *s = r->s + (size_t)(r0 + i) * gs + 64 * h;
        const __m512 v0 = _mm512_set1_ps(sq), v1 = _mm512_set1_ps(sq * 0.0625f);
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++)
            _mm512_storeu_ps(s + 16 * j, _mm512_mul_ps(_mm512_cvtepi32_ps(acc[i][j]), j == 1 ? v1 : v0));
    }
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

/* The end of kv_vsum2_i16 and kv_vsum2_u8 for rows [r0, r0 + RB): lane k
 * of acc[i][j] holds the int32 sum of channel d0 + 4k + j (times 4^j where
 * pow4: codes masked in place); times sw (the row's float at G / 2 of s),
 * 4^-j where pow4, two rounds of 4 x 4 transposes (inside 128-bit lanes,
 * then of 128-bit lanes) put channels d0 + 16b.. in vector b; then acc +=
 * s_chan (sum + pb), as kv_vsum. */
AI void kv_vsum_epilogue(attn_rows *r, __m512i acc[6][4], const float *schan, const float *pb,
                         int r0, int RB, int d0, int G, int pow4)
{
    const int D = r->D, gs = r->gs;
#pragma GCC unroll 6
    for (int i = 0; i < RB; i++) {
        const float sw = r->s[(size_t)(r0 + i) * gs + G / 2];
        __m512 v[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++)
            v[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[i][j]), _mm512_set1_ps(pow4 ? sw / (float)(1 << (2 * j)) : sw));
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
        float *acc_o = r->acc + (size_t)(r0 + i) * D + d0;
        const __m512 b = _mm512_set1_ps(pb[r0 + i]);
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++)
            _mm512_storeu_ps(acc_o + 16 * k, _mm512_fmadd_ps(_mm512_loadu_ps(schan + d0 + 16 * k),
                                                             _mm512_add_ps(o[k], b), _mm512_loadu_ps(acc_o + 16 * k)));
    }
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
    kv_vsum_epilogue(r, acc, schan, pb, r0, RB, d0, G, 1);
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
    const __m512i m3 = _mm512_set1_epi8(3);
    __m512i acc[6][4];
#pragma GCC unroll 6
    for (int i = 0; i < RB; i++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_si512();
    for (int t = 0; t < G; t += 4) {
        attn_prefetch_step_l2(r->pf, 4); /* kv_vsum2_i16's 2 per token pair */
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
        __m512i c[4];
        c[0] = _mm512_and_si512(x, m3);
        c[1] = _mm512_and_si512(_mm512_srli_epi32(x, 2), m3);
        c[2] = _mm512_and_si512(_mm512_srli_epi32(x, 4), m3);
        c[3] = _mm512_and_si512(_mm512_srli_epi32(x, 6), m3);
#pragma GCC unroll 6
        for (int i = 0; i < RB; i++) {
            int32_t wp;
            memcpy(&wp, (const uint8_t *)(const void *)(r->s + (size_t)(r0 + i) * gs) + t, 4);
            const __m512i w = _mm512_set1_epi32(wp);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], w, c[j]);
        }
    }
    kv_vsum_epilogue(r, acc, schan, pb, r0, RB, d0, G, 0);
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
#else
/* the vpmaddwd build has no vpdpbusd: int16 weights throughout */
#define KV_U8_OK(va, G) 0
#define KV_ROUND_U8(i) ((void)0)
#define KV_VSUM_U8(N) ((void)0)
#endif

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
    /* One prefetch every 2^pf_shift channels of the first row block's
     * score loop: half the next tiles' lines spread over the G/32 x D
     * steps; kv_vsum issues the rest, one per token. Where both loops run
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
    for (int i = 0; kint && i < r->n; i++) kv_round_query(r, i);
    const int steps = (k128 ? 2 : G / 32) * D, left = attn_prefetch_left(r->pf);
    int pf_shift = 0;
    while (pf_shift < 6 && (steps >> (pf_shift + 1)) >= (left + 1) / 2) pf_shift++;
    for (int h = 0; k128 && h < 2; h++)
        for (int r0 = 0; r0 < r->n;) {
            int rb = block_rows(r->n, 6, r0);
#define K4CALL(N) (kint ? kv_kdots4_128_i16(r, kc, r0, N, h, r0 == 0 ? pf_shift : 30, vint) \
                       : kv_kdots4_128(r, kc, r0, N, h, r0 == 0 ? pf_shift : 30))
            ATTN_RB_SWITCH6(rb, K4CALL)
#undef K4CALL
            r0 += rb;
        }
    for (int i = 0; k128 && i < r->n; i++) kv_kfinish128(r, i, t0, stok, va, vbias);
    for (int tb = 0; !k128 && tb < G; tb += 32) {
        for (int r0 = 0; r0 < r->n;) {
            int rb = block_rows(r->n, 8, r0);
#define KCALL(N) kv_kdots(r, kc, krow, kb, stok, r0, N, tb, r0 == 0 ? pf_shift : 30)
            ATTN_RB_SWITCH8(rb, KCALL)
#undef KCALL
            r0 += rb;
        }
    }
    /* Weights p_t * a_t; the b_t sum is one constant per row. */
    float *pb = r->rc;
    for (int i = 0; i < r->n; i++) {
        if (k128 && kv_sees_tile(r, i, t0)) continue; /* done by kv_kfinish128 */
        softmax_row_avx512(r, i, t0, G);
        pb[i] = fold_weights(r->s + (size_t)i * gs, va, vbias, G);
    }
    if (vint) {
        /* u8 weights (kv_vsum2_u8) in the VNNI build where every a_t >= 0 */
        const int u8 = KV_U8_OK(va, G);
        for (int i = 0; i < r->n; i++) {
            if (u8)
                KV_ROUND_U8(i);
            else
                kv_round_weights(r, i, G);
        }
        for (int d0 = 0; d0 < D; d0 += 64)
            for (int r0 = 0; r0 < r->n;) {
                int rb = block_rows(r->n, 6, r0);
#define VICALL(N) (u8 ? KV_VSUM_U8(N) : kv_vsum2_i16(r, vc, vrow, G, schan, pb, r0, N, d0))
                ATTN_RB_SWITCH6(rb, VICALL)
#undef VICALL
                r0 += rb;
            }
        attn_prefetch_step_l2(r->pf, attn_prefetch_left(r->pf)); /* any left over */
        return;
    }
    /* 64 channels per pass (up to 6 rows, 24 accumulators) where D allows,
     * else 32 (up to 8 rows). */
    const int nv = D % 64 == 0 ? 4 : 2;
    for (int d0 = 0; d0 < D; d0 += 16 * nv)
        for (int r0 = 0; r0 < r->n;) {
            int rb = block_rows(r->n, nv == 4 ? 6 : 8, r0);
#define VCALL(N) (nv == 4 ? kv_vsum(r, vc, vrow, vb, G, schan, pb, r0, N, d0, 4) \
                          : kv_vsum(r, vc, vrow, vb, G, schan, pb, r0, N, d0, 2))
            ATTN_RB_SWITCH8(rb, VCALL)
#undef VCALL
            r0 += rb;
        }
    attn_prefetch_step(r->pf, attn_prefetch_left(r->pf)); /* any left over */
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
 * Exact either way, so the two builds give the same bits. */

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

/* int32 q . code of the 16 tokens k[0..15] for rows [r0, r0 + RB), lane j
 * = token j. */
AI void i8v_kdots16(const attn_rows *r, i8_pf *f, const uint8_t *const *k, int r0, int RB, int pf,
                    __m512i *out)
{
    const int D = r->D;
    __m512i hi[4], lo[4];
#pragma GCC unroll 4
    for (int i = 0; i < RB; i++) hi[i] = lo[i] = _mm512_setzero_si512();
    const int pf4 = (pf + 3) / 4; /* spread over the step: a burst stalls */
    for (int d = 0; d < D; d += 64) {
        __m512i x[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++) x[j] = _mm512_loadu_si512((const void *)(k[j] + d));
        i8_transpose16(x);
#pragma GCC unroll 16
        for (int kk = 0; kk < 16; kk++) {
            if ((kk & 3) == 0) i8_pf_step(f, pf4);
#pragma GCC unroll 4
            for (int i = 0; i < RB; i++) {
                const uint8_t *dg = (const uint8_t *)(const void *)(r->qa + (size_t)(r0 + i) * D);
                hi[i] = _mm512_dpbusd_epi32(hi[i], x[kk], _mm512_set1_epi32((int)load_u32(dg + d + 4 * kk)));
                lo[i] = _mm512_dpbusd_epi32(lo[i], x[kk], _mm512_set1_epi32((int)load_u32(dg + D + d + 4 * kk)));
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

/* Scores of rows [r0, r0 + RB) (RB <= 4) over the span's nt tokens:
 * s[i][t] = scale_t sq_i (acc_t - 128 sum qi) + zc_t qsum_i, zc_t = zero_t
 * + 128 scale_t, and the largest score of each row's visible positions
 * (I8_MX of its qa scratch, -inf where none). 16 tokens per step (a token
 * past nt repeats the last one; its score is not stored). The first row
 * block (first != 0) also converts the tokens' scales and zero-points:
 * their raw words, read one step ahead (i8_meta_words, into the zc and vz
 * arrays), become ks = scale_K, zc, vs = scale_V and vz = zero_V + 128
 * scale_V, zero past nt (up to nt rounded up to 8); later blocks read ks
 * and zc back. */
AI void i8_kblock(attn_rows *r, i8_pf *f, const uint8_t *const *tok, const kvarn_record_layout *L,
                  int t0, int nt, int r0, int RB, float *meta, int first)
{
    const int D = r->D, gs = r->gs, nv = (nt + 7) & ~7;
    const size_t koff = L->k_codes_off;
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
            const __m512 c128 = _mm512_set1_ps(128.0f);
            const __m512 kb = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(k32, 16)));
            const __m512 sa = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v32));
            const __m512 sb = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v32, 16)));
            const __mmask16 keep = lanes(nv - t);
            kst = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(k32));
            zct = _mm512_fmadd_ps(kst, c128, kb);
            _mm512_mask_storeu_ps(ks + t, keep, kst);
            _mm512_mask_storeu_ps(zc + t, keep, zct);
            _mm512_mask_storeu_ps(vs + t, keep, sa);
            _mm512_mask_storeu_ps(vz + t, keep, _mm512_fmadd_ps(sa, c128, sb));
        } else {
            kst = _mm512_maskz_loadu_ps(in, ks + t);
            zct = _mm512_maskz_loadu_ps(in, zc + t);
        }
        __m512i sums[4];
#ifdef KVARN_AVX512_VNNI
        if (I8_VNNI_K(D)) {
            const uint8_t *k[16];
            for (int j = 0; j < 16; j++) k[j] = tok[t + j < nt ? t + j : nt - 1] + koff;
            i8v_kdots16(r, f, k, r0, RB, per, sums);
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
                for (int j = 0; j < 4; j++) k[j] = tok[tb + j < nt ? tb + j : nt - 1] + koff;
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

AI void token_int8_body(attn_rows *r, const kvarn_record_layout *L, const uint8_t *const *recs,
                        int t0, int nt)
{
    const int gs = r->gs, D = r->D;
    float *vs = r->meta + 2 * gs, *vz = vs + gs;
    /* the query does not change over the item's spans: rounded once */
    if (!r->qa_ready) {
        for (int i = 0; i < r->n; i++) i8_round_query(r, i);
        r->qa_ready = 1;
    }
    i8_pf pf;
    i8_pf_init(&pf, r->pf);
    for (int r0 = 0; r0 < r->n;) {
        const int rb = block_rows(r->n, 4, r0), first = r0 == 0;
        switch (rb) {
        case 4: i8_kblock(r, &pf, recs, L, t0, nt, r0, 4, r->meta, first); break;
        case 3: i8_kblock(r, &pf, recs, L, t0, nt, r0, 3, r->meta, first); break;
        case 2: i8_kblock(r, &pf, recs, L, t0, nt, r0, 2, r->meta, first); break;
        default: i8_kblock(r, &pf, recs, L, t0, nt, r0, 1, r->meta, first); break;
        }
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
#define I8VCALL(N) (NH == 2 ? i8_vsum(r, &pf, recs, L->v_codes_off, nt, r0, N, d0, 2) \
                            : i8_vsum(r, &pf, recs, L->v_codes_off, nt, r0, N, d0, 1))
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

#ifdef KVARN_AVX512_VNNI
void attn_avx512vnni_token_int8(attn_rows *r, const kvarn_record_layout *L,
                                const uint8_t *const *rec, int t0, int nt)
{
    if (!i8_ok(r, nt)) {
        attn_avx512_token_int8(r, L, rec, t0, nt); /* the fp32 path */
        return;
    }
    token_int8_body(r, L, rec, t0, nt);
}
#else
void attn_avx512_token_int8(attn_rows *r, const kvarn_record_layout *L,
                            const uint8_t *const *rec, int t0, int nt)
{
    if (!i8_ok(r, nt)) {
        r->qa_ready = 0; /* (the fp32 path may use qa) */
        token_tile_body(r, KVARN_KIND_INT8, L, rec, t0, nt);
        return;
    }
    token_int8_body(r, L, rec, t0, nt);
}
#endif
