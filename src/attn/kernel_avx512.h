/*
 * kernel_avx512.h -- the common header of the AVX-512 attention tile
 * kernels: the helpers their files share, as static inline functions.
 * Include it only from files compiled with the AVX-512 flags
 * (CMakeLists.txt kvarn_simd_flags: *_avx512.c, *_avx512_<part>.c,
 * *_avx512_vnni.c; checked below). The files:
 *   kernel_avx512.c        the fp16 page kernel, the exported online-softmax
 *                          step and the fp16/bf16/fp8/int4 per-token tiles;
 *   kernel_avx512_int8.c   the int8 per-token tile (integer dot products);
 *   kernel_avx512_kvarn.c  the KVarN record tile;
 *   kernel_avx512_vnni.c   the int8 and KVarN tiles again, compiled with
 *                          -mavx512vnni and KVARN_AVX512_VNNI defined;
 *   kernel_avx512_bf16.c   the fp8 and bf16 spans of many rows
 *                          on vdpbf16ps (-mavx512bf16, KVARN_AVX512_BF16).
 *
 * The kernels, AVX-512 F/BW/VL + FMA/F16C, compute the
 * attention. Same math, same folding and same order of tiles as
 * kernel_ref.c (the oracle) and kernel_avx2.c; the order of the fp32
 * sums inside a tile differs, and the int16 products below. Chosen at run time (attn_dispatch.c) when
 * kvarn__cpu_level() reports AVX-512 and D % 32 == 0 (common/cpu.h).
 *
 * The structure follows kernel_avx2.c with 16-lane vectors and 32
 * registers:
 *   token-major K (fp16 pages, per-token formats): 4 tokens x up to 5 rows
 *     of 16-channel partial dots (20 accumulators), reduced at the end;
 *     items of ATTN_SPAN_F32_MIN_ROWS rows or more convert a span's codes to fp32
 *     once (tm_span_f32: K channel-major, 32 tokens x up to 8 rows, each
 *     block of rows through scores, softmax and V before the next);
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
 * codes in the fp32 loop (a span the integer path does not take) use a
 * table lookup (vpermps reads the low 4 bits of each lane) after a
 * broadcast and a variable shift; 8-bit codes zero-extension and
 * conversion.
 * fp16/bf16/fp8 as in kernel_avx2.c.
 * The online-softmax step masks positions with 16-bit lane masks.
 * 4-bit K and 2-bit V of 128-token KVarN tiles are multiplied in int16
 * (vpmaddwd; one vpdpwssd in the VNNI build, kernel_avx512_vnni.c, whose
 * V takes vpdpbusd against u8 weights instead) against a query / weights
 * rounded to int16 (u8) per row and tile, and so are the int8 and int4
 * per-token codes (token_int_body, kernel_avx512_int8.c; int4 widened to
 * bytes; vpdpbusd on transposed K codes in the VNNI build): the only
 * places the SIMD kernels' arithmetic
 * differs from the reference by more than the order of fp32 sums;
 * docs/attention-intdot.md "Integer (int16) dot products" and "int8: integer dot
 * products" bound the error.
 */
#ifndef KVARN_ATTN_KERNEL_AVX512_H
#define KVARN_ATTN_KERNEL_AVX512_H

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || \
    !defined(__FMA__) || !defined(__F16C__)
#error "kernel_avx512.h: only for files compiled with the AVX-512 flags (CMakeLists.txt kvarn_simd_flags)"
#endif
#if defined(KVARN_AVX512_BF16) && !defined(__AVX512BF16__)
#error "kernel_avx512.h: KVARN_AVX512_BF16 needs -mavx512bf16 (a *_avx512_bf16.c file)"
#endif
#if defined(KVARN_AVX512_VNNI) && !defined(__AVX512VNNI__)
#error "kernel_avx512.h: KVARN_AVX512_VNNI needs -mavx512vnni (a *_avx512_vnni.c file)"
#endif

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "attn/attn_internal.h"
#include "attn/transpose8.h"

#define AI static inline __attribute__((always_inline))
/* A shared helper kept out of line (one call per row), as the compiler
 * kept it when the kernels were one file; unused: no warning in a file
 * that does not call it. */
#define NI static __attribute__((noinline, unused))

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

/* As softmax_rows_avx2 (kernel_avx2.c): s holds whole 8-float vectors up to nt rounded
 * up to 8 (the row stride gs is a multiple of 8), so the last 16-lane step
 * is masked to that length. */
NI void softmax_row_avx512(attn_rows *r, int i, int t0, int nt)
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

static inline void softmax_update_avx512(attn_rows *r, int t0, int nt)
{
    for (int i = 0; i < r->n; i++) softmax_row_avx512(r, i, t0, nt);
}

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

/* ------------------------------------------------ integer dot products */

/* acc + the pairwise sums of a x b (16-bit lanes, int32 sums; exact in the
 * kernels' ranges): vpmaddwd + vpaddd, or one vpdpwssd in the VNNI build
 * (kernel_avx512_vnni.c, run when the CPU has AVX512-VNNI; the same
 * results bit for bit). The VNNI instructions go through inline asm: with
 * GCC 12's builtins (_mm512_dpwssd_epi32, _mm512_dpbusd_epi32) a loop of
 * 24 accumulators copied every accumulator before its dot product and
 * stored it to the stack after, every step (objdump of kv_kdots4_128_pk:
 * 24 stores a step); the asm operand "+v" keeps each in its register. */
AI __m512i dot_i16(__m512i acc, __m512i a, __m512i b)
{
#ifdef KVARN_AVX512_VNNI
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

#ifdef KVARN_AVX512_VNNI
/* acc + the sums of 4 products u8 x s8 per 32-bit lane (vpdpbusd, exact:
 * _mm512_dpbusd_epi32(acc, u, s)), through inline asm as dot_i16. */
AI __m512i dot_u8s8(__m512i acc, __m512i u, __m512i s)
{
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
    return acc;
}
#endif

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
 * [r0, r0 + RB), tokens t < nt; the codes from the records, or (vf not
 * NULL) already fp32, vf[nt][D] (tm_span_f32). */
AI void tm_vsum(attn_rows *r, kvarn_kind kind, const uint8_t *const *tok, size_t voff,
                const float *vf, int nt, int r0, int RB, int d0, const float *bias)
{
    const int D = r->D, gs = r->gs;
    __m512 acc[8][2];
#pragma GCC unroll 8
    for (int i = 0; i < RB; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int t = 0; t < nt; t++) {
        attn_prefetch_step(r->pf, 1);
        __m512 c0, c1;
        if (vf) {
            c0 = _mm512_loadu_ps(vf + (size_t)t * D + d0);
            c1 = _mm512_loadu_ps(vf + (size_t)t * D + d0 + 16);
        } else {
            c0 = load16(kind, tok[t] + voff, d0);
            c1 = load16(kind, tok[t] + voff, d0 + 16);
        }
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
#define VTCALL(N) tm_vsum(r, kind, tok, voff, NULL, nt, r0, N, d0, bias)
            ATTN_RB_SWITCH8(rb, VTCALL)
#undef VTCALL
            r0 += rb;
        }
    attn_prefetch_step(r->pf, attn_prefetch_left(r->pf)); /* any left over */
}

/* ------------------ fp32 codes of a span: items of many rows (prefill) */

/* A span's codes (before scale and zero-point, as load16 gives them) as
 * fp32: K channel-major, kf[d][np] for tokens [0, np), np = nt rounded up
 * to 8, the tokens past nt 0 (8 tokens x 16 channels a step, two 8 x 8
 * transposes); V as they are, vf[nt][D]. */
AI void tm_codes_f32(kvarn_kind kind, const uint8_t *const *tok, size_t koff, size_t voff, int nt,
                     int D, int np, float *kf, float *vf)
{
    for (int t = 0; t < nt; t++)
        for (int d = 0; d < D; d += 16) _mm512_storeu_ps(vf + (size_t)t * D + d, load16(kind, tok[t] + voff, d));
    for (int t = 0; t < np; t += 8) {
        for (int d = 0; d < D; d += 16) {
            __m256 lo[8], hi[8];
            for (int j = 0; j < 8; j++) {
                __m512 x = t + j < nt ? load16(kind, tok[t + j] + koff, d) : _mm512_setzero_ps();
                lo[j] = _mm512_castps512_ps256(x);
                hi[j] = hi8(x);
            }
            attn_transpose8(lo);
            attn_transpose8(hi);
            for (int j = 0; j < 8; j++) {
                _mm256_storeu_ps(kf + (size_t)(d + j) * np + t, lo[j]);
                _mm256_storeu_ps(kf + (size_t)(d + 8 + j) * np + t, hi[j]);
            }
        }
    }
}

/* Scores of tokens [tb, tb + 16 TW) for rows [r0, r0 + RB), up to 8 rows,
 * from the channel-major codes (the last vector's lanes past np masked):
 * s = ks_t (q . code_t) + kz_t qsum (ks NULL: the raw dots; kz NULL: no
 * zero point), one broadcast of q[r][d] per row and channel. */
AI void kc_dots(attn_rows *r, const float *kf, int np, int r0, int RB, int tb, int TW,
                const float *ks, const float *kz)
{
    const int D = r->D, gs = r->gs;
    const __mmask16 m0 = lanes(np - tb), m1 = lanes(np - tb - 16);
    __m512 acc[8][2];
#pragma GCC unroll 8
    for (int i = 0; i < RB; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const float *kp = kf + tb;
    for (int d = 0; d < D; d++, kp += np) {
        __m512 c0 = _mm512_maskz_loadu_ps(m0, kp), c1 = TW == 2 ? _mm512_maskz_loadu_ps(m1, kp + 16) : c0;
#pragma GCC unroll 8
        for (int i = 0; i < RB; i++) {
            __m512 w = _mm512_set1_ps(r->q[(size_t)(r0 + i) * D + d]);
            acc[i][0] = _mm512_fmadd_ps(w, c0, acc[i][0]);
            if (TW == 2) acc[i][1] = _mm512_fmadd_ps(w, c1, acc[i][1]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < RB; i++) {
        float *s = r->s + (size_t)(r0 + i) * gs + tb;
        const __m512 qs = _mm512_set1_ps(kz ? r->qsum[r0 + i] : 0.0f);
        for (int h = 0; h < TW; h++) {
            const __mmask16 m = h ? m1 : m0;
            __m512 a = acc[i][h];
            if (ks) {
                __m512 z = kz ? _mm512_mul_ps(_mm512_maskz_loadu_ps(m, kz + tb + 16 * h), qs) : _mm512_setzero_ps();
                a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, ks + tb + 16 * h), a, z);
            }
            _mm512_mask_storeu_ps(s + 16 * h, m, a);
        }
    }
}

/* kc_dots over a span for one block of rows, out of line per row count
 * (kernel_avx2.c kv_rows' reason: the accumulators stay in registers). */
typedef void (*kc_scores_fn)(attn_rows *r, const float *kf, int np, int r0, const float *ks,
                             const float *kz, int per);
#define KC_SCORES_FN(N)                                                                        \
    NI void kc_scores_##N(attn_rows *r, const float *kf, int np, int r0, const float *ks,      \
                          const float *kz, int per)                                            \
    {                                                                                          \
        int tb = 0;                                                                            \
        for (; tb + 16 < np; tb += 32) {                                                       \
            attn_prefetch_step(r->pf, per);                                                    \
            kc_dots(r, kf, np, r0, N, tb, 2, ks, kz);                                          \
        }                                                                                      \
        if (tb < np) kc_dots(r, kf, np, r0, N, tb, 1, ks, kz);                                 \
    }
KC_SCORES_FN(1)
KC_SCORES_FN(2)
KC_SCORES_FN(3)
KC_SCORES_FN(4)
KC_SCORES_FN(5)
KC_SCORES_FN(6)
KC_SCORES_FN(7)
KC_SCORES_FN(8)
#undef KC_SCORES_FN

/* A per-token span (or fp16 page) for all rows from its codes made fp32
 * once (tm_codes_f32, in r->mat: 2 D cap floats, attn_plan.c), in chunks
 * of cap tokens: each block of up to 8 rows through the scores of 32
 * tokens a pass from the channel-major K (kc_dots: no horizontal sums), the
 * softmax step, the weights folded with the V scales, and the value sums
 * (tm_vsum on vf: no conversion), before the next block. Items of at least
 * ATTN_SPAN_F32_MIN_ROWS rows where r->mat is there; returns 0 (nothing done)
 * otherwise. ks .. vz as token_tile_body's (NULL: none). */
AI int tm_span_f32(attn_rows *r, kvarn_kind kind, const uint8_t *const *tok, size_t koff,
                   size_t voff, int t0, int nt, const float *ks, const float *kz, const float *vs,
                   const float *vz)
{
    const int cap = r->mat ? attn_token_matrix_span(r->gs) : 0;
    if (r->n < ATTN_SPAN_F32_MIN_ROWS || cap < 16) return 0;
    const int D = r->D, gs = r->gs;
    float *kf = (float *)(void *)r->mat, *pz = r->rc;
    for (int j0 = 0; j0 < nt; j0 += cap) {
        /* a chunk before the last is cap tokens, a multiple of 32: only
         * the last has lanes past its end (0 in ks .. vz) */
        const int n = nt - j0 < cap ? nt - j0 : cap, np = (n + 7) & ~7;
        float *vf = kf + (size_t)D * np;
        tm_codes_f32(kind, tok + j0, koff, voff, n, D, np, kf, vf);
        const float *cks = ks ? ks + j0 : NULL, *ckz = kz ? kz + j0 : NULL;
        const float *cvs = vs ? vs + j0 : NULL, *cvz = vz ? vz + j0 : NULL;
        const int steps = (r->n + 7) / 8 * ((np + 31) / 32);
        const int per = (attn_prefetch_left(r->pf) + steps - 1) / steps;
        for (int r0 = 0; r0 < r->n;) {
            const int rb = block_rows(r->n, 8, r0);
#define KSCALL(N) kc_scores_##N(r, kf, np, r0, cks, ckz, per)
            ATTN_RB_SWITCH8(rb, KSCALL)
#undef KSCALL
            for (int i = r0; i < r0 + rb; i++) {
                softmax_row_avx512(r, i, t0 + j0, n);
                if (cvs) pz[i] = fold_weights(r->s + (size_t)i * gs, cvs, cvz, np);
            }
            for (int d0 = 0; d0 < D; d0 += 32) {
#define VSCALL(N) tm_vsum(r, kind, NULL, 0, vf, n, r0, N, d0, cvz ? pz : NULL)
                ATTN_RB_SWITCH8(rb, VSCALL)
#undef VSCALL
            }
            r0 += rb;
        }
    }
    attn_prefetch_step(r->pf, attn_prefetch_left(r->pf)); /* any left over */
    return 1;
}

/* ----------------------------------------------------- per-token tiles */

/* One tile of a per-token kind in fp32 (token_tile_body): the scales and
 * zero-points of its tokens (token_meta), the scores (tm_scores), the
 * softmax step, the weights folded with the V scales, the sums (tm_values).
 * The kernels of kernel_avx512.c, the int8 kernel's fp32 path
 * (kernel_avx512_int8.c) and the AVX512-BF16 kernels' fallback
 * (kernel_avx512_bf16.c). */

/* The scales and zero-points of a span's tokens into r->meta (ks, kz, vs,
 * vz: gs floats each, 0 past nt); E4M3's 2^8 folded into the scales.
 * token_tile_body's first part (kernel_avx512_bf16.c runs it alone). */
AI void token_meta(attn_rows *r, kvarn_kind kind, const kvarn_record_layout *L,
                   const uint8_t *const *recs, int nt)
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
}

/* The rest of token_tile_body, after token_meta (r->meta filled). */
AI void token_tile_rest(attn_rows *r, kvarn_kind kind, const kvarn_record_layout *L,
                        const uint8_t *const *recs, int t0, int nt)
{
    const int gs = r->gs;
    float *ks = r->meta, *kz = ks + gs, *vs = kz + gs, *vz = vs + gs;
    const int has_zero = L->k_b_bytes != 0, has_scale = L->k_a_bytes != 0;
    if (tm_span_f32(r, kind, recs, L->k_codes_off, L->v_codes_off, t0, nt, has_scale ? ks : NULL,
                    has_zero ? kz : NULL, has_scale ? vs : NULL, has_zero ? vz : NULL))
        return;
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

AI void token_tile_body(attn_rows *r, kvarn_kind kind, const kvarn_record_layout *L,
                        const uint8_t *const *recs, int t0, int nt)
{
    token_meta(r, kind, L, recs, nt);
    token_tile_rest(r, kind, L, recs, t0, nt);
}

#endif
