/*
 * amx_tiles.h -- the few Intel AMX tile operations the matrix kernel
 * (kernel_amx.c) uses, as the hardware's intrinsics or, with
 * KVARN_AMX_EMULATE defined, as plain C that follows the instructions'
 * definitions (Intel SDM vol. 2, LDTILECFG, TILELOADD, TILESTORED,
 * TILEZERO, TDPBF16PS, TILERELEASE), so that the kernel's logic is tested
 * on any CPU (kernel_amx_emu.c), as tests/cuda/emu does for the CUDA
 * kernels. Not part of the public contract.
 *
 * Tile numbers are compile-time constants (the instructions encode them).
 * Every tile the kernel configures is 16 rows of 64 bytes: 16 x 16 fp32
 * (C), 16 x 32 bf16 (A), or 16 pairs of rows x 16 columns of bf16 pairs
 * (B, the "VNNI" layout: element (k, n) at row k / 2, column 2 n + k % 2).
 */
#ifndef KVARN_AMX_TILES_H
#define KVARN_AMX_TILES_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* LDTILECFG's 64-byte operand (palette 1). */
typedef struct amx_tilecfg {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16]; /* bytes per row of tile i */
    uint8_t rows[16];   /* rows of tile i */
} amx_tilecfg;

/* Tiles 0..7 as 16 rows x 64 bytes. */
static inline void amx_config_16x64(amx_tilecfg *c)
{
    memset(c, 0, sizeof *c);
    c->palette = 1;
    for (int i = 0; i < 8; i++) {
        c->colsb[i] = 64;
        c->rows[i] = 16;
    }
}

#ifdef KVARN_AMX_EMULATE

/* The emulated tile file of the calling thread. */
typedef struct amx_emu_state {
    amx_tilecfg cfg;
    union {
        uint8_t b[16][64];
        float f[16][16];
        uint16_t h[16][32];
    } t[8];
} amx_emu_state;
static _Thread_local amx_emu_state amx_emu;

static inline void amx_emu_load(int n, const void *base, long stride)
{
    const uint8_t *p = base;
    for (int m = 0; m < amx_emu.cfg.rows[n]; m++)
        memcpy(amx_emu.t[n].b[m], p + (long)m * stride, amx_emu.cfg.colsb[n]);
}

static inline void amx_emu_store(int n, void *base, long stride)
{
    uint8_t *p = base;
    for (int m = 0; m < amx_emu.cfg.rows[n]; m++)
        memcpy(p + (long)m * stride, amx_emu.t[n].b[m], amx_emu.cfg.colsb[n]);
}

/* A bf16 input as TDPBF16PS reads it: denormals as zero (DAZ). */
static inline float amx_emu_bf16(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* C[m][n] += sum_k A[m][2k] B[k][2n] + A[m][2k + 1] B[k][2n + 1], in fp32
 * in the order of the SDM's pseudo-code (the products of two bf16 values
 * are exact in fp32). */
static inline void amx_emu_dpbf16ps(int c, int a, int b)
{
    const int M = amx_emu.cfg.rows[c], N = amx_emu.cfg.colsb[c] / 4, K = amx_emu.cfg.colsb[a] / 4;
    for (int m = 0; m < M; m++)
        for (int k = 0; k < K; k++)
            for (int n = 0; n < N; n++) {
                float acc = amx_emu.t[c].f[m][n];
                acc += amx_emu_bf16(amx_emu.t[a].h[m][2 * k]) * amx_emu_bf16(amx_emu.t[b].h[k][2 * n]);
                acc += amx_emu_bf16(amx_emu.t[a].h[m][2 * k + 1]) *
                       amx_emu_bf16(amx_emu.t[b].h[k][2 * n + 1]);
                amx_emu.t[c].f[m][n] = acc;
            }
}

#define AMX_CONFIG(c) memcpy(&amx_emu.cfg, (c), sizeof amx_emu.cfg)
#define AMX_RELEASE() memset(&amx_emu, 0, sizeof amx_emu)
#define AMX_ZERO(n) memset(amx_emu.t[n].b, 0, sizeof amx_emu.t[n].b)
#define AMX_LOAD(n, base, stride) amx_emu_load((n), (base), (long)(stride))
#define AMX_STORE(n, base, stride) amx_emu_store((n), (base), (long)(stride))
#define AMX_DPBF16PS(c, a, b) amx_emu_dpbf16ps((c), (a), (b))

#else /* the hardware's instructions (compiled with -mamx-tile -mamx-bf16) */

#include <immintrin.h>

#define AMX_CONFIG(c)                         \
    do {                                      \
        AMX_BARRIER();                        \
        _tile_loadconfig(c);                  \
    } while (0)
#define AMX_RELEASE() _tile_release()
/* GCC's tile macros paste the tile number into the instruction's text:
 * pass the bare literal. GCC 12's ldtilecfg names only the first 8 bytes
 * of the configuration as its memory operand, and its tileloadd takes the
 * address in a register with no memory operand or clobber: the compiler
 * may then keep the configuration's or the operands' stores pending, or
 * drop them as dead (nothing else reads those buffers). A compiler barrier
 * before each makes every earlier store happen first; tilestored has its
 * own "memory" clobber. */
#define AMX_BARRIER() __asm__ volatile("" ::: "memory")
#define AMX_ZERO(n) _tile_zero(n)
#define AMX_LOAD(n, base, stride)             \
    do {                                      \
        AMX_BARRIER();                        \
        _tile_loadd(n, (base), (stride));     \
    } while (0)
#define AMX_STORE(n, base, stride) _tile_stored(n, (base), (stride))
#define AMX_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)

#endif

/* ---- what both matrix kernels (kernel_amx.c, mla_amx.c) build on ---- */

/* fp32 -> bf16, round to nearest even (the inputs here are finite). */
static inline uint16_t amx_bf16_of(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* x as two bf16 values, *hi = bf16(x) and *lo = bf16(x - hi) (x - hi is
 * exact in fp32): |x - hi - lo| <= 2^-16 |x|, below 2^-126 aside. */
static inline void amx_bf16_split(float x, uint16_t *hi, uint16_t *lo)
{
    const uint16_t h = amx_bf16_of(x);
    const uint32_t u = (uint32_t)h << 16;
    float hf;
    memcpy(&hf, &u, 4);
    *hi = h;
    *lo = amx_bf16_of(x - hf);
}

/* The per-tile vector work both matrix kernels do around the products,
 * on whole vectors of 16 lanes (every n, G and D here is a multiple of 16).
 * The AVX-512 forms round as the scalar ones (the same fp32 multiply,
 * round-to-nearest-even), so the emulated kernel gives the real one's
 * halves bit for bit but for values below 2^-126 (which the tiles read as
 * 0 either way); the order of the fp32 sums of amx_split_scaled's dot
 * product differs. */

/* hi[i], lo[i] = the two bf16 halves of x[i] * a[i] (amx_bf16_split; a
 * NULL: of x[i]), for i < n (lo NULL: hi alone, bf16(x[i] * a[i]));
 * returns sum_i x[i] * b[i] (fp32; 0 with b NULL). amax (NULL: not
 * wanted) gets max_i |x[i] a[i]| (the caller's range check). The
 * AVX-512 form of hi alone is vcvtneps2bf16 (nearest even, as
 * amx_bf16_of, but a product below 2^-126 gives 0: the tiles read
 * amx_bf16_of's value there as 0 too). */
static inline float amx_split_scaled(const float *x, const float *a, const float *b, int n,
                                     uint16_t *hi, uint16_t *lo, float *amax)
{
#ifdef KVARN_AMX_EMULATE
    float sum = 0.0f, mx = 0.0f;
    for (int i = 0; i < n; i++) {
        const float v = a ? x[i] * a[i] : x[i];
        if (lo) amx_bf16_split(v, &hi[i], &lo[i]);
        else hi[i] = amx_bf16_of(v);
        if (b) sum += x[i] * b[i];
        mx = fabsf(v) > mx ? fabsf(v) : mx;
    }
    if (amax) *amax = mx;
    return sum;
#else
    const __m512i rnd = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
    __m512 acc = _mm512_setzero_ps(), mx = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        const __m512 xv = _mm512_loadu_ps(x + i), v = a ? _mm512_mul_ps(xv, _mm512_loadu_ps(a + i)) : xv;
        mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
        if (lo) {
            __m512i u = _mm512_castps_si512(v);
            u = _mm512_add_epi32(u, _mm512_add_epi32(rnd, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
            const __m512i h = _mm512_and_si512(u, top);
            _mm256_storeu_si256((__m256i *)(hi + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)));
            const __m512 r = _mm512_sub_ps(v, _mm512_castsi512_ps(h));
            __m512i ul = _mm512_castps_si512(r);
            ul = _mm512_add_epi32(ul, _mm512_add_epi32(rnd, _mm512_and_si512(_mm512_srli_epi32(ul, 16), one)));
            _mm256_storeu_si256((__m256i *)(lo + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(ul, 16)));
        } else {
            _mm256_storeu_si256((__m256i *)(hi + i), (__m256i)_mm512_cvtneps_pbh(v));
        }
        if (b) acc = _mm512_fmadd_ps(xv, _mm512_loadu_ps(b + i), acc);
    }
    if (amax) *amax = _mm512_reduce_max_ps(mx);
    return b ? _mm512_reduce_add_ps(acc) : 0.0f;
#endif
}

/* Two rows of n codes (one per byte) as bf16 (exact) in the pair layout
 * of a B operand: out[2 i] = r0[i], out[2 i + 1] = r1[i]. */
static inline void amx_pair_codes(const uint8_t *r0, const uint8_t *r1, int n, uint16_t *out)
{
#ifdef KVARN_AMX_EMULATE
    for (int i = 0; i < n; i++) {
        out[2 * i] = amx_bf16_of((float)r0[i]);
        out[2 * i + 1] = amx_bf16_of((float)r1[i]);
    }
#else
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
    for (int i = 0; i < n; i += 16) {
        const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r0 + i))));
        const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r1 + i))));
        const __m512i w = _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(f0), 16),
                                          _mm512_and_si512(_mm512_castps_si512(f1), top));
        _mm512_storeu_si512(out + 2 * i, w);
    }
#endif
}

#ifndef KVARN_AMX_EMULATE
/* Codes i .. i + 15 of a row of packed codes of 2, 4 or 8 bits (record.h:
 * low bits first), one per 32-bit lane. */
static inline __m512i amx_codes16(const uint8_t *row, int i, int bits)
{
    const uint8_t *p = row + (size_t)i * (size_t)bits / 8;
    if (bits == 8) return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    uint32_t w0, w1 = 0;
    memcpy(&w0, p, 4);
    if (bits == 4) memcpy(&w1, p + 4, 4);
    __m512i v = bits == 4 ? _mm512_mask_blend_epi32((__mmask16)0xff00, _mm512_set1_epi32((int)w0),
                                                    _mm512_set1_epi32((int)w1))
                          : _mm512_set1_epi32((int)w0);
    /* lane j: code j at bit bits * j of the 32-bit word it lies in */
    const __m512i sh = bits == 4 ? _mm512_slli_epi32(_mm512_and_si512(lane, _mm512_set1_epi32(7)), 2)
                                 : _mm512_slli_epi32(lane, 1);
    return _mm512_and_si512(_mm512_srlv_epi32(v, sh), _mm512_set1_epi32((1 << bits) - 1));
}
#endif

/* Two rows of n packed codes of 2, 4 or 8 bits, centred (code - 2^(bits -
 * 1), in [-2^(bits - 1), 2^(bits - 1)): exact in bf16), in the pair layout
 * of a B operand: out[2 i] = centred code i of r0, out[2 i + 1] = that of
 * r1. */
static inline void amx_pair_packed(const uint8_t *r0, const uint8_t *r1, int n, int bits,
                                   uint16_t *out)
{
    const int centre = 1 << (bits - 1);
#ifdef KVARN_AMX_EMULATE
    for (int i = 0; i < n; i++) {
        const int c0 = (r0[(size_t)i * bits / 8] >> ((i * bits) % 8)) & ((1 << bits) - 1);
        const int c1 = (r1[(size_t)i * bits / 8] >> ((i * bits) % 8)) & ((1 << bits) - 1);
        out[2 * i] = amx_bf16_of((float)(c0 - centre));
        out[2 * i + 1] = amx_bf16_of((float)(c1 - centre));
    }
#else
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u), vc = _mm512_set1_epi32(centre);
    for (int i = 0; i < n; i += 16) {
        const __m512 f0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(amx_codes16(r0, i, bits), vc));
        const __m512 f1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(amx_codes16(r1, i, bits), vc));
        const __m512i w = _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(f0), 16),
                                          _mm512_and_si512(_mm512_castps_si512(f1), top));
        _mm512_storeu_si512(out + 2 * i, w);
    }
#endif
}

/* One step of a product: C_j += (A_hi + A_lo) . B_j for j < nb (tiles
 * 0..3 hold C, 4 and 6 the two halves of A; B_j at b + j * 32 bytes goes
 * to tile 5 or 7 in turn, so that a load need not wait for the previous
 * product to have read its tile: tile registers are not renamed). */
#define DP_COL(J, T)                                   \
    do {                                               \
        AMX_LOAD(T, b + 32 * (J), bstride);            \
        AMX_DPBF16PS(J, 4, T);                         \
        AMX_DPBF16PS(J, 6, T);                         \
    } while (0)
static inline void amx_dp_cols(int nb, const uint16_t *b, long bstride)
{
    DP_COL(0, 5);
    if (nb > 1) DP_COL(1, 7);
    if (nb > 2) DP_COL(2, 5);
    if (nb > 3) DP_COL(3, 7);
}
#undef DP_COL

/* The same with A = A_hi alone, in tile A (4 or 6) (amx_product16's
 * locals bk, bstride and nb). */
#define DP1_COL(J, A, T)                               \
    do {                                               \
        AMX_LOAD(T, bk + 32 * (J), bstride);           \
        AMX_DPBF16PS(J, A, T);                         \
    } while (0)
#define DP1_COLS(A)                                    \
    do {                                               \
        DP1_COL(0, A, 5);                              \
        if (nb > 1) DP1_COL(1, A, 7);                  \
        if (nb > 2) DP1_COL(2, A, 5);                  \
        if (nb > 3) DP1_COL(3, A, 7);                  \
    } while (0)

static inline void amx_zero_cols(int nb)
{
    AMX_ZERO(0);
    if (nb > 1) AMX_ZERO(1);
    if (nb > 2) AMX_ZERO(2);
    if (nb > 3) AMX_ZERO(3);
}

static inline void amx_store_cols(int nb, float *c, long stride)
{
    AMX_STORE(0, c, stride);
    if (nb > 1) AMX_STORE(1, c + 16, stride);
    if (nb > 2) AMX_STORE(2, c + 32, stride);
    if (nb > 3) AMX_STORE(3, c + 48, stride);
}

/* out[16][N] = (A_hi + A_lo)[16][K] . B: A's halves bf16 rows of K
 * (stride lda elements; alo NULL: A = A_hi alone), B in the VNNI layout
 * [K / 2][N][2]; K % 32 == 0, N % 16 == 0; out fp32, stride ldo floats.
 * Tiles configured by amx_config_16x64. */
static inline void amx_product16(const uint16_t *ahi, const uint16_t *alo, int lda, int K,
                                 const uint16_t *b, int N, float *out, int ldo)
{
    for (int c0 = 0; c0 < N; c0 += 64) {
        const int nb = (N - c0) / 16 < 4 ? (N - c0) / 16 : 4;
        amx_zero_cols(nb);
        for (int k0 = 0; k0 < K; k0 += 32) {
            const uint16_t *bk = b + ((size_t)(k0 / 2) * N + c0) * 2;
            if (alo) {
                AMX_LOAD(4, ahi + k0, (long)lda * 2);
                AMX_LOAD(6, alo + k0, (long)lda * 2);
                amx_dp_cols(nb, bk, (long)N * 4);
            } else {
                /* A alone: in tile 4 and 6 in turn, as B above */
                const long bstride = (long)N * 4;
                if ((k0 / 32) % 2 == 0) {
                    AMX_LOAD(4, ahi + k0, (long)lda * 2);
                    DP1_COLS(4);
                } else {
                    AMX_LOAD(6, ahi + k0, (long)lda * 2);
                    DP1_COLS(6);
                }
            }
        }
        amx_store_cols(nb, out + c0, (long)ldo * 4);
    }
}
#undef DP1_COLS
#undef DP1_COL

#endif
