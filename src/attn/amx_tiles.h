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

/* Tiles 0..6 as 16 rows x 64 bytes. */
static inline void amx_config_16x64(amx_tilecfg *c)
{
    memset(c, 0, sizeof *c);
    c->palette = 1;
    for (int i = 0; i < 7; i++) {
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

/* One step of a product: C_j += (A_hi + A_lo) . B_j for j < nb (tiles
 * 0..3 hold C, 4 and 6 the two halves of A, 5 the B being multiplied);
 * B_j at b + j * 32 bytes. */
#define DP_COL(J)                                      \
    do {                                               \
        AMX_LOAD(5, b + 32 * (J), bstride);            \
        AMX_DPBF16PS(J, 4, 5);                         \
        AMX_DPBF16PS(J, 6, 5);                         \
    } while (0)
static inline void amx_dp_cols(int nb, const uint16_t *b, long bstride)
{
    DP_COL(0);
    if (nb > 1) DP_COL(1);
    if (nb > 2) DP_COL(2);
    if (nb > 3) DP_COL(3);
}
#undef DP_COL

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
 * (stride K), B in the VNNI layout [K / 2][N][2]; K % 32 == 0, N % 16 ==
 * 0; out fp32, stride N. Tiles configured by amx_config_16x64. */
static inline void amx_product16(const uint16_t *ahi, const uint16_t *alo, int K,
                                 const uint16_t *b, int N, float *out)
{
    for (int c0 = 0; c0 < N; c0 += 64) {
        const int nb = (N - c0) / 16 < 4 ? (N - c0) / 16 : 4;
        amx_zero_cols(nb);
        for (int k0 = 0; k0 < K; k0 += 32) {
            AMX_LOAD(4, ahi + k0, (long)K * 2);
            AMX_LOAD(6, alo + k0, (long)K * 2);
            amx_dp_cols(nb, b + ((size_t)(k0 / 2) * N + c0) * 2, (long)N * 4);
        }
        amx_store_cols(nb, out + c0, (long)N * 4);
    }
}

#endif
